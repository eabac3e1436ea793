// Byte units, alignment arithmetic and human-readable sizes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf {

inline constexpr std::uint64_t kKiB = 1024;
inline constexpr std::uint64_t kMiB = 1024 * kKiB;
inline constexpr std::uint64_t kGiB = 1024 * kMiB;

// Rounds `value` up / down to a multiple of `alignment` (> 0, need not be a power of two).
// Precondition (checked): the rounded-up value does not overflow.
std::uint64_t AlignUp(std::uint64_t value, std::uint64_t alignment);
constexpr std::uint64_t AlignDown(std::uint64_t value, std::uint64_t alignment) {
  return value - value % alignment;
}
constexpr bool IsAligned(std::uint64_t value, std::uint64_t alignment) {
  return value % alignment == 0;
}

// Parses "4096", "1M", "1MiB", "1.5G", "64k", "2GB" (binary multiples: K/KB/KiB = 1024, ...):
// digits, an optional fraction and an optional unit, nothing else (no space, sign or exponent).
// Errors: InvalidArgument naming the text, for a bad number, unit or overflow.
Result<std::uint64_t> ParseBytes(std::string_view text);

// "512 B", "4.0 KiB", "1.50 GiB".
std::string FormatBytes(std::uint64_t bytes);

// Checked arithmetic for sizes that come from the outside; false on overflow.
inline bool CheckedMul(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool CheckedAdd(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace zinf
