// The engine's state in a checkpoint (the /trainer attribute `state`, checkpoint/checkpoint.h), and
// the one validation of a checkpoint that `zinf-ckpt verify` and a resume (ZeroEngine::Create
// with zinf.checkpoint.load) share: verify OK means the file restores and resumes.
//
// ZeroEngine::SaveCheckpoint writes
//   {"step", "world_size", "train_batch_size", "train_micro_batch_size_per_gpu",
//    "gradient_accumulation_steps", "lr", "scheduler_last_batch_iteration", "skipped_steps",
//    "loss_scaler": LossScaler::ToJson(),
//    "param_groups": [{"lr", "betas", "eps", "weight_decay", "params": [parameter names]}],
//    "user": the training loop's JSON object}
// Every key is optional, as a checkpoint of an older zinf-train holds only its own state
// ({"step", "data_position", "seed"}), but each one present must be a value the writer can
// produce, consistent with the file's root attributes and its stored config (the `config`
// attribute: the saving run's effective config):
//   step == the file's step; world_size == the file's world_size;
//   the three batch sizes integers >= 1 with train_batch_size = micro * gas * world_size;
//   skipped_steps in [0, step]; scheduler_last_batch_iteration == step - skipped_steps - 1;
//   lr finite and >= 0; user a JSON object;
//   param_groups: at most kMaxParamGroups groups, each with hyper-parameters in AdamOptions'
//   ranges, and every parameter of the file's layout named in exactly one group (a checkpoint
//   without it holds one group of every parameter);
//   loss_scaler: LossScaler::ParseState against the stored config's fp16 block (a dynamic
//   state needs a dynamic fp16 config, a scale in [fp16.min_loss_scale, LossScaler's cap], an
//   iteration in [0, step], the hysteresis left in [1, fp16.hysteresis], ...); required when
//   the stored config has fp16 with a dynamic loss scale (its state must not be lost).
// What depends on the *resuming* run's config (a loss scale below its fp16.min_loss_scale, the
// parameters' layout, the optimizer type) can only be checked by the resume itself.
//
// Thread safety: pure functions (VerifyResumable reads the file).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"
#include "zinf/engine/loss_scaler.h"
#include "zinf/swapper/cpu_adam.h"

namespace zinf::engine {

// What a resume takes from the trainer state.
inline constexpr std::size_t kMaxParamGroups = std::size_t{1} << 16;

struct TrainerState {
  std::int64_t skipped_steps = 0;                  // 0 when not saved
  std::optional<LossScaler::State> loss_scaler;    // a saved dynamic scaler's state
  nlohmann::json user = nlohmann::json::object();  // "user", or the whole state without one
  // The saved parameter groups' values, and each parameter's group in the file's layout order
  // (empty when not saved: one group of every parameter, with the config optimizer's values).
  std::vector<swapper::AdamHyperParams> param_groups;
  std::vector<std::size_t> group_of;
};

// The fp16 block of a checkpoint's stored config, Fp16Config's defaults for the keys it lacks.
// Errors: DataLoss naming the key for a value of the wrong type or out of the config's range.
Result<config::Fp16Config> SavedFp16Config(const nlohmann::json& config);

// Validates `info.trainer` as described at the top. Errors: DataLoss "<path>: trainer state
// <key> is <value>, ..." naming the first bad key and its value.
Result<TrainerState> ReadTrainerState(const checkpoint::CheckpointInfo& info);

// What `zinf-ckpt verify` runs: the checkpoint's structure (checkpoint::ReadCheckpointInfo), its
// trainer state (ReadTrainerState), then its data (checkpoint::VerifyCheckpoint: the q8 tables and
// every chunk's checksum). `path` as ResolveCheckpointPath takes it. OK means a resume with a
// matching model and config restores it. Errors: those of the three.
Status VerifyResumable(const std::string& path,
                       const checkpoint::CheckpointProgressFn& progress = {});

}  // namespace zinf::engine
