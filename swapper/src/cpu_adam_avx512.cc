// AVX-512 kernel: 16 floats at a time, the tail with masked loads and stores (lanes past the end
// compute on zeros and are never stored). Only the kernels carry the target attribute, so no
// AVX-512 code leaks into inline functions shared with other translation units.
// GCC 12 warns inside its own intrinsics (_mm512_undefined_* as a pass-through operand); the
// pragma must cover the header lines where the warning points.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "cpu_adam_kernels.h"

namespace zinf::swapper::internal {
namespace {

#define ZINF_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// Round-to-nearest-even float -> bf16 in integer arithmetic (see FloatBitsToBf16).
// vcvtneps2bf16 would be shorter but flushes denormal inputs to zero.
ZINF_AVX512_TARGET inline __m512i ToBf16(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40));
}

struct Avx512Scalars {
  __m512 beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_scale,
      l2_decay, param_decay;
};

// One vector of 16 elements at i with the old moments m_old, v_old (already loaded); `mask`
// selects the lanes that exist. Stores param (and bf16, max_exp_avg_sq); returns the new moments
// in *m_new, *v_new for the caller to store.
ZINF_AVX512_TARGET inline void Step16Moments(const AdamScalars& s, const Avx512Scalars& k,
                                             const AdamArrays& a, std::size_t i, __mmask16 mask,
                                             __m512 m_old, __m512 v_old, __m512* m_new,
                                             __m512* v_new) {
  __m512 g = _mm512_maskz_loadu_ps(mask, a.grad + i);
  if (s.scale_grad) g = _mm512_mul_ps(g, k.grad_scale);
  __m512 p = _mm512_maskz_loadu_ps(mask, a.param + i);
  if (s.use_l2) g = _mm512_add_ps(g, _mm512_mul_ps(k.l2_decay, p));
  if (s.use_param_decay) p = _mm512_mul_ps(p, k.param_decay);
  const __m512 m =
      _mm512_add_ps(_mm512_mul_ps(k.beta1, m_old), _mm512_mul_ps(k.one_minus_beta1, g));
  const __m512 v = _mm512_add_ps(_mm512_mul_ps(k.beta2, v_old),
                                 _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, g), g));
  *m_new = m;
  *v_new = v;
  __m512 v_hat = v;
  if (a.max_exp_avg_sq != nullptr) {
    const __m512 old_max = _mm512_maskz_loadu_ps(mask, a.max_exp_avg_sq + i);
    // max_ps(x, y) = x > y ? x : y, y when either is NaN; then a NaN old_max wins too.
    v_hat = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(old_max, old_max, _CMP_UNORD_Q),
                                 _mm512_max_ps(old_max, v), old_max);
    _mm512_mask_storeu_ps(a.max_exp_avg_sq + i, mask, v_hat);
  }
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v_hat), k.bc2_sqrt), k.eps);
  p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k.step_size, m), denom));
  _mm512_mask_storeu_ps(a.param + i, mask, p);
  if (a.bf16 != nullptr) _mm512_mask_cvtepi32_storeu_epi16(a.bf16 + i, mask, ToBf16(p));
}

// One vector of 16 elements at i; `mask` selects the lanes that exist.
ZINF_AVX512_TARGET inline void Step16(const AdamScalars& s, const Avx512Scalars& k,
                                      const AdamArrays& a, std::size_t i, __mmask16 mask) {
  __m512 m, v;
  Step16Moments(s, k, a, i, mask, _mm512_maskz_loadu_ps(mask, a.exp_avg + i),
                _mm512_maskz_loadu_ps(mask, a.exp_avg_sq + i), &m, &v);
  _mm512_mask_storeu_ps(a.exp_avg + i, mask, m);
  _mm512_mask_storeu_ps(a.exp_avg_sq + i, mask, v);
}

ZINF_AVX512_TARGET inline Avx512Scalars Broadcast(const AdamScalars& s) {
  return {_mm512_set1_ps(s.beta1),     _mm512_set1_ps(s.one_minus_beta1),
          _mm512_set1_ps(s.beta2),     _mm512_set1_ps(s.one_minus_beta2),
          _mm512_set1_ps(s.step_size), _mm512_set1_ps(s.bc2_sqrt),
          _mm512_set1_ps(s.eps),       _mm512_set1_ps(s.grad_scale),
          _mm512_set1_ps(s.l2_decay),  _mm512_set1_ps(s.param_decay)};
}

}  // namespace

ZINF_AVX512_TARGET void AdamStepAvx512(const AdamScalars& s, const AdamArrays& a, std::size_t begin,
                                       std::size_t end) {
  const Avx512Scalars k = Broadcast(s);
  std::size_t i = begin;
  for (; i + 16 <= end; i += 16) Step16(s, k, a, i, 0xffff);
  if (i < end) Step16(s, k, a, i, static_cast<__mmask16>((1u << (end - i)) - 1));
}

namespace {

// The block's largest |new moment| per lane, and whether one was not finite.
struct Q8Tops {
  __m512 m, v;
  __mmask16 bad;
};

// One vector of 16 elements of a q8 block (AdamStepQ8Block*): steps them from the decoded old
// moments, stores the new ones to the scratch and folds them into *tops.
ZINF_AVX512_TARGET inline void StepQ8Lanes(const AdamScalars& s, const Avx512Scalars& k,
                                           const AdamArrays& a, std::size_t i, __mmask16 mask,
                                           __m512 m_old, __m512 v_old, Q8Tops* tops) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i max_finite = _mm512_set1_epi32(0x7f7fffff);
  __m512 m, v;
  Step16Moments(s, k, a, i, mask, m_old, v_old, &m, &v);
  _mm512_mask_storeu_ps(a.exp_avg + i, mask, m);
  _mm512_mask_storeu_ps(a.exp_avg_sq + i, mask, v);
  // Lanes past n hold the moments of made-up old moments and zero gradients: finite, and the
  // abs-max ignores them.
  const __m512i m_abs = _mm512_maskz_and_epi32(mask, _mm512_castps_si512(m), abs_mask);
  const __m512i v_abs = _mm512_maskz_and_epi32(mask, _mm512_castps_si512(v), abs_mask);
  tops->bad |=
      _mm512_cmpgt_epi32_mask(m_abs, max_finite) | _mm512_cmpgt_epi32_mask(v_abs, max_finite);
  tops->m = _mm512_max_ps(tops->m, _mm512_castsi512_ps(m_abs));
  tops->v = _mm512_max_ps(tops->v, _mm512_castsi512_ps(v_abs));
}

ZINF_AVX512_TARGET inline bool FinishTops(const Q8Tops& tops, float* m_max, float* v_max) {
  alignas(64) float lanes[2][16];
  _mm512_store_ps(lanes[0], tops.m);
  _mm512_store_ps(lanes[1], tops.v);
  *m_max = *std::max_element(lanes[0], lanes[0] + 16);
  *v_max = *std::max_element(lanes[1], lanes[1] + 16);
  return tops.bad == 0;
}

#define ZINF_AVX512_VBMI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))

// Where the byte unpacks of Decode64 put element e of 64: the codes are permuted first so that
// the four float vectors come out in element order (Decode64).
constexpr std::array<std::uint8_t, 64> DecodeOrder() {
  std::array<std::uint8_t, 64> order{};
  for (unsigned p = 0; p < 64; ++p) {
    // Position p of 128-bit lane p / 16 unpacks to float vector (p / 4) % 4, lane p / 16,
    // dword p % 4: element 16 * ((p / 4) % 4) + 4 * (p / 16) + p % 4.
    order[p] = static_cast<std::uint8_t>(16 * ((p >> 2) & 3) + 4 * (p >> 4) + (p & 3));
  }
  return order;
}
alignas(64) constexpr std::array<std::uint8_t, 64> kDecodeOrder = DecodeOrder();

// map[code] * scale for 64 codes into out[0..4) (16 elements each, in order), without gathers:
// byte b of every map value is looked up in plane b (Q8BlockIn) by vpermt2b, 128 entries per
// lookup and code bit 7 choosing between the two halves, and the four bytes are interleaved
// back into floats. The bytes are the map's own, so the floats are exactly map[code].
ZINF_AVX512_VBMI_TARGET inline void Decode64(const std::uint8_t* planes, __m512i codes,
                                             __m512 scale, __m512* out) {
  const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(kDecodeOrder.data()), codes);
  const __mmask64 upper = _mm512_movepi8_mask(c);
  __m512i b[4];
  for (int p = 0; p < 4; ++p) {
    const std::uint8_t* plane = planes + 256 * p;
    const __m512i lo =
        _mm512_permutex2var_epi8(_mm512_loadu_si512(plane), c, _mm512_loadu_si512(plane + 64));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(plane + 128), c,
                                                _mm512_loadu_si512(plane + 192));
    b[p] = _mm512_mask_blend_epi8(upper, lo, hi);
  }
  const __m512i w01_lo = _mm512_unpacklo_epi8(b[0], b[1]);
  const __m512i w01_hi = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i w23_lo = _mm512_unpacklo_epi8(b[2], b[3]);
  const __m512i w23_hi = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01_lo, w23_lo)), scale);
  out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01_lo, w23_lo)), scale);
  out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01_hi, w23_hi)), scale);
  out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01_hi, w23_hi)), scale);
}

}  // namespace

ZINF_AVX512_TARGET bool AdamStepQ8BlockAvx512(const AdamScalars& s, const AdamArrays& a,
                                              const Q8BlockIn& in, std::size_t n, float* m_max,
                                              float* v_max) {
  const Avx512Scalars k = Broadcast(s);
  const __m512 m_scale = _mm512_set1_ps(in.m_scale);
  const __m512 v_scale = _mm512_set1_ps(in.v_scale);
  Q8Tops tops = {_mm512_setzero_ps(), _mm512_setzero_ps(), 0};
  for (std::size_t i = 0; i < n; i += 16) {
    const __mmask16 mask =
        n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i m_code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, in.m_codes + i));
    const __m512i v_code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, in.v_codes + i));
    // Decoding: map[code] * scale. (The 256 values fit in 16 registers for vpermt2ps lookups,
    // but with the Adam constants they spill: the gathers are faster here.)
    StepQ8Lanes(s, k, a, i, mask, _mm512_mul_ps(_mm512_i32gather_ps(m_code, in.m_map, 4), m_scale),
                _mm512_mul_ps(_mm512_i32gather_ps(v_code, in.v_map, 4), v_scale), &tops);
  }
  return FinishTops(tops, m_max, v_max);
}

namespace {

// 64 elements at i of a q8 block (AdamStepQ8BlockAvx512Vbmi); `mask` selects those that exist.
// Inlined with the all-ones mask, the loads and stores lose their masks, which cost on AMD.
ZINF_AVX512_VBMI_TARGET __attribute__((always_inline)) inline void StepQ8Vbmi64(
    const AdamScalars& s, const Avx512Scalars& k, const AdamArrays& a, const Q8BlockIn& in,
    __m512 m_scale, __m512 v_scale, std::size_t i, __mmask64 mask, Q8Tops* tops) {
  __m512 m[4], v[4];
  // Codes past n read as 0 and decode to finite values that no stored lane uses.
  Decode64(in.m_planes, _mm512_maskz_loadu_epi8(mask, in.m_codes + i), m_scale, m);
  Decode64(in.v_planes, _mm512_maskz_loadu_epi8(mask, in.v_codes + i), v_scale, v);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const auto lanes = static_cast<__mmask16>(mask >> (16 * j));
    if (lanes != 0) StepQ8Lanes(s, k, a, i + 16 * j, lanes, m[j], v[j], tops);
  }
}

}  // namespace

ZINF_AVX512_VBMI_TARGET bool AdamStepQ8BlockAvx512Vbmi(const AdamScalars& scalars,
                                                       const AdamArrays& arrays,
                                                       const Q8BlockIn& block, std::size_t n,
                                                       float* m_max, float* v_max) {
  // Local copies: the stores through float* could alias the callers' structs, which would be
  // read again for every vector.
  const AdamScalars s = scalars;
  const AdamArrays a = arrays;
  const Q8BlockIn in = block;
  const Avx512Scalars k = Broadcast(s);
  const __m512 m_scale = _mm512_set1_ps(in.m_scale);
  const __m512 v_scale = _mm512_set1_ps(in.v_scale);
  Q8Tops tops = {_mm512_setzero_ps(), _mm512_setzero_ps(), 0};
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) StepQ8Vbmi64(s, k, a, in, m_scale, v_scale, i, ~__mmask64{0}, &tops);
  if (i < n) {
    StepQ8Vbmi64(s, k, a, in, m_scale, v_scale, i, (__mmask64{1} << (n - i)) - 1, &tops);
  }
  return FinishTops(tops, m_max, v_max);
}

ZINF_AVX512_TARGET double SquaredNormBlockAvx512(const float* x, std::size_t n) {
  __m512d lo = _mm512_setzero_pd();  // lanes 0..7
  __m512d hi = _mm512_setzero_pd();  // lanes 8..15
  for (std::size_t i = 0; i < n; i += kNormLanes) {
    const __mmask16 mask =
        n - i >= kNormLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 f = _mm512_maskz_loadu_ps(mask, x + i);
    const __m512d d_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d d_hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    // Masked-off lanes add +0.0: exact, and the accumulators start at +0.0.
    lo = _mm512_add_pd(lo, _mm512_mul_pd(d_lo, d_lo));
    hi = _mm512_add_pd(hi, _mm512_mul_pd(d_hi, d_hi));
  }
  alignas(64) double lanes[kNormLanes];
  _mm512_store_pd(lanes, lo);
  _mm512_store_pd(lanes + 8, hi);
  return SumNormLanes(lanes);
}

}  // namespace zinf::swapper::internal
