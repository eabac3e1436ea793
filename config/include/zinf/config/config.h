// Config: the strict, DeepSpeed-style JSON configuration of the zinf engine (docs/DESIGN.md,
// "Configuration").
//
//   ZINF_ASSIGN_OR_RETURN(zinf::config::Config config,
//                         zinf::config::LoadConfig(world, "ds.json"));   // collective
//   LogEffectiveConfig(config);                                          // rank 0 prints it
//
// Keys. Every key of DeepSpeed's documented config is one of three kinds, listed with its reason
// in docs/deepspeed-keys.md (generated from the schema by DeepSpeedKeyTable(), so the two cannot
// drift):
//   - implemented, with DeepSpeed's name, default and semantics: the batch keys,
//     gradient_clipping, steps_per_print, wall_clock_breakdown, fp16 (loss scaling), bf16,
//     optimizer (Adam, AdamW), scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
//     LRRangeTest), zero_optimization {stage, sub_group_size, reduce_bucket_size,
//     allgather_bucket_size, offload_optimizer {device, nvme_path, buffer_count, pin_memory,
//     pipeline_read, pipeline_write}, offload_param {device, nvme_path, buffer_count,
//     buffer_size, max_in_cpu}, stage3_prefetch_bucket_size,
//     stage3_max_live_parameters, stage3_max_reuse_distance, stage3_param_persistence_threshold,
//     stage3_model_persistence_threshold}, aio;
//   - accepted with no effect in zinf (GPU performance hints such as overlap_comm, monitors,
//     profilers): any value, named in one INFO line "ignored, no effect in zinf: ..." and kept
//     in Config::ignored_keys;
//   - refused with an error that says what zinf does instead (amp, zero_quantized_weights,
//     ...); many are refused only for values that ask for something (e.g. "amp": {"enabled":
//     false} is accepted with no effect).
// What DeepSpeed lacks lives in the `zinf` section: pinned budget, I/O backend, optimizer_state,
// verify_swap, keep_swap, nvme_path_weights, swap_gradients, adam_threads, job_id, checkpoint
// {dir, every, keep_last, load}. An application adds its own keys (AppKey: zinf-train's model,
// data, seed and steps). The whole schema (path, kind, type, default, range, description) is one
// table in config/src/schema.cc; DescribeConfigKeys() prints it for --help.
//
// Deliberate differences from DeepSpeed (each documented at its field):
//   - zero_optimization.stage defaults to 1 (DeepSpeed: 0); zinf always partitions the optimizer
//     state, so stage 0 is out of range.
//   - optimizer.type accepts only Adam and AdamW (case-insensitive, printed canonically).
//   - Unknown keys are errors (with the nearest valid key), and so is "auto", the Hugging Face
//     Trainer's placeholder, for every implemented key but those that list it as a value
//     (zinf.io_engine, zinf.checkpoint.load).
//   - One spelling per setting: a key containing '.' is an error naming the nested form, and
//     choices are exact ("q8", not "Q8"; optimizer.type excepted, as in DeepSpeed).
//
// Strictness. Every error is InvalidArgument and starts with the key path:
//   "zero_optimization.sub_grop_size: unknown key; did you mean 'sub_group_size'?"
//   "optimizer.params.lr: expected a number, got string \"fast\""
//   "aio.queue_depth: 0 is out of range [1, 4096]" (an integer's range is the values accepted:
//    "[1, 9223372036854775807]" where the key has no upper limit of its own)
//   "train_batch_size: 30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 *
//    world_size 4 = 32"
// JSON syntax errors carry nlohmann's line and column; the text is parsed bounded (ParseJson: at
// most 16 MiB, 32 levels, a key given twice is an error). Integer keys accept an integral float
// (DeepSpeed configs write "sub_group_size": 1e9).
//
// Thread safety: the functions are thread safe (the parser keeps no state); Config is a plain
// value.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"
#include "zinf/partition/layout.h"
#include "zinf/partition/sub_group.h"
#include "zinf/storage/io_backend.h"
#include "zinf/swapper/q8.h"

namespace zinf::config {

// What the parser needs to know about the process: the batch arithmetic uses world_size, the
// nvme_path placeholders {local_rank} and {node} use the other two.
struct ConfigContext {
  int world_size = 1;  // ranks in the job, >= 1
  int local_rank = 0;  // rank among the processes of this node, >= 0
  int node = 0;        // index of this node, >= 0
};

enum class OptimizerType { kAdam, kAdamW };
enum class SchedulerType {
  kNone,
  kWarmupLR,
  kWarmupDecayLR,
  kWarmupCosineLR,
  kOneCycle,
  kLRRangeTest
};
enum class WarmupType { kLog, kLinear };
enum class OffloadDevice { kNone, kCpu, kNvme };

// DeepSpeed's names: "Adam", "AdamW"; "WarmupLR", ... ("none" for kNone);
// "none", "cpu", "nvme".
std::string_view OptimizerTypeName(OptimizerType type);
std::string_view SchedulerTypeName(SchedulerType type);
std::string_view OffloadDeviceName(OffloadDevice device);

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
//   OneCycle:       cycle_min_lr, cycle_max_lr (both required), decay_lr_rate,
//                   cycle_first_step_size, cycle_second_step_size, decay_step_size,
//                   cycle_momentum, cycle_min_mom, cycle_max_mom, decay_mom_rate (the stair
//                   counts only at 0: zinf's cycle is continuous)
//   LRRangeTest:    lr_range_test_min_lr, lr_range_test_step_size, lr_range_test_step_rate,
//                   lr_range_test_staircase
// Every type also takes last_batch_iteration, DeepSpeed's resume position: only its default -1
// (zinf resumes a schedule from the checkpoint's step).
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;   // >= 0, absolute lr (WarmupLR, WarmupDecayLR)
  double warmup_max_lr = 1e-3;  // >= 0, absolute lr (WarmupLR, WarmupDecayLR)
  // warmup_max_lr not given: each parameter group warms up to its own lr (DeepSpeed >= 0.17.2),
  // and warmup_max_lr holds optimizer.params.lr (the effective config shows that value).
  bool warmup_to_group_lr = false;
  std::int64_t warmup_num_steps = 1000;  // >= 0; DeepSpeed uses max(2, warmup_num_steps)
  WarmupType warmup_type = WarmupType::kLog;
  std::int64_t total_num_steps = 0;  // >= 1 where required; 0 = not given
  double warmup_min_ratio = 0.0;     // [0, 1], fraction of optimizer lr (WarmupCosineLR)
  double cos_min_ratio = 1e-4;       // [0, 1], fraction of optimizer lr (WarmupCosineLR)
  // OneCycle (DeepSpeed's defaults; cycle_min_lr and cycle_max_lr are required).
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000;  // >= 1
  double cycle_second_step_size = 0;    // 0: not given, = cycle_first_step_size
  double decay_step_size = 0;           // 0: no decay after the cycle
  bool cycle_momentum = true;           // beta1 cycles (and beta2 becomes 0.99)
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest.
  double lr_range_test_min_lr = 1e-3;
  double lr_range_test_step_size = 2000;  // > 0
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
  std::int64_t last_batch_iteration = -1;  // only -1
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
};

// zero_optimization.offload_param: where a rank keeps its shard of the partitioned working
// weights. DeepSpeed's names and defaults. It matters only at stage 3 and only for the parameters
// the loop registers without weights (engine.h, "Stage 3"), which are partitioned; elsewhere it is
// recorded and has no effect.
struct OffloadParamConfig {
  // "none" / "cpu": each rank keeps its shard in host memory (zinf has no GPU copy, so the two
  // are the same). "nvme": the shard is not kept: a gather reads it from the fp32 master weights
  // in the optimizer's swap store, which the step has just written (no second copy of the
  // parameters on disk), except the shards kept in memory under max_in_cpu. Needs stage 3 and
  // offload_optimizer.device "nvme".
  OffloadDevice device = OffloadDevice::kNone;
  // As written (a string or a list, like offload_optimizer.nvme_path); optional, since the shards
  // live in the optimizer's store. With device nvme each entry must be one of
  // offload_optimizer.nvme_path as written; with another device it is accepted and unused.
  std::vector<std::string> nvme_path;
  // [1, 1024]. With device nvme: at most this many parameters are read from NVMe ahead of their
  // use (prefetch; stage3_prefetch_bucket_size bounds the elements).
  std::int64_t buffer_count = 5;
  // Elements, >= 1. With device nvme: the largest shard read from NVMe (ZeroEngine::Create
  // refuses a partitioned parameter whose shard is larger).
  std::uint64_t buffer_size = 100'000'000;
  // Elements, >= 0. With device nvme: shards (in registration order) whose elements fit in this
  // many in all stay in host memory and are gathered without reading NVMe.
  std::uint64_t max_in_cpu = 1'000'000'000;
  // (pin_memory is an ignored key: zinf reads the shards through the optimizer's buffer pool,
  // which offload_optimizer.pin_memory pins.)
};

// zero_optimization.
struct ZeroConfig {
  int stage = 1;  // [1, 3]; 1 and 2: flat partition plan, 3: per-parameter plan
  std::uint64_t sub_group_size = partition::kDefaultSubGroupSize;  // elements per sub-group, >= 1
  // Elements per gradient bucket, >= 1 (DeepSpeed 5e8): ZeroEngine reduces the gradient bucket
  // by bucket (whole parameters, at least this many elements each but the last).
  std::uint64_t reduce_bucket_size = 500'000'000;
  // Elements per all-gather round, >= 1 (DeepSpeed 5e8): ZeroEngine gathers the updated
  // partitions into the parameters in rounds of at most this many elements (all ranks).
  std::uint64_t allgather_bucket_size = 500'000'000;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  // Stage 3 (engine.h, "Stage 3"): DeepSpeed's names and defaults, in elements, for the
  // partitioned parameters (those registered without weights); recorded and unused at stages 1
  // and 2. ZeroEngine::Gather records the order of a step's gathers; while the next step repeats
  // it, the engine gathers the parameters that follow ahead of their use, up to this many
  // elements (0: no prefetch).
  std::uint64_t stage3_prefetch_bucket_size = 50'000'000;
  // Prefetching and keeping released parameters gathered never bring the elements gathered at
  // once beyond this.
  std::uint64_t stage3_max_live_parameters = 1'000'000'000;
  // A released parameter stays gathered when the recorded order uses it again within this many
  // elements of gathers (0: released at once).
  std::uint64_t stage3_max_reuse_distance = 1'000'000'000;
  // Parameters of at most this many elements are not partitioned: they stay whole on every rank
  // (their Gather moves nothing; Step gathers their new values as at stages 1 and 2). 0: none.
  std::uint64_t stage3_param_persistence_threshold = 100'000;
  // The elements of all such whole parameters together, in registration order: once the next
  // one would exceed this, the rest are partitioned. Default: no limit (DeepSpeed's sys.maxsize).
  std::uint64_t stage3_model_persistence_threshold = 0x7fff'ffff'ffff'ffff;
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

// fp16: DeepSpeed's fp16 mixed precision with loss scaling (loss_scaler.h). The working weights
// are rounded to fp16 values while the master weights stay fp32 in the swap store; the loop
// computes the gradient of its loss times ZeroEngine::loss_scale(); a step whose gradient holds
// an Inf or NaN on any rank is skipped (no swap I/O) and the scale adjusted. DeepSpeed's defaults.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;                // > 0: that static scale; 0: dynamic
  int initial_scale_power = 16;           // dynamic: the first scale is 2^this; [0, 64]
  std::int64_t loss_scale_window = 1000;  // dynamic: clean steps before the scale doubles, >= 1
  int hysteresis = 2;                     // dynamic: overflows before the scale halves, >= 1
  bool consecutive_hysteresis = false;    // dynamic: a clean step refills the hysteresis
  double min_loss_scale = 1.0;            // dynamic: the scale's floor, > 0
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

// zinf.nvme_path_weights: each nvme_path's share of the swap store's stripe units.
struct PathWeightsConfig {
  bool probe = false;  // "probe": measured by the swap store at open (SwapStoreOptions)
  // Else one positive finite number per nvme_path (relative bandwidths); empty: equal shares.
  std::vector<double> weights;
};

// zinf.host_memory_budget: the host memory of a node that the engine's memory plan is held
// against (docs/configs.md, "Memory plan"), shared by the node's ranks. Both 0 ("auto"): the
// detected budget (the memory cgroup's limit, else MemAvailable).
struct HostMemoryBudgetConfig {
  std::uint64_t bytes = 0;  // > 0: this many bytes per node ("8G")
  double fraction = 0;      // in (0, 1]: this share of the detected budget
};

// zinf: what DeepSpeed does not have.
struct ZinfConfig {
  // Host memory for swap buffers, bytes (an integer or a size string "2G", "512MiB"); 0: the
  // pool holds offload_optimizer.buffer_count buffers of the largest sub-group.
  std::uint64_t pinned_budget_bytes = 0;
  // Host memory tier, bytes per rank (an integer or a size string): the first sub-groups whose
  // whole state fits stay in host memory and are stepped without I/O; 0: every sub-group is
  // swapped. Unused with offload_optimizer.device "cpu" (everything is in memory).
  std::uint64_t host_cache_bytes = 0;
  HostMemoryBudgetConfig host_memory_budget;  // the memory plan's budget; default: detected
  storage::IoBackendKind io_engine = storage::IoBackendKind::kAuto;  // ZINF_IO_ENGINE overrides it
  // The swapped Adam state: "fp32", or "q8" (8-bit block-wise quantized moments, q8.h).
  swapper::StateFormat optimizer_state = swapper::StateFormat::kFp32;
  bool verify_swap = false;     // checksum every swapped stripe unit, check it on read
  bool keep_swap = false;       // keep the swap store at exit
  bool swap_gradients = false;  // accumulate partition gradients through the gradient swapper
  // Step each swapped sub-group during the backward pass once its gradient is final, and commit
  // it in Step unless clipping or a skip says otherwise (engine.h, "Speculative step"). Unset:
  // on where the gradients are lent (stages 2 and 3 without grads buffers); Config::Gave says
  // whether it was set. ZeroEngine::config() holds what the engine does.
  bool speculative_step = true;
  int adam_threads = 0;  // CpuAdam threads per rank; 0 = hardware concurrency; [0, 1024]
  // Seconds a rank waits in one of zinf's collectives for the other ranks before it ends the
  // job with an error naming the collective; [1, 604800].
  std::int64_t collective_timeout_seconds = 600;
  // Each nvme_path's share of the swap I/O by bandwidth; default: equal shares.
  PathWeightsConfig nvme_path_weights;
  // Keys the swap store directory; [A-Za-z0-9_.-]+. Empty: derived (EffectiveJobId).
  std::string job_id;
  CheckpointConfig checkpoint;
};

struct Config {
  // DeepSpeed's batch keys, all three filled in by ParseConfig (DeepSpeed's rule).
  std::int64_t train_batch_size = 0;
  std::int64_t train_micro_batch_size_per_gpu = 0;
  std::int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  // max global gradient norm, >= 0; 0 = off
  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool bf16 = false;  // bf16.enabled: working weights in bf16 (SwapperOptions::bf16_params)
  Fp16Config fp16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero_optimization;
  AioConfig aio;
  ZinfConfig zinf;
  // The values of the application's own keys (AppKey), at their paths, defaults filled:
  // {"zinf": {"model": {"hidden": 256, ...}}}. Empty without application keys.
  nlohmann::ordered_json app;
  // The world size the batch arithmetic was checked against (ConfigContext). Not a key.
  int world_size = 1;
  // The DeepSpeed keys the file gave that have no effect in zinf, sorted (the INFO line
  // "ignored, no effect in zinf: ..."). Not a key, not part of ConfigHash.
  std::vector<std::string> ignored_keys;
  // Every key and section the file gave, by its current name, sorted. The engine sizes the
  // host-memory keys a file left unset to fit the memory plan (docs/configs.md, "Memory plan");
  // a key given is kept as given. Not a key, not part of ConfigHash.
  std::vector<std::string> given_keys;

  // Whether the file gave `path` ("zero_optimization.sub_group_size").
  bool Gave(std::string_view path) const;
};

// A key an application adds to the schema for its own settings (zinf-train adds its model and
// data under zinf.model and zinf.data). It is validated like the engine's keys (type, range,
// choices, unknown siblings with a suggestion, one spelling) and its value, or its default,
// lands in Config::app at its path. Sections on the way are created; a path may not be one of
// the engine's keys.
enum class AppKeyType { kSection, kBool, kInteger, kNumber, kString, kChoice };
struct AppKey {
  std::string path;  // "zinf.model.hidden"; a kSection only describes "zinf.model" for --help
  AppKeyType type = AppKeyType::kInteger;
  nlohmann::ordered_json default_value = nullptr;  // of its type (a choice: one of `choices`)
  std::string description = {};
  double min = -std::numeric_limits<double>::infinity();  // numbers: the range, inclusive
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices = {};  // kChoice: the accepted spellings (exact)
};

// Parses `json_text` against the schema, fills defaults, expands placeholders and checks the
// cross-key rules:
//   - batch sizes, DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu *
//     gradient_accumulation_steps * world_size: any two given determine the third (which must
//     divide exactly); only train_batch_size: gas 1, micro = batch / world; only the micro
//     batch: gas 1; all three must agree; neither train_batch_size nor the micro batch: error.
//   - offload_optimizer.device "nvme" needs nvme_path; a WarmupDecayLR / WarmupCosineLR
//     scheduler needs total_num_steps (WarmupCosineLR: more than max(2, warmup_num_steps)).
//   - offload_param.device "nvme" needs zero_optimization.stage 3 and offload_optimizer.device
//     "nvme", and each of its nvme_path entries must be one of offload_optimizer.nvme_path (as
//     written).
//   - zinf.job_id: at most 200 characters of [A-Za-z0-9_.-], no ".."; no string value holds a
//     NUL byte; with offload_optimizer.device "nvme", zinf.pinned_budget_bytes is 0 or holds the
//     swap buffers of a step of the smallest sub-group (4 buffers of 4 KiB for fp32 state, 3 for
//     q8).
// Logs a WARN line (every rank) for `aio.thread_count` and for questionable but valid values,
// and one INFO line naming the keys accepted with no effect (Config::ignored_keys).
// Errors: InvalidArgument whose message starts with the key path (see the top of the file).
// `app_keys` must outlive the call.
Result<Config> ParseConfig(std::string_view json_text, const ConfigContext& ctx,
                           std::span<const AppKey> app_keys = {});

// What ZeroEngine::Create refuses of a parsed config by itself, before it looks at the parameters
// or the world: offload_optimizer.device "none" (DeepSpeed's default, which ParseConfig accepts
// so that every DeepSpeed config loads; zinf steps the optimizer on the CPU: "cpu" or "nvme").
// ZeroEngine::Create calls it, and so does a program that checks a config without running it
// (zinf-train --check-config), so that both refuse the same configs with the same error.
// Errors: InvalidArgument starting with the key path.
Status CheckEngineConfig(const Config& config);

// The text of the config file at `path` (at most 16 MiB). Errors: NotFound (no such file),
// FailedPrecondition (not a regular file), other errno codes (unreadable), InvalidArgument (too
// large), each naming the path.
Result<std::string> ReadConfigFile(const std::string& path);

// Reads the file at `path` and parses it; error messages are prefixed with "config <path>: ".
// Errors: NotFound (no such file), FailedPrecondition/other errno codes (unreadable),
// InvalidArgument (as ParseConfig).
Result<Config> LoadConfigFile(const std::string& path, const ConfigContext& ctx,
                              std::span<const AppKey> app_keys = {});

// Collective over `world`: reads and parses `path` on every rank (with the rank's own
// ConfigContext from the world's topology), then checks that every rank holds the same config
// (CheckSameConfigOnAllRanks). The same Status on every rank.
Result<Config> LoadConfig(const comm::Communicator& world, const std::string& path,
                          std::span<const AppKey> app_keys = {});

// LoadConfig for config text the program holds (e.g. a Python dict as JSON): parses
// `json_text` on every rank, error messages prefixed with "config <source>: ", then the same
// agreement and same-config check.
Result<Config> LoadConfigText(const comm::Communicator& world, std::string_view json_text,
                              std::string_view source, std::span<const AppKey> app_keys = {});

// The ConfigContext of this process in `world`.
ConfigContext ContextOf(const comm::Communicator& world);

// Every key, one entry per key in schema order (the application's keys after the engine's):
// path, type, default, range or choices and a description. For --help.
std::string DescribeConfigKeys(std::span<const AppKey> app_keys = {});

// docs/deepspeed-keys.md: every key of the schema as a Markdown table (key, kind, type
// and default, what zinf does), the DeepSpeed keys first. `zinf-train --print-key-table` prints
// it, and a test checks that the docs file is this text.
std::string DeepSpeedKeyTable();

// The whole effective configuration as pretty JSON (2-space indent): every key of the schema
// in schema order with its value (defaults filled, canonical spellings, nvme_path as written,
// scheduler params only of the chosen type, no `scheduler` block when there is none; old names
// such as thread_count never appear; the application's values after the engine's). Parsing it
// again with the same world_size and application keys gives the same config.
std::string EffectiveConfigJson(const Config& config);

// XXH3-64 of the compact canonical JSON (the same content as EffectiveConfigJson). Equal on
// every rank that loaded the same file with the same world_size, whatever its local rank/node.
std::uint64_t ConfigHash(const Config& config);

// zinf.job_id, or when it is empty "cfg" + 12 hex digits of an XXH3-64 of only what identifies
// the job: zinf.checkpoint.dir, the parameter layout (names and shapes) and the world size.
// Everything else (the steps a loop runs, zinf.checkpoint.load/every/keep_last, the optimizer
// and scheduler, ...) leaves it unchanged, so a resumed or re-run job finds the swap store a
// killed run of it left behind and reclaims it. The same on every rank. Two concurrent runs of
// the same job on the same nvme_path need distinct explicit job_ids (the second one's swap
// store reports that the directory is in use).
std::string EffectiveJobId(const Config& config, const partition::ParamLayout& layout);

// Collective over `comm`: checks that every rank loaded the same config (ConfigHash). Every rank
// returns the same status: OK, or InvalidArgument "rank <r> loaded a different config (hash ...,
// rank 0 has ...)" naming the lowest rank whose hash differs from rank 0's; MPI failures as the
// communicator reports them.
Status CheckSameConfigOnAllRanks(const comm::Communicator& comm, const Config& config);

// Collective over `comm`: the agreement of LoadConfig for a config each rank parsed itself (a
// Config, or an application's config derived from it): every rank's parse result agreed on
// (one rank's error is every rank's), then CheckSameConfigOnAllRanks.
template <typename C>
Result<C> AgreeOnConfig(const comm::Communicator& comm, Result<C> parsed) {
  ZINF_RETURN_IF_ERROR(
      comm.AgreeOnStatus(parsed.has_value() ? OkStatus() : Status(parsed.error())));
  ZINF_RETURN_IF_ERROR(CheckSameConfigOnAllRanks(comm, *parsed));
  return parsed;
}

// Logs "effective config:\n<EffectiveConfigJson>" as INFO (printed by rank 0). The engine logs the
// job id (EffectiveJobId) when it creates the swap store.
void LogEffectiveConfig(const Config& config);

}  // namespace zinf::config
