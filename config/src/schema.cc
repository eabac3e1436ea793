#include "schema.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf::config::internal {
namespace {

char Lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

// Case-insensitive Levenshtein distance.
std::size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      const std::size_t cost = Lower(a[i - 1]) == Lower(b[j - 1]) ? 0 : 1;
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + cost});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string FormatBound(double bound) {
  if (std::isinf(bound)) return bound > 0 ? "inf" : "-inf";
  return fmt::format("{}", bound);
}

Error OutOfRange(std::string_view path, const Json& shown, const KeySpec& spec) {
  return InvalidArgumentError(
      fmt::format("{}: {} is out of range {}", path, Shown(shown), FormatRange(spec)));
}

// ---- The DeepSpeed keys zinf accepts with no effect or refuses ----

KeySpec Ignored(std::string_view path, std::string_view description, std::string_view why) {
  return {
      .path = path, .field = {}, .description = description, .kind = KeyKind::kIgnored, .why = why};
}
KeySpec Refused(std::string_view path, std::string_view description, std::string_view why,
                bool (*harmless)(const Json&), std::string_view harmless_text) {
  return {.path = path,
          .field = {},
          .description = description,
          .kind = KeyKind::kRefused,
          .why = why,
          .harmless = harmless,
          .harmless_text = harmless_text};
}

bool IsFalse(const Json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsTrue(const Json& v) { return v.is_boolean() && v.get<bool>(); }
bool IsNumber(const Json& v, double x) { return v.is_number() && v.get<double>() == x; }
bool IsOne(const Json& v) { return IsNumber(v, 1); }
bool IsZero(const Json& v) { return IsNumber(v, 0); }
bool IsMinusOne(const Json& v) { return IsNumber(v, -1); }
// A section that is off: {"enabled": false}, or no "enabled" (DeepSpeed's default is off).
bool NotEnabled(const Json& v) {
  return v.is_object() && (!v.contains("enabled") || IsFalse(v.at("enabled")));
}
bool GradAccumFp32(const Json& v) {
  if (!v.is_object()) return false;
  for (const auto& [key, value] : v.items()) {
    if (key != "grad_accum_dtype") return false;
    if (!value.is_null() && !(value.is_string() && (value == "fp32" || value == "float32"))) {
      return false;
    }
  }
  return true;
}
bool IsMean(const Json& v) {
  return v.is_string() && EqualsIgnoreCase(v.get<std::string>(), "mean");
}
bool NoTensorParallel(const Json& v) {
  return v.is_object() && (!v.contains("autotp_size") || IsOne(v.at("autotp_size")) ||
                           IsNumber(v.at("autotp_size"), 0));
}

constexpr std::string_view kGpuHint = "a GPU performance hint; zinf's reduction runs on the host";
constexpr std::string_view kGpuOverlap =
    "a GPU stream overlap; zinf overlaps the reduction with the backward pass on its own thread "
    "(ZeroEngine::GradientReady)";
constexpr std::string_view kHostGather =
    "zinf gathers the partitioned parameters in host memory, with all-gathers of the ranks' "
    "shards when the training loop asks for them (ZeroEngine::Gather) or they are prefetched";
constexpr std::string_view kExport =
    "zinf checkpoints hold the fp32 master weights whatever the stage; zinf-ckpt export writes "
    "the whole model's weights from them (fp32, one tensor per parameter, HDF5 or safetensors)";
constexpr std::string_view kOtherOptimizer =
    "zinf steps Adam and AdamW only (optimizer.type); remove it";
constexpr std::string_view kStairs =
    "zinf's OneCycle is DeepSpeed's continuous one (its releases store the stair counts without "
    "using them; newer code rounds the cycle into stairs): give 0 or leave it out";
constexpr std::string_view kMonitor =
    "zinf writes one JSON object per step to --metrics (EngineOptions::metrics_path)";

}  // namespace

constexpr std::array<std::string_view, 2> kOptimizerNames = {"Adam", "AdamW"};
constexpr std::array<std::string_view, 2> kWarmupNames = {"log", "linear"};
constexpr std::array<std::string_view, 3> kDeviceNames = {"none", "cpu", "nvme"};

const std::vector<KeySpec>& Schema() {
  using T = Config;
  using O = OptimizerConfig;
  using S = SchedulerConfig;
  using Z = ZeroConfig;
  using OO = OffloadOptimizerConfig;
  using OP = OffloadParamConfig;
  using A = AioConfig;
  using F = Fp16Config;
  using ZC = ZinfConfig;
  using C = CheckpointConfig;
  static const std::vector<KeySpec> schema = {
      {.path = "train_batch_size",
       .field = Leaf<&T::train_batch_size>(),
       .description = "Examples per optimizer step over all ranks; = micro batch * "
                      "gradient_accumulation_steps * world size",
       .range = Between(1, kMaxInt32),
       .default_text = "derived"},
      {.path = "train_micro_batch_size_per_gpu",
       .field = Leaf<&T::train_micro_batch_size_per_gpu>(),
       .description = "Examples per rank per micro-batch",
       .range = Between(1, kMaxInt32),
       .default_text = "derived"},
      {.path = "gradient_accumulation_steps",
       .field = Leaf<&T::gradient_accumulation_steps>(),
       .description = "Micro-batches per optimizer step",
       .range = Between(1, 1 << 20),
       .default_text = "1, or derived"},
      {.path = "gradient_clipping",
       .field = Leaf<&T::gradient_clipping>(),
       .description = "Clip the global norm of the (unscaled) gradient to this value; 0 = off",
       .range = AtLeast(0)},
      {.path = "steps_per_print",
       .field = Leaf<&T::steps_per_print>(),
       .description = "Log progress every this many steps",
       .range = AtLeast(1)},
      {.path = "wall_clock_breakdown",
       .field = Leaf<&T::wall_clock_breakdown>(),
       .description = "Log the swap/step timers reduced over ranks at every print"},
      {.path = "dump_state",
       .field = {},
       .description = "Print the engine's state at start",
       .kind = KeyKind::kIgnored,
       .why = "zinf logs its effective config at start"},
      {.path = "memory_breakdown",
       .field = {},
       .description = "Print GPU memory use",
       .kind = KeyKind::kIgnored,
       .why = "no GPU memory to report; zinf logs peak host RSS per step"},
      {.path = "communication_data_type",
       .field = {},
       .description = "Data type of gradient communication",
       .kind = KeyKind::kIgnored,
       .why = "zinf reduces fp32 gradients"},
      {.path = "prescale_gradients",
       .field = {},
       .description = "Divide gradients before the reduction",
       .kind = KeyKind::kIgnored,
       .why = "zinf reduces in fp32, where dividing before or after gives the same average"},
      {.path = "gradient_predivide_factor",
       .field = {},
       .description = "Pre-division factor of the gradient reduction",
       .kind = KeyKind::kIgnored,
       .why = "zinf reduces in fp32, where dividing before or after gives the same average"},
      {.path = "sparse_gradients",
       .field = {},
       .description = "Sparse embedding gradients",
       .kind = KeyKind::kRefused,
       .why = "zinf reduces dense gradients; set it to false",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "zero_allow_untested_optimizer",
       .field = {},
       .description = "Allow a client optimizer with ZeRO",
       .kind = KeyKind::kIgnored,
       .why = "zinf runs its own Adam/AdamW; there is no client optimizer"},
      {.path = "zero_force_ds_cpu_optimizer",
       .field = {},
       .description = "Force DeepSpeed's CPU Adam with offload",
       .kind = KeyKind::kIgnored,
       .why = "zinf always steps with its own CPU Adam"},
      Ignored("managed_gradient_accumulation", "DeepSpeed counts the micro-steps itself",
              "the training loop calls AccumulateGradients/Step; zinf counts micro-batches"),
      Refused("gradient_allreduce_op", "Average or sum the gradients over ranks",
              "zinf averages the gradient over ranks and micro-batches (DeepSpeed's \"mean\")",
              IsMean, "\"mean\""),
      Ignored("disable_python_gc", "Disable Python's garbage collector", "zinf runs no Python"),
      Ignored("graph_harvesting", "Capture CUDA graphs", "zinf launches no GPU kernels"),
      Ignored("seq_parallel_communication_data_type", "Sequence-parallel communication type",
              "zinf has no sequence parallelism"),
      Ignored("use_data_before_expert_parallelism", "Expert-parallel data order",
              "zinf has no expert parallelism"),
      Ignored("vocabulary_size", "A vocabulary size hint", "the model is the training loop's"),
      Refused("disable_allgather", "Skip the weight all-gather",
              "zinf gathers the updated weights into every rank's parameters after each step; "
              "set it to false",
              IsFalse, "false"),
      Refused("torch_autocast", "torch.autocast mixed precision",
              "the training loop runs the model: use torch.autocast in it, with fp16 (loss "
              "scaling) or bf16 here",
              NotEnabled, "enabled false or absent"),
      Refused("expert_parallel", "Expert parallelism for MoE models", "zinf is data parallel only",
              NotEnabled, "enabled false or absent"),
      Refused("bfloat16", "Old name of bf16", "write the block as bf16", nullptr, {}),
      {.path = "fp16", .field = {}, .description = "fp16 mixed precision with loss scaling"},
      {.path = "fp16.enabled",
       .field = Leaf<&T::fp16, &F::enabled>(),
       .description = "Working weights rounded to fp16 values, gradients of the scaled loss, "
                      "overflowing steps skipped; the master weights stay fp32 on NVMe"},
      {.path = "fp16.loss_scale",
       .field = Leaf<&T::fp16, &F::loss_scale>(),
       .description = "A static loss scale; 0 = dynamic loss scaling",
       .range = AtLeast(0)},
      {.path = "fp16.initial_scale_power",
       .field = Leaf<&T::fp16, &F::initial_scale_power>(),
       .description = "Dynamic: the first loss scale is 2^initial_scale_power",
       .range = Between(0, 64)},
      {.path = "fp16.loss_scale_window",
       .field = Leaf<&T::fp16, &F::loss_scale_window>(),
       .description = "Dynamic: the scale doubles after this many steps without overflow",
       .range = Between(1, kMaxInt32)},
      {.path = "fp16.hysteresis",
       .field = Leaf<&T::fp16, &F::hysteresis>(),
       .description = "Dynamic: overflows tolerated (steps skipped) before the scale halves",
       .range = Between(1, kMaxInt32)},
      {.path = "fp16.consecutive_hysteresis",
       .field = Leaf<&T::fp16, &F::consecutive_hysteresis>(),
       .description = "Dynamic: a step without overflow refills the hysteresis"},
      {.path = "fp16.min_loss_scale",
       .field = Leaf<&T::fp16, &F::min_loss_scale>(),
       .description = "Dynamic: the scale never drops below this; an overflow at it is an error",
       .range = Positive()},
      {.path = "fp16.auto_cast",
       .field = {},
       .description = "Cast the model's inputs to fp16",
       .kind = KeyKind::kIgnored,
       .why = "the training loop runs the model and casts its own inputs"},
      {.path = "fp16.fp16_master_weights_and_grads",
       .field = {},
       .description = "Keep master weights and gradients in fp16",
       .kind = KeyKind::kRefused,
       .why = "zinf keeps fp32 master weights and gradients; set it to false",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "bf16", .field = {}, .description = "bf16 working weights"},
      {.path = "bf16.enabled",
       .field = Leaf<&T::bf16>(),
       .description = "Working weights rounded to bf16 values (master weights stay fp32 on NVMe)"},
      {.path = "bf16.immediate_grad_update",
       .field = {},
       .description = "Apply bf16 gradients to the fp32 copy at once",
       .kind = KeyKind::kIgnored,
       .why = "zinf hands every gradient to the swapped step in fp32"},
      {.path = "bf16.check_grad_overflow",
       .field = {},
       .description = "Check bf16 gradients for overflow",
       .kind = KeyKind::kIgnored,
       .why = "zinf refuses a non-finite gradient norm at every step"},
      {.path = "bf16.bf16_master_weights_and_grads",
       .field = {},
       .description = "Keep master weights and gradients in bf16",
       .kind = KeyKind::kRefused,
       .why = "zinf keeps fp32 master weights and gradients; set it to false",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "bf16.bf16_optimizer_states",
       .field = {},
       .description = "Keep the Adam moments in bf16",
       .kind = KeyKind::kRefused,
       .why = "zinf's smaller optimizer state is zinf.optimizer_state \"q8\"; set it to false",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "amp",
       .field = {},
       .description = "NVIDIA Apex AMP",
       .kind = KeyKind::kRefused,
       .why = "zinf has no Apex; use fp16 (loss scaling) or bf16",
       .harmless = NotEnabled,
       .harmless_text = "enabled false or absent"},
      {.path = "data_types",
       .field = {},
       .description = "Data types of internal buffers",
       .kind = KeyKind::kRefused,
       .why = "zinf accumulates gradients in fp32: give data_types.grad_accum_dtype \"fp32\" or "
              "leave it out",
       .harmless = GradAccumFp32,
       .harmless_text = "grad_accum_dtype fp32 or absent"},
      {.path = "optimizer", .field = {}, .description = "The optimizer"},
      {.path = "optimizer.type",
       .field = Leaf<&T::optimizer, &O::type>(),
       .description = "Adam (decoupled decay iff params.adam_w_mode) or AdamW; case-insensitive "
                      "(as DeepSpeed)",
       .choices = kOptimizerNames,
       .case_insensitive = true},
      {.path = "optimizer.params", .field = {}, .description = "Optimizer hyper-parameters"},
      {.path = "optimizer.params.lr",
       .field = Leaf<&T::optimizer, &O::lr>(),
       .description = "Learning rate (the base of WarmupCosineLR, the end of WarmupLR and "
                      "WarmupDecayLR without warmup_max_lr; constant without a scheduler)",
       .range = AtLeast(0)},
      {.path = "optimizer.params.betas",
       .field = Leaf<&T::optimizer, &O::betas>(),
       .description = "[beta1, beta2], moment decay rates, each in [0, 1)",
       .range = UnitOpen()},
      {.path = "optimizer.params.eps",
       .field = Leaf<&T::optimizer, &O::eps>(),
       .description = "Added to the denominator",
       .range = Positive()},
      {.path = "optimizer.params.weight_decay",
       .field = Leaf<&T::optimizer, &O::weight_decay>(),
       .description = "Weight decay (L2 for Adam with adam_w_mode false, else decoupled)",
       .range = AtLeast(0)},
      {.path = "optimizer.params.adam_w_mode",
       .field = Leaf<&T::optimizer, &O::adam_w_mode>(),
       .description = "DeepSpeed's Adam flag: decoupled weight decay (AdamW); ignored for AdamW"},
      {.path = "optimizer.params.amsgrad",
       .field = Leaf<&T::optimizer, &O::amsgrad>(),
       .description = "Use the running max of exp_avg_sq (torch's amsgrad); only false with "
                      "offload_optimizer.device nvme or cpu (no max_exp_avg_sq is kept)"},
      {.path = "optimizer.params.bias_correction",
       .field = {},
       .description = "Adam's bias correction",
       .kind = KeyKind::kRefused,
       .why = "zinf's Adam always corrects the moments' bias; set it to true",
       .harmless = IsTrue,
       .harmless_text = "true"},
      {.path = "optimizer.params.torch_adam",
       .field = {},
       .description = "Use torch's Adam implementation",
       .kind = KeyKind::kIgnored,
       .why = "zinf steps with its own CPU Adam (torch's math, tested against torch)"},
      {.path = "optimizer.params.fp32_optimizer_states",
       .field = {},
       .description = "Keep the optimizer state in fp32",
       .kind = KeyKind::kRefused,
       .why = "zinf's state format is zinf.optimizer_state (fp32 or q8); set it to true",
       .harmless = IsTrue,
       .harmless_text = "true"},
      Ignored("optimizer.legacy_fusion", "DeepSpeed's old fused optimizer",
              "zinf steps with its own CPU Adam"),
      Refused("optimizer.params.max_grad_norm", "Old place of gradient clipping",
              "give gradient_clipping instead", nullptr, {}),
      Refused("optimizer.params.momentum", "A parameter of DeepSpeed's Muon optimizer",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.muon_lr", "A parameter of DeepSpeed's Muon optimizer",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.adam_lr", "A parameter of DeepSpeed's Muon optimizer",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.ns_method", "A parameter of DeepSpeed's Muon optimizer",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.per_head_muon", "A parameter of DeepSpeed's Muon optimizer",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.freeze_step", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.cuda_aware", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.comm_backend_name",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.var_freeze_step",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.var_update_scaler",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.local_step_scaler",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.local_step_clipper",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.max_coeff", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.min_coeff", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.coeff_beta", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.factor_max", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.factor_min", "A parameter of DeepSpeed's 1-bit and 0/1 optimizers",
              kOtherOptimizer, nullptr, {}),
      Refused("optimizer.params.factor_threshold",
              "A parameter of DeepSpeed's 1-bit and 0/1 optimizers", kOtherOptimizer, nullptr, {}),
      {.path = "scheduler",
       .field = {},
       .description = "Learning-rate schedule; absent: constant optimizer lr"},
      {.path = "scheduler.type",
       .field = Leaf<&T::scheduler, &S::type>(),
       .description = "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest; "
                      "required in a scheduler block",
       .choices = kSchedulerNames,
       .default_text = "none (no scheduler block)",
       .scheduler_types = kAllSchedulersBits},
      {.path = "scheduler.params", .field = {}, .description = "The schedule's parameters"},
      {.path = "scheduler.params.warmup_min_lr",
       .field = Leaf<&T::scheduler, &S::warmup_min_lr>(),
       .description = "Learning rate at the start of the warmup (absolute)",
       .range = AtLeast(0),
       .scheduler_types = kWarmupLRBit | kWarmupDecayLRBit},
      {.path = "scheduler.params.warmup_max_lr",
       .field = Leaf<&T::scheduler, &S::warmup_max_lr>(),
       .description = "Learning rate at the end of the warmup (absolute); not given: the "
                      "optimizer's lr, each parameter group's own (DeepSpeed >= 0.17.2)",
       .range = AtLeast(0),
       .default_text = "optimizer.params.lr",
       .scheduler_types = kWarmupLRBit | kWarmupDecayLRBit},
      {.path = "scheduler.params.warmup_min_ratio",
       .field = Leaf<&T::scheduler, &S::warmup_min_ratio>(),
       .description = "Start of the warmup as a fraction of optimizer.params.lr",
       .range = Between(0, 1),
       .scheduler_types = kWarmupCosineLRBit},
      {.path = "scheduler.params.warmup_num_steps",
       .field = Leaf<&T::scheduler, &S::warmup_num_steps>(),
       .description = "Warmup length in steps (DeepSpeed uses at least 2)",
       .range = AtLeast(0),
       .scheduler_types = kWarmupSchedulersBits},
      {.path = "scheduler.params.warmup_type",
       .field = Leaf<&T::scheduler, &S::warmup_type>(),
       .description = "Warmup curve: log or linear",
       .choices = kWarmupNames,
       .scheduler_types = kWarmupSchedulersBits},
      {.path = "scheduler.params.total_num_steps",
       .field = Leaf<&T::scheduler, &S::total_num_steps>(),
       .description = "Steps of the whole schedule (required for WarmupDecayLR, WarmupCosineLR)",
       .range = AtLeast(1),
       .scheduler_types = kWarmupDecayLRBit | kWarmupCosineLRBit,
       .required = true},
      {.path = "scheduler.params.cos_min_ratio",
       .field = Leaf<&T::scheduler, &S::cos_min_ratio>(),
       .description = "Floor of the cosine decay as a fraction of optimizer.params.lr",
       .range = Between(0, 1),
       .scheduler_types = kWarmupCosineLRBit},
      {.path = "scheduler.params.cycle_min_lr",
       .field = Leaf<&T::scheduler, &S::cycle_min_lr>(),
       .description = "Learning rate at the start and end of the cycle (absolute)",
       .range = AtLeast(0),
       .scheduler_types = kOneCycleBit,
       .required = true},
      {.path = "scheduler.params.cycle_max_lr",
       .field = Leaf<&T::scheduler, &S::cycle_max_lr>(),
       .description = "Learning rate at the peak of the cycle (absolute)",
       .range = AtLeast(0),
       .scheduler_types = kOneCycleBit,
       .required = true},
      {.path = "scheduler.params.decay_lr_rate",
       .field = Leaf<&T::scheduler, &S::decay_lr_rate>(),
       .description = "After the cycle: lr = cycle_min_lr / (1 + rate * steps / decay_step_size)",
       .range = AtLeast(0),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.cycle_first_step_size",
       .field = Leaf<&T::scheduler, &S::cycle_first_step_size>(),
       .description = "Steps of the cycle's rising half",
       .range = AtLeast(1),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.cycle_second_step_size",
       .field = Leaf<&T::scheduler, &S::cycle_second_step_size>(),
       .description = "Steps of the cycle's falling half",
       .range = AtLeast(1),
       .default_text = "cycle_first_step_size",
       .scheduler_types = kOneCycleBit},
      Refused("scheduler.params.cycle_first_stair_count", "OneCycle's stairs in the rising half",
              kStairs, IsZero, "0"),
      Refused("scheduler.params.cycle_second_stair_count", "OneCycle's stairs in the falling half",
              kStairs, IsZero, "0"),
      {.path = "scheduler.params.decay_step_size",
       .field = Leaf<&T::scheduler, &S::decay_step_size>(),
       .description = "Steps per decay interval after the cycle; 0 = no decay",
       .range = AtLeast(0),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.cycle_momentum",
       .field = Leaf<&T::scheduler, &S::cycle_momentum>(),
       .description = "Cycle Adam's beta1 against the lr (DeepSpeed then sets beta2 to 0.99)",
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.cycle_min_mom",
       .field = Leaf<&T::scheduler, &S::cycle_min_mom>(),
       .description = "beta1 at the cycle's peak lr",
       .range = UnitOpen(),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.cycle_max_mom",
       .field = Leaf<&T::scheduler, &S::cycle_max_mom>(),
       .description = "beta1 at the cycle's ends",
       .range = UnitOpen(),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.decay_mom_rate",
       .field = Leaf<&T::scheduler, &S::decay_mom_rate>(),
       .description = "After the cycle: beta1 = cycle_max_mom * (1 + rate * steps / "
                      "decay_step_size) (DeepSpeed's formula; beta1 must stay below 1)",
       .range = AtLeast(0),
       .scheduler_types = kOneCycleBit},
      {.path = "scheduler.params.lr_range_test_min_lr",
       .field = Leaf<&T::scheduler, &S::lr_range_test_min_lr>(),
       .description = "The first learning rate of the range test (absolute)",
       .range = AtLeast(0),
       .scheduler_types = kLRRangeTestBit},
      {.path = "scheduler.params.lr_range_test_step_size",
       .field = Leaf<&T::scheduler, &S::lr_range_test_step_size>(),
       .description = "Steps per interval of the range test",
       .range = Positive(),
       .scheduler_types = kLRRangeTestBit},
      {.path = "scheduler.params.lr_range_test_step_rate",
       .field = Leaf<&T::scheduler, &S::lr_range_test_step_rate>(),
       .description = "lr = min_lr * (1 + step_rate * intervals)",
       .range = AtLeast(0),
       .scheduler_types = kLRRangeTestBit},
      {.path = "scheduler.params.lr_range_test_staircase",
       .field = Leaf<&T::scheduler, &S::lr_range_test_staircase>(),
       .description = "Whole intervals only (a staircase) instead of a continuous rise",
       .scheduler_types = kLRRangeTestBit},
      {.path = "scheduler.params.last_batch_iteration",
       .field = {},
       .description = "The schedule's resume position",
       .kind = KeyKind::kRefused,
       .why = "zinf resumes the schedule from the checkpoint's step; leave it at -1",
       .harmless = IsMinusOne,
       .harmless_text = "-1"},
      {.path = "zero_optimization", .field = {}, .description = "ZeRO partitioning"},
      {.path = "zero_optimization.stage",
       .field = Leaf<&T::zero_optimization, &Z::stage>(),
       .description = "1 or 2: flat partition plan; 3: per-parameter plan (DeepSpeed's default "
                      "0 is not supported: zinf always partitions the optimizer state)",
       .range = Between(1, 3)},
      {.path = "zero_optimization.sub_group_size",
       .field = Leaf<&T::zero_optimization, &Z::sub_group_size>(),
       .description = "Elements per sub-group, the unit swapped in, stepped and swapped out",
       .range = AtLeast(1)},
      {.path = "zero_optimization.offload_optimizer",
       .field = {},
       .description = "Where the optimizer state lives"},
      {.path = "zero_optimization.offload_optimizer.device",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::device>(),
       .description = "nvme: swapped to nvme_path (zinf.host_cache_bytes keeps the first "
                      "sub-groups in memory); cpu: the whole state in host memory, no swap store; "
                      "none: refused by the engine (zinf steps on the CPU)",
       .choices = kDeviceNames},
      {.path = "zero_optimization.offload_optimizer.nvme_path",
       .field = PathList<&T::zero_optimization, &Z::offload_optimizer, &OO::nvme_path>(),
       .description = "Node-local directory, or a list (striped); {local_rank} and {node} are "
                      "replaced; required for device nvme",
       .default_text = "none"},
      {.path = "zero_optimization.offload_optimizer.buffer_count",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::buffer_count>(),
       .description = "Swap buffers of the largest sub-group (when zinf.pinned_budget_bytes is "
                      "0); pipelining needs 10 (q8: 7)",
       .range = Between(1, 1024)},
      {.path = "zero_optimization.offload_optimizer.pin_memory",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::pin_memory>(),
       .description = "Lock the swap buffers in memory"},
      {.path = "zero_optimization.offload_optimizer.pipeline_read",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::pipeline_read>(),
       .description = "Read sub-group i+1 while i is stepped (the pipelined swapper)"},
      {.path = "zero_optimization.offload_optimizer.pipeline_write",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::pipeline_write>(),
       .description = "Write sub-group i-1 while i is stepped (the pipelined swapper)"},
      {.path = "zero_optimization.offload_optimizer.pipeline",
       .field = {},
       .description = "Old name of pipeline_read + pipeline_write",
       .kind = KeyKind::kRefused,
       .why = "give pipeline_read and pipeline_write instead",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "zero_optimization.offload_optimizer.fast_init",
       .field = {},
       .description = "Stream the initial state to NVMe",
       .kind = KeyKind::kIgnored,
       .why = "zinf always streams the initial state, one sub-group at a time"},
      {.path = "zero_optimization.offload_optimizer.buffer_size",
       .field = {},
       .description = "Size of the parameter swap buffers",
       .kind = KeyKind::kIgnored,
       .why = "zinf sizes its pool from the sub-groups and zinf.pinned_budget_bytes"},
      {.path = "zero_optimization.offload_optimizer.ratio",
       .field = {},
       .description = "Fraction of the optimizer state offloaded",
       .kind = KeyKind::kRefused,
       .why = "zinf offloads the whole optimizer state; give 1 or leave it out",
       .harmless = IsOne,
       .harmless_text = "1"},
      {.path = "zero_optimization.offload_param",
       .field = {},
       .description = "Where a rank keeps its shard of the partitioned working weights (stage 3, "
                      "parameters registered without weights)"},
      {.path = "zero_optimization.offload_param.device",
       .field = Leaf<&T::zero_optimization, &Z::offload_param, &OP::device>(),
       .description = "none or cpu: the shard in host memory; nvme: the shard read from the fp32 "
                      "master weights in the optimizer's swap store when gathered (no second "
                      "copy on disk), but for those kept in memory by max_in_cpu; nvme needs "
                      "stage 3 and offload_optimizer.device nvme",
       .choices = kDeviceNames},
      {.path = "zero_optimization.offload_param.nvme_path",
       .field = PathList<&T::zero_optimization, &Z::offload_param, &OP::nvme_path>(),
       .description = "Optional and unused: the shards are read from the optimizer's swap store "
                      "(offload_optimizer.nvme_path); a different path is accepted and named in "
                      "an INFO line, nothing is written there",
       .default_text = "none"},
      {.path = "zero_optimization.offload_param.buffer_count",
       .field = Leaf<&T::zero_optimization, &Z::offload_param, &OP::buffer_count>(),
       .description = "Device nvme: at most this many parameters read from NVMe ahead of use "
                      "(prefetch)",
       .range = Between(1, 1024)},
      {.path = "zero_optimization.offload_param.buffer_size",
       .field = Leaf<&T::zero_optimization, &Z::offload_param, &OP::buffer_size>(),
       .description = "Device nvme: elements of the largest shard read from NVMe (checked when "
                      "the engine is created)",
       .range = AtLeast(1)},
      {.path = "zero_optimization.offload_param.max_in_cpu",
       .field = Leaf<&T::zero_optimization, &Z::offload_param, &OP::max_in_cpu>(),
       .description = "Device nvme: elements of shards kept in host memory (the first shards, "
                      "in registration order, that fit together), gathered without NVMe reads",
       .range = AtLeast(0)},
      Ignored("zero_optimization.offload_param.pin_memory", "Pin the parameter buffers",
              "the shards are read through the optimizer's buffer pool, which "
              "offload_optimizer.pin_memory pins"),
      {.path = "zero_optimization.cpu_offload",
       .field = {},
       .description = "Old switch for optimizer offload to CPU",
       .kind = KeyKind::kRefused,
       .why = "give offload_optimizer {device: cpu} (or {device: nvme, nvme_path})",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "zero_optimization.cpu_offload_params",
       .field = {},
       .description = "Old switch for parameter offload to CPU",
       .kind = KeyKind::kRefused,
       .why = "give zero_optimization.offload_param {device: cpu} instead",
       .harmless = IsFalse,
       .harmless_text = "false"},
      {.path = "zero_optimization.cpu_offload_use_pin_memory",
       .field = {},
       .description = "Old pin_memory switch",
       .kind = KeyKind::kIgnored,
       .why = "zinf's switch is offload_optimizer.pin_memory"},
      {.path = "zero_optimization.reduce_bucket_size",
       .field = Leaf<&T::zero_optimization, &Z::reduce_bucket_size>(),
       .description = "Elements per gradient bucket: the engine reduce-scatters the gradient "
                      "bucket by bucket, overlapping the backward pass when gradients are handed "
                      "per parameter (ZeroEngine::GradientReady)",
       .range = AtLeast(1)},
      {.path = "zero_optimization.allgather_bucket_size",
       .field = Leaf<&T::zero_optimization, &Z::allgather_bucket_size>(),
       .description = "Elements per all-gather round: the engine gathers the updated weights "
                      "into the parameters through a buffer of this many elements",
       .range = AtLeast(1)},
      Ignored("zero_optimization.overlap_comm", "Overlap gradient reduction with the backward pass",
              kGpuOverlap),
      Ignored("zero_optimization.contiguous_gradients",
              "Copy gradients into one contiguous GPU buffer",
              "zinf reduces gradients from the training loop's host buffers in buckets"),
      Ignored("zero_optimization.reduce_scatter", "Reduce with reduce-scatter, not all-reduce",
              "zinf always reduce-scatters the gradient"),
      Ignored("zero_optimization.allgather_partitions", "All-gather, not broadcast, the weights",
              "zinf always all-gathers the updated partitions"),
      Ignored("zero_optimization.round_robin_gradients", "Spread gradient copies over ranks",
              kGpuHint),
      {.path = "zero_optimization.stage3_prefetch_bucket_size",
       .field = Leaf<&T::zero_optimization, &Z::stage3_prefetch_bucket_size>(),
       .description = "Stage 3: elements gathered ahead of use, following the order the previous "
                      "step's Gather calls recorded; 0: no prefetch",
       .range = AtLeast(0)},
      {.path = "zero_optimization.stage3_max_live_parameters",
       .field = Leaf<&T::zero_optimization, &Z::stage3_max_live_parameters>(),
       .description = "Stage 3: prefetching and keeping released parameters gathered stop at "
                      "this many elements gathered at once",
       .range = AtLeast(0)},
      {.path = "zero_optimization.stage3_max_reuse_distance",
       .field = Leaf<&T::zero_optimization, &Z::stage3_max_reuse_distance>(),
       .description = "Stage 3: a released parameter stays gathered when the recorded order uses "
                      "it again within this many elements; 0: released at once",
       .range = AtLeast(0)},
      {.path = "zero_optimization.stage3_param_persistence_threshold",
       .field = Leaf<&T::zero_optimization, &Z::stage3_param_persistence_threshold>(),
       .description = "Stage 3: parameters of at most this many elements are not partitioned: "
                      "they stay whole on every rank; 0: none",
       .range = AtLeast(0)},
      {.path = "zero_optimization.stage3_model_persistence_threshold",
       .field = Leaf<&T::zero_optimization, &Z::stage3_model_persistence_threshold>(),
       .description = "Stage 3: elements of all the parameters kept whole together (in "
                      "registration order); the rest are partitioned",
       .range = AtLeast(0)},
      Ignored("zero_optimization.stage3_use_all_reduce_for_fetch_params",
              "Fetch parameters with all-reduce", kHostGather),
      Ignored("zero_optimization.stage3_module_granularity_threshold",
              "Fetch small modules as a whole",
              "zinf traces no modules: it gathers the parameters the training loop names in "
              "each ZeroEngine::Gather call"),
      Ignored("zero_optimization.stage3_gather_16bit_weights_on_model_save",
              "Gather 16-bit weights when the model is saved", kExport),
      Ignored("zero_optimization.stage3_gather_fp16_weights_on_model_save",
              "Old name of stage3_gather_16bit_weights_on_model_save", kExport),
      Ignored("zero_optimization.elastic_checkpoint",
              "Checkpoints that restore on other world sizes",
              "zinf checkpoints always restore on any number of ranks"),
      Ignored("zero_optimization.load_from_fp32_weights", "Restore from the fp32 master weights",
              "zinf always restores the fp32 master weights"),
      Ignored("zero_optimization.ignore_unused_parameters", "Allow parameters without gradients",
              "a parameter the loop wrote no gradient for has a zero gradient in zinf"),
      Ignored("zero_optimization.legacy_stage1", "DeepSpeed's old stage-1 implementation",
              "zinf has one implementation per stage"),
      Ignored("zero_optimization.memory_efficient_linear", "DeepSpeed's linear layer for stage 3",
              "the model is the training loop's"),
      Ignored("zero_optimization.use_multi_rank_bucket_allreduce", "Bucketed all-reduce variant",
              kGpuHint),
      Ignored("zero_optimization.log_trace_cache_warnings", "Log stage-3 trace cache warnings",
              "zinf traces no modules"),
      Ignored("zero_optimization.override_module_apply", "Patch torch Module.apply for stage 3",
              "zinf patches no modules"),
      Ignored("zero_optimization.mics_hierarchical_params_gather",
              "Hierarchical parameter gather of MiCS", "zinf runs no MiCS (mics_shard_size)"),
      Ignored("zero_optimization.zeropp_loco_param", "ZeRO++ LoCo gradient compression",
              "zinf runs no ZeRO++ (zero_quantized_gradients)"),
      Ignored("zero_optimization.pipeline_loading_checkpoint", "Load checkpoints for pipelines",
              "zinf has no pipeline parallelism"),
      Refused("zero_optimization.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning",
              "zinf partitions the optimizer state over all ranks; give 1 or leave it out", IsOne,
              "1"),
      Refused("zero_optimization.zero_quantized_weights", "ZeRO++ quantized weight gather",
              "zinf gathers fp32 weights; its quantization is of the optimizer state "
              "(zinf.optimizer_state \"q8\"); set it to false",
              IsFalse, "false"),
      Refused("zero_optimization.zero_quantized_nontrainable_weights",
              "ZeRO++ quantized frozen weights",
              "zinf never holds frozen weights (the loop does); set it to false", IsFalse, "false"),
      Refused("zero_optimization.zero_quantized_gradients", "ZeRO++ quantized gradient reduction",
              "zinf reduces fp32 gradients; set it to false", IsFalse, "false"),
      Refused("zero_optimization.mics_shard_size", "MiCS: partition over groups of this size",
              "zinf partitions the optimizer state over all ranks; leave it at -1 or out",
              IsMinusOne, "-1"),
      Ignored("zero_optimization.compute_grad_norm", "Compute the global gradient norm",
              "zinf always computes it (for gradient_clipping, the log and fp16 overflow)"),
      Ignored("zero_optimization.parameter_alignment", "Pad flat buffers for alignment",
              "zinf aligns every partition and sub-group to 1024 elements"),
      Ignored("zero_optimization.grad_hooks", "Reduce gradients from backward hooks",
              "the training loop hands gradients with GradientReady (or at AccumulateGradients "
              "and Step)"),
      Ignored("zero_optimization.stage3_allgather_sequential", "Gather parameters one by one",
              kHostGather),
      Ignored("zero_optimization.stage3_partition_stream_chunk_size",
              "Chunk size of parameter partitioning",
              "zinf partitions the parameters in host memory, with no GPU stream to chunk"),
      Ignored("zero_optimization.enable_sanity_checks", "Extra stage-3 checks",
              "zinf checks its inputs and every I/O always"),
      Ignored("zero_optimization.leaf_module", "Stage-3 leaf modules", "zinf traces no modules"),
      Ignored("zero_optimization.save_muon_momentum_buffer_in_memory",
              "Muon momentum buffers in memory", kOtherOptimizer),
      Refused("zero_optimization.cpu_offload_param", "Old switch for parameter offload to CPU",
              "give zero_optimization.offload_param {device: cpu} instead", IsFalse, "false"),
      Refused("zero_optimization.zenflow", "ZenFlow stall-free offload",
              "zinf's pipelined swapper overlaps the swap with the step instead", nullptr, {}),
      Ignored("zero_optimization.offload_optimizer.convert_grad_on_cpu",
              "Convert gradients to fp32 on the CPU", "zinf's gradients are fp32 on the host"),
      Ignored("zero_optimization.offload_optimizer.cpuadam_cores_perc",
              "Share of cores for CPU Adam", "zinf's knob is zinf.adam_threads"),
      Refused("zero_optimization.offload_optimizer.super_offload", "SuperOffload",
              "zinf swaps the optimizer state through its own pipelined swapper; set it to "
              "false",
              IsFalse, "false"),
      {.path = "aio", .field = {}, .description = "Asynchronous I/O backend knobs"},
      {.path = "aio.block_size",
       .field = Leaf<&T::aio, &A::block_size>(),
       .description = "Bytes per block I/O; also a multiple of the file system's direct-I/O "
                      "alignment (checked when the store opens)",
       .range = Between(512, 1 << 30),
       .multiple_of = 512},
      {.path = "aio.queue_depth",
       .field = Leaf<&T::aio, &A::queue_depth>(),
       .description = "Blocks in flight per ring (worker)",
       .range = Between(1, 4096)},
      {.path = "aio.intra_op_parallelism",
       .field = Leaf<&T::aio, &A::intra_op_parallelism>(),
       .description = "io_uring rings (POSIX workers) per I/O backend, each with its own thread",
       .range = Between(1, 64)},
      {.path = "aio.thread_count",
       .field = Leaf<&T::aio, &A::intra_op_parallelism>(),
       .description = "Old DeepSpeed name of intra_op_parallelism (accepted with a warning)",
       .range = Between(1, 64),
       .default_text = "unset",
       .alias_of = "aio.intra_op_parallelism"},
      {.path = "aio.single_submit",
       .field = Leaf<&T::aio, &A::single_submit>(),
       .description = "Submit blocks one at a time instead of in batches"},
      {.path = "aio.overlap_events",
       .field = Leaf<&T::aio, &A::overlap_events>(),
       .description = "Keep the queue full while reaping completions"},
      Refused("aio.use_gds", "NVIDIA GPUDirect Storage",
              "zinf's state moves between NVMe and pinned host memory; set it to false", IsFalse,
              "false"),
      Ignored("aio.io_backend", "DeepSpeed's I/O backend",
              "zinf's choice is zinf.io_engine (io_uring or POSIX)"),
      {.path = "checkpoint",
       .field = {},
       .description = "DeepSpeed's checkpoint options (zinf's own are under zinf.checkpoint)"},
      Ignored("checkpoint.tag_validation", "Check that ranks agree on a checkpoint tag",
              "zinf names checkpoints by step, and every rank saves the same step collectively"),
      Ignored("checkpoint.load_universal", "Load a universal checkpoint",
              "zinf checkpoints always restore on any number of ranks"),
      Ignored("checkpoint.use_node_local_storage", "Save to node-local storage",
              "zinf writes one parallel-HDF5 file collectively into zinf.checkpoint.dir"),
      Ignored("checkpoint.parallel_write", "Pipeline-parallel checkpoint writing",
              "zinf writes one parallel-HDF5 file collectively"),
      Ignored("tensorboard", "TensorBoard monitor", kMonitor),
      Ignored("wandb", "Weights & Biases monitor", kMonitor),
      Ignored("csv_monitor", "CSV monitor", kMonitor),
      Ignored("comet", "Comet monitor", kMonitor),
      Ignored("flops_profiler", "DeepSpeed's FLOPS profiler", "zinf does not run the model"),
      Ignored("comms_logger", "Log collective calls",
              "zinf logs its reduction and swap timers with wall_clock_breakdown"),
      Ignored("activation_checkpointing", "DeepSpeed's activation checkpointing",
              "the training loop runs the model and its own activation checkpointing"),
      Ignored("sparse_attention", "DeepSpeed's sparse attention kernels",
              "the training loop's model decides its attention"),
      Ignored("data_efficiency", "DeepSpeed's data sampling and routing",
              "the training loop reads its own data"),
      Ignored("curriculum_learning", "DeepSpeed's curriculum learning",
              "the training loop reads its own data"),
      Ignored("dataloader_drop_last", "Drop the last incomplete batch of DeepSpeed's loader",
              "the training loop reads its own data"),
      Ignored("progressive_layer_drop", "Progressive layer dropping",
              "the training loop runs the model"),
      Ignored("eigenvalue", "Eigenvalue computation for quantization",
              "the training loop runs the model"),
      Ignored("quantize_training", "Quantization-aware training",
              "the training loop runs the model"),
      Ignored("compression_training", "DeepSpeed's model compression",
              "the training loop runs the model"),
      Ignored("autotuning", "DeepSpeed's autotuner (run by its launcher)",
              "zinf's benchmarks are zinf-bench and bench/run.py"),
      Ignored("nebula", "Azure Nebula checkpoint service",
              "zinf writes its own collective HDF5 checkpoints"),
      Ignored("compile", "torch.compile of the model", "the training loop runs the model"),
      Ignored("pipeline", "Pipeline-parallel engine options",
              "zinf is data parallel only; without a pipeline module the block does nothing"),
      Refused("elasticity", "Elastic batch sizes",
              "zinf resumes on any number of ranks from its checkpoints, with the batch keys "
              "of the config; elastic batch sizing is not implemented",
              NotEnabled, "enabled false or absent"),
      Refused("hybrid_engine", "DeepSpeed's RLHF hybrid engine", "zinf has no inference engine",
              NotEnabled, "enabled false or absent"),
      Refused("tensor_parallel", "Tensor (AutoTP) parallelism",
              "zinf is data parallel only; give autotp_size 1 or leave the block out",
              NoTensorParallel, "autotp_size 1 or absent"),
      {.path = "zinf", .field = {}, .description = "What DeepSpeed does not have"},
      {.path = "zinf.pinned_budget_bytes",
       .field = Size<&T::zinf, &ZC::pinned_budget_bytes>(),
       .description = "Host memory for swap buffers: bytes or a size (\"2G\", \"512MiB\"); 0: "
                      "offload_optimizer.buffer_count buffers",
       .range = AtLeast(0)},
      {.path = "zinf.host_cache_bytes",
       .field = Size<&T::zinf, &ZC::host_cache_bytes>(),
       .description = "Host memory tier per rank: bytes or a size (\"8G\"); the first "
                      "sub-groups whose state fits stay in memory, stepped without I/O; 0: none",
       .range = AtLeast(0)},
      {.path = "zinf.host_memory_budget",
       .field = HostMemoryBudget<&T::zinf, &ZC::host_memory_budget>(),
       .description = "Host memory of a node the engine's memory plan must fit, shared by its "
                      "ranks: bytes or a size (\"8G\"), or a fraction in (0, 1] of the detected "
                      "budget (memory cgroup limit, else MemAvailable); \"auto\": the detected one",
       .default_text = "\"auto\"",
       .auto_is_a_value = true},
      {.path = "zinf.io_engine",
       .field = Leaf<&T::zinf, &ZC::io_engine>(),
       .description = "auto (io_uring if it works, else POSIX), uring or posix; ZINF_IO_ENGINE "
                      "overrides",
       .choices = storage::kIoBackendNames},
      {.path = "zinf.optimizer_state",
       .field = Leaf<&T::zinf, &ZC::optimizer_state>(),
       .description = "The swapped Adam state: fp32 (weights and both moments, 12 bytes per "
                      "element), or q8 (fp32 weights, both moments as 8-bit block-wise quantized "
                      "codes: about 6 bytes per element, half the swap I/O of a step)",
       .choices = swapper::kStateFormatNames},
      {.path = "zinf.verify_swap",
       .field = Leaf<&T::zinf, &ZC::verify_swap>(),
       .description = "Checksum every swapped stripe unit on write, check it on read"},
      {.path = "zinf.keep_swap",
       .field = Leaf<&T::zinf, &ZC::keep_swap>(),
       .description = "Keep the swap store at exit"},
      {.path = "zinf.nvme_path_weights",
       .field = PathWeights<&T::zinf, &ZC::nvme_path_weights>(),
       .description = "Each nvme_path's share of the swap I/O: relative bandwidths, one positive "
                      "number per path ([1, 3]: the second path takes 3/4), or \"probe\" "
                      "(measured at start, per rank; not reproducible run to run); a resumed "
                      "swap store keeps the weights it was created with",
       .default_text = "equal shares"},
      {.path = "zinf.swap_gradients",
       .field = Leaf<&T::zinf, &ZC::swap_gradients>(),
       .description = "Accumulate partition gradients through the gradient swapper"},
      {.path = "zinf.speculative_step",
       .field = Leaf<&T::zinf, &ZC::speculative_step>(),
       .description = "Step each swapped sub-group during the backward pass once its gradient is "
                      "final, into a second slot on disk, and commit it in step() unless "
                      "clipping applies or fp16 skips the step (then it is redone or dropped); "
                      "needs the gradient in memory (no zinf.swap_gradients) and doubles the "
                      "swap store's slots",
       .default_text = "true where the gradients are lent (stages 2 and 3 without grads "
                       "buffers), else false"},
      {.path = "zinf.adam_threads",
       .field = Leaf<&T::zinf, &ZC::adam_threads>(),
       .description = "CPU Adam threads per rank; 0 = hardware concurrency",
       .range = Between(0, 1024)},
      {.path = "zinf.collective_timeout_seconds",
       .field = Leaf<&T::zinf, &ZC::collective_timeout_seconds>(),
       .description = "Seconds; a rank that waits longer than this in one of zinf's collectives "
                      "for the other ranks (a rank failed, stopped or left) ends the job with an "
                      "error naming the collective",
       .range = Between(1, 604800)},
      {.path = "zinf.job_id",
       .field = Leaf<&T::zinf, &ZC::job_id>(),
       .description = "Names the swap store directory zinf-<job_id>; [A-Za-z0-9_.-]+; empty: "
                      "\"cfg\" + 12 hex digits of a hash of what identifies the job "
                      "(zinf.checkpoint.dir, the parameters' names and shapes, world size; not "
                      "steps, resume, checkpoint cadence or learning rate)",
       .default_text = "derived"},
      {.path = "zinf.checkpoint", .field = {}, .description = "Collective HDF5 checkpoints"},
      {.path = "zinf.checkpoint.dir",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::dir>(),
       .description = "Directory of step-<N>.h5 and latest; empty: no checkpoints"},
      {.path = "zinf.checkpoint.every",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::every>(),
       .description = "Steps between checkpoints (StepInfo.checkpoint_due)",
       .range = AtLeast(1)},
      {.path = "zinf.checkpoint.keep_last",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::keep_last>(),
       .description = "Checkpoints kept (older ones removed); 0 keeps all",
       .range = Between(0, 1 << 20)},
      {.path = "zinf.checkpoint.load",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::load>(),
       .description = "Empty: start fresh; \"latest\": resume from <dir>/latest (an error if "
                      "there is none); \"auto\": resume from <dir>/latest if it exists, else "
                      "start fresh; else the checkpoint file (or directory) to resume from",
       .auto_is_a_value = true},
  };
  return schema;
}

SchemaView::SchemaView(std::span<const AppKey> app_keys) : app_keys_(app_keys) {
  specs_ = Schema();
  std::map<std::string, bool> known;
  for (const KeySpec& spec : specs_) known.emplace(spec.path, true);
  for (const AppKey& key : app_keys_) known.emplace(key.path, true);
  // Sections the application's keys sit in, when the engine has none of that name.
  for (const AppKey& key : app_keys_) {
    std::string_view parent = ParentOf(key.path);
    while (!parent.empty() && !known.contains(std::string(parent))) {
      known.emplace(parent, true);
      section_paths_.emplace_back(parent);
      parent = ParentOf(parent);
    }
  }
  choice_views_.reserve(app_keys_.size());
  for (const AppKey& key : app_keys_) {
    choice_views_.emplace_back(key.choices.begin(), key.choices.end());
  }
  for (const std::string& section : section_paths_) {
    specs_.push_back(KeySpec{.path = section, .field = {}, .description = "(application section)"});
  }
  for (std::size_t i = 0; i < app_keys_.size(); ++i) {
    const AppKey& key = app_keys_[i];
    KeySpec spec{.path = key.path, .field = {}, .description = key.description};
    if (key.type != AppKeyType::kSection) {
      spec.field = AppAccess{&key};
      spec.range = Between(key.min, key.max);
      spec.choices = choice_views_[i];
    }
    specs_.push_back(spec);
  }
  for (const KeySpec& spec : specs_) {
    const bool inserted = index_.emplace(spec.path, &spec).second;
    ZINF_CHECK(inserted, "config schema: key {} defined twice", spec.path);
  }
}

const KeySpec* SchemaView::Find(std::string_view path) const {
  auto it = index_.find(path);
  return it == index_.end() ? nullptr : it->second;
}

std::vector<std::string_view> SchemaView::ChildKeys(std::string_view section) const {
  std::vector<std::string_view> keys;
  for (const KeySpec& spec : specs_) {
    if (ParentOf(spec.path) == section && spec.alias_of.empty() && spec.kind != KeyKind::kRefused) {
      keys.push_back(LastComponent(spec.path));
    }
  }
  return keys;
}

std::string_view ParentOf(std::string_view path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}
std::string_view LastComponent(std::string_view path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                            [](char x, char y) { return Lower(x) == Lower(y); });
}

// The candidate nearest to `text`, if it is near enough to be a plausible misspelling.
std::optional<std::string_view> Nearest(std::string_view text,
                                        std::span<const std::string_view> candidates) {
  std::optional<std::string_view> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (std::string_view candidate : candidates) {
    const std::size_t d = EditDistance(text, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  if (!best) return std::nullopt;
  const std::size_t shorter = std::min(text.size(), best->size());
  const std::size_t limit = shorter <= 4 ? 1 : std::max<std::size_t>(2, shorter / 3);
  if (best_distance > limit) return std::nullopt;
  return best;
}

std::string JoinQuoted(std::span<const std::string_view> items, std::string_view quote) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{}{}{}", quote, items[i], quote);
  }
  return out;
}

// A JSON value for a message: the value itself, shortened.
std::string Shown(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

Error TypeError(std::string_view path, std::string_view expected, const Json& got) {
  if (got.is_object() || got.is_null()) {
    return InvalidArgumentError(fmt::format("{}: expected {}, got {}", path, expected,
                                            got.is_null() ? "null" : "an object"));
  }
  return InvalidArgumentError(
      fmt::format("{}: expected {}, got {} {}", path, expected, got.type_name(), Shown(got)));
}

bool IsIntegerKind(const Field& field) {
  return std::holds_alternative<Accessor<int>>(field) ||
         std::holds_alternative<Accessor<std::int64_t>>(field) ||
         std::holds_alternative<Accessor<std::uint64_t>>(field) ||
         std::holds_alternative<SizeAccess>(field) ||
         (std::holds_alternative<AppAccess>(field) &&
          std::get<AppAccess>(field).key->type == AppKeyType::kInteger);
}

IntegerBounds IntegerBoundsOf(const KeySpec& spec) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  IntegerBounds b{.min = std::numeric_limits<std::int64_t>::min(), .max = kMax};
  if (std::holds_alternative<Accessor<int>>(spec.field)) {
    b = {.min = std::numeric_limits<int>::min(), .max = std::numeric_limits<int>::max()};
  } else if (std::holds_alternative<Accessor<std::uint64_t>>(spec.field) ||
             std::holds_alternative<SizeAccess>(spec.field)) {
    b.min = 0;
  }
  // 2^63 and beyond is no int64: such a bound (inf included) leaves the field's own.
  const Range& r = spec.range;
  if (r.min >= -0x1p63) {
    const double up = std::ceil(r.min);
    std::int64_t min = up >= 0x1p63 ? kMax : static_cast<std::int64_t>(up);
    if (r.min_open && up == r.min && min < kMax) ++min;
    b.min = std::max(b.min, min);
  }
  if (r.max < 0x1p63) {
    const double down = std::floor(r.max);
    std::int64_t max = down < -0x1p63 ? b.min : static_cast<std::int64_t>(down);
    if (r.max_open && down == r.max && max > std::numeric_limits<std::int64_t>::min()) --max;
    b.max = std::min(b.max, max);
  }
  return b;
}

std::string FormatRange(const KeySpec& spec) {
  if (IsIntegerKind(spec.field)) {
    const IntegerBounds b = IntegerBoundsOf(spec);
    return fmt::format("[{}, {}]", b.min, b.max);
  }
  const Range& range = spec.range;
  return fmt::format("{}{}, {}{}", range.min_open ? "(" : "[", FormatBound(range.min),
                     FormatBound(range.max), (range.max_open || std::isinf(range.max)) ? ")" : "]");
}

bool InRange(double value, const Range& range) {
  if (std::isnan(value)) return false;
  if (range.min_open ? !(value > range.min) : !(value >= range.min)) return false;
  if (range.max_open ? !(value < range.max) : !(value <= range.max)) return false;
  return true;
}

// An integer: a JSON integer, or a float with an integral value (1e9; not -0.0).
Result<std::int64_t> ReadInteger(std::string_view path, const Json& value, const KeySpec& spec) {
  std::int64_t result = 0;
  if (value.is_number_unsigned()) {
    const auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return OutOfRange(path, value, spec);
    }
    result = static_cast<std::int64_t>(u);
  } else if (value.is_number_integer()) {
    result = value.get<std::int64_t>();
  } else if (value.is_number_float()) {
    const double d = value.get<double>();
    if (d == 0 && std::signbit(d)) {  // no integer is written so; its sign would be dropped
      return InvalidArgumentError(fmt::format("{}: expected an integer, got -0.0", path));
    }
    if (!std::isfinite(d) || d != std::trunc(d)) return TypeError(path, "an integer", value);
    if (std::fabs(d) >= 0x1p63) return OutOfRange(path, value, spec);
    result = static_cast<std::int64_t>(d);
  } else {
    return TypeError(path, "an integer", value);
  }
  const IntegerBounds bounds = IntegerBoundsOf(spec);
  if (result < bounds.min || result > bounds.max) return OutOfRange(path, value, spec);
  if (spec.multiple_of != 0 && result % static_cast<std::int64_t>(spec.multiple_of) != 0) {
    return InvalidArgumentError(
        fmt::format("{}: {} is not a multiple of {}", path, Shown(value), spec.multiple_of));
  }
  return result;
}

Result<double> ReadNumber(std::string_view path, const Json& value, const KeySpec& spec) {
  if (!value.is_number()) return TypeError(path, "a number", value);
  const double d = value.get<double>();
  if (!InRange(d, spec.range)) return OutOfRange(path, value, spec);
  return d;
}

Result<int> ReadChoice(std::string_view path, const Json& value, const KeySpec& spec) {
  std::span<const std::string_view> choices = spec.choices;
  // "none" is how kNone prints, not something a scheduler block may say.
  if (spec.path == "scheduler.type") choices = kNamedSchedulers;
  if (!value.is_string()) {
    return TypeError(path, fmt::format("one of {}", JoinQuoted(choices, "\"")), value);
  }
  const auto& text = value.get_ref<const std::string&>();
  for (std::size_t i = 0; i < spec.choices.size(); ++i) {
    const bool same =
        spec.case_insensitive ? EqualsIgnoreCase(text, spec.choices[i]) : text == spec.choices[i];
    if (same && std::find(choices.begin(), choices.end(), spec.choices[i]) != choices.end()) {
      return static_cast<int>(i);
    }
  }
  std::string message =
      fmt::format("{}: \"{}\" is not one of {}", path, text, JoinQuoted(choices, "\""));
  if (auto nearest = Nearest(text, choices))
    message += fmt::format("; did you mean \"{}\"?", *nearest);
  return InvalidArgumentError(std::move(message));
}

Status RefuseAutoPlaceholder(std::string_view path, const Json& value, const KeySpec& spec) {
  if (!value.is_string() || value.get_ref<const std::string&>() != "auto" || spec.auto_is_a_value ||
      std::find(spec.choices.begin(), spec.choices.end(), "auto") != spec.choices.end()) {
    return OkStatus();
  }
  return InvalidArgumentError(fmt::format(
      "{}: \"auto\" is a placeholder that the Hugging Face Trainer fills in before DeepSpeed "
      "reads the config; give the value itself",
      path));
}

Json::json_pointer PointerOf(std::string_view path) {
  Json::json_pointer pointer;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    pointer /= std::string(path.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return pointer;
}

// The effective config as JSON, in schema order (see EffectiveConfigJson).
Json CanonicalJson(const Config& config_in) {
  Config config = config_in;  // the accessors take a mutable config
  const unsigned scheduler_bit = SchedulerBit(config.scheduler.type);
  Json root = Json::object();
  for (const KeySpec& spec : Schema()) {
    if (std::holds_alternative<std::monostate>(spec.field) || !spec.alias_of.empty()) continue;
    if (spec.scheduler_types != 0 && (spec.scheduler_types & scheduler_bit) == 0) continue;
    Json value;
    std::visit(
        [&](const auto& access) {
          using F = std::decay_t<decltype(access)>;
          if constexpr (std::is_same_v<F, std::monostate> || std::is_same_v<F, AppAccess>) {
          } else if constexpr (std::is_same_v<F, EnumAccess>) {
            value = std::string(spec.choices[static_cast<std::size_t>(access.get(config))]);
          } else if constexpr (std::is_same_v<F, SizeAccess> || std::is_same_v<F, PathListAccess>) {
            value = *access.get(config);
          } else if constexpr (std::is_same_v<F, PathWeightsAccess>) {
            const PathWeightsConfig& weights = *access.get(config);
            value = weights.probe ? Json("probe") : Json(weights.weights);
          } else if constexpr (std::is_same_v<F, HostMemoryBudgetAccess>) {
            const HostMemoryBudgetConfig& budget = *access.get(config);
            value = budget.bytes > 0      ? Json(budget.bytes)
                    : budget.fraction > 0 ? Json(budget.fraction)
                                          : Json("auto");
          } else {
            value = *access(config);
          }
        },
        spec.field);
    if (value.is_array() && value.empty()) continue;  // nvme_path not given
    root[PointerOf(spec.path)] = std::move(value);
  }
  // The application's values, after the engine's (Config::app holds every one of them).
  std::vector<std::pair<Json::json_pointer, const Json*>> leaves;
  std::vector<std::pair<Json::json_pointer, const Json*>> pending = {
      {Json::json_pointer(), &config.app}};
  while (!pending.empty()) {
    auto [at, node] = pending.back();
    pending.pop_back();
    if (!node->is_object() || node->empty()) {
      if (!at.empty()) leaves.emplace_back(at, node);
      continue;
    }
    // Reverse, so that the stack pops the keys in their order.
    std::vector<std::pair<Json::json_pointer, const Json*>> children;
    for (const auto& [key, child] : node->items()) children.emplace_back(at / key, &child);
    pending.insert(pending.end(), children.rbegin(), children.rend());
  }
  for (auto& [at, value] : leaves) root[at] = *value;
  return root;
}

std::string TypeText(const KeySpec& spec) {
  return std::visit(
      [&](const auto& access) -> std::string {
        using F = std::decay_t<decltype(access)>;
        if constexpr (std::is_same_v<F, std::monostate>) {
          return "section";
        } else if constexpr (std::is_same_v<F, Accessor<bool>>) {
          return "boolean";
        } else if constexpr (std::is_same_v<F, Accessor<double>>) {
          return "number";
        } else if constexpr (std::is_same_v<F, Accessor<std::string>>) {
          return "string";
        } else if constexpr (std::is_same_v<F, Accessor<std::array<double, 2>>>) {
          return "[number, number]";
        } else if constexpr (std::is_same_v<F, EnumAccess>) {
          std::span<const std::string_view> choices = spec.choices;
          if (spec.path == "scheduler.type") choices = kNamedSchedulers;
          return fmt::format("one of {}", JoinQuoted(choices, ""));
        } else if constexpr (std::is_same_v<F, SizeAccess>) {
          return "integer or size string";
        } else if constexpr (std::is_same_v<F, PathListAccess>) {
          return "string or list of strings";
        } else if constexpr (std::is_same_v<F, PathWeightsAccess>) {
          return "list of numbers or \"probe\"";
        } else if constexpr (std::is_same_v<F, HostMemoryBudgetAccess>) {
          return "size, fraction or \"auto\"";
        } else if constexpr (std::is_same_v<F, AppAccess>) {
          switch (access.key->type) {
            case AppKeyType::kBool:
              return "boolean";
            case AppKeyType::kNumber:
              return "number";
            case AppKeyType::kString:
              return "string";
            case AppKeyType::kChoice:
              return fmt::format("one of {}", JoinQuoted(spec.choices, ""));
            case AppKeyType::kInteger:
            case AppKeyType::kSection:
              break;
          }
          return "integer";
        } else {
          return "integer";
        }
      },
      spec.field);
}

}  // namespace zinf::config::internal

namespace zinf::config {

using internal::kDeviceNames;
using internal::kOptimizerNames;
using internal::kSchedulerNames;

std::string_view OptimizerTypeName(OptimizerType type) {
  return kOptimizerNames[static_cast<std::size_t>(type)];
}
std::string_view SchedulerTypeName(SchedulerType type) {
  return kSchedulerNames[static_cast<std::size_t>(type)];
}
std::string_view OffloadDeviceName(OffloadDevice device) {
  return kDeviceNames[static_cast<std::size_t>(device)];
}

}  // namespace zinf::config
