// StepInfo: what one ZeroEngine::Step did, and the one list of its fields that every form of it
// is derived from: the metrics file's JSON line (ZeroEngine's metrics_path), the Python dict of
// zinf's engine.step() and zinf.torch.StepInfo's attributes.
//
//   ForEachStepInfoField(info, [&](std::string_view name, const auto& value) { ... });
//   nlohmann::json record = StepInfoJson(info);   // {"step": 3, "lr": 0.001, ...}
//
// ForEachStepInfoField binds the struct's members by structured binding, so a member added to
// StepInfo and not to the list is a compile error, not a field that silently misses the metrics.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include <nlohmann/json.hpp>

namespace zinf::engine {

// What one Step did. Figures summed or maximized over the ranks are the same on every rank.
struct StepInfo {
  std::int64_t step = 0;  // the optimizer step just applied (1-based)
  double lr = 0;          // its learning rate (parameter group 0's)
  double loss = 0;        // the mean over ranks of the loss passed to Step (NaN if none)
  double grad_norm = 0;   // the global norm of the averaged gradient, before clipping
                          // (unscaled with fp16; Inf or NaN when the step overflowed)
  bool clipped = false;   // the gradient was scaled down to gradient_clipping
  // fp16: the loss scale the step's gradient carried, and the one for the next step (1 and 1
  // without fp16). A skipped step (an Inf or NaN in the gradient on some rank) did no swap I/O
  // of the optimizer state and changed no weight; it counts as a step (StepInfo::step, step_count())
  // but not for Adam's bias correction nor the learning-rate schedule (DeepSpeed).
  double loss_scale = 1;
  double next_loss_scale = 1;
  bool skipped = false;
  std::int64_t skipped_steps = 0;  // skipped steps so far, this one included
  double step_seconds = 0;         // since the previous Step returned (or Create), slowest rank
  double optimizer_seconds = 0;    // the swapped Adam step, slowest rank
  // Read and written by the swap stores since the previous Step returned, all ranks: the
  // micro-batches' gradient write-behind included, a checkpoint save's reads not.
  std::uint64_t swap_read_bytes = 0;
  std::uint64_t swap_write_bytes = 0;
  std::uint64_t optimizer_swap_read_bytes = 0;  // the part inside the optimizer step
  std::uint64_t optimizer_swap_write_bytes = 0;
  // optimizer_swap_{read,write}_bytes per parameter element (zinf.optimizer_state: about 12
  // each for fp32, about 6 for q8; more when sub-groups are small against the I/O alignment).
  double read_bytes_per_element = 0;
  double write_bytes_per_element = 0;
  // The speculative step (engine.h, "Speculative step"), sub-groups of all ranks: stepped
  // during the backward pass, and of them those this Step committed, stepped again (clipping
  // applied, or the arguments changed since) and dropped (an fp16 skip, a refused step).
  std::uint64_t speculated = 0;
  std::uint64_t speculation_committed = 0;
  std::uint64_t speculation_redone = 0;
  std::uint64_t speculation_discarded = 0;
  std::uint64_t peak_rss_bytes = 0;  // largest over the ranks
  // The host memory plan per rank (rank 0's) and the budget it was held against per rank (0:
  // unknown), docs/configs.md "The host memory plan": peak_rss_bytes is measured against them.
  std::uint64_t plan_bytes = 0;
  std::uint64_t budget_bytes = 0;
  bool stop_requested = false;       // a stop signal arrived on some rank
  int stop_signal = 0;               // which (this rank's; 0 if none here)
  // The checkpoint cadence (zinf.checkpoint.every with a checkpoint directory) says this step
  // should be followed by a save (ZeroEngine::SaveCheckpoint); a stop request makes it due too,
  // so that a stopped run resumes where it stopped. Always false without a cadence.
  bool checkpoint_due = false;
};

// Calls f(name, member) for every member of `info` (StepInfo or const StepInfo), in the order of
// the struct.
template <typename Info, typename F>
constexpr void ForEachStepInfoField(Info& info, F&& f) {
  auto& [step, lr, loss, grad_norm, clipped, loss_scale, next_loss_scale, skipped, skipped_steps,
         step_seconds, optimizer_seconds, swap_read_bytes, swap_write_bytes,
         optimizer_swap_read_bytes, optimizer_swap_write_bytes, read_bytes_per_element,
         write_bytes_per_element, speculated, speculation_committed, speculation_redone,
         speculation_discarded, peak_rss_bytes, plan_bytes, budget_bytes, stop_requested,
         stop_signal, checkpoint_due] =
      info;
  f("step", step);
  f("lr", lr);
  f("loss", loss);
  f("grad_norm", grad_norm);
  f("clipped", clipped);
  f("loss_scale", loss_scale);
  f("next_loss_scale", next_loss_scale);
  f("skipped", skipped);
  f("skipped_steps", skipped_steps);
  f("step_seconds", step_seconds);
  f("optimizer_seconds", optimizer_seconds);
  f("swap_read_bytes", swap_read_bytes);
  f("swap_write_bytes", swap_write_bytes);
  f("optimizer_swap_read_bytes", optimizer_swap_read_bytes);
  f("optimizer_swap_write_bytes", optimizer_swap_write_bytes);
  f("read_bytes_per_element", read_bytes_per_element);
  f("write_bytes_per_element", write_bytes_per_element);
  f("speculated", speculated);
  f("speculation_committed", speculation_committed);
  f("speculation_redone", speculation_redone);
  f("speculation_discarded", speculation_discarded);
  f("peak_rss_bytes", peak_rss_bytes);
  f("plan_bytes", plan_bytes);
  f("budget_bytes", budget_bytes);
  f("stop_requested", stop_requested);
  f("stop_signal", stop_signal);
  f("checkpoint_due", checkpoint_due);
}

// The field names, in order.
std::span<const std::string_view> StepInfoFieldNames();

// Every field, as a JSON object (the metrics file's line adds "world_size").
nlohmann::json StepInfoJson(const StepInfo& info);

}  // namespace zinf::engine
