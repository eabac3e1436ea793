// The engine's host memory plan (engine/src/memory_plan.h): each module's planned bytes against
// what it allocates (the swapper's pool and host tier, the gradient buckets) for stage 2 and
// stage 3 plans; the budget's detection from a fake /proc and /sys tree (cgroup v2 and v1,
// "max", MemAvailable, a planted symbolic link); and a budget too small, refused by every rank
// before anything large is allocated with an error naming the largest item.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "gradient_buckets.h"
#include "memory_plan.h"
#include "testing/layouts.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/comm/collective_backend.h"
#include "zinf/core/check.h"
#include "zinf/core/process_stats.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"
#include "zinf/partition/plan.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::engine {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

partition::PartitionPlan MakePlan(partition::PlanKind kind) {
  auto plan = partition::PartitionPlan::Create(
      testing::UnevenLayout(), {.kind = kind, .world_size = World().size(), .alignment_elems = 8});
  ZINF_CHECK(plan.has_value());
  return std::move(*plan);
}

struct SwapCase {
  std::string name;
  partition::PlanKind kind;
  std::uint64_t sub_group_size;
  void (*adjust)(swapper::SwapperOptions&);
};

// ---- The swapper: planned pool and host tier == allocated ----

TEST(MemoryPlan, SwapperPlanMatchesItsAllocations) {
  const std::vector<SwapCase> cases = {
      {"stage2-sync", partition::PlanKind::kFlat, 4096, [](swapper::SwapperOptions&) {}},
      {"stage3-sync", partition::PlanKind::kPerParam, 3000, [](swapper::SwapperOptions&) {}},
      {"stage2-pipelined", partition::PlanKind::kFlat, 5000,
       [](swapper::SwapperOptions& o) { o.pipeline_read = o.pipeline_write = true; }},
      {"stage3-budget", partition::PlanKind::kPerParam, 2000,
       [](swapper::SwapperOptions& o) { o.pinned_budget_bytes = 200 << 10; }},
      {"stage2-q8", partition::PlanKind::kFlat, 4096,
       [](swapper::SwapperOptions& o) { o.state_format = swapper::StateFormat::kQ8; }},
      {"stage3-host-cache", partition::PlanKind::kPerParam, 1024,
       [](swapper::SwapperOptions& o) { o.host_cache_bytes = 40 << 10; }},
      {"stage2-device-cpu", partition::PlanKind::kFlat, 4096,
       [](swapper::SwapperOptions& o) {
         o.all_resident = true;
         o.store.paths.clear();
       }},
      {"stage3-gradients-in-memory", partition::PlanKind::kPerParam, 4096,
       [](swapper::SwapperOptions& o) {
         o.swap_gradients = true;
         o.accumulation = swapper::GradientAccumulation::kInMemory;
       }},
      {"stage2-gradients-on-disk", partition::PlanKind::kFlat, 4096,
       [](swapper::SwapperOptions& o) {
         o.swap_gradients = true;
         o.accumulation = swapper::GradientAccumulation::kReadAddWrite;
         o.min_swap_numel = 1024;
       }},
  };
  SharedScratchDir dir("memory-plan");
  for (const SwapCase& c : cases) {
    SCOPED_TRACE(c.name);
    const partition::PartitionPlan plan = MakePlan(c.kind);
    swapper::SwapperOptions options;
    options.store.paths = {dir.Join(c.name)};
    options.store.job_id = c.name;
    options.store.stripe_unit_bytes = 64 << 10;
    options.sub_group_size = c.sub_group_size;
    options.adam = swapper::AdamOptions{.lr = 1e-2, .threads = 1};
    c.adjust(options);
    if (World().rank() == 0 && !options.store.paths.empty()) {
      std::filesystem::create_directories(options.store.paths.front());
    }
    ASSERT_THAT(World().Barrier(), IsOk());
    ZINF_ASSERT_OK_AND_ASSIGN(std::unique_ptr<swapper::OptimizerSwapper> made,
                              swapper::CreateOptimizerSwapper(World(), plan, options));
    const std::uint64_t alignment = made->has_store() ? made->store().alignment() : 4096;
    ZINF_ASSERT_OK_AND_ASSIGN(
        const swapper::SwapperHostPlan planned,
        swapper::PlanSwapperHostMemory(plan, World().rank(), options, alignment));
    EXPECT_EQ(planned.pool_bytes, made->pool().total_bytes());
    EXPECT_EQ(planned.pool_buffers, made->pool().buffer_count());
    EXPECT_EQ(planned.resident_bytes, made->resident_bytes());
    EXPECT_EQ(planned.max_sub_group_numel, made->sub_groups().max_sub_group_numel());
    EXPECT_GT(planned.pool_bytes, 0u);
    if (c.name == "stage3-gradients-in-memory") {
      EXPECT_EQ(planned.gradient_bytes, plan.partition_numel() * sizeof(float));
    }
    if (c.name == "stage2-gradients-on-disk") {
      std::uint64_t unswapped = 0;
      for (std::size_t i = 0; i < made->num_sub_groups(); ++i) {
        for (const partition::GradientPiece& piece : made->swap_info(i).unswapped_gradients) {
          unswapped += piece.numel * sizeof(float);
        }
      }
      EXPECT_EQ(planned.gradient_bytes, unswapped);
    }
    if (c.name == "stage3-host-cache") {
      EXPECT_GT(planned.resident_bytes, 0u);
    }
  }
}

// A pool budget below the mode's minimum: the plan gives Create's own error.
TEST(MemoryPlan, SwapperPlanRefusesWhatCreateRefuses) {
  const partition::PartitionPlan plan = MakePlan(partition::PlanKind::kFlat);
  swapper::SwapperOptions options;
  options.store.paths = {"/nonexistent"};
  options.sub_group_size = 4096;
  options.pinned_budget_bytes = 4096;
  EXPECT_THAT(swapper::PlanSwapperHostMemory(plan, World().rank(), options),
              StatusIs(ErrorCode::kResourceExhausted, HasSubstr("zinf.pinned_budget_bytes")));
}

// ---- The gradient buckets: planned == built ----

TEST(MemoryPlan, BucketPlanMatchesTheBuckets) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend,
                            comm::CreateCollectiveBackend(World(), comm::BackendKind::kMpi));
  comm::Timers timers;
  for (const partition::PlanKind kind :
       {partition::PlanKind::kFlat, partition::PlanKind::kPerParam}) {
    const partition::PartitionPlan plan = MakePlan(kind);
    for (const std::uint64_t bucket : {1ull, 100ull, 5000ull, 9000ull, 1ull << 30}) {
      SCOPED_TRACE(fmt::format("kind {} bucket {}", static_cast<int>(kind), bucket));
      std::vector<float> accumulated(plan.partition_numel());
      GradientBuckets::Target target;
      target.accumulated = accumulated;
      ZINF_ASSERT_OK_AND_ASSIGN(
          auto built, GradientBuckets::Create(plan, World().rank(), {}, bucket, backend.get(),
                                              std::move(target), &timers, false));
      const GradientBuckets::HostPlan planned =
          GradientBuckets::PlanHostMemory(plan, World().rank(), bucket, true, 0);
      EXPECT_EQ(planned.max_bucket_elems, built->max_bucket_elems());
      EXPECT_GE(planned.bucket_bytes, 2 * built->max_bucket_elems() * sizeof(float));
      EXPECT_EQ(planned.staging_bytes, 0u);
    }
  }
}

// A one-rank backend whose reduce-scatter takes 20 ms: a backward pass that hands its
// gradients at once outruns it.
class SlowBackend final : public comm::CollectiveBackend {
 public:
  std::string_view name() const override { return "slow"; }
  bool device_buffers() const override { return false; }
  Status AllreduceSum(std::span<float>) override { return UnimplementedError("slow"); }
  Status ReduceScatterSum(std::span<const float>, std::span<float>) override {
    return UnimplementedError("slow");
  }
  Status ReduceScatterVSum(std::span<const float> in, std::span<const std::int64_t>,
                           std::span<float> out) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::copy_n(in.data(), out.size(), out.data());
    return OkStatus();
  }
  Status Allgather(std::span<const float>, std::span<float>) override {
    return UnimplementedError("slow");
  }
  Status Broadcast(std::span<float>, int) override { return UnimplementedError("slow"); }
  Status Synchronize() override { return OkStatus(); }
};

// Lent gradients handed faster than they are reduced: the send buffers alive stay at the two
// the plan counts (one being filled, one being reduced), not one per bucket.
TEST(MemoryPlan, LentBucketsInFlightStayWithinThePlan) {
  std::vector<partition::ParamSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back({fmt::format("w{}", i), {1000}});
  auto layout = partition::ParamLayout::Create(specs);
  ASSERT_TRUE(layout.has_value());
  ZINF_ASSERT_OK_AND_ASSIGN(
      const partition::PartitionPlan plan,
      partition::PartitionPlan::Create(*layout, {.kind = partition::PlanKind::kFlat,
                                                 .world_size = 1, .alignment_elems = 8}));
  SlowBackend backend;
  comm::Timers timers;
  std::vector<float> accumulated(plan.partition_numel(), 0.0f);
  GradientBuckets::Target target;
  target.accumulated = accumulated;
  ZINF_ASSERT_OK_AND_ASSIGN(auto buckets,
                            GradientBuckets::Create(plan, 0, {}, 1000, &backend, std::move(target),
                                                    &timers, /*background=*/true));
  ASSERT_EQ(buckets->num_buckets(), 8u);
  for (int p = 7; p >= 0; --p) {  // backward order: the last bucket is reduced first
    const std::vector<float> grad(1000, static_cast<float>(p + 1));
    ASSERT_THAT(buckets->Ready(static_cast<std::size_t>(p), 0, grad), IsOk());
  }
  ASSERT_THAT(buckets->Finish(0), IsOk());
  EXPECT_LE(buckets->peak_send_buffers(), 2u);
  for (int p = 0; p < 8; ++p) {
    EXPECT_EQ(accumulated[static_cast<std::size_t>(p) * 1000], static_cast<float>(p + 1));
  }
}

// ---- The budget ----

// A fake root: /proc/self/cgroup, /proc/meminfo and cgroup files under it.
class FakeRoot {
 public:
  FakeRoot() : dir_("memory-budget") {}
  void Write(const std::string& path, const std::string& text) {
    const std::filesystem::path full = dir_.path() + path;
    std::filesystem::create_directories(full.parent_path());
    std::ofstream(full) << text;
  }
  const std::string& root() const { return dir_.path(); }
  std::string Join(const std::string& path) const { return dir_.path() + path; }

 private:
  testing::ScratchDir dir_;
};

TEST(MemoryBudget, CgroupV2TakesTheSmallestLimitOnThePath) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "0::/job/rank\n");
  fake.Write("/proc/meminfo", "MemTotal: 100 kB\nMemAvailable: 999999 kB\n");
  fake.Write("/sys/fs/cgroup/job/rank/memory.max", "max\n");
  fake.Write("/sys/fs/cgroup/job/memory.max", "2147483648\n");
  fake.Write("/sys/fs/cgroup/memory.max", "4294967296\n");
  const MemoryBudget budget = DetectHostMemoryBudget(2, fake.root());
  EXPECT_EQ(budget.node_bytes, 2147483648u);
  EXPECT_EQ(budget.rank_bytes, 1073741824u);
  EXPECT_THAT(budget.source, HasSubstr("/sys/fs/cgroup/job/memory.max"));
}

TEST(MemoryBudget, CgroupV1MemoryController) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "4:cpu,cpuacct:/x\n3:memory:/slurm/job7\n");
  fake.Write("/sys/fs/cgroup/memory/slurm/job7/memory.limit_in_bytes", "1073741824\n");
  fake.Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  const MemoryBudget budget = DetectHostMemoryBudget(1, fake.root());
  EXPECT_EQ(budget.node_bytes, 1073741824u);
}

TEST(MemoryBudget, NoLimitFallsBackToMemAvailable) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "0::/\n");
  fake.Write("/sys/fs/cgroup/memory.max", "max\n");
  fake.Write("/proc/meminfo", "MemTotal: 100 kB\nMemAvailable: 3000 kB\n");
  const MemoryBudget budget = DetectHostMemoryBudget(3, fake.root());
  EXPECT_EQ(budget.node_bytes, 3000u * 1024);
  EXPECT_EQ(budget.rank_bytes, 1000u * 1024);
  EXPECT_THAT(budget.source, HasSubstr("MemAvailable"));
}

TEST(MemoryBudget, HostilePathsAndLinksAreNotFollowed) {
  FakeRoot fake;
  fake.Write("/proc/self/cgroup", "0::/../../etc\n0::/a\n");
  fake.Write("/secret/limit", "4096\n");
  std::filesystem::create_directories(fake.Join("/sys/fs/cgroup/a"));
  std::filesystem::create_symlink(fake.Join("/secret/limit"),
                                  fake.Join("/sys/fs/cgroup/a/memory.max"));
  fake.Write("/proc/meminfo", "MemAvailable: 8 kB\n");
  const MemoryBudget budget = DetectHostMemoryBudget(1, fake.root());
  EXPECT_EQ(budget.node_bytes, 8192u);  // the link's 4096 not taken
}

TEST(MemoryBudget, NothingReadableIsUnknown) {
  FakeRoot fake;
  const MemoryBudget budget = DetectHostMemoryBudget(1, fake.root());
  EXPECT_EQ(budget.node_bytes, 0u);
  MemoryPlan plan;
  plan.Add("pool", std::uint64_t{1} << 40, "keys");
  EXPECT_THAT(CheckMemoryPlan(plan, budget, 1), IsOk());  // nothing to check against
}

TEST(MemoryBudget, ConfigOverridesAndFractions) {
  FakeRoot fake;
  fake.Write("/proc/meminfo", "MemAvailable: 4000 kB\n");
  ZINF_ASSERT_OK_AND_ASSIGN(MemoryBudget bytes,
                            ResolveHostMemoryBudget({.bytes = 1 << 20}, 2, fake.root()));
  EXPECT_EQ(bytes.node_bytes, 1u << 20);
  EXPECT_EQ(bytes.rank_bytes, 1u << 19);
  EXPECT_EQ(bytes.source, "zinf.host_memory_budget");
  ZINF_ASSERT_OK_AND_ASSIGN(MemoryBudget half,
                            ResolveHostMemoryBudget({.fraction = 0.5}, 1, fake.root()));
  EXPECT_EQ(half.node_bytes, 2000u * 1024);
  FakeRoot empty;
  EXPECT_THAT(ResolveHostMemoryBudget({.fraction = 0.5}, 1, empty.root()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("give bytes")));
}

TEST(MemoryBudget, APlanBeyondTheBudgetNamesItsLargestItems) {
  MemoryPlan plan;
  plan.Add("small", 10, "a");
  plan.Add("swap buffer pool", 1000, "zinf.pinned_budget_bytes");
  plan.Add("nothing", 0, "b");
  plan.Add("reduce buckets", 500, "zero_optimization.reduce_bucket_size");
  EXPECT_EQ(plan.items().size(), 3u);
  EXPECT_EQ(plan.total_bytes(), 1510u);
  const MemoryBudget budget{.node_bytes = 3000, .rank_bytes = 1000, .source = "test"};
  EXPECT_THAT(CheckMemoryPlan(plan, budget, 3),
              StatusIs(ErrorCode::kResourceExhausted,
                       HasSubstr("largest: swap buffer pool 1000 B (shrink: "
                                 "zinf.pinned_budget_bytes); reduce buckets")));
  const MemoryBudget enough{.node_bytes = 1510, .rank_bytes = 1510, .source = "test"};
  EXPECT_THAT(CheckMemoryPlan(plan, enough, 1), IsOk());
}

// ---- The engine: a budget too small, refused on every rank ----

// A stage-2 model of six 10000-element parameters with lent gradients (the caller's weights
// are its only buffer, 240 kB), buckets of one parameter and small all-gather rounds: the pool
// of 4 buffers of the rank's one sub-group (4 x 4 x 20480 bytes at least) is the plan's largest
// item on 1 to 3 ranks.
std::string BudgetConfig(const std::string& swap_dir, const std::string& budget) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {{"type": "Adam", "params": {{"lr": 0.01}}}},
    "zero_optimization": {{"stage": 2, "reduce_bucket_size": 10000,
                           "allgather_bucket_size": 3000,
                           "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}},
    "zinf": {{"host_memory_budget": "{}", "adam_threads": 1}}
  }})",
                     swap_dir, budget);
}

std::vector<Param> BudgetParams(std::vector<float>& weights) {
  std::vector<Param> params;
  for (int i = 0; i < 6; ++i) {
    params.push_back({.name = fmt::format("w{}", i),
                      .shape = {10000},
                      .weights = std::span<float>(weights).subspan(10000 * i, 10000)});
  }
  return params;
}

TEST(MemoryPlanEngine, ATinyBudgetIsRefusedOnEveryRankBeforeAllocating) {
  SharedScratchDir dir("memory-plan-engine");
  std::vector<float> weights(60000, 0.5f);
  EngineOptions options;
  options.create_nvme_paths = true;
  options.stop_signals = false;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        config::Config config, config::ParseConfig(BudgetConfig(dir.Join("swap"), "64K"), config::ContextOf(World())));
    Result<std::unique_ptr<ZeroEngine>> engine =
        ZeroEngine::Create(World(), config, BudgetParams(weights), options);
    EXPECT_THAT(engine, StatusIs(ErrorCode::kResourceExhausted, HasSubstr("host memory plan: ")));
    EXPECT_THAT(engine, StatusIs(ErrorCode::kResourceExhausted, HasSubstr("swap buffer pool")));
    EXPECT_THAT(engine,
                StatusIs(ErrorCode::kResourceExhausted, HasSubstr("from zinf.host_memory_budget")));
  }
  // Refused before anything was made: the swap directory (created after the plan) is not there.
  ASSERT_THAT(World().Barrier(), IsOk());
  EXPECT_FALSE(std::filesystem::exists(dir.Join("swap")));

  // The same model with a budget that fits.
  ZINF_ASSERT_OK_AND_ASSIGN(config::Config config,
                            config::ParseConfig(BudgetConfig(dir.Join("swap"), "1G"), config::ContextOf(World())));
  ZINF_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ZeroEngine> engine,
                            ZeroEngine::Create(World(), config, BudgetParams(weights), options));
  EXPECT_THAT(engine->Close(), IsOk());
}

// A stage-2 model of four 2^20-element parameters (16 MiB of weights and as much gradient,
// registered) under DeepSpeed's defaults for the sizes: one sub-group, so a pool of 4 x 16 MiB,
// one bucket of the whole model and the 16 MiB partition gradient: about 100 MiB per rank
// beyond the registered buffers on 1 rank.
std::string FitConfig(const std::string& swap_dir, std::uint64_t budget, const char* extra) {
  return fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {{"type": "Adam", "params": {{"lr": 0.01}}}},
    "zero_optimization": {{"stage": 2, {}
                           "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}},
    "zinf": {{"host_memory_budget": {}, "adam_threads": 1}}
  }})",
                     extra, swap_dir, budget);
}

constexpr std::uint64_t kFitElems = 1u << 20;

std::vector<Param> FitParams(std::vector<float>& weights, std::vector<float>& grads) {
  std::vector<Param> params;
  for (std::uint64_t i = 0; i < 4; ++i) {
    params.push_back({.name = fmt::format("w{}", i),
                      .shape = {kFitElems},
                      .weights = std::span<float>(weights).subspan(kFitElems * i, kFitElems),
                      .grads = std::span<float>(grads).subspan(kFitElems * i, kFitElems)});
  }
  return params;
}

// A node budget of every local rank's RSS now (the registered buffers included) plus `extra`
// per rank, the same on every rank.
std::uint64_t NodeBudget(std::uint64_t extra) {
  std::array<std::uint64_t, 1> peak = {PeakRssBytes()};
  EXPECT_THAT(World().AllreduceInPlace<std::uint64_t>(peak, comm::ReduceOp::kMax), IsOk());
  return (peak[0] + extra) * static_cast<std::uint64_t>(World().topology().local_size);
}

TEST(MemoryPlanEngine, SizesTheConfigLeavesUnsetAreChosenToFitTheBudget) {
  SharedScratchDir dir("memory-plan-fit");
  std::vector<float> weights(4 * kFitElems, 0.5f), grads(4 * kFitElems, 0.0f);
  EngineOptions options;
  options.create_nvme_paths = true;
  options.stop_signals = false;
  const std::uint64_t budget = NodeBudget(48ull << 20);
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        config::Config config, config::ParseConfig(FitConfig(dir.Join("swap"), budget, ""), config::ContextOf(World())));
    ZINF_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ZeroEngine> engine,
                              ZeroEngine::Create(World(), config, FitParams(weights, grads),
                                                 options));
    const config::ZeroConfig& zero = engine->config().zero_optimization;
    EXPECT_LT(zero.sub_group_size, kFitElems * 4 / static_cast<std::uint64_t>(World().size()));
    EXPECT_LT(zero.reduce_bucket_size, 500'000'000u);
    // Chosen alike on every rank.
    std::array<std::uint64_t, 3> lowest = {zero.sub_group_size, zero.reduce_bucket_size,
                                           engine->config().zinf.swap_gradients ? 1u : 0u};
    std::array<std::uint64_t, 3> highest = lowest;
    ASSERT_THAT(World().AllreduceInPlace<std::uint64_t>(lowest, comm::ReduceOp::kMin), IsOk());
    ASSERT_THAT(World().AllreduceInPlace<std::uint64_t>(highest, comm::ReduceOp::kMax), IsOk());
    EXPECT_EQ(lowest, highest);
    EXPECT_THAT(engine->Close(), IsOk());
  }
  // A size the config gives is kept as given: the pool of one 1e9 sub-group does not fit.
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        config::Config config, config::ParseConfig(FitConfig(dir.Join("swap"), budget, R"("sub_group_size": 1e9,)"),
                                   config::ContextOf(World())));
    EXPECT_THAT(ZeroEngine::Create(World(), config, FitParams(weights, grads), options),
                StatusIs(ErrorCode::kResourceExhausted, HasSubstr("swap buffer pool")));
  }
  // A budget the defaults fit changes nothing.
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        config::Config config,
        config::ParseConfig(FitConfig(dir.Join("swap"), NodeBudget(1ull << 30), ""), config::ContextOf(World())));
    ZINF_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ZeroEngine> engine,
                              ZeroEngine::Create(World(), config, FitParams(weights, grads),
                                                 options));
    EXPECT_EQ(engine->config().zero_optimization.sub_group_size, 1'000'000'000u);
    EXPECT_EQ(engine->config().zero_optimization.reduce_bucket_size, 500'000'000u);
    EXPECT_FALSE(engine->config().zinf.swap_gradients);
    EXPECT_THAT(engine->Close(), IsOk());
  }
}

}  // namespace
}  // namespace zinf::engine
