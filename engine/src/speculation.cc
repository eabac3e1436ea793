// The speculative step's glue in the engine (engine.h, "Speculative step"; the thread is
// speculator.h): whether Create turns it on and the shape it gives the partition, arming it in
// the last micro-batch, and Step's commit or discard of what was speculated.
#include "engine_impl.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "zinf/core/units.h"

namespace zinf::engine {

bool ZeroEngine::Impl::SpeculationWanted(bool swap_gradients, bool all_resident) const {
  const State& s = *state_;
  const bool lent = s.params.empty() || s.params[0].grads.empty();
  const bool wanted = config_.Gave("zinf.speculative_step") ? config_.zinf.speculative_step : lent;
  return wanted && !swap_gradients && !all_resident;
}

// A sub-group is speculated once all of its gradient has been reduced: sub-groups and reduce
// buckets that are small parts of the partition (about an eighth, not below 4M elements each
// per rank) let the first ones finish early in the backward pass. Keys given stay as given.
void ZeroEngine::Impl::ShapeForSpeculation(std::uint64_t partition_numel) {
  config::ZeroConfig& zero = config_.zero_optimization;
  constexpr std::uint64_t kFloor = 1u << 22;
  const std::uint64_t part =
      std::max<std::uint64_t>(AlignUp(partition_numel / 8, kPartitionAlignmentElems), kFloor);
  if (!config_.Gave("zero_optimization.sub_group_size")) {
    zero.sub_group_size = std::min(zero.sub_group_size, part);
  }
  if (!config_.Gave("zero_optimization.reduce_bucket_size")) {
    zero.reduce_bucket_size =
        std::min(zero.reduce_bucket_size, part * static_cast<std::uint64_t>(world_.size()));
  }
}

// Whether Step's sink (UnpackWeights) writes anything of partition range [offset, + numel):
// the weights held whole, or the shards kept in memory.
bool ZeroEngine::Impl::SinkWrites(std::uint64_t partition_offset, std::uint64_t numel) const {
  const State& s = *state_;
  for (const partition::Fragment& f :
       s.plan->FragmentsInPartitionRange(world_.rank(), partition_offset, numel)) {
    if (s.holding[f.param_index] != Holding::kPartitioned ||
        f.partition_offset + f.numel <= s.shard_numel) {
      return true;
    }
  }
  return false;
}

// The first gradient handed in the step's last micro-batch: from here on each sub-group whose
// gradient is final is stepped ahead, with the step's arguments as Optimize will compute them
// when nothing clips (the loss scale and the schedule as they are now: Step compares).
void ZeroEngine::Impl::ArmSpeculation() {
  State& s = *state_;
  // After a step that clipped the next one is likely to clip too (a norm changes slowly): its
  // speculation would be stepped again, at the cost of its I/O, before this rank's gradients
  // could prove the clip (Speculator::Plan::clip_squared_sum), so it is not speculated.
  if (!s.speculator || s.speculator->armed() || s.last_step_clipped ||
      s.micro_batches + 1 != static_cast<int>(config_.gradient_accumulation_steps)) {
    return;
  }
  const std::int64_t step = step_ + 1;
  Result<std::vector<HyperParams>> hyper = StepHyperParams(step);
  if (!hyper) return;  // Step refuses it
  Speculator::Plan plan;
  plan.step = step;
  plan.segments = StepSegments(*hyper);
  plan.options = StepOptionsFor(StepPlan{.average = Average(), .loss_scale = s.scaler->scale()},
                                step - skipped_steps_);
  // Decide clips when sqrt(sum) x average / scale > gradient_clipping; a hair above that bound,
  // so that another order of summation cannot make a step that does not clip look clipped.
  if (config_.gradient_clipping > 0) {
    const double bound = config_.gradient_clipping * s.scaler->scale() / Average();
    plan.clip_squared_sum = bound * bound * (1 + 1e-6);
  }
  s.speculator->Arm(std::move(plan));
}

void ZeroEngine::Impl::UseSpeculation(const swapper::StepOptions& options, StepInfo* info) {
  State& s = *state_;
  const Speculator::Plan* plan = s.speculator ? s.speculator->plan() : nullptr;
  if (plan == nullptr) return;
  const auto same = [](const swapper::StepOptions& a, const swapper::StepOptions& b) {
    const auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
    return bits(a.grad_scale) == bits(b.grad_scale) && a.adam_step == b.adam_step && a.lr == b.lr &&
           a.betas == b.betas &&
           std::ranges::equal(a.segments, b.segments, [](const auto& x, const auto& y) {
             return x.begin == y.begin && x.hyper == y.hyper;
           });
  };
  if (plan->step == info->step && same(plan->options, options)) {
    for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
      if (!s.swapper->speculated(i)) continue;
      s.swapper->CommitSpeculated(i);
      const std::span<const float> weights = s.speculator->weights(i);
      if (!weights.empty()) {
        const partition::SubGroup& sg = s.swapper->swap_info(i).sub_group;
        s.UnpackWeights(world_.rank(), sg.partition_offset, weights, Working::kFp32, world_.rank());
      }
      ++info->speculation_committed;
    }
  } else {
    info->speculation_redone = s.swapper->num_speculated();
  }
  s.swapper->DiscardSpeculations();
  s.speculator->Disarm();
}

void ZeroEngine::Impl::DiscardSpeculation(StepInfo* info) {
  State& s = *state_;
  if (!s.speculator || !s.speculator->armed()) return;
  (void)s.speculator->Stop();
  if (info != nullptr) info->speculation_discarded = s.swapper->num_speculated();
  s.swapper->DiscardSpeculations();
  s.speculator->Disarm();
}

}  // namespace zinf::engine
