// checkpoint_resume_crafted [--fp16 JSON] SWAP_DIR MODEL CHECKPOINT...: a real resume
// (ZeroEngine::Create with
// zinf.checkpoint.load, one Step, Close) from each CHECKPOINT in turn, on one rank, for
// tests/checkpoint/crafted_checkpoints.sh, which compares the outcome with `zinf-ckpt verify`'s.
// The model has the parameters of checkpoint MODEL (the corpus's good.h5: its names and
// shapes), the config is the one the crafted files say they were saved with (AdamW, dynamic
// fp16 with DeepSpeed's defaults; --fp16 replaces that block), so a refusal is about the file,
// not about a mismatch.
// Prints one line per checkpoint:
//   accepted <TAB> PATH                  restored, stepped once, every weight finite
//   refused <TAB> PATH <TAB> ERROR       Create (the restore) or the Step failed
//   garbage <TAB> PATH <TAB> WHAT        restored and stepped, but a weight is not finite
// Exit status 0, or 1 when MODEL cannot be read or MPI fails.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/log.h"
#include "zinf/core/status.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace {

using zinf::Result;
using zinf::Status;

std::string ConfigText(const std::string& swap_dir, const std::string& fp16, int index) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 1000000,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001, "betas": [0.9, 0.999],
                                                "eps": 1e-8, "weight_decay": 0.01}}}},
    "fp16": {},
    "zero_optimization": {{"stage": 2, "sub_group_size": 2048,
                           "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}},
    "zinf": {{"adam_threads": 1, "job_id": "crafted-{}"}}
  }})",
                     fp16, swap_dir, index);
}

struct Model {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<float>> weights, grads;
};

Result<Model> ModelOf(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(const zinf::checkpoint::CheckpointInfo info,
                        zinf::checkpoint::ReadCheckpointInfo(path));
  Model m;
  for (const zinf::partition::ParamInfo& p : info.layout->params()) {
    m.names.push_back(p.name);
    m.shapes.push_back(p.shape);
    m.weights.emplace_back(p.numel, 0.25f);
    m.grads.emplace_back(p.numel, 0.0f);
  }
  return m;
}

// "accepted", or why not: "refused\t<error>", "garbage\t<what>".
std::string Resume(const zinf::comm::Communicator& world, const std::string& swap_dir,
                   const std::string& fp16, int index, const std::string& checkpoint,
                   Model& model) {
  Result<zinf::config::Config> config =
      zinf::config::ParseConfig(ConfigText(swap_dir, fp16, index), zinf::config::ContextOf(world));
  if (!config) return "refused\tthe driver's config: " + config.error().ToString();
  std::vector<zinf::engine::Param> params;
  for (std::size_t i = 0; i < model.names.size(); ++i) {
    params.push_back({model.names[i], model.shapes[i], model.weights[i], model.grads[i]});
  }
  auto engine = zinf::engine::ZeroEngine::Create(
      world, *config, std::move(params),
      {.progress = false, .stop_signals = false, .create_nvme_paths = true, .load = checkpoint});
  if (!engine) return "refused\t" + engine.error().ToString();
  // The gradient of the scaled loss: 1e-3 per element, times the restored scale.
  for (std::vector<float>& g : model.grads) {
    for (float& x : g) x = static_cast<float>(1e-3 * (*engine)->loss_scale());
  }
  std::string outcome = "accepted";
  if (Result<zinf::engine::StepInfo> step = (*engine)->Step(1.0); !step) {
    outcome = "refused\tthe first step: " + step.error().ToString();
  } else {
    for (std::size_t i = 0; i < model.weights.size() && outcome == "accepted"; ++i) {
      for (std::size_t k = 0; k < model.weights[i].size(); ++k) {
        if (!std::isfinite(model.weights[i][k])) {
          outcome = fmt::format("garbage\tafter the first step {}[{}] is {}", model.names[i], k,
                                model.weights[i][k]);
          break;
        }
      }
    }
  }
  if (Status closed = (*engine)->Close(); !closed && outcome == "accepted") {
    outcome = "refused\tClose: " + closed.error().ToString();
  }
  return outcome;
}

}  // namespace

int main(int argc, char** argv) {
  auto session = zinf::comm::MpiSession::Init(&argc, &argv);
  if (!session) {
    std::fprintf(stderr, "resume_crafted: %s\n", session.error().ToString().c_str());
    return 1;
  }
  std::string fp16 = R"({"enabled": true, "loss_scale": 0})";
  int first = 1;
  if (argc > 2 && std::string(argv[1]) == "--fp16") {
    fp16 = argv[2];
    first = 3;
  }
  if (argc < first + 2) {
    std::fprintf(stderr, "usage: %s [--fp16 JSON] SWAP_DIR MODEL CHECKPOINT...\n", argv[0]);
    return 1;
  }
  Result<Model> model = ModelOf(argv[first + 1]);
  if (!model) {
    std::fprintf(stderr, "resume_crafted: the model from %s: %s\n", argv[first + 1],
                 model.error().ToString().c_str());
    return 1;
  }
  for (int i = first + 2; i < argc; ++i) {
    const std::string outcome = Resume(session->world(), argv[first], fp16, i, argv[i], *model);
    // One line per file: a message that spans lines is joined, and escaped like a log line.
    std::string line = fmt::format("{}\t{}", outcome.substr(0, outcome.find('\t')),
                                   zinf::EscapeForTerminal(argv[i]));
    if (outcome.find('\t') != std::string::npos) {
      line += "\t" + zinf::EscapeForTerminal(outcome.substr(outcome.find('\t') + 1));
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  return session->Finalize() ? 0 : 1;
}
