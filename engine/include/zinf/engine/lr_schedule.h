// DeepSpeed's learning-rate schedules (the `scheduler` block of the config).
//
//   const double lr = LearningRate(config.scheduler, config.optimizer.lr, step - 1);
//
// Thread safety: a pure function.
#pragma once

#include <cstdint>

#include "zinf/engine/config.h"

namespace zinf::engine {

// DeepSpeed's learning-rate schedules, deepspeed/runtime/lr_schedules.py. `iteration` is the
// scheduler's last_batch_iteration: the number of scheduler steps taken before this optimizer
// step (the engine passes step - 1 for its 1-based step). With w = max(2, warmup_num_steps),
// i = iteration, warm(i) = log(i + 1) / log(w) ("log") or i / w ("linear"):
//   kNone:           base_lr
//   WarmupLR:        min + (max - min) * (i < w ? warm(i) : 1)                (absolute lrs)
//   WarmupDecayLR:   min + (max - min) * (i < w ? warm(i)
//                                         : max(0, (T - i) / max(1, T - w)))  (T = total)
//   WarmupCosineLR:  base_lr * ratio, r0 = warmup_min_ratio, c = cos_min_ratio,
//                    ratio = i < w ? r0 + (1 - r0) * warm(i)
//                                  : max(0, c + (1 - c) * (1 + cos(pi * p)) / 2),
//                    p = min(1, (i - w + 1) / (T - w))
// A negative iteration gives 0 (DeepSpeed's value before the first scheduler step). One
// difference: past total_num_steps DeepSpeed's cosine rises again (its progress exceeds 1);
// zinf holds the floor c (the min(1, ...) above).
double LearningRate(const SchedulerConfig& scheduler, double base_lr, std::int64_t iteration);

}  // namespace zinf::engine
