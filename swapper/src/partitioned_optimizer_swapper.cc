#include "zinf/swapper/partitioned_optimizer_swapper.h"

#include <array>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "optimizer_swapper_internal.h"

namespace zinf::swapper {

PartitionedOptimizerSwapper::PartitionedOptimizerSwapper(Parts&& parts)
    : OptimizerSwapper("partitioned", std::move(parts)) {}

// One step's rotation of the n + 1 lease buffers over the swapped sub-groups `todo` (n slot
// tensors; see the header). role_[t] is the buffer holding slot tensor t of the sub-group in
// hand, grad_ the one holding its gradient; the roles rotate from one sub-group to the next.
class PartitionedOptimizerSwapper::Rotation {
 public:
  Rotation(PartitionedOptimizerSwapper& swapper, std::int64_t step, const GradientSource& source,
           const ParamSink& sink, const StepOptions& options)
      : s_(swapper),
        step_(step),
        source_(source),
        sink_(sink),
        options_(options),
        todo_(swapper.SwappedTodo(step)),
        n_(swapper.num_slot_tensors()),
        q8_(swapper.options_.state_format == StateFormat::kQ8) {}

  Status Allocate() {
    // With every sub-group resident (device cpu) fp32 needs only the gradient's buffer.
    const std::size_t count = todo_.empty() && !q8_ ? 1 : n_ + 1;
    ZINF_ASSIGN_OR_RETURN(lease_, s_.pool_->Allocate(s_.sub_groups_.max_sub_group_numel(), count));
    for (std::size_t t = 0; t < n_; ++t) role_[t] = t;
    grad_ = count - 1;
    return OkStatus();
  }

  Status Run() {
    // Resident sub-groups step while the first swapped one is read; q8's need the state
    // buffers as their work copy, so they step before.
    if (q8_) {
      ZINF_RETURN_IF_ERROR(
          s_.StepResident(step_, source_, sink_, options_, lease_.floats(grad_), Buffers()));
    }
    if (!todo_.empty()) {
      for (std::size_t t = 0; t < n_; ++t) ZINF_RETURN_IF_ERROR(SubmitRead(todo_[0], t, role_[t]));
    }
    if (!q8_) {
      ZINF_RETURN_IF_ERROR(
          s_.StepResident(step_, source_, sink_, options_, lease_.floats(grad_), {}));
    }
    for (std::size_t k = 0; k < todo_.size(); ++k) {
      const std::size_t i = todo_[k];
      ZINF_RETURN_IF_ERROR(SwapIn(i));
      ZINF_RETURN_IF_ERROR(Adam(i));
      ZINF_RETURN_IF_ERROR(SwapOut(i));
      if (k + 1 == todo_.size()) break;
      ZINF_RETURN_IF_ERROR(SwapInNext(todo_[k + 1]));
    }
    return FinishWrites();
  }

  // After a failure: nothing may go back to the pool under an I/O in flight. Writes that
  // complete cleanly still commit: the sub-group's new state is whole on disk.
  void Drain() {
    if (s_.read_engine_) (void)s_.read_engine().WaitAll();
    (void)FinishWrites();
  }

 private:
  StateBuffers Buffers() const {
    StateBuffers b;
    for (std::size_t t = 0; t < n_; ++t) b.tensors[t] = lease_.bytes(role_[t]);
    return b;
  }

  Status SubmitRead(std::size_t i, std::size_t t, std::size_t buffer) {
    comm::ScopedTimer submit(s_.timers_, "swap_submit_read_param");
    return Annotate(s_.SubmitStateRead(i, t, lease_.bytes(buffer), s_.read_engine(), &reads_[t]),
                    s_.StepContext(step_, i) + "swap-in ");
  }

  // Waits for sub-group i's reads (submitted while the sub-group before was written) and
  // verifies them.
  Status SwapIn(std::size_t i) {
    {
      comm::ScopedTimer swap_in(s_.timers_, "swap_in_param");
      comm::ScopedTimer wait(s_.timers_, "swap_wait_read_param");
      for (std::size_t t = 0; t < n_; ++t) {
        ZINF_RETURN_IF_ERROR(Annotate(reads_[t].WaitFor(s_.read_engine(), &read_seen_),
                                      s_.StepContext(step_, i) + "swap-in "));
      }
    }
    return Annotate(s_.VerifyStateReads(i, Buffers()), s_.StepContext(step_, i) + "swap-in ");
  }

  // Fills sub-group i's gradient (unless SwapInNext did) and runs Adam on its state.
  Status Adam(std::size_t i) {
    if (!gradient_ready_) {
      Result<std::span<const float>> g = s_.Gradient(i, source_, lease_.floats(grad_));
      if (!g) return std::move(g).error().WithContext(s_.StepContext(step_, i));
      gradient_ = *g;
    }
    gradient_ready_ = false;
    return Annotate(s_.Compute(step_, i, Buffers(), gradient_, options_), s_.StepContext(step_, i));
  }

  // Submits the writes of sub-group i's new state, fp32 last (see the header); waited for by
  // WaitWrite and FinishWrites.
  Status SwapOut(std::size_t i) {
    comm::ScopedTimer swap_out(s_.timers_, "swap_out_param");
    comm::ScopedTimer submit(s_.timers_, "swap_submit_write");
    std::array<std::size_t, kNumStateTensors> order{};
    for (std::size_t t = 1; t < n_; ++t) order[t - 1] = t;
    order[n_ - 1] = 0;
    Result<std::size_t> slot = s_.SubmitStateWrites(i, Buffers(), s_.write_engine(),
                                                    std::span<IoBatch>(writes_.data(), n_),
                                                    std::span<const std::size_t>(order.data(), n_));
    if (!slot) {
      // The slot is spare again; drain what was submitted before the failure.
      for (std::size_t t = 0; t < n_; ++t) {
        (void)writes_[t].WaitFor(s_.write_engine(), &write_seen_);
      }
      return std::move(slot).error().WithContext(s_.StepContext(step_, i) + "swap-out ");
    }
    write_slot_ = *slot;
    writing_ = i;
    return OkStatus();
  }

  // While the sub-group in hand is written: reads sub-group j into the buffers its writes free,
  // commits the sub-group in hand, rotates the roles and fills j's gradient.
  Status SwapInNext(std::size_t j) {
    ZINF_RETURN_IF_ERROR(SubmitRead(j, 1, grad_));
    for (std::size_t t = 2; t < n_; ++t) {
      // A failed write is reported by FinishWrites, which abandons the slot.
      if (!WaitWrite(t - 1)) break;
      ZINF_RETURN_IF_ERROR(SubmitRead(j, t, role_[t - 1]));
    }
    ZINF_RETURN_IF_ERROR(FinishWrites());
    ZINF_RETURN_IF_ERROR(SubmitRead(j, 0, role_[0]));
    std::array<std::size_t, kNumStateTensors> next = role_;
    next[1] = grad_;
    for (std::size_t t = 2; t < n_; ++t) next[t] = role_[t - 1];
    grad_ = role_[n_ - 1];
    role_ = next;
    Result<std::span<const float>> g = s_.Gradient(j, source_, lease_.floats(grad_));
    if (!g) return std::move(g).error().WithContext(s_.StepContext(step_, j));
    gradient_ = *g;
    gradient_ready_ = true;
    return OkStatus();
  }

  // Waits for the writes of slot tensor t of `writing_`; the first failure among them.
  Status WaitWrite(std::size_t t) {
    comm::ScopedTimer wait(s_.timers_, "swap_wait_write_param");
    Status one = writes_[t].WaitFor(s_.write_engine(), &write_seen_);
    if (write_status_ && !one) write_status_ = std::move(one);
    return write_status_;
  }

  // Waits for the writes of `writing_`; commits and sinks it if they all succeeded.
  Status FinishWrites() {
    if (!writing_) return OkStatus();
    const std::size_t i = *writing_;
    writing_.reset();
    for (std::size_t t = 0; t < n_; ++t) (void)WaitWrite(t);
    Status written = std::exchange(write_status_, OkStatus());
    if (!written) {
      s_.Abandon(write_slot_);
      return Annotate(std::move(written), s_.StepContext(step_, i) + "swap-out ");
    }
    s_.Commit(i, write_slot_, step_);
    return Annotate(s_.Sink(i, Buffers().floats(0), lease_.bytes(role_[n_ - 1]), sink_),
                    s_.StepContext(step_, i));
  }

  PartitionedOptimizerSwapper& s_;
  const std::int64_t step_;
  const GradientSource& source_;
  const ParamSink& sink_;
  const StepOptions& options_;
  const std::vector<std::size_t> todo_;
  const std::size_t n_;  // slot tensors
  const bool q8_;
  PoolLease lease_;
  std::array<std::size_t, kNumStateTensors> role_{};
  std::size_t grad_ = 0;
  std::array<IoBatch, kNumStateTensors> reads_;
  std::array<IoBatch, kNumStateTensors> writes_;
  Completions read_seen_;
  Completions write_seen_;
  std::optional<std::size_t> writing_;  // the sub-group whose writes are in flight
  std::size_t write_slot_ = 0;
  bool gradient_ready_ = false;  // gradient_ is the gradient of the sub-group in hand
  std::span<const float> gradient_;
  Status write_status_ = OkStatus();  // the first failure among the writes of writing_
};

Status PartitionedOptimizerSwapper::StepLocal(std::int64_t step, const GradientSource& source,
                                              const ParamSink& sink, const StepOptions& options) {
  Rotation rotation(*this, step, source, sink, options);
  ZINF_RETURN_IF_ERROR(rotation.Allocate());
  Status status = rotation.Run();
  if (!status) rotation.Drain();
  return status;
}

}  // namespace zinf::swapper
