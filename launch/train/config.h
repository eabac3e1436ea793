// TrainConfig: the strict, DeepSpeed-style JSON configuration of zinf-train (DESIGN.md,
// "Configuration").
//
//   ZINF_ASSIGN_OR_RETURN(TrainConfig config,
//                         LoadTrainConfig(path, {.world_size = world.size(),
//                                                .local_rank = world.topology().local_rank,
//                                                .node = world.topology().node}));
//   ZINF_RETURN_IF_ERROR(CheckSameConfigOnAllRanks(world, config));  // collective
//   LogEffectiveConfig(config);                                       // rank 0 prints it
//   swapper::SwapperOptions options = ToSwapperOptions(config, world.rank());
//
// Keys. DeepSpeed's key names and defaults wherever DeepSpeed has the key: train_batch_size,
// train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping, steps_per_print,
// wall_clock_breakdown, bf16 {enabled}, optimizer {type, params {lr, betas, eps, weight_decay,
// adam_w_mode, amsgrad}}, scheduler {type, params}, zero_optimization {stage, sub_group_size,
// offload_optimizer {device, nvme_path, buffer_count, pin_memory, pipeline_read, pipeline_write,
// fast_init}}, aio {block_size, queue_depth, intra_op_parallelism (old name: thread_count),
// single_submit, overlap_events}, checkpoint {tag_validation, load_universal,
// use_node_local_storage}. What DeepSpeed lacks lives in the `zinf` section: pinned budget, io
// engine, verify_swap, keep_swap, job_id, checkpoint {dir, every, keep_last, load} (DeepSpeed's
// `checkpoint` block has no directory/interval keys, so zinf's are under zinf.checkpoint), model,
// data, seed, steps. The whole schema (path, type, default, range, description) is one table in
// config.cc; DescribeConfigKeys() prints it.
//
// Deliberate differences from DeepSpeed (each documented at its field):
//   - zero_optimization.stage defaults to 1 (DeepSpeed: 0); zinf always partitions the optimizer
//     state, so stage 0 is out of range.
//   - optimizer.type accepts only Adam and AdamW (case-insensitive, printed canonically).
//   - Unknown keys are errors, and well-known DeepSpeed keys zinf does not implement (fp16,
//     offload_param, overlap_comm, ...) are errors that say so, instead of being ignored.
//
// Strictness. Every error is InvalidArgument and starts with the key path:
//   "zero_optimization.sub_grop_size: unknown key; did you mean 'sub_group_size'?"
//   "optimizer.params.lr: expected a number, got string \"fast\""
//   "aio.queue_depth: 0 is out of range [1, 4096]"
//   "train_batch_size: 30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 *
//    world_size 4 = 32"
// JSON syntax errors carry nlohmann's line and column. Integer keys accept an integral float
// (DeepSpeed configs write "sub_group_size": 1e9).
//
// Thread safety: the functions are thread safe (the parser keeps no state); TrainConfig is a
// plain value.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "charlm.h"
#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/io_engine.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::train {

// What the parser needs to know about the process: the batch arithmetic uses world_size, the
// nvme_path placeholders {local_rank} and {node} use the other two.
struct ConfigContext {
  int world_size = 1;  // ranks in the job, >= 1
  int local_rank = 0;  // rank among the processes of this node, >= 0
  int node = 0;        // index of this node, >= 0
};

enum class OptimizerType { kAdam, kAdamW };
enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };
enum class OffloadDevice { kNone, kCpu, kNvme };
enum class TagValidation { kIgnore, kWarn, kFail };
enum class ModelName { kCharLM, kSynthetic };

// DeepSpeed's names: "Adam", "AdamW"; "WarmupLR", ... ("none" for kNone); "log", "linear";
// "none", "cpu", "nvme"; "Ignore", "Warn", "Fail"; zinf's "charlm", "synthetic". (Activation
// and ActivationName come from charlm.h.)
std::string_view OptimizerTypeName(OptimizerType type);
std::string_view SchedulerTypeName(SchedulerType type);
std::string_view WarmupTypeName(WarmupType type);
std::string_view OffloadDeviceName(OffloadDevice device);
std::string_view TagValidationName(TagValidation value);
std::string_view ModelNameName(ModelName name);

// optimizer {type, params {...}}. DeepSpeed's defaults.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;   // "Adam" | "AdamW", case-insensitive
  double lr = 1e-3;                            // >= 0; the base of every schedule
  std::array<double, 2> betas = {0.9, 0.999};  // each in [0, 1)
  double eps = 1e-8;                           // > 0
  double weight_decay = 0.0;                   // >= 0
  // DeepSpeed's Adam flag: true = decoupled weight decay (AdamW math). Ignored for AdamW.
  bool adam_w_mode = true;
  bool amsgrad = false;  // torch's amsgrad (max of exp_avg_sq in the denominator)
};

// scheduler {type, params}. No `scheduler` block: kNone, a constant learning rate (DeepSpeed).
// Each type takes only its own DeepSpeed params (others are errors):
//   WarmupLR:       warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type
//   WarmupDecayLR:  the WarmupLR params + total_num_steps (required)
//   WarmupCosineLR: total_num_steps (required), warmup_min_ratio, warmup_num_steps,
//                   cos_min_ratio, warmup_type
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;            // >= 0, absolute lr (WarmupLR, WarmupDecayLR)
  double warmup_max_lr = 1e-3;           // >= 0, absolute lr (WarmupLR, WarmupDecayLR)
  std::int64_t warmup_num_steps = 1000;  // >= 0; DeepSpeed uses max(2, warmup_num_steps)
  WarmupType warmup_type = WarmupType::kLog;
  std::int64_t total_num_steps = 0;  // >= 1 where required; 0 = not given
  double warmup_min_ratio = 0.0;     // [0, 1], fraction of optimizer lr (WarmupCosineLR)
  double cos_min_ratio = 1e-4;       // [0, 1], fraction of optimizer lr (WarmupCosineLR)
};

// zero_optimization.offload_optimizer. DeepSpeed's defaults.
struct OffloadOptimizerConfig {
  // "nvme": the swappers keep the state on NVMe. "cpu" / "none": the state stays in host memory;
  // recorded only, the trainer decides what to do with it.
  OffloadDevice device = OffloadDevice::kNone;
  // As written: one or more paths, possibly with {local_rank} / {node} placeholders. This form
  // is what EffectiveConfigJson prints and ConfigHash hashes (it is the same on every rank).
  // Required when device is nvme.
  std::vector<std::string> nvme_path;
  // nvme_path with the placeholders expanded for this process (ConfigContext). Not a key.
  std::vector<std::string> resolved_nvme_paths;
  std::int64_t buffer_count = 4;  // [1, 1024]; swap buffers of the largest sub-group
  bool pin_memory = false;        // mlock the buffer pool
  bool pipeline_read = false;     // either pipeline flag selects the pipelined swapper
  bool pipeline_write = false;
  bool fast_init = false;  // accepted for DeepSpeed compatibility; zinf's init is streamed anyway
};

// zero_optimization.
struct ZeroConfig {
  int stage = 1;  // [1, 3]; 1 and 2: flat partition plan, 3: per-parameter plan
  std::uint64_t sub_group_size = 1'000'000'000;  // elements per sub-group, >= 1 (DeepSpeed 1e9)
  OffloadOptimizerConfig offload_optimizer;
};

// aio: DeepSpeed's names and defaults (storage::AioOptions). `thread_count` is accepted as the old
// name of intra_op_parallelism (a WARN line says so); giving both is an error.
struct AioConfig {
  std::uint64_t block_size = 1'048'576;  // bytes, [512, 1 GiB], a multiple of 512
  int queue_depth = 8;                   // [1, 4096]
  int intra_op_parallelism = 1;          // [1, 64]
  bool single_submit = false;
  bool overlap_events = true;
};

// DeepSpeed's `checkpoint` block: accepted and recorded. zinf checkpoints are always universal
// (restore on any world size) and collective, so only tag_validation has a meaning (trainer).
struct DeepSpeedCheckpointConfig {
  TagValidation tag_validation = TagValidation::kWarn;
  bool load_universal = false;
  bool use_node_local_storage = false;
};

// zinf.checkpoint.
struct CheckpointConfig {
  std::string dir;             // where step-<N>.h5 files go; empty: no checkpoints
  std::int64_t every = 1000;   // steps between checkpoints, >= 1
  std::int64_t keep_last = 0;  // checkpoints kept (older ones removed), >= 0; 0 keeps all
  // "": start fresh; "latest": resume from <dir>/latest (an error if there is none); "auto":
  // resume from <dir>/latest when it exists, else start fresh; else a checkpoint file or
  // directory (ResolveCheckpointPath).
  std::string load;
};

// zinf.model.
struct ModelConfig {
  ModelName name = ModelName::kCharLM;
  int hidden = 256;                           // charlm: width of each hidden layer, [1, 1 << 20]
  int layers = 2;                             // charlm: hidden layers, [0, 1024]
  int context = 16;                           // charlm: bytes of context per example, [1, 4096]
  int embed_dim = 16;                         // charlm: embedding width, [1, 65536]
  Activation activation = Activation::kTanh;  // charlm (charlm.h)
  std::uint64_t total_params = 1 << 20;       // synthetic: parameters in all, [1, 2^40]
  int num_params = 4;  // synthetic: parameter tensors the total is split into, [1, 1 << 20]
};

// zinf: what DeepSpeed does not have.
struct ZinfConfig {
  // Host memory for swap buffers, bytes (an integer or a size string "2G", "512MiB"); 0: the
  // pool holds offload_optimizer.buffer_count buffers of the largest sub-group.
  std::uint64_t pinned_budget_bytes = 0;
  storage::EngineKind io_engine = storage::EngineKind::kAuto;  // ZINF_IO_ENGINE overrides it
  bool verify_swap = false;     // checksum every swapped stripe unit, check it on read
  bool keep_swap = false;       // keep the swap store at exit
  bool swap_gradients = false;  // accumulate partition gradients through the gradient swapper
  int adam_threads = 0;         // CpuAdam threads per rank; 0 = hardware concurrency; [0, 1024]
  int compute_threads = 0;      // BLAS threads per rank; 0 = cores / local ranks; [0, 1024]
  // Keys the swap store directory; [A-Za-z0-9_.-]+. Empty: derived (EffectiveJobId).
  std::string job_id;
  CheckpointConfig checkpoint;
  ModelConfig model;
  std::string data_path;     // zinf.data.path: a text file or directory; empty: built-in
  std::int64_t seed = 1234;  // initialization and data seed, >= 0
  std::int64_t steps = 100;  // optimizer steps to run, >= 1
};

struct TrainConfig {
  // DeepSpeed's batch keys, all three filled in by ParseTrainConfig (DeepSpeed's rule).
  std::int64_t train_batch_size = 0;
  std::int64_t train_micro_batch_size_per_gpu = 0;
  std::int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  // max global gradient norm, >= 0; 0 = off
  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool bf16 = false;  // bf16.enabled: working weights in bf16 (SwapperOptions::bf16_params)
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero_optimization;
  AioConfig aio;
  DeepSpeedCheckpointConfig checkpoint;
  ZinfConfig zinf;
  // The world size the batch arithmetic was checked against (ConfigContext). Not a key.
  int world_size = 1;
};

// Parses `json_text` against the schema, fills defaults, expands placeholders and checks the
// cross-key rules:
//   - batch sizes, DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu *
//     gradient_accumulation_steps * world_size: any two given determine the third (which must
//     divide exactly); only train_batch_size: gas 1, micro = batch / world; only the micro
//     batch: gas 1; all three must agree; neither train_batch_size nor the micro batch: error.
//   - offload_optimizer.device "nvme" needs nvme_path; a WarmupDecayLR / WarmupCosineLR
//     scheduler needs total_num_steps (WarmupCosineLR: more than max(2, warmup_num_steps)).
// Logs a WARN line (every rank) for `aio.thread_count` and for questionable but valid values.
// Errors: InvalidArgument whose message starts with the key path (see the top of the file).
Result<TrainConfig> ParseTrainConfig(std::string_view json_text, const ConfigContext& ctx);

// The text of the config file at `path` (at most 16 MiB). Errors: NotFound (no such file),
// FailedPrecondition (not a regular file), other errno codes (unreadable), InvalidArgument (too
// large), each naming the path.
Result<std::string> ReadConfigFile(const std::string& path);

// Reads the file at `path` and parses it; error messages are prefixed with "config <path>: ".
// Errors: NotFound (no such file), FailedPrecondition/other errno codes (unreadable),
// InvalidArgument (as ParseTrainConfig).
Result<TrainConfig> LoadTrainConfig(const std::string& path, const ConfigContext& ctx);

// Every key, one entry per key in schema order: path, type, default, range or choices and a
// description. For --help.
std::string DescribeConfigKeys();

// The whole effective configuration as pretty JSON (2-space indent): every key of the schema
// in schema order with its value (defaults filled, canonical spellings, nvme_path as written,
// scheduler params only of the chosen type, no `scheduler` block when there is none; old names
// such as thread_count never appear). Parsing it again with the same world_size gives the same
// config.
std::string EffectiveConfigJson(const TrainConfig& config);

// XXH3-64 of the compact canonical JSON (the same content as EffectiveConfigJson). Equal on
// every rank that loaded the same file with the same world_size, whatever its local rank/node.
std::uint64_t ConfigHash(const TrainConfig& config);

// zinf.job_id, or when it is empty "cfg" + 12 hex digits of an XXH3-64 of only what identifies
// the job: zinf.checkpoint.dir, the zinf.model section, zinf.data.path, zinf.seed and the world
// size. Everything else (zinf.steps, zinf.checkpoint.load/every/keep_last, the optimizer and
// scheduler, ...) leaves it unchanged, so a resumed or re-run job finds the swap store a killed
// run of it left behind and reclaims it. The same on every rank. Two concurrent runs of the same
// job on the same nvme_path need distinct explicit job_ids (the second one's swap store reports
// that the directory is in use).
std::string EffectiveJobId(const TrainConfig& config);

// Collective over `comm`: checks that every rank loaded the same config (ConfigHash). Every rank
// returns the same status: OK, or InvalidArgument "rank <r> loaded a different config (hash ...,
// rank 0 has ...)" naming the lowest rank whose hash differs from rank 0's; MPI failures as the
// communicator reports them.
Status CheckSameConfigOnAllRanks(const comm::Communicator& comm, const TrainConfig& config);

// Logs "effective config:\n<EffectiveConfigJson>" and the job id as INFO (printed by rank 0).
void LogEffectiveConfig(const TrainConfig& config);

// DeepSpeed's learning-rate schedules, deepspeed/runtime/lr_schedules.py. `iteration` is the
// scheduler's last_batch_iteration: the number of scheduler steps taken before this optimizer
// step (the trainer passes step - 1 for its 1-based step). With w = max(2, warmup_num_steps),
// i = iteration, warm(i) = log(i + 1) / log(w) ("log") or i / w ("linear"):
//   kNone:           base_lr
//   WarmupLR:        min + (max - min) * (i < w ? warm(i) : 1)                (absolute lrs)
//   WarmupDecayLR:   min + (max - min) * (i < w ? warm(i)
//                                         : max(0, (T - i) / max(1, T - w)))  (T = total)
//   WarmupCosineLR:  base_lr * ratio, r0 = warmup_min_ratio, c = cos_min_ratio,
//                    ratio = i < w ? r0 + (1 - r0) * warm(i)
//                                  : max(0, c + (1 - c) * (1 + cos(pi * p)) / 2),
//                    p = min(1, (i - w + 1) / (T - w))
// A negative iteration gives 0 (DeepSpeed's value before the first scheduler step). One
// difference: past total_num_steps DeepSpeed's cosine rises again (its progress exceeds 1);
// zinf holds the floor c (the min(1, ...) above).
double LearningRate(const SchedulerConfig& scheduler, double base_lr, std::int64_t iteration);

// Conversions for the trainer.
storage::AioOptions ToAioOptions(const TrainConfig& config);
// Adam hyper-parameters; adamw from swapper::ResolveAdamWMode(type, adam_w_mode); threads from
// zinf.adam_threads.
swapper::AdamOptions ToAdamOptions(const TrainConfig& config);
// ZeRO stage 1/2 -> kFlat, 3 -> kPerParam.
partition::PlanKind ToPlanKind(const TrainConfig& config);
// Everything the optimizer swapper takes from the config: store (resolved nvme paths,
// EffectiveJobId, world_rank, keep_swap, verify_swap), aio, engine, sub_group_size, pool
// (pinned_budget_bytes, buffer_count, pin_memory), pipeline flags, Adam, bf16,
// swap_gradients and gradient_accumulation_steps. Meaningful for device nvme (the store paths
// are empty otherwise).
swapper::SwapperOptions ToSwapperOptions(const TrainConfig& config, int world_rank);

}  // namespace zinf::train
