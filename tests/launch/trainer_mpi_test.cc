// The trainer (tools/train/trainer.h) in process: command-line overrides of the config, and short
// runs of the synthetic and charlm models (loss falls, checkpoint + resume reproduces the
// uninterrupted run bitwise, errors are the same on every rank). Runs under mpirun with 1-3 ranks.
#include <malloc.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "train/trainer.h"

namespace zinf::train {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

// A small synthetic run: 3 sub-groups per rank, pipelined swapper, a checkpoint every 4 steps.
std::string SyntheticConfig(const std::string& dir, int steps) {
  nlohmann::json config = {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
      {"zero_optimization",
       {{"stage", 1},
        {"sub_group_size", 4096},
        {"offload_optimizer",
         {{"device", "nvme"},
          {"nvme_path", dir + "/swap"},
          {"buffer_count", 12},
          {"pipeline_read", true}}}}},
      {"zinf",
       {{"model", {{"name", "synthetic"}, {"total_params", 30000}, {"num_params", 3}}},
        {"steps", steps},
        {"checkpoint", {{"dir", dir + "/ckpt"}, {"every", 4}}}}}};
  return config.dump();
}

// Rank 0 writes `text` to `path`; every rank returns after a barrier.
void WriteShared(const std::string& path, const std::string& text) {
  if (World().rank() == 0) std::ofstream(path) << text;
  ASSERT_TRUE(World().Barrier().has_value());
}

std::vector<nlohmann::json> ReadMetrics(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(BuildTrainConfig, FlagsOverrideTheFileAndAreValidatedLikeKeys) {
  SharedScratchDir dir("trainer-config");
  const std::string path = dir.Join("c.json");
  WriteShared(path, SyntheticConfig(dir.path(), 10));
  ConfigOverrides o;
  o.steps = 7;
  o.nvme_path = std::vector<std::string>{"/a{local_rank}", "/b"};
  o.checkpoint_every = 3;
  o.keep_last = 2;
  o.hidden = 10;
  o.layers = 4;
  o.seed = 99;
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, BuildTrainConfig(World(), path, o));
  EXPECT_EQ(config.steps, 7);
  EXPECT_EQ(config.zero_optimization.offload_optimizer.nvme_path,
            (std::vector<std::string>{"/a{local_rank}", "/b"}));
  EXPECT_EQ(config.zinf.checkpoint.every, 3);
  EXPECT_EQ(config.zinf.checkpoint.keep_last, 2);
  EXPECT_EQ(config.zinf.checkpoint.dir, dir.Join("ckpt"));  // from the file
  EXPECT_EQ(config.seed, 99);
  // synthetic: --layers 4 --hidden 10 -> 4 tensors of 10 x 10.
  EXPECT_EQ(config.model.total_params, 400u);
  EXPECT_EQ(config.model.num_params, 4);

  ConfigOverrides bad;
  bad.checkpoint_every = 0;
  EXPECT_THAT(BuildTrainConfig(World(), path, bad),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("config " + path + ": zinf.checkpoint.every: 0 is out of range")));
  ConfigOverrides model;
  model.model = "gpt";
  EXPECT_THAT(BuildTrainConfig(World(), path, model),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("zinf.model.name")));
}

TEST(BuildTrainConfig, BuiltInDefaultAndFileErrors) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, BuildTrainConfig(World(), "", {}));
  EXPECT_EQ(config.model.name, ModelName::kCharLM);
  EXPECT_EQ(config.zero_optimization.offload_optimizer.nvme_path,
            std::vector<std::string>{"zinf-swap"});
  EXPECT_THAT(BuildTrainConfig(World(), "/nonexistent/zinf.json", {}),
              StatusIs(ErrorCode::kNotFound, HasSubstr("/nonexistent/zinf.json")));
  SharedScratchDir dir("trainer-syntax");
  WriteShared(dir.Join("bad.json"), "{\"train_micro_batch_size_per_gpu\": 2,\n  oops}");
  EXPECT_THAT(BuildTrainConfig(World(), dir.Join("bad.json"), {}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("line 2")));
  ConfigOverrides resume;
  resume.resume = "latest";
  EXPECT_THAT(BuildTrainConfig(World(), "", resume),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("zinf.checkpoint.dir is not set")));
}

TEST(Train, ResumeReproducesTheUninterruptedRunBitwise) {
  SharedScratchDir dir("trainer-resume");
  for (const char* sub : {"/swap", "/ckpt"}) {
    if (World().rank() == 0) std::filesystem::create_directories(dir.path() + sub);
  }
  const std::string path = dir.Join("c.json");
  WriteShared(path, SyntheticConfig(dir.path(), 12));
  // Uninterrupted: 12 steps (checkpoints at 4, 8, 12).
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig full, BuildTrainConfig(World(), path, {}));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary a,
                            Train(World(), full, {.metrics_path = dir.Join("a.jsonl")}));
  EXPECT_EQ(a.first_step, 1);
  EXPECT_EQ(a.last_step, 12);
  EXPECT_EQ(a.last_checkpoint, dir.Join("ckpt/step-12.h5"));
  // Interrupted after 4 in another checkpoint dir, then resumed from its latest to 12.
  ConfigOverrides first;
  first.steps = 4;
  first.checkpoint_dir = dir.Join("ckpt2");
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig part1, BuildTrainConfig(World(), path, first));
  ZINF_ASSERT_OK(Train(World(), part1, {.metrics_path = dir.Join("b.jsonl")}));
  ConfigOverrides second;
  second.checkpoint_dir = dir.Join("ckpt2");
  second.resume = "latest";
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig part2, BuildTrainConfig(World(), path, second));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary b,
                            Train(World(), part2, {.metrics_path = dir.Join("b.jsonl")}));
  EXPECT_EQ(b.first_step, 5);
  EXPECT_EQ(b.resumed_from, dir.Join("ckpt2/step-4.h5"));
  if (World().rank() == 0) {
    const std::vector<nlohmann::json> ma = ReadMetrics(dir.Join("a.jsonl"));
    const std::vector<nlohmann::json> mb = ReadMetrics(dir.Join("b.jsonl"));
    ASSERT_EQ(ma.size(), 12u);
    ASSERT_EQ(mb.size(), 12u);  // the resumed run appended steps 5..12
    for (std::size_t i = 0; i < ma.size(); ++i) {
      EXPECT_EQ(mb[i]["step"], ma[i]["step"]);
      EXPECT_EQ(mb[i]["loss"].get<double>(), ma[i]["loss"].get<double>()) << "step " << i + 1;
      EXPECT_EQ(mb[i]["grad_norm"].get<double>(), ma[i]["grad_norm"].get<double>());
    }
    // The swap bytes are counted by the stores: without gradient swapping, every step reads and
    // writes the whole state (12 bytes per parameter, plus alignment padding), all of it in the
    // optimizer step.
    for (const nlohmann::json& m : ma) {
      const auto read = m["swap_read_bytes"].get<std::uint64_t>();
      EXPECT_EQ(read, ma.front()["swap_read_bytes"].get<std::uint64_t>()) << m.dump();
      EXPECT_EQ(m["swap_write_bytes"].get<std::uint64_t>(), read) << m.dump();
      EXPECT_EQ(m["optimizer_swap_read_bytes"].get<std::uint64_t>(), read) << m.dump();
      EXPECT_EQ(m["optimizer_swap_write_bytes"].get<std::uint64_t>(), read) << m.dump();
      EXPECT_GE(read, 12u * 30000u) << m.dump();
      EXPECT_LE(read, 12u * 30000u + 64u * 1024u) << m.dump();
    }
    // The synthetic pseudo-loss (0.5 mean w^2) falls under Adam.
    EXPECT_LT(ma.back()["loss"].get<double>(), 0.8 * ma.front()["loss"].get<double>());
  }
  // --steps below the checkpoint's step: nothing to do, not an error.
  ConfigOverrides done = second;
  done.steps = 8;
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig part3, BuildTrainConfig(World(), path, done));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary c, Train(World(), part3));
  EXPECT_EQ(c.first_step, 13);
  EXPECT_EQ(c.last_step, 12);
}

// zinf.swap_gradients reduce-scatters every micro-batch and accumulates the partitions in the
// gradient swapper; without it the micro-batches accumulate in the replicated gradient. Only the
// order of the float sums differs.
TEST(Train, SwapGradientsMatchesInMemoryAccumulation) {
  SharedScratchDir dir("trainer-swapgrad");
  if (World().rank() == 0) std::filesystem::create_directories(dir.Join("swap"));
  std::vector<nlohmann::json> runs[2];
  for (const bool swap : {false, true}) {
    nlohmann::json config = nlohmann::json::parse(SyntheticConfig(dir.path(), 6));
    config["gradient_accumulation_steps"] = 3;
    config["zinf"]["swap_gradients"] = swap;
    config["zinf"].erase("checkpoint");
    const std::string tag = swap ? "swap" : "memory";
    const std::string path = dir.Join(tag + ".json");
    WriteShared(path, config.dump());
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig train, BuildTrainConfig(World(), path, {}));
    ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary summary,
                              Train(World(), train, {.metrics_path = dir.Join(tag + ".jsonl")}));
    EXPECT_EQ(summary.last_step, 6);
    if (World().rank() == 0) runs[swap ? 1 : 0] = ReadMetrics(dir.Join(tag + ".jsonl"));
  }
  if (World().rank() != 0) return;
  ASSERT_EQ(runs[0].size(), 6u);
  ASSERT_EQ(runs[1].size(), 6u);
  for (std::size_t i = 0; i < runs[0].size(); ++i) {
    const double a = runs[0][i]["loss"].get<double>();
    const double b = runs[1][i]["loss"].get<double>();
    EXPECT_NEAR(b, a, 1e-5 * std::abs(a)) << "step " << i + 1;
    EXPECT_NEAR(runs[1][i]["grad_norm"].get<double>(), runs[0][i]["grad_norm"].get<double>(),
                1e-5 * runs[0][i]["grad_norm"].get<double>())
        << "step " << i + 1;
  }
}

// Issue 42: at zero_optimization.stage 3 the models' parameters are partitioned (registered
// without buffers, gathered a layer at a time, gradients lent per parameter): with
// offload_param nvme (every shard read from the swap store: max_in_cpu 0), cpu and none, the run
// trains as the same run at stage 2 does, up to the order of float sums (the gradients are
// reduced per parameter instead of over the flat buffer). Before, offload_param nvme failed in
// the engine with "no parameter is partitioned".
struct Stage3Case {
  const char* name;
  nlohmann::json model;
  const char* offload_param;  // device
  int accumulation;
};

TEST(Train, Stage3TrainsAsStage2) {
  SharedScratchDir dir("trainer-stage3");
  if (World().rank() == 0) std::filesystem::create_directories(dir.Join("swap"));
  const Stage3Case cases[] = {
      {"synthetic-nvme",
       {{"name", "synthetic"}, {"total_params", 30000}, {"num_params", 5}},
       "nvme",
       1},
      {"charlm-nvme",
       {{"name", "charlm"}, {"hidden", 24}, {"layers", 2}, {"context", 6}, {"embed_dim", 4}},
       "nvme",
       2},
      {"charlm-cpu",
       {{"name", "charlm"}, {"hidden", 24}, {"layers", 1}, {"context", 6}, {"embed_dim", 4}},
       "cpu",
       1},
      {"synthetic-none",
       {{"name", "synthetic"}, {"total_params", 20000}, {"num_params", 3}},
       "none",
       2},
  };
  constexpr int kSteps = 8;
  for (const Stage3Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<nlohmann::json> runs[2];
    for (const int stage : {2, 3}) {
      nlohmann::json config = nlohmann::json::parse(SyntheticConfig(dir.path(), kSteps));
      config["train_micro_batch_size_per_gpu"] = 16;
      config["gradient_accumulation_steps"] = c.accumulation;
      config["zinf"]["model"] = c.model;
      config["zinf"].erase("checkpoint");
      nlohmann::json& zero = config["zero_optimization"];
      zero["stage"] = stage;
      zero["sub_group_size"] = 2048;
      if (stage == 3) {
        zero["stage3_param_persistence_threshold"] = 0;
        zero["offload_param"] = {{"device", c.offload_param}, {"max_in_cpu", 0}};
      }
      const std::string tag = std::string(c.name) + "-" + std::to_string(stage);
      const std::string path = dir.Join(tag + ".json");
      WriteShared(path, config.dump());
      ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig train, BuildTrainConfig(World(), path, {}));
      ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary summary,
                                Train(World(), train, {.metrics_path = dir.Join(tag + ".jsonl")}));
      EXPECT_EQ(summary.last_step, kSteps);
      if (World().rank() == 0) runs[stage - 2] = ReadMetrics(dir.Join(tag + ".jsonl"));
    }
    if (World().rank() != 0) continue;
    ASSERT_EQ(runs[0].size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(runs[1].size(), static_cast<std::size_t>(kSteps));
    for (std::size_t i = 0; i < runs[0].size(); ++i) {
      const double a = runs[0][i]["loss"].get<double>();
      const double b = runs[1][i]["loss"].get<double>();
      EXPECT_NEAR(b, a, 1e-5 * std::abs(a)) << "step " << i + 1;
      const double na = runs[0][i]["grad_norm"].get<double>();
      EXPECT_NEAR(runs[1][i]["grad_norm"].get<double>(), na, 1e-5 * na) << "step " << i + 1;
      // With offload_param nvme the shards are read from the swap store outside the optimizer
      // step: the parameters really are partitioned and offloaded.
      const auto read = runs[1][i]["swap_read_bytes"].get<std::uint64_t>();
      const auto optimizer_read = runs[1][i]["optimizer_swap_read_bytes"].get<std::uint64_t>();
      if (std::string(c.offload_param) == "nvme") {
        EXPECT_GT(read, optimizer_read) << "step " << i + 1;
      }
    }
    // The loss falls: the mean of the last three steps below the first step's (charlm's single
    // batches are noisy).
    double tail = 0;
    for (std::size_t i = runs[1].size() - 3; i < runs[1].size(); ++i) {
      tail += runs[1][i]["loss"].get<double>() / 3;
    }
    EXPECT_LT(tail, runs[1].front()["loss"].get<double>());
  }
}

// Issue 42: at zero_optimization.stage 2 the gradients are partitioned: the models' weights are
// registered whole but their gradients lent, each handed to the engine by the layered pass
// (Model::ForwardBackwardLayered over the working weights) as the backward pass completes it,
// so no rank holds the whole gradient. The run trains as the same run at stage 1 does (the
// whole gradient in a registered buffer), up to the order of float sums, with accumulation and
// fp16; and the engine's host memory plan (metrics plan_bytes) holds about the model's fp32
// size less than stage 1's: the gradient buffer is gone. Before, stages 1 and 2 ran the same
// code.
struct Stage2Case {
  const char* name;
  nlohmann::json model;
  int accumulation;
  bool fp16;
};

TEST(Train, Stage2HandsGradientsAsTheyComplete) {
  SharedScratchDir dir("trainer-stage2");
  if (World().rank() == 0) std::filesystem::create_directories(dir.Join("swap"));
  const Stage2Case cases[] = {
      {"synthetic", {{"name", "synthetic"}, {"total_params", 30000}, {"num_params", 5}}, 2, false},
      {"charlm",
       {{"name", "charlm"}, {"hidden", 24}, {"layers", 2}, {"context", 6}, {"embed_dim", 4}},
       2,
       false},
      {"charlm-fp16",
       {{"name", "charlm"}, {"hidden", 24}, {"layers", 1}, {"context", 6}, {"embed_dim", 4}},
       1,
       true},
      // 32 MiB of fp32 weights: the plan's gradient buffer stands out of the process's RSS.
      {"synthetic-8m",
       {{"name", "synthetic"}, {"total_params", 1 << 23}, {"num_params", 8}},
       1,
       false},
  };
  constexpr int kSteps = 6;
  for (const Stage2Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<nlohmann::json> runs[2];
    for (const int stage : {1, 2}) {
      nlohmann::json config = nlohmann::json::parse(SyntheticConfig(dir.path(), kSteps));
      config["train_micro_batch_size_per_gpu"] = 16;
      config["gradient_accumulation_steps"] = c.accumulation;
      config["zinf"]["model"] = c.model;
      config["zinf"].erase("checkpoint");
      if (c.fp16) config["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
      nlohmann::json& zero = config["zero_optimization"];
      zero["stage"] = stage;
      zero["sub_group_size"] = 1 << 16;
      zero["reduce_bucket_size"] = 1 << 19;
      zero["allgather_bucket_size"] = 1 << 19;
      // The plans compared below are about the lent gradient: the speculative step (on at
      // stage 2 by default) adds the speculated weights, an item of its own.
      if (c.model["name"] == "synthetic" &&
          c.model["total_params"].get<std::int64_t>() >= (1 << 20)) {
        config["zinf"]["speculative_step"] = false;
      }
      const std::string tag = std::string(c.name) + "-" + std::to_string(stage);
      const std::string path = dir.Join(tag + ".json");
      WriteShared(path, config.dump());
      ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig train, BuildTrainConfig(World(), path, {}));
      // The plan counts the process's RSS before the engine: without what the allocator keeps
      // of the previous runs.
      malloc_trim(0);
      ZINF_ASSERT_OK_AND_ASSIGN(TrainSummary summary,
                                Train(World(), train, {.metrics_path = dir.Join(tag + ".jsonl")}));
      EXPECT_EQ(summary.last_step, kSteps);
      if (World().rank() == 0) runs[stage - 1] = ReadMetrics(dir.Join(tag + ".jsonl"));
    }
    if (World().rank() != 0) continue;
    ASSERT_EQ(runs[0].size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(runs[1].size(), static_cast<std::size_t>(kSteps));
    for (std::size_t i = 0; i < runs[0].size(); ++i) {
      const double a = runs[0][i]["loss"].get<double>();
      EXPECT_NEAR(runs[1][i]["loss"].get<double>(), a, 1e-5 * std::abs(a)) << "step " << i + 1;
      const double na = runs[0][i]["grad_norm"].get<double>();
      EXPECT_NEAR(runs[1][i]["grad_norm"].get<double>(), na, 1e-5 * na) << "step " << i + 1;
      EXPECT_EQ(runs[1][i]["skipped"], runs[0][i]["skipped"]) << "step " << i + 1;
    }
    const std::int64_t total = c.model["name"] == "synthetic"
                                   ? c.model["total_params"].get<std::int64_t>()
                                   : std::int64_t{0};
    if (total >= (1 << 20)) {
      // Stage 1 registers the whole fp32 gradient, stage 2 only lends it a bucket at a time.
      const auto plan1 = runs[0].back()["plan_bytes"].get<std::int64_t>();
      const auto plan2 = runs[1].back()["plan_bytes"].get<std::int64_t>();
      EXPECT_GT(plan1 - plan2, 4 * total / 2) << "plan " << plan1 << " at stage 1, " << plan2
                                              << " at stage 2, model " << 4 * total << " bytes";
    }
  }
}

TEST(Train, ErrorsAreTheSameOnEveryRank) {
  SharedScratchDir dir("trainer-errors");
  if (World().rank() == 0) std::filesystem::create_directories(dir.Join("swap"));
  const std::string path = dir.Join("c.json");
  WriteShared(path, SyntheticConfig(dir.path(), 2));
  // A checkpoint to resume from that does not exist.
  ConfigOverrides missing;
  missing.resume = "latest";
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, BuildTrainConfig(World(), path, missing));
  EXPECT_THAT(Train(World(), config),
              StatusIs(ErrorCode::kNotFound, HasSubstr("no checkpoint to resume from")));
  // charlm on a data file that does not exist.
  ConfigOverrides data;
  data.model = "charlm";
  data.data = dir.Join("no-such-text");
  ZINF_ASSERT_OK_AND_ASSIGN(config, BuildTrainConfig(World(), path, data));
  EXPECT_THAT(Train(World(), config), StatusIs(ErrorCode::kNotFound, HasSubstr("no-such-text")));
  // A swap path that does not exist (a configured one is never created).
  ConfigOverrides nvme;
  nvme.nvme_path = std::vector<std::string>{dir.Join("unmounted")};
  ZINF_ASSERT_OK_AND_ASSIGN(config, BuildTrainConfig(World(), path, nvme));
  EXPECT_THAT(Train(World(), config), StatusIs(ErrorCode::kNotFound, HasSubstr("unmounted")));
}

}  // namespace
}  // namespace zinf::train
