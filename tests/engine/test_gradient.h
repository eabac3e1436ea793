// The synthetic gradient of the engine's multi-rank tests (engine_mpi_test, stage3_mpi_test,
// speculative_mpi_test): one formula, so that their runs are comparable.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace zinf::engine::testing {

// Rank `rank`'s gradient of element `k` of parameter `param` in micro-batch `micro` of step
// `step`, at weight `w`: it depends on the weights, so a wrong all-gather shows in the next
// step's gradient. Bounded away from 0 (in [0.025, 0.275] for |w| <= 0.5): where an averaged
// gradient cancels to near 0, Adam's g / sqrt(v) amplifies float-vs-double rounding of the sum
// beyond 1e-6.
inline float GradOf(std::size_t param, std::uint64_t k, int rank, std::int64_t step, int micro,
                    float w) {
  const double phase = 0.37 * static_cast<double>(k) + 1.3 * rank +
                       0.71 * static_cast<double>(step) + 0.13 * micro +
                       0.5 * static_cast<double>(param);
  return static_cast<float>(0.15 + 0.1 * std::sin(phase)) + 0.05f * w;
}

}  // namespace zinf::engine::testing
