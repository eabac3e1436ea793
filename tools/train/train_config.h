// TrainConfig: zinf-train's configuration: the engine's DeepSpeed-style config (engine/config.h)
// plus zinf-train's own keys, added to the config's schema as application keys (AppKey) so they
// are checked the same way: the workload (zinf.model: charlm or synthetic and their sizes;
// zinf.data.path; zinf.seed), how long to run (zinf.steps) and the model's BLAS threads
// (zinf.compute_threads).
//
//   ZINF_ASSIGN_OR_RETURN(TrainConfig config, ParseTrainConfig(json_text, ctx));
//   config.model.hidden; config.zero_optimization.sub_group_size;   // both halves
//
// Thread safety: as engine/config.h.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "charlm.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"

namespace zinf::train {

enum class ModelName { kCharLM, kSynthetic };
std::string_view ModelNameName(ModelName name);  // "charlm", "synthetic"

// zinf.model.
struct ModelConfig {
  ModelName name = ModelName::kCharLM;
  int hidden = 256;                           // charlm: width of each hidden layer, [1, 1 << 20]
  int layers = 2;                             // charlm: hidden layers, [0, 1024]
  int context = 16;                           // charlm: bytes of context per example, [1, 4096]
  int embed_dim = 16;                         // charlm: embedding width, [1, 65536]
  Activation activation = Activation::kTanh;  // charlm (charlm.h)
  std::uint64_t total_params = 1 << 20;       // synthetic: parameters in all, [1, 2^40]
  int num_params = 4;  // synthetic: parameter tensors the total is split into, [1, 1 << 20]
};

struct TrainConfig : config::Config {
  ModelConfig model;         // zinf.model
  std::string data_path;     // zinf.data.path: a text file or directory; empty: built-in
  std::int64_t seed = 1234;  // zinf.seed: initialization and data seed, >= 0
  std::int64_t steps = 100;  // zinf.steps: optimizer steps to run, [1, 2^53 - 1]
  int compute_threads = 0;   // zinf.compute_threads: BLAS threads per rank; 0 = cores / ranks
};

// Command-line values that override config keys (zinf-train's flags). Unset fields leave the
// config's value.
struct ConfigOverrides {
  std::optional<std::int64_t> steps;                  // zinf.steps
  std::optional<std::vector<std::string>> nvme_path;  // offload_optimizer.nvme_path, device nvme
  std::optional<std::string> checkpoint_dir;          // zinf.checkpoint.dir
  std::optional<std::int64_t> checkpoint_every;       // zinf.checkpoint.every
  std::optional<std::int64_t> keep_last;              // zinf.checkpoint.keep_last
  std::optional<std::string> optimizer_state;         // zinf.optimizer_state
  std::optional<std::string> resume;                  // zinf.checkpoint.load
  std::optional<std::string> model;                   // zinf.model.name
  // charlm: zinf.model.hidden / layers. synthetic: zinf.model.total_params = max(1, L) * H * H
  // in zinf.model.num_params = max(1, L) tensors (L, H from the flags, or from the config's
  // zinf.model.layers / hidden when only one flag is given).
  std::optional<std::int64_t> hidden;
  std::optional<std::int64_t> layers;
  std::optional<std::string> data;   // zinf.data.path
  std::optional<std::int64_t> seed;  // zinf.seed
};

// zinf-train's keys, for the engine's parser and DescribeConfigKeys.
std::span<const config::AppKey> TrainAppKeys();

// config::ParseConfig with TrainAppKeys(), and the workload's values read back into TrainConfig.
// Errors: InvalidArgument naming the key path (engine/config.h).
Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const config::ConfigContext& ctx);
// The same with `overrides` written into the JSON first, at each key's one (nested) spelling, so
// a flag always replaces the file's value (a dotted key, the only other way to spell it, is an
// error) and a bad flag value gets the error of a bad key. Text that is not JSON gets the
// parser's syntax error.
Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const config::ConfigContext& ctx,
                                     const ConfigOverrides& overrides);
// The file at `path`, parsed; messages prefixed with "config <path>: ".
Result<TrainConfig> LoadTrainConfig(const std::string& path, const config::ConfigContext& ctx);

}  // namespace zinf::train
