// The checkpoint the DeepSpeed export tests need and zinf-train cannot make: two parameter
// groups whose parameters interleave in layout order (the odd sizes of checkpoint_test_util.h),
// Adam with L2 decay (adam_w_mode false), fp16 with a dynamic loss scaler after an overflow (one
// step skipped), step 5, state StateValue(tensor, 5, flat element), a user state of every JSON
// type, nested (the model file's client state). Used by
// deepspeed_export_test.cc and deepspeed_export_make_ckpt.cc.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/communicator.h"
#include "zinf/core/check.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/plan.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::interop::deepspeed_testing {

inline constexpr std::int64_t kGroupsStep = 5;

// The trainer state's "user" object: every JSON type, nested (deepspeed_export_test.sh's
// `two` expectation holds the same object).
inline nlohmann::json GroupsUser() {
  return nlohmann::json::parse(R"({"epoch": 3, "seed": -42, "loss": 0.125, "name": "run-\u00e9",
    "done": false, "none": null, "big": 9223372036854775807,
    "data": {"position": 1234567890123, "files": ["a.bin", "b.bin"],
             "nested": [[1, 2.5], {"k": [], "d": {}}]}})");
}

// The trainer state's groups: {b1, scale, head} and {embed, w1, w2} in layout order.
inline nlohmann::json GroupsTrainer(int world_size) {
  return {{"step", kGroupsStep},
          {"world_size", world_size},
          {"skipped_steps", 1},
          {"scheduler_last_batch_iteration", kGroupsStep - 1 - 1},
          {"lr", 0.001},
          {"loss_scaler",
           {{"dynamic", true},
            {"scale", 2048.0},
            {"iteration", kGroupsStep},
            {"last_overflow_iteration", 2},
            {"hysteresis", 1}}},
          {"param_groups",
           {{{"lr", 0.002},
             {"betas", {0.8, 0.99}},
             {"eps", 1e-6},
             {"weight_decay", 0.0},
             {"params", {"head", "b1", "scale"}}},
            {{"lr", 0.001},
             {"betas", {0.9, 0.999}},
             {"eps", 1e-8},
             {"weight_decay", 0.01},
             {"params", {"embed", "w1", "w2"}}}}},
          {"user", GroupsUser()}};
}

// Parameter names replaced: {old name, new name}.
using Renames = std::vector<std::pair<std::string, std::string>>;

// The layout of checkpoint_test_util.h's TestLayout; with `scalar` false its 0-dim parameter
// "scale" has shape [1] instead (DeepSpeed's ds_to_universal cannot merge a 0-dim parameter:
// torch.cat of 0-dim tensors, in DeepSpeed's own checkpoints too).
inline partition::ParamLayout GroupsLayout(bool scalar, const Renames& renames = {}) {
  std::vector<partition::ParamSpec> specs;
  const partition::ParamLayout test_layout = checkpoint::checkpoint_testing::TestLayout();
  for (const partition::ParamInfo& p : test_layout.params()) {
    std::string name = p.name;
    for (const auto& [from, to] : renames) {
      if (name == from) name = to;
    }
    specs.push_back({name, p.shape.empty() && !scalar ? std::vector<std::int64_t>{1} : p.shape});
  }
  auto layout = partition::ParamLayout::Create(std::move(specs));
  ZINF_CHECK(layout.has_value());
  return std::move(*layout);
}

// Collective over `comm`: fills a swapper's state and saves it to `ckpt_dir` with the metadata
// above (`trainer` replaces the trainer state when not null; `renames` renames parameters, which
// the trainer's param_groups must then follow). Returns the checkpoint file.
inline Result<std::string> SaveGroupsCheckpoint(const comm::Communicator& comm,
                                                const std::string& store_dir,
                                                const std::string& ckpt_dir, bool q8,
                                                nlohmann::json trainer = nullptr,
                                                bool scalar = true, const Renames& renames = {}) {
  using checkpoint::checkpoint_testing::TestSwapper;
  TestSwapper t;
  const partition::ParamLayout layout = GroupsLayout(scalar, renames);
  ZINF_ASSIGN_OR_RETURN(partition::PartitionPlan plan,
                        partition::PartitionPlan::CreateFlat(layout, comm.size(), 8));
  t.plan = std::make_unique<partition::PartitionPlan>(std::move(plan));
  swapper::SwapperOptions options;
  options.store.paths = {store_dir};
  options.store.job_id = fmt::format("dsx_{}_{}", q8 ? "q8" : "fp32", scalar);
  options.store.stripe_unit_bytes = 64 << 10;
  options.sub_group_size = 2000;
  options.state_format = q8 ? swapper::StateFormat::kQ8 : swapper::StateFormat::kFp32;
  options.adam =
      swapper::AdamOptions{.lr = 1e-3, .weight_decay = 0.01, .adamw = false, .threads = 1};
  ZINF_ASSIGN_OR_RETURN(t.swapper, swapper::CreateOptimizerSwapper(comm, *t.plan, options));
  ZINF_RETURN_IF_ERROR(t.swapper->Initialize([](std::uint64_t, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);
    return OkStatus();
  }));
  Status filled =
      comm.AgreeOnStatus(checkpoint::checkpoint_testing::FillState(*t.swapper, kGroupsStep));
  if (!filled) {
    (void)t.swapper->Close();
    return std::move(filled).error();
  }
  checkpoint::CheckpointSaveOptions o;
  o.dir = ckpt_dir;
  o.chunk_numel = 1000;
  o.progress = false;
  o.optimizer = {{"type", "Adam"},
                 {"params",
                  {{"lr", 0.001},
                   {"betas", {0.9, 0.999}},
                   {"eps", 1e-8},
                   {"weight_decay", 0.01},
                   {"adam_w_mode", false}}}};
  o.config = {{"train_batch_size", 8 * comm.size()},
              {"train_micro_batch_size_per_gpu", 8},
              {"gradient_accumulation_steps", 1},
              {"gradient_clipping", 1.0},
              {"fp16",
               {{"enabled", true},
                {"loss_scale", 0.0},
                {"initial_scale_power", 12},
                {"loss_scale_window", 1000},
                {"hysteresis", 2},
                {"consecutive_hysteresis", false},
                {"min_loss_scale", 1.0}}}};
  o.trainer = trainer.is_null() ? GroupsTrainer(comm.size()) : std::move(trainer);
  Result<checkpoint::SavedCheckpoint> saved =
      checkpoint::SaveCheckpoint(*t.swapper, kGroupsStep, o);
  Status closed = t.swapper->Close();
  if (!saved) return std::move(saved).error();
  ZINF_RETURN_IF_ERROR(closed);
  return saved->path;
}

}  // namespace zinf::interop::deepspeed_testing
