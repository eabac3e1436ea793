#include "config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <numbers>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "zinf/core/check.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/fs.h"

namespace zinf::train {
namespace {

using Json = nlohmann::ordered_json;

constexpr double kInf = std::numeric_limits<double>::infinity();
// What a config file may be: at most 16 MiB, nested at most 32 levels (the schema needs 4).
constexpr std::uint64_t kMaxConfigBytes = 16u << 20;
constexpr JsonLimits kConfigJsonLimits{.max_bytes = kMaxConfigBytes, .max_depth = 32};
constexpr double kMaxInt32 = 2147483647.0;

// ---- Field access: the schema reaches into TrainConfig through these. ----

template <auto M, auto... Ms>
constexpr auto& MemberOf(auto& object) {
  if constexpr (sizeof...(Ms) == 0) {
    return object.*M;
  } else {
    return MemberOf<Ms...>(object.*M);
  }
}

template <typename T>
using Accessor = T* (*)(TrainConfig&);

// An enum field, read and written as its index into KeySpec::choices.
struct EnumAccess {
  int (*get)(TrainConfig&);
  void (*set)(TrainConfig&, int);
};
// An unsigned byte count given as an integer or a size string ("2G").
struct SizeAccess {
  std::uint64_t* (*get)(TrainConfig&);
};
// One path or a list of paths.
struct PathListAccess {
  std::vector<std::string>* (*get)(TrainConfig&);
};
// std::monostate: a section (a JSON object holding keys).
using Field = std::variant<std::monostate, Accessor<bool>, Accessor<int>, Accessor<std::int64_t>,
                           Accessor<std::uint64_t>, Accessor<double>, Accessor<std::string>,
                           Accessor<std::array<double, 2>>, EnumAccess, SizeAccess, PathListAccess>;

template <auto... Ms>
Field Leaf() {
  using T = std::remove_cvref_t<decltype(MemberOf<Ms...>(std::declval<TrainConfig&>()))>;
  if constexpr (std::is_enum_v<T>) {
    return EnumAccess{[](TrainConfig& c) { return static_cast<int>(MemberOf<Ms...>(c)); },
                      [](TrainConfig& c, int v) { MemberOf<Ms...>(c) = static_cast<T>(v); }};
  } else {
    return Accessor<T>{[](TrainConfig& c) { return &MemberOf<Ms...>(c); }};
  }
}
template <auto... Ms>
Field Size() {
  return SizeAccess{[](TrainConfig& c) { return &MemberOf<Ms...>(c); }};
}
template <auto... Ms>
Field PathList() {
  return PathListAccess{[](TrainConfig& c) { return &MemberOf<Ms...>(c); }};
}

struct Range {
  double min = -kInf;
  double max = kInf;
  bool min_open = false;  // (min, ...
  bool max_open = false;  // ..., max)
};

constexpr Range AtLeast(double min) { return {.min = min}; }
constexpr Range Between(double min, double max) { return {.min = min, .max = max}; }
constexpr Range Positive() { return {.min = 0, .min_open = true}; }
constexpr Range UnitOpen() { return {.min = 0, .max = 1, .max_open = true}; }

constexpr unsigned SchedulerBit(SchedulerType type) { return 1u << static_cast<int>(type); }
constexpr unsigned kWarmupLRBit = SchedulerBit(SchedulerType::kWarmupLR);
constexpr unsigned kWarmupDecayLRBit = SchedulerBit(SchedulerType::kWarmupDecayLR);
constexpr unsigned kWarmupCosineLRBit = SchedulerBit(SchedulerType::kWarmupCosineLR);
constexpr unsigned kAllSchedulersBits = kWarmupLRBit | kWarmupDecayLRBit | kWarmupCosineLRBit;

// One key of the schema.
struct KeySpec {
  std::string_view path;  // "aio.queue_depth"
  Field field;            // how to read/write the value; monostate: a section
  std::string_view description;
  Range range = {};                                // numbers
  std::span<const std::string_view> choices = {};  // enums: choices[enum value]
  std::uint64_t multiple_of = 0;                   // integers: must be a multiple of this
  std::string_view default_text = {};              // overrides the printed default
  std::string_view alias_of = {};                  // old name of this other key (a WARN)
  unsigned scheduler_types = 0;                    // nonzero: only for these scheduler types
  std::string_view unsupported = {};               // a DeepSpeed key zinf rejects: why
};

constexpr std::array<std::string_view, 2> kOptimizerNames = {"Adam", "AdamW"};
constexpr std::array<std::string_view, 4> kSchedulerNames = {"none", "WarmupLR", "WarmupDecayLR",
                                                             "WarmupCosineLR"};
constexpr std::array<std::string_view, 2> kWarmupNames = {"log", "linear"};
constexpr std::array<std::string_view, 3> kDeviceNames = {"none", "cpu", "nvme"};
constexpr std::array<std::string_view, 3> kTagValidationNames = {"Ignore", "Warn", "Fail"};
constexpr std::array<std::string_view, 2> kModelNames = {"charlm", "synthetic"};
// Indexed by Activation (charlm.h); the test checks these against ActivationName.
constexpr std::array<std::string_view, 2> kActivationNames = {"tanh", "relu"};
static_assert(static_cast<int>(Activation::kTanh) == 0 && static_cast<int>(Activation::kRelu) == 1);
// Indexed by storage::EngineKind (kAuto, kUring, kPosix).
constexpr std::array<std::string_view, 3> kEngineNames = {"auto", "uring", "posix"};
// Only the scheduler types a config may name ("none" is the absence of the block).
constexpr std::array<std::string_view, 3> kSchedulerChoicesForError = {"WarmupLR", "WarmupDecayLR",
                                                                       "WarmupCosineLR"};

constexpr std::string_view kNotImplemented = "a DeepSpeed key that zinf does not implement";

// THE schema: every key zinf-train knows, in the order EffectiveConfigJson prints them.
const std::vector<KeySpec>& Schema() {
  using T = TrainConfig;
  using O = OptimizerConfig;
  using S = SchedulerConfig;
  using Z = ZeroConfig;
  using OO = OffloadOptimizerConfig;
  using A = AioConfig;
  using D = DeepSpeedCheckpointConfig;
  using ZC = ZinfConfig;
  using C = CheckpointConfig;
  using M = ModelConfig;
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
       .description = "Use the running max of exp_avg_sq (torch's amsgrad)"},
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
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.allgather_partitions",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
      {.path = "zero_optimization.allgather_bucket_size",
       .field = {},
       .description = "",
       .unsupported = kNotImplemented},
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
      {.path = "zinf.compute_threads",
       .field = Leaf<&T::zinf, &ZC::compute_threads>(),
       .description = "BLAS threads per rank for the model's forward/backward; 0 = the node's "
                      "cores / its ranks. Results are bitwise reproducible only for a fixed "
                      "count: set it when runs with different ranks per node must agree bitwise",
       .range = Between(0, 1024)},
      {.path = "zinf.job_id",
       .field = Leaf<&T::zinf, &ZC::job_id>(),
       .description = "Names the swap store directory zinf-<job_id>; [A-Za-z0-9_.-]+; empty: "
                      "\"cfg\" + 12 hex digits of a hash of what identifies the job "
                      "(zinf.checkpoint.dir, zinf.model, zinf.data.path, zinf.seed, world size; "
                      "not steps, resume, checkpoint cadence or learning rate)",
       .default_text = "derived"},
      {.path = "zinf.seed",
       .field = Leaf<&T::zinf, &ZC::seed>(),
       .description = "Seed of the initial weights and of the data order",
       .range = AtLeast(0)},
      {.path = "zinf.steps",
       .field = Leaf<&T::zinf, &ZC::steps>(),
       .description = "Optimizer steps to run (up to 2^53 - 1, the largest step a checkpoint "
                      "holds)",
       .range = Between(1, 9007199254740991.0)},
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
      {.path = "zinf.model", .field = {}, .description = "The model to train"},
      {.path = "zinf.model.name",
       .field = Leaf<&T::zinf, &ZC::model, &M::name>(),
       .description = "charlm (byte-level MLP language model) or synthetic (pseudo-gradients)",
       .choices = kModelNames},
      {.path = "zinf.model.hidden",
       .field = Leaf<&T::zinf, &ZC::model, &M::hidden>(),
       .description = "charlm: width of each hidden layer",
       .range = Between(1, 1 << 20)},
      {.path = "zinf.model.layers",
       .field = Leaf<&T::zinf, &ZC::model, &M::layers>(),
       .description = "charlm: hidden layers",
       .range = Between(0, 1024)},
      {.path = "zinf.model.context",
       .field = Leaf<&T::zinf, &ZC::model, &M::context>(),
       .description = "charlm: bytes of context per example",
       .range = Between(1, 4096)},
      {.path = "zinf.model.embed_dim",
       .field = Leaf<&T::zinf, &ZC::model, &M::embed_dim>(),
       .description = "charlm: embedding width per byte",
       .range = Between(1, 65536)},
      {.path = "zinf.model.activation",
       .field = Leaf<&T::zinf, &ZC::model, &M::activation>(),
       .description = "charlm: activation of the hidden layers",
       .choices = kActivationNames},
      {.path = "zinf.model.total_params",
       .field = Leaf<&T::zinf, &ZC::model, &M::total_params>(),
       .description = "synthetic: number of parameters in all",
       .range = Between(1, 0x1p40)},
      {.path = "zinf.model.num_params",
       .field = Leaf<&T::zinf, &ZC::model, &M::num_params>(),
       .description = "synthetic: parameter tensors the total is split into",
       .range = Between(1, 1 << 20)},
      {.path = "zinf.data", .field = {}, .description = "Training data"},
      {.path = "zinf.data.path",
       .field = Leaf<&T::zinf, &ZC::data_path>(),
       .description = "Text file or directory for charlm; empty: the built-in text"},
  };
  return schema;
}

const std::map<std::string_view, const KeySpec*>& SchemaIndex() {
  static const std::map<std::string_view, const KeySpec*> index = [] {
    std::map<std::string_view, const KeySpec*> m;
    for (const KeySpec& spec : Schema()) {
      const bool inserted = m.emplace(spec.path, &spec).second;
      ZINF_CHECK(inserted, "config schema: duplicate key {}", spec.path);
    }
    return m;
  }();
  return index;
}

const KeySpec* FindSpec(std::string_view path) {
  const auto& index = SchemaIndex();
  auto it = index.find(path);
  return it == index.end() ? nullptr : it->second;
}

std::string_view ParentOf(std::string_view path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}
std::string_view LastComponent(std::string_view path) {
  const std::size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

char Lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                            [](char x, char y) { return Lower(x) == Lower(y); });
}

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
  std::string text = value.dump();
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
         std::holds_alternative<SizeAccess>(field);
}

std::string FormatBound(double bound, bool integer) {
  if (std::isinf(bound)) return bound > 0 ? "inf" : "-inf";
  if (integer) return fmt::format("{}", static_cast<std::int64_t>(bound));
  return fmt::format("{}", bound);
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

Status CheckRange(std::string_view path, const Json& shown, double value, const KeySpec& spec) {
  if (!InRange(value, spec.range)) {
    return InvalidArgumentError(fmt::format("{}: {} is out of range {}", path, Shown(shown),
                                            FormatRange(spec.range, IsIntegerKind(spec.field))));
  }
  return OkStatus();
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

// The keys a section may hold (for suggestions): its children that are neither old names nor
// rejected DeepSpeed keys.
std::vector<std::string_view> ChildKeys(std::string_view section) {
  std::vector<std::string_view> keys;
  for (const KeySpec& spec : Schema()) {
    if (ParentOf(spec.path) == section && spec.alias_of.empty() && spec.unsupported.empty()) {
      keys.push_back(LastComponent(spec.path));
    }
  }
  return keys;
}

std::string_view DisplayPath(std::string_view path) { return path.empty() ? "(top level)" : path; }

class Parser {
 public:
  explicit Parser(const ConfigContext& ctx) : ctx_(ctx) {}

  Result<TrainConfig> Run(std::string_view json_text) {
    if (ctx_.world_size < 1 || ctx_.local_rank < 0 || ctx_.node < 0) {
      return InvalidArgumentError(
          fmt::format("config context: world_size {} must be >= 1, local_rank {} and node {} >= 0",
                      ctx_.world_size, ctx_.local_rank, ctx_.node));
    }
    // Bounded: nesting, duplicate keys (a setting has one spelling) and numbers out of range are
    // errors, never an exception or a stack overflow.
    ZINF_ASSIGN_OR_RETURN(Json root, ParseJson<Json>(json_text, kConfigJsonLimits));
    if (!root.is_object()) return TypeError(DisplayPath(""), "an object", root);
    ZINF_RETURN_IF_ERROR(WalkObject(root, ""));
    ZINF_RETURN_IF_ERROR(CheckAliases());
    ZINF_RETURN_IF_ERROR(CheckScheduler());
    ZINF_RETURN_IF_ERROR(CheckOffload());
    ZINF_RETURN_IF_ERROR(CheckZinf());
    ZINF_RETURN_IF_ERROR(ResolveBatchSizes());
    config_.world_size = ctx_.world_size;
    return std::move(config_);
  }

 private:
  bool Given(std::string_view path) const { return given_.contains(path); }

  Status WalkObject(const Json& object, const std::string& prefix) {
    for (const auto& [key, value] : object.items()) {
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      const KeySpec* spec = FindSpec(path);
      if (spec == nullptr) return UnknownKey(prefix, key, path);
      if (!spec->unsupported.empty()) {
        const std::string why =
            spec->description.empty() ? "" : fmt::format(" ({})", spec->description);
        return InvalidArgumentError(
            fmt::format("{}: {}{}; remove it", path, spec->unsupported, why));
      }
      given_.insert(path);
      if (std::holds_alternative<std::monostate>(spec->field)) {
        if (!value.is_object()) return TypeError(path, "an object", value);
        ZINF_RETURN_IF_ERROR(WalkObject(value, path));
        continue;
      }
      ZINF_RETURN_IF_ERROR(SetLeaf(*spec, path, value));
    }
    return OkStatus();
  }

  Status UnknownKey(const std::string& prefix, const std::string& key, const std::string& path) {
    const std::vector<std::string_view> keys = ChildKeys(prefix);
    if (auto nearest = Nearest(key, keys)) {
      return InvalidArgumentError(
          fmt::format("{}: unknown key; did you mean '{}'?", path, *nearest));
    }
    return InvalidArgumentError(fmt::format("{}: unknown key; valid keys in {}: {}", path,
                                            DisplayPath(prefix), JoinQuoted(keys, "'")));
  }

  Status SetLeaf(const KeySpec& spec, const std::string& path, const Json& value) {
    TrainConfig& c = config_;
    if (auto* f = std::get_if<Accessor<bool>>(&spec.field)) {
      if (!value.is_boolean()) return TypeError(path, "a boolean", value);
      *(*f)(c) = value.get<bool>();
    } else if (auto* fi = std::get_if<Accessor<int>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
      *(*fi)(c) = static_cast<int>(v);
    } else if (auto* fl = std::get_if<Accessor<std::int64_t>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(*(*fl)(c), ReadInteger(path, value, spec));
    } else if (auto* fu = std::get_if<Accessor<std::uint64_t>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
      *(*fu)(c) = static_cast<std::uint64_t>(v);
    } else if (auto* fd = std::get_if<Accessor<double>>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(*(*fd)(c), ReadNumber(path, value, spec));
    } else if (auto* fs = std::get_if<Accessor<std::string>>(&spec.field)) {
      if (!value.is_string()) return TypeError(path, "a string", value);
      *(*fs)(c) = value.get<std::string>();
    } else if (auto* fb = std::get_if<Accessor<std::array<double, 2>>>(&spec.field)) {
      if (!value.is_array() || value.size() != 2) {
        return TypeError(path, "an array of 2 numbers", value);
      }
      for (std::size_t i = 0; i < 2; ++i) {
        ZINF_ASSIGN_OR_RETURN((*(*fb)(c))[i],
                              ReadNumber(fmt::format("{}[{}]", path, i), value[i], spec));
      }
    } else if (auto* fe = std::get_if<EnumAccess>(&spec.field)) {
      ZINF_ASSIGN_OR_RETURN(const int index, ReadChoice(path, value, spec));
      fe->set(c, index);
    } else if (auto* fz = std::get_if<SizeAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetSize(spec, path, value, fz->get(c)));
    } else if (auto* fp = std::get_if<PathListAccess>(&spec.field)) {
      ZINF_RETURN_IF_ERROR(SetPathList(path, value, fp->get(c)));
    }
    return OkStatus();
  }

  Status SetSize(const KeySpec& spec, const std::string& path, const Json& value,
                 std::uint64_t* out) {
    if (value.is_string()) {
      const auto& text = value.get_ref<const std::string&>();
      auto bytes = ParseBytes(text);
      if (!bytes) {
        return InvalidArgumentError(fmt::format(
            "{}: \"{}\" is not a size (an integer number of bytes, or a number with a unit: "
            "\"4096\", \"512M\", \"2GiB\", \"1.5G\")",
            path, text));
      }
      if (!InRange(static_cast<double>(*bytes), spec.range)) {
        return InvalidArgumentError(fmt::format("{}: {} is out of range {}", path, Shown(value),
                                                FormatRange(spec.range, true)));
      }
      *out = *bytes;
      return OkStatus();
    }
    if (!value.is_number()) {
      return TypeError(path, "an integer or a size string (\"2G\")", value);
    }
    ZINF_ASSIGN_OR_RETURN(const std::int64_t v, ReadInteger(path, value, spec));
    *out = static_cast<std::uint64_t>(v);
    return OkStatus();
  }

  Status SetPathList(const std::string& path, const Json& value, std::vector<std::string>* out) {
    constexpr std::string_view kExpected = "a string or a list of strings";
    out->clear();
    if (value.is_string()) {
      out->push_back(value.get<std::string>());
    } else if (value.is_array()) {
      if (value.empty()) {
        return InvalidArgumentError(
            fmt::format("{}: empty list; give at least one directory", path));
      }
      for (std::size_t i = 0; i < value.size(); ++i) {
        if (!value[i].is_string()) {
          return TypeError(fmt::format("{}[{}]", path, i), "a string", value[i]);
        }
        out->push_back(value[i].get<std::string>());
      }
    } else {
      return TypeError(path, kExpected, value);
    }
    return OkStatus();
  }

  Status CheckAliases() {
    for (const KeySpec& spec : Schema()) {
      if (spec.alias_of.empty() || !Given(spec.path)) continue;
      if (Given(spec.alias_of)) {
        return InvalidArgumentError(fmt::format(
            "{}: old name of {}; give only one of them (both are set)", spec.path, spec.alias_of));
      }
      ZINF_LOG_WARN("config: {} is the old name of {}; please rename it", spec.path, spec.alias_of);
    }
    return OkStatus();
  }

  Status CheckScheduler() {
    SchedulerConfig& s = config_.scheduler;
    if (Given("scheduler") && !Given("scheduler.type")) {
      return InvalidArgumentError(
          fmt::format("scheduler.type: required in a scheduler block "
                      "(one of {})",
                      JoinQuoted(kSchedulerChoicesForError, "\"")));
    }
    const unsigned bit = SchedulerBit(s.type);
    for (const KeySpec& spec : Schema()) {
      if (spec.scheduler_types == 0 || !Given(spec.path) || (spec.scheduler_types & bit) != 0) {
        continue;
      }
      std::vector<std::string_view> valid;
      for (const KeySpec& other : Schema()) {
        if (ParentOf(other.path) == "scheduler.params" && (other.scheduler_types & bit) != 0) {
          valid.push_back(LastComponent(other.path));
        }
      }
      return InvalidArgumentError(
          fmt::format("{}: not a parameter of scheduler {} (its "
                      "parameters: {})",
                      spec.path, SchedulerTypeName(s.type), JoinQuoted(valid, "")));
    }
    if (s.type == SchedulerType::kWarmupDecayLR || s.type == SchedulerType::kWarmupCosineLR) {
      if (!Given("scheduler.params.total_num_steps")) {
        return InvalidArgumentError(
            fmt::format("scheduler.params.total_num_steps: required by scheduler {}",
                        SchedulerTypeName(s.type)));
      }
      const std::int64_t warmup = std::max<std::int64_t>(2, s.warmup_num_steps);
      if (s.type == SchedulerType::kWarmupCosineLR && s.total_num_steps <= warmup) {
        // DeepSpeed divides by total - warmup: equal values divide by zero.
        return InvalidArgumentError(fmt::format(
            "scheduler.params.total_num_steps: {} must be greater than warmup_num_steps {} "
            "(WarmupCosineLR decays over the steps after the warmup)",
            s.total_num_steps, warmup));
      }
      if (s.total_num_steps < warmup) {
        ZINF_LOG_WARN(
            "config: scheduler.params.total_num_steps {} is less than "
            "warmup_num_steps {}",
            s.total_num_steps, warmup);
      }
    }
    if (s.type == SchedulerType::kWarmupLR || s.type == SchedulerType::kWarmupDecayLR) {
      if (s.warmup_min_lr > s.warmup_max_lr) {
        ZINF_LOG_WARN(
            "config: scheduler.params.warmup_min_lr {} > warmup_max_lr {}: the warmup "
            "lowers the learning rate",
            s.warmup_min_lr, s.warmup_max_lr);
      }
    }
    return OkStatus();
  }

  static Result<std::string> ExpandPlaceholders(const std::string& path, const std::string& text,
                                                const ConfigContext& ctx) {
    std::string out;
    std::size_t pos = 0;
    while (pos < text.size()) {
      const char ch = text[pos];
      if (ch == '}') {
        return InvalidArgumentError(fmt::format("{}: unmatched '}}' in \"{}\"", path, text));
      }
      if (ch != '{') {
        out += ch;
        ++pos;
        continue;
      }
      const std::size_t close = text.find('}', pos);
      if (close == std::string::npos) {
        return InvalidArgumentError(
            fmt::format("{}: unterminated placeholder in \"{}\"", path, text));
      }
      const std::string_view name = std::string_view(text).substr(pos + 1, close - pos - 1);
      if (name == "local_rank") {
        out += std::to_string(ctx.local_rank);
      } else if (name == "node") {
        out += std::to_string(ctx.node);
      } else {
        return InvalidArgumentError(fmt::format(
            "{}: unknown placeholder '{{{}}}' in \"{}\" (known: {{local_rank}}, {{node}})", path,
            name, text));
      }
      pos = close + 1;
    }
    return out;
  }

  Status CheckOffload() {
    OffloadOptimizerConfig& o = config_.zero_optimization.offload_optimizer;
    constexpr std::string_view kPath = "zero_optimization.offload_optimizer.nvme_path";
    o.resolved_nvme_paths.clear();
    for (std::size_t i = 0; i < o.nvme_path.size(); ++i) {
      const std::string element =
          o.nvme_path.size() > 1 ? fmt::format("{}[{}]", kPath, i) : std::string(kPath);
      if (o.nvme_path[i].empty()) {
        return InvalidArgumentError(fmt::format("{}: empty path", element));
      }
      ZINF_ASSIGN_OR_RETURN(std::string resolved,
                            ExpandPlaceholders(element, o.nvme_path[i], ctx_));
      if (std::find(o.resolved_nvme_paths.begin(), o.resolved_nvme_paths.end(), resolved) !=
          o.resolved_nvme_paths.end()) {
        return InvalidArgumentError(fmt::format("{}: \"{}\" is listed twice", element, resolved));
      }
      o.resolved_nvme_paths.push_back(std::move(resolved));
    }
    if (o.device == OffloadDevice::kNvme && o.nvme_path.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: required when offload_optimizer.device is \"nvme\"", kPath));
    }
    return OkStatus();
  }

  Status CheckZinf() {
    const std::string& job_id = config_.zinf.job_id;
    const bool valid_chars = std::all_of(job_id.begin(), job_id.end(), [](char ch) {
      return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
             ch == '_' || ch == '.' || ch == '-';
    });
    if (!valid_chars || job_id.find("..") != std::string::npos || job_id == ".") {
      return InvalidArgumentError(fmt::format(
          "zinf.job_id: \"{}\" may contain only A-Z a-z 0-9 _ . - (and no \"..\")", job_id));
    }
    const CheckpointConfig& checkpoint = config_.zinf.checkpoint;
    if ((checkpoint.load == "latest" || checkpoint.load == "auto") && checkpoint.dir.empty()) {
      return InvalidArgumentError(fmt::format(
          "zinf.checkpoint.load: \"{}\" resumes from <dir>/latest, but zinf.checkpoint.dir is "
          "not set",
          checkpoint.load));
    }
    return OkStatus();
  }

  // DeepSpeed's _set_batch_related_parameters + _batch_assertion, with exact divisibility.
  Status ResolveBatchSizes() {
    TrainConfig& c = config_;
    const std::int64_t world = ctx_.world_size;
    const bool has_batch = Given("train_batch_size");
    const bool has_micro = Given("train_micro_batch_size_per_gpu");
    const bool has_gas = Given("gradient_accumulation_steps");
    std::int64_t& batch = c.train_batch_size;
    std::int64_t& micro = c.train_micro_batch_size_per_gpu;
    std::int64_t& gas = c.gradient_accumulation_steps;
    if (has_batch && has_micro && has_gas) {
      if (batch != micro * gas * world) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} != train_micro_batch_size_per_gpu {} * "
                        "gradient_accumulation_steps {} * world_size {} = {}",
                        batch, micro, gas, world, micro * gas * world));
      }
    } else if (has_batch && has_micro) {
      if (batch % (micro * world) != 0) {
        return InvalidArgumentError(fmt::format(
            "train_batch_size: {} is not divisible by train_micro_batch_size_per_gpu {} * "
            "world_size {} = {}, so gradient_accumulation_steps cannot be derived",
            batch, micro, world, micro * world));
      }
      gas = batch / (micro * world);
    } else if (has_batch && has_gas) {
      if (batch % (gas * world) != 0) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} is not divisible by gradient_accumulation_steps {} * "
                        "world_size {} = {}, so train_micro_batch_size_per_gpu cannot be derived",
                        batch, gas, world, gas * world));
      }
      micro = batch / (gas * world);
    } else if (has_micro && has_gas) {
      batch = micro * gas * world;
    } else if (has_batch) {
      if (batch % world != 0) {
        return InvalidArgumentError(
            fmt::format("train_batch_size: {} is not divisible by world_size {}, so "
                        "train_micro_batch_size_per_gpu cannot be derived",
                        batch, world));
      }
      gas = 1;
      micro = batch / world;
    } else if (has_micro) {
      gas = 1;
      batch = micro * world;
    } else {
      return InvalidArgumentError(
          "train_batch_size: either train_batch_size or train_micro_batch_size_per_gpu must be "
          "given (DeepSpeed's rule)");
    }
    if (batch > static_cast<std::int64_t>(kMaxInt32)) {
      return InvalidArgumentError(
          fmt::format("train_batch_size: the derived value {} is out of range [1, {}]", batch,
                      static_cast<std::int64_t>(kMaxInt32)));
    }
    return OkStatus();
  }

  const ConfigContext& ctx_;
  TrainConfig config_;
  std::set<std::string, std::less<>> given_;  // every key (and section) the file sets
};

// The effective config as JSON, in schema order (see EffectiveConfigJson).
Json CanonicalJson(const TrainConfig& config_in) {
  TrainConfig config = config_in;  // the accessors take a mutable config
  const unsigned scheduler_bit = SchedulerBit(config.scheduler.type);
  Json root = Json::object();
  for (const KeySpec& spec : Schema()) {
    if (std::holds_alternative<std::monostate>(spec.field) || !spec.alias_of.empty()) continue;
    if (spec.scheduler_types != 0 && (spec.scheduler_types & scheduler_bit) == 0) continue;
    Json value;
    std::visit(
        [&](const auto& access) {
          using F = std::decay_t<decltype(access)>;
          if constexpr (std::is_same_v<F, std::monostate>) {
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
    std::string pointer;
    std::size_t start = 0;
    while (true) {
      const std::size_t dot = spec.path.find('.', start);
      pointer += "/";
      pointer += spec.path.substr(start, dot == std::string_view::npos ? dot : dot - start);
      if (dot == std::string_view::npos) break;
      start = dot + 1;
    }
    root[Json::json_pointer(pointer)] = std::move(value);
  }
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
        } else {
          return "integer";
        }
      },
      spec.field);
}

}  // namespace

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
std::string_view ModelNameName(ModelName name) {
  return kModelNames[static_cast<std::size_t>(name)];
}

Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const ConfigContext& ctx) {
  return Parser(ctx).Run(json_text);
}

Result<std::string> ReadConfigFile(const std::string& path) {
  // The path is the user's own: a link is followed, but a FIFO or device is refused, never read.
  return Annotate(storage::ReadSmallFile(path, kMaxConfigBytes, storage::Follow::kYes), "config: ");
}

Result<TrainConfig> LoadTrainConfig(const std::string& path, const ConfigContext& ctx) {
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadConfigFile(path));
  return Annotate(ParseTrainConfig(text, ctx), fmt::format("config {}: ", path));
}

std::string DescribeConfigKeys() {
  TrainConfig defaults;
  const Json canonical = CanonicalJson(defaults);
  std::string out =
      "zinf-train config keys (DeepSpeed names and defaults where DeepSpeed has the key; unknown "
      "keys are errors):\n";
  std::string rejected;
  for (const KeySpec& spec : Schema()) {
    if (!spec.unsupported.empty()) {
      rejected += fmt::format("  {}{}{}\n", spec.path, spec.description.empty() ? "" : ": ",
                              spec.description);
      continue;
    }
    std::string line = fmt::format("{} ({}", spec.path, TypeText(spec));
    if (!std::holds_alternative<std::monostate>(spec.field)) {
      std::string default_text(spec.default_text);
      if (default_text.empty()) {
        std::string pointer = "/" + std::string(spec.path);
        std::replace(pointer.begin(), pointer.end(), '.', '/');
        TrainConfig with_scheduler;  // scheduler params print under their own type
        with_scheduler.scheduler.type = SchedulerType::kWarmupCosineLR;
        if (spec.scheduler_types != 0 && (spec.scheduler_types & kWarmupCosineLRBit) == 0) {
          with_scheduler.scheduler.type = SchedulerType::kWarmupLR;
        }
        const Json source = spec.scheduler_types != 0 ? CanonicalJson(with_scheduler) : canonical;
        const Json::json_pointer ptr(pointer);
        default_text = source.contains(ptr) ? source.at(ptr).dump() : "none";
      }
      line += fmt::format(", default {}", default_text);
      if (spec.range.min != -kInf || spec.range.max != kInf) {
        line += fmt::format(", range {}", FormatRange(spec.range, IsIntegerKind(spec.field)));
      }
      if (spec.multiple_of != 0) line += fmt::format(", a multiple of {}", spec.multiple_of);
      if (spec.scheduler_types != 0 && spec.path != "scheduler.type") {
        std::vector<std::string_view> types;
        for (SchedulerType t : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR,
                                SchedulerType::kWarmupCosineLR}) {
          if ((spec.scheduler_types & SchedulerBit(t)) != 0) types.push_back(SchedulerTypeName(t));
        }
        line += fmt::format(", for {}", JoinQuoted(types, ""));
      }
    }
    out += line + ")\n    " + std::string(spec.description) + "\n";
  }
  out += "DeepSpeed keys zinf rejects (remove them):\n" + rejected;
  return out;
}

std::string EffectiveConfigJson(const TrainConfig& config) { return CanonicalJson(config).dump(2); }

std::uint64_t ConfigHash(const TrainConfig& config) {
  const std::string text = CanonicalJson(config).dump();
  return storage::Checksum64(std::as_bytes(std::span(text.data(), text.size())));
}

std::string EffectiveJobId(const TrainConfig& config) {
  if (!config.zinf.job_id.empty()) return config.zinf.job_id;
  // Only what identifies the job: a resumed run (other --steps, --resume, checkpoint cadence,
  // learning rate, ...) must find the store its killed predecessor left, to reclaim it.
  const Json canonical = CanonicalJson(config);
  auto value = [&](const char* pointer) {
    const Json::json_pointer at(pointer);
    return canonical.contains(at) ? canonical[at] : Json();
  };
  Json identity = Json::object();
  identity["checkpoint_dir"] = value("/zinf/checkpoint/dir");
  identity["model"] = value("/zinf/model");
  identity["data_path"] = value("/zinf/data/path");
  identity["seed"] = value("/zinf/seed");
  identity["world_size"] = config.world_size;
  const std::string text = identity.dump();
  // ChecksumToHex gives "0x" + 16 digits.
  return "cfg" + storage::ChecksumToHex(
                     storage::Checksum64(std::as_bytes(std::span(text.data(), text.size()))))
                     .substr(2, 12);
}

Status CheckSameConfigOnAllRanks(const comm::Communicator& comm, const TrainConfig& config) {
  const std::uint64_t mine = ConfigHash(config);
  std::vector<std::uint64_t> hashes(static_cast<std::size_t>(comm.size()));
  ZINF_RETURN_IF_ERROR(Annotate(
      comm.Allgather<std::uint64_t>(std::span<const std::uint64_t>(&mine, 1), std::span(hashes)),
      "config check: "));
  for (std::size_t r = 1; r < hashes.size(); ++r) {
    if (hashes[r] != hashes[0]) {
      return InvalidArgumentError(fmt::format(
          "rank {} loaded a different config (hash {}, rank 0 has {}): every rank must read the "
          "same file with the same world size",
          r, storage::ChecksumToHex(hashes[r]), storage::ChecksumToHex(hashes[0])));
    }
  }
  return OkStatus();
}

void LogEffectiveConfig(const TrainConfig& config) {
  ZINF_LOG_INFO("effective config (world size {}, job id {}, config hash {}):\n{}",
                config.world_size, EffectiveJobId(config),
                storage::ChecksumToHex(ConfigHash(config)), EffectiveConfigJson(config));
}

double LearningRate(const SchedulerConfig& s, double base_lr, std::int64_t iteration) {
  if (s.type == SchedulerType::kNone) return base_lr;
  if (iteration < 0) return 0.0;
  const auto i = static_cast<double>(iteration);
  const auto warmup = static_cast<double>(std::max<std::int64_t>(2, s.warmup_num_steps));
  const auto total = static_cast<double>(s.total_num_steps);
  auto warm = [&] {
    return s.warmup_type == WarmupType::kLog ? std::log(i + 1.0) / std::log(warmup) : i / warmup;
  };
  switch (s.type) {
    case SchedulerType::kNone:
      return base_lr;
    case SchedulerType::kWarmupLR: {
      const double gamma = i < warmup ? warm() : 1.0;
      return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
    }
    case SchedulerType::kWarmupDecayLR: {
      const double gamma =
          i < warmup ? warm() : std::max(0.0, (total - i) / std::max(1.0, total - warmup));
      return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
      double ratio = 0.0;
      if (i < warmup) {
        ratio = s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warm();
      } else {
        // DeepSpeed lets the cosine rise again after total_num_steps; zinf holds the floor.
        const double progress = std::min(1.0, (i - warmup + 1.0) / (total - warmup));
        const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
        ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
      }
      return base_lr * ratio;
    }
  }
  return base_lr;
}

storage::AioOptions ToAioOptions(const TrainConfig& config) {
  return storage::AioOptions{.block_size = config.aio.block_size,
                             .queue_depth = config.aio.queue_depth,
                             .intra_op_parallelism = config.aio.intra_op_parallelism,
                             .single_submit = config.aio.single_submit,
                             .overlap_events = config.aio.overlap_events};
}

swapper::AdamOptions ToAdamOptions(const TrainConfig& config) {
  const OptimizerConfig& o = config.optimizer;
  Result<bool> adamw = swapper::ResolveAdamWMode(OptimizerTypeName(o.type), o.adam_w_mode);
  ZINF_CHECK(adamw.has_value(), "optimizer type {} not known to ResolveAdamWMode",
             OptimizerTypeName(o.type));
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

partition::PlanKind ToPlanKind(const TrainConfig& config) {
  Result<partition::PlanKind> kind =
      partition::PlanKindForZeroStage(config.zero_optimization.stage);
  ZINF_CHECK(kind.has_value(), "zero stage {} passed validation", config.zero_optimization.stage);
  return *kind;
}

swapper::SwapperOptions ToSwapperOptions(const TrainConfig& config, int world_rank) {
  const OffloadOptimizerConfig& offload = config.zero_optimization.offload_optimizer;
  swapper::SwapperOptions options;
  options.store.paths = offload.resolved_nvme_paths;
  options.store.job_id = EffectiveJobId(config);
  options.store.world_rank = world_rank;
  options.store.keep = config.zinf.keep_swap;
  options.store.verify_swap = config.zinf.verify_swap;
  options.aio = ToAioOptions(config);
  options.engine = config.zinf.io_engine;
  options.sub_group_size = config.zero_optimization.sub_group_size;
  options.pinned_budget_bytes = config.zinf.pinned_budget_bytes;
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

}  // namespace zinf::train
