// AVX2 q8 block kernels (q8_kernels.h): 8 elements at a time, the tail through the scalar rule.
// They compute the same exact codes as the scalar kernel (no rounding choice is involved: max,
// division, comparisons and table lookups), so every path gives the same bytes.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "q8_kernels.h"

namespace zinf::swapper::q8::internal {

#define ZINF_AVX2_TARGET __attribute__((target("avx2")))

ZINF_AVX2_TARGET float QuantizeBlockAvx2(const Tables& t, const float* x, std::size_t n,
                                         std::uint8_t* codes) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  __m256i bad = _mm256_setzero_si256();
  __m256 vmax = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i)), abs_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(bits, max_finite));
    vmax = _mm256_max_ps(vmax, _mm256_castsi256_ps(bits));
  }
  if (!_mm256_testz_si256(bad, bad)) return -1.0f;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float scale = *std::max_element(lanes, lanes + 8);
  if (!AbsMaxTail(x, i, n, &scale)) return -1.0f;
  if (scale == 0.0f) {
    std::fill(codes, codes + n, t.zero_code);
    return 0.0f;
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i first = _mm256_set1_epi32(static_cast<int>(t.first_slot));
  const __m256i last = _mm256_set1_epi32(static_cast<int>(t.last_slot));
  const __m256i tiny = _mm256_set1_epi32(t.tiny_start);
  const __m256 zero = _mm256_setzero_ps();
  const int* start = t.start.data();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vscale);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i slot = _mm256_srli_epi32(_mm256_and_si256(bits, abs_mask), kSlotShift);
    const __m256i is_tiny = _mm256_cmpgt_epi32(first, slot);
    const __m256i s = _mm256_max_epi32(_mm256_sub_epi32(_mm256_min_epi32(slot, last), first),
                                       _mm256_setzero_si256());
    const __m256i at_start = _mm256_add_epi32(_mm256_slli_epi32(s, 1), _mm256_srli_epi32(bits, 31));
    __m256i c = _mm256_i32gather_epi32(start, at_start, 4);
    c = _mm256_blendv_epi8(c, tiny, is_tiny);
    __m256i count = c;
    for (int j = 0; j < t.walk; ++j) {
      const __m256i at = _mm256_add_epi32(c, _mm256_set1_epi32(j));
      const __m256 hi = _mm256_i32gather_ps(t.t_hi.data(), at, 4);
      __m256 above = _mm256_cmp_ps(v, hi, _CMP_GT_OQ);
      const __m256 equal = _mm256_cmp_ps(v, hi, _CMP_EQ_OQ);
      if (!_mm256_testz_ps(equal, equal)) {  // exactly on a threshold's float part: its low part
        const __m256 lo = _mm256_mask_i32gather_ps(zero, t.t_lo.data(), at, equal, 4);
        above = _mm256_or_ps(above, _mm256_and_ps(equal, _mm256_cmp_ps(lo, zero, _CMP_LT_OQ)));
      }
      count = _mm256_sub_epi32(count, _mm256_castps_si256(above));  // true lanes are -1
    }
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(count), _mm256_extracti128_si256(count, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(words, words));
  }
  CodesTail(t, x, i, n, scale, codes);
  return scale;
}

ZINF_AVX2_TARGET void DequantizeBlockAvx2(const Tables& t, const std::uint8_t* codes, float scale,
                                          std::size_t n, float* out) {
  const __m256 vscale = _mm256_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i idx =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(t.values.data(), idx, 4), vscale));
  }
  for (; i < n; ++i) out[i] = t.values[codes[i]] * scale;
}

}  // namespace zinf::swapper::q8::internal
