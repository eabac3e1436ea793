// Private to zinf::engine: the host memory plan of one rank (docs/configs.md, "Memory plan").
//
// At Create the engine adds one item per buffer it and its modules will allocate, each item's
// bytes taken from the owning module's own planning function (PlanSwapperHostMemory,
// GradientBuckets::PlanHostMemory, ...) so that plan and allocation cannot drift, and checks the
// total against the budget (zinf.host_memory_budget, else the memory cgroup's limit, else
// MemAvailable, shared by the node's ranks) before anything large is allocated.
//
//   MemoryPlan plan;
//   plan.Add("swap buffer pool", pool_bytes, "zinf.pinned_budget_bytes, sub_group_size");
//   ZINF_ASSIGN_OR_RETURN(MemoryBudget budget, ResolveHostMemoryBudget(config, local_ranks));
//   ZINF_RETURN_IF_ERROR(CheckMemoryPlan(plan, budget));
//
// Not counted: memory outside the engine (the Python interpreter, torch and the model's own
// activations, MPI's buffers, the binary and its libraries, the allocator's slack).
//
// Thread safety: none needed (used once, in Create's thread).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/config/config.h"

namespace zinf::engine {

// One buffer (or set of buffers) of the plan, per rank.
struct MemoryItem {
  std::string name;         // "swap buffer pool"
  std::uint64_t bytes = 0;  // per rank
  std::string shrink;       // the config keys (or actions) that shrink it
};

class MemoryPlan {
 public:
  // Items of 0 bytes are kept out of the plan.
  void Add(std::string name, std::uint64_t bytes, std::string shrink);
  const std::vector<MemoryItem>& items() const { return items_; }
  // The sum of the items, saturating at 2^64 - 1.
  std::uint64_t total_bytes() const;
  // The `n` largest items, largest first (ties: the order they were added).
  std::vector<MemoryItem> Largest(std::size_t n) const;
  // "swap buffer pool 64.0 MiB, reduce buckets 8.0 MiB, ..." for the `n` largest items.
  std::string Summary(std::size_t n) const;

 private:
  std::vector<MemoryItem> items_;
};

// The host memory one rank may plan for, and where that number came from.
struct MemoryBudget {
  std::uint64_t node_bytes = 0;  // the node's; 0: unknown (nothing to check against)
  std::uint64_t rank_bytes = 0;  // node_bytes / local ranks
  std::string source;            // "zinf.host_memory_budget", "cgroup v2 memory.max /a/b", ...
};

// The node's host memory as the kernel limits it: the smallest memory cgroup limit on the
// path of this process's cgroup (v2: memory.max of it and its ancestors; v1: the memory
// controller's memory.limit_in_bytes), else MemAvailable from /proc/meminfo; node_bytes 0 when
// neither can be read. "max" and limits above 2^60 bytes are no limit. `root`: prepended to
// every path ("" in production; a test's fake /proc and /sys tree). Reads small, bounded
// amounts of each file and does not follow a symbolic link at its last component; tolerates
// every file's absence. Local.
MemoryBudget DetectHostMemoryBudget(int local_ranks, const std::string& root = "");

// zinf.host_memory_budget applied: its bytes, or its fraction of the detected budget, else the
// detected budget. A fraction with no detectable budget is FailedPrecondition (there is
// nothing to take a fraction of). Local.
Result<MemoryBudget> ResolveHostMemoryBudget(const config::HostMemoryBudgetConfig& config, int local_ranks,
                                             const std::string& root = "");

// OK when the plan fits the budget per rank (or the budget is unknown), else ResourceExhausted
// "host memory plan: <total> per rank, more than the budget of <rank_bytes> per rank (<node>
// over <k> ranks, from <source>); largest: <item> <bytes> (shrink: <keys>), ...; raise
// zinf.host_memory_budget only if the memory is really there". Local.
Status CheckMemoryPlan(const MemoryPlan& plan, const MemoryBudget& budget, int local_ranks);

}  // namespace zinf::engine
