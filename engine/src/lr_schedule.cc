#include "zinf/engine/lr_schedule.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace zinf::engine {

namespace {

// OneCycle's position at last_batch_iteration `l`: the phase factor f within the cycle, or the
// decay interval d after it.
struct OneCyclePosition {
  bool in_cycle = true;
  double factor = 0;  // f, in the cycle
  double decay = 0;   // d = (l - N + 1) / decay_step_size after it; 0 without decay
};

OneCyclePosition OneCycleAt(const config::SchedulerConfig& s, double l) {
  const double first = s.cycle_first_step_size;
  const double total = first + s.cycle_second_step_size;
  OneCyclePosition at;
  if (l < total) {
    const double ratio = first / total;
    const double b = l + 1.0;  // DeepSpeed's batch_iteration
    const double x = 1.0 + b / total - std::floor(1.0 + b / total);
    at.factor = x <= ratio ? x / ratio : (x - 1.0) / (ratio - 1.0);
    return at;
  }
  at.in_cycle = false;
  if (s.decay_step_size != 0) at.decay = (l - total + 1.0) / s.decay_step_size;
  return at;
}

}  // namespace

double LearningRate(const config::SchedulerConfig& s, double base_lr, std::int64_t iteration) {
  if (s.type == config::SchedulerType::kNone) return base_lr;
  if (iteration < -1) iteration = -1;
  const auto i = static_cast<double>(iteration);
  if (iteration == -1) {  // what the constructors set for the first step
    switch (s.type) {
      case config::SchedulerType::kWarmupLR:
      case config::SchedulerType::kWarmupDecayLR:
        return s.warmup_min_lr;
      case config::SchedulerType::kWarmupCosineLR:
        return 0.0;
      default:
        break;  // OneCycle and LRRangeTest: their formula
    }
  }
  const auto warmup = static_cast<double>(std::max<std::int64_t>(2, s.warmup_num_steps));
  const auto total = static_cast<double>(s.total_num_steps);
  const double max_lr = s.warmup_to_group_lr ? base_lr : s.warmup_max_lr;
  auto warm = [&] {
    return s.warmup_type == config::WarmupType::kLog ? std::log(i + 1.0) / std::log(warmup)
                                                     : i / warmup;
  };
  switch (s.type) {
    case config::SchedulerType::kNone:
      return base_lr;
    case config::SchedulerType::kWarmupLR: {
      const double gamma = i < warmup ? warm() : 1.0;
      return s.warmup_min_lr + (max_lr - s.warmup_min_lr) * gamma;
    }
    case config::SchedulerType::kWarmupDecayLR: {
      const double gamma =
          i < warmup ? warm() : std::max(0.0, (total - i) / std::max(1.0, total - warmup));
      return s.warmup_min_lr + (max_lr - s.warmup_min_lr) * gamma;
    }
    case config::SchedulerType::kWarmupCosineLR: {
      double ratio = 0.0;
      if (i < warmup) {
        ratio = s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warm();
      } else {
        // DeepSpeed lets the cosine rise again after total_num_steps; zinf holds the floor.
        const double progress = std::min(1.0, (i - warmup + 1.0) / (total - warmup));
        const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
        ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
      }
      return base_lr * ratio;
    }
    case config::SchedulerType::kOneCycle: {
      const OneCyclePosition at = OneCycleAt(s, i);
      if (at.in_cycle) return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * at.factor;
      return s.cycle_min_lr / (1.0 + s.decay_lr_rate * at.decay);
    }
    case config::SchedulerType::kLRRangeTest: {
      double interval = (i + 1.0) / s.lr_range_test_step_size;
      if (s.lr_range_test_staircase) interval = std::floor(interval);
      return s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * interval);
    }
  }
  return base_lr;
}

std::array<double, 2> AdamBetas(const config::SchedulerConfig& s, std::array<double, 2> betas,
                                std::int64_t iteration) {
  if (s.type != config::SchedulerType::kOneCycle || !s.cycle_momentum) return betas;
  // DeepSpeed keeps 0.99 as the second beta of every momentum it sets.
  constexpr double kBeta2 = 0.99;
  if (iteration <= -1) return {s.cycle_min_mom, kBeta2};  // OneCycle's constructor
  const OneCyclePosition at = OneCycleAt(s, static_cast<double>(iteration));
  if (at.in_cycle) {
    return {s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * at.factor, kBeta2};
  }
  return {s.cycle_max_mom * (1.0 + s.decay_mom_rate * at.decay), kBeta2};
}

}  // namespace zinf::engine
