// ParamLayout: the ordered, named parameters of a model and their place in the flat vector.
//
// The flat vector is the concatenation of every parameter (row-major, in layout order) with no
// padding: parameter i occupies [param(i).flat_offset, param(i).flat_offset + param(i).numel).
// Partition plans (plan.h) cut this vector between ranks; checkpoints store it as one dataset per
// state tensor and store the layout next to it (ToJson) so that a restore can check that the
// model it loads into has the same parameters (CompareLayouts).
//
//   ZINF_ASSIGN_OR_RETURN(ParamLayout layout,
//                         ParamLayout::Create({{"embed.weight", {50304, 768}},
//                                              {"ln_f.bias", {768}}}, DType::kBFloat16));
//
// Thread safety: ParamLayout is an immutable value; const methods may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "zinf/core/status.h"

namespace zinf::partition {

// Working precision of the model parameters (the optimizer state itself is always fp32).
enum class DType : std::uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

// "fp32", "bf16", "fp16" (the names used in JSON).
std::string_view DTypeName(DType dtype);
// Bytes per element: 4 or 2.
std::uint64_t DTypeSizeBytes(DType dtype);
// Accepts "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16". Errors: InvalidArgument.
Result<DType> ParseDType(std::string_view name);

// Largest total_numel (and largest numel of one parameter) a layout accepts: 2^63 - 1, so that
// every element count and offset also fits in a std::int64_t.
inline constexpr std::uint64_t kMaxLayoutNumel = 0x7fff'ffff'ffff'ffffULL;

// What a caller describes: a name and a shape. An empty shape is a scalar (one element).
struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;
};

// A validated parameter with its place in the flat vector.
struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;  // every dimension > 0
  std::uint64_t numel = 0;          // product of the shape (1 for a scalar), > 0
  std::uint64_t flat_offset = 0;    // first element in the flat vector
};

class ParamLayout {
 public:
  // Validates `params` and computes flat offsets. Errors (InvalidArgument, the message names the
  // parameter by index and name):
  //  - no parameters;
  //  - an empty name, a duplicate name, a character outside [A-Za-z0-9_.:/-], or a ".." segment
  //    (between '/' separators);
  //  - a dimension <= 0;
  //  - a parameter numel or the total numel above kMaxLayoutNumel.
  static Result<ParamLayout> Create(std::vector<ParamSpec> params, DType dtype = DType::kFloat32);

  // Parses what ToJson wrote. Errors: InvalidArgument for a malformed description (missing or
  // mistyped keys, unknown version or dtype, total_numel inconsistent with the shapes) and for
  // everything Create rejects.
  static Result<ParamLayout> FromJson(const nlohmann::json& json);
  // Parses JSON text; errors as FromJson, plus InvalidArgument for text that is not JSON.
  static Result<ParamLayout> FromJsonString(std::string_view text);

  // {"version": 1, "dtype": "bf16", "total_numel": N,
  //  "params": [{"name": "a.weight", "shape": [4, 8]}, ...]}   (flat offsets are implied)
  nlohmann::json ToJson() const;
  std::string ToJsonString() const;  // compact, one line

  std::size_t num_params() const { return params_.size(); }
  // Precondition (checked): index < num_params().
  const ParamInfo& param(std::size_t index) const;
  const std::vector<ParamInfo>& params() const { return params_; }
  std::uint64_t total_numel() const { return total_numel_; }
  DType dtype() const { return dtype_; }
  // Largest numel of one parameter.
  std::uint64_t max_param_numel() const { return max_param_numel_; }

  // Index of the parameter called `name`, if any. O(log n).
  std::optional<std::size_t> FindParam(std::string_view name) const;
  // Index of the parameter that holds flat element `flat_offset`. O(log n).
  // Precondition (checked): flat_offset < total_numel().
  std::size_t ParamAtFlatOffset(std::uint64_t flat_offset) const;

  // Same parameters (names, shapes, order) and dtype.
  friend bool operator==(const ParamLayout& a, const ParamLayout& b);

 private:
  ParamLayout() = default;

  std::vector<ParamInfo> params_;
  std::vector<std::size_t> sorted_by_name_;  // indices into params_, ordered by name
  std::uint64_t total_numel_ = 0;
  std::uint64_t max_param_numel_ = 0;
  DType dtype_ = DType::kFloat32;
};

// Checks that `actual` (e.g. the model being restored into) has the layout of `expected` (e.g.
// the one stored in a checkpoint). Returns OK, or FailedPrecondition naming the first mismatch
// in parameter order: a parameter missing, unexpected or in another position, a different shape
// ("parameter 'h.0.w' (index 3): shape [4, 8] expected, [8, 4] actual"), and last a different
// dtype (only when `compare_dtype`).
Status CompareLayouts(const ParamLayout& expected, const ParamLayout& actual,
                      bool compare_dtype = true);

// "[4, 8]"; "[]" for a scalar.
std::string FormatShape(const std::vector<std::int64_t>& shape);

}  // namespace zinf::partition
