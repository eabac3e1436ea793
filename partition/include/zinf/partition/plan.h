// PartitionPlan: which rank owns which elements of the flat parameter vector (ZeRO).
//
// Every rank owns a *partition*: a buffer of partition_numel() elements (the same on every rank,
// a multiple of the alignment) that holds its elements followed or interleaved by padding. Two
// kinds of plan share this interface:
//
//  - PlanKind::kFlat (ZeRO stage 1/2): the flat vector, padded at the end, is cut into
//    world_size equal contiguous slices of partition_numel() = AlignUp(ceil(total / world),
//    alignment) elements. Rank r owns flat elements [r * P, (r + 1) * P) clipped to
//    total_numel; the last rank(s) hold the padding, and a rank may own only padding when there
//    are fewer elements than ranks. A parameter may straddle partitions.
//
//  - PlanKind::kPerParam (ZeRO stage 3): every parameter p is split across all ranks on its own
//    into shards of S_p = AlignUp(ceil(numel_p / world), alignment) elements; rank r owns
//    elements [r * S_p, (r + 1) * S_p) of p clipped to numel_p. A rank's partition is the
//    concatenation of its shards of every parameter, in layout order, each padded to S_p:
//    the shard of p starts at partition offset sum_{q < p} S_q, on every rank.
//
// A Fragment is a maximal run of elements of one parameter that is contiguous both in the
// parameter and in one rank's partition. Offsets of fragments are real (unpadded) element
// offsets: `flat_offset` indexes the global unpadded flat vector of ParamLayout.
//
// Thread safety: PartitionPlan is an immutable value (it shares its layout through a
// shared_ptr to const); const methods may be called concurrently. Copies are cheap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zinf/core/status.h"
#include "zinf/partition/layout.h"

namespace zinf::partition {

enum class PlanKind : std::uint8_t {
  kFlat = 0,      // ZeRO stage 1/2: contiguous equal slices of the flat vector
  kPerParam = 1,  // ZeRO stage 3: each parameter sliced across all ranks
};

// "flat", "per_param" (the names used in JSON).
std::string_view PlanKindName(PlanKind kind);
// Errors: InvalidArgument for an unknown name.
Result<PlanKind> ParsePlanKind(std::string_view name);
// ZeRO stage 1 or 2 -> kFlat, 3 -> kPerParam. Errors: InvalidArgument for any other stage
// (stage 0 partitions nothing).
Result<PlanKind> PlanKindForZeroStage(int zero_stage);

// The parameters of a plan besides its layout.
struct PlanOptions {
  PlanKind kind = PlanKind::kFlat;    // how elements are distributed
  int world_size = 1;                 // number of ranks, >= 1
  std::uint64_t alignment_elems = 1;  // partitions / shards are multiples of this, >= 1

  // {"kind": "flat", "world_size": 4, "alignment_elems": 1024}
  nlohmann::json ToJson() const;
  // Errors: InvalidArgument for missing or mistyped keys, an unknown kind, world_size < 1 or
  // alignment_elems == 0.
  static Result<PlanOptions> FromJson(const nlohmann::json& json);

  friend bool operator==(const PlanOptions&, const PlanOptions&) = default;
};

// A run of one parameter's elements owned by one rank (see the file comment).
struct Fragment {
  int world_rank = 0;                  // owner
  std::size_t param_index = 0;         // index in the layout
  std::uint64_t param_offset = 0;      // first element within the parameter
  std::uint64_t flat_offset = 0;       // first element in the global unpadded flat vector
  std::uint64_t partition_offset = 0;  // first element within the owner's partition
  std::uint64_t numel = 0;             // > 0

  friend bool operator==(const Fragment&, const Fragment&) = default;
};

// The owner of one element and the length of the run that continues from it in the same
// parameter and the same partition.
struct ElementOwner {
  int world_rank = 0;
  std::uint64_t partition_offset = 0;
  std::uint64_t run_numel = 0;  // >= 1
};

class PartitionPlan {
 public:
  // The first overload copies `layout`; the second shares it (non-null, checked), so that many
  // plans of one model (e.g. the N-rank plan of a checkpoint and the M-rank plan of a restore)
  // hold one copy. Cost: O(1) for kFlat, O(num_params + world_size) for kPerParam.
  // Errors: InvalidArgument for world_size < 1, alignment_elems == 0, an unknown kind, or a plan
  // whose padded size (partition_numel * world_size) does not fit in 2^63 - 1 elements.
  static Result<PartitionPlan> Create(const ParamLayout& layout, const PlanOptions& options);
  static Result<PartitionPlan> Create(std::shared_ptr<const ParamLayout> layout,
                                      const PlanOptions& options);
  // Shorthands for Create with kFlat / kPerParam.
  static Result<PartitionPlan> CreateFlat(const ParamLayout& layout, int world_size,
                                          std::uint64_t alignment_elems);
  static Result<PartitionPlan> CreatePerParam(const ParamLayout& layout, int world_size,
                                              std::uint64_t alignment_elems);

  const ParamLayout& layout() const { return *layout_; }
  const std::shared_ptr<const ParamLayout>& shared_layout() const { return layout_; }
  const PlanOptions& options() const { return options_; }
  PlanKind kind() const { return options_.kind; }
  int world_size() const { return options_.world_size; }
  std::uint64_t alignment_elems() const { return options_.alignment_elems; }

  // Elements of every rank's partition, padding included; a multiple of alignment_elems, >= 1.
  std::uint64_t partition_numel() const { return partition_numel_; }
  // Real (unpadded) elements owned by `world_rank`; they sum to layout().total_numel().
  // Precondition (checked, here and below): 0 <= world_rank < world_size().
  std::uint64_t RealNumel(int world_rank) const;
  std::uint64_t PaddingNumel(int world_rank) const {
    return partition_numel_ - RealNumel(world_rank);
  }

  // kFlat only (checked): the rank's slice of the padded flat vector,
  // [world_rank * partition_numel(), (world_rank + 1) * partition_numel()). Its real part is
  // that range clipped to total_numel; the rest is padding.
  std::uint64_t PartitionFlatBegin(int world_rank) const;
  std::uint64_t PartitionFlatEnd(int world_rank) const;

  // kPerParam only (checked): shard size S_p of parameter `param_index` and the offset of its
  // shard within every partition.
  std::uint64_t ShardNumel(std::size_t param_index) const;
  std::uint64_t ShardPartitionOffset(std::size_t param_index) const;

  // The rank's fragments in partition order. O(log n + fragments) for kFlat, O(num_params) for
  // kPerParam.
  std::vector<Fragment> RankFragments(int world_rank) const;
  // The parts of the rank's fragments inside partition range [partition_offset,
  // partition_offset + numel), in partition order (padding is not reported).
  // Precondition (checked): the range lies within [0, partition_numel()].
  std::vector<Fragment> FragmentsInPartitionRange(int world_rank, std::uint64_t partition_offset,
                                                  std::uint64_t numel) const;
  // Inverse lookup: which ranks own which part of parameter `param_index`, as fragments in
  // parameter order (they tile the parameter). Precondition (checked): a valid index.
  std::vector<Fragment> ParamFragments(std::size_t param_index) const;
  // The owner of element `param_offset` of parameter `param_index`. O(1).
  // Preconditions (checked): valid index, param_offset < numel.
  ElementOwner Locate(std::size_t param_index, std::uint64_t param_offset) const;

  // {"layout": <ParamLayout::ToJson>, "plan": <PlanOptions::ToJson>}
  nlohmann::json ToJson() const;
  // Errors: those of ParamLayout::FromJson, PlanOptions::FromJson and Create.
  static Result<PartitionPlan> FromJson(const nlohmann::json& json);

 private:
  PartitionPlan() = default;
  void CheckRank(int world_rank) const;

  std::shared_ptr<const ParamLayout> layout_;
  PlanOptions options_;
  std::uint64_t partition_numel_ = 0;
  // kPerParam: per parameter, the shard size S_p and the shard's offset within a partition
  // (num_params + 1 entries, the last is partition_numel_).
  std::vector<std::uint64_t> shard_numel_;
  std::vector<std::uint64_t> shard_offset_;
  // kPerParam: real numel per rank (computed once; kFlat derives it).
  std::vector<std::uint64_t> real_numel_;
};

}  // namespace zinf::partition
