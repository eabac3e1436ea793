#include "train_config.h"

#include <algorithm>
#include <array>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/json.h"

namespace zinf::train {
namespace {

using config::AppKey;
using config::AppKeyType;
using Json = nlohmann::ordered_json;

constexpr std::array<std::string_view, 2> kModelNames = {"charlm", "synthetic"};

const std::vector<AppKey>& Keys() {
  static const std::vector<AppKey> keys = {
      {.path = "zinf.seed",
       .type = AppKeyType::kInteger,
       .default_value = 1234,
       .description = "Initialization and data seed",
       .min = 0},
      {.path = "zinf.steps",
       .type = AppKeyType::kInteger,
       .default_value = 100,
       .description = "Optimizer steps to run (up to 2^53 - 1, the largest step a checkpoint "
                      "holds)",
       .min = 1,
       .max = 9007199254740991.0},
      {.path = "zinf.compute_threads",
       .type = AppKeyType::kInteger,
       .default_value = 0,
       .description = "BLAS threads per rank for the model's forward/backward; 0 = the node's "
                      "cores / its ranks. Results are bitwise reproducible only for a fixed "
                      "count: set it when runs with different ranks per node must agree bitwise",
       .min = 0,
       .max = 1024},
      {.path = "zinf.model", .type = AppKeyType::kSection, .description = "The model to train"},
      {.path = "zinf.model.name",
       .type = AppKeyType::kChoice,
       .default_value = "charlm",
       .description = "charlm (byte-level MLP language model) or synthetic (pseudo-gradients)",
       .choices = {"charlm", "synthetic"}},
      {.path = "zinf.model.hidden",
       .type = AppKeyType::kInteger,
       .default_value = 256,
       .description = "charlm: width of each hidden layer",
       .min = 1,
       .max = 1 << 20},
      {.path = "zinf.model.layers",
       .type = AppKeyType::kInteger,
       .default_value = 2,
       .description = "charlm: hidden layers",
       .min = 0,
       .max = 1024},
      {.path = "zinf.model.context",
       .type = AppKeyType::kInteger,
       .default_value = 16,
       .description = "charlm: bytes of context per example",
       .min = 1,
       .max = 4096},
      {.path = "zinf.model.embed_dim",
       .type = AppKeyType::kInteger,
       .default_value = 16,
       .description = "charlm: embedding width per byte",
       .min = 1,
       .max = 65536},
      {.path = "zinf.model.activation",
       .type = AppKeyType::kChoice,
       .default_value = "tanh",
       .description = "charlm: activation of the hidden layers",
       .choices = {"tanh", "relu"}},
      {.path = "zinf.model.total_params",
       .type = AppKeyType::kInteger,
       .default_value = 1 << 20,
       .description = "synthetic: number of parameters in all",
       .min = 1,
       .max = 0x1p40},
      {.path = "zinf.model.num_params",
       .type = AppKeyType::kInteger,
       .default_value = 4,
       .description = "synthetic: parameter tensors the total is split into",
       .min = 1,
       .max = 1 << 20},
      {.path = "zinf.data", .type = AppKeyType::kSection, .description = "Training data"},
      {.path = "zinf.data.path",
       .type = AppKeyType::kString,
       .default_value = "",
       .description = "Text file or directory for charlm; empty: the built-in text"},
  };
  return keys;
}

// The workload's values, checked by the parser already (types, ranges, choices).
void ReadWorkload(const Json& app, TrainConfig* config) {
  const Json& zinf = app.at("zinf");
  const Json& model = zinf.at("model");
  config->seed = zinf.at("seed").get<std::int64_t>();
  config->steps = zinf.at("steps").get<std::int64_t>();
  config->compute_threads = zinf.at("compute_threads").get<int>();
  config->data_path = zinf.at("data").at("path").get<std::string>();
  config->model.name = model.at("name").get<std::string>() == "synthetic" ? ModelName::kSynthetic
                                                                          : ModelName::kCharLM;
  config->model.hidden = model.at("hidden").get<int>();
  config->model.layers = model.at("layers").get<int>();
  config->model.context = model.at("context").get<int>();
  config->model.embed_dim = model.at("embed_dim").get<int>();
  Result<Activation> activation = ParseActivation(model.at("activation").get<std::string>());
  ZINF_CHECK(activation.has_value(), "zinf.model.activation passed the parser's choices");
  config->model.activation = *activation;
  config->model.total_params = model.at("total_params").get<std::uint64_t>();
  config->model.num_params = model.at("num_params").get<int>();
}

// ---- Command-line overrides, written into the JSON at the keys' nested spelling ----

// The object at `path` inside `root`, created when missing. nullptr when something on the way
// is not an object (null included): the override is then skipped and the parser reports the
// bad type.
Json* ObjectAt(Json& root, std::initializer_list<const char*> path) {
  Json* node = &root;
  for (const char* key : path) {
    if (!node->is_object()) return nullptr;
    if (!node->contains(key)) (*node)[key] = Json::object();
    node = &(*node)[key];
  }
  return node->is_object() ? node : nullptr;
}

void Set(Json& root, std::initializer_list<const char*> parents, const char* key, Json value) {
  if (Json* parent = ObjectAt(root, parents)) (*parent)[key] = std::move(value);
}

void ApplyOverrides(const ConfigOverrides& o, Json& root) {
  if (o.steps) Set(root, {"zinf"}, "steps", *o.steps);
  if (o.nvme_path) {
    Set(root, {"zero_optimization", "offload_optimizer"}, "device", "nvme");
    Set(root, {"zero_optimization", "offload_optimizer"}, "nvme_path", *o.nvme_path);
    // offload_param reads the shards from the optimizer's store: a path it names moves too.
    if (const Json* zero = ObjectAt(root, {"zero_optimization"});
        zero != nullptr && zero->contains("offload_param") &&
        zero->at("offload_param").is_object() && zero->at("offload_param").contains("nvme_path")) {
      Set(root, {"zero_optimization", "offload_param"}, "nvme_path", *o.nvme_path);
    }
  }
  if (o.checkpoint_dir) Set(root, {"zinf", "checkpoint"}, "dir", *o.checkpoint_dir);
  if (o.checkpoint_every) Set(root, {"zinf", "checkpoint"}, "every", *o.checkpoint_every);
  if (o.keep_last) Set(root, {"zinf", "checkpoint"}, "keep_last", *o.keep_last);
  if (o.optimizer_state) Set(root, {"zinf"}, "optimizer_state", *o.optimizer_state);
  if (o.resume) Set(root, {"zinf", "checkpoint"}, "load", *o.resume);
  if (o.model) Set(root, {"zinf", "model"}, "name", *o.model);
  if (o.data) Set(root, {"zinf", "data"}, "path", *o.data);
  if (o.seed) Set(root, {"zinf"}, "seed", *o.seed);
  if (!o.hidden && !o.layers) return;
  // Which model the sizes apply to: the override, else the config's name, else the default.
  std::string name = "charlm";
  if (Json* model = ObjectAt(root, {"zinf", "model"});
      model && model->contains("name") && (*model)["name"].is_string()) {
    name = (*model)["name"].get<std::string>();
  }
  if (name != "synthetic") {
    if (o.hidden) Set(root, {"zinf", "model"}, "hidden", *o.hidden);
    if (o.layers) Set(root, {"zinf", "model"}, "layers", *o.layers);
    return;
  }
  // synthetic: L tensors of H x H. A flag not given takes the config's (or the default) value.
  const ModelConfig defaults;
  std::int64_t hidden = defaults.hidden, layers = defaults.layers;
  if (Json* model = ObjectAt(root, {"zinf", "model"})) {
    if (model->contains("hidden") && (*model)["hidden"].is_number_integer()) {
      hidden = (*model)["hidden"].get<std::int64_t>();
    }
    if (model->contains("layers") && (*model)["layers"].is_number_integer()) {
      layers = (*model)["layers"].get<std::int64_t>();
    }
  }
  if (o.hidden) hidden = *o.hidden;
  if (o.layers) layers = *o.layers;
  layers = std::max<std::int64_t>(layers, 1);
  // Out-of-range values reach the parser as they are (it names the key and the range).
  const std::int64_t total =
      hidden < 1 ? hidden : layers * std::min<std::int64_t>(hidden, 1 << 30) * hidden;
  Set(root, {"zinf", "model"}, "total_params", total);
  Set(root, {"zinf", "model"}, "num_params", layers);
}

}  // namespace

std::string_view ModelNameName(ModelName name) {
  return kModelNames[static_cast<std::size_t>(name)];
}

std::span<const config::AppKey> TrainAppKeys() { return Keys(); }

Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const config::ConfigContext& ctx) {
  ZINF_ASSIGN_OR_RETURN(config::Config base, config::ParseConfig(json_text, ctx, TrainAppKeys()));
  TrainConfig config;
  static_cast<config::Config&>(config) = std::move(base);
  ReadWorkload(config.app, &config);
  return config;
}

Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const config::ConfigContext& ctx,
                                     const ConfigOverrides& overrides) {
  // The engine's limits, so that text it would refuse is refused here with its message.
  Result<Json> root = ParseJson<Json>(json_text, {.max_bytes = 16u << 20, .max_depth = 32});
  if (!root) return ParseTrainConfig(json_text, ctx);  // the parser's own message
  ApplyOverrides(overrides, *root);
  return ParseTrainConfig(DumpJsonForDisplay(*root), ctx);
}

Result<TrainConfig> LoadTrainConfig(const std::string& path, const config::ConfigContext& ctx) {
  ZINF_ASSIGN_OR_RETURN(std::string text, config::ReadConfigFile(path));
  return Annotate(ParseTrainConfig(text, ctx), fmt::format("config {}: ", path));
}

}  // namespace zinf::train
