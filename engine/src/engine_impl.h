// Private to zinf::engine: ZeroEngine's implementation (engine.h keeps only the interface),
// shared by the files that define its parts:
//   engine.cc            Create (Build), Step and its phases, Close; ZeroEngine's forwarding calls
//   gradients.cc         the gradient's way in: buckets, GradientReady, AccumulateGradients,
//                        DropGradients, the partition gradient's norm
//   speculation.cc       the speculative step's glue (engine.h, "Speculative step")
//   gather.cc            stage 3: holding plan, shard reads, Gather and the Gathered scopes
//   working_weights.cc   the working precision and moving weights to and from the partition
//   param_groups.cc      parameter groups and their scheduled hyper-parameters
//   memory_plan_fit.cc   the host memory plan: making it, fitting it to the budget, checking it
//   engine_checkpoint.cc initialize or restore, SaveCheckpoint, Load, reading the weights back
//   step_report.cc       the step's figures, its log/live/metrics lines, LogSummary
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradient_buckets.h"
#include "memory_plan.h"
#include "shard_reader.h"
#include "speculator.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/collective_backend.h"
#include "zinf/comm/timers.h"
#include "zinf/core/status.h"
#include "zinf/core/stop_signals.h"
#include "zinf/engine/engine.h"
#include "zinf/engine/loss_scaler.h"
#include "zinf/engine/trainer_state.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::engine {

// Stage 3 with offload_param nvme: shards are read from the swap store in pieces of this size.
inline constexpr std::uint64_t kShardStagingBytes = std::uint64_t{4} << 20;

// What the working weights hold: fp32 values, or values rounded to bf16 / fp16.
enum class Working { kFp32, kBf16, kFp16 };

Working WorkingOf(const config::Config& config);

// The groups' values (EngineOptions::param_groups over the config optimizer's), with every
// parameter's group in range. Local.
Result<std::vector<HyperParams>> ResolveGroups(const config::OptimizerConfig& optimizer,
                                               const std::vector<ParamGroup>& groups,
                                               const std::vector<Param>& params);

// How a parameter's working weights are held (engine.h, "Stage 3").
enum class Holding : std::uint8_t {
  kLoop,        // whole, in the loop's weights buffer
  kPersistent,  // whole, in the engine's (stage 3, at most the persistence threshold)
  kPartitioned  // this rank's shard only; whole while gathered
};

// The engine's state and the parts of its calls (engine.h keeps only the interface). Each
// public call of ZeroEngine forwards to the one of the same name here (at the end of engine.cc).
class ZeroEngine::Impl {
 public:
  struct State;
  Impl(ZeroEngine* self, const comm::Communicator& world, const config::Config& config,
       const EngineOptions& options);
  ~Impl();

  // ZeroEngine's calls (engine.h).
  Status AccumulateGradients();
  Status DropGradients();
  Status GradientReady(std::size_t index);
  Status GradientReady(std::size_t index, std::span<const float> grad);
  Result<Gathered> Gather(std::span<const std::string> names);
  Result<Gathered> GatherByIndex(std::span<const std::size_t> params);
  Result<StepInfo> Step(std::optional<double> loss);
  Result<SavedCheckpointInfo> SaveCheckpoint(const nlohmann::json& user_state,
                                             const std::string& dir);
  Status Load(const std::string& path);
  Status LogSummary();
  Status Close();
  void Detach(std::string_view reason);
  Status AgreeOnCall(std::string_view call, const Status& local);
  double next_lr() const;
  HyperParams next_hyper_params(std::size_t g) const;
  Status SetHyperParams(std::span<const HyperParams> groups);
  double loss_scale() const;
  const partition::ParamLayout& layout() const;

  // The parts of Create, Step and the rest; each collective unless said otherwise.
  Status Build(std::vector<Param> params);
  // Build's steps, in order: the parameters checked and adopted (their layout returned) and the
  // engine's communicator; the partition plan and the holding plan; the host memory plan (the
  // swapper's options it settles on); the engine's weight buffers and the collective backend;
  // the swapper, the shard reader and the partition gradient.
  Result<partition::ParamLayout> AdoptParams(std::vector<Param> params);
  Status PlanPartition(const partition::ParamLayout& layout, bool speculating);
  Result<swapper::SwapperOptions> PlanMemory(bool speculating);
  Status AllocateWeightBuffers();  // local but for the backend's creation
  Status CreateSwapper(swapper::SwapperOptions& options);
  Result<MemoryPlan> MakeMemoryPlan(const swapper::SwapperOptions& options) const;  // local
  // MakeMemoryPlan's parts (local): the weights' items (the caller's, the engine's, stage 3's),
  // then the swapper's and the gradient's.
  void PlanWeightMemory(MemoryPlan& plan) const;
  Status PlanSwapperMemory(const swapper::SwapperOptions& options, MemoryPlan& plan) const;
  Status FitMemoryPlan(const MemoryBudget& budget, swapper::SwapperOptions& options);
  // FitMemoryPlan's parts: a key the fit may shrink, down to `floor`; the keys in the order they
  // are shrunk (`keep_gradient`: zinf.swap_gradients as a size); shrinking them (local); the
  // INFO line naming what changed (local).
  struct SizingStep {
    std::string_view key;
    std::uint64_t* value;
    std::uint64_t floor;
  };
  std::vector<SizingStep> SizingSteps(std::uint64_t* keep_gradient);
  static void ShrinkToFit(std::span<const SizingStep> steps, const MemoryBudget& budget,
                          const std::function<Status()>& apply,
                          const std::function<std::uint64_t()>& total);
  void LogSizing(const config::ZeroConfig& before, std::uint64_t keep_gradient,
                 std::uint64_t accumulation_limit, const MemoryBudget& budget) const;
  Status PlanHostMemory(const MemoryBudget& budget,
                        const swapper::SwapperOptions& options);  // local
  Status InitializeOrRestore();
  Status Initialize();
  Status Restore(const std::string& path, bool verify_before_write);
  Status ReadPartition();  // local
  Status ReadBackWeights();
  // The updated partitions into the parameters kept whole (the loop's weights, persistent ones).
  Status GatherWholeWeights();
  // Gather's parts (engine.h, "Stage 3").
  Status GatherParams(std::span<const std::size_t> asked);
  // GatherParams' steps, in order (local unless said otherwise): the asks checked (`seen` marks
  // them); what to all-gather (`todo`: the asks not gathered now, then what the recorded order
  // says comes next; returns how many of those); agreeing on the asks and the decision
  // (collective); room made under stage3_max_live_parameters; this rank's shards on disk read;
  // the all-gathers (collective); the scopes' and the counters' bookkeeping.
  Status CheckAsks(std::span<const std::size_t> asked, std::vector<bool>* seen) const;
  std::size_t PlanGather(std::span<const std::size_t> asked, std::vector<std::size_t>* todo,
                         std::uint64_t* todo_elems);
  Status AgreeOnGather(const Status& local, std::span<const std::size_t> asked,
                       std::span<const std::size_t> todo);
  void MakeRoom(const std::vector<bool>& seen, std::uint64_t todo_elems);
  Status ReadShards(std::span<const std::size_t> todo, std::uint64_t todo_elems,
                    std::vector<std::vector<float>>* from_disk);
  Status AllgatherParams(std::span<const std::size_t> todo,
                         const std::vector<std::vector<float>>& from_disk);
  void CountGather(std::span<const std::size_t> asked, std::span<const std::size_t> todo,
                   std::size_t ahead);
  void ReleaseParams(std::span<const std::size_t> params);    // local
  Status ReadShard(std::size_t param, std::span<float> out);  // local
  Status CreateBuckets();                                     // local
  // The speculative step (engine.h, "Speculative step"): whether Create turns it on, whether
  // Step's sink needs a sub-group's new weights, the plan for the step about to be reduced, and
  // its end in Step (local unless said otherwise).
  bool SpeculationWanted(bool swap_gradients, bool all_resident) const;
  void ShapeForSpeculation(std::uint64_t partition_numel);
  bool SinkWrites(std::uint64_t partition_offset, std::uint64_t numel) const;
  void ArmSpeculation();
  Result<std::vector<HyperParams>> StepHyperParams(std::int64_t step) const;
  std::vector<swapper::AdamSegment> StepSegments(std::span<const HyperParams> hyper) const;
  // Commits what was speculated when `options` are what it assumed, else discards it to be
  // stepped again by the swapper's Step; DiscardSpeculation drops it (each counted in `info`
  // unless null). Both disarm the speculator.
  void UseSpeculation(const swapper::StepOptions& options, StepInfo* info);
  void DiscardSpeculation(StepInfo* info);
  Status HandGradient(int micro_batch);
  Status ForgetStepGradient();  // local
  Result<double> PartitionGradSquaredSum();
  // Step's phases (see Step), and what they hand each other.
  struct StepPlan {
    double squared_sum = 0;  // the reduced gradient's, all ranks (not finite: an overflow)
    double average = 1;      // 1 / (gradient_accumulation_steps x ranks)
    double loss_scale = 1;   // fp16: divided out of the gradient
    double clip = 1;         // gradient_clipping's factor
    bool skip = false;       // an fp16 overflow: nothing is stepped
  };
  Status ReduceGradients(std::int64_t step);
  // 1 / (gradient_accumulation_steps x ranks): the gradient's averaging.
  double Average() const;
  // The swapper's arguments for a step of `plan` (its scale: averaging, clipping, loss scale)
  // as the `applied`-th Adam step; the segments are the caller's (StepSegments).
  static swapper::StepOptions StepOptionsFor(const StepPlan& plan, std::int64_t applied);
  Result<StepPlan> MeasureGradient(std::optional<double> loss, StepInfo* info);
  Status Decide(bool have_loss, StepPlan* plan, StepInfo* info);  // local
  Result<double> Optimize(const StepPlan& plan, StepInfo* info);
  Result<StepInfo> FinishStep(StepInfo info, bool skipped,
                              const storage::SwapStore::IoCounters& io_start,
                              const storage::SwapStore::IoCounters& io_optimizer_start,
                              const storage::SwapStore::IoCounters& io_optimizer_end,
                              double optimizer_seconds);
  Status Report(const StepInfo& info);
  // Parameter groups: Step's agreement on their values, the checkpoint's record
  // of them, and a restore's check of it (local).
  Status AgreeOnGroups(std::int64_t step);
  nlohmann::json GroupsJson() const;
  Status CheckGroups(const TrainerState& saved, const checkpoint::CheckpointInfo& info) const;
  Status LogPerNode();
  // The engine's private communicator once built (the caller's `world` before).
  const comm::Communicator& comm() const;
  // Local: the destructor's close; tells the other ranks `reason` unless it is empty.
  void CloseLocally(std::string_view reason);

  ZeroEngine* const self_;  // the interface, for the Gathered scopes
  const comm::Communicator& world_;
  config::Config config_;
  EngineOptions options_;
  std::unique_ptr<State> state_;
  // Each parameter group's hyper-parameters: under a config scheduler the base it schedules
  // from, otherwise what the next Step uses (EngineOptions::param_groups, SetHyperParams, a
  // restored checkpoint's).
  std::vector<HyperParams> groups_;
  std::int64_t step_ = 0;
  std::int64_t skipped_steps_ = 0;
  std::string resumed_from_;
  nlohmann::json user_state_;
  int resumed_world_size_ = 0;
  bool closed_ = false;
};

// Everything the engine builds in Create.
struct ZeroEngine::Impl::State {
  std::vector<Param> params;
  // Stage 3 (engine.h, "Stage 3"), per parameter: how it is held; the engine's whole weights
  // (kPersistent: always; kPartitioned: while gathered, world x shard elements with the
  // shards' padding); the live Gathered scopes holding it.
  std::vector<Holding> holding;
  std::vector<std::vector<float>> whole;
  std::vector<int> refs;
  std::size_t num_partitioned = 0;
  std::uint64_t held_refs = 0;    // sum of refs: Gathered scopes alive
  std::uint64_t live_elems = 0;   // kPartitioned elements gathered now
  std::vector<std::size_t> kept;  // gathered, held by no scope (prefetched or kept), oldest first
  // This rank's fp32 shards in host memory: partition elements [0, shard.size()) (all of the
  // partition, or with offload_param nvme the prefix that max_in_cpu allows; beyond it they
  // are read from the swap store's committed fp32 weights).
  std::vector<float> shard;
  std::uint64_t shard_numel = 0;         // shard's size once allocated
  storage::AlignedBuffer shard_staging;  // ReadShard's, allocated at its first use
  // The partition ranges of the parameters held whole, merged (the same on every rank): what
  // Step gathers after the optimizer step. The whole partition at stages 1 and 2.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> whole_ranges;
  // Parameter groups: where each run of one group's elements begins in this rank's partition
  // (partition order; padding belongs to the run before it), for the step's Adam segments.
  std::vector<std::pair<std::uint64_t, std::size_t>> group_runs;
  // The order of the Gather asks: the previous step's (`trace`, followed up to `trace_at`
  // while this step repeats it) and this step's so far.
  std::vector<std::size_t> trace, recording;
  std::size_t trace_at = 0;
  bool following = false;
  GatherCounters counters;
  std::optional<partition::PartitionPlan> plan;
  std::optional<comm::Communicator> comm;  // the engine's own dup of the world
  std::unique_ptr<comm::CollectiveBackend> backend;
  std::unique_ptr<swapper::OptimizerSwapper> swapper;
  // offload_param nvme with shards on disk: reads them ahead of their Gathers (after swapper:
  // destroyed before it).
  std::unique_ptr<ShardReader> reader;
  std::optional<StopSignals> stop_signals;
  std::optional<LossScaler> scaler;  // fp16 (scale 1 without)
  std::uint64_t total_numel = 0;
  std::uint64_t partition_numel = 0;
  std::uint64_t plan_bytes = 0;         // the host memory plan's total per rank (memory_plan.h)
  std::uint64_t budget_bytes = 0;       // its budget per rank; 0: unknown
  std::uint64_t rss_before_engine = 0;  // CurrentRssBytes() when Create began
  std::vector<float> partition_grad;    // this rank's reduced gradient (in-memory accumulation)
  // With a gradient swapper: its reduced gradient on its way to NVMe (pages allocated as written
  // and released per sub-group, GradientBuckets::Target).
  storage::AlignedBuffer staging;
  // One all-gather round: this rank's piece and every rank's (rank order).
  std::vector<float> gather_send, gather_recv;
  comm::Timers timers;
  storage::UniqueFd metrics;
  int micro_batches = 0;  // AccumulateGradients calls since the last Step
  // The last applied step clipped: the next one is not speculated (ArmSpeculation).
  bool last_step_clipped = false;
  double last_step_end = 0;  // MonotonicSeconds() when the previous Step (or Create) returned
  double loop_start = 0;
  std::int64_t first_step = 0;   // the first step this engine ran
  double swap_seconds = 0;       // this rank's optimizer steps, wall time
  std::uint64_t swap_bytes = 0;  // this rank's swap reads + writes in its optimizer steps
  double last_tty_line = 0;
  bool tty = false;
  // The swap stores' counters when the previous Step (or Create, or a checkpoint save) ended: a
  // step's swap bytes are all I/O since, its micro-batches' gradient write-behind included.
  storage::SwapStore::IoCounters io_mark{};
  // The speculative step's thread (engine.h); destroyed after the buckets that feed it.
  std::unique_ptr<Speculator> speculator;
  // Last: destroyed first (its worker uses the backend, the swapper and the timers).
  std::unique_ptr<GradientBuckets> buckets;

  // The elements per rank of one all-gather round of the parameters held whole: they are
  // gathered in rounds of allgather_bucket_size elements over all ranks. After PlanHolding.
  std::uint64_t GatherRound(const config::Config& config, int world) const {
    std::uint64_t whole_numel = 0;
    for (const auto& [begin, end] : whole_ranges) whole_numel += end - begin;
    return std::clamp<std::uint64_t>(
        config.zero_optimization.allgather_bucket_size / static_cast<std::uint64_t>(world), 1,
        std::max<std::uint64_t>(whole_numel, 1));
  }

  // Decides how each parameter is held (engine.h, "Stage 3") and where the shards live; sizes
  // shard_numel. Local, the same on every rank; allocates nothing.
  Status PlanHolding(const config::Config& config);

  // offload_param nvme with a shard on disk: the reader, with an I/O backend and a staging
  // buffer of its own (the swapper's read backend belongs to the caller's thread). Local.
  Status CreateReader(const config::Config& config);

  // Queues the reads of the shards on disk that the recorded order asks for next, as far as the
  // reader's bounds allow (those gathered now are skipped).
  void ReadAhead();

  // Whether parameter p's shard is read from the swap store (not in `shard`).
  bool ShardOnDisk(std::size_t p) const;

  // A gathered partitioned parameter no scope holds any more: dropped.
  void Drop(std::size_t p);

  // After a step: the gathered weights are stale (dropped) and this step's asks are the
  // order the next one is expected to repeat.
  void NextStep();

  // Whether the recorded order asks for `p` again within `distance` elements of gathers.
  bool ReusedWithin(std::size_t p, std::uint64_t distance) const;

  // A parameter held whole: its weights.
  std::span<float> WholeWeights(std::size_t p);

  // Rank `rank`'s partition elements [partition_offset, + out.size()) from the weights of the
  // parameters held whole (padding and partitioned parameters' elements 0).
  void PackWeights(int rank, std::uint64_t partition_offset, std::span<float> out);

  // The reverse: rank `rank`'s partition elements [partition_offset, + in.size()) into the
  // weights of the parameters held whole, rounded to the working precision, and this rank's
  // own into the shards it keeps in memory (fp32: a gather rounds them).
  void UnpackWeights(int rank, std::uint64_t partition_offset, std::span<const float> in,
                     Working working, int my_rank);

  // `in` rounded to the working precision into `out` (the same size; may be `in`).
  static void Round(std::span<const float> in, std::span<float> out, Working working);
};

}  // namespace zinf::engine
