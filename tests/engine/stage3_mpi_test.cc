// ZeRO stage 3 parameter partitioning (engine/include/zinf/engine/engine.h, "Stage 3") on 1-4
// ranks. A model registered without weights and without gradients, whose loop gathers each
// layer's weights and hands each gradient as soon as it has computed it from them, against the
// same model registered with its weights and gradients in a second engine (stage 1, or stage 3
// where the optimizer state must be cut into the same sub-groups); Gather's counters (prefetch,
// reuse, the live limit, persistent parameters), its errors, and checkpoints between the two
// ways of registering the model.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "gather_counters.h"
#include "test_gradient.h"

namespace zinf::engine {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;
using ::zinf::engine::testing::Delta;
using ::zinf::engine::testing::Show;

// zero_optimization.stage3_param_persistence_threshold of every test: parameters above it are
// partitioned, those at or below it stay whole on every rank.
constexpr std::uint64_t kPersistence = 1000;
// Results of two partition plans (another reduction split, other sub-groups) agree to this,
// relative to the tensor's largest value.
constexpr double kRelTol = 1e-6;
// Written over the gradient buffer as soon as GradientReady returns: an engine that read the
// buffer later would step with it.
constexpr float kGarbage = 1e3f;

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
};

// Three layers of two parameters each: a weight above kPersistence (partitioned) and a smaller
// one (persistent; fc1.bias exactly at the threshold). Odd sizes, so that shards and sub-groups
// of 4096 elements cut parameters on every world size.
const std::vector<Spec>& Specs() {
  static const std::vector<Spec> specs = {{"embed.weight", {7, 143}},      // 1001
                                          {"embed.norm", {70}},            //
                                          {"fc1.weight", {97, 101}},       // 9797
                                          {"fc1.bias", {1000}},            // at the threshold
                                          {"head.weight", {3, 5, 7, 89}},  // 9345
                                          {"head.bias", {13}}};
  return specs;
}
constexpr std::size_t kNumParams = 6;
constexpr std::size_t kMaxNumel = 9797;
constexpr std::uint64_t kPartitionedNumel = 1001 + 9797 + 9345;
// Per step of RunLentStep (one micro-batch): a forward and a backward Gather per layer.
constexpr std::uint64_t kCallsPerStep = 6;
constexpr std::uint64_t kPartitionedAsksPerStep = 6;
constexpr std::uint64_t kPersistentAsksPerStep = 6;

std::uint64_t Numel(std::size_t param) {
  std::uint64_t n = 1;
  for (std::int64_t d : Specs()[param].shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

const std::vector<std::string>& AllNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (const Spec& spec : Specs()) all.push_back(spec.name);
    return all;
  }();
  return names;
}

// Element k of parameter `param` before the first step.
float InitValue(std::size_t param, std::uint64_t k) {
  return 0.5f * static_cast<float>(std::sin(0.1 * static_cast<double>(k) + 1.7 * param));
}

std::vector<float> InitValues(std::size_t param) {
  std::vector<float> w(Numel(param));
  for (std::uint64_t k = 0; k < w.size(); ++k) w[k] = InitValue(param, k);
  return w;
}

using testing::GradOf;

// The model registered the stage 1/2 way: weights and gradients in the loop's buffers.
struct Model {
  std::vector<std::vector<float>> w, g;

  std::vector<Param> Params() {
    std::vector<Param> params;
    for (std::size_t i = 0; i < kNumParams; ++i)
      params.push_back({Specs()[i].name, Specs()[i].shape, w[i], g[i]});
    return params;
  }
};

// `zero`: weights of 0, for a restore to overwrite.
Model MakeModel(bool zero = false) {
  Model m;
  for (std::size_t i = 0; i < kNumParams; ++i) {
    m.w.push_back(zero ? std::vector<float>(Numel(i), 0.0f) : InitValues(i));
    m.g.emplace_back(Numel(i), 0.0f);
  }
  return m;
}

// The elements each parameter's `init` was asked for on this rank.
struct InitLog {
  std::vector<std::vector<std::int32_t>> asked;
  std::atomic<bool> out_of_range{false};

  InitLog() {
    for (std::size_t i = 0; i < kNumParams; ++i) asked.emplace_back(Numel(i), 0);
  }
};

// How the stage-3 loop registers the model: no buffers (the gradients lent), `init` filling
// InitValue.
struct Lent {
  std::shared_ptr<InitLog> log = nullptr;
  bool init = true;                                   // false: no parameter has one (a restore)
  std::optional<std::size_t> no_init = std::nullopt;  // this parameter has none
  // This parameter is registered with `weights` instead (the gradients stay lent).
  std::optional<std::size_t> with_weights = std::nullopt;
  std::span<float> weights = {};
};

std::vector<Param> LentParams(const Lent& lent = {}) {
  std::vector<Param> params;
  for (std::size_t i = 0; i < kNumParams; ++i) {
    Param p{.name = Specs()[i].name, .shape = Specs()[i].shape};
    if (lent.with_weights == i) {
      p.weights = lent.weights;
    } else if (lent.init && lent.no_init != i) {
      p.init = [i, log = lent.log](std::uint64_t offset, std::span<float> out) -> Status {
        if (offset + out.size() > Numel(i)) {
          if (log) log->out_of_range = true;
          return InvalidArgumentError(
              fmt::format("init of {} asked for [{}, {})", i, offset, offset + out.size()));
        }
        for (std::size_t j = 0; j < out.size(); ++j) {
          out[j] = InitValue(i, offset + j);
          if (log) log->asked[i][offset + j] = 1;
        }
        return OkStatus();
      };
    }
    params.push_back(std::move(p));
  }
  return params;
}

// What a test's engine is configured with.
struct Setup {
  int stage = 3;
  int gas = 1;
  std::string optimizer_state = "fp32";
  std::string offload_optimizer = "nvme";
  std::string offload_param = "none";
  std::optional<std::uint64_t> max_in_cpu = std::nullopt;
  std::optional<std::uint64_t> buffer_size = std::nullopt;  // offload_param's
  std::optional<std::uint64_t> prefetch_bucket = std::nullopt;
  std::optional<std::uint64_t> max_live = std::nullopt;
  std::uint64_t persistence = kPersistence;
  std::optional<std::uint64_t> model_persistence = std::nullopt;
  double clipping = 0;  // gradient_clipping
  // Two engines alive in one process need distinct swap stores (the derived job id is the same
  // for the same parameters).
  std::string job_id = "lent";
};

Result<config::Config> MakeConfig(const Setup& s, const SharedScratchDir& dir) {
  const std::string swap = dir.Join("swap");
  nlohmann::json offload_optimizer = {{"device", s.offload_optimizer}};
  if (s.offload_optimizer == "nvme") offload_optimizer["nvme_path"] = swap;
  nlohmann::json offload_param = {{"device", s.offload_param}};
  if (s.offload_param == "nvme") offload_param["nvme_path"] = swap;
  if (s.max_in_cpu) offload_param["max_in_cpu"] = *s.max_in_cpu;
  if (s.buffer_size) offload_param["buffer_size"] = *s.buffer_size;
  nlohmann::json zero = {{"stage", s.stage},
                         {"sub_group_size", 4096},
                         {"reduce_bucket_size", 3000},
                         {"allgather_bucket_size", 5000},
                         {"offload_optimizer", offload_optimizer},
                         {"offload_param", offload_param},
                         {"stage3_param_persistence_threshold", s.persistence}};
  if (s.prefetch_bucket) zero["stage3_prefetch_bucket_size"] = *s.prefetch_bucket;
  if (s.max_live) zero["stage3_max_live_parameters"] = *s.max_live;
  if (s.model_persistence) zero["stage3_model_persistence_threshold"] = *s.model_persistence;
  const nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", s.gas},
      {"gradient_clipping", s.clipping},
      {"steps_per_print", 1000},
      {"optimizer",
       {{"type", "Adam"},
        {"params",
         {{"lr", 0.01},
          {"betas", nlohmann::json::array({0.9, 0.99})},
          {"eps", 1e-8},
          {"weight_decay", 0.01},
          {"adam_w_mode", true}}}}},
      {"scheduler",
       {{"type", "WarmupLR"},
        {"params",
         {{"warmup_min_lr", 0.001},
          {"warmup_max_lr", 0.01},
          {"warmup_num_steps", 3},
          {"warmup_type", "linear"}}}}},
      {"zero_optimization", zero},
      // A hang in one of the engine's collectives ends the job well inside the test's timeout.
      {"zinf",
       {{"adam_threads", 1},
        {"optimizer_state", s.optimizer_state},
        {"job_id", s.job_id},
        {"collective_timeout_seconds", 60},
        {"checkpoint", {{"dir", dir.Join("ckpt")}}}}}};
  return config::ParseConfig(config.dump(), config::ContextOf(World()));
}

const EngineOptions kOptions = {
    .progress = false, .stop_signals = false, .create_nvme_paths = true};

// The worst element of `got` against `want`, within kRelTol of the tensor's largest |want|.
void ExpectWeightsNear(std::span<const float> got, std::span<const float> want,
                       std::string_view what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst_err = -1;
  std::size_t worst = 0;
  for (std::size_t k = 0; k < want.size(); ++k) {
    scale = std::max(scale, std::abs(static_cast<double>(want[k])));
    const double err = std::abs(static_cast<double>(got[k]) - want[k]);
    if (std::isnan(got[k])) {
      worst = k;
      break;
    }
    if (err > worst_err) {
      worst_err = err;
      worst = k;
    }
  }
  if (want.empty()) return;
  EXPECT_NEAR(got[worst], want[worst], kRelTol * std::max(scale, 1e-30))
      << what << ", element " << worst << " of " << want.size();
}

// The whole model, gathered in one call.
Result<std::vector<std::vector<float>>> GatherAll(ZeroEngine& engine) {
  ZINF_ASSIGN_OR_RETURN(Gathered all, engine.Gather(std::span<const std::string>(AllNames())));
  if (all.size() != kNumParams) {
    return InternalError(fmt::format("Gather of every parameter gave {}", all.size()));
  }
  std::vector<std::vector<float>> weights;
  for (std::size_t i = 0; i < kNumParams; ++i) weights.emplace_back(all[i].begin(), all[i].end());
  return weights;
}

void ExpectModelNear(const std::vector<std::vector<float>>& got,
                     const std::vector<std::vector<float>>& want, std::string_view what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ExpectWeightsNear(got[i], want[i], fmt::format("{}: {}", what, Specs()[i].name));
}

void ExpectGatheredNear(ZeroEngine& engine, const std::vector<std::vector<float>>& want,
                        std::string_view what) {
  Result<std::vector<std::vector<float>>> got = GatherAll(engine);
  ASSERT_TRUE(got.has_value()) << what << ": " << got.error().ToString();
  ExpectModelNear(*got, want, what);
}

// The layers the forward pass visits, in order; the backward pass visits them reversed.
using Order = std::vector<std::size_t>;
const Order kForward = {0, 1, 2};
const Order kChanged = {2, 0, 1};

// One step of the stage-3 loop. Per micro-batch: a forward pass that gathers each layer by name
// (and with `want` checks its weights against the registered model's, which has not stepped
// yet), then a backward pass that gathers the layers again in reverse by index and hands each
// parameter's gradient, computed from the gathered weights, last parameter first, out of one
// scratch buffer that is overwritten as soon as GradientReady returns.
Result<StepInfo> RunLentStep(ZeroEngine& engine, std::int64_t step, int gas,
                             const Order& order = kForward, const Model* want = nullptr) {
  const int rank = World().rank();
  std::vector<float> scratch(kMaxNumel);
  for (int micro = 0; micro < gas; ++micro) {
    for (std::size_t layer : order) {
      const std::vector<std::string> names = {Specs()[2 * layer].name, Specs()[2 * layer + 1].name};
      ZINF_ASSIGN_OR_RETURN(Gathered gathered, engine.Gather(std::span<const std::string>(names)));
      if (want == nullptr) continue;
      for (std::size_t j = 0; j < names.size(); ++j) {
        ExpectWeightsNear(gathered[j], want->w[2 * layer + j],
                          fmt::format("step {} micro-batch {}, forward {}", step, micro, names[j]));
      }
    }
    for (auto layer = order.rbegin(); layer != order.rend(); ++layer) {
      const std::array<std::size_t, 2> params = {2 * *layer, 2 * *layer + 1};
      ZINF_ASSIGN_OR_RETURN(Gathered gathered, engine.GatherByIndex(params));
      for (std::size_t j = params.size(); j-- > 0;) {
        const std::size_t i = params[j];
        const std::span<const float> w = gathered[j];
        if (w.size() != Numel(i)) {
          return InternalError(fmt::format("gathered {} has {} elements, not {}", Specs()[i].name,
                                           w.size(), Numel(i)));
        }
        const std::span<float> grad(scratch.data(), w.size());
        for (std::size_t k = 0; k < w.size(); ++k) grad[k] = GradOf(i, k, rank, step, micro, w[k]);
        ZINF_RETURN_IF_ERROR(engine.GradientReady(i, grad));
        std::fill(grad.begin(), grad.end(), kGarbage);
      }
    }
    if (micro + 1 < gas) ZINF_RETURN_IF_ERROR(engine.AccumulateGradients());
  }
  return engine.Step(1.0 + rank);
}

// The same step for the registered model: the gradients at its weights, summed in its buffers.
Result<StepInfo> RunRegisteredStep(ZeroEngine& engine, Model& model, std::int64_t step, int gas) {
  const int rank = World().rank();
  for (int micro = 0; micro < gas; ++micro) {
    for (std::size_t i = kNumParams; i-- > 0;) {
      for (std::size_t k = 0; k < model.w[i].size(); ++k) {
        model.g[i][k] += GradOf(i, k, rank, step, micro, model.w[i][k]);
      }
    }
    if (micro + 1 < gas) ZINF_RETURN_IF_ERROR(engine.AccumulateGradients());
  }
  return engine.Step(1.0 + rank);
}

// A constant gradient for every parameter, handed last parameter first (no gathering).
Status HandConstantGradients(ZeroEngine& engine, float value = 0.25f) {
  std::vector<float> grad;
  for (std::size_t i = kNumParams; i-- > 0;) {
    grad.assign(Numel(i), value);
    ZINF_RETURN_IF_ERROR(engine.GradientReady(i, grad));
  }
  return OkStatus();
}

// Every ask is either served without an all-gather or all-gathered on demand; the other
// all-gathers are the prefetches (used later, or not). And every rank counts the same, but for
// the reads it waited for (a matter of timing).
void ExpectCountersConsistent(const GatherCounters& c) {
  EXPECT_LE(c.prefetched, c.gathered) << Show(c);
  EXPECT_EQ(c.asked, c.served + (c.gathered - c.prefetched)) << Show(c);
  EXPECT_LE(c.read_ahead, c.disk_reads) << Show(c);
  EXPECT_LE(c.disk_waits, c.disk_reads) << Show(c);
  EXPECT_GE(c.disk_waits, c.disk_reads - c.read_ahead) << Show(c);
  std::array<std::uint64_t, 8> values = {c.calls,  c.asked,      c.gathered,   c.prefetched,
                                         c.served, c.disk_reads, c.read_ahead, c.peak_live_elems};
  std::array<std::uint64_t, 8> lowest = values, highest = values;
  ZINF_ASSERT_OK(World().AllreduceInPlace<std::uint64_t>(lowest, comm::ReduceOp::kMin));
  ZINF_ASSERT_OK(World().AllreduceInPlace<std::uint64_t>(highest, comm::ReduceOp::kMax));
  EXPECT_EQ(lowest, highest) << "counters differ between ranks; this rank's: " << Show(c);
}

// `init` was asked, over all ranks, for each element of a partitioned parameter on exactly one
// rank. For a persistent one the header says every rank is asked for all of it; the engine asks
// only the rank that owns each element (and gathers the rest), which serves as well: either is
// accepted, nothing else (an element nobody filled, or filled by some ranks only).
void ExpectInitAskedOwnElements(const InitLog& log, const std::vector<bool>& partitioned) {
  EXPECT_FALSE(log.out_of_range);
  for (std::size_t i = 0; i < kNumParams; ++i) {
    std::vector<std::int32_t> ranks = log.asked[i];
    ZINF_ASSERT_OK(World().AllreduceInPlace<std::int32_t>(ranks, comm::ReduceOp::kSum));
    const std::int32_t all = partitioned[i] ? 1 : World().size();
    const auto wrong = std::find_if(ranks.begin(), ranks.end(),
                                    [all](std::int32_t n) { return n != 1 && n != all; });
    EXPECT_TRUE(wrong == ranks.end()) << Specs()[i].name << ": element " << (wrong - ranks.begin())
                                      << " asked on " << *wrong << " ranks, want 1 or " << all;
  }
}

// ---------------------------------------------------------------------------------------------
// 1. The partitioned model steps as the registered one does.

struct ExactCase {
  std::string name;
  std::string optimizer_state = "fp32";
  std::string offload_optimizer = "nvme";
  std::string offload_param = "none";
  std::optional<std::uint64_t> max_in_cpu = std::nullopt;
  int gas = 1;
  std::uint64_t persistence = kPersistence;
  std::optional<std::uint64_t> model_persistence = std::nullopt;
  std::vector<bool> partitioned = {true, false, true, false, true, false};
  // The registered model's stage: 1 (flat plan), or 3 where the optimizer state must be cut into
  // the same sub-groups (q8's block scales follow the cuts, so other cuts round differently).
  int registered_stage = 1;
};

void PrintTo(const ExactCase& c, std::ostream* os) { *os << c.name; }

class Stage3MatchesRegisteredModel : public ::testing::TestWithParam<ExactCase> {};

// Below the gradient norms of every case (about 23): every step is clipped, each by its own
// factor.
constexpr double kClipping = 20;

TEST_P(Stage3MatchesRegisteredModel, ForTenStepsWithClipping) {
  const ExactCase& c = GetParam();
  SharedScratchDir dir("stage3");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config,
                            MakeConfig({.gas = c.gas,
                                        .optimizer_state = c.optimizer_state,
                                        .offload_optimizer = c.offload_optimizer,
                                        .offload_param = c.offload_param,
                                        .max_in_cpu = c.max_in_cpu,
                                        .persistence = c.persistence,
                                        .model_persistence = c.model_persistence,
                                        .clipping = kClipping},
                                       dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = c.registered_stage,
                                        .gas = c.gas,
                                        .optimizer_state = c.optimizer_state,
                                        .offload_optimizer = c.offload_optimizer,
                                        .clipping = kClipping,
                                        .job_id = "registered"},
                                       dir));
  auto log = std::make_shared<InitLog>();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto engine, ZeroEngine::Create(World(), lent_config, LentParams({.log = log}), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  EXPECT_EQ(engine->num_partitioned_params(),
            static_cast<std::size_t>(std::count(c.partitioned.begin(), c.partitioned.end(), true)));
  ExpectInitAskedOwnElements(*log, c.partitioned);
  ExpectGatheredNear(*engine, model.w, "initial");
  int clipped = 0;
  for (std::int64_t step = 1; step <= 10; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunLentStep(*engine, step, c.gas));
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo want, RunRegisteredStep(*registered, model, step, c.gas));
    clipped += info.clipped ? 1 : 0;
    EXPECT_EQ(info.clipped, want.clipped);
    EXPECT_EQ(info.step, step);
    EXPECT_EQ(info.lr, want.lr);
    EXPECT_NEAR(info.grad_norm, want.grad_norm, kRelTol * want.grad_norm);
    EXPECT_NEAR(info.loss, want.loss, 1e-12);
    ExpectGatheredNear(*engine, model.w, fmt::format("after step {}", step));
  }
  EXPECT_GT(clipped, 0) << "gradient_clipping " << kClipping << " clipped no step";
  const GatherCounters& counters = engine->gather_counters();
  ExpectCountersConsistent(counters);
  if (c.offload_param == "nvme") {
    // Each all-gather of a shard not kept in memory reads it from the swap store.
    EXPECT_GT(counters.disk_reads, 0u) << Show(counters);
    if (c.max_in_cpu == 0u) {
      EXPECT_EQ(counters.disk_reads, counters.gathered) << Show(counters);
      // From step 2 on, the shards of the recorded order are read ahead (the values are
      // checked above, after every step).
      EXPECT_GT(counters.read_ahead, 0u) << Show(counters);
    } else {
      EXPECT_LT(counters.disk_reads, counters.gathered) << Show(counters);
    }
  } else {
    EXPECT_EQ(counters.disk_reads, 0u) << Show(counters);
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(registered->Close());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Stage3MatchesRegisteredModel,
    ::testing::Values(
        ExactCase{.name = "Fp32Nvme"},
        ExactCase{.name = "Q8Nvme", .optimizer_state = "q8", .registered_stage = 3},
        ExactCase{.name = "Fp32Cpu", .offload_optimizer = "cpu"},
        ExactCase{.name = "AccumulateGradients", .gas = 2},
        // The shards read from the optimizer's swap store: none kept in memory, or only
        // embed.weight's (at most 1001 elements, 1024 padded, on every world size; the next
        // shard, fc1.weight's, has at least 2450).
        ExactCase{.name = "ParamNvmeNothingInMemory", .offload_param = "nvme", .max_in_cpu = 0},
        ExactCase{.name = "ParamNvmeSomeInMemory", .offload_param = "nvme", .max_in_cpu = 1024},
        ExactCase{.name = "ParamNvmeQ8Accumulate",
                  .optimizer_state = "q8",
                  .offload_param = "nvme",
                  .max_in_cpu = 0,
                  .gas = 2,
                  .registered_stage = 3},
        // No parameter is persistent: head.bias (13 elements) has one shard holding all of it,
        // and the other ranks own none of it.
        ExactCase{.name = "NothingPersistent",
                  .persistence = 0,
                  .partitioned = {true, true, true, true, true, true}},
        // embed.norm (70) and fc1.bias (1000) fill the model's 1070; head.bias would pass it.
        ExactCase{.name = "ModelPersistenceLimit",
                  .model_persistence = 1070,
                  .partitioned = {true, false, true, false, true, true}}),
    [](const ::testing::TestParamInfo<ExactCase>& param) { return param.param.name; });

// ---------------------------------------------------------------------------------------------
// 2. Prefetch, reuse and the live limit.

// RunLentStep's gathers repeated step after step: the first step gathers each ask on demand,
// the later ones gather each partitioned parameter once, at its first ask or ahead of it, and
// serve the other asks. A step in another order is still right, and the order after it is
// recorded anew.
TEST(Stage3Prefetch, RepeatedOrderIsGatheredAhead) {
  SharedScratchDir dir("stage3-prefetch");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({.prefetch_bucket = 1'000'000}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), lent_config, LentParams(), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  for (std::int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const Order& order = step >= 5 ? kChanged : kForward;
    const GatherCounters before = engine->gather_counters();
    ZINF_ASSERT_OK(RunLentStep(*engine, step, 1, order, &model));
    ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, step, 1));
    const GatherCounters& now = engine->gather_counters();
    const GatherCounters d = Delta(now, before);
    EXPECT_EQ(d.calls, kCallsPerStep) << Show(d);
    EXPECT_EQ(d.asked, kPartitionedAsksPerStep + kPersistentAsksPerStep) << Show(d);
    if (step == 1) {
      EXPECT_EQ(d.prefetched, 0u) << Show(d);
      EXPECT_EQ(d.gathered, kPartitionedAsksPerStep) << Show(d);
      EXPECT_EQ(d.served, kPersistentAsksPerStep) << Show(d);
    } else if (step != 5) {
      // The first ask is gathered on demand with the rest of the order ahead of it (the bucket
      // holds them all); the backward pass finds them kept for reuse.
      EXPECT_GT(d.prefetched, 0u) << Show(d);
      EXPECT_EQ(d.gathered, 3u) << Show(d);
      EXPECT_EQ(d.served, kPersistentAsksPerStep + kPartitionedAsksPerStep - 1) << Show(d);
    }
    ExpectCountersConsistent(now);
  }
  ExpectGatheredNear(*engine, model.w, "after 6 steps");
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(registered->Close());
}

class Stage3NoPrefetch : public ::testing::TestWithParam<std::uint64_t> {};

// A bucket of 0 elements, or of 1 (no parameter fits), prefetches nothing.
TEST_P(Stage3NoPrefetch, PrefetchesNothing) {
  SharedScratchDir dir("stage3-noprefetch");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({.prefetch_bucket = GetParam()}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), lent_config, LentParams(), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  for (std::int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    ZINF_ASSERT_OK(RunLentStep(*engine, step, 1, kForward, &model));
    ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, step, 1));
    EXPECT_EQ(engine->gather_counters().prefetched, 0u) << Show(engine->gather_counters());
    EXPECT_EQ(engine->gather_counters().calls, kCallsPerStep * static_cast<std::uint64_t>(step));
  }
  ExpectCountersConsistent(engine->gather_counters());
  ExpectGatheredNear(*engine, model.w, "after 4 steps");
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(registered->Close());
}

INSTANTIATE_TEST_SUITE_P(Buckets, Stage3NoPrefetch, ::testing::Values(0u, 1u));

// stage3_max_live_parameters 20000 holds fc1.weight and head.weight (19142 elements) but not all
// three partitioned parameters (20143), which the same loop without the limit has gathered at
// once (prefetched and kept for reuse). No single ask is above the limit.
TEST(Stage3Prefetch, LiveElementsStayWithinTheLimit) {
  constexpr std::uint64_t kLimit = 20'000;
  SharedScratchDir dir("stage3-live");
  ZINF_ASSERT_OK_AND_ASSIGN(
      config::Config limited_config,
      MakeConfig({.prefetch_bucket = 1'000'000, .max_live = kLimit, .job_id = "limited"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config unlimited_config,
                            MakeConfig({.prefetch_bucket = 1'000'000, .job_id = "unlimited"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto limited,
                            ZeroEngine::Create(World(), limited_config, LentParams(), kOptions));
  ZINF_ASSERT_OK_AND_ASSIGN(auto unlimited,
                            ZeroEngine::Create(World(), unlimited_config, LentParams(), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  for (std::int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    ZINF_ASSERT_OK(RunLentStep(*limited, step, 1, kForward, &model));
    ZINF_ASSERT_OK(RunLentStep(*unlimited, step, 1, kForward, &model));
    ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, step, 1));
    EXPECT_LE(limited->gather_counters().peak_live_elems, kLimit)
        << Show(limited->gather_counters());
  }
  EXPECT_GT(limited->gather_counters().peak_live_elems, 0u);
  EXPECT_GE(unlimited->gather_counters().peak_live_elems, kPartitionedNumel)
      << Show(unlimited->gather_counters());
  ExpectCountersConsistent(limited->gather_counters());
  ExpectCountersConsistent(unlimited->gather_counters());
  ExpectGatheredNear(*limited, model.w, "limited, after 4 steps");
  ExpectGatheredNear(*unlimited, model.w, "unlimited, after 4 steps");
  ZINF_EXPECT_OK(limited->Close());
  ZINF_EXPECT_OK(unlimited->Close());
  ZINF_EXPECT_OK(registered->Close());
}

// ---------------------------------------------------------------------------------------------
// 3. Errors: the same on every rank, and the engine goes on where the header says it does.

class Stage3Errors : public ::testing::Test {
 protected:
  void SetUp() override { ZINF_ASSERT_OK_AND_ASSIGN(config_, MakeConfig({}, dir_)); }
  Result<std::unique_ptr<ZeroEngine>> Create(const Lent& lent = {}) {
    return ZeroEngine::Create(World(), config_, LentParams(lent), kOptions);
  }

  SharedScratchDir dir_{"stage3-errors"};
  config::Config config_;
};

TEST_F(Stage3Errors, RanksAskingForDifferentParameters) {
  if (World().size() < 2) GTEST_SKIP() << "needs 2 ranks, have " << World().size();
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create());
  const bool first = World().rank() == 0;
  EXPECT_THAT(first ? engine->Gather({"embed.weight"}) : engine->Gather({"fc1.weight"}),
              StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(
      first ? engine->Gather({"embed.weight", "embed.norm"}) : engine->Gather({"embed.weight"}),
      StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(first ? engine->Gather({"fc1.weight", "fc1.bias"})
                    : engine->Gather({"fc1.bias", "fc1.weight"}),
              StatusIs(ErrorCode::kFailedPrecondition));
  // One rank's bad ask fails every rank alike.
  EXPECT_THAT(first ? engine->Gather({"nope"}) : engine->Gather({"embed.weight"}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("nope")));
  EXPECT_THAT(first ? engine->Gather({"head.bias", "head.bias"}) : engine->Gather({"head.bias"}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("head.bias")));
  // Persistent parameters move nothing, but the ask is agreed all the same.
  EXPECT_THAT(first ? engine->Gather({"embed.norm"}) : engine->Gather({"fc1.bias"}),
              StatusIs(ErrorCode::kFailedPrecondition));
  // The refused asks gathered nothing; an agreed one works.
  ZINF_ASSERT_OK_AND_ASSIGN(Gathered gathered, engine->Gather({"embed.weight"}));
  ExpectWeightsNear(gathered[0], InitValues(0), "embed.weight");
  gathered.Release();
  ZINF_ASSERT_OK(engine->Close());
}

TEST_F(Stage3Errors, UnknownOrRepeatedParameters) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create());
  EXPECT_THAT(engine->Gather({"embed.weight", "nope"}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("nope")));
  EXPECT_THAT(engine->Gather({"fc1.weight", "fc1.weight"}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("fc1.weight")));
  EXPECT_THAT(engine->Gather({"head.bias", "embed.weight", "head.bias"}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("head.bias")));
  const std::array<std::size_t, 1> beyond = {kNumParams};
  EXPECT_THAT(engine->GatherByIndex(beyond), StatusIs(ErrorCode::kInvalidArgument));
  const std::array<std::size_t, 2> twice = {2, 2};
  EXPECT_THAT(engine->GatherByIndex(twice), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_ASSERT_OK(engine->Close());
  EXPECT_THAT(engine->Gather({"embed.weight"}),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("after Close")));
}

// A refused Step still ends the micro-batch (its gradients are consumed, as for any Step that
// fails), so the loop hands them again before the next one.
TEST_F(Stage3Errors, StepWhileAGatheredScopeIsAlive) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create());
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(Gathered held, engine->Gather({"fc1.weight"}));
    EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("Gathered")));
    EXPECT_EQ(engine->step_count(), 0);
    // A moved scope is the same scope; the moved-from one holds nothing.
    Gathered moved = std::move(held);
    EXPECT_EQ(held.size(), 0u);  // NOLINT(bugprone-use-after-move): documented state
    EXPECT_EQ(moved.size(), 1u);
    ZINF_ASSERT_OK(HandConstantGradients(*engine));
    EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("Gathered")));
    moved.Release();
    moved.Release();  // idempotent
  }
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, engine->Step());
  EXPECT_EQ(info.step, 1);

  // One rank's scope refuses every rank's Step.
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(Gathered held, engine->Gather({"head.weight"}));
    if (World().rank() != 0) held.Release();
    EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("Gathered")));
    EXPECT_EQ(engine->step_count(), 1);
  }
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  ZINF_ASSERT_OK(engine->Step());
  EXPECT_EQ(engine->step_count(), 2);

  // A persistent parameter's scope as well: Step writes its weights too.
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(Gathered held, engine->Gather({"head.bias"}));
    EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("Gathered")));
  }
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  ZINF_ASSERT_OK(engine->Step());
  EXPECT_EQ(engine->step_count(), 3);
  ZINF_ASSERT_OK(engine->Close());
}

TEST_F(Stage3Errors, GradientReadyMisuse) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, Create());
  // A gradient of the wrong size, on every rank: refused, and the step fails everywhere.
  std::vector<float> grad(Numel(5) + 1, 0.25f);
  EXPECT_THAT(engine->GradientReady(5, grad), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_EQ(engine->step_count(), 0);
  // The loop goes on with the next micro-batch.
  ZINF_ASSERT_OK(HandConstantGradients(*engine));
  ZINF_ASSERT_OK(engine->Step());
  EXPECT_EQ(engine->step_count(), 1);

  // On rank 0 only (the others hand it right): every rank's step fails.
  grad.assign(Numel(5) - (World().rank() == 0 ? 1 : 0), 0.25f);
  const Status handed = engine->GradientReady(5, grad);
  if (World().rank() == 0) {
    EXPECT_THAT(handed, StatusIs(ErrorCode::kInvalidArgument));
  } else {
    ZINF_EXPECT_OK(handed);
  }
  for (std::size_t i = kNumParams - 1; i-- > 0;) {
    grad.assign(Numel(i), 0.25f);
    ZINF_ASSERT_OK(engine->GradientReady(i, grad));
  }
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_EQ(engine->step_count(), 1);

  // No such parameter.
  grad.assign(Numel(5), 0.25f);
  EXPECT_THAT(engine->GradientReady(kNumParams, grad), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kInvalidArgument));

  // The overload without a gradient, on an engine that has no gradient buffers (the step then
  // fails as well, for that or for a gradient that is zero everywhere).
  EXPECT_THAT(engine->GradientReady(0), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(engine->Step(), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_EQ(engine->step_count(), 1);
  ZINF_ASSERT_OK(engine->Close());

  // And the other way round: a lent gradient for an engine with gradient buffers.
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir_));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  grad.assign(Numel(0), 0.25f);
  EXPECT_THAT(registered->GradientReady(0, grad), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_ASSERT_OK(registered->Close());
}

TEST_F(Stage3Errors, CreateRefusesParametersItCannotFill) {
  // No init and no checkpoint: nothing gives the first values, partitioned or persistent.
  EXPECT_THAT(Create({.no_init = 2}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("fc1.weight")));
  EXPECT_THAT(Create({.no_init = 3}), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("fc1.bias")));

  // Stages 1 and 2 keep every parameter whole in the loop's weights buffers.
  for (int stage : {1, 2}) {
    SCOPED_TRACE(fmt::format("stage {}", stage));
    ZINF_ASSERT_OK_AND_ASSIGN(
        config::Config config, MakeConfig({.stage = stage, .job_id = fmt::format("s{}", stage)}, dir_));
    Model model = MakeModel();
    std::vector<Param> params = model.Params();
    params[2].weights = {};
    params[2].init = [](std::uint64_t, std::span<float> out) -> Status {
      std::fill(out.begin(), out.end(), 0.0f);
      return OkStatus();
    };
    EXPECT_THAT(ZeroEngine::Create(World(), config, params, kOptions),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("fc1.weight")));
    if (stage == 2) {  // gradients may be lent at stage 2, weights not
      EXPECT_THAT(ZeroEngine::Create(World(), config, LentParams(), kOptions),
                  StatusIs(ErrorCode::kInvalidArgument));
    }
  }

  // offload_param nvme with nothing to partition: every parameter registered with weights.
  ZINF_ASSERT_OK_AND_ASSIGN(
      config::Config nvme_config,
      MakeConfig({.offload_param = "nvme", .max_in_cpu = 0, .job_id = "nvme"}, dir_));
  Model model = MakeModel();
  EXPECT_THAT(ZeroEngine::Create(World(), nvme_config, model.Params(), kOptions),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("offload_param")));
  // A shard to read from NVMe larger than offload_param.buffer_size (fc1.weight's has at least
  // 2450 elements on 4 ranks).
  ZINF_ASSERT_OK_AND_ASSIGN(
      config::Config small_buffer_config,
      MakeConfig({.offload_param = "nvme", .max_in_cpu = 0, .buffer_size = 2000, .job_id = "nvme"},
                 dir_));
  EXPECT_THAT(ZeroEngine::Create(World(), small_buffer_config, LentParams(), kOptions),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("buffer_size")));
}

// ---------------------------------------------------------------------------------------------
// 4. Checkpoints between the partitioned and the registered model.

// A partitioned run's checkpoint restores into registered weights (stage 1): the weights are the
// ones the partitioned run gathered, and the next step matches the partitioned run's.
TEST(Stage3Checkpoint, PartitionedRunRestoresIntoRegisteredWeights) {
  SharedScratchDir dir("stage3-ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  std::string path;
  std::vector<std::vector<float>> saved, next;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                              ZeroEngine::Create(World(), lent_config, LentParams(), kOptions));
    for (std::int64_t step = 1; step <= 2; ++step) ZINF_ASSERT_OK(RunLentStep(*engine, step, 1));
    ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpointInfo info, engine->SaveCheckpoint({{"epoch", 2}}));
    path = info.path;
    ZINF_ASSERT_OK_AND_ASSIGN(saved, GatherAll(*engine));
    ZINF_ASSERT_OK(RunLentStep(*engine, 3, 1));
    ZINF_ASSERT_OK_AND_ASSIGN(next, GatherAll(*engine));
    ZINF_ASSERT_OK(engine->Close());
  }
  Model model = MakeModel(/*zero=*/true);
  EngineOptions resume = kOptions;
  resume.load = path;
  ZINF_ASSERT_OK_AND_ASSIGN(auto restored,
                            ZeroEngine::Create(World(), registered_config, model.Params(), resume));
  EXPECT_EQ(restored->step_count(), 2);
  EXPECT_EQ(restored->user_state(), nlohmann::json({{"epoch", 2}}));
  ExpectModelNear(model.w, saved, "restored");
  ZINF_ASSERT_OK(RunRegisteredStep(*restored, model, 3, 1));
  ExpectModelNear(model.w, next, "step 3 after the restore");
  ZINF_ASSERT_OK(restored->Close());
}

// A registered run's checkpoint restores into a partitioned model, which then needs no init.
TEST(Stage3Checkpoint, RegisteredRunRestoresIntoPartitionedModel) {
  SharedScratchDir dir("stage3-ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  std::string path;
  std::vector<std::vector<float>> saved, next;
  {
    Model model = MakeModel();
    ZINF_ASSERT_OK_AND_ASSIGN(
        auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
    for (std::int64_t step = 1; step <= 2; ++step) {
      ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, step, 1));
    }
    ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpointInfo info, registered->SaveCheckpoint({{"epoch", 2}}));
    path = info.path;
    saved = model.w;
    ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, 3, 1));
    next = model.w;
    ZINF_ASSERT_OK(registered->Close());
  }
  EngineOptions resume = kOptions;
  resume.load = path;
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto restored, ZeroEngine::Create(World(), lent_config, LentParams({.init = false}), resume));
  EXPECT_EQ(restored->step_count(), 2);
  EXPECT_EQ(restored->user_state(), nlohmann::json({{"epoch", 2}}));
  EXPECT_EQ(restored->num_partitioned_params(), 3u);
  ExpectGatheredNear(*restored, saved, "restored");
  ZINF_ASSERT_OK(RunLentStep(*restored, 3, 1));
  ExpectGatheredNear(*restored, next, "step 3 after the restore");
  ZINF_ASSERT_OK(restored->Close());
}

// ---------------------------------------------------------------------------------------------
// 5. Persistent parameters and parameters registered with weights.

// A parameter at or below the threshold is served without an all-gather; its span stays as it
// was while other parameters are gathered and released around it, and after the step a fresh
// Gather serves the new values, again without an all-gather.
TEST(Stage3Persistent, ServedWithoutAnAllGather) {
  SharedScratchDir dir("stage3-persistent");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), lent_config, LentParams(), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  EXPECT_EQ(engine->num_partitioned_params(), 3u);

  GatherCounters before = engine->gather_counters();
  {
    ZINF_ASSERT_OK_AND_ASSIGN(Gathered small, engine->Gather({"fc1.bias", "head.bias"}));
    GatherCounters d = Delta(engine->gather_counters(), before);
    EXPECT_EQ(d.calls, 1u) << Show(d);
    EXPECT_EQ(d.asked, 2u) << Show(d);
    EXPECT_EQ(d.served, 2u) << Show(d);
    EXPECT_EQ(d.gathered, 0u) << Show(d);
    ASSERT_EQ(small.size(), 2u);
    ExpectWeightsNear(small[0], model.w[3], "fc1.bias");
    ExpectWeightsNear(small[1], model.w[5], "head.bias");
    EXPECT_EQ(small.Find("head.bias").data(), small[1].data());
    EXPECT_EQ(small.Find("head.bias").size(), Numel(5));
    EXPECT_TRUE(small.Find("fc1.weight").empty());
    const std::vector<float> held(small[0].begin(), small[0].end());

    // The first gather of a partitioned parameter is an all-gather; its persistent companion
    // is served.
    before = engine->gather_counters();
    {
      ZINF_ASSERT_OK_AND_ASSIGN(Gathered layer, engine->Gather({"fc1.weight", "fc1.bias"}));
      d = Delta(engine->gather_counters(), before);
      EXPECT_EQ(d.gathered, 1u) << Show(d);
      EXPECT_EQ(d.prefetched, 0u) << Show(d);
      EXPECT_EQ(d.served, 1u) << Show(d);
      ExpectWeightsNear(layer[0], model.w[2], "fc1.weight");
      ExpectWeightsNear(layer[1], model.w[3], "fc1.bias");
    }
    ExpectGatheredNear(*engine, model.w, "with a persistent scope alive");
    EXPECT_EQ(std::vector<float>(small[0].begin(), small[0].end()), held);
  }

  ZINF_ASSERT_OK(RunLentStep(*engine, 1, 1));
  ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, 1, 1));
  before = engine->gather_counters();
  {
    ZINF_ASSERT_OK_AND_ASSIGN(Gathered small, engine->Gather({"fc1.bias", "head.bias"}));
    // The ask repeats the recorded order's first, so the partitioned parameters after it may be
    // prefetched; the asks themselves are served.
    const GatherCounters d = Delta(engine->gather_counters(), before);
    EXPECT_EQ(d.served, 2u) << Show(d);
    EXPECT_EQ(d.gathered, d.prefetched) << Show(d);
    ExpectWeightsNear(small[0], model.w[3], "fc1.bias after step 1");
    ExpectWeightsNear(small[1], model.w[5], "head.bias after step 1");
  }
  ExpectGatheredNear(*engine, model.w, "after step 1");
  ExpectCountersConsistent(engine->gather_counters());
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(registered->Close());
}

// At stage 3 a parameter registered with weights stays whole in them: Gather serves it, and
// Step writes its new values there, as for the rest of the model.
TEST(Stage3Persistent, ParameterRegisteredWithWeightsStaysInThem) {
  SharedScratchDir dir("stage3-mixed");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config lent_config, MakeConfig({}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config registered_config,
                            MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  std::vector<float> head = InitValues(4);
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto engine, ZeroEngine::Create(World(), lent_config,
                                      LentParams({.with_weights = 4, .weights = head}), kOptions));
  Model model = MakeModel();
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto registered, ZeroEngine::Create(World(), registered_config, model.Params(), kOptions));
  EXPECT_EQ(engine->num_partitioned_params(), 2u);
  for (std::int64_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const GatherCounters before = engine->gather_counters();
    {
      ZINF_ASSERT_OK_AND_ASSIGN(Gathered gathered, engine->Gather({"head.weight"}));
      const GatherCounters d = Delta(engine->gather_counters(), before);
      EXPECT_EQ(d.served, 1u) << Show(d);
      EXPECT_EQ(d.gathered, 0u) << Show(d);
      ExpectWeightsNear(gathered[0], head, "head.weight gathered");
    }
    ZINF_ASSERT_OK(RunLentStep(*engine, step, 1));
    ZINF_ASSERT_OK(RunRegisteredStep(*registered, model, step, 1));
    ExpectWeightsNear(head, model.w[4], "head.weight's buffer");
    ExpectGatheredNear(*engine, model.w, "the model");
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(registered->Close());
}

}  // namespace
}  // namespace zinf::engine
