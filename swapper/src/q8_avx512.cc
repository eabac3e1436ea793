// AVX-512 q8 block kernels (q8_kernels.h): 16 elements at a time, the tail through the scalar
// rule; the same exact codes as the scalar kernel (see q8_avx2.cc).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "q8_kernels.h"

namespace zinf::swapper::q8::internal {

#define ZINF_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

ZINF_AVX512_TARGET float QuantizeBlockAvx512(const Tables& t, const float* x, std::size_t n,
                                             std::uint8_t* codes) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i max_finite = _mm512_set1_epi32(0x7f7fffff);
  __mmask16 bad = 0;
  __m512 vmax = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)), abs_mask);
    bad |= _mm512_cmpgt_epi32_mask(bits, max_finite);
    vmax = _mm512_max_ps(vmax, _mm512_castsi512_ps(bits));
  }
  if (bad != 0) return -1.0f;
  float scale = _mm512_reduce_max_ps(vmax);
  if (!AbsMaxTail(x, i, n, &scale)) return -1.0f;
  if (scale == 0.0f) {
    std::fill(codes, codes + n, t.zero_code);
    return 0.0f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i first = _mm512_set1_epi32(static_cast<int>(t.first_slot));
  const __m512i last = _mm512_set1_epi32(static_cast<int>(t.last_slot));
  const __m512i tiny = _mm512_set1_epi32(t.tiny_start);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 zero = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), vscale);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i slot = _mm512_srli_epi32(_mm512_and_si512(bits, abs_mask), kSlotShift);
    const __mmask16 is_tiny = _mm512_cmplt_epi32_mask(slot, first);
    const __m512i s = _mm512_max_epi32(_mm512_sub_epi32(_mm512_min_epi32(slot, last), first),
                                       _mm512_setzero_si512());
    const __m512i at_start = _mm512_add_epi32(_mm512_slli_epi32(s, 1), _mm512_srli_epi32(bits, 31));
    __m512i c = _mm512_i32gather_epi32(at_start, t.start.data(), 4);
    c = _mm512_mask_mov_epi32(c, is_tiny, tiny);
    __m512i count = c;
    for (int j = 0; j < t.walk; ++j) {
      const __m512i at = _mm512_add_epi32(c, _mm512_set1_epi32(j));
      const __m512 hi = _mm512_i32gather_ps(at, t.t_hi.data(), 4);
      __mmask16 above = _mm512_cmp_ps_mask(v, hi, _CMP_GT_OQ);
      const __mmask16 equal = _mm512_cmp_ps_mask(v, hi, _CMP_EQ_OQ);
      if (equal != 0) {  // exactly on a threshold's float part: its low part decides
        const __m512 lo = _mm512_mask_i32gather_ps(zero, equal, at, t.t_lo.data(), 4);
        above |= equal & _mm512_cmp_ps_mask(lo, zero, _CMP_LT_OQ);
      }
      count = _mm512_mask_add_epi32(count, above, count, one);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtusepi32_epi8(count));
  }
  CodesTail(t, x, i, n, scale, codes);
  return scale;
}

ZINF_AVX512_TARGET void DequantizeBlockAvx512(const Tables& t, const std::uint8_t* codes,
                                              float scale, std::size_t n, float* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, t.values.data(), 4), vscale));
  }
  for (; i < n; ++i) out[i] = t.values[codes[i]] * scale;
}

}  // namespace zinf::swapper::q8::internal
