// Test helpers for the partition tests: random layouts and plans from a seeded generator, and a
// brute-force element-by-element model of a plan written straight from the definitions in
// plan.h (independent of PartitionPlan's arithmetic).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"

namespace zinf::partition::testing {

// Randomized tests run this many times fewer cases in unoptimised (Debug, sanitizer) builds, so
// that those stay within a few seconds; optimised builds run them all.
#ifdef NDEBUG
inline constexpr int kRandomCaseDivisor = 1;
#else
inline constexpr int kRandomCaseDivisor = 6;
#endif

inline constexpr std::uint64_t kAlignments[] = {1, 2, 3, 4, 7, 128, 256, 1024};

inline std::uint64_t Uniform(std::mt19937_64& rng, std::uint64_t lo, std::uint64_t hi) {
  return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
}

// A random valid layout of at most ~2000 elements: 1..24 parameters, scalars, 1-element
// parameters, small matrices and now and then a larger vector.
inline ParamLayout RandomLayout(std::mt19937_64& rng) {
  const std::uint64_t count = Uniform(rng, 1, 24);
  std::vector<ParamSpec> specs;
  for (std::uint64_t i = 0; i < count; ++i) {
    ParamSpec spec;
    spec.name = fmt::format("layers.{}/w:{}", i, Uniform(rng, 0, 9));
    switch (Uniform(rng, 0, 5)) {
      case 0:
        break;  // scalar
      case 1:
        spec.shape = {1};
        break;
      case 2:
        spec.shape = {static_cast<std::int64_t>(Uniform(rng, 1, 1000))};
        break;
      default: {
        const std::uint64_t dims = Uniform(rng, 1, 3);
        for (std::uint64_t d = 0; d < dims; ++d) {
          spec.shape.push_back(static_cast<std::int64_t>(Uniform(rng, 1, dims == 1 ? 64 : 8)));
        }
      }
    }
    specs.push_back(std::move(spec));
  }
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  auto layout = ParamLayout::Create(std::move(specs), dtypes[Uniform(rng, 0, 2)]);
  EXPECT_TRUE(layout.has_value()) << layout.error().ToString();
  return std::move(*layout);
}

inline PlanOptions RandomOptions(std::mt19937_64& rng) {
  PlanOptions options;
  options.kind = Uniform(rng, 0, 1) == 0 ? PlanKind::kFlat : PlanKind::kPerParam;
  options.world_size = static_cast<int>(Uniform(rng, 1, 64));
  options.alignment_elems = kAlignments[Uniform(rng, 0, std::size(kAlignments) - 1)];
  return options;
}

inline std::uint64_t CeilDivRef(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }
inline std::uint64_t AlignUpRef(std::uint64_t a, std::uint64_t b) { return CeilDivRef(a, b) * b; }

// Where one real element lives.
struct Slot {
  int world_rank = -1;
  std::uint64_t partition_offset = 0;
};

// The brute-force model: the owner of every flat element, and for every rank its real slots in
// partition order as (partition offset, flat index) pairs (padding slots are the gaps). Built
// element by element from the definitions.
struct ReferencePlan {
  std::uint64_t partition_numel = 0;
  std::vector<Slot> owner;                                                       // by flat index
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> real_slots;  // [rank]
};

inline ReferencePlan BuildReference(const ParamLayout& layout, const PlanOptions& options) {
  ReferencePlan ref;
  const auto world = static_cast<std::uint64_t>(options.world_size);
  const std::uint64_t align = options.alignment_elems;
  ref.owner.resize(layout.total_numel());
  ref.real_slots.resize(world);
  if (options.kind == PlanKind::kFlat) {
    ref.partition_numel = AlignUpRef(CeilDivRef(layout.total_numel(), world), align);
    // Deal the flat vector out: rank r takes the next partition_numel elements.
    for (std::uint64_t flat = 0; flat < layout.total_numel(); ++flat) {
      const std::uint64_t r = flat / ref.partition_numel;
      ref.owner[flat] = Slot{static_cast<int>(r), flat - r * ref.partition_numel};
      ref.real_slots[r].emplace_back(flat - r * ref.partition_numel, flat);
    }
    return ref;
  }
  std::vector<std::uint64_t> shard(layout.num_params());
  for (std::size_t p = 0; p < layout.num_params(); ++p) {
    shard[p] = AlignUpRef(CeilDivRef(layout.param(p).numel, world), align);
    ref.partition_numel += shard[p];
  }
  for (std::uint64_t r = 0; r < world; ++r) {
    std::uint64_t shard_begin = 0;
    for (std::size_t p = 0; p < layout.num_params(); ++p) {
      const ParamInfo& info = layout.param(p);
      for (std::uint64_t k = 0; k < shard[p] && r * shard[p] + k < info.numel; ++k) {
        const std::uint64_t flat = info.flat_offset + r * shard[p] + k;
        ref.owner[flat] = Slot{static_cast<int>(r), shard_begin + k};
        ref.real_slots[r].emplace_back(shard_begin + k, flat);
      }
      shard_begin += shard[p];
    }
  }
  return ref;
}

// Checks `fragments` (of rank `world_rank`, covering partition range [begin, end)) against the
// reference element by element: each fragment maps its run consistently, fragments are in
// partition order without overlap, and together they are exactly the real slots in the range.
inline void ExpectFragmentsMatchReference(const ParamLayout& layout, const ReferencePlan& ref,
                                          int world_rank, std::uint64_t begin, std::uint64_t end,
                                          const std::vector<Fragment>& fragments) {
  const auto& slots = ref.real_slots[world_rank];
  auto first = std::lower_bound(slots.begin(), slots.end(),
                                std::pair<std::uint64_t, std::uint64_t>{begin, 0});
  std::size_t next = 0;
  std::uint64_t real = 0;
  // Plain comparisons in the per-element loop (a gtest assertion per element is slow); the
  // first bad slot is reported below.
  for (auto it = first; it != slots.end() && it->first < end; ++it, ++real) {
    const std::uint64_t k = it->first;
    while (next < fragments.size() &&
           fragments[next].partition_offset + fragments[next].numel <= k) {
      ++next;
    }
    const bool covered_ok = next < fragments.size() && fragments[next].partition_offset <= k;
    ASSERT_TRUE(covered_ok) << "slot " << k << " of rank " << world_rank << " uncovered";
    const Fragment& f = fragments[next];
    if (f.world_rank != world_rank || f.flat_offset + (k - f.partition_offset) != it->second) {
      FAIL() << "slot " << k << " of rank " << world_rank << " holds flat " << it->second
             << " but the fragment at partition offset " << f.partition_offset << " of rank "
             << f.world_rank << " says flat " << f.flat_offset + (k - f.partition_offset);
    }
  }
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < fragments.size(); ++i) {
    const Fragment& f = fragments[i];
    ASSERT_GT(f.numel, 0u);
    ASSERT_GE(f.partition_offset, begin);
    ASSERT_LE(f.partition_offset + f.numel, end);
    ASSERT_EQ(layout.param(f.param_index).flat_offset + f.param_offset, f.flat_offset);
    ASSERT_LE(f.param_offset + f.numel, layout.param(f.param_index).numel);
    if (i > 0) {
      ASSERT_GE(f.partition_offset, fragments[i - 1].partition_offset + fragments[i - 1].numel)
          << "fragments overlap or are out of order";
    }
    covered += f.numel;
  }
  // Every real slot lies in some fragment and the fragments hold no more elements than there
  // are real slots: no padding is covered, nothing is missed, nothing is counted twice.
  ASSERT_EQ(covered, real) << "fragments cover padding or miss elements";
}

}  // namespace zinf::partition::testing
