#include "zinf/interop/deepspeed_import.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/config/config.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/partition/layout.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::interop {
namespace {

using Json = nlohmann::json;
using Field = DeepSpeedCheckpoint::Field;

constexpr std::string_view kWhere = "deepspeed import";
// DeepSpeed's zero_optimization.sub_group_size default.
constexpr std::int64_t kDeepSpeedSubGroupSize = 1'000'000'000;

std::string Shown(const Json& value) { return DumpJsonForDisplay(value).substr(0, 200); }

// What the import takes from ds_config, read by zinf's own config parser so that it accepts and
// refuses exactly what a zinf run with that config would.
struct DsConfig {
  config::Config parsed;  // optimizer, fp16, sub_group_size (the rest defaults)
  bool has_optimizer = false;
  std::int64_t sub_group_size = kDeepSpeedSubGroupSize;
  // The three batch sizes, when ds_config's batch keys resolve for the checkpoint's world size.
  std::optional<std::array<std::int64_t, 3>> batch;
};

Result<DsConfig> ReadDsConfig(const Json& ds_config, std::uint64_t world_size) {
  if (!ds_config.is_null() && !ds_config.is_object()) {
    return InvalidArgumentError(
        fmt::format("{}: ds_config is {}, not a dict", kWhere, Shown(ds_config)));
  }
  const Json none = Json::object();
  const Json& ds = ds_config.is_object() ? ds_config : none;
  DsConfig out;
  // The keys the import uses, alone: the rest of a DeepSpeed config (or a zinf run's own keys,
  // in a checkpoint zinf exported) is kept as it is but not interpreted here. The micro batch
  // only satisfies the parser's batch rule.
  Json reduced = {{"train_micro_batch_size_per_gpu", 1}};
  for (const char* key : {"optimizer", "fp16"}) {
    if (ds.contains(key)) reduced[key] = ds.at(key);
  }
  out.has_optimizer = ds.contains("optimizer");
  const bool has_sub_group = ds.contains("zero_optimization") &&
                             ds.at("zero_optimization").is_object() &&
                             ds.at("zero_optimization").contains("sub_group_size");
  if (has_sub_group) {
    reduced["zero_optimization"] = {
        {"sub_group_size", ds.at("zero_optimization").at("sub_group_size")}};
  }
  Result<config::Config> parsed = config::ParseConfig(reduced.dump(), config::ConfigContext{});
  if (!parsed) {
    return InvalidArgumentError(fmt::format("{}: ds_config {} (zinf's config refuses it)", kWhere,
                                            parsed.error().message()));
  }
  out.parsed = std::move(*parsed);
  if (has_sub_group) {
    out.sub_group_size = static_cast<std::int64_t>(out.parsed.zero_optimization.sub_group_size);
  }
  // The batch sizes, as a run on world_size ranks resolves them: a checkpoint made on another
  // number of ranks (or its export) may hold sizes that do not divide; then none are recorded.
  Json batch = Json::object();
  for (const char* key :
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    if (ds.contains(key)) batch[key] = ds.at(key);
  }
  if (!batch.empty()) {
    Result<config::Config> resolved = config::ParseConfig(
        batch.dump(), config::ConfigContext{.world_size = static_cast<int>(world_size)});
    if (resolved) {
      out.batch = {resolved->train_batch_size, resolved->train_micro_batch_size_per_gpu,
                   resolved->gradient_accumulation_steps};
    }
  }
  return out;
}

// The optimizer zinf runs for this checkpoint: {"type", "params"} and the AdamW flag, from
// ds_config's optimizer block, or from the saved groups' adam_w_mode (DeepSpeed's FusedAdam and
// CPUAdam save it) when the model brought its own optimizer.
struct Optimizer {
  std::string type;
  bool adamw = true;
};

Result<Optimizer> ResolveOptimizer(const DeepSpeedCheckpoint& ds, const DsConfig& cfg) {
  const std::vector<DeepSpeedOptimizerGroup>& groups = ds.optimizer_groups();
  std::optional<bool> saved_flag;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Json& options = groups[g].options;
    if (!groups[g].saved || !options.is_object()) continue;
    auto flag = [&](const char* key) -> std::optional<bool> {
      if (!options.contains(key) || !options.at(key).is_boolean()) return std::nullopt;
      return options.at(key).get<bool>();
    };
    // Adam variants whose state zinf's Adam would continue with other math.
    if (flag("bias_correction") == false || flag("amsgrad") == true || flag("maximize") == true) {
      return InvalidArgumentError(fmt::format(
          "{}: optimizer group {} saved {}: zinf runs Adam/AdamW with bias correction, without "
          "amsgrad or maximize",
          kWhere, g, Shown(options)));
    }
    if (const std::optional<bool> f = flag("adam_w_mode")) {
      if (saved_flag && *saved_flag != *f) {
        return InvalidArgumentError(fmt::format(
            "{}: the optimizer groups disagree on adam_w_mode (group {}: {})", kWhere, g, *f));
      }
      saved_flag = f;
    }
  }
  Optimizer out;
  if (cfg.has_optimizer) {
    const config::OptimizerConfig& o = cfg.parsed.optimizer;
    if (o.amsgrad) {
      return InvalidArgumentError(
          fmt::format("{}: ds_config optimizer.params.amsgrad is true: zinf checkpoints hold no "
                      "max_exp_avg_sq",
                      kWhere));
    }
    out.type = std::string(config::OptimizerTypeName(o.type));
    ZINF_ASSIGN_OR_RETURN(out.adamw, swapper::ResolveAdamWMode(out.type, o.adam_w_mode));
    if (saved_flag && *saved_flag != out.adamw) {
      return InvalidArgumentError(fmt::format(
          "{}: ds_config's optimizer ({}, adam_w_mode {}) is {}, but the saved optimizer groups "
          "say adam_w_mode {}",
          kWhere, out.type, o.adam_w_mode, out.adamw ? "AdamW" : "Adam", *saved_flag));
    }
    return out;
  }
  if (!saved_flag) {
    return InvalidArgumentError(fmt::format(
        "{}: ds_config has no optimizer block and the saved optimizer groups do not say "
        "adam_w_mode (a client optimizer): zinf cannot tell Adam from AdamW state; add the "
        "optimizer block DeepSpeed ran with to the ds_config of the files",
        kWhere));
  }
  out.type = "Adam";
  out.adamw = *saved_flag;
  return out;
}

// Each DeepSpeed group's hyper-parameters: as saved, or (elastic files save none) the config's.
Result<std::vector<swapper::AdamHyperParams>> GroupHyperParams(const DeepSpeedCheckpoint& ds,
                                                               const DsConfig& cfg) {
  const config::OptimizerConfig& o = cfg.parsed.optimizer;
  std::vector<swapper::AdamHyperParams> out;
  for (std::size_t g = 0; g < ds.optimizer_groups().size(); ++g) {
    const DeepSpeedOptimizerGroup& group = ds.optimizer_groups()[g];
    const swapper::AdamHyperParams h =
        group.saved
            ? swapper::AdamHyperParams{.lr = group.lr,
                                       .betas = {group.beta1, group.beta2},
                                       .eps = group.eps,
                                       .weight_decay = group.weight_decay}
            : swapper::AdamHyperParams{
                  .lr = o.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay};
    if (Status valid = swapper::ValidateAdamHyperParams(h); !valid) {
      return InvalidArgumentError(
          fmt::format("{}: optimizer group {}: {}", kWhere, g, valid.error().message()));
    }
    out.push_back(h);
  }
  if (out.empty()) {
    return DataLossError(fmt::format("{}: the checkpoint has no optimizer groups", kWhere));
  }
  return out;
}

// The loss scaler's state in LossScaler::ToJson's shape (engine/loss_scaler.h), present exactly
// when ds_config's fp16 has a dynamic loss scale, as the trainer state requires.
Result<std::optional<Json>> LossScalerState(const DeepSpeedCheckpoint& ds, const DsConfig& cfg) {
  const config::Fp16Config& fp16 = cfg.parsed.fp16;
  const bool config_dynamic = fp16.enabled && fp16.loss_scale == 0;
  const DeepSpeedLossScaler& s = ds.loss_scaler();
  const bool file_dynamic = s.kind == DeepSpeedLossScaler::Kind::kDynamic;
  if (config_dynamic != file_dynamic) {
    return InvalidArgumentError(fmt::format(
        "{}: the optimizer files hold {}, but ds_config's fp16 {}", kWhere,
        file_dynamic                                   ? "a DynamicLossScaler"
        : s.kind == DeepSpeedLossScaler::Kind::kStatic ? "a static LossScaler"
                                                       : "no loss scaler",
        !fp16.enabled    ? "is disabled"
        : config_dynamic ? "has a dynamic loss scale (loss_scale 0)"
                         : fmt::format("has the static loss_scale {}", fp16.loss_scale)));
  }
  if (!file_dynamic) return std::optional<Json>();
  return std::optional<Json>(Json{{"dynamic", true},
                                  {"scale", s.scale},
                                  {"iteration", s.iteration},
                                  {"last_overflow_iteration", s.last_overflow_iteration},
                                  {"hysteresis", s.hysteresis}});
}

Result<partition::ParamLayout> MakeLayout(const DeepSpeedCheckpoint& ds) {
  std::vector<partition::ParamSpec> specs;
  specs.reserve(ds.params().size());
  for (const DeepSpeedParam& p : ds.params()) specs.push_back({p.name, p.shape});
  partition::DType dtype = partition::DType::kFloat32;
  if (!ds.params().empty() && !ds.params()[0].dtype.empty()) {
    Result<partition::DType> parsed = partition::ParseDType(ds.params()[0].dtype);
    if (!parsed) {
      return InvalidArgumentError(fmt::format(
          "{}: the model's parameters are {}; zinf's models are float32, bfloat16 or float16",
          kWhere, EscapeForTerminal(ds.params()[0].dtype)));
    }
    dtype = *parsed;
  }
  return Annotate(partition::ParamLayout::Create(std::move(specs), dtype),
                  fmt::format("{}: the checkpoint's parameters: ", kWhere));
}

}  // namespace

Result<DeepSpeedImportResult> ImportDeepSpeed(const std::string& dir, const std::string& out_path,
                                              const DeepSpeedImportOptions& options) {
  ZINF_ASSIGN_OR_RETURN(const DeepSpeedCheckpoint ds, OpenDeepSpeedCheckpoint(dir, options.limits));
  ZINF_ASSIGN_OR_RETURN(const partition::ParamLayout layout, MakeLayout(ds));
  const std::uint64_t world = ds.world_size();
  const std::int64_t step = ds.global_steps();
  const std::int64_t skipped = ds.skipped_steps();
  if (step < 0 || step > checkpoint::kMaxCheckpointStep || skipped < 0 || skipped > step) {
    return InvalidArgumentError(
        fmt::format("{}: global_steps {} and skipped_steps {} are outside zinf's range [0, {}]",
                    kWhere, step, skipped, checkpoint::kMaxCheckpointStep));
  }
  ZINF_ASSIGN_OR_RETURN(const DsConfig cfg, ReadDsConfig(ds.ds_config(), world));
  ZINF_ASSIGN_OR_RETURN(const Optimizer optimizer, ResolveOptimizer(ds, cfg));
  ZINF_ASSIGN_OR_RETURN(const std::vector<swapper::AdamHyperParams> hyper,
                        GroupHyperParams(ds, cfg));
  ZINF_ASSIGN_OR_RETURN(const std::optional<Json> scaler, LossScalerState(ds, cfg));

  Json groups = Json::array();
  for (const swapper::AdamHyperParams& h : hyper) {
    groups.push_back({{"lr", h.lr},
                      {"betas", {h.betas[0], h.betas[1]}},
                      {"eps", h.eps},
                      {"weight_decay", h.weight_decay},
                      {"params", Json::array()}});
  }
  for (const DeepSpeedParam& p : ds.params()) {
    if (p.group >= groups.size()) {
      return DataLossError(fmt::format("{}: parameter '{}' is in optimizer group {} of {}", kWhere,
                                       EscapeForTerminal(p.name), p.group, groups.size()));
    }
    groups[p.group]["params"].push_back(p.name);
  }
  Json trainer = {{"step", step},
                  {"world_size", static_cast<std::int64_t>(world)},
                  {"lr", hyper[0].lr},
                  {"scheduler_last_batch_iteration", step - skipped - 1},
                  {"skipped_steps", skipped},
                  {"param_groups", std::move(groups)},
                  {"user", ds.client_state()}};
  if (cfg.batch) {
    trainer["train_batch_size"] = (*cfg.batch)[0];
    trainer["train_micro_batch_size_per_gpu"] = (*cfg.batch)[1];
    trainer["gradient_accumulation_steps"] = (*cfg.batch)[2];
  }
  if (scaler) trainer["loss_scaler"] = *scaler;
  // A resume reads the attributes back within ParseJson's bounds: a client state beyond them
  // (nested too deep) would make a file that does not restore.
  if (Result<Json> readable = ParseJson(trainer.dump()); !readable) {
    return InvalidArgumentError(fmt::format("{}: the client state cannot be restored: {}", kWhere,
                                            readable.error().message()));
  }
  const Json& h0 = trainer["param_groups"][0];
  checkpoint::CheckpointWriterOptions writer_options{
      .step = step,
      .world_size = static_cast<std::int64_t>(world),
      .sub_group_size = cfg.sub_group_size,
      .optimizer = {{"type", optimizer.type},
                    {"params",
                     {{"lr", h0["lr"]},
                      {"betas", h0["betas"]},
                      {"eps", h0["eps"]},
                      {"weight_decay", h0["weight_decay"]},
                      {"adam_w_mode", optimizer.adamw}}}},
      .config = ds.ds_config().is_object() ? ds.ds_config() : Json::object(),
      .trainer = std::move(trainer)};

  ZINF_ASSIGN_OR_RETURN(
      checkpoint::CheckpointWriter writer,
      checkpoint::CheckpointWriter::Create(out_path, layout, writer_options, options.overwrite));
  const std::uint64_t total_bytes = 3 * layout.total_numel() * sizeof(float);
  std::uint64_t done_bytes = 0;
  // One parameter at a time, its three fields one after another, each in pieces of at most
  // kPieceNumel floats: every state's values are appended in layout order, a parameter's pieces
  // are read from the same files together, and memory stays bounded whatever the model.
  constexpr std::uint64_t kPieceNumel = std::uint64_t{1} << 20;
  std::vector<float> piece(std::min<std::uint64_t>(kPieceNumel, layout.total_numel()));
  constexpr std::array<std::pair<Field, swapper::StateTensor>, 3> kFields = {{
      {Field::kFp32, swapper::StateTensor::kFp32},
      {Field::kExpAvg, swapper::StateTensor::kExpAvg},
      {Field::kExpAvgSq, swapper::StateTensor::kExpAvgSq},
  }};
  for (std::size_t i = 0; i < ds.params().size(); ++i) {
    const std::uint64_t numel = layout.param(i).numel;
    for (const auto& [field, state] : kFields) {
      for (std::uint64_t at = 0; at < numel; at += kPieceNumel) {
        const std::span<float> values =
            std::span(piece).first(std::min<std::uint64_t>(kPieceNumel, numel - at));
        ZINF_RETURN_IF_ERROR(ds.ReadParam(i, field, at, values));
        ZINF_RETURN_IF_ERROR(Annotate(writer.Append(state, values),
                                      fmt::format("{}: parameter '{}' {}: ", kWhere,
                                                  EscapeForTerminal(layout.param(i).name),
                                                  DeepSpeedFieldName(field))));
        done_bytes += values.size() * sizeof(float);
        if (options.progress) options.progress(done_bytes, total_bytes);
      }
    }
  }
  std::function<Status(const std::string&)> check;
  if (options.check) {
    check = [&](const std::string& temp_path) {
      return Annotate(options.check(temp_path),
                      fmt::format("{}: the file made for {} fails its check: ", kWhere, out_path));
    };
  }
  ZINF_RETURN_IF_ERROR(writer.Commit(check));

  DeepSpeedImportResult result;
  result.stage = ds.stage();
  result.universal = ds.universal();
  result.world_size = world;
  result.step = step;
  result.num_params = layout.num_params();
  result.total_numel = layout.total_numel();
  result.client_state_skipped = ds.client_state_skipped();
  return result;
}

}  // namespace zinf::interop
