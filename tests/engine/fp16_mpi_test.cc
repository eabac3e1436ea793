// fp16 with DeepSpeed's loss scaling in ZeroEngine (engine.h, loss_scaler.h), on 1-3 ranks,
// against a reference written here from DeepSpeed's published rules: a plain loop for the
// scale, the hysteresis and the skipped steps, and data parallel Adam in double precision that
// skips the steps the reference scaler skips (neither Adam's step count nor the schedule moves).
// An injected overflow pattern (an Inf or NaN in one rank's gradient) must give exactly the
// reference's scales and skipped steps; a skipped step must leave every byte of the swap store
// as it was and count no swap bytes; a checkpoint after a scale change resumes with the scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "zinf/engine/loss_scaler.h"

namespace zinf::engine {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

// ---- The reference: DeepSpeed's DynamicLossScaler.update_scale, as published ----

struct RefScaler {
  double scale;
  std::int64_t window;
  int delayed_shift;
  int hysteresis;
  bool consecutive;
  double min_scale;
  std::int64_t iter = 0;
  std::int64_t last_overflow = -1;

  // False where DeepSpeed raises ("Current loss scale already at minimum").
  bool Update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || hysteresis == 1) {
        if (scale == min_scale) return false;
        scale = std::max(scale / 2, min_scale);
      } else {
        hysteresis -= 1;
      }
      last_overflow = iter;
    } else {
      if (consecutive) hysteresis = delayed_shift;
      const std::int64_t stable = iter - last_overflow - 1;
      if (stable > 0 && stable % window == 0) {
        if (!consecutive) hysteresis = delayed_shift;
        scale *= 2;
      }
    }
    iter += 1;
    return true;
  }
};

// A hand-worked sequence, so that the reference itself is checked against the rule's text:
// window 2, hysteresis 2, from 2^4.
TEST(RefScaler, HandWorkedSequence) {
  RefScaler r{.scale = 16,
              .window = 2,
              .delayed_shift = 2,
              .hysteresis = 2,
              .consecutive = false,
              .min_scale = 1};
  // clean (stable 0), clean (1), clean (2: doubles), overflow (hysteresis 2 -> 1), overflow
  // (halves), clean (stable 0), clean (1), clean (2: doubles).
  const std::vector<bool> overflows = {false, false, false, true, true, false, false, false};
  const std::vector<double> after = {16, 16, 32, 32, 16, 16, 16, 32};
  for (std::size_t i = 0; i < overflows.size(); ++i) {
    ASSERT_TRUE(r.Update(overflows[i]));
    EXPECT_EQ(r.scale, after[i]) << "update " << i;
  }
}

// The engine's LossScaler against the reference over a long random-looking pattern.
TEST(LossScaler, MatchesTheReferenceRule) {
  for (bool consecutive : {false, true}) {
    for (int hysteresis : {1, 2, 3}) {
      const config::Fp16Config config{.enabled = true,
                              .initial_scale_power = 6,
                              .loss_scale_window = 3,
                              .hysteresis = hysteresis,
                              .consecutive_hysteresis = consecutive,
                              .min_loss_scale = 0.5};
      LossScaler scaler(config);
      RefScaler ref{.scale = 64,
                    .window = 3,
                    .delayed_shift = hysteresis,
                    .hysteresis = hysteresis,
                    .consecutive = consecutive,
                    .min_scale = 0.5};
      for (int i = 0; i < 400; ++i) {
        const bool overflow = ((i * 7919) % 13) < 4 || (i > 300 && i % 2 == 0);
        const bool ok = ref.Update(overflow);
        const Status status = scaler.Update(overflow);
        ASSERT_EQ(status.has_value(), ok) << "update " << i;
        if (!ok) break;  // DeepSpeed stops the run here
        ASSERT_EQ(scaler.scale(), ref.scale)
            << "update " << i << " consecutive " << consecutive << " hysteresis " << hysteresis;
        ASSERT_EQ(scaler.state().hysteresis, ref.hysteresis);
      }
    }
  }
}

TEST(LossScaler, StaticAndDisabledNeverChange) {
  LossScaler off(config::Fp16Config{});
  LossScaler fixed(config::Fp16Config{.enabled = true, .loss_scale = 128});
  for (bool overflow : {true, false, true}) {
    ZINF_ASSERT_OK(off.Update(overflow));
    ZINF_ASSERT_OK(fixed.Update(overflow));
  }
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_EQ(fixed.scale(), 128.0);
}

TEST(LossScaler, RestoreChecksWhatItReads) {
  const config::Fp16Config config{.enabled = true, .initial_scale_power = 8, .hysteresis = 2};
  LossScaler a(config);
  ZINF_ASSERT_OK(a.Update(true));
  ZINF_ASSERT_OK(a.Update(true));  // halved
  LossScaler b(config);
  ZINF_ASSERT_OK(b.Restore(a.ToJson()));
  EXPECT_EQ(b.scale(), 128.0);
  EXPECT_EQ(b.state().iteration, 2);
  nlohmann::json bad = a.ToJson();
  bad["scale"] = -1.0;
  EXPECT_THAT(b.Restore(bad), StatusIs(ErrorCode::kDataLoss, HasSubstr("scale")));
  bad = a.ToJson();
  bad["last_overflow_iteration"] = 5;
  EXPECT_THAT(b.Restore(bad), StatusIs(ErrorCode::kDataLoss));
  // A state saved without fp16 (or with a static scale) leaves the config's first scale.
  LossScaler c(config);
  ZINF_ASSERT_OK(c.Restore(LossScaler(config::Fp16Config{}).ToJson()));
  EXPECT_EQ(c.scale(), 256.0);
}

// ---- The engine on 1-3 ranks ----

struct Model {
  std::vector<std::string> names = {"w", "b", "head"};
  std::vector<std::vector<std::int64_t>> shapes = {{40, 50}, {50}, {3, 7, 11}};
  std::vector<std::vector<float>> w, g;

  Model() {
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      std::int64_t n = 1;
      for (std::int64_t d : shapes[i]) n *= d;
      w.emplace_back(static_cast<std::size_t>(n));
      g.emplace_back(static_cast<std::size_t>(n), 0.0f);
      for (std::size_t k = 0; k < w[i].size(); ++k) {
        // fp16 values, as fp16 working weights hold them.
        w[i][k] = static_cast<float>(static_cast<_Float16>(
            0.5 * std::sin(0.1 * static_cast<double>(k) + 1.7 * static_cast<double>(i))));
      }
    }
  }
  std::vector<Param> Params() {
    std::vector<Param> params;
    for (std::size_t i = 0; i < names.size(); ++i)
      params.push_back({names[i], shapes[i], w[i], g[i]});
    return params;
  }
};

// The unscaled gradient of rank `rank` in micro-batch `micro` of step `step`: a function of
// those alone, so that the reference sees exactly the gradients the engine sees.
double GradOf(std::size_t param, std::size_t k, int rank, std::int64_t step, int micro) {
  return 0.02 + 0.1 * std::sin(0.37 * static_cast<double>(k) + 1.3 * rank +
                               0.71 * static_cast<double>(step) + 0.13 * micro +
                               0.5 * static_cast<double>(param));
}

// The injected pattern: at these steps one rank (step % world) puts an Inf or a NaN into one
// element of its gradient. With hysteresis 2 and window 3 it exercises the hysteresis, the
// halving, the doubling after a clean window and a refill.
const std::set<std::int64_t> kOverflowSteps = {2, 3, 4, 9, 10, 16, 17, 18};
constexpr std::int64_t kSteps = 20;

struct Fp16Case {
  std::string name;
  int gas = 1;
  bool swap_gradients = false;
  bool consecutive = false;
  std::string state = "fp32";
};

std::string ConfigText(const Fp16Case& c, const std::string& dir) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": {},
    "gradient_clipping": 0.05, "steps_per_print": 1000,
    "fp16": {{"enabled": true, "loss_scale": 0, "initial_scale_power": 10,
              "loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": {},
              "min_loss_scale": 1}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "betas": [0.9, 0.99],
                                                "weight_decay": 0.01}}}},
    "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": 0.001,
                   "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}}},
    "zero_optimization": {{"stage": 2, "sub_group_size": 1024,
                           "offload_optimizer": {{"device": "nvme", "nvme_path": "{}/swap"}}}},
    "zinf": {{"swap_gradients": {}, "optimizer_state": "{}", "adam_threads": 1,
              "keep_swap": false, "checkpoint": {{"dir": "{}/ckpt"}}}}
  }})",
                     c.gas, c.consecutive ? "true" : "false", dir,
                     c.swap_gradients ? "true" : "false", c.state, dir);
}

// Every regular file under `root` with its bytes.
std::map<std::string, std::string> Snapshot(const std::string& root) {
  std::map<std::string, std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files[entry.path().string()] = {std::istreambuf_iterator<char>(in), {}};
  }
  return files;
}

// DeepSpeed's WarmupLR (linear, 0.001 to 0.01 over 4) for the `applied`-th applied step (the
// scheduler's last_batch_iteration is applied - 2; its constructor set the first step's lr).
double RefLr(std::int64_t applied) {
  const double i = static_cast<double>(std::max<std::int64_t>(applied - 2, 0));
  return i < 4 ? 0.001 + (0.01 - 0.001) * i / 4 : 0.01;
}

// Data parallel AdamW in double over every rank's unscaled gradient, with the clip of the
// global norm, for the steps the reference scaler does not skip.
class RefAdam {
 public:
  explicit RefAdam(const Model& m) {
    for (const auto& w : m.w) {
      p_.emplace_back(w.begin(), w.end());
      m_.emplace_back(w.size(), 0.0);
      v_.emplace_back(w.size(), 0.0);
    }
  }
  // Returns the global norm of the averaged gradient.
  double Step(std::int64_t step, std::int64_t applied, int gas, int world) {
    std::vector<std::vector<double>> grad;
    double squared = 0;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      grad.emplace_back(p_[i].size(), 0.0);
      for (std::size_t k = 0; k < p_[i].size(); ++k) {
        for (int r = 0; r < world; ++r)
          for (int m = 0; m < gas; ++m) grad[i][k] += GradOf(i, k, r, step, m);
        grad[i][k] /= gas * world;
        squared += grad[i][k] * grad[i][k];
      }
    }
    const double norm = std::sqrt(squared);
    const double clip = norm > 0.05 ? 0.05 / (norm + 1e-6) : 1.0;
    const double lr = RefLr(applied);
    const double bc1 = 1 - std::pow(0.9, static_cast<double>(applied));
    const double bc2 = 1 - std::pow(0.99, static_cast<double>(applied));
    for (std::size_t j = 0; j < p_.size(); ++j) {
      for (std::size_t k = 0; k < p_[j].size(); ++k) {
        const double g = grad[j][k] * clip;
        double& p = p_[j][k];
        p *= 1 - lr * 0.01;
        m_[j][k] = 0.9 * m_[j][k] + 0.1 * g;
        v_[j][k] = 0.99 * v_[j][k] + 0.01 * g * g;
        p -= lr / bc1 * m_[j][k] / (std::sqrt(v_[j][k]) / std::sqrt(bc2) + 1e-8);
      }
    }
    return norm;
  }
  const std::vector<double>& weights(std::size_t i) const { return p_[i]; }

 private:
  std::vector<std::vector<double>> p_, m_, v_;
};

// One step of the user's loop: gradients of the loss times the engine's scale (so an element
// beyond fp16's range would overflow in a real fp16 backward pass; here the overflow is injected).
Result<StepInfo> RunStep(ZeroEngine& engine, Model& model, const Fp16Case& c, std::int64_t step) {
  const int rank = World().rank();
  const double scale = engine.loss_scale();
  for (int m = 0; m < c.gas; ++m) {
    for (std::size_t i = 0; i < model.w.size(); ++i) {
      for (std::size_t k = 0; k < model.w[i].size(); ++k) {
        model.g[i][k] += static_cast<float>(GradOf(i, k, rank, step, m) * scale);
      }
    }
    if (kOverflowSteps.contains(step) && rank == step % World().size() && m == c.gas - 1) {
      model.g[step % 3][static_cast<std::size_t>(step) % 7] =
          step % 2 == 0 ? std::numeric_limits<float>::infinity()
                        : std::numeric_limits<float>::quiet_NaN();
    }
    if (m + 1 < c.gas) ZINF_RETURN_IF_ERROR(engine.AccumulateGradients());
  }
  return engine.Step(0.5);
}

class Fp16Engine : public ::testing::TestWithParam<Fp16Case> {};

TEST_P(Fp16Engine, ScalesAndSkipsExactlyAsTheReference) {
  const Fp16Case& c = GetParam();
  SharedScratchDir dir("fp16");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config,
                            config::ParseConfig(ConfigText(c, dir.path()), config::ContextOf(World())));
  const EngineOptions options{.progress = false, .stop_signals = false, .create_nvme_paths = true};
  Model model;
  RefAdam adam(model);
  RefScaler ref{.scale = 1024,
                .window = 3,
                .delayed_shift = 2,
                .hysteresis = 2,
                .consecutive = c.consecutive,
                .min_scale = 1};
  std::vector<double> scales;  // the reference's scale before each step, for the resume below
  std::vector<std::int64_t> skipped_by_step;
  std::int64_t skipped = 0;
  std::vector<std::vector<float>> weights_at_save;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, model.Params(), options));
    for (std::int64_t step = 1; step <= kSteps; ++step) {
      SCOPED_TRACE(fmt::format("step {}", step));
      const bool overflow = kOverflowSteps.contains(step);
      scales.push_back(ref.scale);
      EXPECT_EQ(engine->loss_scale(), ref.scale);
      const std::vector<std::vector<float>> before = model.w;
      // The swap store is the same on every rank's view only for its own files: each rank
      // compares its own.
      const auto files_before = overflow ? Snapshot(dir.Join("swap")) : decltype(Snapshot(""))();
      ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(*engine, model, c, step));
      EXPECT_EQ(info.skipped, overflow);
      EXPECT_EQ(info.loss_scale, ref.scale);
      ASSERT_TRUE(ref.Update(overflow));
      EXPECT_EQ(info.next_loss_scale, ref.scale);
      skipped += overflow ? 1 : 0;
      EXPECT_EQ(info.skipped_steps, skipped);
      EXPECT_EQ(engine->skipped_steps(), skipped);
      EXPECT_EQ(engine->step_count(), step);
      if (overflow) {
        EXPECT_EQ(info.optimizer_swap_read_bytes, 0u);
        EXPECT_EQ(info.optimizer_swap_write_bytes, 0u);
        if (!c.swap_gradients) {  // the gradient swapper's own write-behind and norm read aside
          EXPECT_EQ(info.swap_read_bytes, 0u);
          EXPECT_EQ(info.swap_write_bytes, 0u);
        }
        EXPECT_EQ(model.w, before);
        if (!c.swap_gradients) {
          EXPECT_TRUE(Snapshot(dir.Join("swap")) == files_before)
              << "a skipped step changed the swap store";
        }
      } else {
        const double norm = adam.Step(step, step - skipped, c.gas, World().size());
        EXPECT_NEAR(info.grad_norm, norm, 1e-6 * norm);
        EXPECT_TRUE(info.clipped);
        EXPECT_NEAR(info.lr, RefLr(step - skipped), 1e-12);
      }
      for (std::size_t i = 0; i < model.w.size(); ++i) {
        for (std::size_t k = 0; k < model.w[i].size(); ++k) {
          // fp16 working weights: within one fp16 rounding of the reference's master weight
          // (q8 moments are not the reference's fp32 ones: their weights only round to fp16).
          const double want = adam.weights(i)[k];
          if (c.state == "fp32") {
            ASSERT_NEAR(model.w[i][k], want, std::abs(want) * 0x1p-10 + 1e-7)
                << model.names[i] << "[" << k << "]";
          }
          ASSERT_EQ(model.w[i][k], static_cast<float>(static_cast<_Float16>(model.w[i][k])));
        }
        EXPECT_TRUE(
            std::all_of(model.g[i].begin(), model.g[i].end(), [](float x) { return x == 0; }));
      }
      if (step == 10) {  // after the scale was halved at step 10
        ZINF_ASSERT_OK(engine->SaveCheckpoint());
        weights_at_save = model.w;
      }
      skipped_by_step.push_back(skipped);
    }
    ZINF_ASSERT_OK(engine->Close());
  }
  // The checkpoint of step 10 resumes with its scale, hysteresis and skipped steps: the rest of
  // the run repeats exactly.
  Model resumed;
  EngineOptions resume = options;
  resume.load = "latest";
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), config, resumed.Params(), resume));
  EXPECT_EQ(engine->step_count(), 10);
  EXPECT_EQ(resumed.w, weights_at_save);
  EXPECT_EQ(engine->skipped_steps(), skipped_by_step[9]);
  for (std::int64_t step = 11; step <= kSteps; ++step) {
    SCOPED_TRACE(fmt::format("resumed step {}", step));
    EXPECT_EQ(engine->loss_scale(), scales[static_cast<std::size_t>(step - 1)]);
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(*engine, resumed, c, step));
    EXPECT_EQ(info.skipped, kOverflowSteps.contains(step));
    EXPECT_EQ(info.skipped_steps, skipped_by_step[static_cast<std::size_t>(step - 1)]);
  }
  // Bitwise: the same world size and the same steps give the same bits.
  EXPECT_EQ(resumed.w, model.w);
  ZINF_ASSERT_OK(engine->Close());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Fp16Engine,
    ::testing::Values(
        Fp16Case{.name = "Dynamic"},
        Fp16Case{.name = "ConsecutiveHysteresisAccumulated", .gas = 2, .consecutive = true},
        Fp16Case{.name = "SwapGradients", .gas = 2, .swap_gradients = true},
        Fp16Case{.name = "Q8State", .state = "q8"}),
    [](const ::testing::TestParamInfo<Fp16Case>& param) { return param.param.name; });

// An overflow at min_loss_scale with the hysteresis spent stops the run (DeepSpeed raises), on
// every rank, with nothing stepped; a static scale skips the step and keeps its scale.
TEST(Fp16EngineErrors, OverflowAtTheMinimumScaleAndStaticScale) {
  SharedScratchDir dir("fp16-min");
  const EngineOptions options{.progress = false, .stop_signals = false, .create_nvme_paths = true};
  for (const bool dynamic : {true, false}) {
    const char* fp16 = dynamic ? R"({"enabled": true, "initial_scale_power": 0, "hysteresis": 1,
                                     "min_loss_scale": 1})"
                               : R"({"enabled": true, "loss_scale": 8})";
    const std::string text = fmt::format(
        R"({{"train_micro_batch_size_per_gpu": 1, "fp16": {},
             "zero_optimization": {{"offload_optimizer": {{"device": "nvme",
                                                          "nvme_path": "{}/swap"}}}},
             "zinf": {{"adam_threads": 1}}}})",
        fp16, dir.path());
    ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, config::ParseConfig(text, config::ContextOf(World())));
    Model model;
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), config, model.Params(), options));
    EXPECT_EQ(engine->loss_scale(), dynamic ? 1.0 : 8.0);
    const std::vector<std::vector<float>> before = model.w;
    for (auto& g : model.g) std::fill(g.begin(), g.end(), 0.25f);
    if (World().rank() == World().size() - 1)
      model.g[1][3] = std::numeric_limits<float>::infinity();
    if (dynamic) {
      EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition,
                                           HasSubstr("overflowed at the minimum loss scale 1")));
      EXPECT_EQ(engine->step_count(), 0);
    } else {
      ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, engine->Step());
      EXPECT_TRUE(info.skipped);
      EXPECT_EQ(info.next_loss_scale, 8.0);
    }
    EXPECT_EQ(model.w, before);
    ZINF_ASSERT_OK(engine->Close());
  }
}

}  // namespace
}  // namespace zinf::engine
