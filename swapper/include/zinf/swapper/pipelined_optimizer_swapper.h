// PipelinedOptimizerSwapper (DeepSpeed's PipelinedOptimizerSwapper, pipeline_read /
// pipeline_write): while sub-group i is stepped, the state of sub-group i+1 is read on the read
// backend and the state of sub-group i-1 written on the write backend. Three sets of pool buffers (3
// each in fp32, 2 in q8: the slot tensors) rotate between the roles compute, reading and writing,
// and one gradient buffer serves them all, so the pool must hold at least 10 (q8: 7) buffers
// (CreateOptimizerSwapper falls back to the synchronous swapper, with a WARN, when it does not);
// DeepSpeed needs 9 with the gradients kept outside its pool. The resident sub-groups (host
// memory tier) are spread over the swapped ones: a share steps while the first swapped one is
// read and a share after each swapped one's writes are submitted, while its writes and the next
// reads are in flight (q8's work copy: the set free at that moment). Each backend has at most one
// sub-group's requests in flight, which is what lets a failure be pinned to a sub-group and the
// consistency rules of optimizer_swapper.h hold: a sub-group is committed (and sunk) only once its
// writes completed, when the next sub-group's writes are about to be submitted or at the end of
// the step. With only pipeline_read (or only pipeline_write) set, the other direction is waited
// for synchronously.
//
// Depth: one sub-group read ahead and one written behind. A larger budget does not deepen the
// pipeline (it would only help when one sub-group's I/O is much shorter than its compute).
// Thread safety: one thread at a time.
#pragma once

#include <cstdint>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

class PipelinedOptimizerSwapper final : public OptimizerSwapper {
 public:
  static constexpr std::size_t kSets = 3;  // compute, reading, writing
  static std::size_t MinBuffers(StateFormat format) {
    return kSets * (BuffersPerSubGroup(format) - 1) + 1;  // the gradient buffer is shared
  }

 private:
  class Pipeline;  // one step's rotation of the sets (pipelined_optimizer_swapper.cc)
  friend Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
      const comm::Communicator& comm, const partition::PartitionPlan& plan,
      const SwapperOptions& options);
  explicit PipelinedOptimizerSwapper(Parts&& parts);
  Status StepLocal(std::int64_t step, const GradientSource& source, const ParamSink& sink,
                   const StepOptions& options) override;
};

}  // namespace zinf::swapper
