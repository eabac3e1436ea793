#include "zinf/partition/layout.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "zinf/core/check.h"
#include "zinf/core/json.h"
#include "zinf/core/units.h"

namespace zinf::partition {
namespace {

constexpr int kJsonVersion = 1;

bool IsNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '/' || c == '-';
}

// Quotes a name for an error message; bytes that are not printable ASCII become \xNN so that a
// hostile name cannot garble the log.
std::string Quote(std::string_view name) {
  std::string out = "'";
  for (char c : name) {
    auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7f || c == '\'' || c == '\\') {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  out += "'";
  return out;
}

std::string ParamLabel(std::size_t index, std::string_view name) {
  return fmt::format("parameter {} {}", index, Quote(name));
}

Status ValidateName(std::size_t index, std::string_view name) {
  if (name.empty()) return InvalidArgumentError(fmt::format("parameter {}: empty name", index));
  for (char c : name) {
    if (!IsNameChar(c)) {
      return InvalidArgumentError(fmt::format(
          "{}: character {} is not allowed in a parameter name (allowed: A-Z a-z 0-9 _ . : / -)",
          ParamLabel(index, name), Quote(std::string_view(&c, 1))));
    }
  }
  std::size_t start = 0;
  while (start <= name.size()) {
    std::size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    if (name.substr(start, end - start) == "..") {
      return InvalidArgumentError(fmt::format(
          "{}: a '..' path segment is not allowed in a parameter name", ParamLabel(index, name)));
    }
    start = end + 1;
  }
  return OkStatus();
}

Result<std::uint64_t> ValidateShape(std::size_t index, std::string_view name,
                                    const std::vector<std::int64_t>& shape) {
  std::uint64_t numel = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] <= 0) {
      return InvalidArgumentError(fmt::format("{}: dimension {} is {} in shape {} (must be > 0)",
                                              ParamLabel(index, name), d, shape[d],
                                              FormatShape(shape)));
    }
    if (!CheckedMul(numel, static_cast<std::uint64_t>(shape[d]), &numel) ||
        numel > kMaxLayoutNumel) {
      return InvalidArgumentError(fmt::format("{}: numel of shape {} exceeds 2^63 - 1",
                                              ParamLabel(index, name), FormatShape(shape)));
    }
  }
  return numel;
}

// A JSON value from a layout for a message: at most 64 characters, non-ASCII and controls
// escaped (\uXXXX) by the JSON dump itself.
std::string Shown(const nlohmann::json& value) {
  return DumpJsonForDisplay(value).substr(0, 64);
}

Error JsonError(std::string_view what) {
  return InvalidArgumentError(fmt::format("parameter layout JSON: {}", what));
}

}  // namespace

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

std::uint64_t DTypeSizeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

Result<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  return InvalidArgumentError(
      fmt::format("unknown dtype {} (expected fp32, bf16 or fp16)", Quote(name)));
}

std::string FormatShape(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Result<ParamLayout> ParamLayout::Create(std::vector<ParamSpec> params, DType dtype) {
  if (params.empty())
    return InvalidArgumentError("a parameter layout needs at least one parameter");
  if (DTypeName(dtype) == "unknown") {
    return InvalidArgumentError(fmt::format("unknown dtype value {}", static_cast<int>(dtype)));
  }
  ParamLayout layout;
  layout.dtype_ = dtype;
  layout.params_.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    ParamSpec& spec = params[i];
    ZINF_RETURN_IF_ERROR(ValidateName(i, spec.name));
    ZINF_ASSIGN_OR_RETURN(std::uint64_t numel, ValidateShape(i, spec.name, spec.shape));
    ParamInfo info;
    info.flat_offset = layout.total_numel_;
    info.numel = numel;
    if (!CheckedAdd(layout.total_numel_, numel, &layout.total_numel_) ||
        layout.total_numel_ > kMaxLayoutNumel) {
      return InvalidArgumentError(
          fmt::format("{}: total numel of the layout exceeds 2^63 - 1", ParamLabel(i, spec.name)));
    }
    layout.max_param_numel_ = std::max(layout.max_param_numel_, numel);
    info.name = std::move(spec.name);
    info.shape = std::move(spec.shape);
    layout.params_.push_back(std::move(info));
  }
  layout.sorted_by_name_.resize(layout.params_.size());
  for (std::size_t i = 0; i < layout.params_.size(); ++i) layout.sorted_by_name_[i] = i;
  const auto& p = layout.params_;
  std::ranges::stable_sort(layout.sorted_by_name_,
                           [&p](std::size_t a, std::size_t b) { return p[a].name < p[b].name; });
  for (std::size_t k = 1; k < layout.sorted_by_name_.size(); ++k) {
    std::size_t first = layout.sorted_by_name_[k - 1];
    std::size_t second = layout.sorted_by_name_[k];
    if (p[first].name == p[second].name) {
      return InvalidArgumentError(fmt::format("{}: duplicate name (also parameter {})",
                                              ParamLabel(second, p[second].name), first));
    }
  }
  return layout;
}

const ParamInfo& ParamLayout::param(std::size_t index) const {
  ZINF_CHECK_LT(index, params_.size());
  return params_[index];
}

std::optional<std::size_t> ParamLayout::FindParam(std::string_view name) const {
  auto it = std::ranges::lower_bound(
      sorted_by_name_, name, std::less<>(),
      [this](std::size_t i) -> std::string_view { return params_[i].name; });
  if (it == sorted_by_name_.end() || params_[*it].name != name) return std::nullopt;
  return *it;
}

std::size_t ParamLayout::ParamAtFlatOffset(std::uint64_t flat_offset) const {
  ZINF_CHECK_LT(flat_offset, total_numel_);
  auto it = std::ranges::upper_bound(params_, flat_offset, std::less<>(),
                                     [](const ParamInfo& info) { return info.flat_offset; });
  return static_cast<std::size_t>(it - params_.begin()) - 1;
}

bool operator==(const ParamLayout& a, const ParamLayout& b) {
  if (a.dtype_ != b.dtype_ || a.params_.size() != b.params_.size()) return false;
  for (std::size_t i = 0; i < a.params_.size(); ++i) {
    if (a.params_[i].name != b.params_[i].name || a.params_[i].shape != b.params_[i].shape) {
      return false;
    }
  }
  return true;
}

nlohmann::json ParamLayout::ToJson() const {
  nlohmann::json params = nlohmann::json::array();
  for (const ParamInfo& info : params_) {
    params.push_back({{"name", info.name}, {"shape", info.shape}});
  }
  return {{"version", kJsonVersion},
          {"dtype", DTypeName(dtype_)},
          {"total_numel", total_numel_},
          {"params", std::move(params)}};
}

std::string ParamLayout::ToJsonString() const { return ToJson().dump(); }

Result<ParamLayout> ParamLayout::FromJson(const nlohmann::json& json) {
  if (!json.is_object()) return JsonError("not an object");
  auto version = json.find("version");
  if (version == json.end() || !version->is_number_integer()) {
    return JsonError("missing integer 'version'");
  }
  if (version->get<std::int64_t>() != kJsonVersion) {
    return JsonError(fmt::format("unsupported version {} (this build reads {})",
                                 version->get<std::int64_t>(), kJsonVersion));
  }
  auto dtype_it = json.find("dtype");
  if (dtype_it == json.end() || !dtype_it->is_string()) return JsonError("missing string 'dtype'");
  ZINF_ASSIGN_OR_RETURN(
      DType dtype, Annotate(ParseDType(dtype_it->get<std::string>()), "parameter layout JSON: "));
  auto params_it = json.find("params");
  if (params_it == json.end() || !params_it->is_array()) return JsonError("missing array 'params'");
  std::vector<ParamSpec> specs;
  specs.reserve(params_it->size());
  for (std::size_t i = 0; i < params_it->size(); ++i) {
    const nlohmann::json& entry = (*params_it)[i];
    if (!entry.is_object()) return JsonError(fmt::format("params[{}] is not an object", i));
    auto name = entry.find("name");
    auto shape = entry.find("shape");
    if (name == entry.end() || !name->is_string()) {
      return JsonError(fmt::format("params[{}] has no string 'name'", i));
    }
    if (shape == entry.end() || !shape->is_array()) {
      return JsonError(fmt::format("params[{}] has no array 'shape'", i));
    }
    ParamSpec spec;
    spec.name = name->get<std::string>();
    for (const nlohmann::json& dim : *shape) {
      if (!dim.is_number_integer()) {
        return JsonError(fmt::format("params[{}] {}: shape has a non-integer dimension {}", i,
                                     Quote(spec.name), Shown(dim)));
      }
      if (dim.is_number_unsigned() && dim.get<std::uint64_t>() > kMaxLayoutNumel) {
        return JsonError(fmt::format("params[{}] {}: dimension {} exceeds 2^63 - 1", i,
                                     Quote(spec.name), Shown(dim)));
      }
      spec.shape.push_back(dim.get<std::int64_t>());
    }
    specs.push_back(std::move(spec));
  }
  ZINF_ASSIGN_OR_RETURN(ParamLayout layout,
                        Annotate(Create(std::move(specs), dtype), "parameter layout JSON: "));
  auto total = json.find("total_numel");
  if (total != json.end()) {
    if (!total->is_number_unsigned() || total->get<std::uint64_t>() != layout.total_numel()) {
      return JsonError(fmt::format("'total_numel' is {} but the shapes add up to {}", Shown(*total),
                                   layout.total_numel()));
    }
  }
  return layout;
}

Result<ParamLayout> ParamLayout::FromJsonString(std::string_view text) {
  // Bounded: a layout read from a file is hostile input (nesting, duplicate keys, huge numbers).
  Result<nlohmann::json> json = ParseJson(text);
  if (!json) return JsonError(json.error().message());
  return FromJson(*json);
}

Status CompareLayouts(const ParamLayout& expected, const ParamLayout& actual, bool compare_dtype) {
  const std::size_t common = std::min(expected.num_params(), actual.num_params());
  for (std::size_t i = 0; i < common; ++i) {
    const ParamInfo& want = expected.param(i);
    const ParamInfo& got = actual.param(i);
    if (want.name != got.name) {
      std::optional<std::size_t> got_in_expected = expected.FindParam(got.name);
      std::optional<std::size_t> want_in_actual = actual.FindParam(want.name);
      if (!want_in_actual.has_value()) {
        return FailedPreconditionError(fmt::format(
            "layout mismatch: parameter {} (index {}) expected but missing (found {} there)",
            Quote(want.name), i, Quote(got.name)));
      }
      if (!got_in_expected.has_value()) {
        return FailedPreconditionError(
            fmt::format("layout mismatch: unexpected parameter {} at index {} (expected {})",
                        Quote(got.name), i, Quote(want.name)));
      }
      return FailedPreconditionError(fmt::format(
          "layout mismatch: parameter order differs at index {}: {} expected, {} actual ({} is "
          "at index {} in the expected layout)",
          i, Quote(want.name), Quote(got.name), Quote(got.name), *got_in_expected));
    }
    if (want.shape != got.shape) {
      return FailedPreconditionError(
          fmt::format("layout mismatch: parameter {} (index {}): shape {} expected, {} actual",
                      Quote(want.name), i, FormatShape(want.shape), FormatShape(got.shape)));
    }
  }
  if (expected.num_params() > common) {
    return FailedPreconditionError(fmt::format(
        "layout mismatch: parameter {} (index {}) expected but missing ({} parameters expected, "
        "{} actual)",
        Quote(expected.param(common).name), common, expected.num_params(), actual.num_params()));
  }
  if (actual.num_params() > common) {
    return FailedPreconditionError(fmt::format(
        "layout mismatch: unexpected parameter {} at index {} ({} parameters expected, {} "
        "actual)",
        Quote(actual.param(common).name), common, expected.num_params(), actual.num_params()));
  }
  if (compare_dtype && expected.dtype() != actual.dtype()) {
    return FailedPreconditionError(fmt::format("layout mismatch: dtype {} expected, {} actual",
                                               DTypeName(expected.dtype()),
                                               DTypeName(actual.dtype())));
  }
  return OkStatus();
}

}  // namespace zinf::partition
