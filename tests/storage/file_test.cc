#include "zinf/storage/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

OpenOptions Mode(OpenMode mode, bool direct = true) {
  OpenOptions options;
  options.mode = mode;
  options.direct = direct;
  return options;
}

TEST(FileTest, OpenModes) {
  ScratchDir dir("file");
  const std::string path = dir.Join("a");
  EXPECT_THAT(File::Open(path, Mode(OpenMode::kRead)),
              StatusIs(ErrorCode::kNotFound, HasSubstr(path)));
  EXPECT_THAT(File::Open(path, Mode(OpenMode::kReadWrite)), StatusIs(ErrorCode::kNotFound));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(path, Mode(OpenMode::kCreate)));
    EXPECT_TRUE(file.is_open());
    EXPECT_TRUE(file.writable());
    EXPECT_EQ(file.path(), path);
    struct stat st {};
    ASSERT_EQ(::fstat(file.fd(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_NE(::fcntl(file.fd(), F_GETFD) & FD_CLOEXEC, 0);
    ZINF_EXPECT_OK(file.Close());
    EXPECT_FALSE(file.is_open());
    ZINF_EXPECT_OK(file.Close());  // closing twice is fine
  }
  EXPECT_THAT(File::Open(path, Mode(OpenMode::kCreate)),
              StatusIs(ErrorCode::kAlreadyExists, HasSubstr(path)));
  ZINF_ASSERT_OK_AND_ASSIGN(File again, File::Open(path, Mode(OpenMode::kCreateOrOpen)));
  ZINF_ASSERT_OK_AND_ASSIGN(File read_only, File::Open(path, Mode(OpenMode::kRead)));
  EXPECT_FALSE(read_only.writable());
  ZINF_ASSERT_OK_AND_ASSIGN(File read_write, File::Open(path, Mode(OpenMode::kReadWrite)));
  EXPECT_TRUE(read_write.writable());
  ZINF_ASSERT_OK_AND_ASSIGN(File created, File::Open(dir.Join("b"), Mode(OpenMode::kCreateOrOpen)));
  EXPECT_TRUE(created.is_open());
}

TEST(FileTest, DirectOnScratchDiskUsesFileSystemAlignment) {
  ScratchDir dir("file");
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir.Join("d"), Mode(OpenMode::kCreate)));
  if (!file.direct()) ZINF_SKIP_MISSING("odirect", dir.path() << " has no O_DIRECT");
  EXPECT_NE(::fcntl(file.fd(), F_GETFL) & O_DIRECT, 0);
  EXPECT_GE(file.alignment(), 512u);
  EXPECT_EQ(file.alignment() & (file.alignment() - 1), 0u);
  ZINF_ASSERT_OK_AND_ASSIGN(File buffered,
                            File::Open(dir.Join("e"), Mode(OpenMode::kCreate, /*direct=*/false)));
  EXPECT_FALSE(buffered.direct());
  EXPECT_EQ(buffered.alignment(), 1u);
  EXPECT_EQ(::fcntl(buffered.fd(), F_GETFL) & O_DIRECT, 0);
}

TEST(FileTest, SymlinkIsRefused) {
  ScratchDir dir("file");
  ZINF_ASSERT_OK_AND_ASSIGN(File target, File::Open(dir.Join("target"), Mode(OpenMode::kCreate)));
  ASSERT_EQ(::symlink(dir.Join("target").c_str(), dir.Join("link").c_str()), 0);
  EXPECT_THAT(File::Open(dir.Join("link"), Mode(OpenMode::kReadWrite)),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("refusing symlink")));
  OpenOptions follow = Mode(OpenMode::kReadWrite);
  follow.no_follow = false;
  ZINF_EXPECT_OK(File::Open(dir.Join("link"), follow));
}

TEST(FileTest, DirectoryIsRefused) {
  ScratchDir dir("file");
  EXPECT_THAT(File::Open(dir.path(), Mode(OpenMode::kRead)),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a regular file")));
}

TEST(FileTest, AllocateTruncateSizeSync) {
  ScratchDir dir("file");
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir.Join("s"), Mode(OpenMode::kCreate)));
  ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t size, file.Size());
  EXPECT_EQ(size, 0u);
  ZINF_ASSERT_OK(file.Allocate(0, 1 << 20));
  ZINF_ASSERT_OK_AND_ASSIGN(size, file.Size());
  EXPECT_EQ(size, 1u << 20);
  struct stat st {};
  ASSERT_EQ(::fstat(file.fd(), &st), 0);
  EXPECT_GE(static_cast<std::uint64_t>(st.st_blocks) * 512, 1u << 20);
  ZINF_ASSERT_OK(file.Truncate(4096));
  ZINF_ASSERT_OK_AND_ASSIGN(size, file.Size());
  EXPECT_EQ(size, 4096u);
  ZINF_EXPECT_OK(file.Sync());
  ZINF_EXPECT_OK(file.Allocate(0, 0));
}

TEST(FileTest, MoveTransfersTheDescriptor) {
  ScratchDir dir("file");
  ZINF_ASSERT_OK_AND_ASSIGN(File a, File::Open(dir.Join("m"), Mode(OpenMode::kCreate)));
  const int fd = a.fd();
  File b(std::move(a));
  EXPECT_FALSE(a.is_open());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(b.fd(), fd);
  File c;
  c = std::move(b);
  EXPECT_EQ(c.fd(), fd);
  EXPECT_FALSE(b.is_open());  // NOLINT(bugprone-use-after-move)
  EXPECT_NE(::fcntl(fd, F_GETFD), -1);
}

TEST(ProbeDirectIoTest, ScratchDirectory) {
  ScratchDir dir("probe");
  ZINF_ASSERT_OK_AND_ASSIGN(DirectIoInfo info, ProbeDirectIo(dir.path()));
  EXPECT_THAT(info.source, ::testing::AnyOf("statx", "logical_block_size", "default"));
  EXPECT_GE(info.memory_alignment, 1u);
  EXPECT_GE(info.offset_alignment, 1u);
  // Nothing is left behind.
  EXPECT_EQ(::rmdir(dir.path().c_str()), 0);
  ::mkdir(dir.path().c_str(), 0700);
  if (info.direct_supported) {
    ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir.Join("x"), Mode(OpenMode::kCreate)));
    EXPECT_TRUE(file.direct());
    EXPECT_EQ(file.alignment(), std::max(info.memory_alignment, info.offset_alignment));
  }
}

TEST(ProbeDirectIoTest, Errors) {
  ScratchDir dir("probe");
  EXPECT_THAT(ProbeDirectIo(dir.Join("missing")), StatusIs(ErrorCode::kNotFound));
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir.Join("f"), Mode(OpenMode::kCreate)));
  EXPECT_THAT(ProbeDirectIo(dir.Join("f")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a directory")));
}

}  // namespace
}  // namespace zinf::storage
