#include "zinf/partition/reshard.h"

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

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::RandomLayout;
using testing::RandomOptions;
using zinf::testing::IsOk;
using zinf::testing::StatusIs;

constexpr std::uint64_t kPadding = ~std::uint64_t{0};

ParamLayout MakeLayout(std::vector<ParamSpec> specs) {
  auto layout = ParamLayout::Create(std::move(specs));
  EXPECT_TRUE(layout.has_value()) << layout.error().ToString();
  return std::move(*layout);
}

using Partitions = std::vector<std::vector<std::uint64_t>>;

// Every rank's partition filled from the brute-force reference: slot = flat index of its element,
// padding = kPadding.
Partitions ExpectedPartitions(const PartitionPlan& plan) {
  const testing::ReferencePlan ref = testing::BuildReference(plan.layout(), plan.options());
  Partitions out(plan.world_size(), std::vector<std::uint64_t>(plan.partition_numel(), kPadding));
  for (int r = 0; r < plan.world_size(); ++r) {
    for (const auto& [offset, flat] : ref.real_slots[r]) out[r][offset] = flat;
  }
  return out;
}

// Runs a reshard plan on simulated partitions: each destination element must be written exactly
// once and padding never.
Partitions Apply(const ReshardPlan& reshard, const Partitions& source) {
  const PartitionPlan& to = reshard.to();
  Partitions out(to.world_size(), std::vector<std::uint64_t>(to.partition_numel(), kPadding));
  for (int r = 0; r < to.world_size(); ++r) {
    std::uint64_t previous_end = 0;
    for (const ReshardCopy& copy : reshard.CopiesTo(r)) {
      EXPECT_GT(copy.numel, 0u);
      EXPECT_GE(copy.destination_offset, previous_end) << "copies out of order or overlapping";
      previous_end = copy.destination_offset + copy.numel;
      EXPECT_LE(previous_end, to.partition_numel());
      EXPECT_LE(copy.source_offset + copy.numel, reshard.from().partition_numel());
      const std::vector<std::uint64_t>& src = source.at(copy.source_rank);
      for (std::uint64_t k = 0; k < copy.numel; ++k) {
        std::uint64_t& slot = out[r][copy.destination_offset + k];
        if (src[copy.source_offset + k] != copy.flat_offset + k || slot != kPadding) {
          ADD_FAILURE() << "copy to rank " << r << " at " << copy.destination_offset + k
                        << ": source holds " << src[copy.source_offset + k] << ", flat offset "
                        << copy.flat_offset + k << ", destination already "
                        << (slot == kPadding ? "empty" : "written");
          return out;
        }
        slot = src[copy.source_offset + k];
      }
    }
  }
  return out;
}

// Random options whose partitions, padding included, hold at most 100k elements in all: the
// simulation below materialises every partition.
PlanOptions SmallOptions(const ParamLayout& layout, std::mt19937_64& rng) {
  while (true) {
    PlanOptions options = RandomOptions(rng);
    auto plan = PartitionPlan::Create(layout, options);
    if (plan.has_value() &&
        plan->partition_numel() * static_cast<std::uint64_t>(options.world_size) <= 100'000) {
      return options;
    }
  }
}

// Equality of simulated partitions that reports the first difference instead of dumping them.
::testing::AssertionResult SamePartitions(const Partitions& actual, const Partitions& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << actual.size() << " ranks vs " << expected.size();
  }
  for (std::size_t r = 0; r < actual.size(); ++r) {
    if (actual[r].size() != expected[r].size()) {
      return ::testing::AssertionFailure() << "rank " << r << ": partition of " << actual[r].size()
                                           << " vs " << expected[r].size();
    }
    for (std::size_t k = 0; k < actual[r].size(); ++k) {
      if (actual[r][k] != expected[r][k]) {
        return ::testing::AssertionFailure()
               << "rank " << r << " offset " << k << ": " << actual[r][k] << " vs "
               << expected[r][k] << " (" << kPadding << " is padding)";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(ReshardPlan, RandomReshardsMatchBruteForceAndRoundTrip) {
  std::mt19937_64 rng(777);
  for (int iteration = 0; iteration < 1000 / testing::kRandomCaseDivisor; ++iteration) {
    const ParamLayout layout = RandomLayout(rng);
    const PlanOptions from_options = SmallOptions(layout, rng);
    const PlanOptions to_options = SmallOptions(layout, rng);
    SCOPED_TRACE(::testing::Message() << "iteration " << iteration);
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan from, PartitionPlan::Create(layout, from_options));
    // A separately parsed layout: plans need equal layouts, not the same object.
    ZINF_ASSERT_OK_AND_ASSIGN(ParamLayout copy, ParamLayout::FromJson(layout.ToJson()));
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan to, PartitionPlan::Create(copy, to_options));
    ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan forward, ReshardPlan::Create(from, to));
    ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan backward, ReshardPlan::Create(to, from));
    const Partitions source = ExpectedPartitions(from);
    const Partitions moved = Apply(forward, source);
    ASSERT_TRUE(SamePartitions(moved, ExpectedPartitions(to)));
    ASSERT_TRUE(SamePartitions(Apply(backward, moved), source)) << "N -> M -> N is not identity";
    // The flat ranges a restore reads give the same partitions.
    const Partitions& expected_to = moved;
    for (int r = 0; r < to.world_size(); ++r) {
      std::vector<std::uint64_t> restored(to.partition_numel(), kPadding);
      std::uint64_t previous_end = 0;
      for (const FlatRange& range : FlatRangesOfRank(to, r)) {
        ASSERT_GE(range.partition_offset, previous_end);
        previous_end = range.partition_offset + range.numel;
        for (std::uint64_t k = 0; k < range.numel; ++k) {
          restored[range.partition_offset + k] = range.flat_offset + k;
        }
      }
      ASSERT_TRUE(SamePartitions({restored}, {expected_to[r]})) << "rank " << r;
      if (to.kind() == PlanKind::kFlat) {
        ASSERT_LE(FlatRangesOfRank(to, r).size(), 1u);
      }
    }
  }
}

TEST(ReshardPlan, SamePlanIsOneCopyPerRank) {
  ParamLayout layout = MakeLayout({{"a", {100}}, {"b", {7, 3}}, {"c", {}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 3, 8));
  ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan identity, ReshardPlan::Create(plan, plan));
  // partition 48: rank 2 owns flat [96, 122).
  EXPECT_THAT(identity.CopiesTo(2), ElementsAre(ReshardCopy{2, 0, 96, 0, 26}));
  EXPECT_THAT(FlatRangesOfRank(plan, 2), ElementsAre(FlatRange{96, 0, 26}));
}

TEST(ReshardPlan, FourRanksToThreeFlat) {
  ParamLayout layout = MakeLayout({{"w", {24}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan four, PartitionPlan::CreateFlat(layout, 4, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan three, PartitionPlan::CreateFlat(layout, 3, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan reshard, ReshardPlan::Create(four, three));
  // Rank 1 of 3 owns [8, 16): [8, 12) from rank 1 of 4 (offset 2), [12, 16) from rank 2.
  EXPECT_THAT(reshard.CopiesTo(1),
              ElementsAre(ReshardCopy{1, 2, 8, 0, 4}, ReshardCopy{2, 0, 12, 4, 4}));
}

TEST(ReshardPlan, FlatToPerParam) {
  ParamLayout layout = MakeLayout({{"a", {6}}, {"b", {8}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan flat, PartitionPlan::CreateFlat(layout, 2, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan stage3, PartitionPlan::CreatePerParam(layout, 2, 4));
  ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan reshard, ReshardPlan::Create(flat, stage3));
  // Stage-3 rank 1 (shards of 4): a[4, 6) at partition 0, b[4, 8) = flat [10, 14) at 4.
  // Flat rank 0 owns flat [0, 7), rank 1 [7, 14).
  EXPECT_THAT(reshard.CopiesTo(1),
              ElementsAre(ReshardCopy{0, 4, 4, 0, 2}, ReshardCopy{1, 3, 10, 4, 4}));
  EXPECT_THAT(FlatRangesOfRank(stage3, 1), ElementsAre(FlatRange{4, 0, 2}, FlatRange{10, 4, 4}));
  ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan back, ReshardPlan::Create(stage3, flat));
  // Flat rank 1 [7, 14): a is done; b[1, 4) from stage-3 rank 0 (offset 4 + 1), b[4, 8) from 1.
  EXPECT_THAT(back.CopiesTo(1),
              ElementsAre(ReshardCopy{0, 5, 7, 0, 3}, ReshardCopy{1, 4, 10, 3, 4}));
}

TEST(ReshardPlan, LargeReshardsBeyond32BitsAreConsistent) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 64; ++i) specs.push_back({"l" + std::to_string(i), {1 << 13, (1 << 14) + i}});
  ParamLayout layout = MakeLayout(std::move(specs));
  ASSERT_GT(layout.total_numel(), std::uint64_t{1} << 33);
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan from, PartitionPlan::CreateFlat(layout, 8, 256));
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan to, PartitionPlan::CreatePerParam(layout, 3, 1024));
  ZINF_ASSERT_OK_AND_ASSIGN(ReshardPlan reshard, ReshardPlan::Create(from, to));
  std::uint64_t total = 0;
  for (int r = 0; r < to.world_size(); ++r) {
    std::uint64_t numel = 0;
    for (const ReshardCopy& copy : reshard.CopiesTo(r)) {
      // The copy's first and last elements are where both plans say they are.
      for (std::uint64_t k : {std::uint64_t{0}, copy.numel - 1}) {
        const std::uint64_t flat = copy.flat_offset + k;
        const std::size_t p = layout.ParamAtFlatOffset(flat);
        const std::uint64_t in_param = flat - layout.param(p).flat_offset;
        ElementOwner src = from.Locate(p, in_param);
        ElementOwner dst = to.Locate(p, in_param);
        ASSERT_EQ(src.world_rank, copy.source_rank);
        ASSERT_EQ(src.partition_offset, copy.source_offset + k);
        ASSERT_EQ(dst.world_rank, r);
        ASSERT_EQ(dst.partition_offset, copy.destination_offset + k);
      }
      numel += copy.numel;
    }
    ASSERT_EQ(numel, to.RealNumel(r));
    total += numel;
  }
  ASSERT_EQ(total, layout.total_numel());
}

TEST(ReshardPlan, RejectsDifferentLayouts) {
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan a,
                            PartitionPlan::CreateFlat(MakeLayout({{"w", {4}}, {"b", {2}}}), 2, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan b,
                            PartitionPlan::CreateFlat(MakeLayout({{"w", {4}}, {"b", {3}}}), 2, 1));
  EXPECT_THAT(ReshardPlan::Create(a, b),
              StatusIs(ErrorCode::kFailedPrecondition,
                       AllOf(HasSubstr("reshard plan: source and destination layouts differ"),
                             HasSubstr("parameter 'b' (index 1): shape [2] expected, [3]"))));
  // The working dtype does not matter to fp32 state.
  auto bf16 = ParamLayout::Create({{"w", {4}}, {"b", {2}}}, DType::kBFloat16);
  ASSERT_TRUE(bf16.has_value());
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan c, PartitionPlan::CreatePerParam(*bf16, 3, 2));
  EXPECT_THAT(ReshardPlan::Create(a, c), IsOk());
}

}  // namespace
}  // namespace zinf::partition
