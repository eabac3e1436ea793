// The config as the options of the modules the engine builds (for a program that drives a
// swapper itself; ZeroEngine uses them).
#pragma once

#include "zinf/config/config.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/io_backend.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::engine {

// Conversions of the config into the options of the modules the engine drives.
storage::AioOptions ToAioOptions(const config::Config& config);
// Adam hyper-parameters; adamw from swapper::ResolveAdamWMode(type, adam_w_mode); threads from
// zinf.adam_threads.
swapper::AdamOptions ToAdamOptions(const config::Config& config);
// ZeRO stage 1/2 -> kFlat, 3 -> kPerParam.
partition::PlanKind ToPlanKind(const config::Config& config);
// Everything the optimizer swapper takes from the config: store (resolved nvme paths,
// EffectiveJobId(config, layout), world_rank, keep_swap, verify_swap, nvme_path_weights as
// path_weights or probe_path_weights with the probe on zinf.io_engine and aio), aio, engine,
// sub_group_size,
// pool (pinned_budget_bytes, buffer_count, pin_memory), pipeline flags, Adam, bf16, swap_gradients
// and gradient_accumulation_steps, the host memory tier (zinf.host_cache_bytes) and device cpu
// (all_resident: every sub-group in host memory, no store paths needed).
swapper::SwapperOptions ToSwapperOptions(const config::Config& config, int world_rank,
                                         const partition::ParamLayout& layout);

}  // namespace zinf::engine
