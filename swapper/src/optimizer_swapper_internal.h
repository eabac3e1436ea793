// What CreateOptimizerSwapper assembles before the swapper object exists.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

// What CreateOptimizerSwapper's local phase decides besides the swapper's parts.
struct LocalSetup {
  bool pipelined = false;  // a pipeline was asked for and the pool holds its buffers
  GradientAccumulation accumulation = GradientAccumulation::kAuto;  // resolved
  std::unique_ptr<storage::IoBackend> gradient_engine;               // read-add-write gradients only
  std::vector<storage::TensorSpec> specs;                           // what the store reserves
};

struct OptimizerSwapper::Parts {
  SwapperOptions options;
  std::optional<comm::Communicator> comm;
  std::optional<partition::PartitionPlan> plan;
  std::optional<partition::SubGroupPlan> sub_groups;
  std::vector<SubGroupSwapInfo> infos;
  std::unique_ptr<storage::SwapStore> store;
  std::unique_ptr<storage::IoBackend> read_engine;
  std::unique_ptr<storage::IoBackend> write_engine;
  std::unique_ptr<BufferPool> pool;
  std::optional<CpuAdam> adam;
  std::size_t num_slots = 0;
  std::vector<std::vector<storage::AlignedBuffer>> resident;  // per sub-group, empty if swapped
  std::vector<std::vector<storage::AlignedBuffer>> resident_spare;  // speculate_resident

  // CreateOptimizerSwapper's local phase (a member: Parts is protected): checks `options`, then
  // builds this rank's sub-group plan, CpuAdam, store (opened with parts.options.store), pool,
  // backends and swap infos into `parts`.
  static Status SetUpLocally(Parts& parts, const comm::Communicator& comm,
                             const partition::PartitionPlan& plan, const SwapperOptions& options,
                             LocalSetup* setup);
};

}  // namespace zinf::swapper
