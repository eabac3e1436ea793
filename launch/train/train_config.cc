#include "train_config.h"

#include <array>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf::train {
namespace {

using engine::AppKey;
using engine::AppKeyType;
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

}  // namespace

std::string_view ModelNameName(ModelName name) {
  return kModelNames[static_cast<std::size_t>(name)];
}

std::span<const engine::AppKey> TrainAppKeys() { return Keys(); }

Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const engine::ConfigContext& ctx) {
  ZINF_ASSIGN_OR_RETURN(engine::Config base, engine::ParseConfig(json_text, ctx, TrainAppKeys()));
  TrainConfig config;
  static_cast<engine::Config&>(config) = std::move(base);
  ReadWorkload(config.app, &config);
  return config;
}

Result<TrainConfig> LoadTrainConfig(const std::string& path, const engine::ConfigContext& ctx) {
  ZINF_ASSIGN_OR_RETURN(std::string text, engine::ReadConfigFile(path));
  return Annotate(ParseTrainConfig(text, ctx), fmt::format("config {}: ", path));
}

}  // namespace zinf::train
