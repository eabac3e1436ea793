#include "zinf/partition/reshard.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "zinf/core/check.h"
#include "zinf/partition/layout.h"

namespace zinf::partition {

Result<ReshardPlan> ReshardPlan::Create(const PartitionPlan& from, const PartitionPlan& to) {
  if (from.shared_layout() != to.shared_layout()) {
    ZINF_RETURN_IF_ERROR(
        Annotate(CompareLayouts(from.layout(), to.layout(), /*compare_dtype=*/false),
                 "reshard plan: source and destination layouts differ: "));
  }
  return ReshardPlan(from, to);
}

std::vector<ReshardCopy> ReshardPlan::CopiesTo(int destination_rank) const {
  std::vector<ReshardCopy> copies;
  for (const Fragment& fragment : to_.RankFragments(destination_rank)) {
    const std::uint64_t end = fragment.param_offset + fragment.numel;
    for (std::uint64_t offset = fragment.param_offset; offset < end;) {
      const ElementOwner owner = from_.Locate(fragment.param_index, offset);
      const std::uint64_t numel = std::min(owner.run_numel, end - offset);
      const std::uint64_t skip = offset - fragment.param_offset;
      const ReshardCopy copy{owner.world_rank, owner.partition_offset, fragment.flat_offset + skip,
                             fragment.partition_offset + skip, numel};
      if (!copies.empty()) {
        ReshardCopy& last = copies.back();
        if (last.source_rank == copy.source_rank &&
            last.source_offset + last.numel == copy.source_offset &&
            last.flat_offset + last.numel == copy.flat_offset &&
            last.destination_offset + last.numel == copy.destination_offset) {
          last.numel += numel;
          offset += numel;
          continue;
        }
      }
      copies.push_back(copy);
      offset += numel;
    }
  }
  return copies;
}

std::vector<FlatRange> FlatRangesOfRank(const PartitionPlan& plan, int world_rank) {
  std::vector<FlatRange> ranges;
  for (const Fragment& fragment : plan.RankFragments(world_rank)) {
    if (!ranges.empty()) {
      FlatRange& last = ranges.back();
      if (last.flat_offset + last.numel == fragment.flat_offset &&
          last.partition_offset + last.numel == fragment.partition_offset) {
        last.numel += fragment.numel;
        continue;
      }
    }
    ranges.push_back(FlatRange{fragment.flat_offset, fragment.partition_offset, fragment.numel});
  }
  return ranges;
}

}  // namespace zinf::partition
