// What CreateOptimizerSwapper assembles before the swapper object exists.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

struct OptimizerSwapper::Parts {
  SwapperOptions options;
  std::optional<comm::Communicator> comm;
  std::optional<partition::PartitionPlan> plan;
  std::optional<partition::SubGroupPlan> sub_groups;
  std::vector<SubGroupSwapInfo> infos;
  std::unique_ptr<storage::SwapStore> store;
  std::unique_ptr<storage::IoEngine> read_engine;
  std::unique_ptr<storage::IoEngine> write_engine;
  std::unique_ptr<BufferPool> pool;
  std::optional<CpuAdam> adam;
  std::size_t num_slots = 0;
};

}  // namespace zinf::swapper
