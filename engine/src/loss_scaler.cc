#include "zinf/engine/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <fmt/format.h>

namespace zinf::engine {

LossScaler::LossScaler(const Fp16Config& config) : config_(config) {
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
      next.scale = state_.scale * kFactor;
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

Status LossScaler::Restore(const nlohmann::json& saved) {
  if (!dynamic()) return OkStatus();
  auto bad = [&](std::string_view what) {
    return DataLossError(
        fmt::format("checkpoint loss scaler: {} in {}", what,
                    saved.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  };
  if (!saved.is_object()) return bad("not an object");
  // A run with a static scale or without fp16 saved no dynamic state: start at the config's.
  if (!saved.contains("dynamic") || !saved.at("dynamic").is_boolean()) return bad("no dynamic");
  if (!saved.at("dynamic").get<bool>()) return OkStatus();
  for (const char* key : {"scale", "iteration", "last_overflow_iteration", "hysteresis"}) {
    if (!saved.contains(key) || !saved.at(key).is_number()) return bad(fmt::format("no {}", key));
  }
  for (const char* key : {"iteration", "last_overflow_iteration", "hysteresis"}) {
    if (!saved.at(key).is_number_integer()) return bad(fmt::format("{} is not an integer", key));
  }
  State state;
  state.scale = saved.at("scale").get<double>();
  state.iteration = saved.at("iteration").get<std::int64_t>();
  state.last_overflow_iteration = saved.at("last_overflow_iteration").get<std::int64_t>();
  const std::int64_t hysteresis = saved.at("hysteresis").get<std::int64_t>();
  if (!(state.scale > 0) || !std::isfinite(state.scale)) return bad("a bad scale");
  if (state.iteration < 0 || state.last_overflow_iteration < -1 ||
      state.last_overflow_iteration >= state.iteration) {
    return bad("bad iterations");
  }
  // The config may have changed since the save: the hysteresis left is clamped to the new one.
  if (hysteresis < 1) return bad("a bad hysteresis");
  state.hysteresis = static_cast<int>(std::min<std::int64_t>(hysteresis, config_.hysteresis));
  state_ = state;
  return OkStatus();
}

}  // namespace zinf::engine
