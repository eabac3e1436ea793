// Tests of the strict DeepSpeed-style config (config/config.h) as zinf-train uses it
// (tools/train/train_config.{h,cc}: the engine's keys plus zinf-train's own).
#include "train/train_config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/status_matchers.h"
#include "zinf/core/units.h"
#include "zinf/config/config.h"
#include "zinf/engine/config_options.h"
#include "zinf/engine/lr_schedule.h"

namespace zinf::train {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::zinf::testing::IsOk;
using ::zinf::testing::StatusIs;
using namespace ::zinf::config;  // NOLINT(google-build-using-namespace): the config's vocabulary
using namespace ::zinf::engine;  // NOLINT(google-build-using-namespace): its schedules and options

// zinf-train's job id: the engine's, over the layout of the model the config describes.
std::string JobIdOf(const TrainConfig& c) {
  Result<CharLM> model = CharLM::Create({.context = c.model.context,
                                         .embed_dim = c.model.embed_dim,
                                         .hidden = c.model.hidden,
                                         .layers = c.model.layers,
                                         .activation = c.model.activation});
  return EffectiveJobId(c, model.value().layout());
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

TEST(TrainConfig, MinimalConfigGetsDeepSpeedDefaults) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            ParseTrainConfig(R"({"train_micro_batch_size_per_gpu": 4})", {}));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 4);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.betas[0], 0.9);
  EXPECT_EQ(c.optimizer.betas[1], 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
  EXPECT_EQ(c.zero_optimization.stage, 1);
  EXPECT_EQ(c.zero_optimization.sub_group_size, 1'000'000'000u);
  const auto& offload = c.zero_optimization.offload_optimizer;
  EXPECT_EQ(offload.device, OffloadDevice::kNone);
  EXPECT_TRUE(offload.nvme_path.empty());
  EXPECT_EQ(offload.buffer_count, 4);
  EXPECT_FALSE(offload.pin_memory);
  EXPECT_FALSE(offload.pipeline_read);
  EXPECT_FALSE(offload.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 1'048'576u);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_EQ(c.zinf.io_engine, storage::IoBackendKind::kAuto);
  EXPECT_EQ(c.zinf.pinned_budget_bytes, 0u);
  EXPECT_EQ(c.model.name, ModelName::kCharLM);
  EXPECT_TRUE(c.zinf.checkpoint.dir.empty());
  // The defaults agree with the option structs of the modules they feed.
  const storage::AioOptions aio_defaults;
  EXPECT_EQ(c.aio.block_size, aio_defaults.block_size);
  EXPECT_EQ(c.aio.queue_depth, aio_defaults.queue_depth);
  EXPECT_EQ(c.aio.overlap_events, aio_defaults.overlap_events);
  const swapper::AdamOptions adam_defaults;
  EXPECT_EQ(c.optimizer.lr, adam_defaults.lr);
  EXPECT_EQ(c.optimizer.eps, adam_defaults.eps);
}

TEST(TrainConfig, FullDeepSpeedConfigParses) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            LoadTrainConfig(ZINF_GOOD_CONFIG_DIR "/deepspeed-full.json",
                                            {.world_size = 1, .local_rank = 3, .node = 2}));
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 5);
  EXPECT_TRUE(c.wall_clock_breakdown);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_FALSE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(c.scheduler.total_num_steps, 2000);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_EQ(c.zero_optimization.stage, 3);
  EXPECT_EQ(c.zero_optimization.sub_group_size, 1'000'000'000u);  // written as 1e9
  const auto& offload = c.zero_optimization.offload_optimizer;
  EXPECT_EQ(offload.device, OffloadDevice::kNvme);
  EXPECT_THAT(offload.nvme_path,
              ::testing::ElementsAre("/local_nvme/{node}/a", "/local_nvme/{node}/b{local_rank}"));
  EXPECT_THAT(offload.resolved_nvme_paths,
              ::testing::ElementsAre("/local_nvme/2/a", "/local_nvme/2/b3"));
  EXPECT_EQ(c.aio.block_size, 262144u);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  // DeepSpeed's checkpoint block and fast_init have no effect in zinf: named, not read.
  EXPECT_THAT(c.ignored_keys,
              ::testing::ElementsAre("checkpoint.load_universal", "checkpoint.tag_validation",
                                     "checkpoint.use_node_local_storage",
                                     "zero_optimization.offload_optimizer.fast_init"));
  EXPECT_EQ(c.zinf.pinned_budget_bytes, 2 * kGiB);
  EXPECT_EQ(c.zinf.io_engine, storage::IoBackendKind::kPosix);
  EXPECT_TRUE(c.zinf.verify_swap);
  EXPECT_EQ(c.zinf.checkpoint.every, 250);
  EXPECT_EQ(c.zinf.checkpoint.keep_last, 3);
  EXPECT_EQ(c.zinf.checkpoint.load, "auto");
  EXPECT_EQ(c.model.hidden, 512);
  EXPECT_EQ(c.model.activation, Activation::kRelu);
  EXPECT_EQ(ActivationName(c.model.activation), "relu");
  EXPECT_EQ(c.data_path, "/data/text.txt");

  const swapper::SwapperOptions options =
      ToSwapperOptions(c, 5, partition::ParamLayout::Create({{"w", {4}}}).value());
  EXPECT_THAT(options.store.paths, ::testing::ElementsAre("/local_nvme/2/a", "/local_nvme/2/b3"));
  EXPECT_EQ(options.store.job_id, "run-42");
  EXPECT_EQ(options.store.world_rank, 5);
  EXPECT_TRUE(options.store.keep);
  EXPECT_TRUE(options.store.verify_swap);
  EXPECT_EQ(options.aio.block_size, 262144u);
  EXPECT_EQ(options.aio.queue_depth, 32);
  EXPECT_EQ(options.aio.intra_op_parallelism, 2);
  EXPECT_EQ(options.backend, storage::IoBackendKind::kPosix);
  EXPECT_EQ(options.pinned_budget_bytes, 2 * kGiB);
  EXPECT_EQ(options.buffer_count, 12u);
  EXPECT_TRUE(options.pin_memory);
  EXPECT_TRUE(options.pipeline_read);
  EXPECT_TRUE(options.pipeline_write);
  EXPECT_TRUE(options.bf16_params);
  EXPECT_EQ(options.gradient_accumulation_steps, 8);
  EXPECT_EQ(options.adam.lr, 3e-4);
  EXPECT_EQ(options.adam.beta2, 0.95);
  EXPECT_EQ(options.adam.weight_decay, 0.01);
  EXPECT_FALSE(options.adam.adamw);  // Adam with adam_w_mode false: L2 penalty
  EXPECT_EQ(ToPlanKind(c), partition::PlanKind::kPerParam);
}

TEST(TrainConfig, AdamWModeFollowsDeepSpeed) {
  auto adamw = [](const char* json) {
    auto c = ParseTrainConfig(json, {});
    EXPECT_TRUE(c.has_value()) << c.error().ToString();
    return c.has_value() && ToAdamOptions(*c).adamw;
  };
  EXPECT_TRUE(adamw(R"({"train_batch_size": 1, "optimizer": {"type": "Adam"}})"));
  EXPECT_FALSE(adamw(R"({"train_batch_size": 1,
      "optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})"));
  EXPECT_TRUE(adamw(R"({"train_batch_size": 1,
      "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})"));
  // Case-insensitive like DeepSpeed; printed canonically.
  ZINF_ASSERT_OK_AND_ASSIGN(
      TrainConfig c,
      ParseTrainConfig(R"({"train_batch_size": 1, "optimizer": {"type": "adamw"}})", {}));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_THAT(EffectiveConfigJson(c), HasSubstr(R"("type": "AdamW")"));
}

struct BatchCase {
  const char* json;
  int world_size;
  std::int64_t batch, micro, gas;
};

TEST(TrainConfig, BatchArithmeticFollowsDeepSpeedsRule) {
  const BatchCase cases[] = {
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2})",
       4, 32, 4, 2},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 4, 32, 4, 2},
      {R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 4, 32, 4, 2},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 4, 32, 4, 2},
      {R"({"train_batch_size": 12})", 3, 12, 4, 1},
      {R"({"train_micro_batch_size_per_gpu": 5})", 3, 15, 5, 1},
      {R"({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3})", 1, 15, 5, 3},
  };
  for (const BatchCase& bc : cases) {
    SCOPED_TRACE(bc.json);
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                              ParseTrainConfig(bc.json, {.world_size = bc.world_size}));
    EXPECT_EQ(c.train_batch_size, bc.batch);
    EXPECT_EQ(c.train_micro_batch_size_per_gpu, bc.micro);
    EXPECT_EQ(c.gradient_accumulation_steps, bc.gas);
    EXPECT_EQ(c.world_size, bc.world_size);
  }
}

TEST(TrainConfig, BatchErrorsNameTheNumbers) {
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                   "gradient_accumulation_steps": 2})",
                               {.world_size = 3}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("train_batch_size: 32 != train_micro_batch_size_per_gpu 4 * "
                                 "gradient_accumulation_steps 2 * world_size 3 = 24")));
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 10})", {.world_size = 4}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("train_batch_size: 10 is not divisible by world_size 4")));
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 32, "gradient_accumulation_steps": 3})",
                               {.world_size = 2}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("32 is not divisible by gradient_accumulation_steps 3 * "
                                 "world_size 2 = 6")));
  EXPECT_THAT(ParseTrainConfig(R"({"train_micro_batch_size_per_gpu": 2000000000,
                                   "gradient_accumulation_steps": 4})",
                               {}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("derived value 8000000000")));
  EXPECT_THAT(ParseTrainConfig("{}", {.world_size = 0}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("world_size 0")));
}

TEST(TrainConfig, NvmePathPlaceholdersExpandPerProcess) {
  const char* json = R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {
      "device": "nvme", "nvme_path": "/nvme{local_rank}/node{node}/x"}}})";
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig a,
                            ParseTrainConfig(json, {.world_size = 8, .local_rank = 0, .node = 0}));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig b,
                            ParseTrainConfig(json, {.world_size = 8, .local_rank = 3, .node = 1}));
  EXPECT_THAT(a.zero_optimization.offload_optimizer.resolved_nvme_paths,
              ::testing::ElementsAre("/nvme0/node0/x"));
  EXPECT_THAT(b.zero_optimization.offload_optimizer.resolved_nvme_paths,
              ::testing::ElementsAre("/nvme3/node1/x"));
  EXPECT_THAT(
      ToSwapperOptions(b, 11, partition::ParamLayout::Create({{"w", {4}}}).value()).store.paths,
      ::testing::ElementsAre("/nvme3/node1/x"));
  // The config as written is what ranks compare and print.
  EXPECT_EQ(ConfigHash(a), ConfigHash(b));
  EXPECT_EQ(EffectiveConfigJson(a), EffectiveConfigJson(b));
  EXPECT_THAT(EffectiveConfigJson(a), HasSubstr("/nvme{local_rank}/node{node}/x"));
}

TEST(TrainConfig, ThreadCountIsTheOldNameOfIntraOpParallelismWithAWarning) {
  ::testing::internal::CaptureStderr();
  auto c = ParseTrainConfig(R"({"train_batch_size": 1, "aio": {"thread_count": 3}})", {});
  const std::string log = ::testing::internal::GetCapturedStderr();
  ZINF_ASSERT_OK(c);
  EXPECT_EQ(c->aio.intra_op_parallelism, 3);
  EXPECT_THAT(log, HasSubstr("aio.thread_count is the old name of aio.intra_op_parallelism"));
  EXPECT_THAT(log, HasSubstr("[warn"));
  // The old name never appears in the effective config.
  EXPECT_THAT(EffectiveConfigJson(*c), Not(HasSubstr("thread_count")));
  EXPECT_THAT(EffectiveConfigJson(*c), HasSubstr(R"("intra_op_parallelism": 3)"));
}

TEST(TrainConfig, SizeStringsAndIntegralFloatsAreAccepted) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseTrainConfig(R"({"train_batch_size": 1,
      "zero_optimization": {"sub_group_size": 5e8},
      "zinf": {"pinned_budget_bytes": "512MiB"}})",
                                                            {}));
  EXPECT_EQ(c.zero_optimization.sub_group_size, 500'000'000u);
  EXPECT_EQ(c.zinf.pinned_budget_bytes, 512 * kMiB);
  ZINF_ASSERT_OK_AND_ASSIGN(
      c, ParseTrainConfig(R"({"train_batch_size": 1, "zinf": {"pinned_budget_bytes": 4096}})", {}));
  EXPECT_EQ(c.zinf.pinned_budget_bytes, 4096u);
}

TEST(TrainConfig, EffectiveConfigRoundTripsAndHasEveryKey) {
  ZINF_ASSERT_OK_AND_ASSIGN(
      TrainConfig c,
      LoadTrainConfig(ZINF_GOOD_CONFIG_DIR "/deepspeed-full.json", {.world_size = 1}));
  const std::string effective = EffectiveConfigJson(c);
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseTrainConfig(effective, {.world_size = 1}));
  EXPECT_EQ(EffectiveConfigJson(again), effective);
  EXPECT_EQ(ConfigHash(again), ConfigHash(c));
  // Defaults are filled in; the order is the schema's (DeepSpeed keys first, zinf last).
  EXPECT_THAT(effective, HasSubstr(R"("overlap_events": true)"));
  EXPECT_THAT(effective, HasSubstr(R"("amsgrad": false)"));
  EXPECT_LT(effective.find("train_batch_size"), effective.find("\"optimizer\""));
  EXPECT_LT(effective.find("\"aio\""), effective.find("\"zinf\""));
  // Only the chosen scheduler's params.
  EXPECT_THAT(effective, HasSubstr("cos_min_ratio"));
  EXPECT_THAT(effective, Not(HasSubstr("warmup_max_lr")));

  // The defaults round-trip too, and no scheduler means no scheduler block.
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig d,
                            ParseTrainConfig(R"({"train_micro_batch_size_per_gpu": 2})", {}));
  EXPECT_THAT(EffectiveConfigJson(d), Not(HasSubstr("scheduler")));
  EXPECT_THAT(EffectiveConfigJson(d), Not(HasSubstr("nvme_path")));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig d2, ParseTrainConfig(EffectiveConfigJson(d), {}));
  EXPECT_EQ(ConfigHash(d2), ConfigHash(d));
}

TEST(TrainConfig, HashChangesWithAnyValue) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig a, ParseTrainConfig(R"({"train_batch_size": 4})", {}));
  ZINF_ASSERT_OK_AND_ASSIGN(
      TrainConfig b,
      ParseTrainConfig(R"({"train_batch_size": 4, "optimizer": {"params": {"lr": 0.002}}})", {}));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            ParseTrainConfig(R"({"train_batch_size": 4})", {.world_size = 2}));
  EXPECT_NE(ConfigHash(a), ConfigHash(b));
  EXPECT_NE(ConfigHash(a), ConfigHash(c));  // different micro batch
  EXPECT_EQ(ConfigHash(a), ConfigHash(a));
  EXPECT_EQ(JobIdOf(a).size(), 15u);
  EXPECT_EQ(JobIdOf(a).substr(0, 3), "cfg");
  // The job id is not the config hash: the learning rate does not identify the job.
  EXPECT_EQ(JobIdOf(a), JobIdOf(b));
}

TEST(TrainConfig, DescribeConfigKeysListsEveryKeyWithDefaultAndRange) {
  const std::string help = DescribeConfigKeys(TrainAppKeys());
  for (const char* key :
       {"train_batch_size", "optimizer.params.betas", "scheduler.params.cos_min_ratio",
        "zero_optimization.offload_optimizer.nvme_path", "aio.thread_count",
        "zinf.checkpoint.keep_last", "zinf.model.name", "zinf.data.path"}) {
    EXPECT_THAT(help, HasSubstr(key));
  }
  EXPECT_THAT(help, HasSubstr("aio.queue_depth (integer, default 8, range [1, 4096])"));
  EXPECT_THAT(help, HasSubstr("aio.block_size (integer, default 1048576"));
  EXPECT_THAT(help, HasSubstr("a multiple of 512"));
  EXPECT_THAT(help, HasSubstr("optimizer.type (one of Adam, AdamW, default \"Adam\")"));
  EXPECT_THAT(help, HasSubstr("scheduler.params.cos_min_ratio (number, default 0.0001"));
  EXPECT_THAT(help, HasSubstr("fp16.initial_scale_power (integer, default 16, range [0, 64])"));
  EXPECT_THAT(help, HasSubstr("scheduler.params.cycle_momentum (boolean, default true, for "
                              "OneCycle)"));
  EXPECT_THAT(help, HasSubstr("DeepSpeed keys accepted with no effect in zinf"));
  EXPECT_THAT(help, HasSubstr("  zero_optimization.overlap_comm: a GPU stream overlap"));
  EXPECT_THAT(help, HasSubstr("DeepSpeed keys zinf refuses"));
  EXPECT_THAT(help, HasSubstr("  amp (refused unless enabled false or absent): zinf has no Apex"));
}

TEST(TrainConfig, MissingFileIsNotFound) {
  EXPECT_THAT(LoadTrainConfig("/nonexistent/zinf/config.json", {}),
              StatusIs(ErrorCode::kNotFound, HasSubstr("/nonexistent/zinf/config.json")));
  EXPECT_THAT(LoadTrainConfig(ZINF_GOOD_CONFIG_DIR, {}),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a regular file")));
}

TEST(TrainConfig, LoadPrefixesErrorsWithThePath) {
  const std::string path = std::string(ZINF_BAD_CONFIG_DIR) + "/15-queue-depth-zero.json";
  EXPECT_THAT(LoadTrainConfig(path, {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("config " + path + ": aio.queue_depth: 0 is out of range")));
}

// ---- Learning-rate schedules. Expected values come from DeepSpeed's lr_schedules.py. ----

TEST(LearningRate, NoSchedulerIsConstant) {
  const SchedulerConfig none;
  EXPECT_EQ(LearningRate(none, 3e-4, 0), 3e-4);
  EXPECT_EQ(LearningRate(none, 3e-4, 123456), 3e-4);
}

TEST(LearningRate, WarmupLRMatchesDeepSpeed) {
  SchedulerConfig s{.type = SchedulerType::kWarmupLR,
                    .warmup_min_lr = 0.0,
                    .warmup_max_lr = 0.01,
                    .warmup_num_steps = 10};
  EXPECT_EQ(LearningRate(s, 1.0, -1), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 0), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 1), 0.0030102999566398113);  // log(2) / log(10) * 0.01
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 9), 0.01);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 50), 0.01);
  s.warmup_type = WarmupType::kLinear;
  s.warmup_min_lr = 1e-4;
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 0), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 1), 0.00109);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 9), 0.00901);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 10), 0.01);
  // warmup_num_steps below 2 counts as 2 (DeepSpeed).
  s.warmup_num_steps = 0;
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 1), 1e-4 + (0.01 - 1e-4) * 0.5);
}

// DeepSpeed >= 0.17.2: WarmupLR and WarmupDecayLR without warmup_max_lr warm up to the
// optimizer's lr, each parameter group to its own; the effective config shows that value.
TEST(LearningRate, WarmupWithoutMaxEndsAtTheOptimizersLr) {
  for (const char* type : {"WarmupLR", "WarmupDecayLR"}) {
    SCOPED_TRACE(type);
    ZINF_ASSERT_OK_AND_ASSIGN(
        TrainConfig c,
        ParseTrainConfig(
            fmt::format(R"({{"train_micro_batch_size_per_gpu": 2,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.002}}}},
            "scheduler": {{"type": "{}", "params": {{"warmup_num_steps": 4,
                "warmup_type": "linear"{}}}}}}})",
                        type,
                        std::string_view(type) == "WarmupLR" ? "" : R"(, "total_num_steps": 100)"),
            {}));
    const SchedulerConfig& s = c.scheduler;
    EXPECT_TRUE(s.warmup_to_group_lr);
    EXPECT_EQ(s.warmup_max_lr, 0.002);
    EXPECT_DOUBLE_EQ(LearningRate(s, 0.002, 4), 0.002);
    EXPECT_DOUBLE_EQ(LearningRate(s, 0.0005, 2), 0.00025);  // another group's lr, half-way
    EXPECT_THAT(EffectiveConfigJson(c), HasSubstr(R"("warmup_max_lr": 0.002)"));
  }
}

// What DeepSpeed's constructors set for the first step (last_batch_iteration -1).
TEST(LearningRate, FirstStepIsTheConstructorsValue) {
  SchedulerConfig s{.type = SchedulerType::kWarmupLR, .warmup_min_lr = 2e-4};
  EXPECT_EQ(LearningRate(s, 1.0, -1), 2e-4);
  s.type = SchedulerType::kWarmupDecayLR;
  EXPECT_EQ(LearningRate(s, 1.0, -1), 2e-4);
  s.type = SchedulerType::kWarmupCosineLR;
  s.warmup_min_ratio = 0.5;
  EXPECT_EQ(LearningRate(s, 1.0, -1), 0.0);
}

// DeepSpeed's OneCycle (lr_schedules.py) worked by hand at chosen last_batch_iterations: min
// 0.1, max 0.5, both halves 4 steps, decay_step_size 2, decay_lr_rate 0.5, momentum 0.85 to
// 0.95 with decay_mom_rate 0.1. The cycle: b = L + 1, x = b / 8 - floor(b / 8), f = x / 0.5
// rising and (x - 1) / (0.5 - 1) falling; after it (L >= 8) d = (L - 7) / 2.
TEST(LearningRate, OneCycleMatchesDeepSpeed) {
  const SchedulerConfig s{.type = SchedulerType::kOneCycle,
                          .cycle_min_lr = 0.1,
                          .cycle_max_lr = 0.5,
                          .decay_lr_rate = 0.5,
                          .cycle_first_step_size = 4,
                          .cycle_second_step_size = 4,
                          .decay_step_size = 2,
                          .cycle_min_mom = 0.85,
                          .cycle_max_mom = 0.95,
                          .decay_mom_rate = 0.1};
  const std::array<double, 2> adam = {0.9, 0.999};
  struct Row {
    std::int64_t l;
    double lr, beta1;
  };
  for (const Row& r : {Row{-1, 0.1, 0.85},  // the constructor: lr min, beta1 cycle_min_mom
                       Row{0, 0.2, 0.925}, Row{1, 0.3, 0.90}, Row{2, 0.4, 0.875},
                       Row{3, 0.5, 0.85},  // the peak: x = 0.5
                       Row{4, 0.4, 0.875}, Row{6, 0.2, 0.925}, Row{7, 0.1, 0.95},
                       Row{8, 0.1 / 1.25, 0.95 * 1.05},   // d = 0.5
                       Row{9, 0.1 / 1.5, 0.95 * 1.1}}) {  // d = 1: beta1 above 1, as DeepSpeed
    SCOPED_TRACE(r.l);
    EXPECT_NEAR(LearningRate(s, 123.0, r.l), r.lr, 1e-15);
    const std::array<double, 2> betas = AdamBetas(s, adam, r.l);
    EXPECT_NEAR(betas[0], r.beta1, 1e-15);
    EXPECT_EQ(betas[1], 0.99);  // DeepSpeed's second beta under OneCycle
  }
  // Without cycle_momentum the optimizer's betas stay; other schedules never touch them.
  SchedulerConfig flat = s;
  flat.cycle_momentum = false;
  EXPECT_EQ(AdamBetas(flat, adam, 3), adam);
  EXPECT_EQ(AdamBetas(SchedulerConfig{.type = SchedulerType::kWarmupLR}, adam, 3), adam);
  // No decay (decay_step_size 0): the cycle's ends hold after it.
  SchedulerConfig no_decay = s;
  no_decay.decay_step_size = 0;
  EXPECT_EQ(LearningRate(no_decay, 1.0, 20), 0.1);
  EXPECT_EQ(AdamBetas(no_decay, adam, 20)[0], 0.95);
  // Unequal halves: 2 up, 6 down; the peak at b = 2.
  SchedulerConfig skew = s;
  skew.cycle_first_step_size = 2;
  skew.cycle_second_step_size = 6;
  EXPECT_NEAR(LearningRate(skew, 1.0, 1), 0.5, 1e-15);
  EXPECT_NEAR(LearningRate(skew, 1.0, 4), 0.1 + 0.4 * (0.625 - 1) / (0.25 - 1), 1e-15);
}

// DeepSpeed's LRRangeTest: min * (1 + rate * (L + 1) / size), floored intervals with the
// staircase.
TEST(LearningRate, LRRangeTestMatchesDeepSpeed) {
  SchedulerConfig s{.type = SchedulerType::kLRRangeTest,
                    .lr_range_test_min_lr = 0.01,
                    .lr_range_test_step_size = 3,
                    .lr_range_test_step_rate = 2};
  EXPECT_NEAR(LearningRate(s, 9.0, -1), 0.01, 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 0), 0.01 * (1 + 2.0 / 3), 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 2), 0.03, 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 5), 0.05, 1e-15);
  s.lr_range_test_staircase = true;
  EXPECT_NEAR(LearningRate(s, 9.0, 0), 0.01, 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 1), 0.01, 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 2), 0.03, 1e-15);
  EXPECT_NEAR(LearningRate(s, 9.0, 5), 0.05, 1e-15);
}

// The config side: OneCycle needs both lrs, the second half defaults to the first, a stair
// count other than 0 is refused, and only OneCycle's params are OneCycle's.
TEST(TrainConfig, OneCycleAndLRRangeTestParse) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseTrainConfig(R"({"train_batch_size": 4,
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                    "cycle_first_step_size": 100, "cycle_first_stair_count": 0}}})",
                                                            {}));
  EXPECT_EQ(c.scheduler.type, SchedulerType::kOneCycle);
  EXPECT_EQ(c.scheduler.cycle_second_step_size, 100);
  EXPECT_TRUE(c.scheduler.cycle_momentum);
  EXPECT_THAT(c.ignored_keys, ::testing::ElementsAre("scheduler.params.cycle_first_stair_count"));
  // The effective config round-trips (the derived second half is written out).
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseTrainConfig(EffectiveConfigJson(c), {}));
  EXPECT_EQ(ConfigHash(again), ConfigHash(c));
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 4, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_stair_count": 3}}})",
                               {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("scheduler.params.cycle_first_stair_count: 3 is not supported")));
  EXPECT_THAT(
      ParseTrainConfig(R"({"train_batch_size": 4, "scheduler": {"type": "LRRangeTest",
      "params": {"cycle_max_lr": 1e-3}}})",
                       {}),
      StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not a parameter of scheduler LRRangeTest")));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig r, ParseTrainConfig(R"({"train_batch_size": 4,
      "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_staircase": true}}})",
                                                            {}));
  EXPECT_EQ(r.scheduler.type, SchedulerType::kLRRangeTest);
  EXPECT_TRUE(r.scheduler.lr_range_test_staircase);
  EXPECT_EQ(r.scheduler.lr_range_test_step_size, 2000);
}

TEST(LearningRate, WarmupDecayLRMatchesDeepSpeed) {
  const SchedulerConfig s{.type = SchedulerType::kWarmupDecayLR,
                          .warmup_min_lr = 0.0,
                          .warmup_max_lr = 0.01,
                          .warmup_num_steps = 10,
                          .warmup_type = WarmupType::kLinear,
                          .total_num_steps = 100};
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 0), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 5), 0.005);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 10), 0.01);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 55), 0.005);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 100), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 1.0, 150), 0.0);
}

TEST(LearningRate, WarmupCosineLRMatchesDeepSpeed) {
  SchedulerConfig s{.type = SchedulerType::kWarmupCosineLR,
                    .warmup_num_steps = 10,
                    .warmup_type = WarmupType::kLinear,
                    .total_num_steps = 110,
                    .warmup_min_ratio = 0.1,
                    .cos_min_ratio = 0.01};
  const double base = 3e-4;
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 0), 3e-5);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 5), 0.000165);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 10), 0.00029992672421431113);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 11), 0.0002997069691715983);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 55), 0.0001701119851842992);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 109), 3e-6);
  // Past total_num_steps zinf holds the floor (DeepSpeed's cosine would rise again).
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 200), 3e-6);
  s.warmup_type = WarmupType::kLog;
  s.warmup_min_ratio = 0.0;
  s.cos_min_ratio = 1e-4;
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 0), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 5), 0.00023344537511509303);
  EXPECT_DOUBLE_EQ(LearningRate(s, base, 55), 0.0001688131050361422);
}

// ---- The corpus of bad configs: tests/config/bad_configs/NN-name.{json,expect}. ----

std::vector<std::string> BadConfigNames() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(ZINF_BAD_CONFIG_DIR)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class BadConfig : public ::testing::TestWithParam<std::string> {};

TEST_P(BadConfig, IsRejectedWithItsMessage) {
  const std::filesystem::path dir = ZINF_BAD_CONFIG_DIR;
  std::string expect = ReadFile(dir / (GetParam() + ".expect"));
  while (!expect.empty() && (expect.back() == '\n' || expect.back() == '\r')) expect.pop_back();
  ASSERT_FALSE(expect.empty()) << GetParam() << ".expect is empty";
  ASSERT_EQ(expect.find('\n'), std::string::npos) << GetParam() << ".expect has several lines";
  // As zinf-train's BuildTrainConfig loads a config (for a run and for --check-config alike):
  // parsed, then what the engine refuses of it (CheckEngineConfig).
  auto refusal = [](Result<TrainConfig> config) -> Status {
    if (!config) return std::move(config).error();
    return CheckEngineConfig(*config);
  };
  EXPECT_THAT(refusal(LoadTrainConfig((dir / (GetParam() + ".json")).string(), {})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr(expect)));
  // The same text parsed from memory gives the same message (without the file prefix).
  EXPECT_THAT(refusal(ParseTrainConfig(ReadFile(dir / (GetParam() + ".json")), {})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr(expect)));
}

INSTANTIATE_TEST_SUITE_P(Corpus, BadConfig, ::testing::ValuesIn(BadConfigNames()),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           std::string name = param_info.param;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

TEST(BadConfigCorpus, HasAtLeastThirtyCasesEachWithAnExpectFile) {
  const std::vector<std::string> names = BadConfigNames();
  EXPECT_GE(names.size(), 30u);
  for (const std::string& name : names) {
    EXPECT_TRUE(
        std::filesystem::exists(std::filesystem::path(ZINF_BAD_CONFIG_DIR) / (name + ".expect")))
        << name;
  }
}

// ---- One spelling per setting ----

// {"a": {"b": value}} for the key "a.b", after "train_micro_batch_size_per_gpu": 4.
nlohmann::ordered_json ConfigWith(const std::string& path, const nlohmann::ordered_json& value) {
  nlohmann::ordered_json root = {{"train_micro_batch_size_per_gpu", 4}};
  nlohmann::ordered_json::json_pointer at;
  for (std::size_t start = 0;;) {
    const std::size_t dot = path.find('.', start);
    at /= path.substr(start, dot == std::string::npos ? dot : dot - start);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  root[at] = value;
  return root;
}

// Every key with a value (not a section) that --help-config lists: the engine's implemented
// keys and zinf-train's own.
std::vector<std::string> LeafKeys() {
  const std::string help = DescribeConfigKeys(TrainAppKeys());
  std::istringstream lines(help.substr(0, help.find("DeepSpeed keys accepted with no effect")));
  std::vector<std::string> keys;
  for (std::string line; std::getline(lines, line);) {
    const std::size_t paren = line.find(" (");
    if (line.empty() || line[0] == ' ' || paren == std::string::npos ||
        line.compare(paren, 10, " (section)") == 0 || line.starts_with("config keys")) {
      continue;
    }
    keys.push_back(line.substr(0, paren));
  }
  return keys;
}

TEST(OneSpelling, AutoIsRefusedForEveryKeyButWhereItIsAValue) {
  // The keys whose documented values include "auto", with what else they need.
  const std::map<std::string, nlohmann::ordered_json> auto_is_a_value = {
      {"zinf.io_engine", nlohmann::ordered_json::object()},
      {"zinf.host_memory_budget", nlohmann::ordered_json::object()},
      {"zinf.checkpoint.load", {{"zinf", {{"checkpoint", {{"dir", "/ckpt"}}}}}}},
  };
  const std::vector<std::string> keys = LeafKeys();
  // The listing was read: it has the string keys, the size, a list and the application's keys.
  EXPECT_THAT(keys, ::testing::IsSupersetOf(
                        {"zinf.checkpoint.dir", "zinf.job_id", "zinf.pinned_budget_bytes",
                         "zero_optimization.offload_optimizer.nvme_path", "zinf.data.path",
                         "zinf.model.name", "optimizer.params.betas", "aio.thread_count"}));
  EXPECT_GT(keys.size(), 60u);
  for (const std::string& key : keys) {
    SCOPED_TRACE(key);
    nlohmann::ordered_json config = ConfigWith(key, "auto");
    if (auto it = auto_is_a_value.find(key); it != auto_is_a_value.end()) {
      config.merge_patch(it->second);
      EXPECT_THAT(ParseTrainConfig(config.dump(), {}), IsOk());
      continue;
    }
    EXPECT_THAT(ParseTrainConfig(config.dump(), {}),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr(key + ": \"auto\" is a placeholder that the Hugging Face")));
  }
  // And as an element of a list of paths.
  EXPECT_THAT(
      ParseTrainConfig(
          ConfigWith("zero_optimization.offload_optimizer.nvme_path", {"/a", "auto"}).dump(), {}),
      StatusIs(ErrorCode::kInvalidArgument, HasSubstr("nvme_path[1]: \"auto\" is a placeholder")));
}

TEST(OneSpelling, DottedKeysAreRefusedNamingTheNestedSpelling) {
  struct Case {
    const char* json;
    const char* error;
  };
  for (const Case& c : {
           Case{R"({"train_batch_size": 4, "zinf.steps": 7})",
                R"(zinf.steps: the key "zinf.steps" contains a '.'; keys are nested objects, one )"
                R"(spelling per setting: write {"zinf": {"steps": ...}})"},
           Case{R"({"train_batch_size": 4, "optimizer.params.lr": 0.1})",
                R"(write {"optimizer": {"params": {"lr": ...}}})"},
           Case{R"({"train_batch_size": 4, "zinf": {"checkpoint.dir": "/c"}})",
                R"(zinf.checkpoint.dir: the key "checkpoint.dir" contains a '.')"},
           // Agreeing with the nested key or contradicting it: one spelling either way.
           Case{R"({"train_batch_size": 4, "zinf": {"steps": 7}, "zinf.steps": 7})",
                R"(zinf.steps: the key "zinf.steps")"},
           Case{R"({"train_batch_size": 4, "zinf": {"steps": 7}, "zinf.steps": 1})",
                R"(zinf.steps: the key "zinf.steps")"},
           // Unknown or ignored keys, and application keys, the same.
           Case{R"({"train_batch_size": 4, "no.such": 1})", R"(write {"no": {"such": ...}})"},
           Case{R"({"train_batch_size": 4, "zero_optimization.overlap_comm": true})",
                R"(write {"zero_optimization": {"overlap_comm": ...}})"},
           Case{R"({"train_batch_size": 4, "zinf": {"model.hidden": 8}})",
                R"(write {"zinf": {"model": {"hidden": ...}}})"},
       }) {
    EXPECT_THAT(ParseTrainConfig(c.json, {}),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr(c.error)))
        << c.json;
  }
}

// zinf-train's flags against a file that sets the same keys: the flag wins; a file that spells
// the key with dots is an error (it used to win over the flag).
TEST(OneSpelling, FlagsReplaceTheFilesValue) {
  const std::string file = R"({"train_batch_size": 4,
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/file/swap"}},
      "zinf": {"steps": 7, "checkpoint": {"dir": "/file/ckpt"}}})";
  ConfigOverrides flags;
  flags.steps = 1;
  flags.checkpoint_dir = "/flag/ckpt";
  flags.nvme_path = std::vector<std::string>{"/flag/swap"};
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseTrainConfig(file, {}, flags));
  EXPECT_EQ(c.steps, 1);
  EXPECT_EQ(c.zinf.checkpoint.dir, "/flag/ckpt");
  EXPECT_EQ(c.zero_optimization.offload_optimizer.nvme_path,
            std::vector<std::string>{"/flag/swap"});
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig no_flags, ParseTrainConfig(file, {}, {}));
  EXPECT_EQ(no_flags.steps, 7);
  EXPECT_EQ(no_flags.zinf.checkpoint.dir, "/file/ckpt");

  struct Case {
    const char* file;
    ConfigOverrides flags;
    const char* error;
  };
  ConfigOverrides steps;
  steps.steps = 1;
  ConfigOverrides checkpoint_dir;
  checkpoint_dir.checkpoint_dir = "/flag/ckpt";
  ConfigOverrides nvme_path;
  nvme_path.nvme_path = std::vector<std::string>{"/flag/swap"};
  for (const Case& d : {
           Case{R"({"train_batch_size": 4, "zinf.steps": 7})", steps,
                R"(write {"zinf": {"steps": ...}})"},
           Case{R"({"train_batch_size": 4, "zinf": {"checkpoint.dir": "/file/ckpt"}})",
                checkpoint_dir, R"(write {"zinf": {"checkpoint": {"dir": ...}}})"},
           Case{R"({"train_batch_size": 4, "zinf.checkpoint.dir": "/file/ckpt"})", checkpoint_dir,
                R"(write {"zinf": {"checkpoint": {"dir": ...}}})"},
           Case{R"({"train_batch_size": 4,
                    "zero_optimization.offload_optimizer.nvme_path": "/file/swap"})",
                nvme_path,
                R"(write {"zero_optimization": {"offload_optimizer": {"nvme_path": ...}}})"},
           Case{R"({"train_batch_size": 4,
                    "zero_optimization": {"offload_optimizer.nvme_path": "/file/swap"}})",
                nvme_path, R"(zero_optimization.offload_optimizer.nvme_path: the key)"},
       }) {
    EXPECT_THAT(ParseTrainConfig(d.file, {}, d.flags),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr(d.error)))
        << d.file;
  }
  // A section the file gives as something else is not replaced: the parser names it.
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 4, "zinf": null})", {}, steps),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("zinf: expected an object")));
  // Text that is not JSON gets the parser's syntax error.
  EXPECT_THAT(ParseTrainConfig("{\"train_batch_size\": 4,\n oops}", {}, steps),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("line 2")));
}

TEST(OneSpelling, ChoicesAreExactButOptimizerType) {
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 1, "zinf": {"optimizer_state": "Q8"}})", {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr(R"(zinf.optimizer_state: "Q8" is not one of "fp32", "q8"; )"
                                 R"(did you mean "q8"?)")));
  for (const char* json : {
           R"({"train_batch_size": 1, "zinf": {"io_engine": "POSIX"}})",
           R"({"train_batch_size": 1, "scheduler": {"type": "warmuplr"}})",
           R"({"train_batch_size": 1,
               "zero_optimization": {"offload_optimizer": {"device": "CPU"}}})",
           R"({"train_batch_size": 1, "zinf": {"model": {"name": "Synthetic"}}})",
       }) {
    EXPECT_THAT(ParseTrainConfig(json, {}),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("is not one of")))
        << json;
  }
  // DeepSpeed lower-cases optimizer.type, so zinf takes any case there (and prints it canonically).
  ZINF_ASSERT_OK_AND_ASSIGN(
      TrainConfig c,
      ParseTrainConfig(R"({"train_batch_size": 1, "optimizer": {"type": "ADAMW"}})", {}));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
}

TEST(OneSpelling, SizesAreStrict) {
  auto budget = [](const std::string& value) {
    return ParseTrainConfig(
        R"({"train_batch_size": 1, "zinf": {"pinned_budget_bytes": )" + value + "}}", {});
  };
  for (const char* good : {R"("2G")", R"("2GiB")", R"("2GB")", "2147483648", "2147483648.0"}) {
    SCOPED_TRACE(good);
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, budget(good));
    EXPECT_EQ(c.zinf.pinned_budget_bytes, 2 * kGiB);
  }
  for (const char* bad : {R"("2 G B")", R"("2 G")", R"(" 2G")", R"("2G ")", R"("2GG")", R"("-1G")",
                          R"("1e99G")", R"("1e9")", R"("")", "-1", "-0.0", "2.5", "1e20"}) {
    EXPECT_THAT(budget(bad),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("zinf.pinned_budget_bytes: ")))
        << bad;
  }
}

TEST(OneSpelling, IntegersAreIntegers) {
  auto threads = [](const std::string& value) {
    return ParseTrainConfig(R"({"train_batch_size": 1, "zinf": {"adam_threads": )" + value + "}}",
                            {});
  };
  for (const char* good : {"0", "-0", "0.0", "4", "4.0", "4e0"}) {
    EXPECT_THAT(threads(good), IsOk()) << good;
  }
  EXPECT_THAT(threads("-0.0"),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("zinf.adam_threads: expected an integer, got -0.0")));
  EXPECT_THAT(threads("2.5"), StatusIs(ErrorCode::kInvalidArgument,
                                       HasSubstr("zinf.adam_threads: expected an integer")));
  for (const char* huge :
       {"1e19", "-1e19", "1e300", "18446744073709551615", "99999999999999999999999"}) {
    EXPECT_THAT(threads(huge), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("out of range")))
        << huge;
  }
  // JSON has no NaN or infinity; a number that overflows a double is a syntax error.
  EXPECT_THAT(threads("1e400"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("number overflow")));
  EXPECT_THAT(threads("NaN"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("syntax error")));
  // The same for an application's integer (zinf-train's zinf.steps).
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 1, "zinf": {"steps": -0.0}})", {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("zinf.steps: expected an integer, got -0.0")));
}

TEST(TrainConfig, CollectiveTimeoutIsSecondsInItsRange) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig d, ParseTrainConfig(R"({"train_batch_size": 1})", {}));
  EXPECT_EQ(d.zinf.collective_timeout_seconds, 600);
  EXPECT_THAT(EffectiveConfigJson(d), HasSubstr(R"("collective_timeout_seconds": 600)"));
  EXPECT_THAT(DescribeConfigKeys(),
              HasSubstr("zinf.collective_timeout_seconds (integer, default 600, range [1, "
                        "604800])"));
  auto timeout = [](const std::string& value) {
    return ParseTrainConfig(
        R"({"train_batch_size": 1, "zinf": {"collective_timeout_seconds": )" + value + "}}", {});
  };
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, timeout("1"));
  EXPECT_EQ(c.zinf.collective_timeout_seconds, 1);
  ZINF_ASSERT_OK_AND_ASSIGN(c, timeout("604800"));
  EXPECT_EQ(c.zinf.collective_timeout_seconds, 604800);
  for (const char* bad : {"0", "604801", "-1"}) {
    EXPECT_THAT(timeout(bad), StatusIs(ErrorCode::kInvalidArgument,
                                       HasSubstr("zinf.collective_timeout_seconds: ")))
        << bad;
  }
  EXPECT_THAT(timeout("1.5"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("an integer")));
  EXPECT_THAT(timeout(R"("auto")"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("placeholder")));
}

TEST(TrainConfig, JobIdDependsOnlyOnWhatIdentifiesTheJob) {
  // A run and its resumption with other flags: the same job, so the same swap store directory.
  auto parse = [](const std::string& zinf, const std::string& extra = "", int world_size = 2) {
    return ParseTrainConfig("{\"train_batch_size\": 8" + extra + ", \"zinf\": {" + zinf + "}}",
                            {.world_size = world_size});
  };
  const std::string base =
      R"("checkpoint": {"dir": "/ckpt/a"}, "model": {"hidden": 64}, "seed": 5, "steps": 100)";
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig a, parse(base));
  const std::string id = JobIdOf(a);
  EXPECT_EQ(id.size(), 15u);
  EXPECT_EQ(id.substr(0, 3), "cfg");
  EXPECT_TRUE(std::all_of(id.begin() + 3, id.end(), [](char ch) {
    return std::isxdigit(static_cast<unsigned char>(ch)) != 0;
  })) << id;

  for (const std::string& same : {
           std::string(R"("checkpoint": {"dir": "/ckpt/a"}, "model": {"hidden": 64}, "seed": 5,)"
                       R"( "steps": 900)"),
           std::string(R"("checkpoint": {"dir": "/ckpt/a", "load": "latest"},)"
                       R"( "model": {"hidden": 64}, "seed": 5, "steps": 100)"),
           std::string(R"("checkpoint": {"dir": "/ckpt/a", "every": 3, "keep_last": 2},)"
                       R"( "model": {"hidden": 64}, "seed": 5, "steps": 100)"),
           // The seed and the data change the batches, not the parameters or the store.
           std::string(R"("checkpoint": {"dir": "/ckpt/a"}, "model": {"hidden": 64}, "seed": 6,)"
                       R"( "steps": 100)"),
           std::string(R"("checkpoint": {"dir": "/ckpt/a"}, "model": {"hidden": 64}, "seed": 5,)"
                       R"( "steps": 100, "data": {"path": "/text"})"),
       }) {
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig b, parse(same));
    EXPECT_NE(ConfigHash(a), ConfigHash(b)) << same;  // the config differs...
    EXPECT_EQ(JobIdOf(b), id) << same;                // ...the job does not
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig lr,
                            parse(base, R"(, "optimizer": {"params": {"lr": 0.002}})"));
  EXPECT_EQ(JobIdOf(lr), id);

  for (const std::string& other : {
           std::string(R"("checkpoint": {"dir": "/ckpt/b"}, "model": {"hidden": 64}, "seed": 5,)"
                       R"( "steps": 100)"),
           std::string(R"("checkpoint": {"dir": "/ckpt/a"}, "model": {"hidden": 65}, "seed": 5,)"
                       R"( "steps": 100)"),
       }) {
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig b, parse(other));
    EXPECT_NE(JobIdOf(b), id) << other;
  }
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig four_ranks, parse(base, "", 4));
  EXPECT_NE(JobIdOf(four_ranks), id);
  // An explicit job_id is taken as it is.
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig named, parse(base + R"(, "job_id": "mine")"));
  EXPECT_EQ(JobIdOf(named), "mine");
}

// zinf.nvme_path_weights: bandwidth ratios become the swap store's integer weights, "probe"
// asks the store to measure them with the configured engine, absent is equal shares.
TEST(TrainConfig, NvmePathWeightsReachTheSwapStore) {
  const auto layout = partition::ParamLayout::Create({{"w", {4}}}).value();
  auto parse = [](const std::string& weights) {
    return ParseTrainConfig(
        R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"offload_optimizer": )"
        R"({"device": "nvme", "nvme_path": ["/a", "/b"]}}, "aio": {"queue_depth": 4}, )"
        R"("zinf": {"io_engine": "posix")" +
            (weights.empty() ? "" : R"(, "nvme_path_weights": )" + weights) + "}}",
        {});
  };
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig none, parse(""));
  EXPECT_TRUE(ToSwapperOptions(none, 0, layout).store.path_weights.empty());
  EXPECT_FALSE(ToSwapperOptions(none, 0, layout).store.probe_path_weights);
  EXPECT_THAT(EffectiveConfigJson(none), Not(HasSubstr("nvme_path_weights")));

  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig ratios, parse("[2.5, 7.5]"));
  EXPECT_THAT(ratios.zinf.nvme_path_weights.weights, ::testing::ElementsAre(2.5, 7.5));
  EXPECT_THAT(ToSwapperOptions(ratios, 0, layout).store.path_weights, ::testing::ElementsAre(1, 3));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseTrainConfig(EffectiveConfigJson(ratios), {}));
  EXPECT_EQ(ConfigHash(again), ConfigHash(ratios));
  EXPECT_NE(ConfigHash(ratios), ConfigHash(none));

  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig probe, parse(R"("probe")"));
  const swapper::SwapperOptions probed = ToSwapperOptions(probe, 0, layout);
  EXPECT_TRUE(probed.store.probe_path_weights);
  EXPECT_TRUE(probed.store.path_weights.empty());
  EXPECT_EQ(probed.store.probe_backend, storage::IoBackendKind::kPosix);
  EXPECT_EQ(probed.store.probe_aio.queue_depth, 4);
  EXPECT_THAT(EffectiveConfigJson(probe), HasSubstr(R"("nvme_path_weights": "probe")"));

  // More unequal paths than a stripe cycle holds.
  std::string many_paths = "[";
  std::string many_weights = "[";
  for (int i = 0; i < 65; ++i) {
    many_paths += fmt::format(R"({}"/p{}")", i == 0 ? "" : ", ", i);
    many_weights += fmt::format("{}{}", i == 0 ? "" : ", ", i == 0 ? 2 : 1);
  }
  EXPECT_THAT(
      ParseTrainConfig(R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": )"
                       R"({"offload_optimizer": {"device": "nvme", "nvme_path": )" +
                           many_paths + R"(]}}, "zinf": {"nvme_path_weights": )" + many_weights +
                           "]}}",
                       {}),
      StatusIs(ErrorCode::kInvalidArgument,
               HasSubstr("zinf.nvme_path_weights: path bandwidth ratios: 65 paths of unequal")));
  // The typed errors are the corpus's: bad_configs/9*-nvme-path-weights-*.json.
}

// ---- Stage 3: offload_param and the stage3_* keys (engine.h, "Stage 3") ----

TEST(Stage3Config, DefaultsAreDeepSpeeds) {
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            ParseTrainConfig(R"({"train_micro_batch_size_per_gpu": 4})", {}));
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(z.offload_param.nvme_path.empty());
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100'000'000u);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000u);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000u);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000u);
  EXPECT_EQ(z.stage3_model_persistence_threshold, 9'223'372'036'854'775'807u);  // sys.maxsize
  EXPECT_TRUE(c.ignored_keys.empty());
  // Printed with the other zero_optimization keys (no nvme_path when none is given), and
  // --help lists them with their defaults and ranges.
  const std::string effective = EffectiveConfigJson(c);
  EXPECT_THAT(effective, HasSubstr(R"("stage3_prefetch_bucket_size": 50000000)"));
  EXPECT_THAT(effective, HasSubstr(R"("stage3_model_persistence_threshold": 9223372036854775807)"));
  EXPECT_THAT(effective, HasSubstr(R"("offload_param": {
      "device": "none",
      "buffer_count": 5,
      "buffer_size": 100000000,
      "max_in_cpu": 1000000000
    })"));
  const std::string help = DescribeConfigKeys();
  EXPECT_THAT(help, HasSubstr("zero_optimization.offload_param.buffer_count (integer, default 5, "
                              "range [1, 1024])"));
  EXPECT_THAT(help, HasSubstr("zero_optimization.stage3_max_reuse_distance (integer, default "
                              "1000000000, range [0, 9223372036854775807])"));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig again, ParseTrainConfig(effective, {}));
  EXPECT_EQ(ConfigHash(again), ConfigHash(c));
}

TEST(Stage3Config, EveryKeyIsReadAsWrittenAndIntegralFloatsToo) {
  // DeepSpeed's reference example writes these as floats (1e9, 1e8).
  const char* json = R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme{local_rank}/a", "/b"]},
      "offload_param": {"device": "nvme", "nvme_path": ["/b", "/nvme{local_rank}/a"],
                        "buffer_count": 7, "buffer_size": 1e8, "max_in_cpu": 2.5e9,
                        "pin_memory": true},
      "stage3_prefetch_bucket_size": 5e8,
      "stage3_max_live_parameters": 3e9,
      "stage3_max_reuse_distance": 0,
      "stage3_param_persistence_threshold": 1e6,
      "stage3_model_persistence_threshold": 123456789}})";
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            ParseTrainConfig(json, {.world_size = 2, .local_rank = 1}));
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_THAT(z.offload_param.nvme_path, ::testing::ElementsAre("/b", "/nvme{local_rank}/a"));
  EXPECT_EQ(z.offload_param.buffer_count, 7);
  EXPECT_EQ(z.offload_param.buffer_size, 100'000'000u);
  EXPECT_EQ(z.offload_param.max_in_cpu, 2'500'000'000u);
  // pin_memory has no effect in zinf: accepted and named among the ignored keys.
  EXPECT_THAT(c.ignored_keys, ::testing::ElementsAre("zero_optimization.offload_param.pin_memory"));
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 500'000'000u);
  EXPECT_EQ(z.stage3_max_live_parameters, 3'000'000'000u);
  EXPECT_EQ(z.stage3_max_reuse_distance, 0u);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 1'000'000u);
  EXPECT_EQ(z.stage3_model_persistence_threshold, 123'456'789u);
  // The effective config carries them (nvme_path as written), round-trips, and each value is
  // part of the hash every rank compares.
  const std::string effective = EffectiveConfigJson(c);
  EXPECT_THAT(effective, HasSubstr(R"("stage3_max_live_parameters": 3000000000)"));
  EXPECT_THAT(effective, HasSubstr(R"("/nvme{local_rank}/a")"));
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig again,
                            ParseTrainConfig(effective, {.world_size = 2, .local_rank = 1}));
  EXPECT_EQ(EffectiveConfigJson(again), effective);
  EXPECT_EQ(ConfigHash(again), ConfigHash(c));
  for (const char* changed : {R"("buffer_count": 8)", R"("max_in_cpu": 0)"}) {
    nlohmann::ordered_json other = nlohmann::ordered_json::parse(effective);
    const auto one = nlohmann::ordered_json::parse(std::string("{") + changed + "}");
    other["zero_optimization"]["offload_param"].update(one);
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig d,
                              ParseTrainConfig(other.dump(), {.world_size = 2, .local_rank = 1}));
    EXPECT_NE(ConfigHash(d), ConfigHash(c)) << changed;
  }
  nlohmann::ordered_json other = nlohmann::ordered_json::parse(effective);
  other["zero_optimization"]["stage3_max_reuse_distance"] = 1;
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig d,
                            ParseTrainConfig(other.dump(), {.world_size = 2, .local_rank = 1}));
  EXPECT_NE(ConfigHash(d), ConfigHash(c));

  // The largest value DeepSpeed's default allows, as an integer; no float reaches it exactly.
  ZINF_ASSERT_OK_AND_ASSIGN(c, ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization":
                             {"stage3_model_persistence_threshold": 9223372036854775807}})",
                                                {}));
  EXPECT_EQ(c.zero_optimization.stage3_model_persistence_threshold, 9'223'372'036'854'775'807u);
}

TEST(Stage3Config, ValuesOutOfRangeAndWrongTypesNameTheKey) {
  auto zero = [](const std::string& body) {
    return ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization": {)" + body + "}}", {});
  };
  struct Case {
    std::string body, error;
  };
  for (const Case& c : {
           Case{R"("offload_param": {"buffer_count": 0})",
                "zero_optimization.offload_param.buffer_count: 0 is out of range [1, 1024]"},
           Case{R"("offload_param": {"buffer_count": 1025})",
                "zero_optimization.offload_param.buffer_count: 1025 is out of range"},
           Case{R"("offload_param": {"buffer_size": 0})",
                "zero_optimization.offload_param.buffer_size: 0 is out of range [1, "
                "9223372036854775807]"},
           Case{R"("offload_param": {"max_in_cpu": -1})",
                "zero_optimization.offload_param.max_in_cpu: -1 is out of range [0, "
                "9223372036854775807]"},
           Case{R"("offload_param": {"buffer_size": 1.5})",
                "zero_optimization.offload_param.buffer_size: expected an integer"},
           Case{R"("offload_param": {"device": "NVMe"})",
                R"(zero_optimization.offload_param.device: "NVMe" is not one of "none", "cpu", )"
                R"("nvme"; did you mean "nvme"?)"},
           Case{R"("offload_param": {"nvme_path": []})",
                "zero_optimization.offload_param.nvme_path: empty list"},
           Case{R"("offload_param": {"nvme_path": 3})",
                "zero_optimization.offload_param.nvme_path: expected a string or a list"},
           Case{R"("offload_param": "cpu")", "zero_optimization.offload_param: expected an object"},
           Case{R"("stage3_prefetch_bucket_size": -1)",
                "zero_optimization.stage3_prefetch_bucket_size: -1 is out of range [0, "
                "9223372036854775807]"},
           Case{R"("stage3_max_live_parameters": 1e19)",
                "zero_optimization.stage3_max_live_parameters: 1e+19 is out of range [0, "
                "9223372036854775807]"},
           Case{R"("stage3_param_persistence_threshold": "auto")",
                "zero_optimization.stage3_param_persistence_threshold: \"auto\" is a "
                "placeholder"},
           Case{R"("stage3_max_reuse_distance": 2.5)",
                "zero_optimization.stage3_max_reuse_distance: expected an integer"},
       }) {
    EXPECT_THAT(zero(c.body), StatusIs(ErrorCode::kInvalidArgument, HasSubstr(c.error))) << c.body;
  }
}

TEST(Stage3Config, UnknownKeyInOffloadParamNamesTheNearest) {
  EXPECT_THAT(
      ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization": {"offload_param":
                           {"device": "cpu", "buffer_cuont": 4}}})",
                       {}),
      StatusIs(ErrorCode::kInvalidArgument,
               HasSubstr("zero_optimization.offload_param.buffer_cuont: unknown key; did you "
                         "mean 'buffer_count'?")));
  EXPECT_THAT(
      ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization": {"offload_param":
                           {"ratio": 1}}})",
                       {}),
      StatusIs(ErrorCode::kInvalidArgument,
               HasSubstr("zero_optimization.offload_param.ratio: unknown key; valid keys in "
                         "zero_optimization.offload_param: 'device', 'nvme_path', "
                         "'buffer_count', 'buffer_size', 'max_in_cpu', 'pin_memory'")));
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization":
                                   {"stage3_prefetch_bucket_sise": 1}})",
                               {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("did you mean 'stage3_prefetch_bucket_size'?")));
}

TEST(Stage3Config, OffloadParamNvmeNeedsStage3AndTheOptimizersStore) {
  auto parse = [](const std::string& zero) {
    return ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization": {)" + zero + "}}", {});
  };
  // Parameters are partitioned only at stage 3.
  for (const char* stage : {"1", "2"}) {
    EXPECT_THAT(
        parse(std::string(R"("stage": )") + stage +
              R"(, "offload_optimizer": {"device": "nvme",)"
              R"( "nvme_path": "/n"}, "offload_param": {"device": "nvme"})"),
        StatusIs(ErrorCode::kInvalidArgument,
                 HasSubstr(std::string("zero_optimization.offload_param.device: \"nvme\" needs "
                                       "zero_optimization.stage 3, not ") +
                           stage + " (parameters are partitioned only at stage 3)")))
        << stage;
  }
  // The shards are read from the optimizer's swap store: the optimizer state must be on NVMe.
  for (const char* device : {"cpu", "none"}) {
    EXPECT_THAT(parse(std::string(R"("stage": 3, "offload_optimizer": {"device": ")") + device +
                      R"("}, "offload_param": {"device": "nvme"})"),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr(std::string("zero_optimization.offload_param.device: \"nvme\" "
                                               "needs zero_optimization.offload_optimizer.device "
                                               "\"nvme\", not \"") +
                                   device + "\"")))
        << device;
  }
  EXPECT_THAT(parse(R"("stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/n"})"),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("zero_optimization.offload_param.device: \"nvme\" needs "
                                 "zero_optimization.offload_optimizer.device \"nvme\", not "
                                 "\"none\"")));
  // A path that is not one of the optimizer's (DeepSpeed's configs often give the parameters a
  // directory of their own) loads, as written: zinf keeps no second copy there (issue 42; the
  // INFO line that names it: deepspeed_keys_test.cc).
  for (const char* extra :
       {R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},)"
        R"( "offload_param": {"device": "nvme", "nvme_path": "/params"})",
        R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b"]},)"
        R"( "offload_param": {"device": "nvme", "nvme_path": ["/b", "/c"]})",
        R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n{local_rank}"},)"
        R"( "offload_param": {"device": "nvme", "nvme_path": "/n0"})"}) {
    ZINF_EXPECT_OK(parse(extra));
  }
  // What loads: nvme_path left out, or the optimizer's own.
  ZINF_ASSERT_OK(parse(R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n"},)"
                       R"( "offload_param": {"device": "nvme"})"));
  ZINF_ASSERT_OK(
      parse(R"("stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/n{node}"},)"
            R"( "offload_param": {"device": "nvme", "nvme_path": "/n{node}"})"));
}

TEST(Stage3Config, OffloadParamNvmePathWithAnotherDeviceIsAcceptedUnused) {
  // DeepSpeed accepts a path it does not use; so does zinf, at any stage and for any device.
  for (const char* device : {"cpu", "none"}) {
    ZINF_ASSERT_OK_AND_ASSIGN(
        TrainConfig c,
        ParseTrainConfig(std::string(R"({"train_batch_size": 1, "zero_optimization": {"stage": 2,)"
                                     R"( "offload_param": {"device": ")") +
                             device + R"(", "nvme_path": "/elsewhere"}}})",
                         {}));
    EXPECT_THAT(c.zero_optimization.offload_param.nvme_path, ::testing::ElementsAre("/elsewhere"));
    EXPECT_TRUE(c.ignored_keys.empty());
  }
  // The old switches name the new block.
  for (const char* old : {"cpu_offload_param", "cpu_offload_params"}) {
    EXPECT_THAT(ParseTrainConfig(std::string(R"({"train_batch_size": 1, "zero_optimization": {")") +
                                     old + R"(": true}})",
                                 {}),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("give zero_optimization.offload_param {device: cpu} instead")))
        << old;
  }
}

// ---- What a run refuses, the config refuses (issue 41): zinf-train --check-config loads
// the config through the same functions (ParseConfig, then CheckEngineConfig). ----

TEST(RunChecks, OffloadDeviceNoneIsRefusedBeforeTheEngine) {
  // DeepSpeed's default (no offload_optimizer block) and "none" written out: parsed (any
  // DeepSpeed config loads), refused by CheckEngineConfig, which ZeroEngine::Create calls too.
  for (const char* json :
       {R"({"train_batch_size": 1})",
        R"({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"device": "none"}}})"}) {
    SCOPED_TRACE(json);
    ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c, ParseTrainConfig(json, {}));
    EXPECT_THAT(CheckEngineConfig(c),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("zero_optimization.offload_optimizer.device: \"none\" (also "
                                   "the default when it is not given)")));
  }
  for (const char* offload : {R"({"device": "cpu"})", R"({"device": "nvme", "nvme_path": "/n"})"}) {
    SCOPED_TRACE(offload);
    ZINF_ASSERT_OK_AND_ASSIGN(
        TrainConfig c,
        ParseTrainConfig(std::string(R"({"train_batch_size": 1, "zero_optimization": )"
                                     R"({"offload_optimizer": )") +
                             offload + "}}",
                         {}));
    ZINF_EXPECT_OK(CheckEngineConfig(c));
  }
}

TEST(RunChecks, JobIdIsAtMostTheSwapStoresLimit) {
  auto parse = [](std::size_t length) {
    return ParseTrainConfig(
        R"({"train_batch_size": 1, "zinf": {"job_id": ")" + std::string(length, 'j') + "\"}}", {});
  };
  ZINF_EXPECT_OK(parse(200));
  EXPECT_THAT(parse(201), StatusIs(ErrorCode::kInvalidArgument,
                                   HasSubstr("zinf.job_id: 201 characters long, at most 200")));
}

TEST(RunChecks, PinnedBudgetBelowTheSmallestPoolIsRefused) {
  auto parse = [](const std::string& budget, const std::string& device, const char* state) {
    return ParseTrainConfig(
        R"({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"device": ")" +
            device + R"(", "nvme_path": "/n"}}, "zinf": {"pinned_budget_bytes": )" + budget +
            R"(, "optimizer_state": ")" + state + "\"}}",
        {});
  };
  // A size string without a unit is bytes, as the integer: "3" and 3 alike.
  for (const char* three : {R"("3")", "3"}) {
    SCOPED_TRACE(three);
    EXPECT_THAT(parse(three, "nvme", "fp32"),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("zinf.pinned_budget_bytes: 3 bytes cannot hold the swap "
                                   "buffers")));
  }
  EXPECT_THAT(parse(R"("16383")", "nvme", "fp32"),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("16383 bytes cannot hold the swap buffers of a step with fp32 "
                                 "state (4 buffers of at least 4096 bytes each, 16384 bytes")));
  ZINF_EXPECT_OK(parse(R"("16K")", "nvme", "fp32"));
  ZINF_EXPECT_OK(parse("0", "nvme", "fp32"));  // 0: buffer_count buffers
  EXPECT_THAT(parse("12287", "nvme", "q8"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("(3 buffers of at least 4096")));
  ZINF_EXPECT_OK(parse("12288", "nvme", "q8"));
  // Device cpu keeps the state in memory and uses no budget.
  ZINF_EXPECT_OK(parse(R"("3")", "cpu", "fp32"));
}

TEST(RunChecks, NoStringValueHoldsANulByte) {
  const std::string nul("\\u0000");  // JSON's escape of the byte 0
  for (const std::string& json : {
           R"({"train_batch_size": 1, "zinf": {"checkpoint": {"dir": "/c)" + nul + R"("}}})",
           R"({"train_batch_size": 1, "zinf": {"job_id": "a)" + nul + R"("}})",
           R"({"train_batch_size": 1, "zinf": {"checkpoint": {"load": ")" + nul + R"("}}})",
           R"({"train_batch_size": 1, "zinf": {"data": {"path": "d)" + nul + R"("}}})",
           R"({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": )"
           R"({"device": "nvme", "nvme_path": ["/a", "/b)" +
               nul + R"("]}}})",
           R"({"train_batch_size": 1, "zero_optimization": {"offload_param": )"
           R"({"nvme_path": "/p)" +
               nul + R"("}}})",
       }) {
    SCOPED_TRACE(json);
    EXPECT_THAT(ParseTrainConfig(json, {}),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("contains a NUL byte")));
  }
}

// Range errors print the range of values accepted: for an integer without an upper limit of its
// own, the largest int64 (not "inf"), the same whether the value is an integer, an integral
// float or a size string.
TEST(RangeErrors, PrintTheLargestValueAccepted) {
  auto parse = [](const std::string& zero, const std::string& zinf) {
    return ParseTrainConfig(R"({"train_batch_size": 1, "zero_optimization": {)" + zero +
                                R"(}, "zinf": {)" + zinf + "}}",
                            {});
  };
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig c,
                            parse(R"("sub_group_size": 9223372036854775807)",
                                  R"("host_cache_bytes": "8388607T", "seed": 9223372036854775807)"));
  EXPECT_EQ(c.zero_optimization.sub_group_size, 9223372036854775807u);
  EXPECT_EQ(c.zinf.host_cache_bytes, 8388607 * (kGiB * 1024));
  EXPECT_EQ(c.seed, INT64_MAX);
  const std::string kMax = "9223372036854775807]";
  for (const auto& [zero, zinf, want] : std::vector<std::array<std::string, 3>>{
           {R"("sub_group_size": 9223372036854775808)", "",
            "zero_optimization.sub_group_size: 9223372036854775808 is out of range [1, " + kMax},
           {R"("sub_group_size": 0)", "", "zero_optimization.sub_group_size: 0 is out of range [1, " + kMax},
           {R"("sub_group_size": 1e19)", "", "sub_group_size: 1e+19 is out of range [1, " + kMax},
           {"", R"("host_cache_bytes": "8388608T")",
            "zinf.host_cache_bytes: \"8388608T\" (9223372036854775808 bytes) is out of range "
            "[0, " + kMax},
           {"", R"("host_cache_bytes": 18446744073709551615)",
            "zinf.host_cache_bytes: 18446744073709551615 is out of range [0, " + kMax},
           {"", R"("seed": -1)", "zinf.seed: -1 is out of range [0, " + kMax},
           {"", R"("checkpoint": {"every": 0})", "zinf.checkpoint.every: 0 is out of range [1, " + kMax},
           // A key of its own range keeps it; an int key without one is bounded by int.
           {"", R"("adam_threads": 4096)", "zinf.adam_threads: 4096 is out of range [0, 1024]"},
           {"", R"("steps": 9007199254740992)",
            "zinf.steps: 9007199254740992 is out of range [1, 9007199254740991]"},
       }) {
    SCOPED_TRACE(want);
    EXPECT_THAT(parse(zero, zinf), StatusIs(ErrorCode::kInvalidArgument, HasSubstr(want)));
  }
  // A number key keeps its open end: no finite number is excluded by it.
  EXPECT_THAT(ParseTrainConfig(R"({"train_batch_size": 1, "gradient_clipping": -1})", {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("gradient_clipping: -1 is out of range [0, inf)")));
  // --help shows the same ranges.
  EXPECT_THAT(DescribeConfigKeys(),
              HasSubstr("zero_optimization.sub_group_size (integer, default 1000000000, range "
                        "[1, 9223372036854775807])"));
}

}  // namespace
}  // namespace zinf::train
