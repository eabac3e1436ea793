// The optimizer state the swapper benchmarks (step, ckpt) move: one flat fp32 parameter whose
// Adam state (fp32 weights, exp_avg, exp_avg_sq: 12 bytes per element) is about `state_bytes`
// in total, split over `world_size` ranks.
#pragma once

#include <algorithm>
#include <cstdint>

#include "zinf/core/status.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::bench {

inline constexpr std::uint64_t kStateBytesPerElement = swapper::kNumStateTensors * sizeof(float);

inline Result<partition::PartitionPlan> FlatStatePlan(std::uint64_t state_bytes, int world_size) {
  const std::uint64_t numel = std::max<std::uint64_t>(state_bytes / kStateBytesPerElement, 1);
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout,
                        partition::ParamLayout::Create(
                            {{"state", {static_cast<std::int64_t>(numel)}}}));
  return partition::PartitionPlan::CreateFlat(layout, world_size, 1024);
}

}  // namespace zinf::bench
