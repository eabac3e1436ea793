// ZeroEngine: the ZeRO training step a user's own training loop drives (docs/library.md). The
// user owns the model: its parameters' working weights and gradients live in the user's buffers,
// replicated on every rank, and registered by name and shape. The engine owns the optimizer:
// each rank's ZeRO partition of the Adam state (fp32 master weights, exp_avg, exp_avg_sq) is
// kept on node-local NVMe and swapped through a bounded pool around every step.
//
//   auto session = zinf::comm::MpiSession::Init(&argc, &argv);        // or adopt the host's MPI
//   const zinf::comm::Communicator& world = session->world();
//   ZINF_ASSIGN_OR_RETURN(zinf::config::Config config,
//                         zinf::config::LoadConfig(world, "ds.json"));  // collective
//   std::vector<zinf::engine::Param> params = {
//       {"fc1.weight", {512, 256}, w1, g1},  // std::span<float>: weights, gradients
//       {"fc1.bias", {512}, b1, gb1}};
//   ZINF_ASSIGN_OR_RETURN(auto engine, zinf::engine::ZeroEngine::Create(world, config, params));
//   while (engine->step_count() < 1000) {
//     double loss = ForwardBackward(batch);   // writes (or accumulates) g1, gb1, ...
//     ZINF_ASSIGN_OR_RETURN(zinf::engine::StepInfo info, engine->Step(loss));
//     if (info.step % 100 == 0) ZINF_RETURN_IF_ERROR(engine->SaveCheckpoint({{"epoch", e}}));
//     if (info.stop_requested) break;         // SIGUSR1/SIGTERM on some rank
//   }
//   ZINF_RETURN_IF_ERROR(engine->Close());
//
// One Step (collective), on every rank, for the gradients the user accumulated since the last
// Step into the registered `grads` buffers (the gradient of the rank's mean loss, summed over the
// micro-batches it ran):
//   1. the gradient is reduce-scattered (comm::CollectiveBackend) in buckets of whole parameters
//      (zero_optimization.reduce_bucket_size elements; those handed by GradientReady during the
//      backward pass already are): each rank gets the sum of its partition; with
//      zinf.swap_gradients each sub-group goes to the gradient swapper once complete;
//   2. the global gradient norm is computed (one allreduce), the gradient is averaged over
//      gradient_accumulation_steps x ranks and clipped to gradient_clipping;
//   3. the swapped Adam/AdamW step runs over the rank's sub-groups at the scheduler's learning
//      rate (optimizer_swapper.h: crash-consistent per sub-group);
//   4. the updated partitions are all-gathered into every parameter's `weights` (rounded to bf16
//      values with bf16.enabled) in rounds of zero_optimization.allgather_bucket_size elements,
//      and every `grads` buffer is zeroed for the next step. Step 3 writes each rank's new values
//      into its own part of `weights` and step 4 gathers them from there: the engine keeps no
//      copy of the model.
// Gradient accumulation: the user may sum the micro-batches in `grads` and call Step once, or
// call AccumulateGradients() after each micro-batch but the last (required with
// zinf.swap_gradients, so each micro-batch is reduced and written behind during the next one's
// backward). Either way a step stands for gradient_accumulation_steps micro-batches per rank
// (DeepSpeed's batch rule): AccumulateGradients() may be called gradient_accumulation_steps - 1
// times per step, or not at all.
//
// Stage 3 (zero_optimization.stage 3): a parameter registered without weights is partitioned:
// each rank keeps only its shard of the working weights (1/N of the parameter,
// partition/plan.h kPerParam) — in host memory, or with zero_optimization.offload_param.device
// nvme read from the fp32 master weights in the swap store, which the step has just written (no
// second copy) — and the whole weights exist only while the loop uses them:
//   std::vector<zinf::engine::Param> params = {
//       {.name = "fc1.weight", .shape = {512, 256}, .init = FillRandom},  // no buffers: lent
//       {.name = "fc1.bias", .shape = {512}, .init = FillZero}};
//   ...
//   {
//     ZINF_ASSIGN_OR_RETURN(zinf::engine::Gathered fc1, engine->Gather({"fc1.weight",
//                                                                        "fc1.bias"}));
//     Forward(fc1[0], fc1[1]);          // std::span<const float>: the whole parameters
//   }                                   // released here
//   ... backward, gathering again; each gradient as soon as it is complete:
//   ZINF_RETURN_IF_ERROR(engine->GradientReady(0, grad_w1));  // copied: grad_w1 is free again
//   ZINF_ASSIGN_OR_RETURN(zinf::engine::StepInfo info, engine->Step(loss));
// Gather is collective: every rank asks for the same parameters in the same order (agreed on
// each call; a rank that asks for others gets FailedPrecondition, as every rank does). The
// engine records the order of one step's Gather calls and, while the next step repeats it,
// gathers the parameters that follow ahead of use, in the same collective: up to
// zero_optimization.stage3_prefetch_bucket_size elements (with offload_param nvme, at most
// offload_param.buffer_count parameters read from disk ahead), never beyond
// stage3_max_live_parameters elements gathered at once. A released parameter stays gathered
// when the recorded order uses it again within stage3_max_reuse_distance elements. With
// offload_param nvme a thread of the engine reads the shards on disk that the recorded order asks
// for next (from the end of each Step, and after each Gather; at most offload_param.buffer_count
// shards and stage3_prefetch_bucket_size shard elements ahead) while the loop computes, with an
// I/O engine of its own; a Gather waits only for a read still in flight. A step that
// departs from the recording gathers what it asks for and is recorded anew. Parameters of at
// most stage3_param_persistence_threshold elements (in registration order, up to
// stage3_model_persistence_threshold elements in all) stay whole on every rank: their Gather
// moves nothing, and Step gathers their new values as it does at stages 1 and 2. Parameters
// registered with weights stay whole in them at every stage. Step refuses to run while a
// Gathered scope is alive (its weights are about to change); released gathers are dropped by
// Step. The gathered weights are rounded to the working precision (bf16 / fp16) as at stages 1
// and 2.
// Gradients lent (stages 2 and 3, parameters registered without grads): GradientReady(index,
// grad) copies the micro-batch's gradient into its bucket before it returns, and the bucket is
// reduce-scattered once complete, so no rank holds the whole model's gradient: only the buckets
// that are being handed or reduced (about two when gradients are handed in reverse
// registration order, as a backward pass produces them). A parameter not handed in a
// micro-batch has a zero gradient in it.
//
// Speculative step (zinf.speculative_step; on by default where the gradients are lent, stages
// 2 and 3 without grads buffers): in the step's last micro-batch, each swapped sub-group whose
// reduced gradient is final (every parameter it holds handed by GradientReady and its bucket
// reduced) is stepped at once on a thread of the engine, as Step would step it if nothing
// clipped and no fp16 overflow skipped the step: read, Adam, written into a spare slot of the
// swap store, not committed. Step, knowing the global norm and the overflow flag, commits those
// sub-groups when the arguments are the same (no clipping, the same loss scale and
// hyper-parameters) and steps only the rest; when clipping applies it steps them again from
// their committed state; on an overflow it drops them. (Once this rank's gradients seen so far
// prove that the step clips or overflows, nothing more is speculated; a step that follows one
// that clipped is not speculated.) The weights the loop sees change only in
// Step, and a speculated sub-group is only ever in a slot nobody reads: a crash, an error or a
// checkpoint before Step sees the committed state. Costs: a second slot per swapped sub-group on
// disk, the new weights of the speculated sub-groups until Step (memory plan), and, while it is
// on, a per-parameter partition at stages 1 and 2 (each rank owns a part of every parameter,
// so every rank's partition fills from its end as the backward pass goes) with sub-groups and
// reduce buckets of about an eighth of the partition unless set. Sub-groups resident in host
// memory (zinf.host_cache_bytes) are speculated into a second copy of their state, committed
// by swapping the two, when the host memory budget has room for it (else Step steps them). Off
// with zinf.swap_gradients. StepInfo counts what was speculated, committed, redone and dropped.
//
// Parameter groups: each Param names its group (Param::group, an index into
// EngineOptions::param_groups), whose lr, betas, eps and weight_decay its elements step with;
// a sub-group holding elements of several groups steps each run of them with its own in the
// same pass over memory. A config scheduler schedules every group from its own values: lr
// (WarmupLR and WarmupDecayLR without warmup_max_lr warm up to it, WarmupCosineLR scales it;
// OneCycle and LRRangeTest give every group the same absolute lr, as DeepSpeed) and betas
// (OneCycle's momentum). Without one, the groups keep their values until the loop sets new
// ones (SetHyperParams: a schedule of its own, e.g. torch's lr_scheduler). Checkpoints keep
// every parameter's group by name and the groups' values; a restore refuses a checkpoint
// whose groups differ, naming the first parameter, and without a config scheduler goes on
// with the saved values.
//
// Checkpoints (collective): SaveCheckpoint writes one parallel-HDF5 file per step into
// zinf.checkpoint.dir with the commit protocol of checkpoint/checkpoint.h (keep_last applied), the
// engine's state and the user's JSON. Create restores one when zinf.checkpoint.load says so
// (`latest`, `auto`, or a path), on any number of ranks: the swapped state, the step, the
// learning-rate schedule's position and the weights; user_state() returns the user's JSON. A
// checkpoint restores only into the same parameters (names and shapes; the first mismatch is
// named).
//
// Output: rank 0 logs one line every steps_per_print steps (step, loss, lr, step time, swap
// GB/s), and keeps a live line (step, loss, GB/s, ETA when EngineOptions::total_steps is set) on
// stderr when it is a terminal; EngineOptions::metrics_path gets one JSON object per step.
//
// Errors: every call returns the same Status on every rank (one rank's EIO fails all of them
// alike). Nothing waits in a collective forever: the engine's agreements run on a communicator
// of its own (a failure domain, comm/communicator.h) and end the job with an ERROR naming the
// call when a rank destroyed its engine (at once) or when the others do not come within
// zinf.collective_timeout_seconds (default 600); ranks in different calls (one in Close, one in
// Step) get FailedPrecondition naming them. A failed Step leaves every sub-group either
// stepped or not (optimizer_swapper.h), but the `weights` may then hold some of the step's new
// values on some ranks (restore a checkpoint); the last committed checkpoint is never touched.
//
// Thread safety: one thread at a time. Create installs stop-signal handlers (SIGINT, SIGTERM,
// SIGUSR1, SIGUSR2) for the engine's lifetime unless EngineOptions::stop_signals is false.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/comm/communicator.h"
#include "zinf/config/config.h"
#include "zinf/core/status.h"
#include "zinf/engine/step_info.h"
#include "zinf/partition/layout.h"
#include "zinf/swapper/cpu_adam.h"

namespace zinf::engine {

// Partitions, stage-3 shards and sub-groups are multiples of this many elements (4 KiB of fp32:
// the direct-I/O alignment of every file system we have seen, so no sub-group needs a padded
// tail on disk). At stage 3, rank r of W owns elements [r * S, min((r + 1) * S, numel)) of a
// partitioned parameter, S = AlignUp(ceil(numel / W), kPartitionAlignmentElems).
inline constexpr std::uint64_t kPartitionAlignmentElems = 1024;

// One parameter group's lr, betas, eps and weight_decay, all set.
using HyperParams = swapper::AdamHyperParams;

// A parameter group's hyper-parameters (torch's param_groups: e.g. no weight decay for biases
// and norms); the unset ones are the config optimizer's. The optimizer type, adam_w_mode and
// amsgrad are the config's for every group.
struct ParamGroup {
  std::optional<double> lr = std::nullopt;
  std::optional<std::array<double, 2>> betas = std::nullopt;
  std::optional<double> eps = std::nullopt;
  std::optional<double> weight_decay = std::nullopt;
};

// Fills elements [offset, offset + out.size()) of one parameter's initial values (row-major).
using ParamInit = std::function<Status(std::uint64_t offset, std::span<float> out)>;

// One parameter of the user's model. The buffers are the user's and must outlive the engine;
// each holds exactly the shape's number of elements, or is empty where allowed.
struct Param {
  std::string name;                 // unique; [A-Za-z0-9_.:/-] (partition::ParamLayout)
  std::vector<std::int64_t> shape;  // each dimension > 0; {} is a scalar
  // The working weights, the same on every rank; Step writes them. Empty (stage 3 only): the
  // parameter is partitioned (see "Stage 3" above) and `init` gives its first values.
  std::span<float> weights = {};
  // This rank's accumulated gradient; Step reads and zeroes it. Empty (stages 2 and 3, for
  // every parameter or none): the gradient is lent with GradientReady(index, grad).
  std::span<float> grads = {};
  // A parameter without weights: its initial values, asked only for the elements this rank
  // owns; it must give the same values for the same elements on every rank. Required unless a
  // checkpoint is restored; unused for a parameter with weights.
  ParamInit init = nullptr;
  // Its parameter group: an index into EngineOptions::param_groups (0 when that is empty).
  std::size_t group = 0;
};

class ZeroEngine;

// Parameters gathered whole for the loop's use (ZeroEngine::Gather); released when destroyed.
// Move-only. The engine must outlive it; after the engine's Close it holds nothing.
class Gathered {
 public:
  Gathered() = default;
  ~Gathered() { Release(); }
  Gathered(Gathered&& other) noexcept;
  Gathered& operator=(Gathered&& other) noexcept;
  Gathered(const Gathered&) = delete;
  Gathered& operator=(const Gathered&) = delete;

  std::size_t size() const { return weights_.size(); }
  // The i-th requested parameter's whole weights (its numel elements, row-major).
  // Precondition (checked): i < size().
  std::span<const float> operator[](std::size_t i) const;
  // The weights of the requested parameter called `name`; empty if it was not requested.
  std::span<const float> Find(std::string_view name) const;
  // Local: gives the parameters back (they may stay gathered for reuse, see "Stage 3").
  // Idempotent.
  void Release();

 private:
  friend class ZeroEngine;
  ZeroEngine* engine_ = nullptr;
  std::vector<std::size_t> params_;
  std::vector<std::span<const float>> weights_;
};

// One item of the caller's host memory in the engine's memory plan (EngineOptions).
struct HostMemoryUse {
  std::string name;         // "zinf.torch's gathered weights"
  std::uint64_t bytes = 0;  // per rank
  std::string shrink;       // what makes it smaller
};

struct EngineOptions {
  // Rank 0 appends one JSON object per step (a fresh run truncates it); empty: none.
  std::string metrics_path = {};
  // The loop's last step, for the ETA of the live progress line; 0: unknown.
  std::int64_t total_steps = 0;
  bool progress = true;      // the log lines every steps_per_print steps and the live line
  bool stop_signals = true;  // SIGINT/SIGTERM/SIGUSR1/SIGUSR2 set StepInfo::stop_requested
  // Create missing nvme_path directories (mode 0700, parents included). Off by default: a
  // configured path that is missing is an error (an unmounted drive must not silently become a
  // directory on the root file system).
  bool create_nvme_paths = false;
  // With zinf.swap_gradients: the partition's accumulated gradient stays in host memory up to
  // this many bytes per rank, and above it is written behind to NVMe (read, added and written
  // again by each micro-batch).
  std::uint64_t gradient_memory_limit_bytes = 256ull << 20;
  // Restore from this checkpoint instead of zinf.checkpoint.load ("latest", "auto", a path);
  // unset: the config's.
  std::optional<std::string> load = std::nullopt;
  // Parameter groups (see "Parameter groups" above); empty: one group, the config optimizer's.
  std::vector<ParamGroup> param_groups = {};
  // The caller's own host memory beside the engine's, per rank, added to the memory plan
  // (zinf.torch: the whole weights and gradients its stage-3 scopes hold at once).
  std::vector<HostMemoryUse> host_memory_uses = {};
};

// Stage 3: what Gather did since Create (this rank's; the same on every rank but disk_waits).
struct GatherCounters {
  std::uint64_t calls = 0;       // Gather calls
  std::uint64_t asked = 0;       // parameters asked for
  std::uint64_t gathered = 0;    // parameters all-gathered (asked or ahead of use)
  std::uint64_t prefetched = 0;  // of them, gathered ahead of being asked
  // Asks served without an all-gather: a parameter still gathered (prefetched, kept for reuse
  // or held by another scope), persistent, or registered with weights.
  std::uint64_t served = 0;
  std::uint64_t disk_reads = 0;  // shards read from the swap store (offload_param nvme)
  // Of them: read ahead of their Gather on the engine's reader thread (queued in the recorded
  // order), and those the Gather had to wait for (not read ahead, or still in flight).
  std::uint64_t read_ahead = 0;
  std::uint64_t disk_waits = 0;
  std::uint64_t peak_live_elems = 0;  // the most elements gathered at once
};

struct SavedCheckpointInfo {
  std::string path;  // the committed <dir>/step-<N>.h5
  std::uint64_t state_bytes = 0;
  double seconds = 0;
  std::vector<std::string> removed;  // by keep_last and stale-partial cleanup
};

class ZeroEngine {
 public:
  // Collective over `world`. Checks the parameters (names unique and valid, shapes positive,
  // buffer sizes equal to the shapes, no buffer shared by two parameters or by weights and
  // grads; empty buffers only where Param allows them), builds the partition plan (ZeRO stage 1/2:
  // flat; 3: per parameter), the swapper (store on nvme_path, pool, I/O engines, CpuAdam) and the
  // collective backend, then either restores a checkpoint (EngineOptions::load, else
  // zinf.checkpoint.load) or swaps the parameters' current weights in as the initial state (exp_avg
  // = exp_avg_sq = 0). Errors: InvalidArgument (bad parameters, offload device not nvme), NotFound
  // (a missing nvme_path or checkpoint), ResourceExhausted (host memory, disk space, pool), the
  // swapper's and the checkpoint's errors (a mismatched checkpoint names the first differing
  // parameter; a trainer state no writer produces is DataLoss, a loss scale outside this config's
  // fp16 range FailedPrecondition: engine/trainer_state.h), all before the store is written.
  static Result<std::unique_ptr<ZeroEngine>> Create(const comm::Communicator& world,
                                                    const config::Config& config,
                                                    std::vector<Param> params,
                                                    const EngineOptions& options = {});

  ~ZeroEngine();
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  // Collective. Hands the gradient accumulated in the `grads` buffers since the last call to the
  // engine (reduce-scatter; with zinf.swap_gradients written behind to NVMe) and zeroes them. For
  // every micro-batch of a step but the last. Errors: FailedPrecondition when called
  // gradient_accumulation_steps times in one step; the swapper's I/O errors. A refused call has
  // still reduced the micro-batch (no rank is left in a collective) and then drops the step's
  // gradient, as DropGradients does: the next micro-batch begins the step afresh.
  Status AccumulateGradients();

  // Collective. Drops the step's gradient: the micro-batch in progress (its remaining buckets are
  // reduced first, so that no rank is left in a collective, then discarded) and the micro-batches
  // AccumulateGradients ended since the last Step; the `grads` buffers are zeroed. The next
  // micro-batch begins the step afresh (a loop skipping a bad batch after its backward pass).
  // Costs one reduce-scatter of what the micro-batch has not reduced yet. Errors:
  // FailedPrecondition (ranks in different calls, after Close), the reductions' errors (the
  // gradient is dropped all the same).
  Status DropGradients();

  // Hands parameter `index`'s gradient (its position in Create's params) of the current
  // micro-batch to the engine as soon as the backward pass has finished writing it, so that its
  // reduction (and with zinf.swap_gradients its swap-out) overlaps the rest of the backward
  // pass. Optional: parameters not handed are reduced by the AccumulateGradients or Step that
  // ends the micro-batch. After the call the engine owns the buffer until that call returns (it
  // reads and zeroes it, possibly from another thread).
  // Gradients are reduced in buckets of whole parameters (zero_optimization.reduce_bucket_size
  // elements), last bucket first, each once it and every bucket after it are complete: handing
  // them in reverse registration order, as a backward pass produces them, overlaps best; any
  // order is correct, but every rank must hand the same parameters. The reductions run on a
  // background thread when MPI provides MPI_THREAD_SERIALIZED or more (MpiSession::Init(...,
  // ThreadLevel::kSerialized)); the program then must not call MPI itself until the micro-batch
  // ends, unless MPI provides MPI_THREAD_MULTIPLE. Below that level they run inside this call.
  // Local. Errors, also reported by the next AccumulateGradients/Step on every rank:
  // InvalidArgument (no such parameter), FailedPrecondition (handed twice in a micro-batch,
  // after Close). A failed reduction or swap-out is reported there too.
  Status GradientReady(std::size_t index);
  // The same for a lent gradient (parameters registered without grads): `grad` (the parameter's
  // numel elements) is copied before the call returns. Errors as above, plus InvalidArgument
  // for a `grad` of the wrong size and FailedPrecondition for an engine whose parameters have
  // grads buffers (and the other way round for the overload above).
  Status GradientReady(std::size_t index, std::span<const float> grad);

  // Collective (stage 3; see "Stage 3" above). Gathers the whole weights of the parameters
  // named, in that order (a name at most once), with what the recorded order says comes next.
  // Errors: InvalidArgument (an unknown or repeated name), FailedPrecondition (ranks that ask
  // for different parameters, after Close), ResourceExhausted (host memory), the swap store's
  // I/O errors with offload_param nvme; every rank gets the same one.
  Result<Gathered> Gather(std::initializer_list<std::string_view> names);
  Result<Gathered> Gather(std::span<const std::string> names);
  // The same by index in Create's params.
  Result<Gathered> GatherByIndex(std::span<const std::size_t> params);

  // Collective. One optimizer step (see the top of the file); `loss` is this rank's loss, for
  // the log, the metrics and StepInfo (optional). With fp16 a gradient holding an Inf or NaN on
  // any rank skips the step (StepInfo::skipped) and adjusts the loss scale (LossScaler).
  // Errors, nothing stepped: FailedPrecondition for a non-finite loss or gradient norm without
  // fp16, for an fp16 overflow at fp16.min_loss_scale, for a gradient that is zero on every rank
  // (Step before any gradient was written), and for AccumulateGradients called a number of times
  // other than 0 or gradient_accumulation_steps - 1, for a Gathered scope still alive; the
  // swapper's errors. Every refused Step has still reduced the micro-batch's gradient, so that no
  // rank is left in a collective, and consumed the step's gradient (the micro-batches handed
  // since the last Step; the `grads` buffers zeroed): the next micro-batch begins the next
  // step's gradient, so a loop skips a refused batch by going on with the next one.
  Result<StepInfo> Step(std::optional<double> loss = std::nullopt);

  // Collective. Saves checkpoint step_count() into `dir` (empty: zinf.checkpoint.dir) with
  // keep_last from the config; `user_state` (a JSON object, or null) is stored and given back by
  // user_state() after a restore. Errors: InvalidArgument (no directory, state not an object,
  // or beyond what a restore reads back: 64 levels with the engine's wrapper, 64 MiB),
  // ResourceExhausted (no space), I/O errors; `latest` and older checkpoints stay as they were.
  // Also in the middle of a micro-batch: it first waits (without MPI) for the gradient
  // reductions the engine's thread has in flight.
  Result<SavedCheckpointInfo> SaveCheckpoint(const nlohmann::json& user_state = nullptr,
                                             const std::string& dir = {});

  // Collective. Restores checkpoint `path` (a file, or a directory's `latest`) into this open
  // engine, as Create does with zinf.checkpoint.load: the swapped state, the step, the
  // schedule's position, the loss scale, the parameter groups' values (without a config
  // scheduler), the user state, and the weights (every `weights` buffer, the stage-3 shards).
  // Between steps only. The file is read and verified whole before anything changes, so every
  // error of the file or the model (NotFound, DataLoss, a layout or groups that differ:
  // FailedPrecondition) leaves the engine as it was and usable; an I/O error of the swap store
  // while the restored state is written leaves it partly restored (load again, or close).
  // Errors also FailedPrecondition in the middle of a step (AccumulateGradients or
  // GradientReady called since the last Step, a Gathered scope alive) and after Close.
  Status Load(const std::string& path);

  // Collective: the timers (min/mean/max over ranks) and the swap bandwidth per node, logged
  // by rank 0. For the end of a run.
  // Errors: FailedPrecondition after Close.
  Status LogSummary();

  // Collective. Closes the swapper (removes the swap store unless keep_swap) and the metrics
  // file. Idempotent. When some rank is in another call (e.g. Step) every rank gets
  // FailedPrecondition naming the calls; the ranks' collectives have then diverged for good, so
  // every later call fails with that error and Close closes each rank's part locally (OK).
  // The destructor of an engine not closed is local: it drains this rank's I/O, closes (and
  // unless keep_swap removes) its swap store with a WARN, and tells the other ranks, so that one
  // waiting for it in a collective of this engine ends the job within milliseconds instead of
  // waiting for it (comm/communicator.h, "Bounded waits").
  Status Close();

  // Local. This rank will make no call on the engine but Close (e.g. a Python optimizer dropped
  // without close(), which the runtime closes at exit): another rank that waits for it in any
  // other collective of this engine ends the job at once, with `reason`.
  void Detach(std::string_view reason);

  // Collective over the engine's communicator: agrees on `local` (AgreeOnStatus) and that every
  // rank is in the call named `call`, for a layer above the engine whose collective calls begin
  // with checks of their own (zinf.torch). Errors: FailedPrecondition when the ranks are in
  // different calls or after Close; `local`'s agreed error.
  Status AgreeOnCall(std::string_view call, const Status& local = OkStatus());

  bool closed() const;
  // The last step applied (0 before the first; the checkpoint's step after a restore).
  std::int64_t step_count() const;
  // Stage 3: Gather's counters; the number of parameters kept partitioned.
  const GatherCounters& gather_counters() const;
  std::size_t num_partitioned_params() const;
  // The learning rate the next Step will use (parameter group 0's).
  double next_lr() const;
  // Parameter groups: how many, and the hyper-parameters the next Step uses for group `g`
  // (checked: < num_param_groups()).
  std::size_t num_param_groups() const;
  HyperParams next_hyper_params(std::size_t g) const;
  // Local. The loop's own schedule (torch's lr_scheduler): every group's hyper-parameters for
  // the Steps from the next one on, in group order. Step agrees on them: values that differ
  // between the ranks make it FailedPrecondition on every rank, naming the group (the
  // micro-batch's gradient is reduced by then: hand it again). Errors: FailedPrecondition
  // with a config scheduler (the two would fight), after Close; InvalidArgument for another
  // number of groups or a value out of its range (nothing changed then).
  Status SetHyperParams(std::span<const HyperParams> groups);
  // fp16 (config fp16.enabled): the factor the loop multiplies its loss by before the backward
  // pass, for the next Step (DeepSpeed's engine.backward does this); 1 without fp16. The
  // gradients handed to the engine are of the scaled loss; the engine divides the scale out.
  double loss_scale() const;
  // Steps skipped for an fp16 overflow so far (a checkpoint keeps the count and the scale).
  std::int64_t skipped_steps() const;
  // After a restore: the checkpoint read, its user JSON (null otherwise), the ranks it was saved
  // on.
  const std::string& resumed_from() const;
  const nlohmann::json& user_state() const;
  int resumed_world_size() const;
  const config::Config& config() const;
  const partition::ParamLayout& layout() const;
  const comm::Communicator& world() const;

 private:
  friend class Gathered;
  class Impl;  // engine_impl.h: the state and the parts of each call
  ZeroEngine(const comm::Communicator& world, const config::Config& config,
             const EngineOptions& options);

  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf::engine
