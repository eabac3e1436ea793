// DeepSpeed's learning-rate schedules (the `scheduler` block of the config).
//
//   const double lr = LearningRate(config.scheduler, config.optimizer.lr, step - 1);
//
// Thread safety: a pure function.
#pragma once

#include <array>
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
//   OneCycle:        DeepSpeed's OneCycle. With F = cycle_first_step_size, S =
//   cycle_second_step_size,
//                    N = F + S, r = F / N and, for i <= N (the cycle),
//                    x = 1 + i / N - floor(1 + i / N),  f = x <= r ? x / r : (x - 1) / (r - 1):
//                      lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * f
//                    after it (i > N), with d = (i - N) / decay_step_size:
//                      lr = cycle_min_lr / (1 + decay_lr_rate * d)   (cycle_min_lr when
//                      decay_step_size or decay_lr_rate is 0)
//   LRRangeTest:     lr_range_test_min_lr * (1 + lr_range_test_step_rate * i / step_size), with
//                    floor(i / step_size) when lr_range_test_staircase
// A negative iteration gives 0 (DeepSpeed's value before the first scheduler step; OneCycle and
// LRRangeTest: their formula at i = 0). One difference: past total_num_steps DeepSpeed's cosine
// rises again (its progress exceeds 1); zinf holds the floor c (the min(1, ...) above).
double LearningRate(const SchedulerConfig& scheduler, double base_lr, std::int64_t iteration);

// Adam's betas for the optimizer step after `iteration` scheduler steps: `betas` (the
// optimizer's) except under OneCycle with cycle_momentum, where DeepSpeed sets
// (beta1, 0.99) with beta1 = cycle_min_mom at i = 0 (its constructor), then within the cycle
//   beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * f    (f as above)
// and after it beta1 = cycle_max_mom * (1 + decay_mom_rate * d) (cycle_max_mom without decay).
// DeepSpeed's values, quirks included: beta2 becomes 0.99, and a decaying beta1 grows; a beta1
// that reaches 1 is the caller's error (the optimizer refuses it).
std::array<double, 2> AdamBetas(const SchedulerConfig& scheduler, std::array<double, 2> betas,
                                std::int64_t iteration);

}  // namespace zinf::engine
