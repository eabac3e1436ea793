// The file-system layer (storage/fs.h): planted symlinks are refused, FIFOs never block, reads
// are bounded, atomic writes leave the old or the new content, AtomicFile outputs appear only on
// Commit, and no device, FIFO, socket or directory is ever opened, truncated or replaced (device
// nodes are made in a scratch directory, never the real /dev).
#include "zinf/storage/fs.h"

#include <fcntl.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"

namespace zinf::storage {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// A character device node (like /dev/null: 1, 3) made in a scratch directory, never the real
// /dev. False (and nothing made) without CAP_MKNOD.
bool MakeCharDevice(const std::string& path, unsigned major, unsigned minor) {
  return ::mknod(path.c_str(), S_IFCHR | 0666, makedev(major, minor)) == 0;
}

// The file type of `path` (not followed), for "still a device/FIFO afterwards".
mode_t TypeOf(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? (st.st_mode & S_IFMT) : 0;
}

// The names in `dir`, sorted: "nothing else appeared".
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A directory of everything an output must never replace or open: devices like /dev/null and
// /dev/full, a FIFO, a socket, a directory and a link to a device. The devices are left out
// (with a note) without CAP_MKNOD.
struct SpecialFiles {
  explicit SpecialFiles(const ScratchDir& dir) {
    auto add = [&](const std::string& name, bool made, std::string_view type, mode_t mode) {
      if (made) entries.push_back({name, dir.Join(name), std::string(type), mode});
    };
    add("null", MakeCharDevice(dir.Join("null"), 1, 3), "a character device", S_IFCHR);
    add("full", MakeCharDevice(dir.Join("full"), 1, 7), "a character device", S_IFCHR);
    add("fifo", ::mkfifo(dir.Join("fifo").c_str(), 0600) == 0, "a FIFO", S_IFIFO);
    add("subdir", ::mkdir(dir.Join("subdir").c_str(), 0700) == 0, "a directory", S_IFDIR);
    const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string sock_path = dir.Join("sock");
    if (sock >= 0 && sock_path.size() < sizeof(addr.sun_path)) {
      std::memcpy(addr.sun_path, sock_path.c_str(), sock_path.size() + 1);
      add("sock", ::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "a socket",
          S_IFSOCK);
    }
    if (sock >= 0) ::close(sock);
    if (TypeOf(dir.Join("null")) == S_IFCHR) {
      add("link-to-null", ::symlink("null", dir.Join("link-to-null").c_str()) == 0,
          "a symbolic link", S_IFLNK);
    }
  }
  struct Entry {
    std::string name;
    std::string path;
    std::string type;  // as the error names it
    mode_t mode;
  };
  std::vector<Entry> entries;
};

// Counts opens of one file (inotify IN_OPEN): an O_PATH look is not an open; a real open, even
// one refused right after by fstat, is.
class OpenWatch {
 public:
  explicit OpenWatch(const std::string& path) : fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) {
    ok_ = fd_.valid() && ::inotify_add_watch(fd_.get(), path.c_str(), IN_OPEN | IN_MODIFY) >= 0;
  }
  bool ok() const { return ok_; }
  bool Touched() {
    char buffer[4096];
    return ::read(fd_.get(), buffer, sizeof(buffer)) > 0;
  }

 private:
  UniqueFd fd_;
  bool ok_ = false;
};

TEST(UniqueFd, ClosesOnceAndMoves) {
  ScratchDir dir("fs");
  WriteText(dir.Join("a"), "x");
  UniqueFd fd(::open(dir.Join("a").c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  const int raw = fd.get();
  UniqueFd moved(std::move(fd));
  EXPECT_FALSE(fd.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is the point
  EXPECT_EQ(moved.get(), raw);
  ZINF_EXPECT_OK(moved.Close("a"));
  EXPECT_FALSE(moved.valid());
  ZINF_EXPECT_OK(moved.Close("a"));  // idempotent
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);
}

TEST(ReadSmallFile, ReadsBoundedRegularFiles) {
  ScratchDir dir("fs");
  WriteText(dir.Join("a"), "hello\n");
  ZINF_ASSERT_OK_AND_ASSIGN(std::string text, ReadSmallFile(dir.Join("a"), 100));
  EXPECT_EQ(text, "hello\n");
  EXPECT_THAT(ReadSmallFile(dir.Join("a"), 5),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("larger than 5 bytes")));
  EXPECT_THAT(ReadSmallFile(dir.Join("missing"), 100), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(ReadSmallFile(dir.path(), 100),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("a directory")));
}

TEST(ReadSmallFile, RefusesSymlinksUnlessAsked) {
  ScratchDir dir("fs");
  WriteText(dir.Join("target"), "secret");
  ASSERT_EQ(::symlink(dir.Join("target").c_str(), dir.Join("link").c_str()), 0);
  EXPECT_THAT(ReadSmallFile(dir.Join("link"), 100),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string text, ReadSmallFile(dir.Join("link"), 100, Follow::kYes));
  EXPECT_EQ(text, "secret");
}

TEST(ReadSmallFile, NeverBlocksOnAFifoOrDevice) {
  ScratchDir dir("fs");
  ASSERT_EQ(::mkfifo(dir.Join("fifo").c_str(), 0600), 0);
  // Without O_NONBLOCK this open would wait for a writer forever (the CTest timeout catches it).
  EXPECT_THAT(ReadSmallFile(dir.Join("fifo"), 100),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("a FIFO")));
  if (MakeCharDevice(dir.Join("zero"), 1, 5)) {
    EXPECT_THAT(ReadSmallFile(dir.Join("zero"), 100, Follow::kYes),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("character device")));
  }
  // A writer open of a FIFO without a reader fails at once too.
  EXPECT_THAT(OpenFile(dir.Join("fifo"), FileAccess::kTruncateOrCreate),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a regular file")));
}

TEST(OpenFileAt, CreateNewIsExclusiveAndNeverFollows) {
  ScratchDir dir("fs");
  WriteText(dir.Join("target"), "keep");
  ASSERT_EQ(::symlink(dir.Join("target").c_str(), dir.Join("link").c_str()), 0);
  EXPECT_THAT(OpenFile(dir.Join("link"), FileAccess::kCreateNew),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  EXPECT_THAT(OpenFile(dir.Join("target"), FileAccess::kCreateNew),
              StatusIs(ErrorCode::kAlreadyExists));
  EXPECT_THAT(OpenFile(dir.Join("link"), FileAccess::kTruncateOrCreate),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  EXPECT_EQ(ReadText(dir.Join("target")), "keep");
  ZINF_ASSERT_OK_AND_ASSIGN(UniqueFd fd,
                            OpenFile(dir.Join("new"), FileAccess::kCreateNew, Follow::kNo, 0600));
  ZINF_ASSERT_OK(WriteAll(fd.get(), std::string_view("abc"), "new"));
  ZINF_ASSERT_OK(fd.Close("new"));
  EXPECT_EQ(ReadText(dir.Join("new")), "abc");
  struct stat st {};
  ASSERT_EQ(::stat(dir.Join("new").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(OpenDirectoryAt, RefusesLinksAndFiles) {
  ScratchDir dir("fs");
  ASSERT_EQ(::mkdir(dir.Join("d").c_str(), 0700), 0);
  ASSERT_EQ(::symlink(dir.Join("d").c_str(), dir.Join("dlink").c_str()), 0);
  WriteText(dir.Join("f"), "");
  ZINF_ASSERT_OK_AND_ASSIGN(UniqueFd parent, OpenDirectory(dir.path()));
  ZINF_EXPECT_OK(OpenDirectoryAt(parent.get(), "d", dir.Join("d")));
  EXPECT_THAT(OpenDirectoryAt(parent.get(), "dlink", dir.Join("dlink")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  ZINF_EXPECT_OK(OpenDirectoryAt(parent.get(), "dlink", dir.Join("dlink"), Follow::kYes));
  EXPECT_THAT(OpenDirectoryAt(parent.get(), "f", dir.Join("f")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a directory")));
  EXPECT_THAT(OpenDirectoryAt(parent.get(), "none", dir.Join("none")),
              StatusIs(ErrorCode::kNotFound));
}

TEST(WriteFileAtomic, ReplacesAndNeverWritesThroughAPlantedTemporary) {
  ScratchDir dir("fs");
  const std::string path = dir.Join("latest");
  ZINF_ASSERT_OK(WriteFileAtomic(path, "one\n"));
  EXPECT_EQ(ReadText(path), "one\n");
  // A symlink planted at the temporary name is removed, not followed.
  WriteText(dir.Join("victim"), "precious");
  ASSERT_EQ(::symlink(dir.Join("victim").c_str(), dir.Join("latest.tmp").c_str()), 0);
  ZINF_ASSERT_OK(WriteFileAtomic(path, "two\n"));
  EXPECT_EQ(ReadText(path), "two\n");
  EXPECT_EQ(ReadText(dir.Join("victim")), "precious");
  EXPECT_FALSE(Exists(dir.Join("latest.tmp")));
  // A symlink at the final name is replaced by the file, its target untouched.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::symlink(dir.Join("victim").c_str(), path.c_str()), 0);
  ZINF_ASSERT_OK(WriteFileAtomic(path, "three\n"));
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(ReadText(path), "three\n");
  EXPECT_EQ(ReadText(dir.Join("victim")), "precious");
  EXPECT_THAT(WriteFileAtomic(dir.Join("nodir/x"), "x"), StatusIs(ErrorCode::kNotFound));
}

TEST(AtomicFile, AppearsOnlyOnCommit) {
  ScratchDir dir("fs");
  const std::string out = dir.Join("out.bin");
  WriteText(out, "previous");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out, Overwrite::kRegularFile));
    ZINF_ASSERT_OK(file.Write(std::as_bytes(std::span("partial", 7))));
    EXPECT_TRUE(Exists(file.temp_path()));
    EXPECT_EQ(ReadText(out), "previous");
    // Dropped without Commit: a failed writer.
  }
  EXPECT_EQ(ReadText(out), "previous");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out, Overwrite::kRegularFile));
    const std::string temp = file.temp_path();
    ZINF_ASSERT_OK(file.Write(std::as_bytes(std::span("complete", 8))));
    ZINF_ASSERT_OK(file.Commit());
    EXPECT_FALSE(Exists(temp));
    EXPECT_THAT(file.Commit(), StatusIs(ErrorCode::kFailedPrecondition));
  }
  EXPECT_EQ(ReadText(out), "complete");
  // Nothing but `out` is left in the directory.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
  EXPECT_THAT(AtomicFile::Create(dir.Join("missing/out"), Overwrite::kNo),
              StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(AtomicFile::Create("", Overwrite::kNo), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(OpenFileAt, NeverOpensNorTruncatesANonRegularFile) {
  ScratchDir dir("fs");
  SpecialFiles special(dir);
  for (const SpecialFiles::Entry& e : special.entries) {
    for (FileAccess access : {FileAccess::kRead, FileAccess::kReadWrite,
                              FileAccess::kAppendOrCreate, FileAccess::kTruncateOrCreate}) {
      for (Follow follow : {Follow::kNo, Follow::kYes}) {
        SCOPED_TRACE(e.name + (follow == Follow::kYes ? " (followed)" : ""));
        OpenWatch watch(e.path);
        ASSERT_TRUE(watch.ok()) << "inotify on " << e.path;
        // A link is named as such unless followed; then what it leads to is.
        const std::string type =
            e.mode == S_IFLNK && follow == Follow::kYes ? "a character device" : e.type;
        EXPECT_THAT(OpenFile(e.path, access, follow),
                    StatusIs(ErrorCode::kFailedPrecondition, HasSubstr(type)));
        EXPECT_EQ(TypeOf(e.path), e.mode);
        EXPECT_FALSE(watch.Touched()) << "opened " << e.path;
      }
    }
  }
  if (special.entries.size() < 6) std::printf("note: no CAP_MKNOD: devices not tested\n");
}

TEST(OpenFileAt, CreatesNeverThroughADanglingLink) {
  ScratchDir dir("fs");
  ASSERT_EQ(::symlink(dir.Join("target").c_str(), dir.Join("dangling").c_str()), 0);
  for (FileAccess access : {FileAccess::kAppendOrCreate, FileAccess::kTruncateOrCreate}) {
    EXPECT_THAT(OpenFile(dir.Join("dangling"), access, Follow::kYes),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  }
  EXPECT_FALSE(Exists(dir.Join("target")));
  // A missing name is created; a regular file (also through a link, when followed) truncated.
  ZINF_ASSERT_OK_AND_ASSIGN(
      UniqueFd fd, OpenFile(dir.Join("new"), FileAccess::kTruncateOrCreate, Follow::kNo, 0600));
  ZINF_ASSERT_OK(WriteAll(fd.get(), std::string_view("abc"), "new"));
  ZINF_ASSERT_OK(fd.Close("new"));
  ASSERT_EQ(::symlink("new", dir.Join("link").c_str()), 0);
  ZINF_ASSERT_OK_AND_ASSIGN(
      fd, OpenFile(dir.Join("link"), FileAccess::kTruncateOrCreate, Follow::kYes));
  ZINF_ASSERT_OK(fd.Close("link"));
  EXPECT_EQ(ReadText(dir.Join("new")), "");
  EXPECT_EQ(TypeOf(dir.Join("link")), static_cast<mode_t>(S_IFLNK));
}

TEST(AtomicFile, NeverReplacesNorOpensANonRegularFile) {
  ScratchDir dir("fs");
  SpecialFiles special(dir);
  const std::vector<std::string> before = Names(dir.path());
  for (const SpecialFiles::Entry& e : special.entries) {
    for (Overwrite overwrite : {Overwrite::kNo, Overwrite::kRegularFile}) {
      SCOPED_TRACE(e.name);
      OpenWatch watch(e.path);
      ASSERT_TRUE(watch.ok()) << "inotify on " << e.path;
      EXPECT_THAT(AtomicFile::Create(e.path, overwrite),
                  StatusIs(ErrorCode::kFailedPrecondition,
                           AllOf(HasSubstr(e.path), HasSubstr(e.type + ", not a regular file"))));
      EXPECT_EQ(TypeOf(e.path), e.mode);
      EXPECT_FALSE(watch.Touched()) << "opened " << e.path;
    }
  }
  EXPECT_EQ(Names(dir.path()), before);  // no temporary left, nothing replaced
}

TEST(AtomicFile, ReplacesAnExistingFileOnlyWhenAllowed) {
  ScratchDir dir("fs");
  const std::string out = dir.Join("out");
  WriteText(out, "precious");
  EXPECT_THAT(AtomicFile::Create(out, Overwrite::kNo),
              StatusIs(ErrorCode::kAlreadyExists, HasSubstr("exists")));
  EXPECT_EQ(ReadText(out), "precious");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out, Overwrite::kRegularFile));
    ZINF_ASSERT_OK(file.Write(std::as_bytes(std::span("new", 3))));
    ZINF_ASSERT_OK(file.Commit());
  }
  EXPECT_EQ(ReadText(out), "new");
  // What appears at the name while the output is written is never replaced either.
  const std::string late = dir.Join("late");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(late, Overwrite::kNo));
    WriteText(late, "someone else's");
    EXPECT_THAT(file.Commit(), StatusIs(ErrorCode::kAlreadyExists));
  }
  EXPECT_EQ(ReadText(late), "someone else's");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out, Overwrite::kRegularFile));
    ASSERT_EQ(::unlink(out.c_str()), 0);
    ASSERT_EQ(::mkfifo(out.c_str(), 0600), 0);
    EXPECT_THAT(file.Commit(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("a FIFO")));
  }
  EXPECT_EQ(TypeOf(out), static_cast<mode_t>(S_IFIFO));
  EXPECT_EQ(Names(dir.path()), (std::vector<std::string>{"late", "out"}));
}

TEST(WriteFileAtomic, RefusesANonRegularFileAtTheNameOrItsTemporary) {
  ScratchDir dir("fs");
  ASSERT_EQ(::mkfifo(dir.Join("latest").c_str(), 0600), 0);
  EXPECT_THAT(WriteFileAtomic(dir.Join("latest"), "x\n"),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("a FIFO, not a regular file")));
  EXPECT_EQ(TypeOf(dir.Join("latest")), static_cast<mode_t>(S_IFIFO));
  ASSERT_EQ(::mkdir(dir.Join("other.tmp").c_str(), 0700), 0);
  EXPECT_THAT(WriteFileAtomic(dir.Join("other"), "x\n"),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("a directory")));
  EXPECT_EQ(TypeOf(dir.Join("other.tmp")), static_cast<mode_t>(S_IFDIR));
  EXPECT_FALSE(Exists(dir.Join("other")));
}

TEST(CheckReplaceableAt, AcceptsOnlyNothingARegularFileOrALink) {
  ScratchDir dir("fs");
  SpecialFiles special(dir);
  WriteText(dir.Join("file"), "x");
  ZINF_ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenDirectory(dir.path()));
  ZINF_EXPECT_OK(CheckReplaceableAt(fd.get(), "missing", dir.Join("missing")));
  ZINF_EXPECT_OK(CheckReplaceableAt(fd.get(), "file", dir.Join("file")));
  for (const SpecialFiles::Entry& e : special.entries) {
    if (e.mode == S_IFLNK) {
      ZINF_EXPECT_OK(CheckReplaceableAt(fd.get(), e.name, e.path));
    } else {
      EXPECT_THAT(CheckReplaceableAt(fd.get(), e.name, e.path),
                  StatusIs(ErrorCode::kFailedPrecondition, HasSubstr(e.type)))
          << e.name;
    }
  }
}

TEST(SplitPath, NamesTheFile) {
  ZINF_ASSERT_OK_AND_ASSIGN(DirAndName a, SplitPath("/x/y/z.h5"));
  EXPECT_EQ(a.dir, "/x/y");
  EXPECT_EQ(a.name, "z.h5");
  ZINF_ASSERT_OK_AND_ASSIGN(DirAndName b, SplitPath("z.h5"));
  EXPECT_EQ(b.dir, ".");
  ZINF_ASSERT_OK_AND_ASSIGN(DirAndName c, SplitPath("/z//"));
  EXPECT_EQ(c.dir, "/");
  EXPECT_EQ(c.name, "z");
  EXPECT_THAT(SplitPath("/"), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(SplitPath("a/.."), StatusIs(ErrorCode::kInvalidArgument));
}

}  // namespace
}  // namespace zinf::storage
