#include "config_schema.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/core/check.h"

namespace zinf::engine::config_internal {
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

std::string FormatBound(double bound, bool integer) {
  if (std::isinf(bound)) return bound > 0 ? "inf" : "-inf";
  if (integer) return fmt::format("{}", static_cast<std::int64_t>(bound));
  return fmt::format("{}", bound);
}

Status CheckRange(std::string_view path, const Json& shown, double value, const KeySpec& spec) {
  if (!InRange(value, spec.range)) {
    return InvalidArgumentError(fmt::format("{}: {} is out of range {}", path, Shown(shown),
                                            FormatRange(spec.range, IsIntegerKind(spec.field))));
  }
  return OkStatus();
}

constexpr std::string_view kNotImplemented = "a DeepSpeed key that zinf does not implement";

}  // namespace

constexpr std::array<std::string_view, 2> kOptimizerNames = {"Adam", "AdamW"};
constexpr std::array<std::string_view, 4> kSchedulerNames = {"none", "WarmupLR", "WarmupDecayLR",
                                                             "WarmupCosineLR"};
constexpr std::array<std::string_view, 2> kWarmupNames = {"log", "linear"};
constexpr std::array<std::string_view, 3> kDeviceNames = {"none", "cpu", "nvme"};
constexpr std::array<std::string_view, 3> kTagValidationNames = {"Ignore", "Warn", "Fail"};
// Indexed by storage::EngineKind (kAuto, kUring, kPosix).
constexpr std::array<std::string_view, 3> kEngineNames = {"auto", "uring", "posix"};
// Indexed by swapper::StateFormat (kFp32, kQ8).
constexpr std::array<std::string_view, 2> kStateFormatNames = {"fp32", "q8"};

const std::vector<KeySpec>& EngineSchema() {
  using T = Config;
  using O = OptimizerConfig;
  using S = SchedulerConfig;
  using Z = ZeroConfig;
  using OO = OffloadOptimizerConfig;
  using A = AioConfig;
  using D = DeepSpeedCheckpointConfig;
  using ZC = ZinfConfig;
  using C = CheckpointConfig;
  static const std::vector<KeySpec> schema = {
      {.path = "train_batch_size",
       .field = Leaf<&T::train_batch_size>(),
       .description = "Examples per optimizer step over all ranks (DeepSpeed); = micro batch * "
                      "gradient_accumulation_steps * world size",
       .range = Between(1, kMaxInt32),
       .default_text = "derived"},
      {.path = "train_micro_batch_size_per_gpu",
       .field = Leaf<&T::train_micro_batch_size_per_gpu>(),
       .description = "Examples per rank per micro-batch (DeepSpeed)",
       .range = Between(1, kMaxInt32),
       .default_text = "derived"},
      {.path = "gradient_accumulation_steps",
       .field = Leaf<&T::gradient_accumulation_steps>(),
       .description = "Micro-batches per optimizer step (DeepSpeed)",
       .range = Between(1, 1 << 20),
       .default_text = "1, or derived"},
      {.path = "gradient_clipping",
       .field = Leaf<&T::gradient_clipping>(),
       .description = "Clip the global gradient norm to this value; 0 = off (DeepSpeed)",
       .range = AtLeast(0)},
      {.path = "steps_per_print",
       .field = Leaf<&T::steps_per_print>(),
       .description = "Log progress every this many steps (DeepSpeed)",
       .range = AtLeast(1)},
      {.path = "wall_clock_breakdown",
       .field = Leaf<&T::wall_clock_breakdown>(),
       .description = "Log the swap/step timers reduced over ranks at every print (DeepSpeed)"},
      {.path = "bf16", .field = {}, .description = "bf16 working weights (DeepSpeed)"},
      {.path = "bf16.enabled",
       .field = Leaf<&T::bf16>(),
       .description = "Working weights in bf16 (master weights stay fp32 in the swap store)"},
      {.path = "optimizer", .field = {}, .description = "The optimizer (DeepSpeed)"},
      {.path = "optimizer.type",
       .field = Leaf<&T::optimizer, &O::type>(),
       .description = "Adam (decoupled decay iff params.adam_w_mode) or AdamW; case-insensitive",
       .choices = kOptimizerNames},
      {.path = "optimizer.params", .field = {}, .description = "Optimizer hyper-parameters"},
      {.path = "optimizer.params.lr",
       .field = Leaf<&T::optimizer, &O::lr>(),
       .description = "Learning rate (the base of WarmupCosineLR; constant without a scheduler)",
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
                      "offload_optimizer.device nvme (no max_exp_avg_sq on NVMe)"},
      {.path = "scheduler",
       .field = {},
       .description = "Learning-rate schedule (DeepSpeed); absent: constant optimizer lr"},
      {.path = "scheduler.type",
       .field = Leaf<&T::scheduler, &S::type>(),
       .description = "WarmupLR, WarmupDecayLR or WarmupCosineLR; required in a scheduler block",
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
       .description = "Learning rate at the end of the warmup (absolute)",
       .range = AtLeast(0),
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
       .scheduler_types = kAllSchedulersBits},
      {.path = "scheduler.params.warmup_type",
       .field = Leaf<&T::scheduler, &S::warmup_type>(),
       .description = "Warmup curve: log or linear",
       .choices = kWarmupNames,
       .scheduler_types = kAllSchedulersBits},
      {.path = "scheduler.params.total_num_steps",
       .field = Leaf<&T::scheduler, &S::total_num_steps>(),
       .description = "Steps of the whole schedule (required for WarmupDecayLR, WarmupCosineLR)",
       .range = AtLeast(1),
       .default_text = "required",
       .scheduler_types = kWarmupDecayLRBit | kWarmupCosineLRBit},
      {.path = "scheduler.params.cos_min_ratio",
       .field = Leaf<&T::scheduler, &S::cos_min_ratio>(),
       .description = "Floor of the cosine decay as a fraction of optimizer.params.lr",
       .range = Between(0, 1),
       .scheduler_types = kWarmupCosineLRBit},
      {.path = "zero_optimization", .field = {}, .description = "ZeRO partitioning (DeepSpeed)"},
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
       .description = "nvme: swapped to nvme_path; cpu or none: kept in host memory",
       .choices = kDeviceNames},
      {.path = "zero_optimization.offload_optimizer.nvme_path",
       .field = PathList<&T::zero_optimization, &Z::offload_optimizer, &OO::nvme_path>(),
       .description = "Node-local directory, or a list (striped); {local_rank} and {node} are "
                      "replaced; required for device nvme",
       .default_text = "none"},
      {.path = "zero_optimization.offload_optimizer.buffer_count",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::buffer_count>(),
       .description = "Swap buffers of the largest sub-group (when zinf.pinned_budget_bytes is "
                      "0); pipelining needs 12",
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
      {.path = "zero_optimization.offload_optimizer.fast_init",
       .field = Leaf<&T::zero_optimization, &Z::offload_optimizer, &OO::fast_init>(),
       .description = "Accepted for DeepSpeed compatibility; zinf always streams the init"},
      {.path = "zero_optimization.offload_optimizer.ratio",
       .field = {},
       .description = "Partial offload",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.offload_param",
       .field = {},
       .description = "Parameter offload (zinf swaps optimizer state only)",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.contiguous_gradients",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.overlap_comm",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.reduce_scatter",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.reduce_bucket_size",
       .field = Leaf<&T::zero_optimization, &Z::reduce_bucket_size>(),
       .description = "Elements per gradient bucket: the engine reduce-scatters the gradient "
                      "bucket by bucket, overlapping the backward pass when gradients are handed "
                      "per parameter (ZeroEngine::GradientReady)",
       .range = AtLeast(1)},
      {.path = "zero_optimization.allgather_partitions",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.allgather_bucket_size",
       .field = Leaf<&T::zero_optimization, &Z::allgather_bucket_size>(),
       .description = "Elements per all-gather round: the engine gathers the updated weights "
                      "into the parameters through a buffer of this many elements",
       .range = AtLeast(1)},
      {.path = "zero_optimization.stage3_max_live_parameters",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.stage3_prefetch_bucket_size",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.stage3_param_persistence_threshold",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "aio", .field = {}, .description = "Asynchronous I/O engine knobs (DeepSpeed)"},
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
       .description = "io_uring rings (POSIX workers) per engine, each with its own thread",
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
      {.path = "checkpoint",
       .field = {},
       .description = "DeepSpeed's checkpoint options (zinf's own are under zinf.checkpoint)"},
      {.path = "checkpoint.tag_validation",
       .field = Leaf<&T::checkpoint, &D::tag_validation>(),
       .description = "Ignore, Warn or Fail when ranks disagree on a checkpoint tag",
       .choices = kTagValidationNames},
      {.path = "checkpoint.load_universal",
       .field = Leaf<&T::checkpoint, &D::load_universal>(),
       .description = "Accepted; zinf checkpoints always restore on any world size"},
      {.path = "checkpoint.use_node_local_storage",
       .field = Leaf<&T::checkpoint, &D::use_node_local_storage>(),
       .description = "Accepted; zinf writes one parallel-HDF5 file collectively"},
      {.path = "fp16",
       .field = {},
       .description = "zinf keeps fp32 master weights; use bf16.enabled",
       .unsupported = kNotImplemented},
      {.path = "amp", .field = {}, .description = "", .unsupported = kNotImplemented},
      {.path = "activation_checkpointing",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "prescale_gradients",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "gradient_predivide_factor",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_allow_untested_optimizer",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "tensorboard", .field = {}, .description = "", .unsupported = kNotImplemented},
      {.path = "wandb", .field = {}, .description = "", .unsupported = kNotImplemented},
      {.path = "flops_profiler", .field = {}, .description = "", .unsupported = kNotImplemented},
      {.path = "zinf", .field = {}, .description = "What DeepSpeed does not have"},
      {.path = "zinf.pinned_budget_bytes",
       .field = Size<&T::zinf, &ZC::pinned_budget_bytes>(),
       .description = "Host memory for swap buffers: bytes or a size (\"2G\", \"512MiB\"); 0: "
                      "offload_optimizer.buffer_count buffers",
       .range = AtLeast(0)},
      {.path = "zinf.io_engine",
       .field = Leaf<&T::zinf, &ZC::io_engine>(),
       .description = "auto (io_uring if it works, else POSIX), uring or posix; ZINF_IO_ENGINE "
                      "overrides",
       .choices = kEngineNames},
      {.path = "zinf.optimizer_state",
       .field = Leaf<&T::zinf, &ZC::optimizer_state>(),
       .description = "The swapped Adam state: fp32 (weights and both moments, 12 bytes per "
                      "element), or q8 (fp32 weights, both moments as 8-bit block-wise quantized "
                      "codes: about 6 bytes per element, half the swap I/O of a step)",
       .choices = kStateFormatNames},
      {.path = "zinf.verify_swap",
       .field = Leaf<&T::zinf, &ZC::verify_swap>(),
       .description = "Checksum every swapped stripe unit on write, check it on read"},
      {.path = "zinf.keep_swap",
       .field = Leaf<&T::zinf, &ZC::keep_swap>(),
       .description = "Keep the swap store at exit"},
      {.path = "zinf.swap_gradients",
       .field = Leaf<&T::zinf, &ZC::swap_gradients>(),
       .description = "Accumulate partition gradients through the gradient swapper"},
      {.path = "zinf.adam_threads",
       .field = Leaf<&T::zinf, &ZC::adam_threads>(),
       .description = "CPU Adam threads per rank; 0 = hardware concurrency",
       .range = Between(0, 1024)},
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
       .description = "Steps between checkpoints",
       .range = AtLeast(1)},
      {.path = "zinf.checkpoint.keep_last",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::keep_last>(),
       .description = "Checkpoints kept (older ones removed); 0 keeps all",
       .range = Between(0, 1 << 20)},
      {.path = "zinf.checkpoint.load",
       .field = Leaf<&T::zinf, &ZC::checkpoint, &C::load>(),
       .description = "Empty: start fresh; \"latest\": resume from <dir>/latest (an error if "
                      "there is none); \"auto\": resume from <dir>/latest if it exists, else "
                      "start fresh; else the checkpoint file (or directory) to resume from"},
  };
  return schema;
}

SchemaView::SchemaView(std::span<const AppKey> app_keys) : app_keys_(app_keys) {
  specs_ = EngineSchema();
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
    if (ParentOf(spec.path) == section && spec.alias_of.empty() && spec.unsupported.empty()) {
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

std::string FormatRange(const Range& range, bool integer) {
  return fmt::format("{}{}, {}{}", range.min_open ? "(" : "[", FormatBound(range.min, integer),
                     FormatBound(range.max, integer),
                     (range.max_open || std::isinf(range.max)) ? ")" : "]");
}

bool InRange(double value, const Range& range) {
  if (std::isnan(value)) return false;
  if (range.min_open ? !(value > range.min) : !(value >= range.min)) return false;
  if (range.max_open ? !(value < range.max) : !(value <= range.max)) return false;
  return true;
}

// An integer: a JSON integer, or a float with an integral value (1e9).
Result<std::int64_t> ReadInteger(std::string_view path, const Json& value, const KeySpec& spec) {
  std::int64_t result = 0;
  if (value.is_number_unsigned()) {
    const auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return InvalidArgumentError(fmt::format("{}: {} is out of range {}", path, Shown(value),
                                              FormatRange(spec.range, true)));
    }
    result = static_cast<std::int64_t>(u);
  } else if (value.is_number_integer()) {
    result = value.get<std::int64_t>();
  } else if (value.is_number_float()) {
    const double d = value.get<double>();
    if (!std::isfinite(d) || d != std::trunc(d)) return TypeError(path, "an integer", value);
    if (std::fabs(d) >= 0x1p63) {
      return InvalidArgumentError(fmt::format("{}: {} is out of range {}", path, Shown(value),
                                              FormatRange(spec.range, true)));
    }
    result = static_cast<std::int64_t>(d);
  } else {
    return TypeError(path, "an integer", value);
  }
  ZINF_RETURN_IF_ERROR(CheckRange(path, value, static_cast<double>(result), spec));
  if (spec.multiple_of != 0 && result % static_cast<std::int64_t>(spec.multiple_of) != 0) {
    return InvalidArgumentError(
        fmt::format("{}: {} is not a multiple of {}", path, Shown(value), spec.multiple_of));
  }
  return result;
}

Result<double> ReadNumber(std::string_view path, const Json& value, const KeySpec& spec) {
  if (!value.is_number()) return TypeError(path, "a number", value);
  const double d = value.get<double>();
  ZINF_RETURN_IF_ERROR(CheckRange(path, value, d, spec));
  return d;
}

Result<int> ReadChoice(std::string_view path, const Json& value, const KeySpec& spec) {
  std::span<const std::string_view> choices = spec.choices;
  // "none" is how kNone prints, not something a scheduler block may say.
  if (spec.path == "scheduler.type") choices = kSchedulerChoicesForError;
  if (!value.is_string()) {
    return TypeError(path, fmt::format("one of {}", JoinQuoted(choices, "\"")), value);
  }
  const auto& text = value.get_ref<const std::string&>();
  for (std::size_t i = 0; i < spec.choices.size(); ++i) {
    if (EqualsIgnoreCase(text, spec.choices[i]) &&
        std::find(choices.begin(), choices.end(), spec.choices[i]) != choices.end()) {
      return static_cast<int>(i);
    }
  }
  std::string message =
      fmt::format("{}: \"{}\" is not one of {}", path, text, JoinQuoted(choices, "\""));
  if (auto nearest = Nearest(text, choices))
    message += fmt::format("; did you mean \"{}\"?", *nearest);
  return InvalidArgumentError(std::move(message));
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
  for (const KeySpec& spec : EngineSchema()) {
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
          if (spec.path == "scheduler.type") choices = kSchedulerChoicesForError;
          return fmt::format("one of {}", JoinQuoted(choices, ""));
        } else if constexpr (std::is_same_v<F, SizeAccess>) {
          return "integer or size string";
        } else if constexpr (std::is_same_v<F, PathListAccess>) {
          return "string or list of strings";
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

}  // namespace zinf::engine::config_internal

namespace zinf::engine {

using config_internal::kDeviceNames;
using config_internal::kOptimizerNames;
using config_internal::kSchedulerNames;
using config_internal::kTagValidationNames;
using config_internal::kWarmupNames;

std::string_view OptimizerTypeName(OptimizerType type) {
  return kOptimizerNames[static_cast<std::size_t>(type)];
}
std::string_view SchedulerTypeName(SchedulerType type) {
  return kSchedulerNames[static_cast<std::size_t>(type)];
}
std::string_view WarmupTypeName(WarmupType type) {
  return kWarmupNames[static_cast<std::size_t>(type)];
}
std::string_view OffloadDeviceName(OffloadDevice device) {
  return kDeviceNames[static_cast<std::size_t>(device)];
}
std::string_view TagValidationName(TagValidation value) {
  return kTagValidationNames[static_cast<std::size_t>(value)];
}

}  // namespace zinf::engine
