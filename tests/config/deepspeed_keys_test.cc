// Every DeepSpeed key as the key table says (config/config.h, DeepSpeedKeyTable()): the table in
// docs/ is the generated one; each ignored key loads and is named among the ignored keys, each
// refused key fails with its reason (and its harmless values load), each key misspelled fails
// with the nearest key, each implemented leaf refuses a wrong type. Then DeepSpeed's own
// configs (tests/config/deepspeed_configs) and the shipped configs/ as a user hands them over.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/status_matchers.h"
#include "zinf/config/config.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"

namespace zinf::config {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;
using ::zinf::testing::StatusIs;
using Json = nlohmann::ordered_json;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Row {
  std::string key, kind, type;
};

// The rows of the generated table.
std::vector<Row> TableRows() {
  std::vector<Row> rows;
  const std::string table = DeepSpeedKeyTable();
  const std::regex row(R"(^\| `([^`]+)` \| ([^|]+) \| ((?:[^|\\]|\\.)*) \|)");
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, row)) rows.push_back({m[1], m[2], m[3]});
  }
  return rows;
}

// {"a": {"b": value}} for "a.b", on top of a config that needs nothing else.
std::string ConfigWith(const std::string& path, const Json& value) {
  Json root = {{"train_micro_batch_size_per_gpu", 1}};
  Json::json_pointer at;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    at /= path.substr(start, dot == std::string::npos ? dot : dot - start);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  root[at] = value;
  // A scheduler parameter needs a scheduler: one whose parameters are all optional.
  if (path.starts_with("scheduler.") && path != "scheduler.type") {
    root["scheduler"]["type"] = "LRRangeTest";
  }
  return root.dump();
}

// The value a "refused unless <text>" row accepts, from its text.
Json HarmlessValue(const std::string& text) {
  static const std::map<std::string, Json> values = {
      {"false", false},
      {"true", true},
      {"-1", -1},
      {"0", 0},
      {"1", 1},
      {"\"mean\"", "mean"},
      {"enabled false or absent", Json{{"enabled", false}}},
      {"grad_accum_dtype fp32 or absent", Json{{"grad_accum_dtype", "fp32"}}},
      {"autotp_size 1 or absent", Json{{"autotp_size", 1}}},
  };
  auto it = values.find(text);
  return it == values.end() ? Json() : it->second;
}

TEST(DeepSpeedKeyTable, DocsFileIsTheGeneratedTable) {
  const std::filesystem::path docs = std::filesystem::path(ZINF_DOCS_DIR) / "deepspeed-keys.md";
  EXPECT_EQ(ReadFile(docs), DeepSpeedKeyTable())
      << docs << " is not what the schema generates: run `zinf-train --print-key-table > " << docs
      << "`";
}

TEST(DeepSpeedKeyTable, EveryRowBehavesAsItsKindSays) {
  const std::vector<Row> rows = TableRows();
  ASSERT_GT(rows.size(), 150u);
  std::set<std::string> keys;
  for (const Row& row : rows) keys.insert(row.key);
  int ignored = 0, refused = 0, implemented = 0;
  for (const Row& row : rows) {
    SCOPED_TRACE(row.key + " (" + row.kind + ")");
    const ConfigContext ctx{};
    if (row.kind == "ignored") {
      ++ignored;
      ZINF_ASSERT_OK_AND_ASSIGN(Config c,
                                ParseConfig(ConfigWith(row.key, Json{{"any", {1, "value"}}}), ctx));
      EXPECT_THAT(c.ignored_keys, Contains(row.key));
    } else if (row.kind.starts_with("refused")) {
      ++refused;
      EXPECT_THAT(ParseConfig(ConfigWith(row.key, "zinf-test"), ctx),
                  StatusIs(ErrorCode::kInvalidArgument, HasSubstr(row.key + ": ")));
      EXPECT_THAT(ParseConfig(ConfigWith(row.key, "zinf-test"), ctx),
                  StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not supported")));
      if (row.kind.starts_with("refused unless ")) {
        const Json harmless = HarmlessValue(row.kind.substr(15));
        ASSERT_FALSE(harmless.is_null()) << "no harmless value for \"" << row.kind << "\"";
        ZINF_ASSERT_OK_AND_ASSIGN(Config c, ParseConfig(ConfigWith(row.key, harmless), ctx));
        EXPECT_THAT(c.ignored_keys, Contains(row.key));
      }
    } else if (row.kind == "implemented" || row.kind == "zinf's own") {
      ++implemented;
      // A leaf given an object is a type error naming it (sections are objects themselves).
      if (!row.type.starts_with("section") && !row.type.starts_with("old name")) {
        EXPECT_THAT(ParseConfig(ConfigWith(row.key, Json{{"x", 1}}), ctx),
                    StatusIs(ErrorCode::kInvalidArgument, HasSubstr(row.key + ": expected ")));
      }
    } else {
      ADD_FAILURE() << "unknown kind";
    }
    // A misspelling (the last character of the last name dropped) is an unknown key; for the
    // keys a config may give, the error names the key meant.
    const std::string typo = row.key.substr(0, row.key.size() - 1);
    const std::string last = row.key.substr(row.key.rfind('.') + 1);
    if (last.size() >= 5 && !keys.contains(typo)) {
      const auto result = ParseConfig(ConfigWith(typo, true), ctx);
      EXPECT_THAT(result, StatusIs(ErrorCode::kInvalidArgument, HasSubstr("unknown key")));
      if (!row.kind.starts_with("refused") && !row.type.starts_with("old name")) {
        EXPECT_THAT(result, StatusIs(ErrorCode::kInvalidArgument,
                                     HasSubstr("did you mean '" + last + "'")));
      }
    }
  }
  EXPECT_GT(ignored, 50);
  EXPECT_GT(refused, 20);
  EXPECT_GT(implemented, 50);
}

// ---- DeepSpeed's configs (tests/config/deepspeed_configs/README.md) ----

std::string CorpusFile(const std::string& name) {
  return ReadFile(std::filesystem::path(ZINF_DEEPSPEED_CONFIG_DIR) / name);
}

// `text` with zero_optimization.offload_param.`key` set to `value`.
std::string WithParam(const std::string& text, const std::string& key, const Json& value) {
  Json config = Json::parse(text);
  config["zero_optimization"]["offload_param"][key] = value;
  return config.dump();
}

TEST(DeepSpeedConfigs, ConfigReferenceNvmeExample) {
  const std::string text = CorpusFile("config-json-nvme.json");
  // Parameters on NVMe, in the optimizer's directory: the stage 3 keys are read (the sizes
  // written as floats), the GPU hints ignored.
  ZINF_ASSERT_OK_AND_ASSIGN(Config c, ParseConfig(text, {}));
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_EQ(c.zero_optimization.stage, 3);
  EXPECT_EQ(c.zero_optimization.sub_group_size, 1'000'000'000'000u);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  const OffloadParamConfig& param = c.zero_optimization.offload_param;
  EXPECT_EQ(param.device, OffloadDevice::kNvme);
  EXPECT_THAT(param.nvme_path, ::testing::ElementsAre("/local_nvme"));
  EXPECT_THAT(c.ignored_keys, ::testing::Contains("zero_optimization.offload_param.pin_memory"));
  EXPECT_EQ(param.buffer_count, 5);
  EXPECT_EQ(param.buffer_size, 100'000'000u);
  EXPECT_EQ(param.max_in_cpu, 1'000'000'000u);
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 1'000'000'000u);
  EXPECT_EQ(c.zero_optimization.stage3_max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, 500'000'000u);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 1'000'000u);
  EXPECT_THAT(
      c.ignored_keys,
      IsSupersetOf({"activation_checkpointing", "dump_state", "flops_profiler", "fp16.auto_cast",
                    "fp16.fp16_master_weights_and_grads", "tensorboard",
                    "zero_optimization.allgather_partitions",
                    "zero_optimization.contiguous_gradients",
                    "zero_optimization.offload_optimizer.fast_init",
                    "zero_optimization.offload_optimizer.ratio", "zero_optimization.overlap_comm",
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                    "zero_optimization.zero_hpz_partition_size"}));
  // offload_param's keys are read (the section is implemented); only pin_memory is ignored.
  EXPECT_THAT(c.ignored_keys, ::testing::Not(Contains(::testing::AllOf(
                                  ::testing::StartsWith("zero_optimization.offload_param"),
                                  ::testing::Ne("zero_optimization.offload_param.pin_memory")))));
  // Parameters in another directory than the optimizer state (issue 42): accepted as it is,
  // named in one INFO line; zinf keeps no second copy, nothing is written there.
  SetLogLevel(LogLevel::kInfo);
  SetProcessRank(0, 1);
  ::testing::internal::CaptureStderr();
  const auto other = ParseConfig(WithParam(text, "nvme_path", "/other_nvme"), {});
  const std::string log = ::testing::internal::GetCapturedStderr();
  ZINF_ASSERT_OK(other);
  EXPECT_THAT(other->zero_optimization.offload_param.nvme_path,
              ::testing::ElementsAre("/other_nvme"));
  EXPECT_THAT(log, HasSubstr("[info] [rank 0/1] config: zero_optimization.offload_param.nvme_path "
                             "\"/other_nvme\" not used: the parameters are read from the fp32 "
                             "master weights in the optimizer's swap store (\"/local_nvme\"), "
                             "nothing is written there"));
  // The same directory as the optimizer's: no line.
  ::testing::internal::CaptureStderr();
  ZINF_ASSERT_OK(ParseConfig(text, {}));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              ::testing::Not(HasSubstr("offload_param.nvme_path")));
  // The parameters' shards in host memory: the NVMe knobs are recorded, unused.
  ZINF_ASSERT_OK_AND_ASSIGN(Config cpu, ParseConfig(WithParam(text, "device", "cpu"), {}));
  EXPECT_EQ(cpu.zero_optimization.offload_param.device, OffloadDevice::kCpu);
}

TEST(DeepSpeedConfigs, ZeroTutorialsLoad) {
  ZINF_ASSERT_OK_AND_ASSIGN(Config infinity,
                            ParseConfig(CorpusFile("zero-infinity-tutorial.json"), {}));
  EXPECT_EQ(infinity.zero_optimization.reduce_bucket_size, 10'000'000u);
  EXPECT_THAT(infinity.ignored_keys,
              ::testing::ElementsAre("zero_optimization.contiguous_gradients"));
  EXPECT_EQ(infinity.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(infinity.zero_optimization.stage3_max_live_parameters, 1'000'000'000u);
  EXPECT_EQ(infinity.zero_optimization.stage3_max_reuse_distance, 1'000'000'000u);
  EXPECT_EQ(infinity.zero_optimization.stage3_prefetch_bucket_size, 10'000'000u);
  EXPECT_EQ(infinity.zero_optimization.stage3_param_persistence_threshold, 100'000u);
  // The optimizer state in host memory is recorded; ZeroEngine::Create then asks for nvme.
  EXPECT_EQ(infinity.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  ZINF_ASSERT_OK_AND_ASSIGN(Config offload,
                            ParseConfig(CorpusFile("zero-offload-tutorial.json"), {}));
  EXPECT_EQ(offload.zero_optimization.stage, 2);
  EXPECT_THAT(offload.ignored_keys, ::testing::ElementsAre("zero_optimization.contiguous_gradients",
                                                           "zero_optimization.overlap_comm"));
}

// ZeRO-Infinity: optimizer state and parameters on NVMe, in the same directory (zinf reads the
// parameters' shards from the optimizer's swap store).
TEST(DeepSpeedConfigs, ZeroInfinityNvmeConfigsLoad) {
  ZINF_ASSERT_OK_AND_ASSIGN(Config zero3, ParseConfig(CorpusFile("zero3-nvme.json"), {}));
  EXPECT_EQ(zero3.zero_optimization.offload_param.device, OffloadDevice::kNvme);
  EXPECT_THAT(zero3.zero_optimization.offload_param.nvme_path,
              ::testing::ElementsAre("/nvme_data"));
  EXPECT_TRUE(zero3.ignored_keys.empty());
  ZINF_ASSERT_OK_AND_ASSIGN(Config test,
                            ParseConfig(CorpusFile("nvme-checkpointing-test.json"), {}));
  EXPECT_EQ(test.zero_optimization.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(test.zero_optimization.stage3_max_live_parameters, 100u);
  EXPECT_EQ(test.zero_optimization.stage3_param_persistence_threshold, 0u);
  EXPECT_TRUE(test.ignored_keys.empty());
  for (const char* name : {"zero3-nvme.json", "nvme-checkpointing-test.json"}) {
    SCOPED_TRACE(name);
    // Each needs what DeepSpeed's ZeRO-Infinity needs in zinf: the optimizer state on NVMe.
    Json config = Json::parse(CorpusFile(name));
    config["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    EXPECT_THAT(ParseConfig(config.dump(), {}),
                StatusIs(ErrorCode::kInvalidArgument,
                         HasSubstr("zero_optimization.offload_param.device: \"nvme\" needs "
                                   "zero_optimization.offload_optimizer.device \"nvme\"")));
  }
}

TEST(DeepSpeedConfigs, WhatZinfDoesNotDoIsNamed) {
  EXPECT_THAT(ParseConfig(CorpusFile("offloadpp-ratio-test.json"), {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("zero_optimization.offload_optimizer.ratio: 0.3 is not "
                                 "supported: zinf offloads the whole optimizer state")));
  EXPECT_THAT(ParseConfig(CorpusFile("ds-nvme-tune-output.json"), {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("aio.single_submit: expected a boolean, got the string "
                                 "\"false\"; write false without quotes")));
  EXPECT_THAT(ParseConfig(CorpusFile("hf-trainer-zero3.json"), {}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("fp16.enabled: \"auto\" is a placeholder that the Hugging Face "
                                 "Trainer fills in")));
}

// ---- configs/: every shipped config loads, alone and on a node of 8 ranks ----

TEST(ShippedConfigs, EveryOneLoads) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(ZINF_CONFIGS_DIR)) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    SCOPED_TRACE(entry.path().string());
    const std::string text = ReadFile(entry.path());
    for (const ConfigContext& ctx :
         {ConfigContext{}, ConfigContext{.world_size = 8, .local_rank = 5, .node = 0}}) {
      ZINF_ASSERT_OK_AND_ASSIGN(Config c, ParseConfig(text, ctx));
      EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
      EXPECT_FALSE(c.zero_optimization.offload_optimizer.resolved_nvme_paths.empty());
    }
  }
  EXPECT_GE(files, 6);
}

}  // namespace
}  // namespace zinf::config
