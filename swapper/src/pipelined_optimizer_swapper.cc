#include "zinf/swapper/pipelined_optimizer_swapper.h"

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "optimizer_swapper_internal.h"
#include "zinf/swapper/gradient_swapper.h"

namespace zinf::swapper {

PipelinedOptimizerSwapper::PipelinedOptimizerSwapper(Parts&& parts)
    : OptimizerSwapper("pipelined", std::move(parts)) {}

Status PipelinedOptimizerSwapper::Step(std::int64_t step, const GradientSource& source,
                                       const ParamSink& sink, const StepOptions& options) {
  ZINF_RETURN_IF_ERROR(FlushGradientsCollective(step));
  return FinishStep(step, StepLocal(step, source, sink, options));
}

Status PipelinedOptimizerSwapper::StepLocal(std::int64_t step, const GradientSource& source,
                                            const ParamSink& sink, const StepOptions& options) {
  const std::vector<std::size_t> todo = SwappedTodo(step);
  const std::uint64_t max_numel = sub_groups_.max_sub_group_numel();
  std::array<PoolLease, kSets> sets;
  for (PoolLease& set : sets) {
    ZINF_ASSIGN_OR_RETURN(set, pool_->Allocate(max_numel, num_slot_tensors()));
  }
  // One gradient buffer serves every set: a gradient is filled right before its Adam, and the
  // bf16 weights of a sink are rounded into it after the next Adam.
  ZINF_ASSIGN_OR_RETURN(PoolLease gradient_lease, pool_->Allocate(max_numel, 1));
  const std::span<float> grad = gradient_lease.floats(0);
  // Set t % 3 serves todo[t]: computing at iteration t, reading at t - 1, writing until the
  // writes are waited for at iteration t + 1. Set (t + 1) % 3 was therefore last used for the
  // writes of todo[t - 2], waited for at iteration t - 1, before it is read into at iteration t.
  IoBatch reads;
  IoBatch writes;
  std::optional<std::size_t> writing;  // index into todo of the sub-group being written
  std::size_t write_slot = 0;
  const bool read_ahead = options_.pipeline_read;
  const bool write_behind = options_.pipeline_write;

  // Waits for the writes in flight; commits and sinks their sub-group if they all succeeded.
  auto finish_writes = [&]() -> Status {
    if (!writing) return OkStatus();
    const std::size_t t = *writing;
    writing.reset();
    Status written = OkStatus();
    {
      comm::ScopedTimer wait(timers_, "swap_wait_write_param");
      written = writes.Wait(write_engine());
    }
    if (!written) {
      Abandon(write_slot);
      return Annotate(std::move(written), StepContext(step, todo[t]) + "swap-out ");
    }
    Commit(todo[t], write_slot, step);
    return Annotate(
        Sink(todo[t], LeaseBuffers(sets[t % kSets]).floats(0), gradient_lease.bytes(0), sink),
        StepContext(step, todo[t]));
  };
  auto submit_reads = [&](std::size_t t) -> Status {
    comm::ScopedTimer submit(timers_, "swap_submit_read_param");
    return Annotate(SubmitStateReads(todo[t], LeaseBuffers(sets[t % kSets]), read_engine(), &reads),
                    StepContext(step, todo[t]) + "swap-in ");
  };

  // The resident sub-groups step while swapped ones move: a share of them before the first
  // swapped sub-group (while it is read) and after each one (while it is written and the next
  // read), so that their Adam hides behind the I/O instead of preceding it. `work` is a set free
  // until the next reads into it: q8's work copy.
  std::size_t residents = ResidentTodo(step);
  auto step_residents = [&](std::size_t slots_left, const PoolLease& work) -> Status {
    const std::size_t share = (residents + slots_left - 1) / slots_left;
    residents -= share;
    return StepResident(step, source, sink, options, grad, LeaseBuffers(work), share);
  };

  auto run = [&]() -> Status {
    if (read_ahead && !todo.empty()) ZINF_RETURN_IF_ERROR(submit_reads(0));
    // Set 1 is free until iteration 0 reads into it (iteration 0 reads set 0 and 1 ahead).
    ZINF_RETURN_IF_ERROR(step_residents(todo.size() + 1, sets[1]));
    for (std::size_t t = 0; t < todo.size(); ++t) {
      const std::size_t i = todo[t];
      const StateBuffers set = LeaseBuffers(sets[t % kSets]);
      {
        comm::ScopedTimer swap_in(timers_, "swap_in_param");
        if (!read_ahead) ZINF_RETURN_IF_ERROR(submit_reads(t));
        {
          comm::ScopedTimer wait(timers_, "swap_wait_read_param");
          ZINF_RETURN_IF_ERROR(
              Annotate(reads.Wait(read_engine()), StepContext(step, i) + "swap-in "));
        }
        ZINF_RETURN_IF_ERROR(Annotate(VerifyStateReads(i, set), StepContext(step, i) + "swap-in "));
      }
      if (read_ahead && t + 1 < todo.size()) ZINF_RETURN_IF_ERROR(submit_reads(t + 1));
      Result<std::span<const float>> gradient = Gradient(i, source, grad);
      if (!gradient) return std::move(gradient).error().WithContext(StepContext(step, i));
      ZINF_RETURN_IF_ERROR(
          Annotate(Compute(step, i, set, *gradient, options), StepContext(step, i)));
      ZINF_RETURN_IF_ERROR(finish_writes());
      {
        comm::ScopedTimer swap_out(timers_, "swap_out_param");
        comm::ScopedTimer submit(timers_, "swap_submit_write");
        Result<std::size_t> slot =
            SubmitStateWrites(i, set, write_engine(), std::span<IoBatch>(&writes, 1));
        if (!slot) {
          // The slot is spare again; drain what was submitted before the failure.
          (void)writes.Wait(write_engine());
          return std::move(slot).error().WithContext(StepContext(step, i) + "swap-out ");
        }
        write_slot = *slot;
        writing = t;
      }
      if (!write_behind) ZINF_RETURN_IF_ERROR(finish_writes());
      // Set (t + 2) % 3 held todo[t - 1], whose writes finished above; todo[t + 2] is read into
      // it at iteration t + 1.
      ZINF_RETURN_IF_ERROR(step_residents(todo.size() - t, sets[(t + 2) % kSets]));
    }
    return finish_writes();
  };

  Status status = run();
  if (!status) {
    // Nothing may go back to the pool under an I/O in flight. Writes that complete cleanly still
    // commit: the sub-group's new state is whole on disk.
    (void)reads.Wait(read_engine());
    (void)finish_writes();
  }
  return status;
}

}  // namespace zinf::swapper
