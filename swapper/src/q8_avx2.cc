// AVX2 q8 block kernels (q8_kernels.h): 8 elements at a time, the tail through the scalar rule.
// They compute the same exact codes as the scalar kernel (max, comparisons, table lookups, and
// x * (1 / scale) only where it provably has the division's code, q8_kernels.h), so every path
// gives the same bytes.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "q8_avx2_codes.h"
#include "q8_kernels.h"

namespace zinf::swapper::q8::internal {

#define ZINF_AVX2_TARGET __attribute__((target("avx2")))

ZINF_AVX2_TARGET void EncodeBlockAvx2(const Tables& t, const float* x, std::size_t n, float scale,
                                      std::uint8_t* codes) {
  const avx2::Entries e = avx2::EntriesOf(t);
  std::size_t i = 0;
  if (InReciprocalRange(scale)) {
    const avx2::Scale s = avx2::ScaleOf(scale);
    for (; i + 8 <= n; i += 8) avx2::Encode8(e, s, _mm256_loadu_ps(x + i), codes + i);
  } else {
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256i near;
    for (; i + 8 <= n; i += 8) {
      avx2::Store8(avx2::Codes8(e, _mm256_div_ps(_mm256_loadu_ps(x + i), vscale), &near),
                   codes + i);
    }
  }
  CodesTail(t, x, i, n, scale, codes);
}

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
  EncodeBlockAvx2(t, x, n, scale, codes);
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
