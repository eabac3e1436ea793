#include "swap_manifest.h"

#include <charconv>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "zinf/storage/checksum.h"

namespace zinf::storage {
namespace {

constexpr std::string_view kMagicPrefix = "zinf-swap-store ";
constexpr std::string_view kChecksumKey = "checksum ";
constexpr std::size_t kMaxTensorNameLength = 1024;
// Bounds the equal-shares map of a version 1 manifest (which lists no weights): a path count
// larger than any manifest that fits kMaxManifestBytes could describe is corrupt.
constexpr std::uint64_t kMaxManifestPaths = 1 << 20;

// The lines of a text, each without its '\n'; a last line without one counts too.
class Lines {
 public:
  explicit Lines(std::string_view text) : text_(text) {}
  std::optional<std::string_view> Next() {
    if (at_ >= text_.size()) return std::nullopt;
    const std::size_t end = std::min(text_.find('\n', at_), text_.size());
    const std::string_view line = text_.substr(at_, end - at_);
    at_ = end + 1;
    return line;
  }
  // Bytes before the next line.
  std::size_t offset() const { return std::min(at_, text_.size()); }
  bool done() const { return at_ >= text_.size(); }

 private:
  std::string_view text_;
  std::size_t at_ = 0;
};

// "<key> <decimal>" -> the number; nullopt for anything else.
std::optional<std::uint64_t> ParseKeyed(std::optional<std::string_view> line,
                                        std::string_view key) {
  if (!line || !line->starts_with(key) || line->size() <= key.size() ||
      (*line)[key.size()] != ' ') {
    return std::nullopt;
  }
  const std::string_view digits = line->substr(key.size() + 1);
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || digits[0] == '+' || ec != std::errc() ||
      end != digits.data() + digits.size()) {
    return std::nullopt;
  }
  return value;
}

// The weights of a line "path_weights 1 3": one decimal integer per path.
Result<StripeMap> ParseWeights(std::string_view line, std::uint64_t num_paths) {
  std::istringstream in{std::string(line)};
  std::string key;
  if (!(in >> key) || key != "path_weights") {
    return DataLossError(fmt::format("expected path_weights, got '{}'", line));
  }
  std::vector<std::uint32_t> weights;
  for (std::string word; in >> word;) {
    std::uint32_t w = 0;
    const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), w);
    if (ec != std::errc() || end != word.data() + word.size()) {
      return DataLossError(fmt::format("path weight '{}' is not an integer in [1, {}]", word,
                                       std::numeric_limits<std::uint32_t>::max()));
    }
    weights.push_back(w);
  }
  if (weights.size() != num_paths) {
    return DataLossError(fmt::format("{} path weights for {} paths", weights.size(), num_paths));
  }
  Result<StripeMap> map = StripeMap::FromWeights(weights);
  if (!map) return DataLossError(map.error().message());
  return map;
}

}  // namespace

Status ValidateTensorName(const std::string& name) {
  if (name.empty()) return InvalidArgumentError("swap store: tensor name is empty");
  if (name.size() > kMaxTensorNameLength) {
    return InvalidArgumentError(fmt::format("swap store: tensor name of {} characters (at most {})",
                                            name.size(), kMaxTensorNameLength));
  }
  for (unsigned char c : name) {
    if (c <= ' ' || c == 0x7f) {
      return InvalidArgumentError(fmt::format(
          "swap store: tensor name '{}' contains whitespace or a control character", name));
    }
  }
  return OkStatus();
}

std::string ManifestText(std::uint64_t stripe_unit_bytes, const StripeMap& map,
                         std::span<const TensorSpec> tensors) {
  std::string text =
      fmt::format("{}{}\nstripe_unit_bytes {}\npaths {}\npath_weights {}\ntensors {}\n",
                  kMagicPrefix, kManifestVersion, stripe_unit_bytes, map.weights().size(),
                  fmt::join(map.weights(), " "), tensors.size());
  for (const TensorSpec& t : tensors) text += fmt::format("tensor {} {}\n", t.size_bytes, t.name);
  const std::uint64_t sum = Checksum64(std::as_bytes(std::span(text.data(), text.size())));
  text += fmt::format("{}{}\n", kChecksumKey, ChecksumToHex(sum));
  return text;
}

Result<Manifest> ParseManifest(std::string_view text) {
  Manifest m;
  Lines lines(text);
  const std::optional<std::string_view> first = lines.Next();
  if (first == "zinf-swap-store 1") {
    m.version = 1;
  } else if (first == "zinf-swap-store 2") {
    m.version = 2;
  } else if (first == "zinf-swap-store 3") {
    m.version = 3;
  } else {
    return DataLossError("bad first line");
  }
  const std::optional<std::uint64_t> stripe_unit = ParseKeyed(lines.Next(), "stripe_unit_bytes");
  if (!stripe_unit || *stripe_unit == 0) return DataLossError("stripe unit");
  m.stripe_unit_bytes = *stripe_unit;
  const std::optional<std::uint64_t> num_paths = ParseKeyed(lines.Next(), "paths");
  if (!num_paths || *num_paths == 0 || *num_paths > kMaxManifestPaths) {
    return DataLossError("path count");
  }
  m.num_paths = *num_paths;
  if (m.version >= 2) {
    const std::optional<std::string_view> line = lines.Next();
    if (!line) return DataLossError("no path_weights line");
    ZINF_ASSIGN_OR_RETURN(m.map, ParseWeights(*line, m.num_paths));
  } else {
    m.map = StripeMap::Equal(m.num_paths);
  }
  const std::optional<std::uint64_t> num_tensors = ParseKeyed(lines.Next(), "tensors");
  if (!num_tensors) return DataLossError("tensor count");
  for (std::uint64_t i = 0; i < *num_tensors; ++i) {
    const std::optional<std::string_view> line = lines.Next();
    // "tensor <size_bytes> <name>"
    const std::size_t space = line ? line->rfind(' ') : std::string_view::npos;
    std::optional<std::uint64_t> size;
    TensorSpec spec;
    if (space != std::string_view::npos) {
      size = ParseKeyed(line->substr(0, space), "tensor");
      spec.name = std::string(line->substr(space + 1));
    }
    if (!size || !ValidateTensorName(spec.name)) {
      return DataLossError(fmt::format("tensor {} of {}", i, *num_tensors));
    }
    spec.size_bytes = *size;
    m.tensors.push_back(std::move(spec));
  }
  if (m.version >= 3) {
    const std::size_t covered = lines.offset();
    const std::optional<std::string_view> line = lines.Next();
    if (!line || !line->starts_with(kChecksumKey)) {
      return DataLossError(
          fmt::format("no checksum line after the {} tensor line(s)", *num_tensors));
    }
    const std::uint64_t computed = Checksum64(std::as_bytes(std::span(text.data(), covered)));
    const std::string_view stored = line->substr(kChecksumKey.size());
    if (stored != ChecksumToHex(computed)) {
      return DataLossError(
          fmt::format("checksum mismatch: stored {}, computed {} ({} over {} bytes)",
                      stored.substr(0, 32), ChecksumToHex(computed), kChecksumAlgorithm, covered));
    }
    if (!text.ends_with('\n')) return DataLossError("no newline after the checksum line");
  }
  if (!lines.done()) return DataLossError("text after the last line");
  return m;
}

}  // namespace zinf::storage
