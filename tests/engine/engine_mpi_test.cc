// ZeroEngine (engine/include/zinf/engine/engine.h) against a reference: plain in-memory data
// parallel Adam/AdamW in double precision, with the same gradient averaging, clipping and
// learning-rate schedule, computed independently of the engine's code. Plus the engine's
// argument errors and a checkpoint restore into mismatched parameters.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "test_gradient.h"

namespace zinf::engine {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

// A model the way a user holds it: weights and gradients in buffers of their own.
struct Model {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<float>> w, g;

  std::vector<Param> Params() {
    std::vector<Param> params;
    for (std::size_t i = 0; i < names.size(); ++i)
      params.push_back({names[i], shapes[i], w[i], g[i]});
    return params;
  }
};

// Odd sizes, so that partitions and sub-groups split tensors on every world size of the test.
Model MakeModel(std::int64_t emb = 5000) {
  Model m;
  m.names = {"fc1.weight", "fc1.bias", "emb", "head.w"};
  m.shapes = {{64, 70}, {70}, {emb}, {3, 5, 7}};
  for (std::size_t i = 0; i < m.shapes.size(); ++i) {
    std::int64_t n = 1;
    for (std::int64_t d : m.shapes[i]) n *= d;
    m.w.emplace_back(static_cast<std::size_t>(n));
    m.g.emplace_back(static_cast<std::size_t>(n), 0.0f);
    for (std::size_t k = 0; k < m.w[i].size(); ++k) {
      m.w[i][k] = 0.5f * static_cast<float>(std::sin(0.1 * static_cast<double>(k) + 1.7 * i));
    }
  }
  return m;
}

using testing::GradOf;

struct Case {
  std::string name;
  int gas = 1;                   // gradient_accumulation_steps
  bool accumulate_calls = true;  // AccumulateGradients per micro-batch; false: sum in the buffers
  bool swap_gradients = false;
  int stage = 2;
  bool adamw = true;
  double clipping = 0.0;
  // GradientReady per parameter: none; last parameter first (as a backward pass); first
  // parameter first; last first on rank 0 only (the others hand nothing).
  enum class Hand { kNone, kReverse, kForward, kRankZero } hand = Hand::kNone;
  std::uint64_t bucket = 500'000'000;  // zero_optimization.reduce_bucket_size
  // swap_gradients with read-add-write on NVMe instead of in memory; the model and sub-groups
  // are then large enough (emb 1.2M elements) for every rank's gradient to have swapped pieces.
  bool gradient_on_disk = false;
  std::uint64_t gather = 500'000'000;  // zero_optimization.allgather_bucket_size
};

// DeepSpeed's WarmupLR, linear, for 1-based step `step`: the scheduler's last_batch_iteration
// is i = step - 2 (its constructor sets the first step's min); min + (max - min) * i /
// max(2, warmup) for 0 <= i < warmup.
double RefLr(std::int64_t step) {
  constexpr double kMin = 0.001, kMax = 0.01, kWarmup = 3;
  const std::int64_t i = step - 2;
  if (i < 0) return kMin;
  if (i >= kWarmup) return kMax;
  return kMin + (kMax - kMin) * static_cast<double>(i) / kWarmup;
}

std::string ConfigText(const Case& c, const std::string& swap_dir, const std::string& ckpt_dir) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": {},
    "gradient_clipping": {},
    "steps_per_print": 1000,
    "optimizer": {{"type": "Adam", "params": {{"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8,
                                               "weight_decay": 0.01, "adam_w_mode": {}}}}},
    "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                   "warmup_num_steps": 3, "warmup_type": "linear"}}}},
    "zero_optimization": {{"stage": {}, "sub_group_size": {}, "reduce_bucket_size": {},
                           "allgather_bucket_size": {},
                           "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}},
    "zinf": {{"swap_gradients": {}, "adam_threads": 1, "checkpoint": {{"dir": "{}"}}}}
  }})",
                     c.gas, c.clipping, c.adamw ? "true" : "false", c.stage,
                     c.gradient_on_disk ? 1 << 20 : 3000, c.bucket, c.gather, swap_dir,
                     c.swap_gradients ? "true" : "false", ckpt_dir);
}

Result<config::Config> ParseFor(const Case& c, const SharedScratchDir& dir) {
  return config::ParseConfig(ConfigText(c, dir.Join("swap"), dir.Join("ckpt")), config::ContextOf(World()));
}

// Plain data parallel Adam over every rank's gradients, in double precision.
class Reference {
 public:
  Reference(const Model& initial, const Case& c, int world) : c_(c), world_(world) {
    for (const std::vector<float>& w : initial.w) {
      p_.emplace_back(w.begin(), w.end());
      m_.emplace_back(w.size(), 0.0);
      v_.emplace_back(w.size(), 0.0);
    }
  }

  // One step: returns the gradient norm before clipping.
  double Step(std::int64_t step) {
    std::vector<std::vector<double>> grad;
    for (const auto& p : p_) grad.emplace_back(p.size(), 0.0);
    for (int micro = 0; micro < c_.gas; ++micro) {
      for (int rank = 0; rank < world_; ++rank) {
        for (std::size_t i = 0; i < p_.size(); ++i) {
          for (std::size_t k = 0; k < p_[i].size(); ++k) {
            grad[i][k] += GradOf(i, k, rank, step, micro, static_cast<float>(p_[i][k]));
          }
        }
      }
    }
    double squared = 0;
    const double average = 1.0 / (c_.gas * world_);
    for (auto& g : grad) {
      for (double& x : g) {
        x *= average;
        squared += x * x;
      }
    }
    const double norm = std::sqrt(squared);
    const double clip = c_.clipping > 0 && norm > c_.clipping ? c_.clipping / (norm + 1e-6) : 1.0;
    const double lr = RefLr(step), beta1 = 0.9, beta2 = 0.99, eps = 1e-8, wd = 0.01;
    const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
    for (std::size_t i = 0; i < p_.size(); ++i) {
      for (std::size_t k = 0; k < p_[i].size(); ++k) {
        double g = grad[i][k] * clip;
        double& p = p_[i][k];
        if (c_.adamw) {
          p *= 1 - lr * wd;
        } else {
          g += wd * p;
        }
        m_[i][k] = beta1 * m_[i][k] + (1 - beta1) * g;
        v_[i][k] = beta2 * v_[i][k] + (1 - beta2) * g * g;
        p -= lr / bc1 * m_[i][k] / (std::sqrt(v_[i][k]) / std::sqrt(bc2) + eps);
      }
    }
    return norm;
  }

  const std::vector<double>& weights(std::size_t i) const { return p_[i]; }

 private:
  Case c_;
  int world_;
  std::vector<std::vector<double>> p_, m_, v_;
};

// The largest |got - want| of a tensor relative to the tensor's largest |want|.
double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (std::size_t k = 0; k < want.size(); ++k) {
    err = std::max(err, std::abs(static_cast<double>(got[k]) - want[k]));
    scale = std::max(scale, std::abs(want[k]));
  }
  return err / std::max(scale, 1e-30);
}

// The user's loop for one step: every micro-batch's gradient at the current weights, parameter
// by parameter in the order a backward pass (or the case) produces them.
Result<StepInfo> RunStep(ZeroEngine& engine, Model& model, const Case& c, std::int64_t step) {
  const int rank = World().rank();
  const std::size_t n = model.w.size();
  const bool hand = c.hand == Case::Hand::kReverse || c.hand == Case::Hand::kForward ||
                    (c.hand == Case::Hand::kRankZero && rank == 0);
  for (int micro = 0; micro < c.gas; ++micro) {
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = c.hand == Case::Hand::kForward ? j : n - 1 - j;
      for (std::size_t k = 0; k < model.w[i].size(); ++k) {
        model.g[i][k] += GradOf(i, k, rank, step, micro, model.w[i][k]);
      }
      if (hand) ZINF_RETURN_IF_ERROR(engine.GradientReady(i));
    }
    if (micro + 1 < c.gas && c.accumulate_calls) ZINF_RETURN_IF_ERROR(engine.AccumulateGradients());
  }
  return engine.Step(1.0 + rank);
}

class EngineMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(EngineMatchesReference, ForSeveralSteps) {
  const Case& c = GetParam();
  SharedScratchDir dir("engine");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, ParseFor(c, dir));
  Model model = MakeModel(c.gradient_on_disk ? 1'200'000 : 5000);
  Reference ref(model, c, World().size());
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto engine,
      ZeroEngine::Create(World(), config, model.Params(),
                         {.progress = false,
                          .stop_signals = false,
                          .create_nvme_paths = true,
                          .gradient_memory_limit_bytes = c.gradient_on_disk ? 0 : 256ull << 20}));
  bool clipped_once = false;
  for (std::int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(*engine, model, c, step));
    const double norm = ref.Step(step);
    EXPECT_EQ(info.step, step);
    EXPECT_EQ(engine->step_count(), step);
    EXPECT_NEAR(info.lr, RefLr(step), 1e-12);
    EXPECT_NEAR(info.grad_norm, norm, 1e-6 * norm);
    EXPECT_NEAR(info.loss, 1.0 + (World().size() - 1) / 2.0, 1e-12);
    clipped_once |= info.clipped;
    // The step's swap I/O: all of it in the optimizer step, but for a gradient written behind to
    // NVMe during the micro-batches (counted too).
    if (c.gradient_on_disk) {
      EXPECT_GT(info.swap_write_bytes, info.optimizer_swap_write_bytes);
    } else {
      EXPECT_EQ(info.swap_write_bytes, info.optimizer_swap_write_bytes);
      EXPECT_EQ(info.swap_read_bytes, info.optimizer_swap_read_bytes);
    }
    EXPECT_GT(info.optimizer_swap_write_bytes, 0u);
    for (std::size_t i = 0; i < model.w.size(); ++i) {
      EXPECT_LE(RelativeError(model.w[i], ref.weights(i)), 1e-6) << model.names[i];
      // Step hands the gradients back zeroed for the next step.
      EXPECT_TRUE(
          std::all_of(model.g[i].begin(), model.g[i].end(), [](float x) { return x == 0; }));
    }
  }
  EXPECT_EQ(clipped_once, c.clipping > 0);
  ZINF_EXPECT_OK(engine->Close());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EngineMatchesReference,
    ::testing::Values(
        Case{.name = "AdamW"}, Case{.name = "AccumulateCalls", .gas = 3, .gather = 64},
        Case{.name = "AccumulateInBuffers", .gas = 3, .accumulate_calls = false},
        Case{.name = "SwapGradients", .gas = 2, .swap_gradients = true},
        // The all-gather in rounds (allgather_bucket_size over all ranks) that cut parameters
        // and end short of the partition.
        Case{.name = "Stage3AdamL2Clipped",
             .stage = 3,
             .adamw = false,
             .clipping = 5.0,
             .gather = 1000},
        // Gradients handed per parameter, in buckets of >= 3000 elements: [fc1.weight],
        // [fc1.bias, emb], [head.w]; or one bucket; or one per parameter (bucket 1).
        Case{.name = "PerParam", .hand = Case::Hand::kReverse, .bucket = 3000},
        Case{.name = "PerParamOneBucket", .hand = Case::Hand::kReverse},
        Case{.name = "PerParamForwardOrder", .hand = Case::Hand::kForward, .bucket = 3000},
        Case{.name = "PerParamRankZeroOnly",
             .gas = 2,
             .hand = Case::Hand::kRankZero,
             .bucket = 3000},
        Case{.name = "PerParamAccumulateClipped",
             .gas = 3,
             .clipping = 0.5,
             .hand = Case::Hand::kReverse,
             .bucket = 1},
        Case{.name = "PerParamSwapGradients",
             .gas = 2,
             .swap_gradients = true,
             .hand = Case::Hand::kReverse,
             .bucket = 3000},
        Case{.name = "PerParamStage3", .stage = 3, .hand = Case::Hand::kReverse, .bucket = 3000},
        Case{.name = "PerParamGradientOnDisk",
             .gas = 3,
             .swap_gradients = true,
             .hand = Case::Hand::kReverse,
             .bucket = 3000,
             .gradient_on_disk = true},
        Case{.name = "GradientOnDisk",
             .gas = 2,
             .swap_gradients = true,
             .gradient_on_disk = true,
             .gather = 100'003}),
    [](const ::testing::TestParamInfo<Case>& param) { return param.param.name; });

TEST(ZeroEngine, RestoreNamesTheMismatchedParameter) {
  SharedScratchDir dir("engine-restore");
  const Case c;
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, ParseFor(c, dir));
  const EngineOptions options = {
      .progress = false, .stop_signals = false, .create_nvme_paths = true};
  Model model = MakeModel();
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, model.Params(), options));
    for (std::int64_t step = 1; step <= 2; ++step) {
      ZINF_ASSERT_OK(RunStep(*engine, model, c, step));
    }
    ZINF_ASSERT_OK(engine->SaveCheckpoint({{"epoch", 7}}));
    ZINF_ASSERT_OK(engine->Close());
  }
  EngineOptions resume = options;
  resume.load = "latest";
  {
    Model same = MakeModel();
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, same.Params(), resume));
    EXPECT_EQ(engine->step_count(), 2);
    EXPECT_EQ(engine->user_state(), nlohmann::json({{"epoch", 7}}));
    EXPECT_EQ(engine->resumed_world_size(), World().size());
    for (std::size_t i = 0; i < model.w.size(); ++i)
      EXPECT_EQ(same.w[i], model.w[i]) << model.names[i];
    ZINF_ASSERT_OK(engine->Close());
  }
  {
    Model renamed = MakeModel();
    renamed.names[1] = "fc1.b";
    EXPECT_THAT(ZeroEngine::Create(World(), config, renamed.Params(), resume),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("fc1.b")));
  }
  {
    Model reshaped = MakeModel();
    reshaped.shapes[0] = {70, 64};
    EXPECT_THAT(ZeroEngine::Create(World(), config, reshaped.Params(), resume),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("fc1.weight")));
  }
}

// Parameter groups through the C++ API: each Param names its group, bad groups are refused
// before anything is built, a config scheduler schedules every group from its own values, the
// loop's SetHyperParams is agreed on at Step, and a checkpoint restores only into the same
// groups (naming the first parameter that moved) and then goes on with the saved values.
TEST(ZeroEngine, ParamGroups) {
  SharedScratchDir dir("engine-groups");
  const Case c;
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config scheduled, ParseFor(c, dir));
  config::Config constant = scheduled;
  constant.scheduler.type = config::SchedulerType::kNone;
  EngineOptions options = {.progress = false, .stop_signals = false, .create_nvme_paths = true};
  options.param_groups = {{}, {.lr = 0.004, .weight_decay = 0.0}};
  auto grouped = [](Model& model, std::size_t moved) {
    std::vector<Param> params = model.Params();
    params[1].group = 1;  // fc1.bias
    params[moved].group = 1;
    return params;
  };
  {
    Model model = MakeModel();
    std::vector<Param> params = grouped(model, 3);
    params[2].group = 2;
    EXPECT_THAT(ZeroEngine::Create(World(), scheduled, params, options),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("parameter 2 'emb' is in group 2, but there are 2")));
    EngineOptions bad = options;
    bad.param_groups[1].eps = 0.0;
    EXPECT_THAT(ZeroEngine::Create(World(), scheduled, grouped(model, 3), bad),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("param_groups[1]: adam eps")));
  }
  {
    Model model = MakeModel();
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), scheduled, grouped(model, 3), options));
    ASSERT_EQ(engine->num_param_groups(), 2u);
    // WarmupLR with warmup_max_lr: every group's lr alike (DeepSpeed); the rest its own.
    EXPECT_EQ(engine->next_hyper_params(1).lr, engine->next_lr());
    EXPECT_EQ(engine->next_hyper_params(1).weight_decay, 0.0);
    EXPECT_EQ(engine->next_hyper_params(0).weight_decay, 0.01);
    EXPECT_THAT(engine->SetHyperParams(std::vector<HyperParams>(2)),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("scheduler")));
    ZINF_ASSERT_OK(engine->Close());
  }
  Model model = MakeModel();
  const std::vector<HyperParams> values = {
      {.lr = 0.01, .betas = {0.9, 0.99}, .eps = 1e-8, .weight_decay = 0.01},
      {.lr = 0.003, .betas = {0.8, 0.9}, .eps = 1e-6, .weight_decay = 0.0}};
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), constant, grouped(model, 3), options));
    EXPECT_THAT(engine->SetHyperParams(std::span(values).first(1)),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("1 group(s) given")));
    std::vector<HyperParams> nan = values;
    nan[1].lr = std::nan("");
    EXPECT_THAT(engine->SetHyperParams(nan),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("group 1: adam lr")));
    ZINF_ASSERT_OK(engine->SetHyperParams(values));
    ZINF_ASSERT_OK(RunStep(*engine, model, c, 1));
    if (World().size() > 1) {
      std::vector<HyperParams> mine = values;
      if (World().rank() == 1) mine[1].weight_decay = 0.5;
      ZINF_ASSERT_OK(engine->SetHyperParams(mine));
      const std::vector<float> before = model.w[1];
      EXPECT_THAT(RunStep(*engine, model, c, 2),
                  StatusIs(ErrorCode::kFailedPrecondition,
                           HasSubstr("parameter group 1's weight_decay differs between the ranks "
                                     "(0 to 0.5)")));
      EXPECT_EQ(model.w[1], before);
      for (std::vector<float>& g : model.g) std::ranges::fill(g, 0.0f);  // handed already
      ZINF_ASSERT_OK(engine->SetHyperParams(values));
    }
    ZINF_ASSERT_OK(RunStep(*engine, model, c, 2));
    ZINF_ASSERT_OK(engine->SaveCheckpoint());
    ZINF_ASSERT_OK(engine->Close());
  }
  EngineOptions resume = options;
  resume.load = "latest";
  Model other = MakeModel();
  EXPECT_THAT(ZeroEngine::Create(World(), constant, grouped(other, 2), resume),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr("parameter 'emb' is in parameter group 0 of the checkpoint but "
                                 "in group 1 here")));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), constant, grouped(other, 3), resume));
  EXPECT_EQ(engine->next_hyper_params(0), values[0]);
  EXPECT_EQ(engine->next_hyper_params(1), values[1]);
  for (std::size_t i = 0; i < model.w.size(); ++i) EXPECT_EQ(other.w[i], model.w[i]);
  ZINF_ASSERT_OK(engine->Close());

  // Load into a live engine: refused mid-step and for a missing file, changing nothing; then
  // the checkpoint's step, weights and values, and the loop goes on.
  Model live = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(engine,
                            ZeroEngine::Create(World(), constant, grouped(live, 3), options));
  ZINF_ASSERT_OK(RunStep(*engine, live, c, 1));
  const std::vector<std::vector<float>> stepped = live.w;
  ZINF_ASSERT_OK(engine->GradientReady(0));
  EXPECT_THAT(engine->Load(dir.Join("ckpt")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("in the middle of a step")));
  for (std::vector<float>& g : live.g) std::ranges::fill(g, 0.0f);
  ZINF_ASSERT_OK(RunStep(*engine, live, c, 2));  // ends the micro-batch
  EXPECT_THAT(engine->Load(dir.Join("none")), StatusIs(ErrorCode::kNotFound));
  EXPECT_EQ(engine->step_count(), 2);
  ZINF_ASSERT_OK(engine->Load(dir.Join("ckpt")));
  EXPECT_EQ(engine->step_count(), 2);
  EXPECT_EQ(engine->next_hyper_params(1), values[1]);
  for (std::size_t i = 0; i < model.w.size(); ++i) EXPECT_EQ(live.w[i], model.w[i]);
  ZINF_ASSERT_OK(RunStep(*engine, live, c, 3));
  EXPECT_EQ(engine->step_count(), 3);
  ZINF_ASSERT_OK(engine->Close());
}

class EngineErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    ZINF_ASSERT_OK_AND_ASSIGN(config_, ParseFor(Case{.name = "gas2", .gas = 2}, dir_));
  }
  Result<std::unique_ptr<ZeroEngine>> Create(Model& model) {
    return ZeroEngine::Create(World(), config_, model.Params(), options_);
  }

  SharedScratchDir dir_{"engine-errors"};
  config::Config config_;
  EngineOptions options_ = {.progress = false, .stop_signals = false, .create_nvme_paths = true};
};

TEST_F(EngineErrors, StepBeforeAnyGradient) {
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(model));
  const std::vector<float> before = model.w[0];
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition,
                                       HasSubstr("before any gradient was written")));
  EXPECT_EQ(engine->step_count(), 0);
  EXPECT_EQ(model.w[0], before);
  // The loop can go on once it writes gradients.
  ZINF_EXPECT_OK(RunStep(*engine, model, Case{.name = "gas2", .gas = 2}, 1));
  EXPECT_EQ(engine->step_count(), 1);
}

TEST_F(EngineErrors, ParameterRegisteredTwice) {
  Model model = MakeModel();
  model.names[2] = "fc1.weight";
  EXPECT_THAT(Create(model),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'fc1.weight': duplicate name")));
  Model shared = MakeModel();
  std::vector<Param> params = shared.Params();
  params[3].grads = params[2].grads.first(params[3].grads.size());  // head.w's grads in emb's
  EXPECT_THAT(ZeroEngine::Create(World(), config_, params, options_),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("grads buffer of parameter 'head.w' overlaps the grads buffer of "
                                 "parameter 'emb'")));
}

TEST_F(EngineErrors, GradientReadyMisuse) {
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(model));
  EXPECT_THAT(engine->GradientReady(4),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("GradientReady(4): there are 4")));
  // Recorded: the micro-batch fails on every rank, and the loop can go on after it.
  EXPECT_THAT(engine->AccumulateGradients(),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("GradientReady(4)")));
  ZINF_ASSERT_OK(engine->GradientReady(2));
  EXPECT_THAT(engine->GradientReady(2),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("GradientReady(2) called twice")));
  EXPECT_THAT(engine->AccumulateGradients(),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("called twice")));
  EXPECT_EQ(engine->step_count(), 0);
  ZINF_ASSERT_OK(engine->Close());
  EXPECT_THAT(engine->GradientReady(0),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("after Close")));
}

// A user state the restore could not read back (ParseJson's 64 levels, counting the engine's
// wrapper) is refused at save time; the checkpoint directory stays empty.
TEST_F(EngineErrors, UserStateARestoreCouldNotRead) {
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(model));
  ZINF_ASSERT_OK(RunStep(*engine, model, Case{.name = "gas2", .gas = 2}, 1));
  auto nested = [](int depth) {
    nlohmann::json state = nlohmann::json::object();
    for (int i = 1; i < depth; ++i) state = nlohmann::json{{"k", state}};
    return state;
  };
  EXPECT_THAT(engine->SaveCheckpoint(nested(64)),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("user state of a checkpoint is not restorable")));
  EXPECT_FALSE(std::filesystem::exists(dir_.Join("ckpt") + "/latest"));
  ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpointInfo saved, engine->SaveCheckpoint(nested(63)));
  ZINF_ASSERT_OK(engine->Close());
  EngineOptions resume = options_;
  resume.load = saved.path;
  ZINF_ASSERT_OK_AND_ASSIGN(auto again,
                            ZeroEngine::Create(World(), config_, model.Params(), resume));
  EXPECT_EQ(again->user_state(), nested(63));
  ZINF_ASSERT_OK(again->Close());
}

TEST_F(EngineErrors, BufferSizeAndAccumulateCalls) {
  Model model = MakeModel();
  model.w[1].pop_back();
  EXPECT_THAT(Create(model), StatusIs(ErrorCode::kInvalidArgument,
                                      HasSubstr("'fc1.bias' of shape [70] has 70 elements, but "
                                                "its weights buffer holds 69")));
  Model good = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(good));
  good.g[0][0] = 1;
  ZINF_ASSERT_OK(engine->AccumulateGradients());
  EXPECT_THAT(
      engine->AccumulateGradients(),
      StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("AccumulateGradients called 2 times")));
  ZINF_ASSERT_OK(engine->Close());
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("after Close")));
}

// DropGradients (a loop skipping a bad batch) and a refused AccumulateGradients drop the step's
// gradient: the next micro-batches make the step alone, bitwise as in a run that never saw the
// dropped ones. One rank's recorded GradientReady error fails DropGradients on every rank, and
// the micro-batch is dropped all the same.
TEST_F(EngineErrors, DroppedGradientsLeaveTheStepToTheNextMicroBatches) {
  const Case gas2{.name = "gas2", .gas = 2};
  auto bad = [](Model& m) {
    for (auto& g : m.g) std::fill(g.begin(), g.end(), 5.0f);
  };
  Model clean = MakeModel();
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(clean));
    for (std::int64_t step = 1; step <= 3; ++step) {
      ZINF_ASSERT_OK(RunStep(*engine, clean, gas2, step));
    }
    ZINF_ASSERT_OK(engine->Close());
  }
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(model));
  // Step 1: a whole micro-batch and part of the next one (handed), dropped.
  bad(model);
  ZINF_ASSERT_OK(engine->AccumulateGradients());
  bad(model);
  ZINF_ASSERT_OK(engine->GradientReady(3));
  ZINF_ASSERT_OK(engine->DropGradients());
  for (const auto& g : model.g) EXPECT_EQ(*std::max_element(g.begin(), g.end()), 0.0f);
  ZINF_ASSERT_OK(RunStep(*engine, model, gas2, 1));
  // Step 2: AccumulateGradients once too often: refused, the step's gradient dropped.
  bad(model);
  ZINF_ASSERT_OK(engine->AccumulateGradients());
  bad(model);
  EXPECT_THAT(engine->AccumulateGradients(),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("called 2 times")));
  ZINF_ASSERT_OK(RunStep(*engine, model, gas2, 2));
  // Step 3: one rank hands a parameter that does not exist.
  bad(model);
  if (World().rank() == World().size() - 1) {
    EXPECT_THAT(engine->GradientReady(4), StatusIs(ErrorCode::kInvalidArgument));
  }
  EXPECT_THAT(engine->DropGradients(),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("GradientReady(4)")));
  ZINF_ASSERT_OK(RunStep(*engine, model, gas2, 3));
  EXPECT_EQ(engine->step_count(), 3);
  for (std::size_t i = 0; i < model.w.size(); ++i) EXPECT_EQ(model.w[i], clean.w[i]) << i;
  ZINF_ASSERT_OK(engine->Close());
  EXPECT_THAT(engine->DropGradients(),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("after Close")));
}

// One rank closes while the others step: every rank is told which call each rank is in, and the
// engine can only be closed. Then the destructor of an engine not
// closed is local: on every rank, at different times, it removes the rank's own store.
TEST_F(EngineErrors, RanksInDifferentCallsAndALocalDestructor) {
  if (World().size() < 2) GTEST_SKIP() << "needs 2 ranks, have " << World().size();
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create(model));
  const bool last = World().rank() == World().size() - 1;
  for (auto& g : model.g) std::fill(g.begin(), g.end(), 0.25f);
  ZINF_ASSERT_OK(engine->AccumulateGradients());
  Status mixed = OkStatus();
  if (last) {
    mixed = engine->Close();
  } else if (Result<StepInfo> stepped = engine->Step(); !stepped) {
    mixed = stepped.error();
  }
  EXPECT_THAT(mixed, StatusIs(ErrorCode::kFailedPrecondition,
                              HasSubstr(fmt::format("rank {} in Close", World().size() - 1))));
  EXPECT_TRUE(engine->closed() == last);
  // Diverged for good: every call fails at once alike, and Close closes each rank's part.
  EXPECT_THAT(engine->SaveCheckpoint(),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr(last ? "after Close" : "different calls")));
  ZINF_ASSERT_OK(engine->Close());
  EXPECT_TRUE(engine->closed());

  Model again = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(engine, Create(again));
  for (auto& g : again.g) std::fill(g.begin(), g.end(), 0.25f);
  ZINF_ASSERT_OK(engine->AccumulateGradients());
  ZINF_ASSERT_OK(engine->Step());
  EXPECT_EQ(engine->step_count(), 1);

  auto my_store = [&] {  // <nvme_path>/zinf-<job>/rank<r>
    std::error_code ec;
    const std::string mine = fmt::format("rank{}", World().rank());
    for (const auto& job : std::filesystem::directory_iterator(
             config_.zero_optimization.offload_optimizer.resolved_nvme_paths[0], ec)) {
      if (std::filesystem::exists(job.path() / mine)) return true;
    }
    return false;
  };
  ASSERT_TRUE(my_store());
  std::this_thread::sleep_for(std::chrono::milliseconds(100 * World().rank()));
  engine.reset();
  EXPECT_FALSE(my_store());
}

// OneCycle through the engine: each step at DeepSpeed's lr for its last_batch_iteration (k - 2),
// until DeepSpeed's momentum decay (beta1 = 0.9 * (1 + d) after the 2-step cycle) reaches 1,
// which is refused before any swap, on every rank.
TEST(ZeroEngine, OneCycleStepsAtDeepSpeedsLrUntilBeta1ReachesOne) {
  SharedScratchDir dir("engine-onecycle");
  const std::string text = fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.5}}}},
    "scheduler": {{"type": "OneCycle", "params": {{"cycle_min_lr": 0.01, "cycle_max_lr": 0.03,
        "cycle_first_step_size": 1, "decay_step_size": 1, "decay_lr_rate": 1,
        "decay_mom_rate": 0.05, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}}}},
    "zero_optimization": {{"offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}},
    "zinf": {{"adam_threads": 1}}}})",
                                       dir.Join("swap"));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, config::ParseConfig(text, config::ContextOf(World())));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto engine,
      ZeroEngine::Create(World(), config, model.Params(),
                         {.progress = false, .stop_signals = false, .create_nvme_paths = true}));
  // L = -1: 0.01 (constructor); L = 0: b = 1, x = 0.5 = r: the peak 0.03; L = 1: b = 2, the
  // end 0.01; L >= 2: 0.01 / (1 + (L - 1)), beta1 = 0.9 * (1 + 0.05 * (L - 1)).
  const std::vector<double> lrs = {0.01, 0.03, 0.01, 0.005, 0.01 / 3};
  for (std::int64_t step = 1; step <= 5; ++step) {
    SCOPED_TRACE(step);
    for (auto& g : model.g) std::fill(g.begin(), g.end(), 0.1f);
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, engine->Step());
    EXPECT_NEAR(info.lr, lrs[static_cast<std::size_t>(step - 1)], 1e-15);
  }
  // Step 6 (L = 4): beta1 = 0.9 * 1.15 >= 1.
  std::vector<std::vector<float>> before = model.w;
  for (auto& g : model.g) std::fill(g.begin(), g.end(), 0.1f);
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition,
                                       HasSubstr("OneCycle's momentum decay made beta1")));
  EXPECT_EQ(model.w, before);
  EXPECT_EQ(engine->step_count(), 5);
  ZINF_ASSERT_OK(engine->Close());
}

// A registered buffer one element longer or shorter than its parameter is refused, weights and
// grads alike, on every rank (here on one: the others' buffers are right).
TEST_F(EngineErrors, BuffersOfTheWrongSizeAreRefusedLongerAndShorter) {
  struct Wrong {
    bool grads;
    int delta;
    const char* message;
  };
  const std::vector<Wrong> cases = {
      {true, +1, "its weights buffer holds 70 and its grads buffer 71"},
      {true, -1, "its weights buffer holds 70 and its grads buffer 69"},
      {false, +1, "its weights buffer holds 71 and its grads buffer 70"},
      {false, -1, "its weights buffer holds 69 and its grads buffer 70"}};
  for (const Wrong& wrong : cases) {
    SCOPED_TRACE(wrong.message);
    Model model = MakeModel();
    if (World().rank() == World().size() - 1) {
      std::vector<float>& buffer = wrong.grads ? model.g[1] : model.w[1];
      buffer.resize(buffer.size() + wrong.delta, 0.0f);
    }
    const Result<std::unique_ptr<ZeroEngine>> created = Create(model);
    ASSERT_FALSE(created.has_value());
    EXPECT_EQ(created.error().code(), ErrorCode::kInvalidArgument);
    if (World().rank() == World().size() - 1) {
      EXPECT_THAT(created.error().message(),
                  HasSubstr(std::string("'fc1.bias' of shape [70] has 70 elements, but ") +
                            wrong.message));
    }
  }
}

// Step agrees on every parameter group's values: one rank whose loop set another value of any
// one of them (each of the five, in either group) makes the step FailedPrecondition on every
// rank, naming the group and the value, with nothing stepped; the groups set alike again, the
// loop goes on. The same for groups given differently to Create.
TEST(ZeroEngine, ParamGroupsThatDifferInAnyOneValueAreRefused) {
  if (World().size() < 2) GTEST_SKIP() << "needs 2 ranks, have " << World().size();
  SharedScratchDir dir("engine-groups-differ");
  const Case c;
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, ParseFor(c, dir));
  config.scheduler.type = config::SchedulerType::kNone;
  const std::vector<HyperParams> values = {
      {.lr = 0.01, .betas = {0.9, 0.99}, .eps = 1e-8, .weight_decay = 0.01},
      {.lr = 0.003, .betas = {0.8, 0.9}, .eps = 1e-6, .weight_decay = 0.0}};
  constexpr std::array<const char*, 5> kNames = {"lr", "beta1", "beta2", "eps", "weight_decay"};
  // Value k of `h`, changed a little (still valid).
  auto changed = [](HyperParams h, std::size_t k) {
    switch (k) {
      case 0: h.lr *= 1.5; break;
      case 1: h.betas[0] -= 0.05; break;
      case 2: h.betas[1] -= 0.005; break;
      case 3: h.eps *= 2; break;
      default: h.weight_decay += 0.02; break;
    }
    return h;
  };
  const bool odd_one = World().rank() == World().size() - 1;
  EngineOptions options = {.progress = false, .stop_signals = false, .create_nvme_paths = true};
  options.param_groups = {{}, {.lr = 0.003, .betas = std::array{0.8, 0.9}, .eps = 1e-6,
                               .weight_decay = 0.0}};
  auto grouped = [](Model& model) {
    std::vector<Param> params = model.Params();
    params[1].group = 1;
    params[3].group = 1;
    return params;
  };
  Model model = MakeModel();
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, grouped(model), options));
    std::int64_t step = 0;
    for (std::size_t g = 0; g < values.size(); ++g) {
      for (std::size_t k = 0; k < kNames.size(); ++k) {
        SCOPED_TRACE(fmt::format("group {} {}", g, kNames[k]));
        std::vector<HyperParams> mine = values;
        if (odd_one) mine[g] = changed(mine[g], k);
        ZINF_ASSERT_OK(engine->SetHyperParams(mine));
        const std::vector<std::vector<float>> before = model.w;
        EXPECT_THAT(RunStep(*engine, model, c, step + 1),
                    StatusIs(ErrorCode::kFailedPrecondition,
                             HasSubstr(fmt::format("parameter group {}'s {} differs between the "
                                                   "ranks",
                                                   g, kNames[k]))));
        EXPECT_TRUE(model.w == before) << "a refused step changed the weights";
        EXPECT_EQ(engine->step_count(), step);
        for (std::vector<float>& grad : model.g) std::ranges::fill(grad, 0.0f);  // handed
        ZINF_ASSERT_OK(engine->SetHyperParams(values));
        ZINF_ASSERT_OK(RunStep(*engine, model, c, ++step));
      }
    }
    ZINF_ASSERT_OK(engine->Close());
  }
  for (std::size_t k = 0; k < kNames.size(); ++k) {
    SCOPED_TRACE(fmt::format("Create's group 1 {}", kNames[k]));
    EngineOptions mine = options;
    if (odd_one) {
      const HyperParams h = changed(values[1], k);
      mine.param_groups[1] = {.lr = h.lr, .betas = h.betas, .eps = h.eps,
                              .weight_decay = h.weight_decay};
    }
    Model fresh = MakeModel();
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, grouped(fresh), mine));
    EXPECT_THAT(RunStep(*engine, fresh, c, 1),
                StatusIs(ErrorCode::kFailedPrecondition,
                         HasSubstr(fmt::format("parameter group 1's {} differs", kNames[k]))));
    EXPECT_EQ(engine->step_count(), 0);
    ZINF_ASSERT_OK(engine->Close());
  }
}

}  // namespace
}  // namespace zinf::engine
