#include "zinf/swapper/partitioned_optimizer_swapper.h"

#include <algorithm>
#include <array>
#include <optional>
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
  const StateBuffers buffers = LeaseBuffers(lease);
  if (resident(sub_group)) {
    ZINF_RETURN_IF_ERROR(CheckNotDamaged(sub_group));
    CopyState(sub_group, ResidentBuffers(sub_group), buffers);
  } else {
    comm::ScopedTimer swap_in(timers_, "swap_in_param");
    IoBatch batch;
    Status submitted = OkStatus();
    {
      comm::ScopedTimer submit(timers_, "swap_submit_read_param");
      submitted = SubmitStateReads(sub_group, buffers, read_engine(), &batch);
    }
    Status waited = OkStatus();
    {
      comm::ScopedTimer wait(timers_, "swap_wait_read_param");
      waited = batch.Wait(read_engine());
    }
    ZINF_RETURN_IF_ERROR(Annotate(submitted, "swap-in "));
    ZINF_RETURN_IF_ERROR(Annotate(waited, "swap-in "));
    ZINF_RETURN_IF_ERROR(Annotate(VerifyStateReads(sub_group, buffers), "swap-in "));
  }
  ZINF_RETURN_IF_ERROR(
      Annotate(source.FillInto(info.sub_group, lease.floats(num_slot_tensors())), "gradient: "));
  swapped_in_.emplace(sub_group, std::move(lease));
  return OkStatus();
}

void PartitionedOptimizerSwapper::Release(std::size_t sub_group) { swapped_in_.erase(sub_group); }

Status PartitionedOptimizerSwapper::Step(std::int64_t step, const GradientSource& source,
                                         const ParamSink& sink, const StepOptions& options) {
  ZINF_RETURN_IF_ERROR(FlushGradientsCollective(step));
  return FinishStep(step, StepLocal(step, source, sink, options));
}

Status PartitionedOptimizerSwapper::StepLocal(std::int64_t step, const GradientSource& source,
                                              const ParamSink& sink, const StepOptions& options) {
  const std::vector<std::size_t> todo = SwappedTodo(step);
  const std::size_t n = num_slot_tensors();
  // With every sub-group resident (device cpu) fp32 needs only the gradient's buffer.
  const bool q8 = options_.state_format == StateFormat::kQ8;
  const std::size_t count = todo.empty() && !q8 ? 1 : n + 1;
  ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool_->Allocate(sub_groups_.max_sub_group_numel(), count));
  // role[t]: the lease buffer holding slot tensor t of the sub-group in hand; `grad`: the one
  // holding its gradient. The roles rotate from one sub-group to the next (see the header).
  std::array<std::size_t, kNumStateTensors> role{};
  for (std::size_t t = 0; t < n; ++t) role[t] = t;
  std::size_t grad = count - 1;
  auto buffers = [&] {
    StateBuffers b;
    for (std::size_t t = 0; t < n; ++t) b.tensors[t] = lease.bytes(role[t]);
    return b;
  };

  std::array<IoBatch, kNumStateTensors> reads;
  std::array<IoBatch, kNumStateTensors> writes;
  Completions read_seen;
  Completions write_seen;
  std::optional<std::size_t> writing;  // the sub-group whose writes are in flight
  std::size_t write_slot = 0;
  bool gradient_ready = false;  // `gradient` is the gradient of the sub-group in hand
  std::span<const float> gradient;
  Status write_status = OkStatus();  // the first failure among the writes of `writing`

  // Waits for the writes of slot tensor t of `writing`.
  auto wait_write = [&](std::size_t t) {
    comm::ScopedTimer wait(timers_, "swap_wait_write_param");
    Status one = writes[t].WaitFor(write_engine(), &write_seen);
    if (write_status && !one) write_status = std::move(one);
    return write_status;
  };

  auto submit_read = [&](std::size_t i, std::size_t t, std::size_t buffer) -> Status {
    comm::ScopedTimer submit(timers_, "swap_submit_read_param");
    return Annotate(SubmitStateRead(i, t, lease.bytes(buffer), read_engine(), &reads[t]),
                    StepContext(step, i) + "swap-in ");
  };
  // Waits for the writes of `writing`; commits and sinks it if they all succeeded.
  auto finish_writes = [&]() -> Status {
    if (!writing) return OkStatus();
    const std::size_t i = *writing;
    writing.reset();
    for (std::size_t t = 0; t < n; ++t) (void)wait_write(t);
    Status written = std::exchange(write_status, OkStatus());
    if (!written) {
      Abandon(write_slot);
      return Annotate(std::move(written), StepContext(step, i) + "swap-out ");
    }
    Commit(i, write_slot, step);
    return Annotate(Sink(i, buffers().floats(0), lease.bytes(role[n - 1]), sink),
                    StepContext(step, i));
  };

  auto run = [&]() -> Status {
    // Resident sub-groups step while the first swapped one is read; q8's need the state
    // buffers as their work copy, so they step before.
    if (q8) {
      ZINF_RETURN_IF_ERROR(
          StepResident(step, source, sink, options, lease.floats(grad), buffers()));
    }
    if (!todo.empty()) {
      for (std::size_t t = 0; t < n; ++t) ZINF_RETURN_IF_ERROR(submit_read(todo[0], t, role[t]));
    }
    if (!q8) {
      ZINF_RETURN_IF_ERROR(StepResident(step, source, sink, options, lease.floats(grad), {}));
    }
    for (std::size_t k = 0; k < todo.size(); ++k) {
      const std::size_t i = todo[k];
      {
        comm::ScopedTimer swap_in(timers_, "swap_in_param");
        comm::ScopedTimer wait(timers_, "swap_wait_read_param");
        for (std::size_t t = 0; t < n; ++t) {
          ZINF_RETURN_IF_ERROR(Annotate(reads[t].WaitFor(read_engine(), &read_seen),
                                        StepContext(step, i) + "swap-in "));
        }
      }
      ZINF_RETURN_IF_ERROR(
          Annotate(VerifyStateReads(i, buffers()), StepContext(step, i) + "swap-in "));
      if (!gradient_ready) {
        Result<std::span<const float>> g = Gradient(i, source, lease.floats(grad));
        if (!g) return std::move(g).error().WithContext(StepContext(step, i));
        gradient = *g;
      }
      gradient_ready = false;
      ZINF_RETURN_IF_ERROR(
          Annotate(Compute(step, i, buffers(), gradient, options), StepContext(step, i)));
      {
        comm::ScopedTimer swap_out(timers_, "swap_out_param");
        comm::ScopedTimer submit(timers_, "swap_submit_write");
        std::array<std::size_t, kNumStateTensors> order{};
        for (std::size_t t = 1; t < n; ++t) order[t - 1] = t;  // fp32 last: see the header
        order[n - 1] = 0;
        Result<std::size_t> slot =
            SubmitStateWrites(i, buffers(), write_engine(), std::span<IoBatch>(writes.data(), n),
                              std::span<const std::size_t>(order.data(), n));
        if (!slot) {
          // The slot is spare again; drain what was submitted before the failure.
          for (std::size_t t = 0; t < n; ++t) (void)writes[t].WaitFor(write_engine(), &write_seen);
          return std::move(slot).error().WithContext(StepContext(step, i) + "swap-out ");
        }
        write_slot = *slot;
        writing = i;
      }
      if (k + 1 == todo.size()) break;
      const std::size_t j = todo[k + 1];
      ZINF_RETURN_IF_ERROR(submit_read(j, 1, grad));
      for (std::size_t t = 2; t < n; ++t) {
        // A failed write is reported by finish_writes, which abandons the slot.
        if (!wait_write(t - 1)) break;
        ZINF_RETURN_IF_ERROR(submit_read(j, t, role[t - 1]));
      }
      ZINF_RETURN_IF_ERROR(finish_writes());
      ZINF_RETURN_IF_ERROR(submit_read(j, 0, role[0]));
      std::array<std::size_t, kNumStateTensors> next = role;
      next[1] = grad;
      for (std::size_t t = 2; t < n; ++t) next[t] = role[t - 1];
      grad = role[n - 1];
      role = next;
      Result<std::span<const float>> g = Gradient(j, source, lease.floats(grad));
      if (!g) return std::move(g).error().WithContext(StepContext(step, j));
      gradient = *g;
      gradient_ready = true;
    }
    return finish_writes();
  };

  Status status = run();
  if (!status) {
    // Nothing may go back to the pool under an I/O in flight. Writes that complete cleanly still
    // commit: the sub-group's new state is whole on disk.
    if (read_engine_) (void)read_engine().WaitAll();
    (void)finish_writes();
  }
  return status;
}

}  // namespace zinf::swapper
