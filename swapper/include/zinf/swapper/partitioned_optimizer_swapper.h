// PartitionedOptimizerSwapper: the synchronous swapper (DeepSpeed's PartitionedOptimizerSwapper).
// Step() runs, for each sub-group in order: SwapIn (flush gradients, take 4 pool buffers, read
// fp32/exp_avg/exp_avg_sq, fill the gradient), CpuAdam::Step, SwapOut (write the state to the
// spare slot, wait, commit, sink, release). One engine; I/O and compute do not overlap.
//
// The seed's operations are public for callers that drive sub-groups themselves (the checkpoint
// code, tests). They are local, not collective; the consistency rules of optimizer_swapper.h hold
// for them too (SwapOut/Writeback commit only after every write completed).
// Thread safety: one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

class PartitionedOptimizerSwapper final : public OptimizerSwapper {
 public:
  struct Buffers {
    std::span<float> fp32, exp_avg, exp_avg_sq, grad;  // sub-group numel each
  };

  Status Step(std::int64_t step, const GradientSource& source, const ParamSink& sink,
              const StepOptions& options = {}) override;

  // swap_in_optimizer_state: flushes the gradient swapper (locally), takes 4 buffers, reads the
  // committed state and fills the gradient from `source` (none when `source` is empty: the
  // gradient buffer is zeroed). Errors: FailedPrecondition (already swapped in),
  // ResourceExhausted (pool), I/O and callback errors (the buffers are released then).
  Status SwapIn(std::size_t sub_group, const GradientSource& source);
  // The swapped-in buffers. Errors: FailedPrecondition if the sub-group is not swapped in.
  Result<Buffers> SwappedIn(std::size_t sub_group) const;
  // swap_out_optimizer_state: writes the three state tensors to the spare slot, commits them as
  // `step` once written, and releases the buffers (also on error, after draining the engine).
  Status SwapOut(std::size_t sub_group, std::int64_t step);
  // writeback_optimizer_state_and_gradients: optionally the state (as SwapOut) and the gradient
  // buffer back into the gradient swapper's store (swapped pieces and in-memory remainders);
  // then releases the buffers.
  Status Writeback(std::size_t sub_group, std::int64_t step, bool write_state,
                   bool write_gradients);
  // release_swap_buffers: gives the buffers back without writing. No-op if not swapped in.
  void Release(std::size_t sub_group);
  // swap_out_gradients: forwards to GradientSwapper::SwapOut. FailedPrecondition without one.
  Status SwapOutGradients(int micro_batch, std::size_t sub_group, std::span<const float> grad);

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
