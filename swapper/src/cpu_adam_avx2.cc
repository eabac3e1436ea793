// AVX2 kernel: 8 floats at a time; the tail (< 8 elements) goes through the scalar kernel, which
// performs the same operations. Only this file's kernels are compiled for AVX2 (target
// attribute), so no AVX2 code can leak into inline functions shared with other translation units.
// GCC 12 warns inside its own intrinsics (_mm256_undefined_* as a pass-through operand); the
// pragma must cover the header lines where the warning points.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu_adam_kernels.h"
#include "q8_avx2_codes.h"

namespace zinf::swapper::internal {
namespace {

#define ZINF_AVX2_TARGET __attribute__((target("avx2")))
// For the q8 step's per-vector helpers, which GCC would otherwise leave as calls.
#define ZINF_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

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

namespace {

struct Avx2Scalars {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_scale,
      l2_decay, param_decay;
};

ZINF_AVX2_TARGET inline Avx2Scalars Broadcast(const AdamScalars& s) {
  return {_mm256_set1_ps(s.beta1),     _mm256_set1_ps(s.one_minus_beta1),
          _mm256_set1_ps(s.beta2),     _mm256_set1_ps(s.one_minus_beta2),
          _mm256_set1_ps(s.step_size), _mm256_set1_ps(s.bc2_sqrt),
          _mm256_set1_ps(s.eps),       _mm256_set1_ps(s.grad_scale),
          _mm256_set1_ps(s.l2_decay),  _mm256_set1_ps(s.param_decay)};
}

// Eight elements at i with the old moments m_old, v_old: stores param (and bf16,
// max_exp_avg_sq) and the new moments to a.exp_avg, a.exp_avg_sq; returns them in *m, *v.
ZINF_AVX2_TARGET inline void Step8(const AdamScalars& s, const Avx2Scalars& k, const AdamArrays& a,
                                   std::size_t i, __m256 m_old, __m256 v_old, __m256* m_new,
                                   __m256* v_new) {
  __m256 g = _mm256_loadu_ps(a.grad + i);
  if (s.scale_grad) g = _mm256_mul_ps(g, k.grad_scale);
  __m256 p = _mm256_loadu_ps(a.param + i);
  if (s.use_l2) g = _mm256_add_ps(g, _mm256_mul_ps(k.l2_decay, p));
  if (s.use_param_decay) p = _mm256_mul_ps(p, k.param_decay);
  const __m256 m =
      _mm256_add_ps(_mm256_mul_ps(k.beta1, m_old), _mm256_mul_ps(k.one_minus_beta1, g));
  const __m256 v = _mm256_add_ps(_mm256_mul_ps(k.beta2, v_old),
                                 _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g));
  _mm256_storeu_ps(a.exp_avg + i, m);
  _mm256_storeu_ps(a.exp_avg_sq + i, v);
  *m_new = m;
  *v_new = v;
  __m256 v_hat = v;
  if (a.max_exp_avg_sq != nullptr) {
    const __m256 old_max = _mm256_loadu_ps(a.max_exp_avg_sq + i);
    // max_ps(x, y) = x > y ? x : y, y when either is NaN; then a NaN old_max wins too.
    v_hat = _mm256_blendv_ps(_mm256_max_ps(old_max, v), old_max,
                             _mm256_cmp_ps(old_max, old_max, _CMP_UNORD_Q));
    _mm256_storeu_ps(a.max_exp_avg_sq + i, v_hat);
  }
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), k.bc2_sqrt), k.eps);
  p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(k.step_size, m), denom));
  _mm256_storeu_ps(a.param + i, p);
  if (a.bf16 != nullptr) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.bf16 + i), ToBf16(p));
  }
}

}  // namespace

ZINF_AVX2_TARGET void AdamStepAvx2(const AdamScalars& s, const AdamArrays& a, std::size_t begin,
                                   std::size_t end) {
  const Avx2Scalars k = Broadcast(s);
  std::size_t i = begin;
  __m256 m, v;
  for (; i + 8 <= end; i += 8) {
    Step8(s, k, a, i, _mm256_loadu_ps(a.exp_avg + i), _mm256_loadu_ps(a.exp_avg_sq + i), &m, &v);
  }
  if (i < end) AdamStepScalar(s, a, i, end);
}

namespace {

// map[codes[0, 8)] by scalar loads and inserts: on this AMD Zen 5 a third of the time of
// vgatherdps (0.2 against 0.55 ns per element).
ZINF_AVX2_TARGET inline __m256 Lookup8(const float* map, const std::uint8_t* codes) {
  return _mm256_set_m128(_mm_setr_ps(map[codes[4]], map[codes[5]], map[codes[6]], map[codes[7]]),
                         _mm_setr_ps(map[codes[0]], map[codes[1]], map[codes[2]], map[codes[3]]));
}

// The block's largest |new moment| per lane, and whether one was not finite.
struct Q8Tops {
  __m256 m, v;
  __m256i bad;
};

// Eight elements of a q8 block at i (AdamStepQ8BlockAvx2): decodes the old moments, steps them,
// stores the new ones to the scratch and folds them into *tops.
ZINF_AVX2_INLINE void StepQ8Lanes(const AdamScalars& s, const Avx2Scalars& k, const AdamArrays& a,
                                  const Q8BlockIn& in, __m256 m_scale, __m256 v_scale,
                                  std::size_t i, Q8Tops* tops) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  __m256 m, v;
  Step8(s, k, a, i, _mm256_mul_ps(Lookup8(in.m_map, in.m_codes + i), m_scale),
        _mm256_mul_ps(Lookup8(in.v_map, in.v_codes + i), v_scale), &m, &v);
  const __m256i m_abs = _mm256_and_si256(_mm256_castps_si256(m), abs_mask);
  const __m256i v_abs = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
  tops->bad = _mm256_or_si256(tops->bad, _mm256_or_si256(_mm256_cmpgt_epi32(m_abs, max_finite),
                                                         _mm256_cmpgt_epi32(v_abs, max_finite)));
  tops->m = _mm256_max_ps(tops->m, _mm256_castsi256_ps(m_abs));
  tops->v = _mm256_max_ps(tops->v, _mm256_castsi256_ps(v_abs));
}

// The block before, to encode during the step (Q8BlockOut): its tables and scales in registers.
struct Q8Encoders {
  Q8BlockOut out;  // no elements where there is no block before
  q8::internal::avx2::Entries m_entries, v_entries;
  q8::internal::avx2::Scale m_scale, v_scale;
};

ZINF_AVX2_TARGET inline Q8Encoders EncodersOf(const Q8BlockOut* previous) {
  if (previous == nullptr) {
    Q8Encoders none{};
    return none;
  }
  return {*previous, q8::internal::avx2::EntriesOf(*previous->m_tables),
          q8::internal::avx2::EntriesOf(*previous->v_tables),
          q8::internal::avx2::ScaleOf(previous->m_scale),
          q8::internal::avx2::ScaleOf(previous->v_scale)};
}

// The codes of the block before's elements [i, i + 8).
ZINF_AVX2_INLINE void EncodeQ8Lanes(const Q8Encoders& e, std::size_t i) {
  q8::internal::avx2::Encode8(e.m_entries, e.m_scale, _mm256_loadu_ps(e.out.m + i),
                              e.out.m_codes + i);
  q8::internal::avx2::Encode8(e.v_entries, e.v_scale, _mm256_loadu_ps(e.out.v + i),
                              e.out.v_codes + i);
}

// The block before's codes from element i on (a multiple of 8), after the step has gone past
// its end: the block encoder's codes for the rest, which it encodes alone.
void EncodeRest(const Q8BlockOut& out, std::size_t i) {
  if (i >= out.n) return;  // also where there is no block before: its tables are null
  q8::internal::EncodeBlockAvx2(*out.m_tables, out.m + i, out.n - i, out.m_scale, out.m_codes + i);
  q8::internal::EncodeBlockAvx2(*out.v_tables, out.v + i, out.n - i, out.v_scale, out.v_codes + i);
}

}  // namespace

ZINF_AVX2_TARGET bool AdamStepQ8BlockAvx2(const AdamScalars& scalars, const AdamArrays& arrays,
                                          const Q8BlockIn& block, std::size_t n, float* m_max,
                                          float* v_max, const Q8BlockOut* previous) {
  // Local copies: the stores through float* could alias the callers' structs, which would be
  // read again for every vector.
  const AdamScalars s = scalars;
  const AdamArrays a = arrays;
  const Q8BlockIn in = block;
  const Avx2Scalars k = Broadcast(s);
  const __m256 m_scale = _mm256_set1_ps(in.m_scale);
  const __m256 v_scale = _mm256_set1_ps(in.v_scale);
  const Q8Encoders encoders = EncodersOf(previous);
  Q8Tops tops = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_si256()};
  // The step and the encoding side by side as far as both go, then each alone.
  const std::size_t both = std::min(n, encoders.out.n) / 8 * 8;
  std::size_t i = 0;
  for (; i < both; i += 8) {
    StepQ8Lanes(s, k, a, in, m_scale, v_scale, i, &tops);
    EncodeQ8Lanes(encoders, i);
  }
  EncodeRest(encoders.out, i);
  for (; i + 8 <= n; i += 8) StepQ8Lanes(s, k, a, in, m_scale, v_scale, i, &tops);
  alignas(32) float lanes[2][8];
  _mm256_store_ps(lanes[0], tops.m);
  _mm256_store_ps(lanes[1], tops.v);
  float m_big = *std::max_element(lanes[0], lanes[0] + 8);
  float v_big = *std::max_element(lanes[1], lanes[1] + 8);
  bool ok = _mm256_testz_si256(tops.bad, tops.bad);
  if (i < n) {  // the tail, as the scalar kernel steps it
    for (std::size_t j = i; j < n; ++j) {
      a.exp_avg[j] = in.m_map[in.m_codes[j]] * in.m_scale;
      a.exp_avg_sq[j] = in.v_map[in.v_codes[j]] * in.v_scale;
    }
    AdamStepScalar(s, a, i, n);
    for (std::size_t j = i; j < n; ++j) {
      ok = ok && std::isfinite(a.exp_avg[j]) && std::isfinite(a.exp_avg_sq[j]);
      m_big = std::max(m_big, std::fabs(a.exp_avg[j]));
      v_big = std::max(v_big, std::fabs(a.exp_avg_sq[j]));
    }
  }
  *m_max = m_big;
  *v_max = v_big;
  return ok;
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
