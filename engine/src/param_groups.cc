// Parameter groups (engine.h, "Parameter groups"): their values (ResolveGroups, SetHyperParams),
// the schedule's values for a step (StepHyperParams, StepSegments), Step's agreement on them, and
// the checkpoint's record of them (GroupsJson, CheckGroups).
#include "engine_impl.h"

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/engine/lr_schedule.h"

namespace zinf::engine {

namespace {

using Json = nlohmann::json;
using comm::ReduceOp;

// A group's values at the scheduler's last_batch_iteration `position` (lr_schedule.h).
HyperParams Scheduled(const config::SchedulerConfig& scheduler, HyperParams h,
                      std::int64_t position) {
  h.betas = AdamBetas(scheduler, h.betas, position);
  h.lr = LearningRate(scheduler, h.lr, position);
  return h;
}

}  // namespace

// The groups' values (EngineOptions::param_groups over the config optimizer's), with every
// parameter's group in range.
Result<std::vector<HyperParams>> ResolveGroups(const config::OptimizerConfig& optimizer,
                                               const std::vector<ParamGroup>& groups,
                                               const std::vector<Param>& params) {
  const HyperParams config = {.lr = optimizer.lr,
                              .betas = optimizer.betas,
                              .eps = optimizer.eps,
                              .weight_decay = optimizer.weight_decay};
  if (groups.size() > kMaxParamGroups) {
    return InvalidArgumentError(
        fmt::format("engine: {} param_groups; at most {}", groups.size(), kMaxParamGroups));
  }
  std::vector<HyperParams> out;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const HyperParams h = {.lr = groups[g].lr.value_or(config.lr),
                           .betas = groups[g].betas.value_or(config.betas),
                           .eps = groups[g].eps.value_or(config.eps),
                           .weight_decay = groups[g].weight_decay.value_or(config.weight_decay)};
    ZINF_RETURN_IF_ERROR(Annotate(swapper::ValidateAdamHyperParams(h),
                                  fmt::format("engine: param_groups[{}]: ", g)));
    out.push_back(h);
  }
  if (out.empty()) out.push_back(config);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].group >= out.size()) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' is in group {}, but there {} {} parameter group(s)", i,
          EscapeForTerminal(params[i].name), params[i].group, out.size() == 1 ? "is" : "are",
          out.size()));
    }
  }
  return out;
}

double ZeroEngine::Impl::next_lr() const { return next_hyper_params(0).lr; }

HyperParams ZeroEngine::Impl::next_hyper_params(std::size_t g) const {
  ZINF_CHECK(g < groups_.size(), "parameter group {} of {}", g, groups_.size());
  return Scheduled(config_.scheduler, groups_[g], step_ - skipped_steps_ - 1);
}

Status ZeroEngine::Impl::SetHyperParams(std::span<const HyperParams> groups) {
  if (closed_) return FailedPreconditionError("engine: SetHyperParams after Close");
  if (config_.scheduler.type != config::SchedulerType::kNone) {
    return FailedPreconditionError(
        "engine: SetHyperParams: the config's scheduler block sets the learning rate; schedule "
        "it either there or in the loop, not both (remove the scheduler block to set it here)");
  }
  if (groups.size() != groups_.size()) {
    return InvalidArgumentError(
        fmt::format("engine: SetHyperParams: {} group(s) given, the engine has {}", groups.size(),
                    groups_.size()));
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ZINF_RETURN_IF_ERROR(Annotate(swapper::ValidateAdamHyperParams(groups[g]),
                                  fmt::format("engine: SetHyperParams: group {}: ", g)));
  }
  groups_.assign(groups.begin(), groups.end());
  return OkStatus();
}

// Step's agreement on the groups' values: a rank whose loop set others must not diverge
// silently. One allreduce of the values and their negations (max and -min).
Status ZeroEngine::Impl::AgreeOnGroups(std::int64_t step) {
  constexpr std::array<const char*, 5> kNames = {"lr", "beta1", "beta2", "eps", "weight_decay"};
  const std::size_t n = groups_.size() * kNames.size();
  std::vector<double> values(2 * n);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const HyperParams& h = groups_[g];
    const std::array<double, 5> mine = {h.lr, h.betas[0], h.betas[1], h.eps, h.weight_decay};
    for (std::size_t k = 0; k < mine.size(); ++k) {
      values[g * kNames.size() + k] = mine[k];
      values[n + g * kNames.size() + k] = -mine[k];
    }
  }
  ZINF_RETURN_IF_ERROR(state_->comm->AllreduceInPlace<double>(values, ReduceOp::kMax));
  for (std::size_t i = 0; i < n; ++i) {
    if (values[i] != -values[n + i]) {
      return FailedPreconditionError(fmt::format(
          "engine: step {}: parameter group {}'s {} differs between the ranks ({} to {}); every "
          "rank must set the same values; nothing was stepped",
          step, i / kNames.size(), kNames[i % kNames.size()], -values[n + i], values[i]));
    }
  }
  return OkStatus();
}

// The checkpoint's "param_groups" (trainer_state.h): each group's values and parameters.
nlohmann::json ZeroEngine::Impl::GroupsJson() const {
  Json groups = Json::array();
  for (const HyperParams& h : groups_) {
    groups.push_back({{"lr", h.lr},
                      {"betas", {h.betas[0], h.betas[1]}},
                      {"eps", h.eps},
                      {"weight_decay", h.weight_decay},
                      {"params", Json::array()}});
  }
  for (const Param& p : state_->params) groups[p.group]["params"].push_back(p.name);
  return groups;
}

// A restore's check of the checkpoint's groups against this engine's, by parameter name.
Status ZeroEngine::Impl::CheckGroups(const TrainerState& saved,
                                     const checkpoint::CheckpointInfo& info) const {
  const std::size_t count = saved.param_groups.empty() ? 1 : saved.param_groups.size();
  for (const Param& p : state_->params) {
    const std::optional<std::size_t> at = info.layout->FindParam(p.name);
    if (!at) continue;  // the layout check names it
    const std::size_t was = saved.group_of.empty() ? 0 : saved.group_of[*at];
    if (was != p.group) {
      return FailedPreconditionError(fmt::format(
          "{}: parameter '{}' is in parameter group {} of the checkpoint but in group {} here; "
          "a checkpoint restores into the same groups",
          info.path, EscapeForTerminal(p.name), was, p.group));
    }
  }
  if (count != groups_.size()) {
    return FailedPreconditionError(
        fmt::format("{}: the checkpoint has {} parameter group(s), this model {}; a checkpoint "
                    "restores into the same groups",
                    info.path, count, groups_.size()));
  }
  return OkStatus();
}

// The scheduled hyper-parameters of every group for `step` (Optimize's, and the speculation's).
// Skipped steps advance neither Adam's step count nor the schedule (DeepSpeed): the k-th applied
// step runs at the scheduler's last_batch_iteration k - 2 (lr_schedule.h).
Result<std::vector<HyperParams>> ZeroEngine::Impl::StepHyperParams(std::int64_t step) const {
  const std::int64_t applied = step - skipped_steps_;
  std::vector<HyperParams> hyper;
  for (const HyperParams& group : groups_) {
    hyper.push_back(Scheduled(config_.scheduler, group, applied - 2));
    if (!(hyper.back().betas[0] < 1.0)) {
      // DeepSpeed's OneCycle multiplies beta1 after the cycle, without a bound.
      return FailedPreconditionError(fmt::format(
          "step {}: OneCycle's momentum decay made beta1 {} (cycle_max_mom * (1 + "
          "decay_mom_rate * intervals), DeepSpeed's formula); Adam needs beta1 < 1: lower "
          "scheduler.params.decay_mom_rate; nothing was stepped",
          step, hyper.back().betas[0]));
    }
  }
  return hyper;
}

// The partition's runs of parameter groups with their hyper-parameters, for the swapper.
std::vector<swapper::AdamSegment> ZeroEngine::Impl::StepSegments(
    std::span<const HyperParams> hyper) const {
  std::vector<swapper::AdamSegment> segments;
  for (const auto& [begin, g] : state_->group_runs) {
    segments.push_back({.begin = begin, .hyper = hyper[g]});
  }
  return segments;
}

}  // namespace zinf::engine
