// Numbers read from the JSON of a checkpoint (hostile input): loss_scaler.cc, trainer_state.cc.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

namespace zinf::engine {

// The value of a JSON integer that fits in int64 (nlohmann keeps a non-negative one as
// unsigned, which get<std::int64_t>() would wrap); nullopt for any other value.
inline std::optional<std::int64_t> Int64Of(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return std::nullopt;
    }
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<std::int64_t>();
  return std::nullopt;
}

}  // namespace zinf::engine
