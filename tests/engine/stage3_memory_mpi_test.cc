// ZeroEngine at stage 3 with offload_param nvme (engine.h, "Stage 3"): a rank's peak RSS stays
// under a bound that does not grow with the model (the live parameter window, the pool, the
// loop's own gradient buffer and a fixed slack), while the model's fp32 weights are at least 4x
// that bound. The weights, the gradient (zinf.swap_gradients, read-add-write on disk) and the
// optimizer state are all on NVMe; the loop gathers one parameter at a time.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace zinf::engine {
namespace {

using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::World;

constexpr std::uint64_t kParamNumel = std::uint64_t{1} << 20;  // 4 MiB of fp32 each
constexpr int kParams = 96;                                    // 384 MiB of fp32 weights
constexpr std::uint64_t kSubGroupNumel = std::uint64_t{1} << 18;
constexpr std::uint64_t kBufferCount = 4;
constexpr std::uint64_t kMaxLive = 3 * kParamNumel;  // the gathered window
// What the engine may add besides: its threads' stacks, the io_uring rings, one gradient bucket
// and the per-sub-group bookkeeping.
constexpr std::uint64_t kSlackBytes = std::uint64_t{64} << 20;

std::string ConfigText(const std::string& swap) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
    "zero_optimization": {{
      "stage": 3, "sub_group_size": {}, "reduce_bucket_size": {}, "allgather_bucket_size": {},
      "offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": {}}},
      "offload_param": {{"device": "nvme", "nvme_path": "{}", "max_in_cpu": 0}},
      "stage3_max_live_parameters": {}, "stage3_prefetch_bucket_size": {},
      "stage3_param_persistence_threshold": 0}},
    "zinf": {{"swap_gradients": true, "adam_threads": 1}}
  }})",
                     kSubGroupNumel, kParamNumel, kParamNumel, swap, kBufferCount, swap, kMaxLive,
                     kParamNumel);
}

float InitialValue(std::size_t param, std::uint64_t k) {
  return 0.1f * static_cast<float>(std::sin(0.001 * static_cast<double>(k) + param));
}

TEST(Stage3Memory, PeakRssDoesNotGrowWithTheModel) {
  SharedScratchDir dir("stage3-memory");
  const comm::Communicator& world = World();
  ZINF_ASSERT_OK_AND_ASSIGN(
      config::Config config,
      config::ParseConfig(ConfigText(dir.path()),
                  {.world_size = world.size(), .local_rank = world.rank(), .node = 0}));
  std::vector<Param> params;
  for (int p = 0; p < kParams; ++p) {
    params.push_back({.name = fmt::format("layer{}.weight", p),
                      .shape = {1024, static_cast<std::int64_t>(kParamNumel / 1024)},
                      .init = [p](std::uint64_t offset, std::span<float> out) {
                        for (std::size_t k = 0; k < out.size(); ++k) {
                          out[k] = InitialValue(static_cast<std::size_t>(p), offset + k);
                        }
                        return OkStatus();
                      }});
  }
  // The loop's one gradient buffer (its "activations"), allocated before the baseline.
  std::vector<float> grad(kParamNumel, 0.0f);
  const bool reset = ResetPeakRss();
  const std::uint64_t baseline = PeakRssBytes();

  ZINF_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<ZeroEngine> engine,
      ZeroEngine::Create(
          world, config, std::move(params),
          {.progress = false, .stop_signals = false, .gradient_memory_limit_bytes = 0}));
  EXPECT_EQ(engine->num_partitioned_params(), static_cast<std::size_t>(kParams));
  StepInfo info;
  for (int step = 1; step <= 2; ++step) {
    // Forward: every layer in order; backward: in reverse, a gradient from the weights.
    for (std::size_t p = 0; p < kParams; ++p) {
      ZINF_ASSERT_OK_AND_ASSIGN(Gathered layer, engine->GatherByIndex(std::vector<std::size_t>{p}));
      ASSERT_EQ(layer[0].size(), kParamNumel);
    }
    for (std::size_t p = kParams; p-- > 0;) {
      {
        ZINF_ASSERT_OK_AND_ASSIGN(Gathered layer,
                                  engine->GatherByIndex(std::vector<std::size_t>{p}));
        for (std::size_t k = 0; k < kParamNumel; ++k) grad[k] = layer[0][k] + 0.01f;
      }
      ZINF_ASSERT_OK(engine->GradientReady(p, grad));
    }
    ZINF_ASSERT_OK_AND_ASSIGN(info, engine->Step());
  }
  const std::uint64_t grown = PeakRssBytes() - baseline;
  const std::uint64_t pool = kBufferCount * kSubGroupNumel * sizeof(float);
  const std::uint64_t bound = kMaxLive * sizeof(float) + pool + kSlackBytes;
  const std::uint64_t weights = static_cast<std::uint64_t>(kParams) * kParamNumel * sizeof(float);
  RecordProperty("peak_rss_growth_bytes", static_cast<std::int64_t>(grown));
  fmt::print(
      "rank {}: peak RSS grew by {} during 2 steps (bound {}: window {} + pool {} + slack "
      "{}; model {} of fp32 weights{})\n",
      world.rank(), FormatBytes(grown), FormatBytes(bound), FormatBytes(kMaxLive * sizeof(float)),
      FormatBytes(pool), FormatBytes(kSlackBytes), FormatBytes(weights),
      reset ? "" : "; the peak could not be reset: whole process");
  EXPECT_GE(weights, 4 * bound);
  EXPECT_LE(grown, bound);
  EXPECT_GT(engine->gather_counters().disk_reads, 0u);
  EXPECT_GT(info.grad_norm, 0.0);
  ZINF_ASSERT_OK(engine->Close());
}

}  // namespace
}  // namespace zinf::engine
