// Sub-groups: a rank's partition cut into the pieces that are swapped in, stepped and swapped
// out one at a time, and the split of a sub-group's gradient into swapped and in-memory pieces.
//
// Sub-group k of a rank covers partition elements [k * E, min((k + 1) * E, partition_numel)),
// where E = max(AlignDown(sub_group_size, alignment), alignment) is sub_group_size rounded down
// to the plan's alignment (at least one alignment unit). Every sub-group therefore starts at an
// aligned partition offset and, because partition_numel is a multiple of the alignment, every
// sub-group's numel is a multiple of the alignment too; only the last one may be shorter than E.
// Sub-groups tile the whole partition, padding included: a rank that owns only padding still
// has sub-groups (with no fragments), so that every rank runs the same number of steps.
//
// Thread safety: immutable values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/partition/plan.h"

namespace zinf::partition {

// DeepSpeed's zero_optimization.sub_group_size default.
inline constexpr std::uint64_t kDefaultSubGroupSize = 1'000'000'000;
// DeepSpeed swaps a gradient piece only from 1 MiB on: 262144 fp32 elements.
inline constexpr std::uint64_t kDefaultMinSwapNumel = 262'144;

// A run of one parameter's elements inside a sub-group.
struct SubGroupFragment {
  std::size_t param_index = 0;
  std::uint64_t param_offset = 0;      // first element within the parameter
  std::uint64_t flat_offset = 0;       // first element in the global unpadded flat vector
  std::uint64_t sub_group_offset = 0;  // first element within the sub-group
  std::uint64_t numel = 0;             // > 0

  friend bool operator==(const SubGroupFragment&, const SubGroupFragment&) = default;
};

struct SubGroup {
  std::size_t index = 0;                    // position in the rank's sub-groups
  std::uint64_t partition_offset = 0;       // first element within the partition; aligned
  std::uint64_t numel = 0;                  // padding included; a multiple of the alignment
  std::vector<SubGroupFragment> fragments;  // in sub-group order; gaps are padding

  std::uint64_t RealNumel() const;  // sum of the fragments' numel
  std::uint64_t PaddingNumel() const { return numel - RealNumel(); }
};

class SubGroupPlan {
 public:
  // Cuts partition `world_rank` of `plan` into sub-groups of at most `sub_group_size` elements
  // (rounded as in the file comment). Errors: InvalidArgument for sub_group_size == 0 or a rank
  // outside [0, plan.world_size()).
  static Result<SubGroupPlan> Create(const PartitionPlan& plan, int world_rank,
                                     std::uint64_t sub_group_size = kDefaultSubGroupSize);

  int world_rank() const { return world_rank_; }
  // E of the file comment: the numel of every sub-group except perhaps the last.
  std::uint64_t sub_group_numel() const { return sub_group_numel_; }
  // The largest sub-group's numel (what one swap buffer must hold).
  std::uint64_t max_sub_group_numel() const;
  std::uint64_t alignment_elems() const { return alignment_elems_; }
  std::size_t size() const { return sub_groups_.size(); }
  // Precondition (checked): index < size().
  const SubGroup& sub_group(std::size_t index) const;
  const std::vector<SubGroup>& sub_groups() const { return sub_groups_; }

 private:
  SubGroupPlan() = default;

  int world_rank_ = 0;
  std::uint64_t sub_group_numel_ = 0;
  std::uint64_t alignment_elems_ = 1;
  std::vector<SubGroup> sub_groups_;
};

// A piece of a sub-group's gradient.
struct GradientPiece {
  std::size_t param_index = 0;
  std::uint64_t sub_group_offset = 0;  // first element within the sub-group
  std::uint64_t numel = 0;             // > 0

  friend bool operator==(const GradientPiece&, const GradientPiece&) = default;
};

struct GradientSwapSplit {
  std::vector<GradientPiece> swapped;    // written to the swap store; in sub-group order
  std::vector<GradientPiece> unswapped;  // kept in host memory; in sub-group order
};

// Splits the gradient of every fragment of `sub_group` into pieces that are swapped out and
// pieces that stay in memory, as DeepSpeed's optimizer swapper does, with an alignment rule that
// also makes the swapped pieces' offsets aligned:
//  - a fragment of fewer than `min_swap_numel` elements stays in memory entirely;
//  - otherwise its aligned interior [AlignUp(o), AlignDown(o + n)) (o, n: the fragment's
//    sub-group offset and numel) is swapped if it holds at least min_swap_numel elements, and
//    the unaligned head [o, AlignUp(o)) and tail [AlignDown(o + n), o + n) stay in memory.
//    When o is aligned (always for the first fragment of a sub-group, and for every fragment of
//    a kPerParam plan when alignment_elems divides the plan's alignment) this is DeepSpeed's
//    split: an aligned swapped head and an unaligned in-memory remainder.
// Swapped pieces thus start and end at multiples of alignment_elems within the sub-group (and,
// since sub-groups start aligned, within the partition). Swapped and unswapped pieces together
// tile the fragments exactly. Errors: InvalidArgument for alignment_elems == 0.
Result<GradientSwapSplit> SplitGradientForSwap(const SubGroup& sub_group,
                                               std::uint64_t alignment_elems,
                                               std::uint64_t min_swap_numel = kDefaultMinSwapNumel);

}  // namespace zinf::partition
