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

#include "q8_kernels.h"

namespace zinf::swapper::q8::internal {

#define ZINF_AVX2_TARGET __attribute__((target("avx2")))

namespace {

// The vector kernels' table (q8_kernels.h), loaded once: the code stores through uint8_t*,
// which may alias anything, so reading the Tables inside the loop would reload it each time.
struct Entries {
  const int* entry;
  __m256i offset;
};

ZINF_AVX2_TARGET inline Entries EntriesOf(const Tables& t) {
  return {reinterpret_cast<const int*>(t.entry.data()),
          _mm256_set1_epi32(static_cast<int>(t.entry_offset))};
}

// The codes of 8 normalized values n (q8_kernels.h: one gather of the packed entries), as 32-bit
// lanes; *near gets all-ones lanes within kNearSteps of a threshold.
ZINF_AVX2_TARGET inline __m256i Codes8(const Entries& t, __m256 n, __m256i* near) {
  const __m256i bits = _mm256_castps_si256(n);
  const __m256i u = _mm256_add_epi32(bits, t.offset);
  // Scalar loads and inserts instead of vpgatherdd: on this AMD Zen 5 they take 40-45% of its
  // time.
  // The slots leave the vector as four 64-bit pairs, fewer extracts than one per lane.
  const __m256i slot = _mm256_srli_epi32(u, kSlotShift);
  const __m128i low_half = _mm256_castsi256_si128(slot);
  const __m128i high_half = _mm256_extracti128_si256(slot, 1);
  const auto p0 = static_cast<std::uint64_t>(_mm_cvtsi128_si64(low_half));
  const auto p1 = static_cast<std::uint64_t>(_mm_extract_epi64(low_half, 1));
  const auto p2 = static_cast<std::uint64_t>(_mm_cvtsi128_si64(high_half));
  const auto p3 = static_cast<std::uint64_t>(_mm_extract_epi64(high_half, 1));
  constexpr std::uint64_t kLow = 0xffffffffu;
  const __m256i entry = _mm256_setr_epi32(t.entry[p0 & kLow], t.entry[p0 >> 32], t.entry[p1 & kLow],
                                          t.entry[p1 >> 32], t.entry[p2 & kLow], t.entry[p2 >> 32],
                                          t.entry[p3 & kLow], t.entry[p3 >> 32]);
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  const __m256i low = _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(bits, 31)), low16);
  const __m256i d = _mm256_sub_epi32(low, _mm256_srli_epi32(entry, 8));  // low - key + kNear
  const __m256i above = _mm256_cmpgt_epi32(d, _mm256_set1_epi32(kNearSteps - 1));
  // 0 <= d <= 2 * kNearSteps, as unsigned
  *near = _mm256_cmpeq_epi32(_mm256_min_epu32(d, _mm256_set1_epi32(2 * kNearSteps + 1)), d);
  return _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)), above);
}

ZINF_AVX2_TARGET inline void Store8(__m256i code, std::uint8_t* out) {
  const __m128i words =
      _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}

}  // namespace

ZINF_AVX2_TARGET void EncodeBlockAvx2(const Tables& t, const float* x, std::size_t n, float scale,
                                      std::uint8_t* codes) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const Entries e = EntriesOf(t);
  std::size_t i = 0;
  __m256i near;
  if (scale >= kMinReciprocalScale && scale <= kMaxReciprocalScale) {
    const __m256 reciprocal = _mm256_set1_ps(1.0f / scale);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      __m256i c = Codes8(e, _mm256_mul_ps(v, reciprocal), &near);
      if (!_mm256_testz_si256(near, near)) c = Codes8(e, _mm256_div_ps(v, vscale), &near);
      Store8(c, codes + i);
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      Store8(Codes8(e, _mm256_div_ps(_mm256_loadu_ps(x + i), vscale), &near), codes + i);
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
