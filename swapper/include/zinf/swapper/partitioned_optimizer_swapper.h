// PartitionedOptimizerSwapper: the synchronous swapper (DeepSpeed's PartitionedOptimizerSwapper).
// Step() runs, for each sub-group in order: SwapIn (flush gradients, take 4 pool buffers, read
// fp32/exp_avg/exp_avg_sq, fill the gradient), CpuAdam::Step, swap-out (write the state to the
// spare slot, wait, commit, sink, Release). One engine; I/O and compute do not overlap.
//
// SwapIn and Release, the steps Step takes per sub-group, are local, not collective.
// Thread safety: one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

class PartitionedOptimizerSwapper final : public OptimizerSwapper {
 public:
  Status Step(std::int64_t step, const GradientSource& source, const ParamSink& sink,
              const StepOptions& options = {}) override;

  // swap_in_optimizer_state: flushes the gradient swapper (locally), takes 4 buffers, reads the
  // committed state and fills the gradient from `source` (none when `source` is empty: the
  // gradient buffer is zeroed). Errors: FailedPrecondition (already swapped in),
  // ResourceExhausted (pool), I/O and callback errors (the buffers are released then).
  Status SwapIn(std::size_t sub_group, const GradientSource& source);
  // release_swap_buffers: gives the buffers back without writing. No-op if not swapped in.
  void Release(std::size_t sub_group);

 private:
  friend Result<std::unique_ptr<OptimizerSwapper>> CreateOptimizerSwapper(
      const comm::Communicator& comm, const partition::PartitionPlan& plan,
      const SwapperOptions& options);
  explicit PartitionedOptimizerSwapper(Parts&& parts);
  Status StepOne(std::int64_t step, std::size_t sub_group, const GradientSource& source,
                 const ParamSink& sink, const StepOptions& options);

  std::map<std::size_t, PoolLease> swapped_in_;
};

}  // namespace zinf::swapper
