#include "zinf/partition/sub_group.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "partition/reference.h"
#include "testing/status_matchers.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"

namespace zinf::partition {
namespace {

using testing::BuildReference;
using ::testing::ElementsAre;
using testing::ExpectFragmentsMatchReference;
using ::testing::HasSubstr;
using testing::RandomLayout;
using testing::RandomOptions;
using testing::ReferencePlan;
using testing::Uniform;
using zinf::testing::StatusIs;

ParamLayout MakeLayout(std::vector<ParamSpec> specs) {
  auto layout = ParamLayout::Create(std::move(specs));
  EXPECT_TRUE(layout.has_value()) << layout.error().ToString();
  return std::move(*layout);
}

// The sub-group's fragments, as plan fragments with partition offsets.
std::vector<Fragment> AsPlanFragments(const SubGroup& group, int world_rank) {
  std::vector<Fragment> out;
  for (const SubGroupFragment& f : group.fragments) {
    out.push_back(Fragment{world_rank, f.param_index, f.param_offset, f.flat_offset,
                           group.partition_offset + f.sub_group_offset, f.numel});
  }
  return out;
}

// Checks the gradient split of one sub-group element by element.
void ExpectSplitTilesFragments(const SubGroup& group, std::uint64_t alignment,
                               std::uint64_t min_swap_numel) {
  ZINF_ASSERT_OK_AND_ASSIGN(GradientSwapSplit split,
                            SplitGradientForSwap(group, alignment, min_swap_numel));
  // 0: padding, 1: fragment not yet covered, 2: covered by a piece.
  std::vector<std::uint8_t> state(group.numel, 0);
  std::vector<std::size_t> param_of(group.numel, 0);
  for (const SubGroupFragment& f : group.fragments) {
    for (std::uint64_t k = 0; k < f.numel; ++k) {
      state[f.sub_group_offset + k] = 1;
      param_of[f.sub_group_offset + k] = f.param_index;
    }
  }
  auto cover = [&](const GradientPiece& piece) {
    ASSERT_GT(piece.numel, 0u);
    for (std::uint64_t k = 0; k < piece.numel; ++k) {
      ASSERT_EQ(state[piece.sub_group_offset + k], 1) << "piece covers padding or overlaps";
      ASSERT_EQ(param_of[piece.sub_group_offset + k], piece.param_index);
      state[piece.sub_group_offset + k] = 2;
    }
  };
  for (const GradientPiece& piece : split.swapped) {
    cover(piece);
    ASSERT_EQ(piece.sub_group_offset % alignment, 0u) << "swapped piece offset unaligned";
    ASSERT_EQ(piece.numel % alignment, 0u) << "swapped piece length unaligned";
    ASSERT_GE(piece.numel, min_swap_numel);
  }
  for (const GradientPiece& piece : split.unswapped) cover(piece);
  for (std::uint64_t k = 0; k < group.numel; ++k) ASSERT_NE(state[k], 1) << "element " << k;
  for (std::size_t i = 1; i < split.swapped.size(); ++i) {
    ASSERT_LT(split.swapped[i - 1].sub_group_offset, split.swapped[i].sub_group_offset);
  }
  for (std::size_t i = 1; i < split.unswapped.size(); ++i) {
    ASSERT_LT(split.unswapped[i - 1].sub_group_offset, split.unswapped[i].sub_group_offset);
  }
  // Fragments below the minimum stay in memory whole; an aligned fragment is split into a
  // swapped head and an in-memory remainder shorter than the alignment.
  for (const SubGroupFragment& f : group.fragments) {
    auto swapped =
        std::ranges::find(split.swapped, f.sub_group_offset, &GradientPiece::sub_group_offset);
    if (f.numel < min_swap_numel) {
      ASSERT_EQ(state[f.sub_group_offset], 2);
      ASSERT_EQ(swapped, split.swapped.end());
    }
    if (f.sub_group_offset % alignment == 0 && f.numel >= std::max(min_swap_numel, alignment) &&
        (f.numel / alignment) * alignment >= min_swap_numel && f.numel > 0) {
      ASSERT_NE(swapped, split.swapped.end());
      ASSERT_EQ(swapped->numel, (f.numel / alignment) * alignment);
    }
  }
}

TEST(SubGroupPlan, RandomSubGroupsTilePartitions) {
  std::mt19937_64 rng(4242);
  for (int iteration = 0; iteration < 1000 / testing::kRandomCaseDivisor; ++iteration) {
    const ParamLayout layout = RandomLayout(rng);
    const PlanOptions options = RandomOptions(rng);
    SCOPED_TRACE(::testing::Message()
                 << "iteration " << iteration << " kind " << PlanKindName(options.kind) << " world "
                 << options.world_size << " alignment " << options.alignment_elems);
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::Create(layout, options));
    const ReferencePlan ref = BuildReference(layout, options);
    const std::uint64_t alignment = options.alignment_elems;
    const std::uint64_t sub_group_size = Uniform(rng, 1, 3 * plan.partition_numel());
    const std::uint64_t expected_step = std::max(sub_group_size / alignment * alignment, alignment);
    // A few ranks per plan keep the test fast; ranks 0 and world - 1 always.
    for (int r :
         {0, options.world_size - 1, static_cast<int>(Uniform(rng, 0, options.world_size - 1))}) {
      ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan groups, SubGroupPlan::Create(plan, r, sub_group_size));
      ASSERT_EQ(groups.sub_group_numel(), expected_step);
      ASSERT_EQ(groups.world_rank(), r);
      std::uint64_t next = 0;
      std::uint64_t real = 0;
      for (std::size_t i = 0; i < groups.size(); ++i) {
        const SubGroup& group = groups.sub_group(i);
        ASSERT_EQ(group.index, i);
        ASSERT_EQ(group.partition_offset, next) << "sub-groups do not tile the partition";
        ASSERT_EQ(group.partition_offset % alignment, 0u);
        ASSERT_EQ(group.numel % alignment, 0u);
        ASSERT_GT(group.numel, 0u);
        ASSERT_LE(group.numel, expected_step);
        if (i + 1 < groups.size()) {
          ASSERT_EQ(group.numel, expected_step);
        }
        ASSERT_LE(group.numel, groups.max_sub_group_numel());
        ExpectFragmentsMatchReference(layout, ref, r, group.partition_offset,
                                      group.partition_offset + group.numel,
                                      AsPlanFragments(group, r));
        if (HasFatalFailure()) return;
        ASSERT_EQ(group.RealNumel() + group.PaddingNumel(), group.numel);
        real += group.RealNumel();
        next += group.numel;
        const std::uint64_t min_swap = Uniform(rng, 0, 1) == 0 ? Uniform(rng, 0, 64) : 262144;
        ExpectSplitTilesFragments(group, alignment, min_swap);
        if (HasFatalFailure()) return;
      }
      ASSERT_EQ(next, plan.partition_numel());
      ASSERT_EQ(real, plan.RealNumel(r));
    }
  }
}

TEST(SubGroupPlan, SizeIsRoundedDownToAlignment) {
  ParamLayout layout = MakeLayout({{"w", {10000}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 1, 1024));
  ASSERT_EQ(plan.partition_numel(), 10240u);
  ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan groups, SubGroupPlan::Create(plan, 0, 3000));
  EXPECT_EQ(groups.sub_group_numel(), 2048u);
  ASSERT_EQ(groups.size(), 5u);
  EXPECT_EQ(groups.sub_group(4).partition_offset, 8192u);
  EXPECT_EQ(groups.sub_group(4).numel, 2048u);
  EXPECT_EQ(groups.sub_group(4).PaddingNumel(), 240u);
  EXPECT_THAT(groups.sub_group(1).fragments, ElementsAre(SubGroupFragment{0, 2048, 2048, 0, 2048}));
  // Below one alignment unit a sub-group is one unit.
  ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan tiny, SubGroupPlan::Create(plan, 0, 100));
  EXPECT_EQ(tiny.sub_group_numel(), 1024u);
  EXPECT_EQ(tiny.size(), 10u);
}

TEST(SubGroupPlan, DefaultSizeIsDeepSpeeds) {
  EXPECT_EQ(kDefaultSubGroupSize, 1'000'000'000u);
  ParamLayout layout = MakeLayout({{"w", {50000, 50000}}});  // 2.5e9 elements
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 1, 1024));
  ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan groups, SubGroupPlan::Create(plan, 0));
  EXPECT_EQ(groups.sub_group_numel(), 999'999'488u);  // 1e9 rounded down to 1024
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups.max_sub_group_numel(), 999'999'488u);
  EXPECT_EQ(groups.sub_group(2).numel, plan.partition_numel() - 2 * 999'999'488u);
}

TEST(SubGroupPlan, SubGroupsOfAPaddingOnlyRankHaveNoFragments) {
  ParamLayout layout = MakeLayout({{"x", {3}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 4, 8));
  ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan groups, SubGroupPlan::Create(plan, 3, 8));
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_TRUE(groups.sub_group(0).fragments.empty());
  EXPECT_EQ(groups.sub_group(0).PaddingNumel(), 8u);
}

TEST(SubGroupPlan, LargePartitionsBeyond32Bits) {
  ParamLayout layout = MakeLayout({{"a", {100000, 30000}}, {"b", {77}}, {"c", {100000, 30000}}});
  ASSERT_GT(layout.total_numel(), std::uint64_t{1} << 32);
  for (PlanKind kind : {PlanKind::kFlat, PlanKind::kPerParam}) {
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan,
                              PartitionPlan::Create(layout, PlanOptions{kind, 3, 4096}));
    for (int r = 0; r < 3; ++r) {
      ZINF_ASSERT_OK_AND_ASSIGN(SubGroupPlan groups, SubGroupPlan::Create(plan, r, 100'000'000));
      std::uint64_t real = 0;
      std::uint64_t next = 0;
      for (const SubGroup& group : groups.sub_groups()) {
        ASSERT_EQ(group.partition_offset, next);
        ASSERT_EQ(group.partition_offset % 4096, 0u);
        next += group.numel;
        real += group.RealNumel();
        ZINF_ASSERT_OK_AND_ASSIGN(GradientSwapSplit split, SplitGradientForSwap(group, 4096));
        std::uint64_t pieces = 0;
        for (const GradientPiece& p : split.swapped) pieces += p.numel;
        for (const GradientPiece& p : split.unswapped) pieces += p.numel;
        ASSERT_EQ(pieces, group.RealNumel());
      }
      ASSERT_EQ(next, plan.partition_numel());
      ASSERT_EQ(real, plan.RealNumel(r));
    }
  }
}

TEST(SubGroupPlan, RejectsBadArguments) {
  ParamLayout layout = MakeLayout({{"x", {3}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 2, 1));
  EXPECT_THAT(SubGroupPlan::Create(plan, 0, 0),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("sub_group_size must be >= 1")));
  EXPECT_THAT(SubGroupPlan::Create(plan, 2),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("rank 2 outside a plan of 2")));
  EXPECT_THAT(SubGroupPlan::Create(plan, -1), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(SplitGradientForSwap(SubGroup{}, 0),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("alignment_elems must be >= 1")));
}

SubGroup MakeSubGroup(std::uint64_t numel, std::vector<SubGroupFragment> fragments) {
  SubGroup group;
  group.numel = numel;
  group.fragments = std::move(fragments);
  return group;
}

TEST(GradientSwapSplit, SmallFragmentsStayInMemory) {
  // 262144 fp32 elements = 1 MiB: the smallest fragment that is swapped.
  SubGroup group = MakeSubGroup(
      600'000,
      {{0, 0, 0, 0, 262'143}, {1, 0, 262'143, 262'143, 1}, {2, 0, 262'144, 262'144, 300'000}});
  ZINF_ASSERT_OK_AND_ASSIGN(GradientSwapSplit split, SplitGradientForSwap(group, 1024));
  // Fragment 2 starts aligned (256 * 1024): head of 292 * 1024 swapped, the rest in memory.
  EXPECT_THAT(split.swapped, ElementsAre(GradientPiece{2, 262'144, 299'008}));
  EXPECT_THAT(split.unswapped,
              ElementsAre(GradientPiece{0, 0, 262'143}, GradientPiece{1, 262'143, 1},
                          GradientPiece{2, 561'152, 992}));
}

TEST(GradientSwapSplit, UnalignedFragmentKeepsHeadAndTailInMemory) {
  SubGroup group = MakeSubGroup(4096, {{0, 0, 0, 0, 100}, {1, 0, 100, 100, 3000}});
  ZINF_ASSERT_OK_AND_ASSIGN(GradientSwapSplit split,
                            SplitGradientForSwap(group, 256, /*min_swap_numel=*/512));
  // Fragment 1 covers [100, 3100): aligned interior [256, 3072).
  EXPECT_THAT(split.swapped, ElementsAre(GradientPiece{1, 256, 2816}));
  EXPECT_THAT(split.unswapped, ElementsAre(GradientPiece{0, 0, 100}, GradientPiece{1, 100, 156},
                                           GradientPiece{1, 3072, 28}));
}

TEST(GradientSwapSplit, InteriorBelowTheMinimumStaysInMemory) {
  SubGroup group = MakeSubGroup(2048, {{0, 0, 0, 1, 1500}});
  ZINF_ASSERT_OK_AND_ASSIGN(GradientSwapSplit split,
                            SplitGradientForSwap(group, 1024, /*min_swap_numel=*/1000));
  // [1, 1501) has no whole aligned block of 1024: everything stays in memory.
  EXPECT_TRUE(split.swapped.empty());
  EXPECT_THAT(split.unswapped, ElementsAre(GradientPiece{0, 1, 1500}));
}

}  // namespace
}  // namespace zinf::partition
