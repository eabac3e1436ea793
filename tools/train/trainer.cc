#include "trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "charlm.h"
#include "data.h"
#include "model.h"
#include "synthetic.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"
#include "zinf/engine/engine.h"

namespace zinf::train {
namespace {

using Json = nlohmann::json;
using config::CheckpointConfig;

// Held-out examples for the periodic charlm evaluation.
constexpr int kEvalExamples = 512;

const char kDefaultConfig[] = R"json({
  "train_micro_batch_size_per_gpu": 64,
  "gradient_accumulation_steps": 1,
  "gradient_clipping": 1.0,
  "steps_per_print": 25,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003, "warmup_num_steps": 20,
                           "warmup_type": "linear"}},
  "zero_optimization": {
    "stage": 1,
    "sub_group_size": 65536,
    "offload_optimizer": {"device": "nvme", "nvme_path": "zinf-swap", "buffer_count": 12,
                          "pipeline_read": true, "pipeline_write": true}
  },
  "zinf": {
    "model": {"name": "charlm", "hidden": 512, "layers": 2, "context": 16, "embed_dim": 16},
    "steps": 200,
    "seed": 1234
  }
})json";

// ---- One run: the workload (model, data) driving the engine ----

// What a backward pass of the loss times `scale` in fp16 gives for a gradient element: the
// element times the scale, rounded to fp16 (beyond its range: Inf, and the engine skips the step
// and lowers the scale).
float ScaledToFp16(float grad, float scale) {
  return static_cast<float>(static_cast<_Float16>(grad * scale));
}

// Stages 2 and 3: a model's layered pass, each gradient lent to the engine as the backward pass
// completes it (with fp16 first scaled by the loss scale and rounded to fp16, as the replicated
// path does). Stage 3 reads the partitioned parameters through one Gather scope at a time (a
// layer's), released by the next Fetch or Finish; stage 2 reads the whole working weights the
// engine keeps up to date (`replicated`, layout order).
class EngineLayerAccess final : public LayerAccess {
 public:
  EngineLayerAccess(engine::ZeroEngine& engine, bool fp16, std::span<const float> replicated = {})
      : engine_(engine), fp16_(fp16), replicated_(replicated) {}

  Result<std::vector<std::span<const float>>> Fetch(std::span<const std::size_t> params) override {
    std::vector<std::span<const float>> weights;
    weights.reserve(params.size());
    if (!replicated_.empty()) {
      const partition::ParamLayout& layout = engine_.layout();
      for (const std::size_t i : params) {
        if (i >= layout.num_params()) {
          return InvalidArgumentError(fmt::format("Fetch: no parameter {}", i));
        }
        const partition::ParamInfo& p = layout.param(i);
        weights.push_back(replicated_.subspan(p.flat_offset, p.numel));
      }
      return weights;
    }
    held_.Release();
    ZINF_ASSIGN_OR_RETURN(held_, engine_.GatherByIndex(params));
    for (std::size_t i = 0; i < held_.size(); ++i) weights.push_back(held_[i]);
    return weights;
  }

  Status GradientDone(std::size_t index, std::span<const float> grad) override {
    std::span<const float> handed = grad;
    if (fp16_) {
      const auto scale = static_cast<float>(engine_.loss_scale());
      scaled_.resize(grad.size());
      for (std::size_t i = 0; i < grad.size(); ++i) {
        scaled_[i] = ScaledToFp16(grad[i], scale);
      }
      handed = scaled_;
    }
    // GradientReady is local; its errors come back from the next AccumulateGradients or Step
    // on every rank, so the pass goes on (its Gathers are collective) and they are agreed there.
    static_cast<void>(engine_.GradientReady(index, handed));
    return OkStatus();
  }

  void Finish() { held_.Release(); }

 private:
  engine::ZeroEngine& engine_;
  const bool fp16_;
  const std::span<const float> replicated_;
  engine::Gathered held_;
  std::vector<float> scaled_;
};

class Run {
 public:
  Run(const comm::Communicator& world, const TrainConfig& config, const TrainOptions& options)
      : world_(world), config_(config), options_(options) {}

  Result<TrainSummary> Go();

 private:
  Status BuildModel();
  Status CheckHostMemory() const;
  Status CreateEngine();
  // One optimizer step: the micro-batches' forward/backward, then the engine's Step.
  Result<engine::StepInfo> Step(std::int64_t step);
  Status ForwardBackward(std::int64_t step, int micro_batch, double* loss_sum);
  Status SaveCheckpoint(double loss);
  // Stage 3: the model's parameters are partitioned (registered without buffers).
  bool partitioned() const { return config_.zero_optimization.stage == 3; }
  // Stages 2 and 3: the gradients are lent (registered without grads buffers), each handed to
  // the engine by the layered pass as it completes, so no whole gradient exists on a rank.
  bool lent() const { return config_.zero_optimization.stage >= 2; }
  Json UserState(std::int64_t step, double loss) const;
  Status Finish(const TrainSummary& summary);

  const comm::Communicator& world_;
  const TrainConfig& config_;
  TrainOptions options_;

  std::unique_ptr<Model> model_;
  const CharLM* charlm_ = nullptr;  // model_ when it is a CharLM
  std::optional<TextDataset> data_;
  // The working weights, layout order (the engine writes them); empty at stage 3.
  std::vector<float> weights_;
  // The gradient of the rank's micro-batches, layout order; empty at stages 2 and 3.
  std::vector<float> grads_;
  // fp16: one micro-batch's unscaled gradient, before it is scaled and rounded into grads_.
  std::vector<float> micro_grads_;
  std::unique_ptr<engine::ZeroEngine> engine_;
  std::string last_checkpoint_;
  std::int64_t last_checkpoint_step_ = -1;
};

Status Run::BuildModel() {
  const ModelConfig& m = config_.model;
  // A fixed BLAS thread count per rank: the split of an sgemm over threads can change its last
  // bits on some CPUs' kernels, so runs compare bitwise only at the same count.
  const int local = std::max(world_.topology().local_size, 1);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads =
      config_.compute_threads > 0 ? config_.compute_threads : std::max(1, cores / local);
  if (m.name == ModelName::kCharLM) {
    ZINF_ASSIGN_OR_RETURN(CharLM charlm, CharLM::Create({.context = m.context,
                                                         .embed_dim = m.embed_dim,
                                                         .hidden = m.hidden,
                                                         .layers = m.layers,
                                                         .activation = m.activation}));
    auto owned = std::make_unique<CharLM>(std::move(charlm));
    charlm_ = owned.get();
    model_ = std::move(owned);
    SetBlasThreads(threads);
    Result<TextDataset> data = config_.data_path.empty()
                                   ? TextDataset::LoadDefault()
                                   : (std::filesystem::is_directory(config_.data_path)
                                          ? TextDataset::LoadDirectory(config_.data_path)
                                          : TextDataset::Load(config_.data_path));
    if (!data) return std::move(data).error();
    data_.emplace(std::move(*data));
  } else {
    ZINF_ASSIGN_OR_RETURN(SyntheticModel synthetic,
                          SyntheticModel::Create(m.total_params, m.num_params, threads));
    model_ = std::make_unique<SyntheticModel>(std::move(synthetic));
  }
  return CheckHostMemory();
}

// The workload's own memory (its weights and gradient, a micro-batch's activations) against the
// machine's RAM + swap shared by this node's ranks, before anything is allocated; the engine's
// host memory plan then holds all of it, its own buffers included, against the node's budget.
Status Run::CheckHostMemory() const {
  // The layered pass (stages 2 and 3) holds a layer's gradients at a time, stage 3 a layer's
  // weights too (at most two parameters each, the largest bounding both); the engine checks
  // its shards, gathers and buckets itself.
  const std::uint64_t whole = model_->layout().total_numel();
  std::uint64_t layer = 0;
  for (const partition::ParamInfo& p : model_->layout().params()) layer = std::max(layer, p.numel);
  if (!CheckedMul(layer, 2, &layer)) layer = UINT64_MAX;
  std::uint64_t held = 0;
  if (!CheckedAdd(partitioned() ? layer : whole, lent() ? layer : whole, &held)) held = UINT64_MAX;
  std::uint64_t replicated = 0;
  if (!CheckedMul(held, sizeof(float), &replicated)) replicated = UINT64_MAX;
  const std::uint64_t activations =
      model_->WorkingBytes(static_cast<std::uint64_t>(config_.train_micro_batch_size_per_gpu));
  std::uint64_t need = 0;
  if (!CheckedAdd(replicated, activations, &need)) need = UINT64_MAX;
  return CheckHostMemoryShare(
      need, world_.topology().local_size, "this rank needs",
      fmt::format(" ({} {}, the activations of a micro-batch of {} examples {})",
                  partitioned() ? "a layer's gathered weights and gradient"
                  : lent()      ? "the replicated weights and a layer's gradient"
                                : "the replicated weights and gradient",
                  FormatBytes(replicated), config_.train_micro_batch_size_per_gpu,
                  FormatBytes(activations)),
      "lower train_micro_batch_size_per_gpu (use gradient_accumulation_steps), the model size, "
      "or the ranks per node");
}

Status Run::CreateEngine() {
  const partition::ParamLayout& layout = model_->layout();
  ZINF_LOG_INFO("model: {}", model_->Describe());
  if (data_) ZINF_LOG_INFO("data: {} ({})", data_->source(), FormatBytes(data_->size_bytes()));
  if (partitioned()) {
    ZINF_LOG_INFO(
        "stage 3: the parameters are partitioned, gathered a layer at a time{}",
        charlm_ != nullptr ? " (no held-out loss or sample: they need the whole weights)" : "");
  } else if (lent()) {
    ZINF_LOG_INFO(
        "stage 2: each gradient goes to the engine as the backward pass completes it, a layer "
        "at a time; no rank holds the whole gradient");
  }
  std::vector<engine::Param> params;
  params.reserve(layout.num_params());
  const auto seed = static_cast<std::uint64_t>(config_.seed);
  if (partitioned()) {
    // Stage 3: no buffers; the engine asks each rank for the initial values of its shards only
    // (a pure function of (seed, flat index), as below) and gradients are lent per layer.
    const Model* model = model_.get();
    for (const partition::ParamInfo& p : layout.params()) {
      const std::uint64_t flat_offset = p.flat_offset;
      params.push_back(
          {.name = p.name,
           .shape = p.shape,
           .init = [model, seed, flat_offset](std::uint64_t offset, std::span<float> out) {
             return model->InitSlice(seed, flat_offset + offset, out);
           }});
    }
  } else {
    weights_.assign(layout.total_numel(), 0.0f);
    // Stage 2: no grads buffers (lent per layer, GradientReady).
    if (!lent()) grads_.assign(layout.total_numel(), 0.0f);
    // The initial weights, a pure function of (seed, flat index): the same on every rank. A
    // restore overwrites them.
    ZINF_RETURN_IF_ERROR(model_->InitWeights(seed, weights_));
    for (const partition::ParamInfo& p : layout.params()) {
      params.push_back({.name = p.name,
                        .shape = p.shape,
                        .weights = std::span<float>(weights_).subspan(p.flat_offset, p.numel),
                        .grads = lent()
                                     ? std::span<float>()
                                     : std::span<float>(grads_).subspan(p.flat_offset, p.numel)});
    }
  }
  ZINF_ASSIGN_OR_RETURN(
      engine_, engine::ZeroEngine::Create(world_, config_, std::move(params),
                                          {.metrics_path = options_.metrics_path,
                                           .total_steps = config_.steps,
                                           .progress = options_.progress,
                                           .create_nvme_paths = options_.create_nvme_paths}));
  const Json& user = engine_->user_state();
  if (user.is_object() && user.contains("seed") && user["seed"].is_number_integer() &&
      user["seed"].get<std::int64_t>() != config_.seed) {
    ZINF_LOG_WARN(
        "resuming with seed {}, but the checkpoint was trained with seed {}: the data "
        "order changes",
        config_.seed, user["seed"].get<std::int64_t>());
  }
  return OkStatus();
}

Status Run::ForwardBackward(std::int64_t step, int micro_batch, double* loss_sum) {
  const BatchId id{.seed = static_cast<std::uint64_t>(config_.seed),
                   .step = static_cast<std::uint64_t>(step - 1),
                   .micro_batch = micro_batch,
                   .world_rank = world_.rank(),
                   .world_size = world_.size()};
  const int batch_size = static_cast<int>(config_.train_micro_batch_size_per_gpu);
  Result<Batch> made = data_ ? data_->SampleBatch(id, batch_size, config_.model.context)
                             : SyntheticModel::MakeBatch(id, static_cast<std::size_t>(batch_size));
  if (lent()) {
    // The fetches (stage 3) and the reductions of the handed gradients are collective: a batch
    // this rank cannot make or take is agreed on before.
    const Status usable = made ? model_->CheckBatch(*made) : Status(std::unexpected(made.error()));
    ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(usable));
  }
  if (!made) return std::move(made).error();
  const Batch& batch = *made;
  if (lent()) {
    EngineLayerAccess access(*engine_, config_.fp16.enabled, weights_);
    Result<double> loss = model_->ForwardBackwardLayered(batch, access);
    access.Finish();
    if (!loss) return std::move(loss).error();
    *loss_sum += *loss;
    return OkStatus();
  }
  // The model accumulates into grads_, which the engine zeroes after taking it.
  if (!config_.fp16.enabled) {
    ZINF_ASSIGN_OR_RETURN(double loss, model_->ForwardBackward(weights_, batch, grads_));
    *loss_sum += loss;
    return OkStatus();
  }
  // fp16: each micro-batch's gradient as a backward pass of the loss times the engine's loss
  // scale in fp16 gives it (ScaledToFp16).
  micro_grads_.assign(grads_.size(), 0.0f);
  ZINF_ASSIGN_OR_RETURN(double loss, model_->ForwardBackward(weights_, batch, micro_grads_));
  const auto scale = static_cast<float>(engine_->loss_scale());
  for (std::size_t i = 0; i < grads_.size(); ++i) {
    grads_[i] += ScaledToFp16(micro_grads_[i], scale);
  }
  *loss_sum += loss;
  return OkStatus();
}

Result<engine::StepInfo> Run::Step(std::int64_t step) {
  const int gas = static_cast<int>(config_.gradient_accumulation_steps);
  double loss_sum = 0;
  for (int m = 0; m < gas; ++m) {
    // Local failures (a bad batch) are agreed on before the engine's collectives (at stages 2
    // and 3 inside ForwardBackward, whose errors are then the same on every rank).
    if (lent()) {
      ZINF_RETURN_IF_ERROR(ForwardBackward(step, m, &loss_sum));
    } else {
      ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(ForwardBackward(step, m, &loss_sum)));
    }
    // With swapped gradients every micro-batch is handed over as it comes (reduced and written
    // behind), and so at stages 2 and 3, where the gradients are lent; otherwise they add up in
    // grads_ and the step takes their sum.
    if ((config_.zinf.swap_gradients || lent()) && m + 1 < gas) {
      ZINF_RETURN_IF_ERROR(engine_->AccumulateGradients());
    }
  }
  return engine_->Step(loss_sum / gas);
}

Json Run::UserState(std::int64_t step, double loss) const {
  return Json{{"seed", config_.seed},
              {"samples_seen", step * config_.train_micro_batch_size_per_gpu *
                                   config_.gradient_accumulation_steps * world_.size()},
              {"data", "batches are a pure function of (seed, step, micro_batch, rank, world)"},
              {"loss", loss}};
}

Status Run::SaveCheckpoint(double loss) {
  ZINF_ASSIGN_OR_RETURN(engine::SavedCheckpointInfo saved,
                        engine_->SaveCheckpoint(UserState(engine_->step_count(), loss)));
  last_checkpoint_ = saved.path;
  last_checkpoint_step_ = engine_->step_count();
  return OkStatus();
}

Result<TrainSummary> Run::Go() {
  TrainSummary summary;
  // Every rank builds the model and loads the data; agree before the first collective.
  ZINF_RETURN_IF_ERROR(world_.AgreeOnStatus(BuildModel()));
  ZINF_RETURN_IF_ERROR(CreateEngine());
  const std::int64_t start_step = engine_->step_count() + 1;
  summary.first_step = start_step;
  summary.resumed_from = engine_->resumed_from();
  const std::int64_t last = config_.steps;
  if (start_step > last) {
    ZINF_LOG_INFO("nothing to do: the checkpoint is at step {}, --steps is {}", start_step - 1,
                  last);
  }
  const double loop_start = MonotonicSeconds();
  double loss = std::numeric_limits<double>::quiet_NaN();
  for (std::int64_t step = start_step; step <= last; ++step) {
    ZINF_ASSIGN_OR_RETURN(const engine::StepInfo info, Step(step));
    loss = info.loss;
    summary.last_step = step;
    if (info.checkpoint_due) ZINF_RETURN_IF_ERROR(SaveCheckpoint(loss));
    if (charlm_ != nullptr && !partitioned() && config_.steps_per_print > 0 &&
        (step % config_.steps_per_print == 0 || step == last) && world_.rank() == 0) {
      Result<double> eval = charlm_->EvalLoss(weights_, *data_, kEvalExamples);
      if (eval) ZINF_LOG_INFO("step {}: held-out loss {:.4f}", step, *eval);
    }
    if (info.stop_requested) {
      summary.interrupted = true;
      summary.signal = info.stop_signal;
      ZINF_LOG_WARN(
          "stopping after step {}: signal received on some rank{}", step,
          last_checkpoint_step_ == step ? fmt::format(" (checkpoint {})", last_checkpoint_) : "");
      break;
    }
  }
  summary.seconds = MonotonicSeconds() - loop_start;
  summary.final_loss = loss;
  summary.last_checkpoint = last_checkpoint_;
  if (summary.last_step == 0) summary.last_step = start_step - 1;
  ZINF_RETURN_IF_ERROR(Finish(summary));
  return summary;
}

Status Run::Finish(const TrainSummary& summary) {
  const std::int64_t steps = summary.last_step - summary.first_step + 1;
  ZINF_RETURN_IF_ERROR(engine_->LogSummary());
  if (steps > 0) {
    const std::int64_t samples = steps * config_.train_micro_batch_size_per_gpu *
                                 config_.gradient_accumulation_steps * world_.size();
    ZINF_LOG_INFO(
        "done: steps {}..{} in {:.1f} s ({:.3f} s/step, {:.0f} samples/s), final loss "
        "{:.4f}",
        summary.first_step, summary.last_step, summary.seconds,
        summary.seconds / static_cast<double>(steps),
        static_cast<double>(samples) / std::max(summary.seconds, 1e-9), summary.final_loss);
  }
  if (charlm_ != nullptr && !partitioned() && world_.rank() == 0) {
    Result<std::string> sample =
        charlm_->Sample(weights_, "The ", 240, static_cast<std::uint64_t>(config_.seed));
    if (sample) ZINF_LOG_INFO("sample (temperature 0.8) after \"The \":\nThe {}", *sample);
  }
  if (!last_checkpoint_.empty()) {
    ZINF_LOG_INFO(
        "last checkpoint: {} (inspect: zinf-ckpt ls {}; resume: --resume latest "
        "--checkpoint-dir {})",
        last_checkpoint_, last_checkpoint_, config_.zinf.checkpoint.dir);
  }
  return engine_->Close();
}

}  // namespace

const char* DefaultConfigJson() { return kDefaultConfig; }

Result<TrainConfig> BuildTrainConfig(const comm::Communicator& world,
                                     const std::string& config_path,
                                     const ConfigOverrides& overrides) {
  const config::ConfigContext ctx = config::ContextOf(world);
  Result<TrainConfig> config = [&]() -> Result<TrainConfig> {
    std::string text = kDefaultConfig;
    const std::string where =
        config_path.empty() ? std::string("built-in config: ") : "config " + config_path + ": ";
    if (!config_path.empty()) {
      ZINF_ASSIGN_OR_RETURN(text, config::ReadConfigFile(config_path));
    }
    ZINF_ASSIGN_OR_RETURN(TrainConfig parsed,
                          Annotate(ParseTrainConfig(text, ctx, overrides), where));
    // What the engine would refuse of this config, refused now: a run and --check-config load
    // the config through this one function and refuse the same configs.
    if (Status usable = config::CheckEngineConfig(parsed); !usable) {
      return std::move(usable).error().WithContext(where);
    }
    return parsed;
  }();
  return config::AgreeOnConfig(world, std::move(config));
}

Result<TrainSummary> Train(const comm::Communicator& world, const TrainConfig& config,
                           const TrainOptions& options) {
  Run run(world, config, options);
  return run.Go();
}

}  // namespace zinf::train
