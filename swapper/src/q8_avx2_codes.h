// Private: the AVX2 encoding of 8 values (q8_kernels.h), inline for the two AVX2 translation
// units: the block encoder (q8_avx2.cc) and the q8 step, which encodes the block before while it
// steps the next (cpu_adam_avx2.cc). Only AVX2 code includes this header.
#pragma once

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

#include "q8_kernels.h"

namespace zinf::swapper::q8::internal::avx2 {

#define ZINF_Q8_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline

// The vector kernels' table (q8_kernels.h), loaded once: the code stores through uint8_t*,
// which may alias anything, so reading the Tables inside the loop would reload it each time.
struct Entries {
  const std::int32_t* entry;
  __m256i offset;
};

ZINF_Q8_AVX2_INLINE Entries EntriesOf(const Tables& t) {
  return {reinterpret_cast<const std::int32_t*>(t.entry.data()),
          _mm256_set1_epi32(static_cast<int>(t.entry_offset))};
}

// entry[slot] for the 8 slots, by scalar loads: on AMD Zen 5 vpgatherdd takes 2.4 times as long.
// The slots leave the vector as four 64-bit pairs, fewer extracts than one per lane.
ZINF_Q8_AVX2_INLINE __m256i Lookup8(const std::int32_t* entry, __m256i slot) {
  const __m128i low_half = _mm256_castsi256_si128(slot);
  const __m128i high_half = _mm256_extracti128_si256(slot, 1);
  const auto p0 = static_cast<std::uint64_t>(_mm_cvtsi128_si64(low_half));
  const auto p1 = static_cast<std::uint64_t>(_mm_extract_epi64(low_half, 1));
  const auto p2 = static_cast<std::uint64_t>(_mm_cvtsi128_si64(high_half));
  const auto p3 = static_cast<std::uint64_t>(_mm_extract_epi64(high_half, 1));
  constexpr std::uint64_t kLow = 0xffffffffu;
  return _mm256_setr_epi32(entry[p0 & kLow], entry[p0 >> 32], entry[p1 & kLow], entry[p1 >> 32],
                           entry[p2 & kLow], entry[p2 >> 32], entry[p3 & kLow], entry[p3 >> 32]);
}

// The codes of 8 normalized values n (q8_kernels.h: one lookup of the packed entries), as
// 32-bit lanes; *near gets all-ones lanes within kNearSteps of a threshold.
ZINF_Q8_AVX2_INLINE __m256i Codes8(const Entries& t, __m256 n, __m256i* near) {
  const __m256i bits = _mm256_castps_si256(n);
  const __m256i u = _mm256_add_epi32(bits, t.offset);
  const __m256i entry = Lookup8(t.entry, _mm256_srli_epi32(u, kSlotShift));
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  const __m256i low = _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(bits, 31)), low16);
  const __m256i d = _mm256_sub_epi32(low, _mm256_srli_epi32(entry, 8));  // low - key + kNear
  const __m256i above = _mm256_cmpgt_epi32(d, _mm256_set1_epi32(kNearSteps - 1));
  // 0 <= d <= 2 * kNearSteps, as unsigned
  *near = _mm256_cmpeq_epi32(_mm256_min_epu32(d, _mm256_set1_epi32(2 * kNearSteps + 1)), d);
  return _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)), above);
}

ZINF_Q8_AVX2_INLINE void Store8(__m256i code, std::uint8_t* out) {
  const __m128i words =
      _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}

// A block's scale in registers, for scales in [kMinReciprocalScale, kMaxReciprocalScale].
struct Scale {
  __m256 scale, reciprocal;
};

ZINF_Q8_AVX2_INLINE Scale ScaleOf(float scale) {
  return {_mm256_set1_ps(scale), _mm256_set1_ps(1.0f / scale)};
}

// Writes the codes of x[0, 8) / scale to out[0, 8): by the reciprocal, and by the division where
// a lane lies near a threshold (q8_kernels.h).
ZINF_Q8_AVX2_INLINE void Encode8(const Entries& t, const Scale& s, __m256 x, std::uint8_t* out) {
  __m256i near;
  __m256i c = Codes8(t, _mm256_mul_ps(x, s.reciprocal), &near);
  if (!_mm256_testz_si256(near, near)) c = Codes8(t, _mm256_div_ps(x, s.scale), &near);
  Store8(c, out);
}

#undef ZINF_Q8_AVX2_INLINE

}  // namespace zinf::swapper::q8::internal::avx2
