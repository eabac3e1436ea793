// AVX2 kernel: 8 floats at a time; the tail (< 8 elements) goes through the scalar kernel, which
// performs the same operations. Only this file's kernels are compiled for AVX2 (target
// attribute), so no AVX2 code can leak into inline functions shared with other translation units.
// GCC 12 warns inside its own intrinsics (_mm256_undefined_* as a pass-through operand); the
// pragma must cover the header lines where the warning points.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "cpu_adam_kernels.h"

namespace zinf::swapper::internal {
namespace {

#define ZINF_AVX2_TARGET __attribute__((target("avx2")))

// Round-to-nearest-even float -> bf16 in integer arithmetic (see FloatBitsToBf16); returns the
// 8 results packed as uint16 in order.
ZINF_AVX2_TARGET inline __m128i ToBf16(__m256 p) {
  const __m256i bits = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

}  // namespace

ZINF_AVX2_TARGET void AdamStepAvx2(const AdamScalars& s, const AdamArrays& a, std::size_t begin,
                                   std::size_t end) {
  const __m256 beta1 = _mm256_set1_ps(s.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 step_size = _mm256_set1_ps(s.step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps);
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale);
  const __m256 l2_decay = _mm256_set1_ps(s.l2_decay);
  const __m256 param_decay = _mm256_set1_ps(s.param_decay);
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_loadu_ps(a.grad + i);
    if (s.scale_grad) g = _mm256_mul_ps(g, grad_scale);
    __m256 p = _mm256_loadu_ps(a.param + i);
    if (s.use_l2) g = _mm256_add_ps(g, _mm256_mul_ps(l2_decay, p));
    if (s.use_param_decay) p = _mm256_mul_ps(p, param_decay);
    const __m256 m = _mm256_add_ps(_mm256_mul_ps(beta1, _mm256_loadu_ps(a.exp_avg + i)),
                                   _mm256_mul_ps(one_minus_beta1, g));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(beta2, _mm256_loadu_ps(a.exp_avg_sq + i)),
                                   _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    __m256 v_hat = v;
    if (a.max_exp_avg_sq != nullptr) {
      const __m256 old_max = _mm256_loadu_ps(a.max_exp_avg_sq + i);
      // max_ps(x, y) = x > y ? x : y, y when either is NaN; then a NaN old_max wins too.
      v_hat = _mm256_blendv_ps(_mm256_max_ps(old_max, v), old_max,
                               _mm256_cmp_ps(old_max, old_max, _CMP_UNORD_Q));
      _mm256_storeu_ps(a.max_exp_avg_sq + i, v_hat);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bc2_sqrt), eps);
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
    _mm256_storeu_ps(a.param + i, p);
    if (a.bf16 != nullptr) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.bf16 + i), ToBf16(p));
    }
  }
  if (i < end) AdamStepScalar(s, a, i, end);
}

ZINF_AVX2_TARGET double SquaredNormBlockAvx2(const float* x, std::size_t n) {
  // acc[k] holds lanes 4k .. 4k+3.
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  std::size_t i = 0;
  for (; i + kNormLanes <= n; i += kNormLanes) {
    for (int k = 0; k < 4; ++k) {
      const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * k));
      acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d, d));
    }
  }
  alignas(32) double lanes[kNormLanes];
  for (int k = 0; k < 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
  AccumulateNormLanes(x, i, n, lanes);
  return SumNormLanes(lanes);
}

}  // namespace zinf::swapper::internal
