// PartitionedOptimizerSwapper: the swapper of DeepSpeed's PartitionedOptimizerSwapper, in the
// same memory (one set of buffers: the slot tensors of one sub-group and its gradient, 4 for fp32,
// 3 for q8), but with reads and writes overlapped by rotating the buffers between roles.
//
// Step() steps the resident sub-groups (host memory tier) while the first swapped sub-group is
// read, then for each swapped sub-group i, with n slot tensors in n + 1 buffers:
//   wait for i's reads; fill its gradient (unless done ahead); Adam;
//   write i's tensors 1..n-1, then 0 (fp32) to the spare slot, on the write backend;
//   read the next sub-group j's tensor 1 into the gradient buffer, free now, and each tensor
//     t >= 2 of j into the buffer of i's tensor t - 1 as soon as that one is written;
//   once all of i's writes are done: commit, sink (bf16 scratch: the buffer of tensor n - 1),
//     read j's fp32 into i's fp32 buffer, and fill j's gradient into the buffer of tensor n - 1
//     while that read runs.
// So most of the next sub-group's reads run while the previous one is written (a disk moves
// more both ways at once than one way), and the sink still sees only committed weights: fp32 is
// written last and its buffer is read into only after the commit. The crash-consistency contract of
// OptimizerSwapper holds unchanged: one write set in flight, one spare slot.
//
// Thread safety: one thread at a time.
#pragma once

#include <cstdint>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

class PartitionedOptimizerSwapper final : public OptimizerSwapper {
 private:
  class Rotation;  // one step's rotation of the buffers (partitioned_optimizer_swapper.cc)
  friend Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
      const comm::Communicator& comm, const partition::PartitionPlan& plan,
      const SwapperOptions& options);
  explicit PartitionedOptimizerSwapper(Parts&& parts);
  Status StepLocal(std::int64_t step, const GradientSource& source, const ParamSink& sink,
                   const StepOptions& options) override;
};

}  // namespace zinf::swapper
