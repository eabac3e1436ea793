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
// fix doubled one step sooner ((i - last overflow) % window == 0).
//
// Thread safety: a plain value.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/engine/config.h"

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

  explicit LossScaler(const Fp16Config& config);

  // The scale the gradients handed to the next step carry (1 without fp16).
  double scale() const { return state_.scale; }
  bool enabled() const { return config_.enabled; }
  bool dynamic() const { return config_.enabled && config_.loss_scale == 0; }
  const State& state() const { return state_; }

  // After a step: `overflow` is whether its gradient held an Inf or NaN on some rank (the same
  // on every rank). Errors: FailedPrecondition for an overflow at min_loss_scale with the
  // hysteresis spent (DeepSpeed stops the run there; the state is left as it was).
  Status Update(bool overflow);

  // The state as JSON for a checkpoint ({"dynamic", "scale", "iteration",
  // "last_overflow_iteration", "hysteresis"}), and back. A dynamic scaler takes a saved dynamic
  // state and keeps its first scale for any other; a static or disabled one keeps its config's.
  // Errors: DataLoss for a malformed state (a scale that is not a positive finite number, a
  // hysteresis outside [1, fp16.hysteresis], ...).
  nlohmann::json ToJson() const;
  Status Restore(const nlohmann::json& saved);

 private:
  Fp16Config config_;
  State state_;
};

}  // namespace zinf::engine
