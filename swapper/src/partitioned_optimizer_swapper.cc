#include "zinf/swapper/partitioned_optimizer_swapper.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "optimizer_swapper_internal.h"
#include "zinf/swapper/gradient_swapper.h"

namespace zinf::swapper {

PartitionedOptimizerSwapper::PartitionedOptimizerSwapper(Parts&& parts)
    : OptimizerSwapper("partitioned", std::move(parts)) {}

Status PartitionedOptimizerSwapper::SwapIn(std::size_t sub_group, const GradientSource& source) {
  if (sub_group >= infos_.size()) {
    return InvalidArgumentError(fmt::format("sub-group {} of {}", sub_group, infos_.size()));
  }
  if (swapped_in_.contains(sub_group)) {
    return FailedPreconditionError(fmt::format("sub-group {} is already swapped in", sub_group));
  }
  if (gradient_swapper_) ZINF_RETURN_IF_ERROR(gradient_swapper_->Flush());
  const SubGroupSwapInfo& info = infos_[sub_group];
  ZINF_ASSIGN_OR_RETURN(PoolLease lease,
                        pool_->Allocate(info.sub_group.numel, buffers_per_sub_group()));
  {
    comm::ScopedTimer swap_in(timers_, "swap_in_param");
    IoBatch batch;
    Status submitted = OkStatus();
    {
      comm::ScopedTimer submit(timers_, "swap_submit_read_param");
      submitted = SubmitStateReads(sub_group, lease, read_engine(), &batch);
    }
    Status waited = OkStatus();
    {
      comm::ScopedTimer wait(timers_, "swap_wait_read_param");
      waited = batch.Wait(read_engine());
    }
    ZINF_RETURN_IF_ERROR(Annotate(submitted, "swap-in "));
    ZINF_RETURN_IF_ERROR(Annotate(waited, "swap-in "));
    ZINF_RETURN_IF_ERROR(Annotate(VerifyStateReads(sub_group, lease), "swap-in "));
  }
  {
    comm::ScopedTimer gradient(timers_, "swap_in_gradient");
    std::span<float> grad = lease.floats(gradient_buffer()).first(info.sub_group.numel);
    if (source) {
      ZINF_RETURN_IF_ERROR(Annotate(source(info.sub_group, grad), "gradient: "));
    } else {
      std::fill(grad.begin(), grad.end(), 0.0f);
    }
  }
  swapped_in_.emplace(sub_group, std::move(lease));
  return OkStatus();
}

void PartitionedOptimizerSwapper::Release(std::size_t sub_group) { swapped_in_.erase(sub_group); }

Status PartitionedOptimizerSwapper::StepOne(std::int64_t step, std::size_t sub_group,
                                            const GradientSource& source, const ParamSink& sink,
                                            const StepOptions& options) {
  ZINF_RETURN_IF_ERROR(SwapIn(sub_group, source));
  auto it = swapped_in_.find(sub_group);
  Status computed = Compute(step, sub_group, it->second, options);
  if (!computed) {
    Release(sub_group);
    return computed;
  }
  // The sink sees the weights only once they are committed, so the buffers stay leased until
  // after it: write without releasing, then sink, then release.
  {
    comm::ScopedTimer swap_out(timers_, "swap_out_param");
    comm::ScopedTimer submit(timers_, "swap_submit_write");
    Status written = WriteAndCommit(sub_group, step, it->second, {}, "swap-out ");
    if (!written) {
      Release(sub_group);
      return written;
    }
  }
  Status sunk = Sink(sub_group, it->second, sink);
  Release(sub_group);
  return sunk;
}

Status PartitionedOptimizerSwapper::Step(std::int64_t step, const GradientSource& source,
                                         const ParamSink& sink, const StepOptions& options) {
  ZINF_RETURN_IF_ERROR(FlushGradientsCollective(step));
  Status local = OkStatus();
  for (std::size_t i = 0; i < infos_.size() && local; ++i) {
    if (last_step_[i] >= step) continue;
    local = Annotate(StepOne(step, i, source, sink, options), StepContext(step, i));
  }
  return FinishStep(step, std::move(local));
}

}  // namespace zinf::swapper
