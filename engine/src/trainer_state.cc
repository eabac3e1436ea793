#include "zinf/engine/trainer_state.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "saved_json.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"

namespace zinf::engine {
namespace {

using Json = nlohmann::json;

std::string Shown(const Json& value) { return DumpJsonForDisplay(value).substr(0, 200); }

// An error about the trainer state's "param_groups".
Error BadParamGroups(const std::string& where, const std::string& what) {
  return DataLossError(fmt::format("{} param_groups: {}", where, what));
}

// One group of "param_groups": its hyper-parameters, validated, and its "params" array.
struct ParamGroup {
  swapper::AdamHyperParams hyper;
  const Json* names;
};

// Group `g` of "param_groups".
Result<ParamGroup> ReadParamGroup(const Json& group, std::size_t g, const std::string& where) {
  auto number = [&](const char* key) -> std::optional<double> {
    if (!group.is_object() || !group.contains(key) || !group.at(key).is_number()) {
      return std::nullopt;
    }
    return group.at(key).get<double>();
  };
  const std::optional<double> lr = number("lr"), eps = number("eps"), wd = number("weight_decay");
  const Json* betas = group.is_object() && group.contains("betas") ? &group.at("betas") : nullptr;
  const Json* names = group.is_object() && group.contains("params") ? &group.at("params") : nullptr;
  if (!lr || !eps || !wd || betas == nullptr || !betas->is_array() || betas->size() != 2 ||
      !(*betas)[0].is_number() || !(*betas)[1].is_number() || names == nullptr ||
      !names->is_array()) {
    return BadParamGroups(where,
                          fmt::format("group {} is {}, expected {{\"lr\", \"betas\": [2 numbers], "
                                      "\"eps\", \"weight_decay\", \"params\": [names]}}",
                                      g, Shown(group)));
  }
  const swapper::AdamHyperParams hyper = {
      .lr = *lr,
      .betas = {(*betas)[0].get<double>(), (*betas)[1].get<double>()},
      .eps = *eps,
      .weight_decay = *wd};
  if (Status valid = swapper::ValidateAdamHyperParams(hyper); !valid) {
    return BadParamGroups(where, fmt::format("group {}: {}", g, valid.error().message()));
  }
  return ParamGroup{hyper, names};
}

// The trainer state's "param_groups" (trainer_state.h) against the file's layout.
Status ReadParamGroups(const Json& groups, const checkpoint::CheckpointInfo& info,
                       const std::string& where, TrainerState* state) {
  if (!groups.is_array() || groups.empty() || groups.size() > kMaxParamGroups) {
    return BadParamGroups(where, fmt::format("expected an array of 1 to {} groups, got {}",
                                             kMaxParamGroups, Shown(groups)));
  }
  const partition::ParamLayout& layout = *info.layout;
  constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  state->group_of.assign(layout.num_params(), kNone);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ZINF_ASSIGN_OR_RETURN(const ParamGroup group, ReadParamGroup(groups[g], g, where));
    state->param_groups.push_back(group.hyper);
    for (const Json& name : *group.names) {
      const std::optional<std::size_t> p =
          name.is_string() ? layout.FindParam(name.get<std::string>()) : std::nullopt;
      if (!p) {
        return BadParamGroups(
            where,
            fmt::format("group {} names {}, not a parameter of the checkpoint", g, Shown(name)));
      }
      if (state->group_of[*p] != kNone) {
        return BadParamGroups(where, fmt::format("parameter {} is in groups {} and {}", Shown(name),
                                                 state->group_of[*p], g));
      }
      state->group_of[*p] = g;
    }
  }
  for (std::size_t p = 0; p < layout.num_params(); ++p) {
    if (state->group_of[p] == kNone) {
      return BadParamGroups(where, fmt::format("parameter '{}' is in no group",
                                               EscapeForTerminal(layout.param(p).name)));
    }
  }
  return OkStatus();
}

}  // namespace

Result<config::Fp16Config> SavedFp16Config(const Json& config) {
  config::Fp16Config fp16;
  if (!config.is_object() || !config.contains("fp16")) return fp16;
  const Json& block = config.at("fp16");
  if (!block.is_object()) {
    return DataLossError(
        fmt::format("the checkpoint's config: fp16 is {}, expected an object", Shown(block)));
  }
  auto bad = [&](std::string_view key, std::string_view want) {
    return DataLossError(fmt::format("the checkpoint's config: fp16.{} is {}, expected {}", key,
                                     Shown(block.at(key)), want));
  };
  // The ranges of config/src/schema.cc's fp16 keys.
  if (block.contains("enabled")) {
    if (!block.at("enabled").is_boolean()) return bad("enabled", "true or false");
    fp16.enabled = block.at("enabled").get<bool>();
  }
  auto number = [&](const char* key, double* out, double min, bool min_open) -> Status {
    if (!block.contains(key)) return OkStatus();
    const Json& v = block.at(key);
    const double x = v.is_number() ? v.get<double>() : std::nan("");
    if (!std::isfinite(x) || x < min || (min_open && x == min)) {
      return bad(key, fmt::format("a finite number {} {}", min_open ? ">" : ">=", min));
    }
    *out = x;
    return OkStatus();
  };
  auto integer = [&](const char* key, std::int64_t min, std::int64_t max) -> Result<std::int64_t> {
    const std::optional<std::int64_t> v = Int64Of(block.at(key));
    if (!v || *v < min || *v > max)
      return bad(key, fmt::format("an integer in [{}, {}]", min, max));
    return *v;
  };
  ZINF_RETURN_IF_ERROR(number("loss_scale", &fp16.loss_scale, 0, /*min_open=*/false));
  ZINF_RETURN_IF_ERROR(number("min_loss_scale", &fp16.min_loss_scale, 0, /*min_open=*/true));
  if (block.contains("initial_scale_power")) {
    ZINF_ASSIGN_OR_RETURN(const std::int64_t v, integer("initial_scale_power", 0, 64));
    fp16.initial_scale_power = static_cast<int>(v);
  }
  if (block.contains("hysteresis")) {
    ZINF_ASSIGN_OR_RETURN(const std::int64_t v,
                          integer("hysteresis", 1, std::numeric_limits<int>::max()));
    fp16.hysteresis = static_cast<int>(v);
  }
  return fp16;
}

namespace {

// The trainer state's keys, with the errors ReadTrainerState reports about them.
class TrainerKeys {
 public:
  explicit TrainerKeys(const checkpoint::CheckpointInfo& info)
      : trainer_(info.trainer), where_(fmt::format("{}: trainer state", info.path)) {}

  const Json& trainer() const { return trainer_; }
  // "<path>: trainer state", the errors' prefix.
  const std::string& where() const { return where_; }

  Error Bad(std::string_view key, std::string_view want) const {
    return DataLossError(fmt::format("{} {} is {}, expected {}", where_, key,
                                     trainer_.contains(key) ? Shown(trainer_.at(key)) : "missing",
                                     want));
  }

  // An integer key, if present, within [min, max].
  Result<std::optional<std::int64_t>> Integer(const char* key, std::int64_t min,
                                              std::int64_t max) const {
    if (!trainer_.contains(key)) return std::optional<std::int64_t>();
    const std::optional<std::int64_t> v = Int64Of(trainer_.at(key));
    if (!v || *v < min || *v > max) {
      return Bad(key, min == max ? fmt::format("{}", min)
                                 : fmt::format("an integer in [{}, {}]", min, max));
    }
    return v;
  }

 private:
  const Json& trainer_;
  const std::string where_;
};

// The counters against the file's: step, world_size, skipped_steps (into `state`), the
// scheduler's position; and lr.
Status ReadCounters(const TrainerKeys& keys, const checkpoint::CheckpointInfo& info,
                    TrainerState* state) {
  const std::int64_t step = info.step;
  ZINF_RETURN_IF_ERROR(keys.Integer("step", step, step));
  ZINF_RETURN_IF_ERROR(keys.Integer("world_size", info.world_size, info.world_size));
  ZINF_ASSIGN_OR_RETURN(const std::optional<std::int64_t> skipped,
                        keys.Integer("skipped_steps", 0, step));
  state->skipped_steps = skipped.value_or(0);
  // The schedule's position: the k-th applied step ran at k - 2, so after step - skipped
  // applied steps the next runs at step - skipped - 1 (engine.cc).
  const std::int64_t position = step - state->skipped_steps - 1;
  ZINF_RETURN_IF_ERROR(keys.Integer("scheduler_last_batch_iteration", position, position));
  if (keys.trainer().contains("lr")) {
    const Json& lr = keys.trainer().at("lr");
    if (!lr.is_number() || !(lr.get<double>() >= 0) || !std::isfinite(lr.get<double>())) {
      return keys.Bad("lr", "a finite number >= 0");
    }
  }
  return OkStatus();
}

// DeepSpeed's batch rule, as ParseConfig applied it on the saving ranks.
Status CheckBatchSizes(const TrainerKeys& keys, const checkpoint::CheckpointInfo& info) {
  constexpr std::int64_t kMaxBatch = std::int64_t{1} << 53;
  ZINF_ASSIGN_OR_RETURN(const std::optional<std::int64_t> micro,
                        keys.Integer("train_micro_batch_size_per_gpu", 1, kMaxBatch));
  ZINF_ASSIGN_OR_RETURN(const std::optional<std::int64_t> gas,
                        keys.Integer("gradient_accumulation_steps", 1, kMaxBatch));
  ZINF_ASSIGN_OR_RETURN(const std::optional<std::int64_t> batch,
                        keys.Integer("train_batch_size", 1, kMaxBatch));
  std::uint64_t per_rank = 0, product = 0;
  if (micro && gas && batch &&
      (!CheckedMul(static_cast<std::uint64_t>(*micro), static_cast<std::uint64_t>(*gas),
                   &per_rank) ||
       !CheckedMul(per_rank, static_cast<std::uint64_t>(info.world_size), &product) ||
       product != static_cast<std::uint64_t>(*batch))) {
    return keys.Bad("train_batch_size",
                    fmt::format("train_micro_batch_size_per_gpu {} x gradient_accumulation_steps "
                                "{} x world_size {}",
                                *micro, *gas, info.world_size));
  }
  return OkStatus();
}

// The loss scaler's state (into `state`), present exactly when the checkpoint's config has a
// dynamic loss scale.
Status ReadLossScaler(const TrainerKeys& keys, const checkpoint::CheckpointInfo& info,
                      TrainerState* state) {
  const Json& trainer = keys.trainer();
  if (!trainer.contains("loss_scaler") && info.config.is_object() && info.config.contains("fp16")) {
    // A dynamic scale's state (scale, iteration, hysteresis left) goes with the weights it
    // scaled: a checkpoint of a dynamic fp16 run without it would resume at the first scale.
    ZINF_ASSIGN_OR_RETURN(const config::Fp16Config writer,
                          Annotate(SavedFp16Config(info.config), info.path + ": "));
    if (writer.enabled && writer.loss_scale == 0) {
      return keys.Bad("loss_scaler",
                      "the loss scaler's state, as the checkpoint's config (fp16 with a dynamic "
                      "loss scale)");
    }
  }
  if (trainer.contains("loss_scaler")) {
    ZINF_ASSIGN_OR_RETURN(const config::Fp16Config writer,
                          Annotate(SavedFp16Config(info.config), info.path + ": "));
    ZINF_ASSIGN_OR_RETURN(
        state->loss_scaler,
        Annotate(LossScaler::ParseState(trainer.at("loss_scaler"), writer, info.step),
                 keys.where() + ": "));
    // The scaler saves a dynamic state exactly when its config is dynamic.
    const bool writer_dynamic = writer.enabled && writer.loss_scale == 0;
    if (state->loss_scaler.has_value() != writer_dynamic) {
      return keys.Bad(
          "loss_scaler",
          fmt::format("\"dynamic\": {}, as the checkpoint's config (fp16 {})", writer_dynamic,
                      !writer.enabled  ? "disabled"
                      : writer_dynamic ? "with a dynamic loss scale"
                                       : "with a static loss scale"));
    }
  }
  return OkStatus();
}

// The loop's JSON into state->user. A checkpoint of ZeroEngine holds it under "user" (an object
// or null, SaveCheckpoint checks); one of an older zinf-train holds the trainer's state itself.
Status ReadUser(const TrainerKeys& keys, TrainerState* state) {
  const Json& trainer = keys.trainer();
  if (trainer.contains("user")) {
    if (!trainer.at("user").is_object() && !trainer.at("user").is_null()) {
      return keys.Bad("user", "a JSON object or null");
    }
    state->user = trainer.at("user");
  } else {
    state->user = trainer;
  }
  return OkStatus();
}

}  // namespace

Result<TrainerState> ReadTrainerState(const checkpoint::CheckpointInfo& info) {
  const TrainerKeys keys(info);
  TrainerState state;
  if (!info.trainer.is_object()) {
    return DataLossError(
        fmt::format("{} is not a JSON object: {}", keys.where(), Shown(info.trainer)));
  }
  ZINF_RETURN_IF_ERROR(ReadCounters(keys, info, &state));
  ZINF_RETURN_IF_ERROR(CheckBatchSizes(keys, info));
  ZINF_RETURN_IF_ERROR(ReadLossScaler(keys, info, &state));
  if (info.trainer.contains("param_groups")) {
    ZINF_RETURN_IF_ERROR(
        ReadParamGroups(info.trainer.at("param_groups"), info, keys.where(), &state));
  }
  ZINF_RETURN_IF_ERROR(ReadUser(keys, &state));
  return state;
}

Status VerifyResumable(const std::string& path, const checkpoint::CheckpointProgressFn& progress) {
  ZINF_ASSIGN_OR_RETURN(const checkpoint::CheckpointInfo info,
                        checkpoint::ReadCheckpointInfo(path));
  ZINF_RETURN_IF_ERROR(ReadTrainerState(info));
  return checkpoint::VerifyCheckpoint(info.path, progress);
}

}  // namespace zinf::engine
