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

// One step's pipeline over the swapped sub-groups `todo`. Set t % 3 serves todo[t]: computing at
// iteration t, reading at t - 1, writing until the writes are waited for at iteration t + 1. Set
// (t + 1) % 3 was therefore last used for the writes of todo[t - 2], waited for at iteration
// t - 1, before it is read into at iteration t.
class PipelinedOptimizerSwapper::Pipeline {
 public:
  Pipeline(PipelinedOptimizerSwapper& swapper, std::int64_t step, const GradientSource& source,
           const ParamSink& sink, const StepOptions& options)
      : s_(swapper),
        step_(step),
        source_(source),
        sink_(sink),
        options_(options),
        todo_(swapper.SwappedTodo(step)),
        residents_(swapper.ResidentTodo(step)) {}

  // The three sets and the one gradient buffer they share: a gradient is filled right before its
  // Adam, and the bf16 weights of a sink are rounded into it after the next Adam.
  Status Allocate() {
    const std::uint64_t max_numel = s_.sub_groups_.max_sub_group_numel();
    for (PoolLease& set : sets_) {
      ZINF_ASSIGN_OR_RETURN(set, s_.pool_->Allocate(max_numel, s_.num_slot_tensors()));
    }
    ZINF_ASSIGN_OR_RETURN(gradient_lease_, s_.pool_->Allocate(max_numel, 1));
    grad_ = gradient_lease_.floats(0);
    return OkStatus();
  }

  Status Run() {
    const bool read_ahead = s_.options_.pipeline_read;
    if (read_ahead && !todo_.empty()) ZINF_RETURN_IF_ERROR(SubmitReads(0));
    // Set 1 is free until iteration 0 reads into it (iteration 0 reads set 0 and 1 ahead).
    ZINF_RETURN_IF_ERROR(StepResidents(todo_.size() + 1, sets_[1]));
    for (std::size_t t = 0; t < todo_.size(); ++t) {
      const std::size_t i = todo_[t];
      const StateBuffers set = s_.LeaseBuffers(sets_[t % kSets]);
      ZINF_RETURN_IF_ERROR(SwapIn(t, set));
      if (read_ahead && t + 1 < todo_.size()) ZINF_RETURN_IF_ERROR(SubmitReads(t + 1));
      Result<std::span<const float>> gradient = s_.Gradient(i, source_, grad_);
      if (!gradient) return std::move(gradient).error().WithContext(s_.StepContext(step_, i));
      ZINF_RETURN_IF_ERROR(
          Annotate(s_.Compute(step_, i, set, *gradient, options_), s_.StepContext(step_, i)));
      ZINF_RETURN_IF_ERROR(FinishWrites());
      ZINF_RETURN_IF_ERROR(SwapOut(t, set));
      if (!s_.options_.pipeline_write) ZINF_RETURN_IF_ERROR(FinishWrites());
      // Set (t + 2) % 3 held todo[t - 1], whose writes finished above; todo[t + 2] is read into
      // it at iteration t + 1.
      ZINF_RETURN_IF_ERROR(StepResidents(todo_.size() - t, sets_[(t + 2) % kSets]));
    }
    return FinishWrites();
  }

  // After a failure: nothing may go back to the pool under an I/O in flight. Writes that
  // complete cleanly still commit: the sub-group's new state is whole on disk.
  void Drain() {
    (void)reads_.Wait(s_.read_engine());
    (void)FinishWrites();
  }

 private:
  Status SubmitReads(std::size_t t) {
    comm::ScopedTimer submit(s_.timers_, "swap_submit_read_param");
    return Annotate(
        s_.SubmitStateReads(todo_[t], s_.LeaseBuffers(sets_[t % kSets]), s_.read_engine(), &reads_),
        s_.StepContext(step_, todo_[t]) + "swap-in ");
  }

  // Reads (unless read ahead) and verifies todo[t]'s state into `set`.
  Status SwapIn(std::size_t t, const StateBuffers& set) {
    const std::size_t i = todo_[t];
    comm::ScopedTimer swap_in(s_.timers_, "swap_in_param");
    if (!s_.options_.pipeline_read) ZINF_RETURN_IF_ERROR(SubmitReads(t));
    {
      comm::ScopedTimer wait(s_.timers_, "swap_wait_read_param");
      ZINF_RETURN_IF_ERROR(
          Annotate(reads_.Wait(s_.read_engine()), s_.StepContext(step_, i) + "swap-in "));
    }
    return Annotate(s_.VerifyStateReads(i, set), s_.StepContext(step_, i) + "swap-in ");
  }

  // Submits the writes of todo[t]'s new state from `set` (waited for by FinishWrites).
  Status SwapOut(std::size_t t, const StateBuffers& set) {
    const std::size_t i = todo_[t];
    comm::ScopedTimer swap_out(s_.timers_, "swap_out_param");
    comm::ScopedTimer submit(s_.timers_, "swap_submit_write");
    Result<std::size_t> slot =
        s_.SubmitStateWrites(i, set, s_.write_engine(), std::span<IoBatch>(&writes_, 1));
    if (!slot) {
      // The slot is spare again; drain what was submitted before the failure.
      (void)writes_.Wait(s_.write_engine());
      return std::move(slot).error().WithContext(s_.StepContext(step_, i) + "swap-out ");
    }
    write_slot_ = *slot;
    writing_ = t;
    return OkStatus();
  }

  // Waits for the writes in flight; commits and sinks their sub-group if they all succeeded.
  Status FinishWrites() {
    if (!writing_) return OkStatus();
    const std::size_t t = *writing_;
    writing_.reset();
    Status written = OkStatus();
    {
      comm::ScopedTimer wait(s_.timers_, "swap_wait_write_param");
      written = writes_.Wait(s_.write_engine());
    }
    if (!written) {
      s_.Abandon(write_slot_);
      return Annotate(std::move(written), s_.StepContext(step_, todo_[t]) + "swap-out ");
    }
    s_.Commit(todo_[t], write_slot_, step_);
    return Annotate(s_.Sink(todo_[t], s_.LeaseBuffers(sets_[t % kSets]).floats(0),
                            gradient_lease_.bytes(0), sink_),
                    s_.StepContext(step_, todo_[t]));
  }

  // The resident sub-groups step while swapped ones move: a share of them before the first
  // swapped sub-group (while it is read) and after each one (while it is written and the next
  // read), so that their Adam hides behind the I/O instead of preceding it. `work` is a set free
  // until the next reads into it: q8's work copy.
  Status StepResidents(std::size_t slots_left, const PoolLease& work) {
    const std::size_t share = (residents_ + slots_left - 1) / slots_left;
    residents_ -= share;
    return s_.StepResident(step_, source_, sink_, options_, grad_, s_.LeaseBuffers(work), share);
  }

  PipelinedOptimizerSwapper& s_;
  const std::int64_t step_;
  const GradientSource& source_;
  const ParamSink& sink_;
  const StepOptions& options_;
  const std::vector<std::size_t> todo_;
  std::size_t residents_;  // not yet stepped
  std::array<PoolLease, kSets> sets_;
  PoolLease gradient_lease_;
  std::span<float> grad_;
  IoBatch reads_;
  IoBatch writes_;
  std::optional<std::size_t> writing_;  // index into todo_ of the sub-group being written
  std::size_t write_slot_ = 0;
};

Status PipelinedOptimizerSwapper::StepLocal(std::int64_t step, const GradientSource& source,
                                            const ParamSink& sink, const StepOptions& options) {
  Pipeline pipeline(*this, step, source, sink, options);
  ZINF_RETURN_IF_ERROR(pipeline.Allocate());
  Status status = pipeline.Run();
  if (!status) pipeline.Drain();
  return status;
}

}  // namespace zinf::swapper
