// Block-wise 8-bit quantization of Adam's moments (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", ICLR 2022): the codec of the `q8` optimizer state format.
//
// A tensor is cut into blocks of kBlockNumel elements (the last one shorter). Each block keeps
// one fp32 scale, the largest |x| of the block, and one 8-bit code per element: the index of
// the entry of a fixed 256-entry map (values in [-1, 1], ascending) nearest to x / scale.
// Decoding is map[code] * scale.
//
// The maps are the paper's dynamic (tree) quantization: a value is 10^-E times a linear
// fraction, where E (0..6) is the number of zero bits before the first one bit (the indicator)
// and the bits after the indicator split [0.1, 1] into equal intervals whose midpoints are the
// values; precision is spent where the magnitudes are, over seven decades.
//   - kSigned (exp_avg): a sign bit, then 7 bits: 2^(6-E) fractions per decade E, 127 values of
//     each sign; the two patterns without an indicator bit stand for 0 and 1, so that 0 and a
//     block's largest positive element are exact.
//   - kUnsigned (exp_avg_sq, never negative): the sign bit becomes a fraction bit: 2^(7-E)
//     fractions per decade, 254 values in (0, 1), 0 and 1.
// Codes are the indices of the sorted map, so code order is value order.
//
// Nearest: the code whose value is nearest to x / scale (float division), ties to the smaller
// code; with exact arithmetic (distances compared in double, where they are exact), so any
// implementation of the rule gives the same codes. Negative inputs to kUnsigned get code 0.
//
// Blocks: a block whose elements are all zero has scale 0 and the codes of 0. A block holding a
// NaN or an infinity is not encoded (Quantize* report it), so that non-finite values never turn
// into finite-looking state.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf::swapper {

// The format of the swapped Adam state (zinf.optimizer_state), for the whole run.
//   kFp32: fp32 weights, exp_avg and exp_avg_sq (12 bytes per element each way per step);
//   kQ8:   fp32 weights, exp_avg and exp_avg_sq as this codec's 8-bit codes plus one fp32 scale
//          per block each (6 + 8 / kBlockNumel bytes per element).
enum class StateFormat { kFp32 = 0, kQ8 = 1 };
// The formats' names, indexed by StateFormat: the one list zinf.optimizer_state and the benches'
// --optimizer-state accept.
inline constexpr std::array<std::string_view, 2> kStateFormatNames = {"fp32", "q8"};
std::string_view StateFormatName(StateFormat format);  // kStateFormatNames[format]

}  // namespace zinf::swapper

namespace zinf::swapper::q8 {

inline constexpr std::size_t kBlockNumel = 2048;

enum class MapKind { kSigned, kUnsigned };

// The 256 values of `kind`'s map, ascending.
const std::array<float, 256>& MapValues(MapKind kind);
// The code of 0 (kSigned: 127; kUnsigned: 0).
std::uint8_t ZeroCode(MapKind kind);

// The nearest code (see the top) to `normalized` (x / scale, in [-1, 1] for finite blocks).
std::uint8_t NearestCode(MapKind kind, float normalized);

// Blocks of a tensor of `numel` elements.
constexpr std::size_t NumBlocks(std::size_t numel) {
  return (numel + kBlockNumel - 1) / kBlockNumel;
}

// Encodes one block x[0, n), n <= kBlockNumel, into codes[0, n); returns its scale, or -1 (and
// leaves `codes` undefined) if x holds a NaN or an infinity.
float QuantizeBlock(MapKind kind, std::span<const float> x, std::span<std::uint8_t> codes);
// Decodes one block: out[i] = MapValues(kind)[codes[i]] * scale.
void DequantizeBlock(MapKind kind, std::span<const std::uint8_t> codes, float scale,
                     std::span<float> out);

// Whole tensors: x.size() == codes.size(), scales.size() == NumBlocks(x.size()).
// Errors: InvalidArgument (sizes), FailedPrecondition (a non-finite element; its index is
// named, and `codes`/`scales` are then undefined).
Status Quantize(MapKind kind, std::span<const float> x, std::span<std::uint8_t> codes,
                std::span<float> scales);
Status Dequantize(MapKind kind, std::span<const std::uint8_t> codes, std::span<const float> scales,
                  std::span<float> out);

}  // namespace zinf::swapper::q8
