#include "zinf/engine/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "saved_json.h"
#include "zinf/core/json.h"

namespace zinf::engine {

LossScaler::LossScaler(const config::Fp16Config& config) : config_(config) {
  if (!config.enabled) return;
  state_.scale =
      config.loss_scale > 0 ? config.loss_scale : std::ldexp(1.0, config.initial_scale_power);
  state_.hysteresis = config.hysteresis;
}

Status LossScaler::Update(bool overflow) {
  if (!dynamic()) return OkStatus();
  constexpr double kFactor = 2.0;
  State next = state_;
  if (overflow) {
    if (config_.hysteresis == 1 || state_.hysteresis == 1) {
      if (state_.scale == config_.min_loss_scale) {
        return FailedPreconditionError(fmt::format(
            "fp16: the gradient overflowed at the minimum loss scale {} (fp16.min_loss_scale); "
            "the run cannot go on (as in DeepSpeed): lower the learning rate, set "
            "gradient_clipping, or lower fp16.min_loss_scale",
            config_.min_loss_scale));
      }
      next.scale = std::fmax(state_.scale / kFactor, config_.min_loss_scale);
    } else {
      --next.hysteresis;
    }
    next.last_overflow_iteration = state_.iteration;
  } else {
    if (config_.consecutive_hysteresis) next.hysteresis = config_.hysteresis;
    const std::int64_t stable = state_.iteration - state_.last_overflow_iteration - 1;
    if (stable > 0 && stable % config_.loss_scale_window == 0) {
      if (!config_.consecutive_hysteresis) next.hysteresis = config_.hysteresis;
      next.scale = std::fmin(state_.scale * kFactor, MaxDynamicScale(config_));
    }
  }
  ++next.iteration;
  state_ = next;
  return OkStatus();
}

nlohmann::json LossScaler::ToJson() const {
  return {{"dynamic", dynamic()},
          {"scale", state_.scale},
          {"iteration", state_.iteration},
          {"last_overflow_iteration", state_.last_overflow_iteration},
          {"hysteresis", state_.hysteresis}};
}

double LossScaler::MinDynamicScale(const config::Fp16Config& config) {
  // Below min_loss_scale only before the first overflow, from a small first scale.
  return std::fmin(config.min_loss_scale, std::ldexp(1.0, config.initial_scale_power));
}

double LossScaler::MaxDynamicScale(const config::Fp16Config& config) {
  return std::fmax(kMaxDynamicScale, config.min_loss_scale);
}

Result<std::optional<LossScaler::State>> LossScaler::ParseState(const nlohmann::json& saved,
                                                                const config::Fp16Config& writer,
                                                                std::int64_t max_iteration) {
  auto bad = [&](std::string_view what) {
    return DataLossError(fmt::format("checkpoint loss scaler: {} in {}", what,
                                     DumpJsonForDisplay(saved).substr(0, 300)));
  };
  if (!saved.is_object()) return bad("not an object");
  if (!saved.contains("dynamic") || !saved.at("dynamic").is_boolean()) return bad("no dynamic");
  // A JSON integer within [min, max].
  auto integer = [&](const char* key, std::int64_t min, std::int64_t max) -> Result<std::int64_t> {
    if (!saved.contains(key)) return bad(fmt::format("no {}", key));
    const nlohmann::json& v = saved.at(key);
    if (!v.is_number_integer()) return bad(fmt::format("{} is not an integer", key));
    const std::optional<std::int64_t> value = Int64Of(v);
    if (!value || *value < min || *value > max) {
      return bad(fmt::format("{} {} is outside [{}, {}]", key, v.dump(), min, max));
    }
    return *value;
  };
  if (!saved.contains("scale") || !saved.at("scale").is_number()) return bad("no scale");
  State state;
  state.scale = saved.at("scale").get<double>();
  if (!(state.scale > 0) || !std::isfinite(state.scale)) {
    return bad(fmt::format("scale {} is not a positive finite number", state.scale));
  }
  ZINF_ASSIGN_OR_RETURN(state.iteration, integer("iteration", 0, max_iteration));
  ZINF_ASSIGN_OR_RETURN(state.last_overflow_iteration,
                        integer("last_overflow_iteration", -1, state.iteration - 1));
  const bool dynamic = saved.at("dynamic").get<bool>();
  ZINF_ASSIGN_OR_RETURN(
      const std::int64_t hysteresis,
      integer("hysteresis", 1, dynamic ? writer.hysteresis : std::numeric_limits<int>::max()));
  state.hysteresis = static_cast<int>(hysteresis);
  // A static or disabled scaler's state: a resume keeps its own config's scale.
  if (!dynamic) return std::optional<State>();
  const double min = MinDynamicScale(writer), max = MaxDynamicScale(writer);
  if (!(state.scale >= min && state.scale <= max)) {
    return bad(fmt::format(
        "scale {} is outside [{}, {}], the range of a dynamic scale with fp16.min_loss_scale {} "
        "and fp16.initial_scale_power {}",
        state.scale, min, max, writer.min_loss_scale, writer.initial_scale_power));
  }
  return std::optional<State>(state);
}

Status LossScaler::Restore(const std::optional<State>& saved) {
  if (!dynamic() || !saved) return OkStatus();
  const double min = MinDynamicScale(config_), max = MaxDynamicScale(config_);
  if (!(saved->scale >= min && saved->scale <= max)) {
    return FailedPreconditionError(fmt::format(
        "the checkpoint's loss scale {} is outside [{}, {}], the range of this run's fp16 config "
        "(fp16.min_loss_scale {}, fp16.initial_scale_power {}); resume with the config it was "
        "saved with",
        saved->scale, min, max, config_.min_loss_scale, config_.initial_scale_power));
  }
  State state = *saved;
  // The config may have changed since the save: the hysteresis left is clamped to the new one.
  state.hysteresis = std::min(state.hysteresis, config_.hysteresis);
  state_ = state;
  return OkStatus();
}

Status LossScaler::Restore(const nlohmann::json& saved) {
  ZINF_ASSIGN_OR_RETURN(const std::optional<State> state,
                        ParseState(saved, config_, std::numeric_limits<std::int64_t>::max()));
  return Restore(state);
}

}  // namespace zinf::engine
