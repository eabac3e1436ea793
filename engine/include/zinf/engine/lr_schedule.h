// DeepSpeed's learning-rate schedules (the `scheduler` block of the config).
//
//   // The optimizer step that is the k-th applied step (1-based) uses
//   const double lr = LearningRate(config.scheduler, config.optimizer.lr, k - 2);
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstdint>

#include "zinf/config/config.h"

namespace zinf::engine {

// DeepSpeed's learning-rate schedules, deepspeed/runtime/lr_schedules.py, at the scheduler's
// `last_batch_iteration` L. DeepSpeed builds the scheduler at L = -1, which sets the learning
// rate of the first optimizer step, and steps it (L += 1) after every applied optimizer step:
// the k-th applied step runs at L = k - 2 (ZeroEngine passes that; steps skipped for an fp16
// overflow do not step the schedule). With w = max(2, warmup_num_steps), warm(L) = log(L + 1) /
// log(w) ("log") or L / w ("linear"), for L >= 0:
//   kNone:           base_lr
//   WarmupLR:        min + (max - min) * (L < w ? warm(L) : 1)                (absolute lrs;
//                    max = base_lr when warmup_max_lr was not given: DeepSpeed >= 0.17.2)
//   WarmupDecayLR:   min + (max - min) * (L < w ? warm(L)
//                                         : max(0, (T - L) / max(1, T - w)))  (T = total)
//   WarmupCosineLR:  base_lr * ratio, r0 = warmup_min_ratio, c = cos_min_ratio,
//                    ratio = L < w ? r0 + (1 - r0) * warm(L)
//                                  : max(0, c + (1 - c) * (1 + cos(pi * p)) / 2),
//                    p = min(1, (L - w + 1) / (T - w))
//   OneCycle:        with F = cycle_first_step_size, S = cycle_second_step_size, N = F + S,
//                    r = F / N and b = L + 1: while L < N (the cycle)
//                      x = 1 + b / N - floor(1 + b / N),  f = x <= r ? x / r : (x - 1) / (r - 1)
//                      lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * f
//                    after it, with d = (L - N + 1) / decay_step_size:
//                      lr = cycle_min_lr / (1 + decay_lr_rate * d)   (cycle_min_lr when
//                      decay_step_size or decay_lr_rate is 0)
//   LRRangeTest:     lr_range_test_min_lr * (1 + lr_range_test_step_rate * (L + 1) / size),
//                    with floor((L + 1) / size) when lr_range_test_staircase
// At L = -1 (and below), what DeepSpeed's constructors set: warmup_min_lr (WarmupLR,
// WarmupDecayLR), 0 (WarmupCosineLR), the formula (OneCycle: cycle_min_lr; LRRangeTest:
// min_lr). One difference: past total_num_steps DeepSpeed's cosine rises again (its progress
// exceeds 1); zinf holds the floor c (the min(1, ...) above).
double LearningRate(const config::SchedulerConfig& scheduler, double base_lr,
                    std::int64_t last_batch_iteration);

// Adam's betas at the scheduler's `last_batch_iteration` (as LearningRate): `betas` (the
// optimizer's) except under OneCycle with cycle_momentum, where DeepSpeed sets (beta1, 0.99):
// beta1 = cycle_min_mom at L = -1 (its constructor), then within the cycle
//   beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * f    (f as above)
// and after it beta1 = cycle_max_mom * (1 + decay_mom_rate * d) (cycle_max_mom without decay).
// DeepSpeed's values, quirks included: beta2 becomes 0.99, and a decaying beta1 grows; a beta1
// that reaches 1 is an error of the step (CpuAdam refuses it).
std::array<double, 2> AdamBetas(const config::SchedulerConfig& scheduler, std::array<double, 2> betas,
                                std::int64_t last_batch_iteration);

}  // namespace zinf::engine
