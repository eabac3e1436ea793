#include "zinf/core/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf {

std::uint64_t AlignUp(std::uint64_t value, std::uint64_t alignment) {
  ZINF_CHECK_GT(alignment, 0u);
  std::uint64_t rem = value % alignment;
  if (rem == 0) return value;
  std::uint64_t out;
  ZINF_CHECK(CheckedAdd(value, alignment - rem, &out), "AlignUp({}, {}) overflows", value,
             alignment);
  return out;
}

Result<std::uint64_t> ParseBytes(std::string_view text) {
  // Strict: digits, an optional fraction, an optional unit, nothing else (no sign, exponent,
  // space or second unit), so that "2 G B" or " 2G" is an error, not a guess.
  auto digits_at = [&](std::size_t pos) {
    std::size_t end = pos;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    return end - pos;
  };
  std::size_t number_size = digits_at(0);
  if (number_size > 0 && number_size < text.size() && text[number_size] == '.') {
    const std::size_t fraction = digits_at(number_size + 1);
    number_size = fraction == 0 ? 0 : number_size + 1 + fraction;
  }
  if (number_size == 0) {
    return InvalidArgumentError(
        fmt::format("'{}' is not a byte size (e.g. 4096, 64K, 1MiB, 1.5G)", text));
  }
  const std::string number(text.substr(0, number_size));
  std::string unit;
  for (char c : text.substr(number_size)) {
    unit.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  }
  std::uint64_t multiplier = 0;
  static constexpr std::pair<std::string_view, std::uint64_t> kUnits[] = {
      {"", 1},       {"B", 1},           {"K", kKiB},         {"KB", kKiB},        {"KIB", kKiB},
      {"M", kMiB},   {"MB", kMiB},       {"MIB", kMiB},       {"G", kGiB},         {"GB", kGiB},
      {"GIB", kGiB}, {"T", kGiB * 1024}, {"TB", kGiB * 1024}, {"TIB", kGiB * 1024}};
  for (const auto& [name, value] : kUnits) {
    if (unit == name) multiplier = value;
  }
  if (multiplier == 0) {
    return InvalidArgumentError(fmt::format("'{}': unknown size unit '{}' (use B, K, M, G or T)",
                                            text, text.substr(number_size)));
  }
  if (number.find('.') == std::string::npos) {
    std::uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
    std::uint64_t bytes;
    if (ec != std::errc() || ptr != number.data() + number.size() ||
        !CheckedMul(value, multiplier, &bytes)) {
      return InvalidArgumentError(
          fmt::format("'{}' is not a byte size that fits in 64 bits", text));
    }
    return bytes;
  }
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  double bytes = value * static_cast<double>(multiplier);
  if (*end != '\0' || !std::isfinite(bytes) || bytes >= 1.8e19) {
    return InvalidArgumentError(fmt::format("'{}' is not a byte size", text));
  }
  if (bytes != std::floor(bytes)) {
    return InvalidArgumentError(fmt::format("'{}' is not a whole number of bytes", text));
  }
  return static_cast<std::uint64_t>(bytes);
}

std::string FormatBytes(std::uint64_t bytes) {
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  static constexpr const char* kNames[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / kKiB;
  int i = 0;
  while (value >= 1024.0 && i < 4) {
    value /= 1024.0;
    ++i;
  }
  return fmt::format("{:.2f} {}", value, kNames[i]);
}

}  // namespace zinf
