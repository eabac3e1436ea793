#include "zinf/partition/plan.h"

#include <cstdint>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "partition/reference.h"
#include "testing/status_matchers.h"
#include "zinf/partition/layout.h"

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
using zinf::testing::IsOk;
using zinf::testing::StatusIs;

ParamLayout MakeLayout(std::vector<ParamSpec> specs) {
  auto layout = ParamLayout::Create(std::move(specs));
  EXPECT_TRUE(layout.has_value()) << layout.error().ToString();
  return std::move(*layout);
}

// Checks a plan against the brute-force reference for every rank and every parameter.
void ExpectPlanMatchesReference(const PartitionPlan& plan, std::mt19937_64& rng) {
  const ParamLayout& layout = plan.layout();
  const ReferencePlan ref = BuildReference(layout, plan.options());
  ASSERT_EQ(plan.partition_numel(), ref.partition_numel);
  ASSERT_EQ(plan.partition_numel() % plan.alignment_elems(), 0u);
  std::uint64_t real_total = 0;
  for (int r = 0; r < plan.world_size(); ++r) {
    const std::vector<Fragment> fragments = plan.RankFragments(r);
    ExpectFragmentsMatchReference(layout, ref, r, 0, plan.partition_numel(), fragments);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_EQ(plan.RealNumel(r), ref.real_slots[r].size());
    ASSERT_EQ(plan.PaddingNumel(r), plan.partition_numel() - ref.real_slots[r].size());
    real_total += plan.RealNumel(r);
    // A random sub-range, as sub-groups ask for.
    const std::uint64_t a = Uniform(rng, 0, plan.partition_numel());
    const std::uint64_t b = Uniform(rng, 0, plan.partition_numel());
    const std::uint64_t lo = std::min(a, b);
    const std::uint64_t hi = std::max(a, b);
    ExpectFragmentsMatchReference(layout, ref, r, lo, hi,
                                  plan.FragmentsInPartitionRange(r, lo, hi - lo));
    if (::testing::Test::HasFatalFailure()) return;
  }
  ASSERT_EQ(real_total, layout.total_numel()) << "every element is owned exactly once";
  // Inverse lookup: the fragments of a parameter tile it and agree with the owner of every
  // element.
  for (std::size_t p = 0; p < layout.num_params(); ++p) {
    const ParamInfo& info = layout.param(p);
    std::uint64_t next = 0;
    for (const Fragment& f : plan.ParamFragments(p)) {
      ASSERT_EQ(f.param_index, p);
      ASSERT_EQ(f.param_offset, next) << "parameter " << p << " not tiled";
      ASSERT_GT(f.numel, 0u);
      ASSERT_EQ(f.flat_offset, info.flat_offset + f.param_offset);
      for (std::uint64_t k = 0; k < f.numel; ++k) {
        const testing::Slot& slot = ref.owner[f.flat_offset + k];
        if (slot.world_rank != f.world_rank || slot.partition_offset != f.partition_offset + k) {
          FAIL() << "parameter " << p << " element " << f.param_offset + k << ": reference rank "
                 << slot.world_rank << " offset " << slot.partition_offset << ", plan rank "
                 << f.world_rank << " offset " << f.partition_offset + k;
        }
      }
      next += f.numel;
    }
    ASSERT_EQ(next, info.numel);
  }
  if (plan.kind() == PlanKind::kFlat) {
    // Equal slices; only the last rank(s) are padded.
    bool seen_padding = false;
    for (int r = 0; r < plan.world_size(); ++r) {
      ASSERT_EQ(plan.PartitionFlatBegin(r), static_cast<std::uint64_t>(r) * plan.partition_numel());
      ASSERT_EQ(plan.PartitionFlatEnd(r) - plan.PartitionFlatBegin(r), plan.partition_numel());
      if (seen_padding) {
        ASSERT_EQ(plan.RealNumel(r), 0u);
      }
      if (plan.PaddingNumel(r) > 0) seen_padding = true;
    }
    ASSERT_LE(layout.total_numel(),
              static_cast<std::uint64_t>(plan.world_size()) * plan.partition_numel());
  }
}

TEST(PartitionPlan, RandomPlansMatchBruteForce) {
  std::mt19937_64 rng(20240601);
  for (int iteration = 0; iteration < 3000 / testing::kRandomCaseDivisor; ++iteration) {
    const ParamLayout layout = RandomLayout(rng);
    const PlanOptions options = RandomOptions(rng);
    SCOPED_TRACE(::testing::Message()
                 << "iteration " << iteration << " kind " << PlanKindName(options.kind) << " world "
                 << options.world_size << " alignment " << options.alignment_elems);
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::Create(layout, options));
    ExpectPlanMatchesReference(plan, rng);
    if (HasFatalFailure()) return;
  }
}

TEST(PartitionPlan, FlatSlicesAreEqualAndAligned) {
  ParamLayout layout = MakeLayout({{"a", {10}}, {"b", {3, 5}}, {"c", {}}});  // 26 elements
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreateFlat(layout, 4, 4));
  EXPECT_EQ(plan.partition_numel(), 8u);  // ceil(26 / 4) = 7 -> 8
  EXPECT_EQ(plan.RealNumel(0), 8u);
  EXPECT_EQ(plan.RealNumel(3), 2u);
  EXPECT_EQ(plan.PaddingNumel(3), 6u);
  // Rank 1 owns flat [8, 16): the last 2 elements of a and the first 6 of b.
  EXPECT_THAT(plan.RankFragments(1),
              ElementsAre(Fragment{1, 0, 8, 8, 0, 2}, Fragment{1, 1, 0, 10, 2, 6}));
  // b (flat [10, 25)) straddles ranks 1, 2 and 3.
  EXPECT_THAT(plan.ParamFragments(1),
              ElementsAre(Fragment{1, 1, 0, 10, 2, 6}, Fragment{2, 1, 6, 16, 0, 8},
                          Fragment{3, 1, 14, 24, 0, 1}));
  ElementOwner owner = plan.Locate(1, 7);
  EXPECT_EQ(owner.world_rank, 2);
  EXPECT_EQ(owner.partition_offset, 1u);
  EXPECT_EQ(owner.run_numel, 7u);
}

TEST(PartitionPlan, PerParamShardsAreConcatenated) {
  ParamLayout layout = MakeLayout({{"a", {10}}, {"b", {3}}, {"c", {}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan, PartitionPlan::CreatePerParam(layout, 4, 2));
  // Shards: a: ceil(10/4)=3 -> 4; b: 1 -> 2; c: 1 -> 2.
  EXPECT_EQ(plan.ShardNumel(0), 4u);
  EXPECT_EQ(plan.ShardNumel(1), 2u);
  EXPECT_EQ(plan.ShardPartitionOffset(2), 6u);
  EXPECT_EQ(plan.partition_numel(), 8u);
  EXPECT_THAT(plan.RankFragments(0),
              ElementsAre(Fragment{0, 0, 0, 0, 0, 4}, Fragment{0, 1, 0, 10, 4, 2},
                          Fragment{0, 2, 0, 13, 6, 1}));
  EXPECT_THAT(plan.RankFragments(1),
              ElementsAre(Fragment{1, 0, 4, 4, 0, 4}, Fragment{1, 1, 2, 12, 4, 1}));
  EXPECT_THAT(plan.RankFragments(2), ElementsAre(Fragment{2, 0, 8, 8, 0, 2}));
  EXPECT_TRUE(plan.RankFragments(3).empty());
  EXPECT_EQ(plan.RealNumel(3), 0u);
  EXPECT_EQ(plan.RealNumel(0) + plan.RealNumel(1) + plan.RealNumel(2), 14u);
}

TEST(PartitionPlan, FewerElementsThanRanksLeavesRanksWithOnlyPadding) {
  ParamLayout layout = MakeLayout({{"x", {3}}});
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan unaligned, PartitionPlan::CreateFlat(layout, 8, 1));
  EXPECT_EQ(unaligned.partition_numel(), 1u);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(unaligned.RealNumel(r), r < 3 ? 1u : 0u) << r;
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan aligned, PartitionPlan::CreateFlat(layout, 8, 4));
  EXPECT_EQ(aligned.partition_numel(), 4u);
  EXPECT_EQ(aligned.RealNumel(0), 3u);
  for (int r = 1; r < 8; ++r) {
    EXPECT_EQ(aligned.RealNumel(r), 0u);
    EXPECT_TRUE(aligned.RankFragments(r).empty());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan stage3, PartitionPlan::CreatePerParam(layout, 8, 4));
  EXPECT_EQ(stage3.partition_numel(), 4u);
  EXPECT_EQ(stage3.RealNumel(0), 3u);
  EXPECT_EQ(stage3.RealNumel(7), 0u);
}

TEST(PartitionPlan, OneElementParametersOnManyRanks) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 100; ++i) specs.push_back({"p" + std::to_string(i), {1}});
  ParamLayout layout = MakeLayout(std::move(specs));
  std::mt19937_64 rng(7);
  for (int world : {1, 3, 64}) {
    for (PlanKind kind : {PlanKind::kFlat, PlanKind::kPerParam}) {
      ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan,
                                PartitionPlan::Create(layout, PlanOptions{kind, world, 256}));
      ExpectPlanMatchesReference(plan, rng);
    }
  }
}

// Invariants checked by arithmetic (no per-element reference) for plans too large to enumerate.
void ExpectLargePlanInvariants(const PartitionPlan& plan) {
  const ParamLayout& layout = plan.layout();
  std::uint64_t real_total = 0;
  for (int r = 0; r < plan.world_size(); ++r) {
    std::uint64_t real = 0;
    std::uint64_t end = 0;
    for (const Fragment& f : plan.RankFragments(r)) {
      ASSERT_GE(f.partition_offset, end);
      ASSERT_EQ(f.flat_offset, layout.param(f.param_index).flat_offset + f.param_offset);
      ElementOwner owner = plan.Locate(f.param_index, f.param_offset);
      ASSERT_EQ(owner.world_rank, r);
      ASSERT_EQ(owner.partition_offset, f.partition_offset);
      ASSERT_EQ(owner.run_numel, f.numel);
      end = f.partition_offset + f.numel;
      real += f.numel;
    }
    ASSERT_LE(end, plan.partition_numel());
    ASSERT_EQ(real, plan.RealNumel(r));
    real_total += real;
  }
  ASSERT_EQ(real_total, layout.total_numel());
  for (std::size_t p = 0; p < layout.num_params(); ++p) {
    std::uint64_t next = 0;
    for (const Fragment& f : plan.ParamFragments(p)) {
      ASSERT_EQ(f.param_offset, next);
      next += f.numel;
    }
    ASSERT_EQ(next, layout.param(p).numel);
  }
}

TEST(PartitionPlan, OneHugeParameterBeyond32Bits) {
  ParamLayout layout = MakeLayout({{"huge", {1 << 20, 1 << 20}}, {"bias", {7}}});  // 2^40 + 7
  ASSERT_EQ(layout.total_numel(), (std::uint64_t{1} << 40) + 7);
  for (int world : {1, 7, 64}) {
    for (PlanKind kind : {PlanKind::kFlat, PlanKind::kPerParam}) {
      ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan,
                                PartitionPlan::Create(layout, PlanOptions{kind, world, 1024}));
      EXPECT_EQ(plan.partition_numel() % 1024, 0u);
      EXPECT_GE(plan.partition_numel() * static_cast<std::uint64_t>(world), layout.total_numel());
      ExpectLargePlanInvariants(plan);
    }
  }
}

TEST(PartitionPlan, ManyParametersBeyond32Bits) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 300; ++i) {
    specs.push_back({"layer" + std::to_string(i), {4096 + i, 4096 - i}});  // ~2^24 each
  }
  ParamLayout layout = MakeLayout(std::move(specs));
  ASSERT_GT(layout.total_numel(), std::uint64_t{1} << 32);
  for (int world : {5, 64}) {
    for (PlanKind kind : {PlanKind::kFlat, PlanKind::kPerParam}) {
      ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan,
                                PartitionPlan::Create(layout, PlanOptions{kind, world, 256}));
      ExpectLargePlanInvariants(plan);
    }
  }
}

TEST(PartitionPlan, RejectsBadOptions) {
  ParamLayout layout = MakeLayout({{"a", {4}}});
  EXPECT_THAT(PartitionPlan::CreateFlat(layout, 0, 1),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world_size 0 must be >= 1")));
  EXPECT_THAT(PartitionPlan::CreatePerParam(layout, -3, 1),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world_size -3")));
  EXPECT_THAT(PartitionPlan::CreateFlat(layout, 2, 0),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("alignment_elems must be >= 1")));
  EXPECT_THAT(PartitionPlan::Create(layout, PlanOptions{static_cast<PlanKind>(9), 1, 1}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("unknown kind 9")));
}

TEST(PartitionPlan, RejectsPlansThatOverflow) {
  ParamLayout layout = MakeLayout({{"big", {std::int64_t{1} << 62}}, {"b", {1}}});
  EXPECT_THAT(PartitionPlan::CreateFlat(layout, 3, std::uint64_t{1} << 62),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("exceed 2^63 - 1")));
  EXPECT_THAT(PartitionPlan::CreatePerParam(layout, 3, std::uint64_t{1} << 62),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("parameter 0 'big'")));
  EXPECT_THAT(PartitionPlan::CreateFlat(layout, 1, ~std::uint64_t{0}),
              StatusIs(ErrorCode::kInvalidArgument));
  // The largest plans that fit are accepted.
  EXPECT_THAT(PartitionPlan::CreateFlat(layout, 2, 1), IsOk());
  EXPECT_THAT(PartitionPlan::CreatePerParam(layout, 1, 1), IsOk());
}

TEST(PartitionPlan, KindsForZeroStages) {
  EXPECT_EQ(PlanKindForZeroStage(1).value(), PlanKind::kFlat);
  EXPECT_EQ(PlanKindForZeroStage(2).value(), PlanKind::kFlat);
  EXPECT_EQ(PlanKindForZeroStage(3).value(), PlanKind::kPerParam);
  EXPECT_THAT(PlanKindForZeroStage(0),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("ZeRO stage 0")));
  EXPECT_THAT(ParsePlanKind("stage3"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("stage3")));
  EXPECT_EQ(ParsePlanKind(PlanKindName(PlanKind::kPerParam)).value(), PlanKind::kPerParam);
}

TEST(PartitionPlan, JsonRoundTrip) {
  std::mt19937_64 rng(99);
  for (int i = 0; i < 50; ++i) {
    const ParamLayout layout = RandomLayout(rng);
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan plan,
                              PartitionPlan::Create(layout, RandomOptions(rng)));
    const nlohmann::json json = nlohmann::json::parse(plan.ToJson().dump());
    ZINF_ASSERT_OK_AND_ASSIGN(PartitionPlan parsed, PartitionPlan::FromJson(json));
    EXPECT_EQ(parsed.options(), plan.options());
    EXPECT_EQ(parsed.layout(), plan.layout());
    EXPECT_EQ(parsed.partition_numel(), plan.partition_numel());
  }
}

TEST(PartitionPlan, JsonErrorsAreInvalidArgument) {
  EXPECT_THAT(PlanOptions::FromJson(nlohmann::json::parse(R"({"kind":"flat","world_size":0,
                                                             "alignment_elems":1})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world_size 0")));
  EXPECT_THAT(PlanOptions::FromJson(nlohmann::json::parse(R"({"kind":"flat","world_size":4,
                                                             "alignment_elems":0})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("alignment_elems must be >= 1")));
  EXPECT_THAT(PlanOptions::FromJson(nlohmann::json::parse(R"({"kind":"zero3","world_size":4,
                                                             "alignment_elems":1})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'zero3'")));
  EXPECT_THAT(PlanOptions::FromJson(nlohmann::json::parse(R"({"kind":"flat","world_size":"4",
                                                             "alignment_elems":1})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'world_size'")));
  EXPECT_THAT(PlanOptions::FromJson(nlohmann::json::parse(R"({"kind":"flat",
                                      "world_size":4294967297, "alignment_elems":1})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world_size")));
  EXPECT_THAT(PartitionPlan::FromJson(nlohmann::json::parse(R"({"plan":{}})")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'layout'")));
}

}  // namespace
}  // namespace zinf::partition
