// Resharding: moving partitioned state from one plan to another (N ranks -> M ranks, stage 1/2
// <-> stage 3), e.g. to restore a checkpoint saved on N ranks on M ranks.
//
// Both directions are expressed as copies of element runs. Offsets are in elements of the
// state tensor (fp32); padding is never copied, so a destination partition's padding keeps
// whatever the caller put there (zero it).
//
// Thread safety: immutable values.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/partition/plan.h"

namespace zinf::partition {

// Copy `numel` elements from partition `source_rank` of the source plan, starting at
// `source_offset` within that partition, to the destination rank's partition at
// `destination_offset`. `flat_offset` is where the run starts in the global unpadded flat
// vector (the same run, seen from a checkpoint file).
struct ReshardCopy {
  int source_rank = 0;
  std::uint64_t source_offset = 0;
  std::uint64_t flat_offset = 0;
  std::uint64_t destination_offset = 0;
  std::uint64_t numel = 0;  // > 0

  friend bool operator==(const ReshardCopy&, const ReshardCopy&) = default;
};

// A run of the global unpadded flat vector and where it goes in a rank's partition.
struct FlatRange {
  std::uint64_t flat_offset = 0;
  std::uint64_t partition_offset = 0;
  std::uint64_t numel = 0;  // > 0

  friend bool operator==(const FlatRange&, const FlatRange&) = default;
};

class ReshardPlan {
 public:
  // Errors: FailedPrecondition (from CompareLayouts, dtype ignored: the state is fp32 whatever
  // the working precision) when the plans' layouts differ in names, shapes or order.
  static Result<ReshardPlan> Create(const PartitionPlan& from, const PartitionPlan& to);

  const PartitionPlan& from() const { return from_; }
  const PartitionPlan& to() const { return to_; }

  // The copies that fill every real element of partition `destination_rank` of `to()`, in
  // destination order, each element exactly once. Adjacent runs that are contiguous in the
  // source partition, the flat vector and the destination are merged into one copy.
  // Precondition (checked): 0 <= destination_rank < to().world_size().
  std::vector<ReshardCopy> CopiesTo(int destination_rank) const;

 private:
  ReshardPlan(PartitionPlan from, PartitionPlan to) : from_(std::move(from)), to_(std::move(to)) {}

  PartitionPlan from_;
  PartitionPlan to_;
};

// The global unpadded flat ranges that rank `world_rank` of `plan` owns, with their place in its
// partition, in partition order and merged where contiguous in both. For a kFlat plan this is at
// most one range. This is what a restore reads from a checkpoint whose datasets are the global
// flat vector. Precondition (checked): 0 <= world_rank < plan.world_size().
std::vector<FlatRange> FlatRangesOfRank(const PartitionPlan& plan, int world_rank);

}  // namespace zinf::partition
