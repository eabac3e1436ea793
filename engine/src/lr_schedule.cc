#include "zinf/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace zinf::engine {

double LearningRate(const SchedulerConfig& s, double base_lr, std::int64_t iteration) {
  if (s.type == SchedulerType::kNone) return base_lr;
  if (iteration < 0) return 0.0;
  const auto i = static_cast<double>(iteration);
  const auto warmup = static_cast<double>(std::max<std::int64_t>(2, s.warmup_num_steps));
  const auto total = static_cast<double>(s.total_num_steps);
  auto warm = [&] {
    return s.warmup_type == WarmupType::kLog ? std::log(i + 1.0) / std::log(warmup) : i / warmup;
  };
  switch (s.type) {
    case SchedulerType::kNone:
      return base_lr;
    case SchedulerType::kWarmupLR: {
      const double gamma = i < warmup ? warm() : 1.0;
      return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
    }
    case SchedulerType::kWarmupDecayLR: {
      const double gamma =
          i < warmup ? warm() : std::max(0.0, (total - i) / std::max(1.0, total - warmup));
      return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
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
  }
  return base_lr;
}

}  // namespace zinf::engine
