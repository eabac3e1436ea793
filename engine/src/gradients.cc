// The gradient's way in: the reduce buckets (CreateBuckets, gradient_buckets.h), the calls that
// hand gradients to them (GradientReady, AccumulateGradients, DropGradients), and the squared
// norm of this rank's reduced partition gradient (PartitionGradSquaredSum).
#include "engine_impl.h"

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zinf/comm/mpi_session.h"
#include "zinf/core/log.h"
#include "zinf/swapper/gradient_swapper.h"

namespace zinf::engine {

// The buckets the gradients are reduced in (gradient_buckets.h). Local.
Status ZeroEngine::Impl::CreateBuckets() {
  State& s = *state_;
  GradientBuckets::Target target;
  target.gradients = s.swapper->gradient_swapper();
  if (target.gradients != nullptr) {
    target.staging = s.staging.as<float>().first(s.partition_numel);
  } else {
    target.accumulated = s.partition_grad;
  }
  for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
    target.sub_groups.push_back(s.swapper->swap_info(i).sub_group);
  }
  if (s.swapper->options().speculative_slots > 0 && target.gradients == nullptr) {
    std::vector<bool> keep_weights;
    for (const partition::SubGroup& sg : target.sub_groups) {
      keep_weights.push_back(SinkWrites(sg.partition_offset, sg.numel));
    }
    s.speculator =
        std::make_unique<Speculator>(s.swapper.get(), s.partition_grad, std::move(keep_weights));
    target.complete = [spec = s.speculator.get()](std::size_t sub_group, int) {
      spec->Complete(sub_group);
    };
    ZINF_LOG_INFO(
        "engine: speculative step: each swapped sub-group is stepped during the last "
        "micro-batch's backward pass once its gradient is final, into a second slot, and "
        "committed by Step unless clipping or an fp16 skip applies (zinf.speculative_step)");
  }
  // Lent gradients (no grads buffers): none; GradientReady(index, grad) copies each in.
  std::vector<std::span<float>> grads;
  if (!s.params[0].grads.empty()) {
    for (const Param& p : s.params) grads.push_back(p.grads);
  }
  // A worker thread may call MPI while the caller's thread runs its backward pass only when MPI
  // allows calls from several threads, one at a time.
  const comm::ThreadLevel level = comm::ProvidedThreadLevel();
  const bool background =
      level == comm::ThreadLevel::kSerialized || level == comm::ThreadLevel::kMultiple;
  ZINF_ASSIGN_OR_RETURN(s.buckets, GradientBuckets::Create(
                                       *s.plan, world_.rank(), std::move(grads),
                                       config_.zero_optimization.reduce_bucket_size,
                                       s.backend.get(), std::move(target), &s.timers, background));
  ZINF_LOG_INFO(
      "engine: gradient in {} bucket(s) of <= {} elements; gradients handed per "
      "parameter are reduced {}",
      s.buckets->num_buckets(), s.buckets->max_bucket_elems(),
      background ? "on a background thread, overlapping the backward pass"
                 : "in the caller's thread (MPI gives no MPI_THREAD_SERIALIZED; "
                   "MpiSession::Init(..., ThreadLevel::kSerialized) lets them overlap)");
  return OkStatus();
}

// Collective: reduces what the micro-batch has not reduced yet and ends it.
Status ZeroEngine::Impl::HandGradient(int micro_batch) {
  return comm().AgreeOnStatus(state_->buckets->Finish(micro_batch));
}

Status ZeroEngine::Impl::GradientReady(std::size_t index) {
  if (closed_) return FailedPreconditionError("engine: GradientReady after Close");
  ArmSpeculation();
  return state_->buckets->Ready(index, state_->micro_batches);
}

Status ZeroEngine::Impl::GradientReady(std::size_t index, std::span<const float> grad) {
  if (closed_) return FailedPreconditionError("engine: GradientReady after Close");
  ArmSpeculation();
  return state_->buckets->Ready(index, state_->micro_batches, grad);
}

Status ZeroEngine::Impl::AccumulateGradients() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: AccumulateGradients after Close");
  Status calls = OkStatus();
  if (s.micro_batches + 1 >= config_.gradient_accumulation_steps) {
    calls = FailedPreconditionError(fmt::format(
        "engine: step {}: AccumulateGradients called {} times; gradient_accumulation_steps {} "
        "allows {} (Step takes the last micro-batch)",
        step_ + 1, s.micro_batches + 1, config_.gradient_accumulation_steps,
        config_.gradient_accumulation_steps - 1));
  }
  // The micro-batch's reductions come first, so that no rank enters another collective while
  // some rank's buckets are still being reduced.
  const Status handed = HandGradient(s.micro_batches);
  Status agreed = comm().AgreeOnCall("AccumulateGradients", calls);
  if (agreed && !handed) agreed = handed;
  if (!agreed) {
    DiscardSpeculation(nullptr);
    // Refused: the step's gradient is dropped, so that the loop goes on with a clean step
    // instead of adding this micro-batch twice. (A write-behind error of the dropped gradient
    // is dropped with it; a failing store fails the next write again.)
    (void)ForgetStepGradient();
    return agreed;
  }
  ++s.micro_batches;
  return OkStatus();
}

// The step's gradient forgotten: the next micro-batch is 0 again, which overwrites the reduced
// partition gradient; with zinf.swap_gradients the dropped micro-batch's write-behind is waited
// for, so that none of it lands after the next micro-batch 0's writes to the same sub-groups.
Status ZeroEngine::Impl::ForgetStepGradient() {
  State& s = *state_;
  s.micro_batches = 0;
  swapper::GradientSwapper* gradients = s.swapper->gradient_swapper();
  return gradients != nullptr ? gradients->Flush() : OkStatus();
}

Status ZeroEngine::Impl::DropGradients() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: DropGradients after Close");
  // The micro-batch's reductions first (as AccumulateGradients), then it is forgotten.
  const Status handed = HandGradient(s.micro_batches);
  DiscardSpeculation(nullptr);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("DropGradients", ForgetStepGradient()));
  return handed;
}

// The squared L2 norm of this rank's reduced partition gradient.
Result<double> ZeroEngine::Impl::PartitionGradSquaredSum() {
  State& s = *state_;
  double sum = 0;
  // The Adam threads' SIMD sum: the same bits on every path and thread count (cpu_adam.h).
  auto add = [&sum, &s](std::span<const float> g) { sum += s.swapper->adam().SquaredL2Norm(g); };
  swapper::GradientSwapper* gradients = s.swapper->gradient_swapper();
  if (gradients == nullptr) {
    add(s.partition_grad);
    return sum;
  }
  // The accumulated gradient is in the gradient swapper: read it once through one pool buffer.
  ZINF_RETURN_IF_ERROR(s.swapper->FlushGradients());
  Status local = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(
        swapper::PoolLease lease,
        s.swapper->pool().Allocate(s.swapper->sub_groups().max_sub_group_numel(), 1));
    for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
      std::span<float> g = lease.floats(0).first(s.swapper->swap_info(i).sub_group.numel);
      ZINF_RETURN_IF_ERROR(gradients->SwapIn(i, g));
      add(g);
    }
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(local));
  return sum;
}

}  // namespace zinf::engine
