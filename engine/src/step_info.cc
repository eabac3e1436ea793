#include "zinf/engine/step_info.h"

#include <array>
#include <cstddef>

namespace zinf::engine {
namespace {

constexpr std::size_t NumStepInfoFields() {
  StepInfo info;
  std::size_t n = 0;
  ForEachStepInfoField(info, [&](std::string_view, const auto&) { ++n; });
  return n;
}

constexpr auto kFieldNames = [] {
  std::array<std::string_view, NumStepInfoFields()> names;
  StepInfo info;
  std::size_t i = 0;
  ForEachStepInfoField(info, [&](std::string_view name, const auto&) { names[i++] = name; });
  return names;
}();

}  // namespace

std::span<const std::string_view> StepInfoFieldNames() { return kFieldNames; }

nlohmann::json StepInfoJson(const StepInfo& info) {
  nlohmann::json record = nlohmann::json::object();
  ForEachStepInfoField(
      info, [&](std::string_view name, const auto& value) { record[std::string(name)] = value; });
  return record;
}

}  // namespace zinf::engine
