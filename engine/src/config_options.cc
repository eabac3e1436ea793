#include "zinf/engine/config_options.h"

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/storage/stripe_map.h"

namespace zinf::engine {

storage::AioOptions ToAioOptions(const config::Config& config) {
  return storage::AioOptions{.block_size = config.aio.block_size,
                             .queue_depth = config.aio.queue_depth,
                             .intra_op_parallelism = config.aio.intra_op_parallelism,
                             .single_submit = config.aio.single_submit,
                             .overlap_events = config.aio.overlap_events};
}

swapper::AdamOptions ToAdamOptions(const config::Config& config) {
  const config::OptimizerConfig& o = config.optimizer;
  Result<bool> adamw = swapper::ResolveAdamWMode(config::OptimizerTypeName(o.type), o.adam_w_mode);
  ZINF_CHECK(adamw.has_value(), "optimizer type {} not known to ResolveAdamWMode",
             config::OptimizerTypeName(o.type));
  swapper::AdamOptions adam;
  adam.lr = o.lr;
  adam.beta1 = o.betas[0];
  adam.beta2 = o.betas[1];
  adam.eps = o.eps;
  adam.weight_decay = o.weight_decay;
  adam.adamw = *adamw;
  adam.amsgrad = o.amsgrad;
  adam.threads = config.zinf.adam_threads;
  return adam;
}

partition::PlanKind ToPlanKind(const config::Config& config) {
  Result<partition::PlanKind> kind =
      partition::PlanKindForZeroStage(config.zero_optimization.stage);
  ZINF_CHECK(kind.has_value(), "zero stage {} passed validation", config.zero_optimization.stage);
  return *kind;
}

namespace {

// zinf.nvme_path_weights as the swap store's integer weights (empty: equal shares).
std::vector<std::uint32_t> ToPathWeights(const config::Config& config) {
  const std::vector<double>& ratios = config.zinf.nvme_path_weights.weights;
  if (ratios.empty()) return {};
  Result<storage::StripeMap> map = storage::StripeMap::FromRatios(ratios);
  ZINF_CHECK(map.has_value(), "zinf.nvme_path_weights passed validation: {}",
             map.error().ToString());
  return map->weights();
}

}  // namespace

swapper::SwapperOptions ToSwapperOptions(const config::Config& config, int world_rank,
                                         const partition::ParamLayout& layout) {
  const config::OffloadOptimizerConfig& offload = config.zero_optimization.offload_optimizer;
  swapper::SwapperOptions options;
  options.store.paths = offload.resolved_nvme_paths;
  options.store.job_id = config::EffectiveJobId(config, layout);
  options.store.world_rank = world_rank;
  options.store.keep = config.zinf.keep_swap;
  options.store.verify_swap = config.zinf.verify_swap;
  options.store.path_weights = ToPathWeights(config);
  options.store.probe_path_weights = config.zinf.nvme_path_weights.probe;
  options.store.probe_backend = config.zinf.io_engine;
  options.store.probe_aio = ToAioOptions(config);
  options.aio = ToAioOptions(config);
  options.backend = config.zinf.io_engine;
  options.state_format = config.zinf.optimizer_state;
  options.sub_group_size = config.zero_optimization.sub_group_size;
  options.pinned_budget_bytes = config.zinf.pinned_budget_bytes;
  options.host_cache_bytes = config.zinf.host_cache_bytes;
  options.all_resident = offload.device == config::OffloadDevice::kCpu;
  options.buffer_count = static_cast<std::uint64_t>(offload.buffer_count);
  options.pin_memory = offload.pin_memory;
  options.pipeline_read = offload.pipeline_read;
  options.pipeline_write = offload.pipeline_write;
  options.adam = ToAdamOptions(config);
  options.bf16_params = config.bf16;
  options.swap_gradients = config.zinf.swap_gradients;
  options.gradient_accumulation_steps = static_cast<int>(config.gradient_accumulation_steps);
  return options;
}

}  // namespace zinf::engine
