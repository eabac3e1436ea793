// The q8 codec (q8.h): the dynamic maps, nearest-code search and block (de)quantization.
#include "zinf/swapper/q8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include <fmt/format.h>

namespace zinf::swapper::q8 {
namespace {

constexpr int kDecades = 7;  // E = 0..6: values in [1e-7, 1)

// The guess table of NearestCode covers magnitudes [kGuessLow, 1] in slots of one binade's
// 1/32 (a float's exponent and top 5 mantissa bits), which hold at most a few codes each.
constexpr int kGuessShift = 18;
constexpr float kGuessLow = 1e-8f;
const std::uint32_t kGuessFirst = std::bit_cast<std::uint32_t>(kGuessLow) >> kGuessShift;
const std::uint32_t kGuessLast = std::bit_cast<std::uint32_t>(1.0f) >> kGuessShift;

// A map and its decision thresholds: thresholds[c] is the midpoint (exact in double) of values
// c and c + 1; x goes to the number of thresholds below it. guess[slot]: that number for the
// smallest magnitude of the slot.
struct Map {
  std::array<float, 256> values;
  std::array<double, 255> thresholds;
  std::vector<std::uint8_t> guess;
  std::uint8_t zero_code;
};

std::uint8_t CountBelow(const Map& map, double x) {
  return static_cast<std::uint8_t>(
      std::lower_bound(map.thresholds.begin(), map.thresholds.end(), x) - map.thresholds.begin());
}

Map Build(MapKind kind) {
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
  Map map{};
  std::vector<float> f(v.begin(), v.end());
  std::sort(f.begin(), f.end());
  std::copy(f.begin(), f.end(), map.values.begin());
  for (std::size_t c = 0; c + 1 < map.values.size(); ++c) {
    map.thresholds[c] =
        (static_cast<double>(map.values[c]) + static_cast<double>(map.values[c + 1])) / 2;
  }
  map.zero_code = static_cast<std::uint8_t>(std::find(map.values.begin(), map.values.end(), 0.0f) -
                                            map.values.begin());
  for (std::uint32_t slot = kGuessFirst; slot <= kGuessLast; ++slot) {
    map.guess.push_back(CountBelow(map, std::bit_cast<float>(slot << kGuessShift)));
  }
  return map;
}

const Map& GetMap(MapKind kind) {
  static const Map kSignedMap = Build(MapKind::kSigned);
  static const Map kUnsignedMap = Build(MapKind::kUnsigned);
  return kind == MapKind::kSigned ? kSignedMap : kUnsignedMap;
}

}  // namespace

const std::array<float, 256>& MapValues(MapKind kind) { return GetMap(kind).values; }

std::uint8_t ZeroCode(MapKind kind) { return GetMap(kind).zero_code; }

std::uint8_t NearestCode(MapKind kind, float normalized) {
  const Map& map = GetMap(kind);
  // The answer is the number of thresholds strictly below x (ties go to the smaller code).
  // Start from the slot of |x| (mirrored for a negative x: the signed map is symmetric), then
  // walk to the exact answer; the walk alone decides, the start only saves steps.
  const float magnitude = std::fabs(normalized);
  int c = map.zero_code;
  if (magnitude >= kGuessLow) {
    const std::uint32_t slot =
        std::min(std::bit_cast<std::uint32_t>(magnitude) >> kGuessShift, kGuessLast);
    c = map.guess[slot - kGuessFirst];
    if (normalized < 0) c = 2 * map.zero_code - c;
    c = std::clamp(c, 0, 255);
  }
  const double x = normalized;
  while (c < 255 && map.thresholds[static_cast<std::size_t>(c)] < x) ++c;
  while (c > 0 && map.thresholds[static_cast<std::size_t>(c) - 1] >= x) --c;
  return static_cast<std::uint8_t>(c);
}

float QuantizeBlock(MapKind kind, std::span<const float> x, std::span<std::uint8_t> codes) {
  float scale = 0.0f;
  for (float value : x) {
    if (!std::isfinite(value)) return -1.0f;
    scale = std::max(scale, std::fabs(value));
  }
  if (scale == 0.0f) {
    std::fill(codes.begin(), codes.begin() + static_cast<std::ptrdiff_t>(x.size()), ZeroCode(kind));
    return 0.0f;
  }
  for (std::size_t i = 0; i < x.size(); ++i) codes[i] = NearestCode(kind, x[i] / scale);
  return scale;
}

void DequantizeBlock(MapKind kind, std::span<const std::uint8_t> codes, float scale,
                     std::span<float> out) {
  const std::array<float, 256>& values = MapValues(kind);
  for (std::size_t i = 0; i < codes.size(); ++i) out[i] = values[codes[i]] * scale;
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
