// The file-system layer (storage/fs.h): planted symlinks are refused, FIFOs never block, reads
// are bounded, atomic writes leave the old or the new content, AtomicFile outputs appear only on
// Commit.
#include "zinf/storage/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"

namespace zinf::storage {
namespace {

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
  EXPECT_THAT(ReadSmallFile("/dev/zero", 100, Follow::kYes),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("character device")));
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
  ZINF_ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(dir.Join("new"), FileAccess::kCreateNew,
                                                  Follow::kNo, 0600));
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
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out));
    ZINF_ASSERT_OK(file.Write(std::as_bytes(std::span("partial", 7))));
    EXPECT_TRUE(Exists(file.temp_path()));
    EXPECT_EQ(ReadText(out), "previous");
    // Dropped without Commit: a failed writer.
  }
  EXPECT_EQ(ReadText(out), "previous");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(AtomicFile file, AtomicFile::Create(out));
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
  EXPECT_THAT(AtomicFile::Create(dir.Join("missing/out")), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(AtomicFile::Create(""), StatusIs(ErrorCode::kInvalidArgument));
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
