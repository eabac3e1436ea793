#include "zinf/partition/sub_group.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/units.h"

namespace zinf::partition {

std::uint64_t SubGroup::RealNumel() const {
  std::uint64_t real = 0;
  for (const SubGroupFragment& fragment : fragments) real += fragment.numel;
  return real;
}

Result<SubGroupPlan> SubGroupPlan::Create(const PartitionPlan& plan, int world_rank,
                                          std::uint64_t sub_group_size) {
  if (sub_group_size == 0) return InvalidArgumentError("sub_group_size must be >= 1");
  if (world_rank < 0 || world_rank >= plan.world_size()) {
    return InvalidArgumentError(fmt::format("sub-groups: rank {} outside a plan of {} ranks",
                                            world_rank, plan.world_size()));
  }
  const std::uint64_t alignment = plan.alignment_elems();
  SubGroupPlan sub_groups;
  sub_groups.world_rank_ = world_rank;
  sub_groups.alignment_elems_ = alignment;
  sub_groups.sub_group_numel_ = std::max(AlignDown(sub_group_size, alignment), alignment);
  const std::uint64_t partition_numel = plan.partition_numel();
  const std::uint64_t step = sub_groups.sub_group_numel_;
  // Fragments are computed once for the whole partition and then cut, so a partition of many
  // small sub-groups costs O(fragments + sub-groups), not a lookup per sub-group.
  std::vector<Fragment> fragments = plan.RankFragments(world_rank);
  std::size_t next = 0;
  sub_groups.sub_groups_.reserve(static_cast<std::size_t>((partition_numel - 1) / step + 1));
  for (std::uint64_t begin = 0; begin < partition_numel;
       begin += std::min(step, partition_numel - begin)) {
    SubGroup group;
    group.index = sub_groups.sub_groups_.size();
    group.partition_offset = begin;
    group.numel = std::min(step, partition_numel - begin);
    const std::uint64_t end = begin + group.numel;
    // Skip fragments that end before this sub-group; a fragment may span several sub-groups.
    while (next < fragments.size() &&
           fragments[next].partition_offset + fragments[next].numel <= begin) {
      ++next;
    }
    for (std::size_t f = next; f < fragments.size() && fragments[f].partition_offset < end; ++f) {
      const Fragment& fragment = fragments[f];
      const std::uint64_t lo = std::max(fragment.partition_offset, begin);
      const std::uint64_t hi = std::min(fragment.partition_offset + fragment.numel, end);
      const std::uint64_t skip = lo - fragment.partition_offset;
      group.fragments.push_back(SubGroupFragment{fragment.param_index, fragment.param_offset + skip,
                                                 fragment.flat_offset + skip, lo - begin, hi - lo});
    }
    sub_groups.sub_groups_.push_back(std::move(group));
  }
  return sub_groups;
}

std::uint64_t SubGroupPlan::max_sub_group_numel() const {
  return sub_groups_.empty() ? 0 : sub_groups_.front().numel;
}

const SubGroup& SubGroupPlan::sub_group(std::size_t index) const {
  ZINF_CHECK_LT(index, sub_groups_.size());
  return sub_groups_[index];
}

Result<GradientSwapSplit> SplitGradientForSwap(const SubGroup& sub_group,
                                               std::uint64_t alignment_elems,
                                               std::uint64_t min_swap_numel) {
  if (alignment_elems == 0) {
    return InvalidArgumentError("gradient swap split: alignment_elems must be >= 1");
  }
  GradientSwapSplit split;
  auto keep = [&split](std::size_t param, std::uint64_t offset, std::uint64_t numel) {
    if (numel > 0) split.unswapped.push_back(GradientPiece{param, offset, numel});
  };
  for (const SubGroupFragment& fragment : sub_group.fragments) {
    const std::uint64_t begin = fragment.sub_group_offset;
    const std::uint64_t end = begin + fragment.numel;
    const std::uint64_t rem = begin % alignment_elems;
    const std::uint64_t head = rem == 0 ? 0 : alignment_elems - rem;  // no overflow, unlike AlignUp
    const std::uint64_t inner_begin = head < fragment.numel ? begin + head : end;
    const std::uint64_t inner_end = std::max(AlignDown(end, alignment_elems), inner_begin);
    if (fragment.numel < min_swap_numel || inner_begin == inner_end ||
        inner_end - inner_begin < min_swap_numel) {
      keep(fragment.param_index, begin, fragment.numel);
      continue;
    }
    keep(fragment.param_index, begin, inner_begin - begin);
    split.swapped.push_back(
        GradientPiece{fragment.param_index, inner_begin, inner_end - inner_begin});
    keep(fragment.param_index, inner_end, end - inner_end);
  }
  return split;
}

}  // namespace zinf::partition
