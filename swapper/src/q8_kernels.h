// Private: the tables behind the q8 codec (q8.h) and its per-path block kernels.
//
// Nearest code, exactly and without doubles: code(n) is the number of thresholds t_c (the
// midpoints of adjacent values, exact in double) below n. Each t_c is stored as two floats,
// t = hi + lo exactly, so that n > t <=> n > hi || (n == hi && lo < 0) for a float n. The
// magnitude |n| falls into a slot (its float bits >> kSlotShift: exponent and top mantissa
// bits); start[2 * slot + sign] is code() of the slot's lowest n (one gather in the vector
// kernels, which read t_lo only for lanes equal to t_hi, rare), and at most `walk` thresholds
// lie within a slot, so code(n) = start + the number of the `walk` thresholds from there that
// are below n (the arrays are padded with +inf). Every path computes exactly this, so all give
// the same codes.
//
// The vector kernels use a second table, one packed 32-bit entry per (slot, sign), gathered once
// per value. Their slots are shifted: u = bits(n) + offset (offset < 2^16, chosen per map when
// the tables are built), slot = u >> 16 (the sign lands in bit 15 of the slot, so one index
// covers both signs, and the table spans 2^15 + the slot of 1), low = the low 16 bits of u,
// reversed (0xffff - low) for n < 0 so that a larger low is always nearer +inf. The offset is
// chosen so that every slot holds at most one threshold and no threshold lies within
// 2 * kNearSteps of a slot edge. Then code(n) = base + (low >= key), where key is the smallest
// low with the code base + 1 (0x10000 for a slot without a threshold; slots of |n| < kSlotLow
// have the code of 0 and a key no low reaches): entry = base | (key - kNearSteps) << 8.
//
// n = x / scale by division costs as much as the rest of the encoding, so the vector kernels
// first use n' = x * (1 / scale), when 1 / scale is a normal float: n' is within 4 steps (of
// the float grid, counted as integers) of the exact n: 1 / scale and the product are each
// rounded with a relative error of at most 2^-24, n itself too. So code(n') == code(n) unless
// a threshold lies within 4 steps of n', i.e. unless |low - key| <= kNearSteps (no threshold is
// near a slot edge, so one lying in the next slot is farther): the kernels test exactly that
// and recompute such a vector with the division. The codes are therefore the division's codes
// on every input; only the time depends on how many values lie that close to a threshold.
//
// The AVX-512 encoder avoids the gather (~6 ns for 16 lanes on Zen 5) with arithmetic. The
// values from the zero code up fall into regions of equally spaced values (a decade of the map,
// zero, 1.0), so within a region of codes [first, top] the code of a = |n| is min(floor(x), top)
// for x = a * region_a + region_b (a / spacing, shifted so that the region's threshold below
// code c + 1 has x = c + 1). Only approximately: the values are rounded, so the thresholds drift
// from the integers, and x' is computed in floats from n'. The tables are built (q8.cc) only
// when the drift plus a bound on |x' - x| stays below kNearFraction; the bound is
// 2^-20 * a * region_a (n' is within 4 steps of n: 2^-21 relative; the product's rounding) +
// 2^-23 * |x'| (the sum's rounding), with margins. Then a lane whose x' is more than
// kNearFraction from every integer has the exact code, and the others are recomputed as above.
// (The build also checks x' > first at the region's bottom, so truncation is the floor.) The
// region comes from the binade of a (its float exponent, clamped to kBinades): binade_region is
// the region of the binade's lowest a, one more above binade_bound (the float nearest the
// threshold between two regions, at most one per binade, at least 2 * kBoundSteps from the
// binade's edges). A lane within kBoundSteps (twice n''s error) of binade_bound is recomputed as
// well: elsewhere the comparison with the float gives the exact one's answer for n too.
// Negative n: the thresholds below zero mirror those above (checked), so code(-a) =
// max(mirror - code(a), 0) with mirror = 2 * zero_code; at a threshold (a tie) the lane is near
// and recomputed.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "zinf/swapper/q8.h"

namespace zinf::swapper::q8::internal {

inline constexpr int kSlotShift = 16;           // a binade in 128 slots
inline constexpr std::int32_t kNearSteps = 32;  // see the top: 8 x the reciprocal's error
// 1 / scale is a normal float with at most half a unit of rounding error in this range.
inline constexpr float kMinReciprocalScale = 0x1p-125f;
inline constexpr float kMaxReciprocalScale = 0x1p+125f;
// Whether the vector encoders may use 1 / scale for this block scale.
inline bool InReciprocalRange(float scale) {
  return scale >= kMinReciprocalScale && scale <= kMaxReciprocalScale;
}

// The AVX-512 encoder (see the top): binade i holds the |n| of biased exponent kBinadeBase + i
// (i = 0: all below, i = kBinades - 1: all above).
inline constexpr int kBinades = 32;
inline constexpr std::int32_t kBinadeBase = 127 - (kBinades - 1);
inline constexpr int kMaxRegions = 16;
inline constexpr std::int32_t kBoundSteps = 8;    // twice the error of x * (1 / scale)
inline constexpr float kNearFraction = 0x1p-11f;  // x this close to an integer: recompute

struct Tables {
  std::array<float, 256> values;
  // Byte b of the bits of values[c] at planes[256 * b + c] (little-endian: b = 0 is the lowest),
  // for kernels that look values up by byte permutes.
  alignas(64) std::array<std::uint8_t, 1024> planes;
  std::vector<float> t_hi, t_lo;        // 255 thresholds + `walk` of +inf / 0
  std::uint32_t first_slot, last_slot;  // slots of magnitudes below first_slot: `tiny`
  std::vector<std::int32_t> start;      // 2 * (slot - first_slot) + (n < 0)
  std::int32_t tiny_start;              // |n| below the first slot
  int walk;
  std::uint8_t zero_code;
  // The vector kernels' table (see the top): entry[(bits(n) + entry_offset) >> 16].
  std::vector<std::uint32_t> entry;
  std::uint32_t entry_offset;
  // The AVX-512 encoder's tables (see the top), indexed by binade and by region.
  alignas(64) std::array<std::int32_t, kBinades> binade_bound;    // float bits; +inf: none
  alignas(64) std::array<std::int32_t, kBinades> binade_region;   // of the binade's lowest |n|
  alignas(64) std::array<float, kMaxRegions> region_a, region_b;  // x = |n| * a + b
  alignas(64) std::array<std::int32_t, kMaxRegions> region_top;
  std::int32_t mirror;  // code(-a) = max(mirror - code(a), 0)
};

const Tables& TablesFor(MapKind kind);

// The block kernels: codes[0, n) and the returned scale (-1 for a non-finite element), as
// q8::QuantizeBlock; out[0, n) as q8::DequantizeBlock. n <= kBlockNumel.
float QuantizeBlockScalar(const Tables& t, const float* x, std::size_t n, std::uint8_t* codes);
float QuantizeBlockAvx2(const Tables& t, const float* x, std::size_t n, std::uint8_t* codes);
float QuantizeBlockAvx512(const Tables& t, const float* x, std::size_t n, std::uint8_t* codes);
// The codes of x[0, n) / scale (scale > 0, finite; every x finite), as QuantizeBlock* writes
// them after its abs-max pass.
void EncodeBlockAvx2(const Tables& t, const float* x, std::size_t n, float scale,
                     std::uint8_t* codes);
void EncodeBlockAvx512(const Tables& t, const float* x, std::size_t n, float scale,
                       std::uint8_t* codes);
void DequantizeBlockScalar(const Tables& t, const std::uint8_t* codes, float scale, std::size_t n,
                           float* out);
void DequantizeBlockAvx2(const Tables& t, const std::uint8_t* codes, float scale, std::size_t n,
                         float* out);
void DequantizeBlockAvx512(const Tables& t, const std::uint8_t* codes, float scale, std::size_t n,
                           float* out);

// The scalar code of one normalized value (the definition the vector kernels follow).
inline std::uint8_t CodeOf(const Tables& t, float n, std::uint32_t magnitude_bits) {
  std::int32_t c;
  const std::uint32_t slot = magnitude_bits >> kSlotShift;
  if (slot < t.first_slot) {
    c = t.tiny_start;
  } else {
    const std::uint32_t s = (slot > t.last_slot ? t.last_slot : slot) - t.first_slot;
    c = t.start[2 * s + (n < 0 ? 1 : 0)];
  }
  std::int32_t count = c;
  for (int j = 0; j < t.walk; ++j) {
    const float hi = t.t_hi[static_cast<std::size_t>(c + j)];
    const float lo = t.t_lo[static_cast<std::size_t>(c + j)];
    count += (n > hi || (n == hi && lo < 0)) ? 1 : 0;
  }
  return static_cast<std::uint8_t>(count);
}

// Shared by the kernels: folds |x[i]| for i in [begin, n) into *scale; false at a non-finite x.
inline bool AbsMaxTail(const float* x, std::size_t begin, std::size_t n, float* scale) {
  for (std::size_t i = begin; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
    *scale = std::max(*scale, std::fabs(x[i]));
  }
  return true;
}

// The codes of x[i] / scale for i in [begin, n), one at a time.
inline void CodesTail(const Tables& t, const float* x, std::size_t begin, std::size_t n,
                      float scale, std::uint8_t* codes) {
  for (std::size_t i = begin; i < n; ++i) {
    const float v = x[i] / scale;
    codes[i] = CodeOf(t, v, std::bit_cast<std::uint32_t>(v) & 0x7fffffffu);
  }
}

}  // namespace zinf::swapper::q8::internal
