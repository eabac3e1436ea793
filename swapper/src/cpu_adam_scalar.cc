// The reference kernel: one element at a time, in the order documented in cpu_adam.h.
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu_adam_kernels.h"
#include "zinf/swapper/cpu_adam.h"

namespace zinf::swapper::internal {

void AdamStepScalar(const AdamScalars& s, const AdamArrays& a, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    float g = a.grad[i];
    if (s.scale_grad) g = g * s.grad_scale;
    float p = a.param[i];
    if (s.use_l2) g = g + s.l2_decay * p;
    if (s.use_param_decay) p = p * s.param_decay;
    const float m = s.beta1 * a.exp_avg[i] + s.one_minus_beta1 * g;
    const float v = s.beta2 * a.exp_avg_sq[i] + (s.one_minus_beta2 * g) * g;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    float v_hat = v;
    if (a.max_exp_avg_sq != nullptr) {
      // torch.maximum: NaN in either operand wins; ties keep v.
      const float old_max = a.max_exp_avg_sq[i];
      v_hat = (old_max > v || std::isnan(old_max)) ? old_max : v;
      a.max_exp_avg_sq[i] = v_hat;
    }
    const float denom = std::sqrt(v_hat) / s.bc2_sqrt + s.eps;
    p = p - (s.step_size * m) / denom;
    a.param[i] = p;
    if (a.bf16 != nullptr) a.bf16[i] = FloatBitsToBf16(std::bit_cast<std::uint32_t>(p));
  }
}

double SquaredNormBlockScalar(const float* x, std::size_t n) {
  double lanes[kNormLanes] = {};
  AccumulateNormLanes(x, 0, n, lanes);
  return SumNormLanes(lanes);
}

}  // namespace zinf::swapper::internal
