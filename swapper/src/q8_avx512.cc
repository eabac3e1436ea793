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

namespace {

// The vector kernels' table (q8_kernels.h), loaded once: the code stores through uint8_t*,
// which may alias anything, so reading the Tables inside the loop would reload it each time.
struct Entries {
  const std::uint32_t* entry;
  __m512i offset;
};

ZINF_AVX512_TARGET inline Entries EntriesOf(const Tables& t) {
  return {t.entry.data(), _mm512_set1_epi32(static_cast<int>(t.entry_offset))};
}

// The codes of 16 normalized values n (q8_kernels.h: one gather of the packed entries);
// *near gets the lanes within kNearSteps of a threshold.
ZINF_AVX512_TARGET inline __m128i Codes16(const Entries& t, __m512 n, __mmask16* near) {
  const __m512i bits = _mm512_castps_si512(n);
  const __m512i u = _mm512_add_epi32(bits, t.offset);
  const __m512i entry = _mm512_i32gather_epi32(_mm512_srli_epi32(u, kSlotShift), t.entry, 4);
  // (u ^ (n < 0 ? ~0 : 0)) & 0xffff
  const __m512i low =
      _mm512_ternarylogic_epi32(u, _mm512_srai_epi32(bits, 31), _mm512_set1_epi32(0xffff), 0x28);
  const __m512i d = _mm512_sub_epi32(low, _mm512_srli_epi32(entry, 8));  // low - key + kNear
  const __mmask16 above = _mm512_cmpge_epi32_mask(d, _mm512_set1_epi32(kNearSteps));
  *near = _mm512_cmple_epu32_mask(d, _mm512_set1_epi32(2 * kNearSteps));
  return _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(entry, above, entry, _mm512_set1_epi32(1)));
}

// The affine encoder's tables (q8_kernels.h) in registers.
struct Affine {
  __m512i bound_lo, bound_hi, region_lo, region_hi;  // by binade
  __m512 a, b;                                       // by region
  __m512i top;
  __m512i mirror;
};

ZINF_AVX512_TARGET inline Affine AffineOf(const Tables& t) {
  return {_mm512_load_si512(t.binade_bound.data()),  _mm512_load_si512(t.binade_bound.data() + 16),
          _mm512_load_si512(t.binade_region.data()), _mm512_load_si512(t.binade_region.data() + 16),
          _mm512_load_ps(t.region_a.data()),         _mm512_load_ps(t.region_b.data()),
          _mm512_load_si512(t.region_top.data()),    _mm512_set1_epi32(t.mirror)};
}

// The codes of 16 values n' = x * (1 / scale) without a table gather (q8_kernels.h); *near gets
// the lanes where n' may have another code than x / scale.
ZINF_AVX512_TARGET inline __m128i AffineCodes16(const Affine& t, __m512 n, __mmask16* near) {
  const __m512i bits = _mm512_castps_si512(n);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  // The exponent is at most 255: a saturating 16-bit subtraction clamps it at kBinadeBase.
  const __m512i binade = _mm512_min_epi32(
      _mm512_subs_epu16(_mm512_srli_epi32(mag, 23), _mm512_set1_epi32(kBinadeBase)),
      _mm512_set1_epi32(kBinades - 1));
  const __m512i from_bound =
      _mm512_sub_epi32(mag, _mm512_permutex2var_epi32(t.bound_lo, binade, t.bound_hi));
  const __mmask16 above = _mm512_cmpgt_epi32_mask(from_bound, _mm512_setzero_si512());
  const __mmask16 at_bound =
      _mm512_cmple_epu32_mask(_mm512_add_epi32(from_bound, _mm512_set1_epi32(kBoundSteps)),
                              _mm512_set1_epi32(2 * kBoundSteps));
  __m512i region = _mm512_permutex2var_epi32(t.region_lo, binade, t.region_hi);
  region = _mm512_mask_add_epi32(region, above, region, _mm512_set1_epi32(1));
  const __m512 x =
      _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_permutexvar_ps(region, t.a)),
                    _mm512_permutexvar_ps(region, t.b));
  // x - rint(x): near an integer, a threshold may lie between n' and n.
  const __m512 fraction = _mm512_abs_ps(_mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT));
  *near = at_bound | _mm512_cmplt_ps_mask(fraction, _mm512_set1_ps(kNearFraction));
  const __m512i code =
      _mm512_min_epi32(_mm512_cvttps_epi32(x), _mm512_permutexvar_epi32(region, t.top));
  const __mmask16 negative = _mm512_movepi32_mask(bits);
  const __m512i mirrored =
      _mm512_max_epi32(_mm512_sub_epi32(t.mirror, code), _mm512_setzero_si512());
  return _mm512_cvtepi32_epi8(_mm512_mask_mov_epi32(code, negative, mirrored));
}

}  // namespace

ZINF_AVX512_TARGET void EncodeBlockAvx512(const Tables& t, const float* x, std::size_t n,
                                          float scale, std::uint8_t* codes) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const Entries e = EntriesOf(t);
  std::size_t i = 0;
  __mmask16 near;
  if (InReciprocalRange(scale)) {
    const __m512 reciprocal = _mm512_set1_ps(1.0f / scale);
    const Affine affine = AffineOf(t);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      __m128i c = AffineCodes16(affine, _mm512_mul_ps(v, reciprocal), &near);
      if (near != 0) c = Codes16(e, _mm512_div_ps(v, vscale), &near);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), c);
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      const __m128i c = Codes16(e, _mm512_div_ps(_mm512_loadu_ps(x + i), vscale), &near);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), c);
    }
  }
  CodesTail(t, x, i, n, scale, codes);
}

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
  EncodeBlockAvx512(t, x, n, scale, codes);
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
