// The q8 codec (q8.h): the dynamic maps and their tables (q8_kernels.h), the scalar block
// kernels and the tensor functions.
#include "zinf/swapper/q8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "q8_kernels.h"
#include "zinf/core/check.h"

namespace zinf::swapper {

std::string_view StateFormatName(StateFormat format) {
  const auto index = static_cast<std::size_t>(format);
  return index < kStateFormatNames.size() ? kStateFormatNames[index] : "?";
}

}  // namespace zinf::swapper

namespace zinf::swapper::q8 {
namespace internal {
namespace {

constexpr int kDecades = 7;        // E = 0..6: values in [1e-7, 1)
constexpr float kSlotLow = 1e-8f;  // magnitudes below have no threshold near them

// The map's values, ascending, as the paper's dynamic tree describes them (q8.h).
std::array<float, 256> BuildValues(MapKind kind) {
  const int fraction_bits_e0 = kind == MapKind::kSigned ? 6 : 7;
  std::vector<double> v = {0.0, 1.0};
  for (int e = 0; e < kDecades; ++e) {
    const int intervals = 1 << (fraction_bits_e0 - e);
    const double decade = std::pow(10.0, -e);
    for (int k = 0; k < intervals; ++k) {
      // The midpoint of the k-th of `intervals` equal parts of [0.1, 1].
      const double lo = 0.1 + 0.9 * k / intervals;
      const double hi = 0.1 + 0.9 * (k + 1) / intervals;
      const double value = decade * (lo + hi) / 2;
      v.push_back(value);
      if (kind == MapKind::kSigned) v.push_back(-value);
    }
  }
  ZINF_CHECK(v.size() == 256, "q8 map has {} values", v.size());
  std::array<float, 256> values;
  std::transform(v.begin(), v.end(), values.begin(),
                 [](double d) { return static_cast<float>(d); });
  std::sort(values.begin(), values.end());
  return values;
}

// The vector kernels' table (q8_kernels.h) for the slots shifted by `offset`, or empty when a
// slot holds two thresholds or one lies within 2 * kNearSteps of a slot edge. count(x) is the
// exact code of x. A slot without a threshold gets a key no low reaches.
template <typename Count>
std::vector<std::uint32_t> Entries(const Count& count, std::uint32_t offset) {
  const std::uint32_t first = (std::bit_cast<std::uint32_t>(kSlotLow) + offset) >> kSlotShift;
  // n never exceeds 1 by more than a step: the last slot holds 1 + 2^-23.
  const std::uint32_t last = (std::bit_cast<std::uint32_t>(1.0f) + 1 + offset) >> kSlotShift;
  // |n| of the slot (u >> 16) and low bits `low` (unreversed).
  auto at = [offset](std::uint32_t slot, std::uint32_t low) {
    return std::bit_cast<float>(((slot << kSlotShift) | low) - offset);
  };
  const std::int32_t tiny = count(0.0f);
  const std::uint32_t never = std::uint32_t{0x1ffff} << 8;
  std::vector<std::uint32_t> entry((std::size_t{1} << 15) + last + 1, never | tiny);
  for (std::uint32_t sign : {0u, 1u}) {
    const float s = sign == 1 ? -1.0f : 1.0f;
    // The code of the value with `w` = low (n >= 0) or 0xffff - low (n < 0) in `slot`.
    auto code = [&](std::uint32_t slot, std::uint32_t w) {
      return count(s * at(slot, sign == 0 ? w : 0xffff - w));
    };
    if (count(s * std::nextafter(at(first, 0), 0.0f)) != tiny) return {};
    for (std::uint32_t slot = first; slot <= last; ++slot) {
      const std::int32_t base = code(slot, 0);
      if (code(slot, 0xffff) - base > 1) return {};
      std::uint32_t lo = 0, hi = 0x10000;  // the smallest w with a larger code
      while (lo < hi) {
        const std::uint32_t mid = (lo + hi) / 2;
        if (code(slot, mid) > base) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      if (lo == 0x10000) {
        entry[(sign << 15) + slot] = never | static_cast<std::uint32_t>(base);
        continue;
      }
      if (lo < 2 * kNearSteps || lo > 0x10000 - 2 * kNearSteps) return {};
      entry[(sign << 15) + slot] = static_cast<std::uint32_t>(base) | (lo - kNearSteps) << 8;
    }
  }
  return entry;
}

template <typename Count>
std::uint32_t EntryOffset(const Count& count) {
  for (std::uint32_t offset = 0; offset < 0x10000; offset += 0x101) {
    if (!Entries(count, offset).empty()) return offset;
  }
  ZINF_CHECK(false, "q8: no slot offset keeps the thresholds away from the slot edges");
  return 0;
}

// The AVX-512 encoder's tables (q8_kernels.h): the positive values from the zero code up cut
// into regions of equally spaced values, so that within a region code = min(floor(x), top) for
// the affine x = |n| * a + b, and a table per binade of the boundary between regions in it. Checks
// what the kernels' exactness rests on; `thresholds` are the exact ones.
void BuildAffine(const std::array<double, 255>& thresholds, Tables* t) {
  const int z = t->zero_code;
  // Negative n: the thresholds below zero mirror those above it.
  for (int c = 0; c < z; ++c) {
    ZINF_CHECK(thresholds[c] == -thresholds[2 * z - 1 - c], "q8: threshold {} is not mirrored", c);
  }
  ZINF_CHECK(thresholds[z] > 0, "q8: the zero code is not the first non-negative one");
  t->mirror = 2 * z;
  // Runs of equal gaps, [first, last] codes. A value joins the run before it only where its gap
  // continues the run's spacing, so a decade's first value is never taken into the run below,
  // whose threshold would then lie at an integer x at the decade's bottom.
  auto gap = [&](int c) { return static_cast<double>(t->values[c + 1]) - t->values[c]; };
  auto same = [](double a, double b) { return std::fabs(a - b) <= 1e-3 * b; };
  std::vector<std::pair<int, int>> regions;
  for (int c = z; c < 256;) {
    int last = c;
    if (c + 2 < 256 && same(gap(c + 1), gap(c))) {
      while (last + 1 < 256 && same(gap(last), gap(c))) ++last;
    }
    regions.push_back({c, last});
    c = last + 1;
  }
  ZINF_CHECK(regions.size() <= kMaxRegions, "q8: {} regions", regions.size());
  for (std::size_t r = 0; r < kMaxRegions; ++r) {
    const auto [first, last] = regions[std::min(r, regions.size() - 1)];
    const double v0 = t->values[first];
    const double spacing = last > first ? static_cast<double>(t->values[first + 1]) - v0 : 0.0;
    const float a = spacing > 0 ? static_cast<float>(1 / spacing) : 0.0f;
    const float b = static_cast<float>(first + 0.5 - (spacing > 0 ? v0 / spacing : 0.0));
    // The smallest and largest |n| of the region (beyond the last one: up to 2, where n' can
    // still be).
    const double bottom = r == 0 ? 0.0 : thresholds[first - 1];
    const double top = r + 1 < regions.size() ? thresholds[last] : 2.0;
    // |x' - x| for the float x' of n' (q8_kernels.h), with margin.
    const double error = 0x1p-20 * a * top + 0x1p-23 * (a * top + std::fabs(b));
    double drift = 0;  // how far a threshold's x is from its integer
    for (int c = first; c < last; ++c) {
      drift = std::max(drift, std::fabs(thresholds[c] * a + b - (c + 1)));
    }
    ZINF_CHECK(error + drift + 0x1p-30 < kNearFraction, "q8: region {} is not affine enough", r);
    // x' > first throughout the region: truncation is then the floor, and never below first.
    ZINF_CHECK(bottom * a + b - error > first, "q8: region {} starts below its code", r);
    t->region_a[r] = a;
    t->region_b[r] = b;
    t->region_top[r] = last;
  }
  // The boundaries as float bits: each at least 2 * kBoundSteps from a binade's edge, one per
  // binade at most.
  t->binade_bound.fill(std::bit_cast<std::int32_t>(std::numeric_limits<float>::infinity()));
  t->binade_region.fill(0);
  for (std::size_t r = 1; r < regions.size(); ++r) {
    const auto bound =
        std::bit_cast<std::int32_t>(static_cast<float>(thresholds[regions[r].first - 1]));
    const std::int32_t binade = (bound >> 23) - kBinadeBase;
    const std::int32_t edge = bound & 0x7fffff;
    ZINF_CHECK(binade >= 1 && binade < kBinades - 1 && edge >= 2 * kBoundSteps &&
                   edge <= 0x7fffff - 2 * kBoundSteps,
               "q8: region boundary {} is outside the binades or near an edge", r);
    ZINF_CHECK(t->binade_bound[binade] ==
                   std::bit_cast<std::int32_t>(std::numeric_limits<float>::infinity()),
               "q8: two region boundaries in one binade");
    t->binade_bound[binade] = bound;
    for (int i = binade + 1; i < kBinades; ++i) t->binade_region[i] = static_cast<std::int32_t>(r);
  }
}

Tables Build(MapKind kind) {
  Tables t{};
  t.values = BuildValues(kind);
  for (std::size_t c = 0; c < t.values.size(); ++c) {
    const auto bits = std::bit_cast<std::uint32_t>(t.values[c]);
    for (std::size_t b = 0; b < 4; ++b)
      t.planes[256 * b + c] = static_cast<std::uint8_t>(bits >> (8 * b));
  }
  std::array<double, 255> thresholds;
  for (std::size_t c = 0; c < thresholds.size(); ++c) {
    thresholds[c] = (static_cast<double>(t.values[c]) + t.values[c + 1]) / 2;  // exact
  }
  // The exact answer, for building the tables only.
  auto count = [&](double x) {
    return static_cast<std::int32_t>(std::lower_bound(thresholds.begin(), thresholds.end(), x) -
                                     thresholds.begin());
  };
  t.zero_code = static_cast<std::uint8_t>(std::find(t.values.begin(), t.values.end(), 0.0f) -
                                          t.values.begin());
  t.first_slot = std::bit_cast<std::uint32_t>(kSlotLow) >> kSlotShift;
  t.last_slot = std::bit_cast<std::uint32_t>(1.0f) >> kSlotShift;
  const float below_first = std::nextafter(std::bit_cast<float>(t.first_slot << kSlotShift), 0.0f);
  t.tiny_start = count(-below_first);
  int walk = count(below_first) - t.tiny_start;
  for (std::uint32_t slot = t.first_slot; slot <= t.last_slot; ++slot) {
    const float low = std::bit_cast<float>(slot << kSlotShift);
    const float high = slot == t.last_slot
                           ? std::numeric_limits<float>::max()
                           : std::nextafter(std::bit_cast<float>((slot + 1) << kSlotShift), 0.0f);
    t.start.push_back(count(low));
    t.start.push_back(count(-high));
    walk = std::max({walk, count(high) - count(low), count(-low) - count(-high)});
  }
  t.walk = walk;
  for (double th : thresholds) {
    const float hi = static_cast<float>(th);
    const float lo = static_cast<float>(th - hi);
    ZINF_CHECK(static_cast<double>(hi) + lo == th, "q8 threshold {} is not hi + lo", th);
    t.t_hi.push_back(hi);
    t.t_lo.push_back(lo);
  }
  for (int j = 0; j < walk; ++j) {
    t.t_hi.push_back(std::numeric_limits<float>::infinity());
    t.t_lo.push_back(0.0f);
  }
  ZINF_CHECK(walk == 1, "q8 slots hold up to {} thresholds; the packed table needs 1", walk);
  BuildAffine(thresholds, &t);
  t.entry_offset = EntryOffset(count);
  t.entry = Entries(count, t.entry_offset);
  return t;
}

}  // namespace

const Tables& TablesFor(MapKind kind) {
  static const Tables kSigned = Build(MapKind::kSigned);
  static const Tables kUnsigned = Build(MapKind::kUnsigned);
  return kind == MapKind::kSigned ? kSigned : kUnsigned;
}

float QuantizeBlockScalar(const Tables& t, const float* x, std::size_t n, std::uint8_t* codes) {
  float scale = 0.0f;
  if (!AbsMaxTail(x, 0, n, &scale)) return -1.0f;
  if (scale == 0.0f) {
    std::fill(codes, codes + n, t.zero_code);
    return 0.0f;
  }
  CodesTail(t, x, 0, n, scale, codes);
  return scale;
}

void DequantizeBlockScalar(const Tables& t, const std::uint8_t* codes, float scale, std::size_t n,
                           float* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = t.values[codes[i]] * scale;
}

}  // namespace internal

const std::array<float, 256>& MapValues(MapKind kind) { return internal::TablesFor(kind).values; }

std::uint8_t ZeroCode(MapKind kind) { return internal::TablesFor(kind).zero_code; }

std::uint8_t NearestCode(MapKind kind, float normalized) {
  return internal::CodeOf(internal::TablesFor(kind), normalized,
                          std::bit_cast<std::uint32_t>(normalized) & 0x7fffffffu);
}

float QuantizeBlock(MapKind kind, std::span<const float> x, std::span<std::uint8_t> codes) {
  return internal::QuantizeBlockScalar(internal::TablesFor(kind), x.data(), x.size(), codes.data());
}

void DequantizeBlock(MapKind kind, std::span<const std::uint8_t> codes, float scale,
                     std::span<float> out) {
  internal::DequantizeBlockScalar(internal::TablesFor(kind), codes.data(), scale, codes.size(),
                                  out.data());
}

Status Quantize(MapKind kind, std::span<const float> x, std::span<std::uint8_t> codes,
                std::span<float> scales) {
  if (codes.size() != x.size() || scales.size() != NumBlocks(x.size())) {
    return InvalidArgumentError(
        fmt::format("q8::Quantize: {} elements need {} codes and {} scales, got {} and {}",
                    x.size(), x.size(), NumBlocks(x.size()), codes.size(), scales.size()));
  }
  for (std::size_t b = 0; b < scales.size(); ++b) {
    const std::size_t begin = b * kBlockNumel;
    const std::size_t n = std::min(kBlockNumel, x.size() - begin);
    scales[b] = QuantizeBlock(kind, x.subspan(begin, n), codes.subspan(begin, n));
    if (scales[b] < 0) {
      const auto bad = std::find_if(x.begin() + static_cast<std::ptrdiff_t>(begin), x.end(),
                                    [](float v) { return !std::isfinite(v); });
      return FailedPreconditionError(
          fmt::format("q8::Quantize: element {} is {}; non-finite optimizer state is not encoded",
                      bad - x.begin(), *bad));
    }
  }
  return OkStatus();
}

Status Dequantize(MapKind kind, std::span<const std::uint8_t> codes, std::span<const float> scales,
                  std::span<float> out) {
  if (out.size() != codes.size() || scales.size() != NumBlocks(codes.size())) {
    return InvalidArgumentError(fmt::format(
        "q8::Dequantize: {} codes need {} scales and {} outputs, got {} and {}", codes.size(),
        NumBlocks(codes.size()), codes.size(), scales.size(), out.size()));
  }
  for (std::size_t b = 0; b < scales.size(); ++b) {
    const std::size_t begin = b * kBlockNumel;
    const std::size_t n = std::min(kBlockNumel, codes.size() - begin);
    DequantizeBlock(kind, codes.subspan(begin, n), scales[b], out.subspan(begin, n));
  }
  return OkStatus();
}

}  // namespace zinf::swapper::q8
