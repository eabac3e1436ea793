// Helpers shared by the checkpoint tests and the kill -9 helper: a small model, a swapper whose
// state is a deterministic function of (tensor, step, flat element), and a bitwise check of it.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zinf/comm/communicator.h"
#include "zinf/core/check.h"
#include "zinf/core/status.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::checkpoint {
// The swapper's types the checkpoint tests build and inspect.
using swapper::AdamOptions;
using swapper::CreateOptimizerSwapper;
using swapper::OptimizerSwapper;
using swapper::Q8Moment;
using swapper::Q8Moments;
using swapper::StateFormat;
using swapper::StateTensor;
using swapper::SwapperOptions;
namespace q8 = swapper::q8;
}  // namespace zinf::checkpoint

namespace zinf::checkpoint::checkpoint_testing {

// Odd sizes so that partitions, sub-groups and checkpoint chunks never line up.
inline partition::ParamLayout TestLayout(bool other = false, std::uint64_t extra_numel = 0) {
  std::vector<partition::ParamSpec> specs;
  specs.push_back({"embed", {37, 129}});
  specs.push_back(
      {"w1", other ? std::vector<std::int64_t>{3, 2048} : std::vector<std::int64_t>{2048, 3}});
  specs.push_back({"b1", {17}});
  specs.push_back({"w2", {1500, 7}});
  specs.push_back({"scale", {}});
  specs.push_back({"head", {4099}});
  if (extra_numel > 0) specs.push_back({"extra", {static_cast<std::int64_t>(extra_numel)}});
  auto layout = partition::ParamLayout::Create(std::move(specs));
  ZINF_CHECK(layout.has_value());
  return std::move(*layout);
}

inline float StateValue(StateTensor which, std::int64_t step, std::uint64_t flat) {
  std::uint64_t x = flat * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(which) * 7919 +
                    static_cast<std::uint64_t>(step) * 1000003;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<float>(x % 1000003) / 1000003.0f * 2.0f - 1.0f;
}

struct SwapperSetup {
  std::string store_dir;
  std::string job_id;
  int world_size = 1;
  bool per_param = false;
  std::uint64_t sub_group_size = 2000;
  bool adamw = true;
  bool other_layout = false;
  std::uint64_t extra_numel = 0;  // appends a parameter "extra" of this numel
  StateFormat state_format = StateFormat::kFp32;
  std::uint64_t host_cache_bytes = 0;  // SwapperOptions::host_cache_bytes (the host tier)
};

struct TestSwapper {
  std::unique_ptr<partition::PartitionPlan> plan;
  std::unique_ptr<OptimizerSwapper> swapper;
};

inline Result<TestSwapper> MakeSwapper(const comm::Communicator& comm, const SwapperSetup& s) {
  TestSwapper t;
  partition::ParamLayout layout = TestLayout(s.other_layout, s.extra_numel);
  ZINF_ASSIGN_OR_RETURN(partition::PartitionPlan plan,
                        s.per_param
                            ? partition::PartitionPlan::CreatePerParam(layout, comm.size(), 8)
                            : partition::PartitionPlan::CreateFlat(layout, comm.size(), 8));
  t.plan = std::make_unique<partition::PartitionPlan>(std::move(plan));
  SwapperOptions options;
  options.store.paths = {s.store_dir};
  options.store.job_id = s.job_id;
  options.store.stripe_unit_bytes = 64 << 10;
  options.sub_group_size = s.sub_group_size;
  options.state_format = s.state_format;
  options.host_cache_bytes = s.host_cache_bytes;
  options.adam = AdamOptions{.lr = 1e-2, .weight_decay = 0.01, .adamw = s.adamw, .threads = 1};
  ZINF_ASSIGN_OR_RETURN(t.swapper, CreateOptimizerSwapper(comm, *t.plan, options));
  ZINF_RETURN_IF_ERROR(t.swapper->Initialize([](std::uint64_t, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);
    return OkStatus();
  }));
  return t;
}

// Local: every sub-group's state = value(tensor, step, flat) (padding 0).
using StateValueFn = float (*)(StateTensor, std::int64_t, std::uint64_t);
inline Status FillState(OptimizerSwapper& swapper, std::int64_t step,
                        StateValueFn value = StateValue) {
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    ZINF_RETURN_IF_ERROR(
        swapper.WriteState(i, step, [&](StateTensor which, std::span<float> out) -> Status {
          for (const partition::SubGroupFragment& f : sg.fragments) {
            for (std::uint64_t k = 0; k < f.numel; ++k) {
              out[f.sub_group_offset + k] = value(which, step, f.flat_offset + k);
            }
          }
          return OkStatus();
        }));
  }
  return OkStatus();
}

// Local: OK if every real element equals StateValue(tensor, step, flat) bitwise and the padding
// is 0; otherwise DataLoss naming the first difference.
inline Status CheckState(OptimizerSwapper& swapper, std::int64_t step) {
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    std::vector<float> got(sg.numel);
    for (StateTensor which : {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      ZINF_RETURN_IF_ERROR(swapper.ReadState(i, which, 0, got));
      std::vector<float> want(sg.numel, 0.0f);
      for (const partition::SubGroupFragment& f : sg.fragments) {
        for (std::uint64_t k = 0; k < f.numel; ++k) {
          want[f.sub_group_offset + k] = StateValue(which, step, f.flat_offset + k);
        }
      }
      for (std::uint64_t k = 0; k < sg.numel; ++k) {
        if (std::memcmp(&got[k], &want[k], sizeof(float)) != 0) {
          return DataLossError(fmt::format("sub-group {} {} element {}: got {}, want {} (step {})",
                                           i, StateTensorName(which), k, got[k], want[k], step));
        }
      }
    }
  }
  return OkStatus();
}

}  // namespace zinf::checkpoint::checkpoint_testing
