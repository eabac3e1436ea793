// ZeRO stage 3 at the edges of its bounds (engine/include/zinf/engine/engine.h, "Stage 3"), on
// 1-4 ranks, against the same model registered with its weights at stage 1: shards read ahead
// before a Step or a Load are never served after it; the shards kept in memory under
// offload_param.max_in_cpu, the one ending exactly at the limit included, carry each step's new
// weights; stage3_max_reuse_distance and offload_param.buffer_count bound exactly what they say
// (Gather's counters); and parameter groups whose boundaries fall exactly on sub-group boundaries.
//
// The model is six parameters of 12288 = 1024 x 12 elements: on 1, 2, 3 and 4 ranks each rank's
// shard (12288 / world elements) is whole, without padding, so every shard ends exactly where the
// next begins, and a limit or a sub-group of k shards ends exactly at a parameter boundary.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
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

namespace zinf::engine {
namespace {

using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::World;
using ::zinf::engine::testing::Delta;
using ::zinf::engine::testing::Show;

constexpr std::size_t kNumParams = 6;
constexpr std::uint64_t kNumel = 12288;
// Two runs of the same steps with other partition plans agree to this, relative to the
// tensor's largest value; a step moves every weight by about lr = 1e-2, 10^4 times more.
constexpr double kRelTol = 1e-6;

// This rank's shard of every parameter, in elements.
std::uint64_t ShardNumel() { return kNumel / static_cast<std::uint64_t>(World().size()); }

std::string Name(std::size_t p) { return fmt::format("w{}", p); }

float InitValue(std::size_t p, std::uint64_t k) {
  return 0.5f * static_cast<float>(std::sin(0.1 * static_cast<double>(k) + 1.7 * p));
}

// Rank `rank`'s gradient at step `step`, bounded away from 0.
float Grad(std::size_t p, std::uint64_t k, int rank, std::int64_t step) {
  return static_cast<float>(0.15 + 0.1 * std::sin(0.37 * static_cast<double>(k) + 1.3 * rank +
                                                  0.71 * static_cast<double>(step) + 0.5 * p));
}

struct Setup {
  int stage = 3;
  std::string offload_param = "none";
  std::optional<std::uint64_t> max_in_cpu = std::nullopt;
  std::optional<std::uint64_t> buffer_count = std::nullopt;  // offload_param's
  std::uint64_t prefetch_bucket = 0;
  std::optional<std::uint64_t> max_live = std::nullopt;
  std::optional<std::uint64_t> reuse_distance = std::nullopt;
  std::uint64_t sub_group_size = 4096;
  std::string job_id = "lent";
};

Result<config::Config> MakeConfig(const Setup& s, const SharedScratchDir& dir) {
  const std::string swap = dir.Join("swap");
  nlohmann::json offload_param = {{"device", s.offload_param}};
  if (s.offload_param == "nvme") offload_param["nvme_path"] = swap;
  if (s.max_in_cpu) offload_param["max_in_cpu"] = *s.max_in_cpu;
  if (s.buffer_count) offload_param["buffer_count"] = *s.buffer_count;
  nlohmann::json zero = {{"stage", s.stage},
                         {"sub_group_size", s.sub_group_size},
                         {"reduce_bucket_size", 20000},
                         {"allgather_bucket_size", 30000},
                         {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}},
                         {"offload_param", offload_param},
                         {"stage3_prefetch_bucket_size", s.prefetch_bucket},
                         {"stage3_param_persistence_threshold", 100}};
  if (s.max_live) zero["stage3_max_live_parameters"] = *s.max_live;
  if (s.reuse_distance) zero["stage3_max_reuse_distance"] = *s.reuse_distance;
  const nlohmann::json config = {{"train_micro_batch_size_per_gpu", 1},
                                 {"gradient_accumulation_steps", 1},
                                 {"steps_per_print", 1000},
                                 {"optimizer",
                                  {{"type", "AdamW"},
                                   {"params",
                                    {{"lr", 0.01},
                                     {"betas", nlohmann::json::array({0.9, 0.99})},
                                     {"eps", 1e-8},
                                     {"weight_decay", 0.01}}}}},
                                 {"zero_optimization", zero},
                                 {"zinf",
                                  {{"adam_threads", 1},
                                   {"job_id", s.job_id},
                                   {"collective_timeout_seconds", 60},
                                   {"checkpoint", {{"dir", dir.Join("ckpt-" + s.job_id)}}}}}};
  return config::ParseConfig(config.dump(), config::ContextOf(World()));
}

EngineOptions Options(const std::vector<ParamGroup>& groups = {}) {
  EngineOptions options = {.progress = false, .stop_signals = false, .create_nvme_paths = true};
  options.param_groups = groups;
  return options;
}

// Parameter p's group when the test has groups: every other parameter in group 1.
std::size_t GroupOf(std::size_t p, bool grouped) { return grouped && p % 2 == 1 ? 1 : 0; }

// The model registered without weights or gradients (partitioned, gradients lent).
std::vector<Param> LentParams(bool grouped = false) {
  std::vector<Param> params;
  for (std::size_t p = 0; p < kNumParams; ++p) {
    params.push_back({.name = Name(p),
                      .shape = {96, 128},
                      .init = [p](std::uint64_t offset, std::span<float> out) -> Status {
                        for (std::size_t j = 0; j < out.size(); ++j)
                          out[j] = InitValue(p, offset + j);
                        return OkStatus();
                      },
                      .group = GroupOf(p, grouped)});
  }
  return params;
}

// The reference: the same model registered with its weights and gradients.
struct Model {
  std::vector<std::vector<float>> w, g;

  Model() {
    for (std::size_t p = 0; p < kNumParams; ++p) {
      w.emplace_back(kNumel);
      for (std::uint64_t k = 0; k < kNumel; ++k) w[p][k] = InitValue(p, k);
      g.emplace_back(kNumel, 0.0f);
    }
  }
  std::vector<Param> Params(bool grouped = false) {
    std::vector<Param> params;
    for (std::size_t p = 0; p < kNumParams; ++p) {
      params.push_back({.name = Name(p),
                        .shape = {96, 128},
                        .weights = w[p],
                        .grads = g[p],
                        .group = GroupOf(p, grouped)});
    }
    return params;
  }
};

Result<std::unique_ptr<ZeroEngine>> CreateReference(Model& model, const SharedScratchDir& dir,
                                                    const std::vector<ParamGroup>& groups = {}) {
  ZINF_ASSIGN_OR_RETURN(config::Config config, MakeConfig({.stage = 1, .job_id = "registered"}, dir));
  return ZeroEngine::Create(World(), config, model.Params(!groups.empty()), Options(groups));
}

// Hands every parameter's gradient of step `step`, last parameter first.
Status HandGradients(ZeroEngine& engine, std::int64_t step) {
  std::vector<float> grad(kNumel);
  for (std::size_t p = kNumParams; p-- > 0;) {
    for (std::uint64_t k = 0; k < kNumel; ++k) grad[k] = Grad(p, k, World().rank(), step);
    ZINF_RETURN_IF_ERROR(engine.GradientReady(p, grad));
  }
  return OkStatus();
}

Status StepReference(ZeroEngine& engine, Model& model, std::int64_t step) {
  for (std::size_t p = 0; p < kNumParams; ++p) {
    for (std::uint64_t k = 0; k < kNumel; ++k) model.g[p][k] = Grad(p, k, World().rank(), step);
  }
  ZINF_RETURN_IF_ERROR(engine.Step());
  return OkStatus();
}

void ExpectNear(std::span<const float> got, std::span<const float> want, std::string_view what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-30, worst_err = -1;
  std::size_t worst = 0;
  for (std::size_t k = 0; k < want.size(); ++k) {
    scale = std::max(scale, std::abs(static_cast<double>(want[k])));
    const double err =
        std::isnan(got[k]) ? HUGE_VAL : std::abs(static_cast<double>(got[k]) - want[k]);
    if (err > worst_err) {
      worst_err = err;
      worst = k;
    }
  }
  EXPECT_NEAR(got[worst], want[worst], kRelTol * scale)
      << what << ", element " << worst << " of " << want.size();
}

// Gathers parameter p alone, checks its weights against `want` and releases it; returns what
// the Gather did to the counters.
Result<GatherCounters> GatherAndCheck(ZeroEngine& engine, std::size_t p,
                                      std::span<const float> want, std::string_view when) {
  const GatherCounters before = engine.gather_counters();
  const std::vector<std::string> names = {Name(p)};
  ZINF_ASSIGN_OR_RETURN(Gathered gathered, engine.Gather(std::span<const std::string>(names)));
  ExpectNear(gathered[0], want, fmt::format("{}: {}", when, Name(p)));
  return Delta(engine.gather_counters(), before);
}

// One step of the loop that gathers w0 .. w5 one at a time (checking each against the
// reference's weights before its step), then steps both engines. Returns the step's counters.
Result<GatherCounters> RunStep(ZeroEngine& engine, ZeroEngine& reference, Model& model,
                               std::int64_t step) {
  const GatherCounters before = engine.gather_counters();
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_RETURN_IF_ERROR(GatherAndCheck(engine, p, model.w[p], fmt::format("step {}", step)));
  }
  ZINF_RETURN_IF_ERROR(HandGradients(engine, step));
  ZINF_RETURN_IF_ERROR(engine.Step());
  ZINF_RETURN_IF_ERROR(StepReference(reference, model, step));
  const GatherCounters& now = engine.gather_counters();
  return GatherCounters{.calls = now.calls - before.calls,
                        .gathered = now.gathered - before.gathered,
                        .prefetched = now.prefetched - before.prefetched,
                        .disk_reads = now.disk_reads - before.disk_reads,
                        .read_ahead = now.read_ahead - before.read_ahead};
}

// ---------------------------------------------------------------------------------------------
// 1. What the reader thread read ahead of a Step or a Load is never served after it.

// Shards on disk, nothing gathered ahead of its ask (stage3_max_live_parameters 1: the
// all-gathers are the asks alone, and nothing stays gathered), the reader two shards ahead.
Setup ReadAheadSetup() {
  return {.offload_param = "nvme",
          .max_in_cpu = 0,
          .buffer_count = 2,
          .prefetch_bucket = 1'000'000,
          .max_live = 1};
}

// Step 2 gathers w0 and w1 only: the reader has read w2 and w3 (the recorded order's next) when
// the step changes the master. Step 3 asks for w2 first: a fresh read, with the new weights.
TEST(Stage3ReadAhead, AShardReadBeforeAStepIsNeverServedAfterIt) {
  SharedScratchDir dir("stage3-readahead");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, MakeConfig(ReadAheadSetup(), dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), config, LentParams(), Options()));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir));
  ZINF_ASSERT_OK(RunStep(*engine, *reference, model, 1));

  // The end of step 1 queued w0 and w1; the Gather of w0 queues w2, that of w1 w3.
  ZINF_ASSERT_OK_AND_ASSIGN(GatherCounters d, GatherAndCheck(*engine, 0, model.w[0], "step 2"));
  EXPECT_EQ(d.read_ahead, 1u) << Show(d);
  ZINF_ASSERT_OK_AND_ASSIGN(d, GatherAndCheck(*engine, 1, model.w[1], "step 2"));
  EXPECT_EQ(d.read_ahead, 1u) << "the read-ahead is not running: the test shows nothing. "
                              << Show(d);
  ZINF_ASSERT_OK(HandGradients(*engine, 2));
  ZINF_ASSERT_OK(engine->Step());
  ZINF_ASSERT_OK(StepReference(*reference, model, 2));

  // Another order than step 2's (which recorded w0, w1): w2 and w3 are read now.
  for (std::size_t p : {2, 3}) {
    ZINF_ASSERT_OK_AND_ASSIGN(d, GatherAndCheck(*engine, p, model.w[p], "after step 2"));
    EXPECT_EQ(d.disk_reads, 1u) << Show(d);
    EXPECT_EQ(d.read_ahead, 0u) << Name(p) << " was served from a read made before step 2. "
                                << Show(d);
  }
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], "after step 2, all"));
  }
  ZINF_ASSERT_OK(HandGradients(*engine, 3));
  ZINF_ASSERT_OK(engine->Step());
  ZINF_ASSERT_OK(StepReference(*reference, model, 3));
  ZINF_ASSERT_OK(RunStep(*engine, *reference, model, 4));
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], "after step 4"));
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(reference->Close());
}

// The end of step 2 queued the reads of w0 and w1 (step 2's weights); Load then restores step
// 1's. The Gathers after it read step 1's weights, the first one afresh.
TEST(Stage3ReadAhead, AShardReadBeforeALoadIsNeverServedAfterIt) {
  SharedScratchDir dir("stage3-readahead-load");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, MakeConfig(ReadAheadSetup(), dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), config, LentParams(), Options()));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir));
  ZINF_ASSERT_OK(RunStep(*engine, *reference, model, 1));
  ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpointInfo saved, engine->SaveCheckpoint());
  const Model at_step_1 = model;
  ZINF_ASSERT_OK(RunStep(*engine, *reference, model, 2));

  ZINF_ASSERT_OK(engine->Load(saved.path));
  EXPECT_EQ(engine->step_count(), 1);
  ZINF_ASSERT_OK_AND_ASSIGN(GatherCounters d,
                            GatherAndCheck(*engine, 0, at_step_1.w[0], "after the load"));
  EXPECT_EQ(d.read_ahead, 0u) << "w0 was served from a read made before the load. " << Show(d);
  // The recorded order goes on: w1 was read ahead after the load, with its weights.
  ZINF_ASSERT_OK_AND_ASSIGN(d, GatherAndCheck(*engine, 1, at_step_1.w[1], "after the load"));
  EXPECT_EQ(d.read_ahead, 1u) << Show(d);
  for (std::size_t p = 2; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, at_step_1.w[p], "after the load"));
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(reference->Close());
}

// ---------------------------------------------------------------------------------------------
// 2. offload_param.max_in_cpu: the shards that fit stay in memory and carry the new weights.

class Stage3MaxInCpu : public ::testing::TestWithParam<int> {};

// max_in_cpu = 2 shards: w0 and w1 in memory, w1's shard ending exactly at the limit; one
// element less: w0 only. The rest are read from the swap store at every Gather.
TEST_P(Stage3MaxInCpu, ShardsUpToTheLimitStayInMemoryWithTheNewWeights) {
  const std::uint64_t limit = 2 * ShardNumel() - static_cast<std::uint64_t>(GetParam());
  const std::uint64_t in_memory = GetParam() == 0 ? 2 : 1;
  SharedScratchDir dir("stage3-max-in-cpu");
  ZINF_ASSERT_OK_AND_ASSIGN(
      config::Config config,
      MakeConfig({.offload_param = "nvme", .max_in_cpu = limit, .max_live = 1}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), config, LentParams(), Options()));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir));
  for (std::int64_t step = 1; step <= 3; ++step) {
    ZINF_ASSERT_OK_AND_ASSIGN(GatherCounters d, RunStep(*engine, *reference, model, step));
    EXPECT_EQ(d.gathered, kNumParams) << Show(d);
    EXPECT_EQ(d.disk_reads, kNumParams - in_memory) << "max_in_cpu " << limit << ". " << Show(d);
  }
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], "after step 3"));
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(reference->Close());
}

INSTANTIATE_TEST_SUITE_P(Limits, Stage3MaxInCpu, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return p.param == 0 ? "ExactlyTwoShards" : "OneElementLess";
                         });

// ---------------------------------------------------------------------------------------------
// 3. stage3_max_reuse_distance and offload_param.buffer_count.

// The loop asks for w0, w1, w0 (each released before the next ask): between the two asks of w0
// lie kNumel elements of gathers. A distance of kNumel keeps w0 gathered for its second ask; one
// element less drops it, and the second ask all-gathers it again.
TEST(Stage3Bounds, ReuseDistanceKeepsAParameterUsedAgainWithinIt) {
  SharedScratchDir dir("stage3-reuse");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config within,
                            MakeConfig({.reuse_distance = kNumel, .job_id = "within"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config beyond,
                            MakeConfig({.reuse_distance = kNumel - 1, .job_id = "beyond"}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto kept,
                            ZeroEngine::Create(World(), within, LentParams(), Options()));
  ZINF_ASSERT_OK_AND_ASSIGN(auto dropped,
                            ZeroEngine::Create(World(), beyond, LentParams(), Options()));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir));
  for (std::int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    for (ZeroEngine* engine : {kept.get(), dropped.get()}) {
      const GatherCounters before = engine->gather_counters();
      for (std::size_t p : {0, 1, 0}) {
        ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], fmt::format("step {}", step)));
      }
      const std::uint64_t gathered = engine->gather_counters().gathered - before.gathered;
      EXPECT_EQ(engine->gather_counters().prefetched, 0u);
      // Step 1 records the order; from step 2 on it is followed.
      const std::uint64_t want = step == 1 || engine == dropped.get() ? 3 : 2;
      EXPECT_EQ(gathered, want) << (engine == kept.get() ? "distance kNumel"
                                                         : "distance kNumel - 1");
      ZINF_ASSERT_OK(HandGradients(*engine, step));
      ZINF_ASSERT_OK(engine->Step());
    }
    ZINF_ASSERT_OK(StepReference(*reference, model, step));
  }
  ZINF_EXPECT_OK(kept->Close());
  ZINF_EXPECT_OK(dropped->Close());
  ZINF_EXPECT_OK(reference->Close());
}

class Stage3BufferCount : public ::testing::TestWithParam<std::uint64_t> {};

// Every shard on disk and a prefetch bucket that holds them all: buffer_count alone bounds how
// many shards a Gather all-gathers ahead of use and how many the reader reads ahead. At the
// first Gather of step 2 the reader holds the first buffer_count shards of the order (queued at
// the end of step 1); the Gather asks for w0 and gathers the next buffer_count ahead.
TEST_P(Stage3BufferCount, BoundsTheShardsReadAndGatheredAhead) {
  const std::uint64_t count = GetParam();
  SharedScratchDir dir("stage3-buffer-count");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config, MakeConfig({.offload_param = "nvme",
                                                       .max_in_cpu = 0,
                                                       .buffer_count = count,
                                                       .prefetch_bucket = 1'000'000},
                                                      dir));
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine,
                            ZeroEngine::Create(World(), config, LentParams(), Options()));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir));
  ZINF_ASSERT_OK(RunStep(*engine, *reference, model, 1));
  for (std::int64_t step = 2; step <= 3; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    for (std::size_t p = 0; p < kNumParams; ++p) {
      ZINF_ASSERT_OK_AND_ASSIGN(
          GatherCounters d, GatherAndCheck(*engine, p, model.w[p], fmt::format("step {}", step)));
      EXPECT_LE(d.prefetched, count) << Name(p) << ". " << Show(d);
      if (p == 0) {
        EXPECT_EQ(d.prefetched, count) << Show(d);
        EXPECT_EQ(d.read_ahead, count) << Show(d);
        EXPECT_EQ(d.disk_reads, count + 1) << Show(d);
      }
    }
    ZINF_ASSERT_OK(HandGradients(*engine, step));
    ZINF_ASSERT_OK(engine->Step());
    ZINF_ASSERT_OK(StepReference(*reference, model, step));
  }
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], "after step 3"));
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(reference->Close());
}

INSTANTIATE_TEST_SUITE_P(Counts, Stage3BufferCount, ::testing::Values(1u, 2u));

// ---------------------------------------------------------------------------------------------
// 4. Parameter groups whose runs begin exactly where a sub-group begins (the previous one's
// end): w1, w3, w5 in group 1. Sub-groups of one shard (every group boundary on a sub-group
// boundary) and of two (every other one inside a sub-group).

class Stage3GroupBoundaries : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(Stage3GroupBoundaries, GroupRunsStartingAtASubGroupsEndStepWithTheirOwnValues) {
  const std::vector<ParamGroup> groups = {
      {}, {.lr = 0.004, .betas = std::array{0.8, 0.95}, .eps = 1e-6, .weight_decay = 0.0}};
  SharedScratchDir dir("stage3-group-boundaries");
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config,
                            MakeConfig({.sub_group_size = GetParam() * ShardNumel()}, dir));
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto engine,
      ZeroEngine::Create(World(), config, LentParams(/*grouped=*/true), Options(groups)));
  Model model;
  ZINF_ASSERT_OK_AND_ASSIGN(auto reference, CreateReference(model, dir, groups));
  for (std::int64_t step = 1; step <= 3; ++step) {
    ZINF_ASSERT_OK(RunStep(*engine, *reference, model, step));
  }
  for (std::size_t p = 0; p < kNumParams; ++p) {
    ZINF_ASSERT_OK(GatherAndCheck(*engine, p, model.w[p], "after step 3"));
  }
  ZINF_EXPECT_OK(engine->Close());
  ZINF_EXPECT_OK(reference->Close());
}

INSTANTIATE_TEST_SUITE_P(ShardsPerSubGroup, Stage3GroupBoundaries, ::testing::Values(1u, 2u));

}  // namespace
}  // namespace zinf::engine
