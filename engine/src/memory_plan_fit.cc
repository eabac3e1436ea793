// The engine's host memory plan (memory_plan.h): what this rank will hold (MakeMemoryPlan), the
// unset keys shrunk until it fits the budget (FitMemoryPlan), and the check against the budget
// (PlanHostMemory), all before Create allocates anything large.
#include "engine_impl.h"

#include <malloc.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/engine/config_options.h"
#include "zinf/partition/sub_group.h"

namespace zinf::engine {

namespace {

using comm::ReduceOp;

}  // namespace

// The swapper's options from the config, the host memory budget, and the plan fitted to it: the
// speculation's memory gives way first when it was not asked for, then FitMemoryPlan shrinks the
// keys left unset, then the host tier's second copy gives way if the plan still does not fit.
Result<swapper::SwapperOptions> ZeroEngine::Impl::PlanMemory(bool speculating) {
  State& s = *state_;
  swapper::SwapperOptions options = ToSwapperOptions(config_, world_.rank(), s.plan->layout());
  // Stores left by killed runs are scratch: this job's own is reused, other jobs' are removed
  // once every rank's store is open (SwapStore::ReclaimStale; kept ones are named in a WARN).
  options.store.reclaim_stale = !config_.zinf.keep_swap;
  options.accumulation_memory_limit_bytes = options_.gradient_memory_limit_bytes;
  // Before anything large is allocated: the plan against the budget, refused on every rank.
  Result<MemoryBudget> budget =
      ResolveHostMemoryBudget(config_.zinf.host_memory_budget, world_.topology().local_size);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(budget ? OkStatus() : Status(budget.error())));
  // Speculation keeps up to one more slot per swapped sub-group (the swapper caps it).
  options.speculative_slots = speculating ? SIZE_MAX : 0;
  options.speculate_resident = speculating && options.host_cache_bytes > 0;
  if (speculating && !config_.Gave("zinf.speculative_step")) {
    // Unasked for, the speculation's memory (the kept weights, the host tier's copy) gives way
    // before anything the fit would shrink for it; every rank decides as the tightest one.
    Result<MemoryPlan> plan = MakeMemoryPlan(options);
    std::array<std::uint64_t, 1> over = {
        plan && budget->node_bytes > 0 && plan->total_bytes() > budget->rank_bytes ? 1u : 0u};
    ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(over, ReduceOp::kMax));
    if (over[0] != 0) {
      ZINF_LOG_INFO(
          "engine: no speculative step: its memory does not fit the host memory budget with "
          "the rest of the plan; set zinf.speculative_step to decide");
      options.speculative_slots = 0;
      options.speculate_resident = false;
    }
  }
  ZINF_RETURN_IF_ERROR(FitMemoryPlan(*budget, options));
  if (options.swap_gradients) options.speculative_slots = 0;  // the fit swaps the gradient
  Status planned = comm().AgreeOnStatus(PlanHostMemory(*budget, options));
  if (!planned && options.speculate_resident && options.speculative_slots > 0) {
    // The host tier's second copy gives way first: its sub-groups are then stepped by Step.
    ZINF_LOG_INFO(
        "engine: the speculative step leaves the host tier's sub-groups to Step: their second "
        "copy does not fit the host memory budget");
    options.speculate_resident = false;
    planned = comm().AgreeOnStatus(PlanHostMemory(*budget, options));
  }
  ZINF_RETURN_IF_ERROR(planned);
  return options;
}

// What this rank will hold in host memory (memory_plan.h), each item from the owning module's
// planning function. Local; allocates nothing.
Result<MemoryPlan> ZeroEngine::Impl::MakeMemoryPlan(const swapper::SwapperOptions& options) const {
  MemoryPlan plan;
  PlanWeightMemory(plan);
  ZINF_RETURN_IF_ERROR(PlanSwapperMemory(options, plan));
  return plan;
}

void ZeroEngine::Impl::PlanWeightMemory(MemoryPlan& plan) const {
  const State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  const partition::ParamLayout& layout = s.plan->layout();
  const auto world = static_cast<std::uint64_t>(world_.size());
  constexpr std::uint64_t kF = sizeof(float);
  std::uint64_t loop_floats = 0, persistent = 0, partitioned = 0, largest_partitioned = 0;
  std::uint64_t largest_on_disk = 0;
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    loop_floats += s.params[p].weights.size() + s.params[p].grads.size();
  }
  // The registered buffers exist before Create: counted once, as their own item.
  plan.Add("this process before the engine (its RSS then, less the registered buffers)",
           s.rss_before_engine - std::min(s.rss_before_engine, loop_floats * kF),
           "a smaller program around the engine");
  for (const HostMemoryUse& use : options_.host_memory_uses) {
    plan.Add(use.name, use.bytes, use.shrink);
  }
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] == Holding::kPersistent) persistent += layout.param(p).numel;
    if (s.holding[p] != Holding::kPartitioned) continue;
    const std::uint64_t whole = s.plan->ShardNumel(p) * world;  // GatherParams' size
    partitioned += whole;
    largest_partitioned = std::max(largest_partitioned, whole);
    if (s.plan->ShardPartitionOffset(p) + s.plan->ShardNumel(p) > s.shard_numel) {
      largest_on_disk = std::max(largest_on_disk, s.plan->ShardNumel(p));
    }
  }
  // Stage 3: a model registered with its weights is what shrinks most.
  plan.Add("the caller's registered weights and gradients", loop_floats * kF,
           "ZeRO stage 3 with the parameters registered without weights and gradients");
  plan.Add("persistent stage-3 parameters", persistent * kF,
           "zero_optimization.stage3_param_persistence_threshold, "
           "stage3_model_persistence_threshold");
  plan.Add("fp32 shards in memory", s.shard_numel * kF,
           "zero_optimization.offload_param.device \"nvme\" with offload_param.max_in_cpu");
  plan.Add("all-gather rounds", s.GatherRound(config_, world_.size()) * (1 + world) * kF,
           "zero_optimization.allgather_bucket_size");
  if (s.num_partitioned > 0) {
    // A Gather that asks more than the window at once holds what it asks (the largest
    // parameter at least).
    const std::uint64_t window = std::max(
        std::min<std::uint64_t>(zero.stage3_max_live_parameters, partitioned), largest_partitioned);
    plan.Add("stage-3 live parameters", window * kF,
             "zero_optimization.stage3_max_live_parameters");
  }
  if (largest_on_disk > 0) {
    const std::uint64_t staging = kShardStagingBytes + 2 * 4096;  // AllocateShardStaging's
    plan.Add("shard read-ahead",
             ShardReader::PlanBytes(static_cast<std::size_t>(zero.offload_param.buffer_count),
                                    zero.stage3_prefetch_bucket_size, largest_on_disk) +
                 2 * staging,
             "zero_optimization.stage3_prefetch_bucket_size, offload_param.buffer_count");
  }
}

Status ZeroEngine::Impl::PlanSwapperMemory(const swapper::SwapperOptions& options,
                                           MemoryPlan& plan) const {
  const State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  constexpr std::uint64_t kF = sizeof(float);
  ZINF_ASSIGN_OR_RETURN(const swapper::SwapperHostPlan swap,
                        swapper::PlanSwapperHostMemory(*s.plan, world_.rank(), options));
  plan.Add("swap buffer pool", swap.pool_bytes,
           "zinf.pinned_budget_bytes, offload_optimizer.buffer_count, "
           "zero_optimization.sub_group_size");
  plan.Add("optimizer state in memory", swap.resident_bytes,
           "zinf.host_cache_bytes, offload_optimizer.device \"nvme\"");
  plan.Add("its second copy for the speculative step", swap.resident_spare_bytes,
           "zinf.speculative_step false, zinf.host_cache_bytes");
  const bool lent = s.params.empty() || s.params[0].grads.empty();
  const GradientBuckets::HostPlan buckets =
      GradientBuckets::PlanHostMemory(*s.plan, world_.rank(), zero.reduce_bucket_size, lent,
                                      options.swap_gradients ? swap.max_sub_group_numel : 0);
  plan.Add("reduce buckets", buckets.bucket_bytes, "zero_optimization.reduce_bucket_size");
  if (options.swap_gradients) {
    plan.Add("gradient swapper", swap.gradient_bytes,
             "a partition gradient above the accumulation limit is swapped");
    plan.Add("gradient staging", buckets.staging_bytes,
             "zero_optimization.reduce_bucket_size, sub_group_size");
  } else {
    plan.Add("partition gradient", s.partition_numel * kF, "zinf.swap_gradients");
  }
  if (options.speculative_slots > 0 && !options.swap_gradients) {
    // The speculated sub-groups' new weights wait for Step's sink (those it writes anything of).
    ZINF_ASSIGN_OR_RETURN(
        const partition::SubGroupPlan sub_groups,
        partition::SubGroupPlan::Create(*s.plan, world_.rank(), options.sub_group_size));
    std::uint64_t kept = 0;
    for (const partition::SubGroup& sg : sub_groups.sub_groups()) {
      if (SinkWrites(sg.partition_offset, sg.numel)) kept += sg.numel;
    }
    plan.Add("speculative step's new weights", kept * kF, "zinf.speculative_step false");
  }
  return OkStatus();
}

// The host-memory keys the config left unset (Config::Gave), shrunk until this rank's plan
// fits the budget, in the order of what they cost: the reduce buckets and the live window
// (more, smaller collectives), sub-groups down to 4M elements (more, smaller I/Os), the fp32
// shards kept in memory (offload_param nvme: read when gathered) and their read-ahead, the
// partition gradient (swapped), then sub-groups and buckets down to their floors. Each goes down
// the powers of two until the plan fits or the key is at its floor, and keeps the value of the
// smallest plan on the way (its own when none was smaller). The ranks then take the smallest of
// each (every rank must cut the reduce buckets alike). Keys given are kept as given; what still
// does not fit is PlanHostMemory's error. Collective.
Status ZeroEngine::Impl::FitMemoryPlan(const MemoryBudget& budget,
                                       swapper::SwapperOptions& options) {
  State& s = *state_;
  config::ZeroConfig& zero = config_.zero_optimization;
  const config::ZeroConfig before = zero;
  // zinf.swap_gradients as a size: 1 keeps the partition gradient in memory, 0 swaps it.
  std::uint64_t keep_gradient = options.swap_gradients ? 0 : 1;
  const std::vector<SizingStep> steps = SizingSteps(&keep_gradient);

  // The options and the holding plan after a change; an error when the holding plan refuses it
  // (offload_param nvme: a shard on disk above offload_param.buffer_size). A gradient swapped
  // for the plan's sake is swapped whole: none of it accumulates in memory
  // (EngineOptions::gradient_memory_limit_bytes).
  const std::uint64_t accumulation_limit = options.accumulation_memory_limit_bytes;
  auto apply = [&] {
    options.sub_group_size = zero.sub_group_size;
    options.swap_gradients = keep_gradient == 0;
    options.accumulation_memory_limit_bytes =
        options.swap_gradients && !config_.Gave("zinf.swap_gradients") ? 0 : accumulation_limit;
    return s.PlanHolding(config_);
  };
  // A plan that cannot be made (a pinned pool too small for a sub-group) fits nothing: the
  // keys shrink on; what is left is PlanHostMemory's error.
  auto total = [&]() -> std::uint64_t {
    Result<MemoryPlan> plan = MakeMemoryPlan(options);
    return plan ? plan->total_bytes() : UINT64_MAX;
  };
  ShrinkToFit(steps, budget, apply, total);
  std::array<std::uint64_t*, 7> sizes = {&zero.reduce_bucket_size,
                                         &zero.allgather_bucket_size,
                                         &zero.stage3_max_live_parameters,
                                         &zero.sub_group_size,
                                         &zero.offload_param.max_in_cpu,
                                         &zero.stage3_prefetch_bucket_size,
                                         &keep_gradient};
  std::array<std::uint64_t, 7> chosen;
  for (std::size_t i = 0; i < sizes.size(); ++i) chosen[i] = *sizes[i];
  ZINF_RETURN_IF_ERROR(comm().AllreduceInPlace<std::uint64_t>(chosen, comm::ReduceOp::kMin));
  for (std::size_t i = 0; i < sizes.size(); ++i) *sizes[i] = chosen[i];
  config_.zinf.swap_gradients = keep_gradient == 0;
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(apply()));

  LogSizing(before, keep_gradient, accumulation_limit, budget);
  return OkStatus();
}

std::vector<ZeroEngine::Impl::SizingStep> ZeroEngine::Impl::SizingSteps(
    std::uint64_t* keep_gradient) {
  const State& s = *state_;
  config::ZeroConfig& zero = config_.zero_optimization;
  std::vector<SizingStep> steps;
  auto add = [&](std::string_view key, std::uint64_t* value, std::uint64_t floor, bool applies) {
    if (applies && !config_.Gave(key)) steps.push_back({key, value, floor});
  };
  const bool stage3 = s.num_partitioned > 0;
  std::uint64_t largest_partitioned = 0;  // whole, as gathered: the live window's floor
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] != Holding::kPartitioned) continue;
    largest_partitioned = std::max(largest_partitioned, s.plan->ShardNumel(p) * world_.size());
  }
  add("zero_optimization.reduce_bucket_size", &zero.reduce_bucket_size, 1u << 20, true);
  add("zero_optimization.allgather_bucket_size", &zero.allgather_bucket_size,
      (1u << 20) * static_cast<std::uint64_t>(world_.size()), true);
  add("zero_optimization.stage3_max_live_parameters", &zero.stage3_max_live_parameters,
      largest_partitioned, stage3);
  add("zero_optimization.sub_group_size", &zero.sub_group_size, 1u << 22, true);
  add("zero_optimization.offload_param.max_in_cpu", &zero.offload_param.max_in_cpu, 0,
      stage3 && zero.offload_param.device == config::OffloadDevice::kNvme);
  add("zero_optimization.stage3_prefetch_bucket_size", &zero.stage3_prefetch_bucket_size, 0,
      stage3 && zero.offload_param.device == config::OffloadDevice::kNvme);
  add("zinf.swap_gradients", keep_gradient, 0,
      zero.offload_optimizer.device == config::OffloadDevice::kNvme);
  add("zero_optimization.sub_group_size", &zero.sub_group_size, partition::kDefaultMinSwapNumel,
      true);
  add("zero_optimization.reduce_bucket_size", &zero.reduce_bucket_size, 1, true);
  return steps;
}

void ZeroEngine::Impl::ShrinkToFit(std::span<const SizingStep> steps, const MemoryBudget& budget,
                                   const std::function<Status()>& apply,
                                   const std::function<std::uint64_t()>& total) {
  // Twice: a key early in the order that could not help while a later one kept the plan from
  // being made (or from moving) gets its turn again.
  for (int pass = 0; pass < 2 && budget.node_bytes > 0; ++pass) {
    for (const SizingStep& step : steps) {
      // The plan is not monotonic in every key (below the swapper's smallest swapped piece a
      // sub-group's gradient stays in memory): the value of the smallest plan is kept.
      std::uint64_t best = *step.value, best_total = total();
      while (best_total > budget.rank_bytes && *step.value > step.floor) {
        const std::uint64_t was = *step.value;
        *step.value = std::max(std::bit_floor(*step.value - 1), step.floor);  // powers of 2
        if (!apply()) {
          *step.value = was;
          break;
        }
        const std::uint64_t now = total();
        if (now < best_total) {
          best = *step.value;
          best_total = now;
        }
      }
      *step.value = best;
      (void)apply();  // a value it accepted before
    }
  }
}

void ZeroEngine::Impl::LogSizing(const config::ZeroConfig& before, std::uint64_t keep_gradient,
                                 std::uint64_t accumulation_limit,
                                 const MemoryBudget& budget) const {
  const config::ZeroConfig& zero = config_.zero_optimization;
  std::vector<std::string> changed;
  auto note = [&](std::string_view key, std::uint64_t from, std::uint64_t to) {
    if (from != to) changed.push_back(fmt::format("{} {} (default {})", key, to, from));
  };
  note("reduce_bucket_size", before.reduce_bucket_size, zero.reduce_bucket_size);
  note("allgather_bucket_size", before.allgather_bucket_size, zero.allgather_bucket_size);
  note("stage3_max_live_parameters", before.stage3_max_live_parameters,
       zero.stage3_max_live_parameters);
  note("sub_group_size", before.sub_group_size, zero.sub_group_size);
  note("offload_param.max_in_cpu", before.offload_param.max_in_cpu, zero.offload_param.max_in_cpu);
  note("stage3_prefetch_bucket_size", before.stage3_prefetch_bucket_size,
       zero.stage3_prefetch_bucket_size);
  if (keep_gradient == 0 && !config_.Gave("zinf.swap_gradients")) {
    changed.push_back(
        fmt::format("zinf.swap_gradients true (default false), none of the gradient accumulated "
                    "in memory (the caller's limit was {})",
                    FormatBytes(accumulation_limit)));
  }
  if (!changed.empty()) {
    ZINF_LOG_INFO(
        "engine: host memory plan: sized what the config leaves unset to fit the budget of {} per "
        "rank ({}): {}; set a key to keep your own value",
        FormatBytes(budget.rank_bytes), budget.source, fmt::join(changed, ", "));
    // Memory is tight: buffers of 1 MiB and more (torch's activations and gathered weights
    // among them) get mappings of their own, returned to the system when freed, instead of
    // staying in glibc's heap once its dynamic threshold has grown past them. The environment's
    // MALLOC_MMAP_THRESHOLD_ wins.
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 1 << 20);
  }
}

// The plan (MakeMemoryPlan) against the budget; one INFO line per node. Local (the same decision
// on every rank of a node; the caller agrees).
Status ZeroEngine::Impl::PlanHostMemory(const MemoryBudget& budget,
                                        const swapper::SwapperOptions& options) {
  State& s = *state_;
  ZINF_ASSIGN_OR_RETURN(const MemoryPlan plan, MakeMemoryPlan(options));
  s.plan_bytes = plan.total_bytes();
  s.budget_bytes = budget.node_bytes > 0 ? budget.rank_bytes : 0;
  // One line per node (its first rank), an exception to "INFO on rank 0": each node has its
  // own budget.
  if (world_.topology().local_rank == 0 &&
      static_cast<int>(GetLogLevel()) <= static_cast<int>(LogLevel::kInfo)) {
    LogLine(LogLevel::kInfo,
            fmt::format("engine: host memory plan on host {}: {} per rank ({}); budget {} per "
                        "rank ({} over {} rank(s), {})",
                        world_.topology().hostname, FormatBytes(s.plan_bytes), plan.Summary(4),
                        budget.node_bytes > 0 ? FormatBytes(budget.rank_bytes) : "unknown",
                        budget.node_bytes > 0 ? FormatBytes(budget.node_bytes) : "unknown",
                        world_.topology().local_size, budget.source));
  }
  return CheckMemoryPlan(plan, budget, world_.topology().local_size);
}

}  // namespace zinf::engine
