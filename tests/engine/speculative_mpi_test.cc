// The speculative optimizer step (engine/include/zinf/engine/engine.h, "Speculative step") on 1-3
// ranks: a model whose sub-groups are stepped during the last micro-batch's backward pass and
// committed, redone or dropped by Step, against the same model with zinf.speculative_step false.
// At stage 3 both engines cut the same per-parameter partition into the same sub-groups, so the
// results must be the same bits; at stages 1 and 2 the non-speculative engine's partition is
// flat (another reduction split), so they agree within a tolerance. Each case checks the
// weights after every step and StepInfo's speculation counters step by step, and that something
// was speculated where it must be (so that a case cannot pass with the speculation idle): no
// clipping (committed), clipping at every step or at some and hyper-parameters changed after
// the speculation began (redone), a step that must clip (nothing speculated), fp16 overflows
// (dropped, and the speculation stops at the overflow), q8 state, parameter groups, the host
// tier (resident sub-groups through their second copy), a checkpoint, a DropGradients and a
// refused Step in the middle of a step, registered gradients with the key given, and an I/O
// error of a speculated write (the step fails on every rank with nothing stepped).
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "zinf/partition/plan.h"
#include "zinf/partition/sub_group.h"
#include "test_gradient.h"

namespace zinf::engine {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

// Sub-groups of 4096 elements and buckets of about one layer: several sub-groups per rank on
// every world size (7 or more at 3 ranks), so that many complete before the pass ends.
constexpr std::uint64_t kSubGroupSize = 4096;
constexpr std::uint64_t kReduceBucket = 12000;
// Stage 3: the biases (at most 131 elements) stay whole on every rank, the weights are
// partitioned.
constexpr std::uint64_t kPersistence = 200;
// Stages 1 and 2: a flat partition against a per-parameter one agree to this, relative to the
// tensor's largest value.
constexpr double kRelTol = 1e-5;
// The averaged gradient's norm is about 35 to 38 at every step (it differs with the ranks). The
// speculation stops once this rank's part of the squared norm proves that the step clips, so a
// threshold a little below the norm lets the sub-groups seen first be speculated (and redone):
// on one rank about half of them at kEveryClipping, three quarters at kSomeClipping on the
// steps whose gradient is kBig times larger (norm 53 to 57), all of them on more ranks.
constexpr double kEveryClipping = 25;
constexpr float kBig = 1.5f;
constexpr double kSomeClipping = 45;
// Before each Step (and each mid-micro-batch call) of a speculating engine the loop waits this
// long, so that the speculation's thread has stepped the sub-groups completed by then: Step
// drops those still queued, and a case must not pass with nothing speculated.
constexpr auto kSettle = std::chrono::milliseconds(100);

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
};

// Five layers of a weight (partitioned at stage 3) and a bias (persistent), odd sizes.
const std::vector<Spec>& Specs() {
  static const std::vector<Spec> specs = {
      {"l0.weight", {97, 101}}, {"l0.bias", {101}}, {"l1.weight", {83, 127}}, {"l1.bias", {127}},
      {"l2.weight", {89, 113}}, {"l2.bias", {113}}, {"l3.weight", {103, 97}}, {"l3.bias", {97}},
      {"l4.weight", {79, 131}}, {"l4.bias", {131}}};
  return specs;
}
constexpr std::size_t kLayers = 5;
constexpr std::size_t kNumParams = 2 * kLayers;

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

float InitValue(std::size_t param, std::uint64_t k) {
  return 0.5f * static_cast<float>(std::sin(0.1 * static_cast<double>(k) + 1.7 * param));
}

using testing::GradOf;

// How a case's engines are configured; the reference is the same with speculative false.
struct Knobs {
  std::string name = {};
  int stage = 3;
  bool lent = true;                                // no grads buffers: GradientReady(i, grad)
  std::optional<bool> speculative = std::nullopt;  // zinf.speculative_step; unset: the default
  int gas = 1;
  double clipping = 0;
  std::string state = "fp32";
  bool fp16 = false;
  std::string offload_param = "none";                      // stage 3
  std::optional<std::uint64_t> max_in_cpu = std::nullopt;  // offload_param's
  std::uint64_t host_cache_bytes = 0;
  bool verify_swap = false;  // zinf.verify_swap
  bool groups = false;       // three parameter groups
  bool scheduler = true;     // WarmupLR; false: the loop may SetHyperParams
  bool bitwise = true;       // the reference has the same plan
};

void PrintTo(const Knobs& s, std::ostream* os) { *os << s.name; }

// What the loop does, step by step (steps count from 1).
struct Schedule {
  std::int64_t steps = 5;
  std::set<std::int64_t> big = {};       // the gradient times kBig
  std::set<std::int64_t> overflow = {};  // an Inf (even steps) or a NaN in one rank's gradient
  // In the last micro-batch, once the last two layers are handed: SaveCheckpoint, then the rest.
  std::set<std::int64_t> save_mid = {};
  // Before the step: half a micro-batch of other gradients, DropGradients, then the step.
  std::set<std::int64_t> drop_mid = {};
  // Before the step: a whole backward pass of other gradients, then a Step refused for a NaN
  // loss.
  std::set<std::int64_t> refuse = {};
  // In the last micro-batch, once the last two layers are handed: SetHyperParams with every
  // group's lr halved (without a config scheduler), then the rest.
  std::set<std::int64_t> retune = {};
};

Result<config::Config> MakeConfig(const Knobs& s, const std::string& job, const SharedScratchDir& dir) {
  nlohmann::json zero = {
      {"stage", s.stage},
      {"sub_group_size", kSubGroupSize},
      {"reduce_bucket_size", kReduceBucket},
      {"allgather_bucket_size", 20000},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir.Join("swap")}}}};
  if (s.stage == 3) {
    nlohmann::json offload_param = {{"device", s.offload_param}};
    if (s.offload_param == "nvme") offload_param["nvme_path"] = dir.Join("swap");
    if (s.max_in_cpu) offload_param["max_in_cpu"] = *s.max_in_cpu;
    zero["offload_param"] = offload_param;
    zero["stage3_param_persistence_threshold"] = kPersistence;
  }
  nlohmann::json zinf = {{"adam_threads", 1},
                         {"optimizer_state", s.state},
                         {"job_id", job},
                         {"collective_timeout_seconds", 60},
                         {"checkpoint", {{"dir", dir.Join("ckpt-" + job)}}}};
  if (s.speculative) zinf["speculative_step"] = *s.speculative;
  if (s.host_cache_bytes > 0) zinf["host_cache_bytes"] = s.host_cache_bytes;
  if (s.verify_swap) zinf["verify_swap"] = true;
  nlohmann::json config = {{"train_micro_batch_size_per_gpu", 1},
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
                           {"zinf", zinf}};
  if (!s.scheduler) config.erase("scheduler");
  if (s.fp16) {
    // Each overflow halves the scale at once; two clean steps double it.
    config["fp16"] = {{"enabled", true},        {"loss_scale", 0}, {"initial_scale_power", 8},
                      {"loss_scale_window", 2}, {"hysteresis", 1}, {"min_loss_scale", 1}};
  }
  return config::ParseConfig(config.dump(), config::ContextOf(World()));
}

// One engine and the loop's buffers.
struct Loop {
  Knobs setup;
  std::vector<std::vector<float>> w = {}, g = {};  // stages 1 and 2: the loop's buffers
  std::unique_ptr<ZeroEngine> engine = nullptr;

  bool gathers() const { return setup.stage == 3; }
  bool speculating() const { return setup.speculative != false; }
};

Status CreateEngine(Loop& run, const std::string& job, const SharedScratchDir& dir,
                    std::optional<std::string> load = std::nullopt) {
  ZINF_ASSIGN_OR_RETURN(config::Config config, MakeConfig(run.setup, job, dir));
  EngineOptions options{.progress = false, .stop_signals = false, .create_nvme_paths = true};
  options.load = std::move(load);
  if (run.setup.groups) {
    options.param_groups = {
        {},
        {.lr = 0.004, .weight_decay = 0.0},
        {.lr = 0.02, .betas = std::array{0.8, 0.95}, .eps = 1e-6, .weight_decay = 0.1}};
  }
  std::vector<Param> params;
  run.w.clear();
  run.g.clear();
  for (std::size_t i = 0; i < kNumParams; ++i) {
    Param p{.name = Specs()[i].name, .shape = Specs()[i].shape};
    if (run.setup.groups) p.group = i % 2 == 1 ? 1 : (i == 4 ? 2 : 0);
    if (run.gathers()) {
      p.init = [i](std::uint64_t offset, std::span<float> out) -> Status {
        for (std::size_t j = 0; j < out.size(); ++j) out[j] = InitValue(i, offset + j);
        return OkStatus();
      };
    } else {
      run.w.emplace_back(Numel(i));
      for (std::uint64_t k = 0; k < Numel(i); ++k) run.w[i][k] = InitValue(i, k);
      run.g.emplace_back(run.setup.lent ? 0 : Numel(i), 0.0f);
    }
    params.push_back(std::move(p));
  }
  for (std::size_t i = 0; !run.gathers() && i < kNumParams; ++i) {
    params[i].weights = run.w[i];
    if (!run.setup.lent) params[i].grads = run.g[i];
  }
  ZINF_ASSIGN_OR_RETURN(run.engine,
                        ZeroEngine::Create(World(), config, std::move(params), options));
  return OkStatus();
}

using Weights = std::vector<std::vector<float>>;

// The whole model as the loop sees it.
Result<Weights> Snapshot(Loop& run) {
  if (!run.gathers()) return run.w;
  ZINF_ASSIGN_OR_RETURN(Gathered all, run.engine->Gather(std::span<const std::string>(AllNames())));
  Weights weights;
  for (std::size_t i = 0; i < kNumParams; ++i) weights.emplace_back(all[i].begin(), all[i].end());
  return weights;
}

// Hands micro-batch `micro`'s gradients of layers [first, end), last layer first and in each the
// bias before the weight (reverse registration order), each computed at the weights the loop
// sees (gathered at stage 3) times `factor`. `overflow`: one rank puts an Inf into one of them.
Status HandLayers(Loop& run, std::int64_t step, int micro, float factor, bool overflow,
                  std::size_t first, std::size_t end) {
  const int rank = World().rank();
  std::vector<float> scratch;
  for (std::size_t layer = end; layer-- > first;) {
    const std::array<std::size_t, 2> params = {2 * layer, 2 * layer + 1};
    Gathered gathered;
    std::array<std::span<const float>, 2> weights;
    if (run.gathers()) {
      ZINF_ASSIGN_OR_RETURN(gathered, run.engine->GatherByIndex(params));
      weights = {gathered[0], gathered[1]};
    } else {
      weights = {run.w[params[0]], run.w[params[1]]};
    }
    for (std::size_t j = params.size(); j-- > 0;) {
      const std::size_t i = params[j];
      std::span<float> grad;
      if (run.setup.lent) {
        scratch.assign(Numel(i), 0.0f);
        grad = scratch;
      } else {
        grad = run.g[i];
      }
      for (std::uint64_t k = 0; k < grad.size(); ++k) {
        grad[k] += factor * GradOf(i, k, rank, step, micro, weights[j][k]);
      }
      if (overflow && rank == step % World().size() &&
          i == static_cast<std::size_t>(step) % kNumParams) {
        grad[3] = step % 2 == 0 ? std::numeric_limits<float>::infinity()
                                : std::numeric_limits<float>::quiet_NaN();
      }
      ZINF_RETURN_IF_ERROR(run.setup.lent ? run.engine->GradientReady(i, grad)
                                          : run.engine->GradientReady(i));
    }
  }
  return OkStatus();
}

// One step of the loop, with the schedule's interruptions; `saved` collects the checkpoints
// written in the middle of a micro-batch.
Result<StepInfo> RunStep(Loop& run, const Schedule& sch, std::int64_t step,
                         std::vector<std::string>* saved = nullptr) {
  const bool settle = run.speculating();
  const float factor =
      (sch.big.contains(step) ? kBig : 1.0f) * static_cast<float>(run.engine->loss_scale());
  if (sch.refuse.contains(step)) {
    // Other gradients (micro-batches 7 and on), which the refused step consumes.
    for (int micro = 0; micro < run.setup.gas; ++micro) {
      ZINF_RETURN_IF_ERROR(HandLayers(run, step, 7 + micro, 3 * factor, false, 0, kLayers));
      if (micro + 1 < run.setup.gas) ZINF_RETURN_IF_ERROR(run.engine->AccumulateGradients());
    }
    if (settle) std::this_thread::sleep_for(kSettle);
    Result<StepInfo> refused = run.engine->Step(std::numeric_limits<double>::quiet_NaN());
    if (refused || refused.error().code() != ErrorCode::kFailedPrecondition) {
      return InternalError(fmt::format("step {} with a NaN loss was not refused: {}", step,
                                       refused ? "OK" : refused.error().ToString()));
    }
  }
  if (sch.drop_mid.contains(step)) {
    // Half a micro-batch of gradients that must not count (micro-batch 7 of the last one).
    for (int micro = 0; micro + 1 < run.setup.gas; ++micro) {
      ZINF_RETURN_IF_ERROR(HandLayers(run, step, micro, factor, false, 0, kLayers));
      ZINF_RETURN_IF_ERROR(run.engine->AccumulateGradients());
    }
    ZINF_RETURN_IF_ERROR(HandLayers(run, step, 7, 3 * factor, false, kLayers / 2, kLayers));
    if (settle) std::this_thread::sleep_for(kSettle);
    ZINF_RETURN_IF_ERROR(run.engine->DropGradients());
  }
  for (int micro = 0; micro < run.setup.gas; ++micro) {
    const bool last = micro + 1 == run.setup.gas;
    const bool overflow = last && sch.overflow.contains(step);
    if (last && (sch.save_mid.contains(step) || sch.retune.contains(step))) {
      ZINF_RETURN_IF_ERROR(HandLayers(run, step, micro, factor, overflow, kLayers - 2, kLayers));
      if (settle) std::this_thread::sleep_for(kSettle);
      if (sch.save_mid.contains(step)) {
        ZINF_ASSIGN_OR_RETURN(SavedCheckpointInfo info, run.engine->SaveCheckpoint());
        if (saved != nullptr) saved->push_back(info.path);
      }
      if (sch.retune.contains(step)) {
        std::vector<HyperParams> groups;
        for (std::size_t g = 0; g < run.engine->num_param_groups(); ++g) {
          groups.push_back(run.engine->next_hyper_params(g));
          groups.back().lr *= 0.5;
        }
        ZINF_RETURN_IF_ERROR(run.engine->SetHyperParams(groups));
      }
      ZINF_RETURN_IF_ERROR(HandLayers(run, step, micro, factor, overflow, 0, kLayers - 2));
    } else {
      ZINF_RETURN_IF_ERROR(HandLayers(run, step, micro, factor, overflow, 0, kLayers));
    }
    if (!last) ZINF_RETURN_IF_ERROR(run.engine->AccumulateGradients());
  }
  if (settle) std::this_thread::sleep_for(kSettle);
  return run.engine->Step(1.0 + World().rank());
}

// A run: the StepInfo of every step and the weights before the first and after each.
struct Trace {
  std::vector<StepInfo> infos;
  std::vector<Weights> weights;
  std::vector<std::string> saved;
  std::size_t total_sub_groups = 0;  // all ranks', of the run's partition plan
  // Of them, those holding parameter elements (the others are padding that no gradient
  // completes: at 3 ranks a bias's shards on ranks 1 and 2).
  std::size_t filled_sub_groups = 0;
};

// The sub-groups of all ranks for the engine's plan (per parameter while speculating, or at
// stage 3), all of them and those holding parameter elements.
void CountSubGroups(const ZeroEngine& engine, Trace* trace) {
  Result<partition::PartitionPlan> plan = partition::PartitionPlan::CreatePerParam(
      engine.layout(), World().size(), kPartitionAlignmentElems);
  ASSERT_TRUE(plan.has_value()) << plan.error().ToString();
  for (int r = 0; r < World().size(); ++r) {
    Result<partition::SubGroupPlan> sub_groups =
        partition::SubGroupPlan::Create(*plan, r, kSubGroupSize);
    ASSERT_TRUE(sub_groups.has_value()) << sub_groups.error().ToString();
    trace->total_sub_groups += sub_groups->size();
    for (const partition::SubGroup& sg : sub_groups->sub_groups()) {
      trace->filled_sub_groups += sg.RealNumel() > 0 ? 1 : 0;
    }
  }
}

// Runs `sch` on a fresh engine of `setup` into `trace` (ASSERTs: check HasFatalFailure).
void RunAll(const Knobs& setup, const Schedule& sch, const SharedScratchDir& dir,
            const std::string& job, Trace* trace) {
  Loop run{.setup = setup};
  ZINF_ASSERT_OK(CreateEngine(run, job, dir));
  // Unset, the key is on with lent gradients only.
  EXPECT_EQ(run.engine->config().zinf.speculative_step, setup.speculative.value_or(setup.lent));
  CountSubGroups(*run.engine, trace);
  if (::testing::Test::HasFatalFailure()) return;
  ZINF_ASSERT_OK_AND_ASSIGN(Weights initial, Snapshot(run));
  trace->weights.push_back(std::move(initial));
  for (std::int64_t step = 1; step <= sch.steps; ++step) {
    SCOPED_TRACE(fmt::format("{} step {}", job, step));
    ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(run, sch, step, &trace->saved));
    EXPECT_EQ(info.step, step);
    EXPECT_EQ(run.engine->step_count(), step);
    trace->infos.push_back(info);
    ZINF_ASSERT_OK_AND_ASSIGN(Weights after, Snapshot(run));
    trace->weights.push_back(std::move(after));
  }
  ZINF_ASSERT_OK(run.engine->Close());
}

// Bitwise: the first element whose bits differ; else the worst against kRelTol of the largest.
void ExpectWeightsMatch(const Weights& got, const Weights& want, bool bitwise,
                        std::string_view what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what << " " << Specs()[i].name;
    if (bitwise) {
      for (std::size_t k = 0; k < got[i].size(); ++k) {
        if (std::memcmp(&got[i][k], &want[i][k], sizeof(float)) != 0) {
          ADD_FAILURE() << what << ": " << Specs()[i].name << "[" << k << "] is " << got[i][k]
                        << ", without speculation " << want[i][k];
          break;
        }
      }
      continue;
    }
    double scale = 0, worst = 0;
    std::size_t at = 0;
    for (std::size_t k = 0; k < got[i].size(); ++k) {
      scale = std::max(scale, std::abs(static_cast<double>(want[i][k])));
      const double err = std::abs(static_cast<double>(got[i][k]) - want[i][k]);
      if (!(err <= worst)) {  // NaN counts as worst
        worst = err;
        at = k;
      }
    }
    EXPECT_LE(worst, kRelTol * scale) << what << ": " << Specs()[i].name << "[" << at << "] is "
                                      << got[i][at] << ", without speculation " << want[i][at];
  }
}

// The speculative run did what the reference did, step by step.
void ExpectSameRun(const Trace& spec, const Trace& ref, bool bitwise) {
  ASSERT_EQ(spec.infos.size(), ref.infos.size());
  ASSERT_EQ(spec.weights.size(), ref.weights.size());
  ExpectWeightsMatch(spec.weights[0], ref.weights[0], bitwise, "initial");
  for (std::size_t s = 0; s < spec.infos.size(); ++s) {
    const StepInfo& a = spec.infos[s];
    const StepInfo& b = ref.infos[s];
    SCOPED_TRACE(fmt::format("step {}", b.step));
    EXPECT_EQ(a.skipped, b.skipped);
    EXPECT_EQ(a.clipped, b.clipped);
    EXPECT_EQ(a.loss_scale, b.loss_scale);
    EXPECT_EQ(a.lr, b.lr);
    if (!std::isfinite(b.grad_norm)) {  // an overflow
      EXPECT_EQ(std::isnan(a.grad_norm), std::isnan(b.grad_norm)) << a.grad_norm;
    } else if (bitwise) {
      EXPECT_EQ(a.grad_norm, b.grad_norm);
    } else {
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-6 * b.grad_norm);
    }
    ExpectWeightsMatch(spec.weights[s + 1], ref.weights[s + 1], bitwise,
                       fmt::format("after step {}", b.step));
    // The reference speculates nothing.
    EXPECT_EQ(b.speculated, 0u);
    EXPECT_EQ(b.speculation_committed + b.speculation_redone + b.speculation_discarded, 0u);
  }
}

// What a step did with what was speculated for it, summed over the run.
struct Fates {
  std::uint64_t committed = 0;  // on steps neither skipped nor clipped
  std::uint64_t redone = 0;     // on clipped steps
  std::uint64_t discarded = 0;  // on skipped steps
};

// Per step: everything speculated is committed when the step applied unclipped, redone when it
// clipped (or at the `retuned` steps, whose hyper-parameters changed after the speculation
// began), dropped when it was skipped; never more than there are sub-groups.
Fates ExpectFates(const Trace& spec, const std::set<std::int64_t>& retuned = {}) {
  Fates fates;
  for (const StepInfo& info : spec.infos) {
    SCOPED_TRACE(fmt::format("step {}: speculated {}, committed {}, redone {}, discarded {}",
                             info.step, info.speculated, info.speculation_committed,
                             info.speculation_redone, info.speculation_discarded));
    EXPECT_LE(info.speculated, spec.total_sub_groups);
    if (info.skipped) {
      EXPECT_EQ(info.speculation_discarded, info.speculated);
      EXPECT_EQ(info.speculation_committed + info.speculation_redone, 0u);
      fates.discarded += info.speculated;
    } else if (info.clipped || retuned.contains(info.step)) {
      EXPECT_EQ(info.speculation_redone, info.speculated);
      EXPECT_EQ(info.speculation_committed + info.speculation_discarded, 0u);
      fates.redone += info.speculated;
    } else {
      EXPECT_EQ(info.speculation_committed, info.speculated);
      EXPECT_EQ(info.speculation_redone + info.speculation_discarded, 0u);
      fates.committed += info.speculated;
    }
  }
  if (World().rank() == 0) {
    std::printf("speculated: %llu committed, %llu redone, %llu discarded over %zu steps\n",
                static_cast<unsigned long long>(fates.committed),
                static_cast<unsigned long long>(fates.redone),
                static_cast<unsigned long long>(fates.discarded), spec.infos.size());
  }
  return fates;
}

// Runs `setup` with speculation and without (the reference) on `sch` and compares them.
void RunBoth(const Knobs& setup, const Schedule& sch, Trace* spec, Trace* ref,
             const SharedScratchDir& dir) {
  Knobs off = setup;
  off.speculative = false;
  RunAll(off, sch, dir, "ref", ref);
  if (::testing::Test::HasFatalFailure()) return;
  RunAll(setup, sch, dir, "spec", spec);
  if (::testing::Test::HasFatalFailure()) return;
  ExpectSameRun(*spec, *ref, setup.bitwise);
}

// ---------------------------------------------------------------------------------------------
// Without clipping every speculated sub-group is committed: the same bits as without.

class SpeculationCommits : public ::testing::TestWithParam<Knobs> {};

TEST_P(SpeculationCommits, SameResultsAsWithout) {
  const Knobs& setup = GetParam();
  SharedScratchDir dir("spec-commit");
  Trace spec, ref;
  RunBoth(setup, {.steps = 5}, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.committed, 0u) << "nothing was speculated";
  EXPECT_EQ(fates.redone + fates.discarded, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SpeculationCommits,
    ::testing::Values(
        // Stage 3, gradients lent, the key unset: on by default.
        Knobs{.name = "Stage3Lent"},
        // The shards read from the swap store: the partitioned weights' new values are not kept
        // for the sink, the persistent ones' are; two micro-batches, the second speculated.
        Knobs{.name = "Stage3ParamNvmeAccumulated", .gas = 2, .offload_param = "nvme"},
        // On 2 and 3 ranks the first shards kept in memory (the sink writes their new values),
        // the rest read from the swap store (on 1 rank all of them).
        Knobs{.name = "Stage3ParamNvmeSomeInMemory", .offload_param = "nvme", .max_in_cpu = 6000},
        // Every swapped stripe unit checksummed: the speculated writes and the reads ahead too.
        Knobs{.name = "Stage3VerifySwap", .offload_param = "nvme", .verify_swap = true},
        // q8 state: the same sub-groups give the same block scales.
        Knobs{.name = "Stage3Q8", .speculative = true, .state = "q8"},
        // Parameter groups of their own lr, betas, eps and weight decay.
        Knobs{.name = "Stage3ParamGroups", .groups = true},
        // Stage 2, gradients lent: per parameter against the reference's flat partition.
        Knobs{.name = "Stage2Lent", .stage = 2, .bitwise = false},
        // Stage 1 with registered gradients handed by GradientReady(index): on only when asked.
        Knobs{.name = "Stage1RegisteredAsked",
              .stage = 1,
              .lent = false,
              .speculative = true,
              .bitwise = false}),
    [](const ::testing::TestParamInfo<Knobs>& param) { return param.param.name; });

// Registered gradients with the key unset: no speculation (the default needs lent gradients).
TEST(SpeculationDefault, OffWithRegisteredGradients) {
  SharedScratchDir dir("spec-default");
  Trace trace;
  RunAll({.stage = 1, .lent = false}, {.steps = 2}, dir, "default", &trace);
  if (HasFatalFailure()) return;
  for (const StepInfo& info : trace.infos) {
    EXPECT_EQ(info.speculated, 0u) << "step " << info.step;
  }
}

// ---------------------------------------------------------------------------------------------
// Clipping: the speculated sub-groups are stepped again from their committed state.

TEST(SpeculationClipping, EveryStepClippedIsRedone) {
  SharedScratchDir dir("spec-clip-all");
  Trace spec, ref;
  RunBoth({.clipping = kEveryClipping}, {.steps = 4}, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  for (const StepInfo& info : spec.infos) EXPECT_TRUE(info.clipped) << "step " << info.step;
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.redone, 0u) << "nothing was speculated";
  EXPECT_EQ(fates.committed, 0u);
}

// A threshold far below the norm: the first sub-group seen proves that the step clips, so
// nothing is speculated at all.
TEST(SpeculationClipping, HopelessStepSpeculatesNothing) {
  SharedScratchDir dir("spec-clip-tiny");
  Trace spec, ref;
  RunBoth({.clipping = 1e-3}, {.steps = 3}, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  for (const StepInfo& info : spec.infos) {
    EXPECT_TRUE(info.clipped) << "step " << info.step;
    EXPECT_EQ(info.speculated, 0u) << "step " << info.step;
  }
  ExpectFates(spec);
}

TEST(SpeculationClipping, SomeStepsClipped) {
  SharedScratchDir dir("spec-clip-some");
  const Schedule sch{.steps = 6, .big = {2, 3, 5}};
  Trace spec, ref;
  RunBoth({.clipping = kSomeClipping}, sch, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  for (const StepInfo& info : spec.infos) {
    EXPECT_EQ(info.clipped, sch.big.contains(info.step))
        << "step " << info.step << ": gradient norm " << info.grad_norm << " against "
        << kSomeClipping;
  }
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.committed, 0u) << "nothing speculated on the steps that did not clip";
  EXPECT_GT(fates.redone, 0u) << "nothing speculated on the steps that clipped";
}

// Hyper-parameters set after the speculation began (SetHyperParams in the middle of the last
// micro-batch): the speculated sub-groups assumed the old ones and are stepped again.
TEST(SpeculationClipping, HyperParamsChangedMidStepAreRedone) {
  SharedScratchDir dir("spec-retune");
  const Schedule sch{.steps = 4, .retune = {2, 3}};
  Trace spec, ref;
  RunBoth({.groups = true, .scheduler = false}, sch, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  const Fates fates = ExpectFates(spec, sch.retune);
  EXPECT_GT(fates.redone, 0u) << "nothing speculated on the retuned steps";
  EXPECT_GT(fates.committed, 0u) << "nothing speculated on the other steps";
  for (const StepInfo& info : spec.infos) EXPECT_FALSE(info.clipped) << "step " << info.step;
}

// ---------------------------------------------------------------------------------------------
// fp16 overflows: the skipped steps drop what was speculated; the loss scale moves.

TEST(SpeculationFp16, OverflowsDiscard) {
  SharedScratchDir dir("spec-fp16");
  const Schedule sch{.steps = 7, .overflow = {2, 4, 5}};
  Trace spec, ref;
  RunBoth({.fp16 = true}, sch, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  std::set<double> scales;
  for (const StepInfo& info : spec.infos) {
    EXPECT_EQ(info.skipped, sch.overflow.contains(info.step)) << "step " << info.step;
    scales.insert(info.loss_scale);
  }
  EXPECT_GT(scales.size(), 2u) << "the loss scale should have gone down and up";
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.discarded, 0u) << "nothing speculated on the skipped steps";
  EXPECT_GT(fates.committed, 0u) << "nothing speculated on the applied steps";
}

// Once this rank has seen a sub-group that is not finite (the step will be skipped), nothing more
// is speculated: the sub-group holding the Inf or NaN never is, so a skipped step counts fewer
// speculated sub-groups than the backward pass completes (an Inf at steps 2 and 4, a NaN at 5;
// no clipping, so only the overflow can stop the speculation).
TEST(SpeculationFp16, OverflowStopsTheSpeculation) {
  SharedScratchDir dir("spec-fp16-stop");
  const Schedule sch{.steps = 5, .overflow = {2, 4, 5}};
  Trace spec;
  RunAll({.fp16 = true}, sch, dir, "spec", &spec);
  if (HasFatalFailure()) return;
  for (const StepInfo& info : spec.infos) {
    ASSERT_EQ(info.skipped, sch.overflow.contains(info.step)) << "step " << info.step;
    if (info.skipped) {
      EXPECT_LT(info.speculated, spec.filled_sub_groups)
          << "step " << info.step << ": the sub-group with the "
          << (info.step % 2 == 0 ? "Inf" : "NaN") << " was speculated";
    }
  }
  ExpectFates(spec);
}

// ---------------------------------------------------------------------------------------------
// The host tier (zinf.host_cache_bytes): resident sub-groups are speculated into a second
// copy of their state in memory, committed by swapping the two copies, or dropped.

struct HostCase {
  std::string name;
  std::uint64_t host_cache_bytes = 0;
  bool fp16 = false;
  double clipping = 0;
  Schedule schedule = {};
};

void PrintTo(const HostCase& c, std::ostream* os) { *os << c.name; }

class SpeculationHostTier : public ::testing::TestWithParam<HostCase> {};

TEST_P(SpeculationHostTier, SameResultsAsWithout) {
  const HostCase& c = GetParam();
  SharedScratchDir dir("spec-host");
  Trace spec, ref;
  RunBoth({.clipping = c.clipping, .fp16 = c.fp16, .host_cache_bytes = c.host_cache_bytes},
          c.schedule, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.committed, 0u) << "nothing was speculated on the applied steps";
  if (!c.schedule.big.empty()) {
    EXPECT_GT(fates.redone, 0u) << "nothing speculated on the clipped steps";
  }
  if (!c.schedule.overflow.empty()) {
    EXPECT_GT(fates.discarded, 0u) << "nothing speculated on the skipped steps";
  }
  for (const StepInfo& info : spec.infos) {
    EXPECT_EQ(info.clipped, c.schedule.big.contains(info.step)) << "step " << info.step;
    EXPECT_EQ(info.skipped, c.schedule.overflow.contains(info.step)) << "step " << info.step;
  }
}

// One sub-group's fp32 state is 3 x 4096 x 4 = 48 KiB: 72 KiB keeps each rank's first one in
// memory (every rank has at least two), 8 MiB all of them, so that everything speculated there
// went through the second copy.
INSTANTIATE_TEST_SUITE_P(Cases, SpeculationHostTier,
                         ::testing::Values(HostCase{.name = "FirstSubGroupResident",
                                                    .host_cache_bytes = 72 << 10,
                                                    .schedule = {.steps = 4}},
                                           HostCase{.name = "AllResidentSomeStepsClipped",
                                                    .host_cache_bytes = 8 << 20,
                                                    .clipping = kSomeClipping,
                                                    .schedule = {.steps = 4, .big = {2}}},
                                           HostCase{.name = "AllResidentFp16Overflow",
                                                    .host_cache_bytes = 8 << 20,
                                                    .fp16 = true,
                                                    .schedule = {.steps = 4, .overflow = {2}}}),
                         [](const ::testing::TestParamInfo<HostCase>& param) {
                           return param.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// A checkpoint or a DropGradients in the middle of the last micro-batch, or a refused Step,
// drops what was speculated so far; the sub-groups completed after it are speculated again.

TEST(SpeculationInterrupted, SaveDropAndRefusedStepDiscard) {
  SharedScratchDir dir("spec-mid");
  const Schedule sch{.steps = 5, .save_mid = {2}, .drop_mid = {3}, .refuse = {4}};
  Trace spec, ref;
  RunBoth({}, sch, &spec, &ref, dir);
  if (HasFatalFailure()) return;
  const Fates fates = ExpectFates(spec);
  EXPECT_GT(fates.committed, 0u) << "nothing was speculated";
  // Sub-groups completed after the save and after the drop are speculated again.
  std::uint64_t after_interruption = 0;
  for (const StepInfo& info : spec.infos) {
    if (sch.save_mid.contains(info.step) || sch.drop_mid.contains(info.step) ||
        sch.refuse.contains(info.step)) {
      after_interruption += info.speculated;
    }
  }
  EXPECT_GT(after_interruption, 0u);
  // The checkpoint saved in the middle of step 2 holds the state after step 1: restored, it
  // gives step 1's weights, and step 2 from there the same bits as the reference's step 2.
  ASSERT_EQ(spec.saved.size(), 1u);
  Loop run{.setup = {}};
  ZINF_ASSERT_OK(CreateEngine(run, "restored", dir, spec.saved[0]));
  EXPECT_EQ(run.engine->step_count(), 1);
  ZINF_ASSERT_OK_AND_ASSIGN(Weights restored, Snapshot(run));
  ExpectWeightsMatch(restored, ref.weights[1], true, "restored from the mid-step checkpoint");
  ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(run, {}, 2));
  EXPECT_EQ(info.speculation_committed, info.speculated);
  ZINF_ASSERT_OK_AND_ASSIGN(Weights after, Snapshot(run));
  ExpectWeightsMatch(after, ref.weights[2], true, "step 2 after the restore");
  ZINF_ASSERT_OK(run.engine->Close());
}

// ---------------------------------------------------------------------------------------------
// An I/O error while a speculated sub-group is written (or read) fails Step on every rank with
// the same error and nothing stepped. The speculation's I/O engines are made at its first
// sub-group, so ZINF_FAULT_INJECT set on one rank after Create reaches them alone: the first
// write of the speculation, its fourth (with one block per state tensor: the second
// sub-group's, after the first was speculated whole), or its second read.

TEST(SpeculationIoError, FailsTheStepOnEveryRankWithNothingStepped) {
  SharedScratchDir dir("spec-fault");
  const Schedule sch{.steps = 3};
  Trace ref;
  Knobs off;
  off.speculative = false;
  RunAll(off, sch, dir, "ref", &ref);
  if (HasFatalFailure()) return;
  const int faulty = World().size() - 1;
  const std::array<const char*, 3> faults = {"write:1:eio", "write:4:eio", "read:2:eio"};
  for (std::size_t f = 0; f < faults.size(); ++f) {
    const char* fault = faults[f];
    SCOPED_TRACE(fault);
    Loop run{.setup = {}};
    ZINF_ASSERT_OK(CreateEngine(run, fmt::format("fault{}", f), dir));
    if (World().rank() == faulty) {
      ASSERT_EQ(::setenv("ZINF_FAULT_INJECT", fault, 1), 0);
    }
    Result<StepInfo> failed = RunStep(run, sch, 1);
    if (World().rank() == faulty) {
      ASSERT_EQ(::unsetenv("ZINF_FAULT_INJECT"), 0);
    }
    EXPECT_THAT(failed, StatusIs(ErrorCode::kDataLoss, HasSubstr("speculative")));
    // The same code on every rank.
    std::array<std::int32_t, 2> codes = {
        failed ? -1 : static_cast<std::int32_t>(failed.error().code()),
        failed ? 1 : -static_cast<std::int32_t>(failed.error().code())};
    ZINF_ASSERT_OK(World().AllreduceInPlace<std::int32_t>(codes, comm::ReduceOp::kMax));
    EXPECT_EQ(codes[0], -codes[1]) << "the ranks got different errors";
    EXPECT_EQ(run.engine->step_count(), 0);
    ZINF_ASSERT_OK_AND_ASSIGN(Weights now, Snapshot(run));
    ExpectWeightsMatch(now, ref.weights[0], true, "after the failed step");
    // The step again, and the next ones: every sub-group steps from the state before the failed
    // step (one committed or half written would step from another).
    std::uint64_t speculated = 0;
    for (std::int64_t step = 1; step <= sch.steps; ++step) {
      SCOPED_TRACE(fmt::format("step {} after the failure", step));
      ZINF_ASSERT_OK_AND_ASSIGN(StepInfo info, RunStep(run, sch, step));
      EXPECT_EQ(info.speculation_committed, info.speculated);
      speculated += info.speculated;
      ZINF_ASSERT_OK_AND_ASSIGN(Weights after, Snapshot(run));
      ExpectWeightsMatch(after, ref.weights[static_cast<std::size_t>(step)], true,
                         fmt::format("step {}", step));
    }
    EXPECT_GT(speculated, 0u) << "nothing was speculated after the failure";
    ZINF_ASSERT_OK(run.engine->Close());
  }
}

}  // namespace
}  // namespace zinf::engine
