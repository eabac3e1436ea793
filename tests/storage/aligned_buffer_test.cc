#include "zinf/storage/aligned_buffer.h"

#include <sys/resource.h>

#include <cstdint>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf::storage {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::StatusIs;

BufferOptions Options(std::uint64_t alignment, bool lock = false) {
  BufferOptions options;
  options.alignment = alignment;
  options.lock = lock;
  options.register_cuda = false;
  return options;
}

TEST(AlignedBufferTest, AlignsAndRoundsUp) {
  for (std::uint64_t alignment : {1ull, 8ull, 512ull, 4096ull, 1ull << 21}) {
    for (std::uint64_t size : {1ull, 511ull, 4096ull, 10'000ull}) {
      ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer,
                                AlignedBuffer::Allocate(size, Options(alignment)));
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % alignment, 0u);
      EXPECT_EQ(buffer.size() % alignment, 0u);
      EXPECT_GE(buffer.size(), size);
      EXPECT_LT(buffer.size(), size + alignment);
      EXPECT_EQ(buffer.alignment(), alignment);
      for (std::byte b : buffer.span()) ASSERT_EQ(b, std::byte{0});
      EXPECT_EQ(buffer.as<float>().size(), buffer.size() / sizeof(float));
    }
  }
}

TEST(AlignedBufferTest, BadAlignmentIsInvalidArgument) {
  EXPECT_THAT(AlignedBuffer::Allocate(4096, Options(3000)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("3000")));
  EXPECT_THAT(AlignedBuffer::Allocate(4096, Options(0)), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(AlignedBufferTest, ZeroSizeIsEmpty) {
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, AlignedBuffer::Allocate(0, Options(4096)));
  EXPECT_TRUE(buffer.empty());
  EXPECT_EQ(buffer.size(), 0u);
}

TEST(AlignedBufferTest, MoveLeavesSourceEmpty) {
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer a, AlignedBuffer::Allocate(8192, Options(4096)));
  std::byte* data = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data(), data);
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer c, AlignedBuffer::Allocate(4096, Options(4096)));
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.size(), 8192u);
  EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move)
}

TEST(AlignedBufferTest, LockWithinLimit) {
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer,
                            AlignedBuffer::Allocate(64 * 1024, Options(4096, /*lock=*/true)));
  EXPECT_TRUE(buffer.locked());
}

TEST(AlignedBufferTest, LockBeyondMemlockIsResourceExhausted) {
  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &old_limit), 0);
  // Root (CAP_IPC_LOCK) ignores the limit, so the failure cannot be forced there.
  struct rlimit tiny = old_limit;
  tiny.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_MEMLOCK, &tiny), 0);
  auto buffer = AlignedBuffer::Allocate(16 << 20, Options(4096, /*lock=*/true));
  ASSERT_EQ(::setrlimit(RLIMIT_MEMLOCK, &old_limit), 0);
  if (buffer.has_value()) GTEST_SKIP() << "mlock ignores RLIMIT_MEMLOCK here (CAP_IPC_LOCK)";
  EXPECT_THAT(buffer, StatusIs(ErrorCode::kResourceExhausted,
                               ::testing::AllOf(HasSubstr("RLIMIT_MEMLOCK is 64.0 KiB"),
                                                HasSubstr("ulimit -l"))));
}

}  // namespace
}  // namespace zinf::storage

namespace zinf::storage {
namespace {

TEST(AlignedBufferTest, CudaRegistrationIsBestEffort) {
  // Default options ask for cudaHostRegister; without a CUDA build, a driver or a GPU the buffer
  // is still made, just not registered.
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, AlignedBuffer::Allocate(1 << 20, {}));
  EXPECT_FALSE(buffer.empty());
#if !defined(ZINF_WITH_CUDA)
  EXPECT_FALSE(buffer.cuda_registered());
#endif
  AlignedBuffer moved = std::move(buffer);
  EXPECT_EQ(moved.size(), 1u << 20);
}

}  // namespace
}  // namespace zinf::storage
