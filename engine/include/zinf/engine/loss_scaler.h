// LossScaler: DeepSpeed's fp16 loss scaling (the `fp16` block of the config), as ZeroEngine
// applies it around every step.
//
//   LossScaler scaler(config.fp16);
//   backward(loss * scaler.scale());                  // the loop's gradient of the scaled loss
//   const bool overflow = !isfinite(global_grad_norm_squared);   // agreed over the ranks
//   if (!overflow) step(grad / scaler.scale());
//   ZINF_RETURN_IF_ERROR(scaler.Update(overflow));
//
// fp16 disabled: the scale is 1 and Update does nothing. A static scale (fp16.loss_scale > 0)
// never changes. Dynamic (fp16.loss_scale 0), DeepSpeed's DynamicLossScaler.update_scale with
// scale factor 2, starting at 2^initial_scale_power with the hysteresis at its full value h
// (fp16.hysteresis), the iteration i at 0 and the last overflow at -1:
//   overflow:  if h == 1 or the hysteresis left is 1: the scale halves, but not below
//              min_loss_scale (an overflow at min_loss_scale is an error, as DeepSpeed raises);
//              else the hysteresis left drops by one. The last overflow is i.
//   clean:     with consecutive_hysteresis the hysteresis left is refilled to h. With
//              n = i - last overflow - 1 (the clean steps before this one since the overflow):
//              if n > 0 and n % loss_scale_window == 0, the scale doubles (and without
//              consecutive_hysteresis the hysteresis left is refilled to h).
//   then i += 1.
// This is the rule of DeepSpeed's loss_scaler.py today; releases before its "stable interval"
// fix doubled one step sooner ((i - last overflow) % window == 0). One difference: the scale
// doubles up to max_scale() = max(2^64, min_loss_scale) and stays there (DeepSpeed has no cap; a
// scale past 2^1023 would double into infinity). So a dynamic scale is always within
// [min(2^initial_scale_power, min_loss_scale), max_scale()]: ParseState checks a saved one
// against that range.
//
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/config/config.h"

namespace zinf::engine {

class LossScaler {
 public:
  // The state that a checkpoint keeps.
  struct State {
    double scale = 1.0;
    std::int64_t iteration = 0;  // DeepSpeed's cur_iter: updates so far
    std::int64_t last_overflow_iteration = -1;
    int hysteresis = 1;  // what is left of fp16.hysteresis
  };

  // The cap of a dynamic scale (see the top): the largest first scale fp16.initial_scale_power
  // allows.
  static constexpr double kMaxDynamicScale = 0x1p64;

  explicit LossScaler(const config::Fp16Config& config);

  // The scale the gradients handed to the next step carry (1 without fp16).
  double scale() const { return state_.scale; }
  bool enabled() const { return config_.enabled; }
  bool dynamic() const { return config_.enabled && config_.loss_scale == 0; }
  const State& state() const { return state_; }

  // After a step: `overflow` is whether its gradient held an Inf or NaN on some rank (the same
  // on every rank). Errors: FailedPrecondition for an overflow at min_loss_scale with the
  // hysteresis spent (DeepSpeed stops the run there; the state is left as it was).
  Status Update(bool overflow);

  // The range of the scale of a dynamic scaler with `config` (see the top).
  static double MinDynamicScale(const config::Fp16Config& config);
  static double MaxDynamicScale(const config::Fp16Config& config);

  // The state as JSON for a checkpoint ({"dynamic", "scale", "iteration",
  // "last_overflow_iteration", "hysteresis"}).
  nlohmann::json ToJson() const;
  // A saved state (ToJson), checked against what a scaler with `writer` (the saving run's fp16
  // config) can produce: every key present with its type, a finite scale > 0, iteration in
  // [0, max_iteration], last_overflow_iteration in [-1, iteration), hysteresis >= 1; a dynamic
  // state also a scale in [MinDynamicScale(writer), MaxDynamicScale(writer)] and a hysteresis
  // <= writer.hysteresis. Returns the dynamic state, or nullopt for a static or disabled
  // scaler's (which a resume ignores). Errors: DataLoss naming the key and the state.
  static Result<std::optional<State>> ParseState(const nlohmann::json& saved,
                                                 const config::Fp16Config& writer,
                                                 std::int64_t max_iteration);
  // Continues from a parsed state (ParseState). A dynamic scaler takes a saved dynamic state,
  // its hysteresis left clamped to this config's fp16.hysteresis, and keeps its first scale
  // without one; a static or disabled scaler keeps its config's. Errors: FailedPrecondition for
  // a saved scale outside this config's range [MinDynamicScale, MaxDynamicScale] (the config's
  // fp16.min_loss_scale was raised since the save, say): the state is left as it was.
  Status Restore(const std::optional<State>& saved);
  // ParseState with this scaler's own config as the writer's, then Restore.
  Status Restore(const nlohmann::json& saved);

 private:
  config::Fp16Config config_;
  State state_;
};

}  // namespace zinf::engine
