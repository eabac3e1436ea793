#include "zinf/swapper/buffer_pool.h"

#include <cstdint>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf::swapper {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

TEST(BufferPool, BudgetDecidesTheBufferCount) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto pool, BufferPool::Create({.budget_bytes = 10 * 4096 + 100,
                                                           .buffer_bytes = 4000}));
  EXPECT_EQ(pool->buffer_bytes(), 4096u);
  EXPECT_EQ(pool->buffer_count(), 10u);
  EXPECT_EQ(pool->free_count(), 10u);
  EXPECT_EQ(pool->total_bytes(), 10u * 4096);
}

TEST(BufferPool, BufferCountWithoutBudget) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto pool, BufferPool::Create({.buffer_count = 3,
                                                           .buffer_bytes = 8192}));
  EXPECT_EQ(pool->buffer_count(), 3u);
  EXPECT_EQ(pool->budget_bytes(), 3u * 8192);
}

TEST(BufferPool, LeasesReturnTheirBuffers) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto pool, BufferPool::Create({.buffer_count = 4,
                                                           .buffer_bytes = 4096}));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(PoolLease a, pool->Allocate(1024, 3));
    EXPECT_EQ(a.size(), 3u);
    EXPECT_EQ(pool->free_count(), 1u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.bytes(0).data()) % 4096, 0u);
    EXPECT_NE(a.bytes(0).data(), a.bytes(1).data());
    EXPECT_EQ(a.floats(2).size(), 1024u);
    PoolLease b = std::move(a);
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(pool->free_count(), 1u);
    pool->Free(b);
    EXPECT_EQ(pool->free_count(), 4u);
    ZINF_ASSERT_OK_AND_ASSIGN(PoolLease all, pool->AllocateAll(10));
    EXPECT_EQ(all.size(), 4u);
    EXPECT_EQ(pool->free_count(), 0u);
  }
  EXPECT_EQ(pool->free_count(), 4u);
}

TEST(BufferPool, ExhaustionNamesWhatWasAskedAndTheBudget) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto pool, BufferPool::Create({.budget_bytes = 3 * 4096,
                                                           .buffer_bytes = 4096}));
  ZINF_ASSERT_OK_AND_ASSIGN(PoolLease held, pool->Allocate(1, 1));
  EXPECT_THAT(pool->Allocate(1024, 4),
              StatusIs(ErrorCode::kResourceExhausted,
                       "swap buffer pool: asked for 4 buffers of 4096 bytes, the pool has 2 free "
                       "of 3 (budget 12288 = 12.00 KiB); raise zinf.pinned_budget_bytes to at "
                       "least 20480 (20.00 KiB)"));
  ZINF_ASSERT_OK_AND_ASSIGN(PoolLease rest, pool->AllocateAll(1));
  EXPECT_EQ(rest.size(), 2u);
  EXPECT_THAT(pool->AllocateAll(1),
              StatusIs(ErrorCode::kResourceExhausted, HasSubstr("asked for 1 buffers")));
}

TEST(BufferPool, RejectsBadSizes) {
  EXPECT_THAT(BufferPool::Create({.budget_bytes = 1000, .buffer_bytes = 4096}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("holds no swap buffer of 4.00 KiB")));
  EXPECT_THAT(BufferPool::Create({.buffer_bytes = 0}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(BufferPool::Create({.buffer_bytes = 4096, .alignment = 3000}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("power of two")));
  ZINF_ASSERT_OK_AND_ASSIGN(auto pool, BufferPool::Create({.buffer_count = 1,
                                                           .buffer_bytes = 4096}));
  EXPECT_THAT(pool->Allocate(1025, 1), StatusIs(ErrorCode::kInvalidArgument,
                                                HasSubstr("1025 elements")));
  EXPECT_THAT(pool->Allocate(1, 0), StatusIs(ErrorCode::kInvalidArgument));
}

}  // namespace
}  // namespace zinf::swapper
