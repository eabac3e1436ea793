// ZeroEngine (engine.h): the ZeRO step over the user's parameters. The step is a sequence of named
// parts, each collective: HandGradient (the micro-batch's buckets reduce-scattered into the
// partition gradient, gradient_buckets.h), the global norm, the swapped Adam step, Gather (the
// updated partitions into the user's weights), Report (log, live line, metrics).
#include "zinf/engine/engine.h"

#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "gradient_buckets.h"
#include "memory_plan.h"
#include "shard_reader.h"
#include "speculator.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/collective_backend.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/comm/timers.h"
#include "zinf/core/check.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"
#include "zinf/engine/config_options.h"
#include "zinf/engine/loss_scaler.h"
#include "zinf/engine/lr_schedule.h"
#include "zinf/engine/trainer_state.h"
#include "zinf/partition/plan.h"
#include "zinf/partition/sub_group.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/gradient_swapper.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::engine {
namespace {

using Json = nlohmann::json;
using comm::ReduceOp;

// Stage 3 with offload_param nvme: shards are read from the swap store in pieces of this size.
constexpr std::uint64_t kShardStagingBytes = std::uint64_t{4} << 20;

// ---- Stop signals ----

std::atomic<int> g_stop_signal{0};

extern "C" void OnStopSignal(int sig) { g_stop_signal.store(sig, std::memory_order_relaxed); }

// Installs the stop handlers for the lifetime of the object and restores the old ones after.
// SIGINT/SIGTERM for a rank run directly; under Open MPI's mpirun those become SIGTERM then
// SIGKILL a second later, while SIGUSR1/SIGUSR2 sent to mpirun reach the ranks unchanged and the
// job waits for them: the way to stop a job with a final checkpoint.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = OnStopSignal;
    sigemptyset(&action.sa_mask);
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &action, &old_[i]);
  }
  ~StopSignals() {
    for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
  std::array<struct sigaction, 4> old_{};
};

// What the working weights hold: fp32 values, or values rounded to bf16 / fp16.
enum class Working { kFp32, kBf16, kFp16 };

Working WorkingOf(const config::Config& config) {
  if (config.bf16) return Working::kBf16;
  return config.fp16.enabled ? Working::kFp16 : Working::kFp32;
}

// fp16 round-to-nearest-even, kept in fp32 (beyond the fp16 range: infinity).
float RoundToFp16(float x) { return static_cast<float>(static_cast<_Float16>(x)); }

// bf16 round-to-nearest-even, kept in fp32 (the value the bf16 working weights hold).
float RoundToBf16(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u) return x;  // inf and NaN stay as they are
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Where stage 3 keeps this rank's shards, for the log.
std::string ShardWhereabouts(const config::Config& config, std::uint64_t in_memory,
                             std::uint64_t partition_numel) {
  if (config.zero_optimization.offload_param.device != config::OffloadDevice::kNvme) {
    return "in host memory";
  }
  if (in_memory == 0) return "read from the swap store when gathered";
  return fmt::format(
      "in host memory up to partition element {} of {} (offload_param.max_in_cpu), beyond it "
      "read from the swap store when gathered",
      in_memory, partition_numel);
}

// A group's values at the scheduler's last_batch_iteration `position` (lr_schedule.h).
HyperParams Scheduled(const config::SchedulerConfig& scheduler, HyperParams h,
                      std::int64_t position) {
  h.betas = AdamBetas(scheduler, h.betas, position);
  h.lr = LearningRate(scheduler, h.lr, position);
  return h;
}

// The checkpoint's trainer JSON: the engine's own state, and the user's under "user".
constexpr const char* kUserStateKey = "user";

// This rank's fp32 shard of parameter `p` from the swap store's committed weights (the sub-groups
// it spans), in pieces through `staging` (kShardStagingBytes + 2 x the store's alignment) on
// `engine` (nullptr: the swapper's read engine). Local.
Status ReadShardFrom(swapper::OptimizerSwapper& swapper, const partition::PartitionPlan& plan,
                     std::size_t p, std::span<float> out, std::span<std::byte> staging,
                     storage::IoBackend* engine) {
  constexpr std::uint64_t kPiece = kShardStagingBytes / sizeof(float);
  const std::uint64_t begin = plan.ShardPartitionOffset(p);
  const std::uint64_t end = begin + out.size();
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    const std::uint64_t lo = std::max(begin, sg.partition_offset);
    const std::uint64_t hi = std::min(end, sg.partition_offset + sg.numel);
    for (std::uint64_t at = lo; at < hi; at += kPiece) {
      const std::uint64_t n = std::min(kPiece, hi - at);
      ZINF_RETURN_IF_ERROR(swapper.ReadState(i, swapper::StateTensor::kFp32,
                                             at - sg.partition_offset, out.subspan(at - begin, n),
                                             staging, engine));
    }
  }
  return OkStatus();
}

// A staging buffer for ReadShardFrom.
Result<storage::AlignedBuffer> AllocateShardStaging(swapper::OptimizerSwapper& swapper) {
  const std::uint64_t alignment = std::max<std::uint64_t>(swapper.store().alignment(), 4096);
  return storage::AlignedBuffer::Allocate(kShardStagingBytes + 2 * alignment,
                                          {.alignment = alignment, .register_cuda = false});
}

}  // namespace

// How a parameter's working weights are held (engine.h, "Stage 3").
enum class Holding : std::uint8_t {
  kLoop,        // whole, in the loop's weights buffer
  kPersistent,  // whole, in the engine's (stage 3, at most the persistence threshold)
  kPartitioned  // this rank's shard only; whole while gathered
};

// The engine's state and the parts of its calls (engine.h keeps only the interface). Each
// public call of ZeroEngine forwards to the one of the same name here (at the end of the file).
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
  Result<MemoryPlan> MakeMemoryPlan(const swapper::SwapperOptions& options) const;  // local
  Status FitMemoryPlan(const MemoryBudget& budget, swapper::SwapperOptions& options);
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
  Status PlanHolding(const config::Config& config) {
    const config::ZeroConfig& zero = config.zero_optimization;
    const partition::ParamLayout& layout = plan->layout();
    num_partitioned = 0;
    holding.assign(params.size(), Holding::kLoop);
    whole.assign(params.size(), {});
    refs.assign(params.size(), 0);
    std::uint64_t persistent = 0;
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (!params[p].weights.empty()) continue;
      const std::uint64_t numel = layout.param(p).numel;
      if (numel <= zero.stage3_param_persistence_threshold &&
          persistent + numel <= zero.stage3_model_persistence_threshold) {
        holding[p] = Holding::kPersistent;
        persistent += numel;
      } else {
        holding[p] = Holding::kPartitioned;
        ++num_partitioned;
      }
    }
    const bool nvme = zero.offload_param.device == config::OffloadDevice::kNvme;
    if (nvme && num_partitioned == 0) {
      return InvalidArgumentError(
          "zero_optimization.offload_param.device: \"nvme\", but no parameter is partitioned: "
          "register the parameters without weights (Param::init gives their first values) and "
          "above stage3_param_persistence_threshold elements, or set the device to \"cpu\"");
    }
    whole_ranges.clear();
    if (plan->kind() == partition::PlanKind::kFlat) {
      whole_ranges.emplace_back(0, partition_numel);
    } else {
      for (std::size_t p = 0; p < params.size(); ++p) {
        if (holding[p] == Holding::kPartitioned) continue;
        const std::uint64_t begin = plan->ShardPartitionOffset(p);
        const std::uint64_t end = begin + plan->ShardNumel(p);
        if (!whole_ranges.empty() && whole_ranges.back().second == begin) {
          whole_ranges.back().second = end;
        } else {
          whole_ranges.emplace_back(begin, end);
        }
      }
    }
    shard_numel = 0;
    if (num_partitioned == 0) return OkStatus();
    if (!nvme) {
      shard_numel = partition_numel;
      return OkStatus();
    }
    // offload_param nvme: the first shards up to max_in_cpu elements stay in memory; each of
    // the others must fit offload_param.buffer_size (DeepSpeed's check).
    std::uint64_t in_cpu = 0;
    bool full = false;
    for (std::size_t p = 0; p < params.size(); ++p) {
      if (holding[p] != Holding::kPartitioned) continue;
      const std::uint64_t n = plan->ShardNumel(p);
      if (!full && in_cpu + n <= zero.offload_param.max_in_cpu) {
        in_cpu += n;
        shard_numel = plan->ShardPartitionOffset(p) + n;
        continue;
      }
      full = true;
      if (n > zero.offload_param.buffer_size) {
        return InvalidArgumentError(fmt::format(
            "zero_optimization.offload_param.buffer_size: parameter '{}' has a shard of {} "
            "elements per rank to read from NVMe, more than buffer_size {}; raise it",
            EscapeForTerminal(layout.param(p).name), n, zero.offload_param.buffer_size));
      }
    }
    return OkStatus();
  }

  // offload_param nvme with a shard on disk: the reader, with an I/O engine and a staging buffer
  // of its own (the swapper's read engine belongs to the caller's thread). Local.
  Status CreateReader(const config::Config& config) {
    bool on_disk = false;
    for (std::size_t p = 0; p < params.size() && !on_disk; ++p) {
      on_disk = holding[p] == Holding::kPartitioned && ShardOnDisk(p);
    }
    if (!on_disk) return OkStatus();
    struct Io {
      std::unique_ptr<storage::IoBackend> engine;
      storage::AlignedBuffer staging;
    };
    auto io = std::make_shared<Io>();
    ZINF_ASSIGN_OR_RETURN(io->engine, swapper->CreateReaderBackend());
    ZINF_ASSIGN_OR_RETURN(io->staging, AllocateShardStaging(*swapper));
    const config::ZeroConfig& zero = config.zero_optimization;
    reader = std::make_unique<ShardReader>(
        [io, from = swapper.get(), of = &*plan](std::size_t p, std::span<float> out) {
          return ReadShardFrom(*from, *of, p, out, io->staging.span(), io->engine.get());
        },
        static_cast<std::size_t>(zero.offload_param.buffer_count),
        zero.stage3_prefetch_bucket_size);
    return OkStatus();
  }

  // Queues the reads of the shards on disk that the recorded order asks for next, as far as the
  // reader's bounds allow (those gathered now are skipped).
  void ReadAhead() {
    if (!reader) return;
    if (!following) {
      reader->Cancel();
      return;
    }
    for (std::size_t i = trace_at; i < trace.size(); ++i) {
      const std::size_t p = trace[i];
      if (holding[p] != Holding::kPartitioned || !whole[p].empty() || !ShardOnDisk(p) ||
          reader->queued(p)) {
        continue;
      }
      if (!reader->Queue(p, plan->ShardNumel(p))) break;
    }
  }

  // Whether parameter p's shard is read from the swap store (not in `shard`).
  bool ShardOnDisk(std::size_t p) const {
    return plan->ShardPartitionOffset(p) + plan->ShardNumel(p) > shard.size();
  }

  // A gathered partitioned parameter no scope holds any more: dropped.
  void Drop(std::size_t p) {
    live_elems -= plan->layout().param(p).numel;
    std::vector<float>().swap(whole[p]);
  }

  // After a step: the gathered weights are stale (dropped) and this step's asks are the
  // order the next one is expected to repeat.
  void NextStep() {
    if (reader) reader->Cancel();  // what it read is the master the step is about to change
    for (std::size_t p : kept) Drop(p);
    kept.clear();
    if (!recording.empty()) trace = std::move(recording);
    recording.clear();
    trace_at = 0;
    following = !trace.empty();
  }

  // Whether the recorded order asks for `p` again within `distance` elements of gathers.
  bool ReusedWithin(std::size_t p, std::uint64_t distance) const {
    if (!following) return false;
    std::uint64_t ahead = 0;
    for (std::size_t i = trace_at; i < trace.size() && ahead <= distance; ++i) {
      if (trace[i] == p) return true;
      if (holding[trace[i]] == Holding::kPartitioned) ahead += plan->layout().param(trace[i]).numel;
    }
    return false;
  }

  // A parameter held whole: its weights.
  std::span<float> WholeWeights(std::size_t p) {
    return holding[p] == Holding::kLoop ? params[p].weights : std::span<float>(whole[p]);
  }

  // Rank `rank`'s partition elements [partition_offset, + out.size()) from the weights of the
  // parameters held whole (padding and partitioned parameters' elements 0).
  void PackWeights(int rank, std::uint64_t partition_offset, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);
    for (const partition::Fragment& f :
         plan->FragmentsInPartitionRange(rank, partition_offset, out.size())) {
      if (holding[f.param_index] == Holding::kPartitioned) continue;
      std::copy_n(WholeWeights(f.param_index).data() + f.param_offset, f.numel,
                  out.data() + (f.partition_offset - partition_offset));
    }
  }

  // The reverse: rank `rank`'s partition elements [partition_offset, + in.size()) into the
  // weights of the parameters held whole, rounded to the working precision, and this rank's
  // own into the shards it keeps in memory (fp32: a gather rounds them).
  void UnpackWeights(int rank, std::uint64_t partition_offset, std::span<const float> in,
                     Working working, int my_rank) {
    for (const partition::Fragment& f :
         plan->FragmentsInPartitionRange(rank, partition_offset, in.size())) {
      const float* src = in.data() + (f.partition_offset - partition_offset);
      if (holding[f.param_index] == Holding::kPartitioned) {
        if (rank == my_rank && f.partition_offset + f.numel <= shard.size()) {
          std::copy_n(src, f.numel, shard.data() + f.partition_offset);
        }
        continue;
      }
      Round(std::span<const float>(src, f.numel),
            WholeWeights(f.param_index).subspan(f.param_offset, f.numel), working);
    }
  }

  static void Round(std::span<const float> in, std::span<float> out, Working working) {
    switch (working) {
      case Working::kBf16:
        for (std::size_t k = 0; k < in.size(); ++k) out[k] = RoundToBf16(in[k]);
        break;
      case Working::kFp16:
        for (std::size_t k = 0; k < in.size(); ++k) out[k] = RoundToFp16(in[k]);
        break;
      case Working::kFp32:
        std::copy_n(in.data(), in.size(), out.data());
        break;
    }
  }
};

ZeroEngine::ZeroEngine(const comm::Communicator& world, const config::Config& config,
                       const EngineOptions& options)
    : impl_(std::make_unique<Impl>(this, world, config, options)) {}

ZeroEngine::~ZeroEngine() = default;

ZeroEngine::Impl::Impl(ZeroEngine* self, const comm::Communicator& world,
                       const config::Config& config, const EngineOptions& options)
    : self_(self),
      world_(world),
      config_(config),
      options_(options),
      state_(std::make_unique<State>()) {
  state_->scaler.emplace(config.fp16);
}

ZeroEngine::Impl::~Impl() {
  if (closed_) return;
  // Local: a garbage collector runs a destructor at different times on different ranks, so it
  // never waits for them. They are told, so that none waits for this rank in a collective.
  if (state_->swapper) {
    ZINF_LOG_WARN(
        "engine: destroyed without Close(): closed on this rank only; another rank "
        "that waits for it in a collective of this engine ends the job");
  }
  CloseLocally("its engine was destroyed without Close()");
}

const comm::Communicator& ZeroEngine::Impl::comm() const {
  return state_->comm ? *state_->comm : world_;
}

void ZeroEngine::Impl::CloseLocally(std::string_view reason) {
  closed_ = true;
  State& s = *state_;
  s.buckets.reset();     // joins its worker before the swapper goes
  s.speculator.reset();  // likewise, and waits for its writes
  s.reader.reset();      // likewise
  if (s.comm && !reason.empty()) {
    s.comm->Leave(fmt::format("rank {}: {}", world_.rank(), reason));
  }
  Status metrics = s.metrics.Close(options_.metrics_path);
  if (!metrics) ZINF_LOG_WARN("engine: {}", metrics.error().ToString());
  s.swapper.reset();  // drains its I/O, then closes (and unless keep_swap removes) the store
  s.stop_signals.reset();
}

void ZeroEngine::Impl::Detach(std::string_view reason) {
  if (!closed_ && state_->comm) {
    state_->comm->Leave(fmt::format("rank {}: {}", world_.rank(), reason), "Close");
  }
}

Status ZeroEngine::Impl::AgreeOnCall(std::string_view call, const Status& local) {
  if (closed_) return FailedPreconditionError(fmt::format("engine: {} after Close", call));
  if (state_->buckets) state_->buckets->WaitIdle();
  return comm().AgreeOnCall(call, local);
}

const partition::ParamLayout& ZeroEngine::Impl::layout() const { return state_->plan->layout(); }

double ZeroEngine::Impl::next_lr() const { return next_hyper_params(0).lr; }

HyperParams ZeroEngine::Impl::next_hyper_params(std::size_t g) const {
  ZINF_CHECK(g < groups_.size(), "parameter group {} of {}", g, groups_.size());
  return Scheduled(config_.scheduler, groups_[g], step_ - skipped_steps_ - 1);
}

Status ZeroEngine::Impl::SetHyperParams(std::span<const HyperParams> groups) {
  if (closed_) return FailedPreconditionError("engine: SetHyperParams after Close");
  if (config_.scheduler.type != config::SchedulerType::kNone) {
    return FailedPreconditionError(
        "engine: SetHyperParams: the config's scheduler block sets the learning rate; schedule "
        "it either there or in the loop, not both (remove the scheduler block to set it here)");
  }
  if (groups.size() != groups_.size()) {
    return InvalidArgumentError(
        fmt::format("engine: SetHyperParams: {} group(s) given, the engine has {}", groups.size(),
                    groups_.size()));
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    ZINF_RETURN_IF_ERROR(Annotate(swapper::ValidateAdamHyperParams(groups[g]),
                                  fmt::format("engine: SetHyperParams: group {}: ", g)));
  }
  groups_.assign(groups.begin(), groups.end());
  return OkStatus();
}

// Step's agreement on the groups' values: a rank whose loop set others must not diverge
// silently. One allreduce of the values and their negations (max and -min).
Status ZeroEngine::Impl::AgreeOnGroups(std::int64_t step) {
  constexpr std::array<const char*, 5> kNames = {"lr", "beta1", "beta2", "eps", "weight_decay"};
  const std::size_t n = groups_.size() * kNames.size();
  std::vector<double> values(2 * n);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const HyperParams& h = groups_[g];
    const std::array<double, 5> mine = {h.lr, h.betas[0], h.betas[1], h.eps, h.weight_decay};
    for (std::size_t k = 0; k < mine.size(); ++k) {
      values[g * kNames.size() + k] = mine[k];
      values[n + g * kNames.size() + k] = -mine[k];
    }
  }
  ZINF_RETURN_IF_ERROR(state_->comm->AllreduceInPlace<double>(values, ReduceOp::kMax));
  for (std::size_t i = 0; i < n; ++i) {
    if (values[i] != -values[n + i]) {
      return FailedPreconditionError(fmt::format(
          "engine: step {}: parameter group {}'s {} differs between the ranks ({} to {}); every "
          "rank must set the same values; nothing was stepped",
          step, i / kNames.size(), kNames[i % kNames.size()], -values[n + i], values[i]));
    }
  }
  return OkStatus();
}

// The checkpoint's "param_groups" (trainer_state.h): each group's values and parameters.
nlohmann::json ZeroEngine::Impl::GroupsJson() const {
  Json groups = Json::array();
  for (const HyperParams& h : groups_) {
    groups.push_back({{"lr", h.lr},
                      {"betas", {h.betas[0], h.betas[1]}},
                      {"eps", h.eps},
                      {"weight_decay", h.weight_decay},
                      {"params", Json::array()}});
  }
  for (const Param& p : state_->params) groups[p.group]["params"].push_back(p.name);
  return groups;
}

// A restore's check of the checkpoint's groups against this engine's, by parameter name.
Status ZeroEngine::Impl::CheckGroups(const TrainerState& saved,
                                     const checkpoint::CheckpointInfo& info) const {
  const std::size_t count = saved.param_groups.empty() ? 1 : saved.param_groups.size();
  for (const Param& p : state_->params) {
    const std::optional<std::size_t> at = info.layout->FindParam(p.name);
    if (!at) continue;  // the layout check names it
    const std::size_t was = saved.group_of.empty() ? 0 : saved.group_of[*at];
    if (was != p.group) {
      return FailedPreconditionError(fmt::format(
          "{}: parameter '{}' is in parameter group {} of the checkpoint but in group {} here; "
          "a checkpoint restores into the same groups",
          info.path, EscapeForTerminal(p.name), was, p.group));
    }
  }
  if (count != groups_.size()) {
    return FailedPreconditionError(
        fmt::format("{}: the checkpoint has {} parameter group(s), this model {}; a checkpoint "
                    "restores into the same groups",
                    info.path, count, groups_.size()));
  }
  return OkStatus();
}

double ZeroEngine::Impl::loss_scale() const { return state_->scaler->scale(); }

namespace {

// The parameters as a layout, after checking every buffer against its shape and the stage.
Result<partition::ParamLayout> LayoutOf(const std::vector<Param>& params, int stage) {
  if (params.empty()) return InvalidArgumentError("engine: no parameters");
  std::vector<partition::ParamSpec> specs;
  specs.reserve(params.size());
  for (const Param& p : params) specs.push_back({p.name, p.shape});
  ZINF_ASSIGN_OR_RETURN(partition::ParamLayout layout,
                        Annotate(partition::ParamLayout::Create(std::move(specs)), "engine: "));
  const bool lent = params[0].grads.empty();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const partition::ParamInfo& info = layout.params()[i];
    const std::string name = EscapeForTerminal(info.name);
    const bool no_weights = params[i].weights.empty();
    const bool no_grads = params[i].grads.empty();
    if ((!no_weights && params[i].weights.size() != info.numel) ||
        (!no_grads && params[i].grads.size() != info.numel)) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' of shape {} has {} elements, but its weights buffer holds "
          "{} and its grads buffer {}",
          i, name, partition::FormatShape(info.shape), info.numel, params[i].weights.size(),
          params[i].grads.size()));
    }
    if (no_weights && stage != 3) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' has no weights buffer: only zero_optimization.stage 3 "
          "partitions parameters (this config has stage {})",
          i, name, stage));
    }
    if (no_grads != lent) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' {} a grads buffer and parameter 0 '{}' {}: register "
          "grads for every parameter, or for none and lend them with GradientReady(index, grad)",
          i, name, no_grads ? "has no" : "has", EscapeForTerminal(layout.params()[0].name),
          lent ? "has none" : "has one"));
    }
  }
  if (lent && stage < 2) {
    return InvalidArgumentError(
        "engine: the parameters have no grads buffers: lent gradients (GradientReady(index, "
        "grad)) are partitioned as they arrive, which needs zero_optimization.stage 2 or 3 "
        "(stage 1 keeps the whole gradient)");
  }
  // A buffer registered twice (two names, or weights and grads alike) would be written twice
  // per step: its parameters would silently train on each other's values.
  struct Buffer {
    const float* begin;
    const float* end;
    std::size_t param;
    const char* what;
  };
  std::vector<Buffer> buffers;
  for (std::size_t i = 0; i < params.size(); ++i) {
    for (auto [span, what] :
         {std::pair{params[i].weights, "weights"}, {params[i].grads, "grads"}}) {
      if (!span.empty()) buffers.push_back({span.data(), span.data() + span.size(), i, what});
    }
  }
  std::sort(buffers.begin(), buffers.end(),
            [](const Buffer& x, const Buffer& y) { return x.begin < y.begin; });
  for (std::size_t i = 1; i < buffers.size(); ++i) {
    const Buffer& a = buffers[i - 1];
    const Buffer& b = buffers[i];
    if (b.begin < a.end) {
      return InvalidArgumentError(fmt::format(
          "engine: the {} buffer of parameter '{}' overlaps the {} buffer of parameter '{}'; "
          "every parameter needs weights and grads of its own",
          b.what, EscapeForTerminal(layout.params()[b.param].name), a.what,
          EscapeForTerminal(layout.params()[a.param].name)));
    }
  }
  return layout;
}

// The groups' values (EngineOptions::param_groups over the config optimizer's), with every
// parameter's group in range.
Result<std::vector<HyperParams>> ResolveGroups(const config::OptimizerConfig& optimizer,
                                               const std::vector<ParamGroup>& groups,
                                               const std::vector<Param>& params) {
  const HyperParams config = {.lr = optimizer.lr,
                              .betas = optimizer.betas,
                              .eps = optimizer.eps,
                              .weight_decay = optimizer.weight_decay};
  if (groups.size() > kMaxParamGroups) {
    return InvalidArgumentError(
        fmt::format("engine: {} param_groups; at most {}", groups.size(), kMaxParamGroups));
  }
  std::vector<HyperParams> out;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const HyperParams h = {.lr = groups[g].lr.value_or(config.lr),
                           .betas = groups[g].betas.value_or(config.betas),
                           .eps = groups[g].eps.value_or(config.eps),
                           .weight_decay = groups[g].weight_decay.value_or(config.weight_decay)};
    ZINF_RETURN_IF_ERROR(Annotate(swapper::ValidateAdamHyperParams(h),
                                  fmt::format("engine: param_groups[{}]: ", g)));
    out.push_back(h);
  }
  if (out.empty()) out.push_back(config);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].group >= out.size()) {
      return InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' is in group {}, but there {} {} parameter group(s)", i,
          EscapeForTerminal(params[i].name), params[i].group, out.size() == 1 ? "is" : "are",
          out.size()));
    }
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<ZeroEngine>> ZeroEngine::Create(const comm::Communicator& world,
                                                       const config::Config& config,
                                                       std::vector<Param> params,
                                                       const EngineOptions& options) {
  std::unique_ptr<ZeroEngine> engine(new ZeroEngine(world, config, options));
  Impl& impl = *engine->impl_;
  Status created = impl.Build(std::move(params));
  if (created) created = impl.InitializeOrRestore();
  if (!created) {
    impl.CloseLocally({});  // agreed: every rank drops its engine here, nobody to tell
    return std::move(created).error();
  }
  Impl::State& s = *impl.state_;
  s.last_step_end = MonotonicSeconds();
  s.loop_start = s.last_step_end;
  s.io_mark = s.swapper->io_counters();
  s.first_step = impl.step_ + 1;
  return engine;
}

Status ZeroEngine::Impl::Build(std::vector<Param> params) {
  State& s = *state_;
  s.rss_before_engine = CurrentRssBytes();
  if (Status usable = config::CheckEngineConfig(config_); !usable) {
    return comm().AgreeOnStatus(std::move(usable));
  }
  if (config_.world_size != world_.size()) {
    return comm().AgreeOnStatus(InvalidArgumentError(fmt::format(
        "engine: the config was parsed for {} ranks, the world has {} (batch sizes depend on it)",
        config_.world_size, world_.size())));
  }
  // Every rank checks its own buffers; agree before the first collective.
  Result<partition::ParamLayout> layout = LayoutOf(params, config_.zero_optimization.stage);
  Result<std::vector<HyperParams>> groups =
      ResolveGroups(config_.optimizer, options_.param_groups, params);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(!layout   ? Status(layout.error())
                                            : !groups ? Status(groups.error())
                                                      : OkStatus()));
  groups_ = std::move(*groups);
  s.params = std::move(params);
  // The engine's own failure domain (comm/communicator.h): its agreements wait at most
  // zinf.collective_timeout_seconds, and end at once when a rank destroys its engine.
  ZINF_ASSIGN_OR_RETURN(s.comm, world_.DupDomain());
  s.comm->SetWaitTimeout(std::chrono::seconds(config_.zinf.collective_timeout_seconds));
  // Speculating, every rank owns a part of every parameter (as at stage 3), so that each rank's
  // partition fills from its end as the backward pass goes: a flat partition of the first
  // parameters would complete only when the pass ends.
  const bool speculating = SpeculationWanted(
      config_.zinf.swap_gradients,
      config_.zero_optimization.offload_optimizer.device == config::OffloadDevice::kCpu);
  ZINF_ASSIGN_OR_RETURN(s.plan, partition::PartitionPlan::Create(
                                    *layout, {.kind = speculating ? partition::PlanKind::kPerParam
                                                                  : ToPlanKind(config_),
                                              .world_size = world_.size(),
                                              .alignment_elems = kPartitionAlignmentElems}));
  s.total_numel = s.plan->layout().total_numel();
  s.partition_numel = s.plan->partition_numel();
  for (const partition::Fragment& f : s.plan->RankFragments(world_.rank())) {
    const std::size_t g = s.params[f.param_index].group;
    if (s.group_runs.empty()) {
      s.group_runs.emplace_back(0, g);
    } else if (s.group_runs.back().second != g) {
      s.group_runs.emplace_back(f.partition_offset, g);
    }
  }
  if (s.group_runs.empty()) s.group_runs.emplace_back(0, 0);  // a rank of padding only
  if (s.partition_numel > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    return comm().AgreeOnStatus(InvalidArgumentError(fmt::format(
        "engine: {} parameters per rank exceed what one MPI collective moves ({}); run on more "
        "ranks",
        s.partition_numel, std::numeric_limits<int>::max())));
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(s.PlanHolding(config_)));
  if (speculating) ShapeForSpeculation(s.partition_numel);
  swapper::SwapperOptions options = ToSwapperOptions(config_, world_.rank(), s.plan->layout());
  // Stores left by killed runs are scratch: this job's own is reused, other jobs' are removed
  // once every rank's store is open (SwapStore::ReclaimStale; kept ones are named in a WARN).
  options.store.reclaim_stale = !config_.zinf.keep_swap;
  options.accumulation_memory_limit_bytes = options_.gradient_memory_limit_bytes;
  // Before anything large is allocated: the plan against the budget, refused on every rank.
  Result<MemoryBudget> budget =
      ResolveHostMemoryBudget(config_.zinf.host_memory_budget, world_.topology().local_size);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(budget ? OkStatus() : Status(budget.error())));
  // Speculation keeps up to one more slot per swapped sub-group (the swapper caps it).
  options.speculative_slots = speculating ? SIZE_MAX : 0;
  options.speculate_resident = speculating && options.host_cache_bytes > 0;
  if (speculating && !config_.Gave("zinf.speculative_step")) {
    // Unasked for, the speculation's memory (the kept weights, the host tier's copy) gives way
    // before anything the fit would shrink for it; every rank decides as the tightest one.
    Result<MemoryPlan> plan = MakeMemoryPlan(options);
    std::array<std::uint64_t, 1> over = {
        plan && budget->node_bytes > 0 && plan->total_bytes() > budget->rank_bytes ? 1u : 0u};
    ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(over, ReduceOp::kMax));
    if (over[0] != 0) {
      ZINF_LOG_INFO(
          "engine: no speculative step: its memory does not fit the host memory budget with "
          "the rest of the plan; set zinf.speculative_step to decide");
      options.speculative_slots = 0;
      options.speculate_resident = false;
    }
  }
  ZINF_RETURN_IF_ERROR(FitMemoryPlan(*budget, options));
  if (options.swap_gradients) options.speculative_slots = 0;  // the fit swaps the gradient
  Status planned = comm().AgreeOnStatus(PlanHostMemory(*budget, options));
  if (!planned && options.speculate_resident && options.speculative_slots > 0) {
    // The host tier's second copy gives way first: its sub-groups are then stepped by Step.
    ZINF_LOG_INFO(
        "engine: the speculative step leaves the host tier's sub-groups to Step: their second "
        "copy does not fit the host memory budget");
    options.speculate_resident = false;
    planned = comm().AgreeOnStatus(PlanHostMemory(*budget, options));
  }
  ZINF_RETURN_IF_ERROR(planned);
  std::uint64_t whole_numel = 0;
  for (const auto& [begin, end] : s.whole_ranges) whole_numel += end - begin;
  const std::uint64_t round = s.GatherRound(config_, world_.size());
  ZINF_LOG_INFO(
      "engine: {} parameters in {} tensors; partition {} elements per rank; weights held whole "
      "gathered in {} round(s) of {} elements per rank",
      s.total_numel, s.params.size(), s.partition_numel, (whole_numel + round - 1) / round, round);
  if (config_.zero_optimization.stage == 3) {
    std::size_t loop = 0, persistent = 0;
    for (Holding h : s.holding) {
      loop += h == Holding::kLoop ? 1 : 0;
      persistent += h == Holding::kPersistent ? 1 : 0;
    }
    ZINF_LOG_INFO(
        "engine: stage 3: {} parameter(s) partitioned (shards {}), {} persistent (whole on every "
        "rank, at most {} elements each), {} whole in the loop's weights buffers",
        s.num_partitioned, ShardWhereabouts(config_, s.shard_numel, s.partition_numel), persistent,
        config_.zero_optimization.stage3_param_persistence_threshold, loop);
  }
  s.shard.assign(s.shard_numel, 0.0f);
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] == Holding::kPersistent)
      s.whole[p].assign(s.plan->layout().param(p).numel, 0.0f);
  }
  s.gather_send.assign(round, 0.0f);
  s.gather_recv.assign(round * static_cast<std::uint64_t>(world_.size()), 0.0f);
  ZINF_ASSIGN_OR_RETURN(s.backend, comm::CreateCollectiveBackend(*s.comm, comm::BackendKind::kMpi));

  if (options_.create_nvme_paths) {
    Status created = OkStatus();
    for (const std::string& path :
         config_.zero_optimization.offload_optimizer.resolved_nvme_paths) {
      std::error_code ec;
      std::filesystem::create_directories(path, ec);
      if (ec) {
        created = ErrnoError(ec.value(), fmt::format("create swap directory {}", path));
        break;
      }
    }
    ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(created));
  }
  ZINF_LOG_INFO("engine: job id {}", options.store.job_id);
  Result<std::unique_ptr<swapper::OptimizerSwapper>> created =
      swapper::CreateOptimizerSwapper(*s.comm, *s.plan, options);
  if (!created && options.speculative_slots > 0 &&
      created.error().code() == ErrorCode::kResourceExhausted) {
    // The speculation's second slots do not fit (the same error on every rank): unasked for,
    // it gives way; asked for, the error says what it costs.
    if (config_.Gave("zinf.speculative_step")) {
      return std::move(created).error().WithContext(
          "zinf.speculative_step keeps a second slot per swapped sub-group (false halves the "
          "swap store): ");
    }
    ZINF_LOG_INFO(
        "engine: no speculative step: the swap store with a second slot per sub-group does not "
        "fit ({}); set zinf.speculative_step to decide",
        created.error().message());
    options.speculative_slots = 0;
    created = swapper::CreateOptimizerSwapper(*s.comm, *s.plan, options);
  }
  ZINF_RETURN_IF_ERROR(created);
  s.swapper = std::move(*created);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(s.CreateReader(config_)));
  if (s.swapper->gradient_swapper() == nullptr) {
    s.partition_grad.assign(s.partition_numel, 0.0f);
  } else {
    ZINF_ASSIGN_OR_RETURN(
        s.staging, storage::AlignedBuffer::Allocate(s.partition_numel * sizeof(float),
                                                    {.register_cuda = false, .zero = false}));
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(CreateBuckets()));
  config_.zinf.speculative_step = s.speculator != nullptr;  // what config() reports

  if (options_.stop_signals) s.stop_signals.emplace();
  // Rank 0 appends to the metrics of a resumed run and starts a fresh file otherwise: opened
  // after the restore decides which (InitializeOrRestore).
  s.tty = options_.progress && world_.rank() == 0 && isatty(STDERR_FILENO) == 1;
  return OkStatus();
}

// What this rank will hold in host memory (memory_plan.h), each item from the owning module's
// planning function. Local; allocates nothing.
Result<MemoryPlan> ZeroEngine::Impl::MakeMemoryPlan(const swapper::SwapperOptions& options) const {
  const State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  const partition::ParamLayout& layout = s.plan->layout();
  const auto world = static_cast<std::uint64_t>(world_.size());
  constexpr std::uint64_t kF = sizeof(float);
  MemoryPlan plan;
  std::uint64_t loop_floats = 0, persistent = 0, partitioned = 0, largest_partitioned = 0;
  std::uint64_t largest_on_disk = 0;
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    loop_floats += s.params[p].weights.size() + s.params[p].grads.size();
  }
  // The registered buffers exist before Create: counted once, as their own item.
  plan.Add("this process before the engine (its RSS then, less the registered buffers)",
           s.rss_before_engine - std::min(s.rss_before_engine, loop_floats * kF),
           "a smaller program around the engine");
  for (const HostMemoryUse& use : options_.host_memory_uses) {
    plan.Add(use.name, use.bytes, use.shrink);
  }
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] == Holding::kPersistent) persistent += layout.param(p).numel;
    if (s.holding[p] != Holding::kPartitioned) continue;
    const std::uint64_t whole = s.plan->ShardNumel(p) * world;  // GatherParams' size
    partitioned += whole;
    largest_partitioned = std::max(largest_partitioned, whole);
    if (s.plan->ShardPartitionOffset(p) + s.plan->ShardNumel(p) > s.shard_numel) {
      largest_on_disk = std::max(largest_on_disk, s.plan->ShardNumel(p));
    }
  }
  // Stage 3: a model registered with its weights is what shrinks most.
  plan.Add("the caller's registered weights and gradients", loop_floats * kF,
           "ZeRO stage 3 with the parameters registered without weights and gradients");
  plan.Add("persistent stage-3 parameters", persistent * kF,
           "zero_optimization.stage3_param_persistence_threshold, "
           "stage3_model_persistence_threshold");
  plan.Add("fp32 shards in memory", s.shard_numel * kF,
           "zero_optimization.offload_param.device \"nvme\" with offload_param.max_in_cpu");
  plan.Add("all-gather rounds", s.GatherRound(config_, world_.size()) * (1 + world) * kF,
           "zero_optimization.allgather_bucket_size");
  if (s.num_partitioned > 0) {
    // A Gather that asks more than the window at once holds what it asks (the largest
    // parameter at least).
    const std::uint64_t window = std::max(
        std::min<std::uint64_t>(zero.stage3_max_live_parameters, partitioned), largest_partitioned);
    plan.Add("stage-3 live parameters", window * kF,
             "zero_optimization.stage3_max_live_parameters");
  }
  if (largest_on_disk > 0) {
    const std::uint64_t staging = kShardStagingBytes + 2 * 4096;  // AllocateShardStaging's
    plan.Add("shard read-ahead",
             ShardReader::PlanBytes(static_cast<std::size_t>(zero.offload_param.buffer_count),
                                    zero.stage3_prefetch_bucket_size, largest_on_disk) +
                 2 * staging,
             "zero_optimization.stage3_prefetch_bucket_size, offload_param.buffer_count");
  }
  ZINF_ASSIGN_OR_RETURN(const swapper::SwapperHostPlan swap,
                        swapper::PlanSwapperHostMemory(*s.plan, world_.rank(), options));
  plan.Add("swap buffer pool", swap.pool_bytes,
           "zinf.pinned_budget_bytes, offload_optimizer.buffer_count, "
           "zero_optimization.sub_group_size");
  plan.Add("optimizer state in memory", swap.resident_bytes,
           "zinf.host_cache_bytes, offload_optimizer.device \"nvme\"");
  plan.Add("its second copy for the speculative step", swap.resident_spare_bytes,
           "zinf.speculative_step false, zinf.host_cache_bytes");
  const bool lent = s.params.empty() || s.params[0].grads.empty();
  const GradientBuckets::HostPlan buckets =
      GradientBuckets::PlanHostMemory(*s.plan, world_.rank(), zero.reduce_bucket_size, lent,
                                      options.swap_gradients ? swap.max_sub_group_numel : 0);
  plan.Add("reduce buckets", buckets.bucket_bytes, "zero_optimization.reduce_bucket_size");
  if (options.swap_gradients) {
    plan.Add("gradient swapper", swap.gradient_bytes,
             "a partition gradient above the accumulation limit is swapped");
    plan.Add("gradient staging", buckets.staging_bytes,
             "zero_optimization.reduce_bucket_size, sub_group_size");
  } else {
    plan.Add("partition gradient", s.partition_numel * kF, "zinf.swap_gradients");
  }
  if (options.speculative_slots > 0 && !options.swap_gradients) {
    // The speculated sub-groups' new weights wait for Step's sink (those it writes anything of).
    ZINF_ASSIGN_OR_RETURN(
        const partition::SubGroupPlan sub_groups,
        partition::SubGroupPlan::Create(*s.plan, world_.rank(), options.sub_group_size));
    std::uint64_t kept = 0;
    for (const partition::SubGroup& sg : sub_groups.sub_groups()) {
      if (SinkWrites(sg.partition_offset, sg.numel)) kept += sg.numel;
    }
    plan.Add("speculative step's new weights", kept * kF, "zinf.speculative_step false");
  }
  return plan;
}

// The host-memory keys the config left unset (Config::Gave), shrunk until this rank's plan
// fits the budget, in the order of what they cost: the reduce buckets and the live window
// (more, smaller collectives), sub-groups down to 4M elements (more, smaller I/Os), the fp32
// shards kept in memory (offload_param nvme: read when gathered) and their read-ahead, the
// partition gradient (swapped), then sub-groups and buckets down to their floors. Each goes down
// the powers of two until the plan fits or the key is at its floor, and keeps the value of the
// smallest plan on the way (its own when none was smaller). The ranks then take the smallest of
// each (every rank must cut the reduce buckets alike). Keys given are kept as given; what still
// does not fit is PlanHostMemory's error. Collective.
Status ZeroEngine::Impl::FitMemoryPlan(const MemoryBudget& budget,
                                       swapper::SwapperOptions& options) {
  State& s = *state_;
  config::ZeroConfig& zero = config_.zero_optimization;
  const config::ZeroConfig before = zero;
  // zinf.swap_gradients as a size: 1 keeps the partition gradient in memory, 0 swaps it.
  std::uint64_t keep_gradient = options.swap_gradients ? 0 : 1;
  struct SizingStep {
    std::string_view key;
    std::uint64_t* value;
    std::uint64_t floor;
  };
  std::vector<SizingStep> steps;
  auto add = [&](std::string_view key, std::uint64_t* value, std::uint64_t floor, bool applies) {
    if (applies && !config_.Gave(key)) steps.push_back({key, value, floor});
  };
  const bool stage3 = s.num_partitioned > 0;
  std::uint64_t largest_partitioned = 0;  // whole, as gathered: the live window's floor
  for (std::size_t p = 0; p < s.params.size(); ++p) {
    if (s.holding[p] != Holding::kPartitioned) continue;
    largest_partitioned = std::max(largest_partitioned, s.plan->ShardNumel(p) * world_.size());
  }
  add("zero_optimization.reduce_bucket_size", &zero.reduce_bucket_size, 1u << 20, true);
  add("zero_optimization.allgather_bucket_size", &zero.allgather_bucket_size,
      (1u << 20) * static_cast<std::uint64_t>(world_.size()), true);
  add("zero_optimization.stage3_max_live_parameters", &zero.stage3_max_live_parameters,
      largest_partitioned, stage3);
  add("zero_optimization.sub_group_size", &zero.sub_group_size, 1u << 22, true);
  add("zero_optimization.offload_param.max_in_cpu", &zero.offload_param.max_in_cpu, 0,
      stage3 && zero.offload_param.device == config::OffloadDevice::kNvme);
  add("zero_optimization.stage3_prefetch_bucket_size", &zero.stage3_prefetch_bucket_size, 0,
      stage3 && zero.offload_param.device == config::OffloadDevice::kNvme);
  add("zinf.swap_gradients", &keep_gradient, 0,
      zero.offload_optimizer.device == config::OffloadDevice::kNvme);
  add("zero_optimization.sub_group_size", &zero.sub_group_size, partition::kDefaultMinSwapNumel,
      true);
  add("zero_optimization.reduce_bucket_size", &zero.reduce_bucket_size, 1, true);

  // The options and the holding plan after a change; an error when the holding plan refuses it
  // (offload_param nvme: a shard on disk above offload_param.buffer_size). A gradient swapped
  // for the plan's sake is swapped whole: none of it accumulates in memory
  // (EngineOptions::gradient_memory_limit_bytes).
  const std::uint64_t accumulation_limit = options.accumulation_memory_limit_bytes;
  auto apply = [&] {
    options.sub_group_size = zero.sub_group_size;
    options.swap_gradients = keep_gradient == 0;
    options.accumulation_memory_limit_bytes =
        options.swap_gradients && !config_.Gave("zinf.swap_gradients") ? 0 : accumulation_limit;
    return s.PlanHolding(config_);
  };
  // A plan that cannot be made (a pinned pool too small for a sub-group) fits nothing: the
  // keys shrink on; what is left is PlanHostMemory's error.
  auto total = [&]() -> std::uint64_t {
    Result<MemoryPlan> plan = MakeMemoryPlan(options);
    return plan ? plan->total_bytes() : UINT64_MAX;
  };
  // Twice: a key early in the order that could not help while a later one kept the plan from
  // being made (or from moving) gets its turn again.
  for (int pass = 0; pass < 2 && budget.node_bytes > 0; ++pass) {
    for (const SizingStep& step : steps) {
      // The plan is not monotonic in every key (below the swapper's smallest swapped piece a
      // sub-group's gradient stays in memory): the value of the smallest plan is kept.
      std::uint64_t best = *step.value, best_total = total();
      while (best_total > budget.rank_bytes && *step.value > step.floor) {
        const std::uint64_t was = *step.value;
        *step.value = std::max(std::bit_floor(*step.value - 1), step.floor);  // powers of 2
        if (!apply()) {
          *step.value = was;
          break;
        }
        const std::uint64_t now = total();
        if (now < best_total) {
          best = *step.value;
          best_total = now;
        }
      }
      *step.value = best;
      (void)apply();  // a value it accepted before
    }
  }
  std::array<std::uint64_t*, 7> sizes = {&zero.reduce_bucket_size,
                                         &zero.allgather_bucket_size,
                                         &zero.stage3_max_live_parameters,
                                         &zero.sub_group_size,
                                         &zero.offload_param.max_in_cpu,
                                         &zero.stage3_prefetch_bucket_size,
                                         &keep_gradient};
  std::array<std::uint64_t, 7> chosen;
  for (std::size_t i = 0; i < sizes.size(); ++i) chosen[i] = *sizes[i];
  ZINF_RETURN_IF_ERROR(comm().AllreduceInPlace<std::uint64_t>(chosen, comm::ReduceOp::kMin));
  for (std::size_t i = 0; i < sizes.size(); ++i) *sizes[i] = chosen[i];
  config_.zinf.swap_gradients = keep_gradient == 0;
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(apply()));

  std::vector<std::string> changed;
  auto note = [&](std::string_view key, std::uint64_t from, std::uint64_t to) {
    if (from != to) changed.push_back(fmt::format("{} {} (default {})", key, to, from));
  };
  note("reduce_bucket_size", before.reduce_bucket_size, zero.reduce_bucket_size);
  note("allgather_bucket_size", before.allgather_bucket_size, zero.allgather_bucket_size);
  note("stage3_max_live_parameters", before.stage3_max_live_parameters,
       zero.stage3_max_live_parameters);
  note("sub_group_size", before.sub_group_size, zero.sub_group_size);
  note("offload_param.max_in_cpu", before.offload_param.max_in_cpu, zero.offload_param.max_in_cpu);
  note("stage3_prefetch_bucket_size", before.stage3_prefetch_bucket_size,
       zero.stage3_prefetch_bucket_size);
  if (keep_gradient == 0 && !config_.Gave("zinf.swap_gradients")) {
    changed.push_back(
        fmt::format("zinf.swap_gradients true (default false), none of the gradient accumulated "
                    "in memory (the caller's limit was {})",
                    FormatBytes(accumulation_limit)));
  }
  if (!changed.empty()) {
    ZINF_LOG_INFO(
        "engine: host memory plan: sized what the config leaves unset to fit the budget of {} per "
        "rank ({}): {}; set a key to keep your own value",
        FormatBytes(budget.rank_bytes), budget.source, fmt::join(changed, ", "));
    // Memory is tight: buffers of 1 MiB and more (torch's activations and gathered weights
    // among them) get mappings of their own, returned to the system when freed, instead of
    // staying in glibc's heap once its dynamic threshold has grown past them. The environment's
    // MALLOC_MMAP_THRESHOLD_ wins.
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 1 << 20);
  }
  return OkStatus();
}

// The plan (MakeMemoryPlan) against the budget; one INFO line per node. Local (the same decision
// on every rank of a node; the caller agrees).
Status ZeroEngine::Impl::PlanHostMemory(const MemoryBudget& budget,
                                        const swapper::SwapperOptions& options) {
  State& s = *state_;
  ZINF_ASSIGN_OR_RETURN(const MemoryPlan plan, MakeMemoryPlan(options));
  s.plan_bytes = plan.total_bytes();
  s.budget_bytes = budget.node_bytes > 0 ? budget.rank_bytes : 0;
  // One line per node (its first rank), an exception to "INFO on rank 0": each node has its
  // own budget.
  if (world_.topology().local_rank == 0 &&
      static_cast<int>(GetLogLevel()) <= static_cast<int>(LogLevel::kInfo)) {
    LogLine(LogLevel::kInfo,
            fmt::format("engine: host memory plan on host {}: {} per rank ({}); budget {} per "
                        "rank ({} over {} rank(s), {})",
                        world_.topology().hostname, FormatBytes(s.plan_bytes), plan.Summary(4),
                        budget.node_bytes > 0 ? FormatBytes(budget.rank_bytes) : "unknown",
                        budget.node_bytes > 0 ? FormatBytes(budget.node_bytes) : "unknown",
                        world_.topology().local_size, budget.source));
  }
  return CheckMemoryPlan(plan, budget, world_.topology().local_size);
}

Status ZeroEngine::Impl::InitializeOrRestore() {
  State& s = *state_;
  const config::CheckpointConfig& ckpt = config_.zinf.checkpoint;
  const std::string load = options_.load.value_or(ckpt.load);
  std::string path;
  if (load == "latest" || load == "auto") {
    if (ckpt.dir.empty()) {
      return comm().AgreeOnStatus(InvalidArgumentError(fmt::format(
          "zinf.checkpoint.load: \"{}\" resumes from <dir>/latest, but zinf.checkpoint.dir is "
          "not set",
          load)));
    }
    // Any entry named `latest` (a link or a dangling one included) is resolved, so that a bad
    // one is an error rather than a silent fresh start.
    const std::string latest = ckpt.dir + "/latest";
    struct stat st {};
    if (::lstat(latest.c_str(), &st) == 0) {
      path = ckpt.dir;
    } else if (load == "latest") {
      return comm().AgreeOnStatus(NotFoundError(
          fmt::format("--resume latest: no checkpoint to resume from: {} does not exist", latest)));
    }
  } else if (!load.empty()) {
    path = load;
  }
  Status restored = path.empty() ? Initialize() : Restore(path, /*verify_before_write=*/false);
  ZINF_RETURN_IF_ERROR(restored);
  ZINF_RETURN_IF_ERROR(ReadBackWeights());
  // Rank 0 appends to the metrics of a resumed run and starts a fresh file otherwise.
  Status opened = OkStatus();
  if (world_.rank() == 0 && !options_.metrics_path.empty()) {
    // The user's own path (a link is followed): a fresh run truncates a regular file there; a
    // directory, FIFO, socket or device (or a link to one) is refused without being opened.
    Result<storage::UniqueFd> fd =
        storage::OpenFile(options_.metrics_path,
                          resumed_from_.empty() ? storage::FileAccess::kTruncateOrCreate
                                                : storage::FileAccess::kAppendOrCreate,
                          storage::Follow::kYes);
    if (fd) {
      s.metrics = std::move(*fd);
    } else {
      opened = std::move(fd).error().WithContext("--metrics: ");
    }
  }
  return comm().AgreeOnStatus(opened);
}

Status ZeroEngine::Impl::Initialize() {
  State& s = *state_;
  const double start = MonotonicSeconds();
  // Parameters without weights get their first values from Param::init, or from a checkpoint.
  Status inits = OkStatus();
  for (std::size_t p = 0; p < s.params.size() && inits; ++p) {
    if (s.holding[p] != Holding::kLoop && !s.params[p].init) {
      inits = InvalidArgumentError(fmt::format(
          "engine: parameter {} '{}' has neither weights nor init, and no checkpoint is "
          "restored (zinf.checkpoint.load): give Param::init its first values",
          p, EscapeForTerminal(s.params[p].name)));
    }
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(inits));
  // Each rank writes its partition of the initial weights, slice by slice.
  const swapper::InitialWeights initial = [&](std::uint64_t partition_offset,
                                              std::span<float> out) -> Status {
    s.PackWeights(world_.rank(), partition_offset, out);
    for (const partition::Fragment& f :
         s.plan->FragmentsInPartitionRange(world_.rank(), partition_offset, out.size())) {
      const Param& param = s.params[f.param_index];
      if (s.holding[f.param_index] == Holding::kLoop) continue;
      ZINF_RETURN_IF_ERROR(Annotate(
          param.init(f.param_offset, out.subspan(f.partition_offset - partition_offset, f.numel)),
          fmt::format("engine: parameter '{}' init: ", EscapeForTerminal(param.name))));
    }
    return OkStatus();
  };
  ZINF_RETURN_IF_ERROR(s.swapper->Initialize(initial));
  ZINF_LOG_INFO("engine: initialized {} parameters in {:.2f} s", s.total_numel,
                MonotonicSeconds() - start);
  step_ = 0;
  return OkStatus();
}

Status ZeroEngine::Impl::Restore(const std::string& path, bool verify_before_write) {
  State& s = *state_;
  // The trainer state is checked on every rank once the file's structure has been, before any
  // state is read: what zinf-ckpt verify checks (ReadTrainerState), then this run's fp16
  // limits on a copy of the scaler.
  std::optional<TrainerState> trainer;
  LossScaler scaler = *s.scaler;
  // Create (verify_before_write false): one pass, every chunk verified as it is read, and a bad
  // file fails the restore on every rank before any step runs; the store was created empty for
  // this engine and is discarded with it on error, so a verify-first pass would only cost time.
  // Load (true): the live store stays untouched unless the whole file verified (two reads).
  const checkpoint::CheckpointRestoreOptions restore_options{
      .verify_before_write = verify_before_write,
      .progress = options_.progress,
      .check_info = [&](const checkpoint::CheckpointInfo& info) -> Status {
        ZINF_ASSIGN_OR_RETURN(TrainerState read, ReadTrainerState(info));
        ZINF_RETURN_IF_ERROR(CheckGroups(read, info));
        ZINF_RETURN_IF_ERROR(Annotate(scaler.Restore(read.loss_scaler), info.path + ": "));
        trainer = std::move(read);
        return OkStatus();
      }};
  ZINF_ASSIGN_OR_RETURN(checkpoint::RestoredCheckpoint restored,
                        checkpoint::RestoreCheckpoint(*s.swapper, path, restore_options));
  if (!trainer) return InternalError("checkpoint restore succeeded without its trainer state");
  resumed_from_ = restored.path;
  resumed_world_size_ = restored.world_size;
  step_ = restored.step;
  // fp16: the skipped steps and the loss scale go on where they were (older checkpoints and
  // runs without fp16 have none: no step skipped, the config's first scale).
  skipped_steps_ = trainer->skipped_steps;
  *s.scaler = scaler;
  user_state_ = std::move(trainer->user);
  // Without a config scheduler the groups go on with the values they were saved with (as
  // torch's load_state_dict); under one, the schedule runs from this run's values.
  if (config_.scheduler.type == config::SchedulerType::kNone && !trainer->param_groups.empty()) {
    groups_ = trainer->param_groups;
  }
  ZINF_LOG_INFO("resumed from {} (step {}, saved on {} ranks, now {}) in {:.2f} s", restored.path,
                restored.step, restored.world_size, world_.size(), restored.seconds);
  return OkStatus();
}

// After Initialize or Restore: the committed weights into the parameters, this rank's part
// (ReadPartition, agreed) and then every rank's (GatherWholeWeights).
Status ZeroEngine::Impl::ReadBackWeights() {
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(
      Annotate(ReadPartition(), resumed_from_.empty() ? "reading the initial weights back: "
                                                      : "reading the restored weights back: ")));
  return GatherWholeWeights();
}

// This rank's committed fp32 weights from the swap store into its part of the parameters'
// weights, through the all-gather's send buffer or, when that is small, a 1 MiB one (so that a
// tiny allgather_bucket_size does not mean one read per element).
Status ZeroEngine::Impl::ReadPartition() {
  State& s = *state_;
  constexpr std::uint64_t kMinPieceNumel = std::uint64_t{1} << 18;
  std::vector<float> own;
  std::span<float> buffer(s.gather_send);
  if (buffer.size() < kMinPieceNumel && s.partition_numel > buffer.size()) {
    own.resize(std::min(kMinPieceNumel, s.partition_numel));
    buffer = own;
  }
  for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
    const partition::SubGroup& sg = s.swapper->swap_info(i).sub_group;
    for (std::uint64_t at = 0; at < sg.numel; at += buffer.size()) {
      const std::span<float> piece =
          buffer.first(std::min<std::uint64_t>(buffer.size(), sg.numel - at));
      ZINF_RETURN_IF_ERROR(s.swapper->ReadState(i, swapper::StateTensor::kFp32, at, piece));
      s.UnpackWeights(world_.rank(), sg.partition_offset + at, piece, Working::kFp32,
                      world_.rank());
    }
  }
  return OkStatus();
}

// Every rank's part of the weights of the parameters held whole (its partition's updated values,
// written there by the step's sink or ReadPartition) to every rank, in rounds of
// gather_send.size() elements per rank over whole_ranges: the engine never holds a copy of the
// model, and at stage 3 the partitioned parameters are not gathered here (Gather does).
Status ZeroEngine::Impl::GatherWholeWeights() {
  State& s = *state_;
  comm::ScopedTimer timer(s.timers, "allgather");
  const std::uint64_t round = s.gather_send.size();
  const int world = world_.size();
  // One round: pieces (partition offset, elements) of whole_ranges, at most `round` in all.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces;
  std::size_t range = 0;
  std::uint64_t at = s.whole_ranges.empty() ? 0 : s.whole_ranges[0].first;
  while (range < s.whole_ranges.size()) {
    pieces.clear();
    std::uint64_t n = 0;
    while (n < round && range < s.whole_ranges.size()) {
      const std::uint64_t take = std::min(round - n, s.whole_ranges[range].second - at);
      pieces.emplace_back(at, take);
      n += take;
      at += take;
      if (at == s.whole_ranges[range].second && ++range < s.whole_ranges.size()) {
        at = s.whole_ranges[range].first;
      }
    }
    const std::span<float> send(s.gather_send.data(), n);
    const std::span<float> recv(s.gather_recv.data(), n * static_cast<std::uint64_t>(world));
    std::uint64_t packed = 0;
    for (const auto& [offset, count] : pieces) {
      s.PackWeights(world_.rank(), offset, send.subspan(packed, count));
      packed += count;
    }
    ZINF_RETURN_IF_ERROR(s.backend->Allgather(send, recv));
    for (int r = 0; r < world; ++r) {
      std::uint64_t unpacked = static_cast<std::uint64_t>(r) * n;
      for (const auto& [offset, count] : pieces) {
        s.UnpackWeights(r, offset, recv.subspan(unpacked, count), WorkingOf(config_),
                        world_.rank());
        unpacked += count;
      }
    }
  }
  return OkStatus();
}

// The buckets the gradients are reduced in (gradient_buckets.h). Local.
Status ZeroEngine::Impl::CreateBuckets() {
  State& s = *state_;
  GradientBuckets::Target target;
  target.gradients = s.swapper->gradient_swapper();
  if (target.gradients != nullptr) {
    target.staging = s.staging.as<float>().first(s.partition_numel);
  } else {
    target.accumulated = s.partition_grad;
  }
  for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
    target.sub_groups.push_back(s.swapper->swap_info(i).sub_group);
  }
  if (s.swapper->options().speculative_slots > 0 && target.gradients == nullptr) {
    std::vector<bool> keep_weights;
    for (const partition::SubGroup& sg : target.sub_groups) {
      keep_weights.push_back(SinkWrites(sg.partition_offset, sg.numel));
    }
    s.speculator =
        std::make_unique<Speculator>(s.swapper.get(), s.partition_grad, std::move(keep_weights));
    target.complete = [spec = s.speculator.get()](std::size_t sub_group, int) {
      spec->Complete(sub_group);
    };
    ZINF_LOG_INFO(
        "engine: speculative step: each swapped sub-group is stepped during the last "
        "micro-batch's backward pass once its gradient is final, into a second slot, and "
        "committed by Step unless clipping or an fp16 skip applies (zinf.speculative_step)");
  }
  // Lent gradients (no grads buffers): none; GradientReady(index, grad) copies each in.
  std::vector<std::span<float>> grads;
  if (!s.params[0].grads.empty()) {
    for (const Param& p : s.params) grads.push_back(p.grads);
  }
  // A worker thread may call MPI while the caller's thread runs its backward pass only when MPI
  // allows calls from several threads, one at a time.
  const comm::ThreadLevel level = comm::ProvidedThreadLevel();
  const bool background =
      level == comm::ThreadLevel::kSerialized || level == comm::ThreadLevel::kMultiple;
  ZINF_ASSIGN_OR_RETURN(s.buckets, GradientBuckets::Create(
                                       *s.plan, world_.rank(), std::move(grads),
                                       config_.zero_optimization.reduce_bucket_size,
                                       s.backend.get(), std::move(target), &s.timers, background));
  ZINF_LOG_INFO(
      "engine: gradient in {} bucket(s) of <= {} elements; gradients handed per "
      "parameter are reduced {}",
      s.buckets->num_buckets(), s.buckets->max_bucket_elems(),
      background ? "on a background thread, overlapping the backward pass"
                 : "in the caller's thread (MPI gives no MPI_THREAD_SERIALIZED; "
                   "MpiSession::Init(..., ThreadLevel::kSerialized) lets them overlap)");
  return OkStatus();
}

// Collective: reduces what the micro-batch has not reduced yet and ends it.
Status ZeroEngine::Impl::HandGradient(int micro_batch) {
  return comm().AgreeOnStatus(state_->buckets->Finish(micro_batch));
}

Status ZeroEngine::Impl::GradientReady(std::size_t index) {
  if (closed_) return FailedPreconditionError("engine: GradientReady after Close");
  ArmSpeculation();
  return state_->buckets->Ready(index, state_->micro_batches);
}

Status ZeroEngine::Impl::GradientReady(std::size_t index, std::span<const float> grad) {
  if (closed_) return FailedPreconditionError("engine: GradientReady after Close");
  ArmSpeculation();
  return state_->buckets->Ready(index, state_->micro_batches, grad);
}

// ---- The speculative step (engine.h, "Speculative step") ----

bool ZeroEngine::Impl::SpeculationWanted(bool swap_gradients, bool all_resident) const {
  const State& s = *state_;
  const bool lent = s.params.empty() || s.params[0].grads.empty();
  const bool wanted = config_.Gave("zinf.speculative_step") ? config_.zinf.speculative_step : lent;
  return wanted && !swap_gradients && !all_resident;
}

// A sub-group is speculated once all of its gradient has been reduced: sub-groups and reduce
// buckets that are small parts of the partition (about an eighth, not below 4M elements each
// per rank) let the first ones finish early in the backward pass. Keys given stay as given.
void ZeroEngine::Impl::ShapeForSpeculation(std::uint64_t partition_numel) {
  config::ZeroConfig& zero = config_.zero_optimization;
  constexpr std::uint64_t kFloor = 1u << 22;
  const std::uint64_t part =
      std::max<std::uint64_t>(AlignUp(partition_numel / 8, kPartitionAlignmentElems), kFloor);
  if (!config_.Gave("zero_optimization.sub_group_size")) {
    zero.sub_group_size = std::min(zero.sub_group_size, part);
  }
  if (!config_.Gave("zero_optimization.reduce_bucket_size")) {
    zero.reduce_bucket_size =
        std::min(zero.reduce_bucket_size, part * static_cast<std::uint64_t>(world_.size()));
  }
}

// Whether Step's sink (UnpackWeights) writes anything of partition range [offset, + numel):
// the weights held whole, or the shards kept in memory.
bool ZeroEngine::Impl::SinkWrites(std::uint64_t partition_offset, std::uint64_t numel) const {
  const State& s = *state_;
  for (const partition::Fragment& f :
       s.plan->FragmentsInPartitionRange(world_.rank(), partition_offset, numel)) {
    if (s.holding[f.param_index] != Holding::kPartitioned ||
        f.partition_offset + f.numel <= s.shard_numel) {
      return true;
    }
  }
  return false;
}

// The first gradient handed in the step's last micro-batch: from here on each sub-group whose
// gradient is final is stepped ahead, with the step's arguments as Optimize will compute them
// when nothing clips (the loss scale and the schedule as they are now: Step compares).
void ZeroEngine::Impl::ArmSpeculation() {
  State& s = *state_;
  // After a step that clipped the next one is likely to clip too (a norm changes slowly): its
  // speculation would be stepped again, at the cost of its I/O, before this rank's gradients
  // could prove the clip (Speculator::Plan::clip_squared_sum), so it is not speculated.
  if (!s.speculator || s.speculator->armed() || s.last_step_clipped ||
      s.micro_batches + 1 != static_cast<int>(config_.gradient_accumulation_steps)) {
    return;
  }
  const std::int64_t step = step_ + 1;
  Result<std::vector<HyperParams>> hyper = StepHyperParams(step);
  if (!hyper) return;  // Step refuses it
  Speculator::Plan plan;
  plan.step = step;
  plan.segments = StepSegments(*hyper);
  plan.options = StepOptionsFor(StepPlan{.average = Average(), .loss_scale = s.scaler->scale()},
                                step - skipped_steps_);
  // Decide clips when sqrt(sum) x average / scale > gradient_clipping; a hair above that bound,
  // so that another order of summation cannot make a step that does not clip look clipped.
  if (config_.gradient_clipping > 0) {
    const double bound = config_.gradient_clipping * s.scaler->scale() / Average();
    plan.clip_squared_sum = bound * bound * (1 + 1e-6);
  }
  s.speculator->Arm(std::move(plan));
}

void ZeroEngine::Impl::UseSpeculation(const swapper::StepOptions& options, StepInfo* info) {
  State& s = *state_;
  const Speculator::Plan* plan = s.speculator ? s.speculator->plan() : nullptr;
  if (plan == nullptr) return;
  const auto same = [](const swapper::StepOptions& a, const swapper::StepOptions& b) {
    const auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
    return bits(a.grad_scale) == bits(b.grad_scale) && a.adam_step == b.adam_step && a.lr == b.lr &&
           a.betas == b.betas &&
           std::ranges::equal(a.segments, b.segments, [](const auto& x, const auto& y) {
             return x.begin == y.begin && x.hyper == y.hyper;
           });
  };
  if (plan->step == info->step && same(plan->options, options)) {
    for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
      if (!s.swapper->speculated(i)) continue;
      s.swapper->CommitSpeculated(i);
      const std::span<const float> weights = s.speculator->weights(i);
      if (!weights.empty()) {
        const partition::SubGroup& sg = s.swapper->swap_info(i).sub_group;
        s.UnpackWeights(world_.rank(), sg.partition_offset, weights, Working::kFp32, world_.rank());
      }
      ++info->speculation_committed;
    }
  } else {
    info->speculation_redone = s.swapper->num_speculated();
  }
  s.swapper->DiscardSpeculations();
  s.speculator->Disarm();
}

void ZeroEngine::Impl::DiscardSpeculation(StepInfo* info) {
  State& s = *state_;
  if (!s.speculator || !s.speculator->armed()) return;
  (void)s.speculator->Stop();
  if (info != nullptr) info->speculation_discarded = s.swapper->num_speculated();
  s.swapper->DiscardSpeculations();
  s.speculator->Disarm();
}

Status ZeroEngine::Impl::AccumulateGradients() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: AccumulateGradients after Close");
  Status calls = OkStatus();
  if (s.micro_batches + 1 >= config_.gradient_accumulation_steps) {
    calls = FailedPreconditionError(fmt::format(
        "engine: step {}: AccumulateGradients called {} times; gradient_accumulation_steps {} "
        "allows {} (Step takes the last micro-batch)",
        step_ + 1, s.micro_batches + 1, config_.gradient_accumulation_steps,
        config_.gradient_accumulation_steps - 1));
  }
  // The micro-batch's reductions come first, so that no rank enters another collective while
  // some rank's buckets are still being reduced.
  const Status handed = HandGradient(s.micro_batches);
  Status agreed = comm().AgreeOnCall("AccumulateGradients", calls);
  if (agreed && !handed) agreed = handed;
  if (!agreed) {
    DiscardSpeculation(nullptr);
    // Refused: the step's gradient is dropped, so that the loop goes on with a clean step
    // instead of adding this micro-batch twice. (A write-behind error of the dropped gradient
    // is dropped with it; a failing store fails the next write again.)
    (void)ForgetStepGradient();
    return agreed;
  }
  ++s.micro_batches;
  return OkStatus();
}

// The step's gradient forgotten: the next micro-batch is 0 again, which overwrites the reduced
// partition gradient; with zinf.swap_gradients the dropped micro-batch's write-behind is waited
// for, so that none of it lands after the next micro-batch 0's writes to the same sub-groups.
Status ZeroEngine::Impl::ForgetStepGradient() {
  State& s = *state_;
  s.micro_batches = 0;
  swapper::GradientSwapper* gradients = s.swapper->gradient_swapper();
  return gradients != nullptr ? gradients->Flush() : OkStatus();
}

Status ZeroEngine::Impl::DropGradients() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: DropGradients after Close");
  // The micro-batch's reductions first (as AccumulateGradients), then it is forgotten.
  const Status handed = HandGradient(s.micro_batches);
  DiscardSpeculation(nullptr);
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("DropGradients", ForgetStepGradient()));
  return handed;
}

// ---- Stage 3: Gather (engine.h, "Stage 3") ----

Result<Gathered> ZeroEngine::Gather(std::initializer_list<std::string_view> names) {
  return Gather(std::vector<std::string>(names.begin(), names.end()));
}

Result<Gathered> ZeroEngine::Impl::Gather(std::span<const std::string> names) {
  if (closed_) return FailedPreconditionError("engine: Gather after Close");
  std::vector<std::size_t> indices;
  indices.reserve(names.size());
  for (const std::string& name : names) {
    const std::optional<std::size_t> index = layout().FindParam(name);
    if (!index) {
      // Agreed with the other ranks' Gather (GatherParams), which fail alike.
      Status agreed = AgreeOnCall(
          "Gather", InvalidArgumentError(fmt::format("engine: Gather: no parameter is called '{}'",
                                                     EscapeForTerminal(name))));
      return std::move(agreed).error();
    }
    indices.push_back(*index);
  }
  return GatherByIndex(indices);
}

Result<Gathered> ZeroEngine::Impl::GatherByIndex(std::span<const std::size_t> params) {
  if (closed_) return FailedPreconditionError("engine: Gather after Close");
  ZINF_RETURN_IF_ERROR(GatherParams(params));
  State& s = *state_;
  Gathered gathered;
  gathered.engine_ = self_;
  gathered.params_.assign(params.begin(), params.end());
  for (std::size_t p : params) {
    const std::uint64_t numel = s.plan->layout().param(p).numel;
    gathered.weights_.push_back(s.holding[p] == Holding::kPartitioned
                                    ? std::span<const float>(s.whole[p]).first(numel)
                                    : std::span<const float>(s.WholeWeights(p)));
  }
  return gathered;
}

namespace {

// What a rank is about to gather (the asks, then everything it all-gathers), as one checksum.
std::uint64_t HashIndices(std::span<const std::size_t> asked, std::span<const std::size_t> todo) {
  std::vector<std::uint64_t> list(asked.begin(), asked.end());
  list.push_back(UINT64_MAX);  // no other list of indices hashes alike
  list.insert(list.end(), todo.begin(), todo.end());
  return storage::Checksum64(std::as_bytes(std::span<const std::uint64_t>(list)));
}

}  // namespace

// Collective. Checks the asks, decides what to all-gather (the asks not gathered yet and what the
// recorded order says comes next), agrees on it, reads the shards kept on disk, and all-gathers
// each parameter into its whole buffer. On success every asked parameter is held once more.
Status ZeroEngine::Impl::GatherParams(std::span<const std::size_t> asked) {
  State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  const partition::ParamLayout& layout = s.plan->layout();
  Status local = OkStatus();
  std::vector<bool> seen(s.params.size(), false);
  for (std::size_t p : asked) {
    if (p >= s.params.size()) {
      local = InvalidArgumentError(fmt::format(
          "engine: Gather: parameter index {} (there are {} parameters)", p, s.params.size()));
      break;
    }
    if (seen[p]) {
      local = InvalidArgumentError(fmt::format("engine: Gather: parameter '{}' asked twice",
                                               EscapeForTerminal(layout.param(p).name)));
      break;
    }
    seen[p] = true;
  }
  // What to all-gather: the asks not gathered now, then ahead of use.
  std::vector<std::size_t> todo;
  std::uint64_t todo_elems = 0;
  std::size_t ahead = 0;
  if (local) {
    for (std::size_t p : asked) {
      if (s.holding[p] != Holding::kPartitioned || !s.whole[p].empty()) continue;
      todo.push_back(p);
      todo_elems += layout.param(p).numel;
    }
    if (s.following && s.trace_at + asked.size() <= s.trace.size() &&
        std::equal(asked.begin(), asked.end(), s.trace.begin() + s.trace_at)) {
      s.trace_at += asked.size();
    } else {
      s.following = false;
    }
    std::uint64_t prefetch = 0;
    std::int64_t disk_ahead = 0;
    for (std::size_t i = s.trace_at; s.following && i < s.trace.size(); ++i) {
      const std::size_t p = s.trace[i];
      if (s.holding[p] != Holding::kPartitioned || !s.whole[p].empty() ||
          std::find(todo.begin(), todo.end(), p) != todo.end()) {
        continue;
      }
      const std::uint64_t numel = layout.param(p).numel;
      const bool disk = s.ShardOnDisk(p);
      if (prefetch + numel > zero.stage3_prefetch_bucket_size ||
          s.live_elems + todo_elems + numel > zero.stage3_max_live_parameters ||
          (disk && disk_ahead >= zero.offload_param.buffer_count)) {
        break;
      }
      todo.push_back(p);
      todo_elems += numel;
      prefetch += numel;
      disk_ahead += disk ? 1 : 0;
      ++ahead;
    }
  }
  // Every rank must gather the same parameters: the asks and the decision are agreed (ranks
  // whose Gathered scopes were released at different points decide differently).
  ZINF_RETURN_IF_ERROR(AgreeOnCall("Gather", local));
  const std::uint64_t decided = HashIndices(asked, todo);
  std::array<std::uint64_t, 2> hash = {decided, ~decided};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(hash, ReduceOp::kMax));
  if (hash[0] != ~hash[1]) {
    return FailedPreconditionError(
        "engine: Gather: the ranks ask for different parameters (or released their Gathered "
        "scopes at different points): every rank must make the same Gather calls in the same "
        "order");
  }
  s.recording.insert(s.recording.end(), asked.begin(), asked.end());
  // Make room: gathered parameters no scope holds go, oldest first, except those asked now.
  for (std::size_t i = 0;
       i < s.kept.size() && s.live_elems + todo_elems > zero.stage3_max_live_parameters;) {
    const std::size_t p = s.kept[i];
    if (seen[p]) {
      ++i;
      continue;
    }
    s.Drop(p);
    s.kept.erase(s.kept.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // This rank's shards: from memory, or read from the swap store (agreed before any
  // all-gather, so that a failed read leaves no rank waiting in one).
  std::vector<std::vector<float>> from_disk(todo.size());
  Status read = OkStatus();
  try {
    for (std::size_t i = 0; i < todo.size() && read; ++i) {
      const std::size_t p = todo[i];
      s.whole[p].assign(s.plan->ShardNumel(p) * static_cast<std::uint64_t>(world_.size()), 0.0f);
      if (!s.ShardOnDisk(p)) continue;
      ++s.counters.disk_reads;
      bool waited = true;
      std::optional<Result<std::vector<float>>> read_ahead =
          s.reader ? s.reader->Take(p, waited) : std::nullopt;
      s.counters.disk_waits += waited ? 1 : 0;
      s.counters.read_ahead += read_ahead ? 1 : 0;
      if (read_ahead && *read_ahead) {
        from_disk[i] = std::move(**read_ahead);
        continue;
      }
      if (read_ahead) {
        read = std::move(*read_ahead).error();
      } else {
        from_disk[i].assign(s.plan->ShardNumel(p), 0.0f);
        read = ReadShard(p, from_disk[i]);
      }
      read = Annotate(read, fmt::format("engine: Gather: reading the shard of parameter '{}': ",
                                        EscapeForTerminal(layout.param(p).name)));
    }
  } catch (const std::bad_alloc&) {
    read = ResourceExhaustedError(
        fmt::format("engine: Gather: no host memory for {} gathered elements (lower "
                    "stage3_prefetch_bucket_size or stage3_max_live_parameters)",
                    todo_elems));
  }
  // On failure nothing of this call stays gathered.
  auto fail = [&](Status failed) {
    for (std::size_t p : todo) std::vector<float>().swap(s.whole[p]);
    return failed;
  };
  read = comm().AgreeOnStatus(read);
  if (!read) return fail(std::move(read));
  {
    comm::ScopedTimer timer(s.timers, "param_allgather");
    for (std::size_t i = 0; i < todo.size(); ++i) {
      const std::size_t p = todo[i];
      const std::uint64_t n = s.plan->ShardNumel(p);
      const std::span<const float> mine =
          s.ShardOnDisk(p)
              ? std::span<const float>(from_disk[i])
              : std::span<const float>(s.shard).subspan(s.plan->ShardPartitionOffset(p), n);
      Status gathered = s.backend->Allgather(mine, s.whole[p]);
      if (!gathered) return fail(std::move(gathered));
      if (WorkingOf(config_) != Working::kFp32) {
        const std::span<float> weights = std::span<float>(s.whole[p]).first(layout.param(p).numel);
        State::Round(weights, weights, WorkingOf(config_));
      }
    }
  }
  for (std::size_t i = 0; i < todo.size(); ++i) {
    s.live_elems += layout.param(todo[i]).numel;
    // Gathered ahead of use: held by no scope until asked.
    if (i >= todo.size() - ahead) s.kept.push_back(todo[i]);
  }
  for (std::size_t p : asked) {
    if (++s.refs[p] == 1 && s.holding[p] == Holding::kPartitioned) {
      std::erase(s.kept, p);
    }
  }
  s.held_refs += asked.size();
  s.counters.calls += 1;
  s.counters.asked += asked.size();
  s.counters.gathered += todo.size();
  s.counters.prefetched += ahead;
  s.counters.served += asked.size() - (todo.size() - ahead);
  s.counters.peak_live_elems = std::max(s.counters.peak_live_elems, s.live_elems);
  s.ReadAhead();
  return OkStatus();
}

// ReadShardFrom in the caller's thread, through the engine's own staging buffer: in the middle of
// a micro-batch the gradient swapper may hold every pool buffer. Local.
Status ZeroEngine::Impl::ReadShard(std::size_t p, std::span<float> out) {
  State& s = *state_;
  if (s.shard_staging.empty()) {
    ZINF_ASSIGN_OR_RETURN(s.shard_staging, AllocateShardStaging(*s.swapper));
  }
  return ReadShardFrom(*s.swapper, *s.plan, p, out, s.shard_staging.span(), nullptr);
}

// Local: the scopes of `params` end; a parameter no scope holds stays gathered while the
// recorded order uses it again within stage3_max_reuse_distance elements (and
// stage3_max_live_parameters allows), else its whole weights go.
void ZeroEngine::Impl::ReleaseParams(std::span<const std::size_t> params) {
  if (closed_) return;
  State& s = *state_;
  const config::ZeroConfig& zero = config_.zero_optimization;
  for (std::size_t p : params) {
    --s.held_refs;
    if (--s.refs[p] > 0 || s.holding[p] != Holding::kPartitioned) continue;
    if (s.live_elems <= zero.stage3_max_live_parameters &&
        s.ReusedWithin(p, zero.stage3_max_reuse_distance)) {
      s.kept.push_back(p);
    } else {
      s.Drop(p);
    }
  }
}

Gathered::Gathered(Gathered&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      params_(std::move(other.params_)),
      weights_(std::move(other.weights_)) {}

Gathered& Gathered::operator=(Gathered&& other) noexcept {
  if (this != &other) {
    Release();
    engine_ = std::exchange(other.engine_, nullptr);
    params_ = std::move(other.params_);
    weights_ = std::move(other.weights_);
  }
  return *this;
}

std::span<const float> Gathered::operator[](std::size_t i) const {
  ZINF_CHECK(i < weights_.size(), "Gathered[{}]: {} parameters", i, weights_.size());
  return weights_[i];
}

std::span<const float> Gathered::Find(std::string_view name) const {
  if (engine_ == nullptr) return {};
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (engine_->layout().param(params_[i]).name == name) return weights_[i];
  }
  return {};
}

void Gathered::Release() {
  if (engine_ != nullptr) engine_->impl_->ReleaseParams(params_);
  engine_ = nullptr;
  params_.clear();
  weights_.clear();
}

// The squared L2 norm of this rank's reduced partition gradient.
Result<double> ZeroEngine::Impl::PartitionGradSquaredSum() {
  State& s = *state_;
  double sum = 0;
  // The Adam threads' SIMD sum: the same bits on every path and thread count (cpu_adam.h).
  auto add = [&sum, &s](std::span<const float> g) { sum += s.swapper->adam().SquaredL2Norm(g); };
  swapper::GradientSwapper* gradients = s.swapper->gradient_swapper();
  if (gradients == nullptr) {
    add(s.partition_grad);
    return sum;
  }
  // The accumulated gradient is in the gradient swapper: read it once through one pool buffer.
  ZINF_RETURN_IF_ERROR(s.swapper->FlushGradients());
  Status local = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(
        swapper::PoolLease lease,
        s.swapper->pool().Allocate(s.swapper->sub_groups().max_sub_group_numel(), 1));
    for (std::size_t i = 0; i < s.swapper->num_sub_groups(); ++i) {
      std::span<float> g = lease.floats(0).first(s.swapper->swap_info(i).sub_group.numel);
      ZINF_RETURN_IF_ERROR(gradients->SwapIn(i, g));
      add(g);
    }
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(local));
  return sum;
}

// Step in its phases: reduce the gradient, measure it (norm, loss, stop flag), decide (skip an
// fp16 overflow, refuse a zero or non-finite gradient, clip), optimize (the swapped Adam step at
// the scheduled hyper-parameters), gather the new weights, then report (FinishStep).
Result<StepInfo> ZeroEngine::Impl::Step(std::optional<double> loss) {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: Step after Close");
  StepInfo info;
  info.step = step_ + 1;
  // The step's swap I/O counts from the end of the previous one: earlier micro-batches'
  // write-behind and the swap-outs during the backward pass.
  const storage::SwapStore::IoCounters io_start = s.io_mark;
  // The speculation takes no more sub-groups (those the rest of the reduction completes are the
  // swapper's Step's); whatever this Step does not commit is discarded on the way out.
  if (s.speculator) s.speculator->Seal();
  struct Discard {
    Impl* impl;
    ~Discard() { impl->DiscardSpeculation(nullptr); }
  } discard{this};
  ZINF_RETURN_IF_ERROR(ReduceGradients(info.step));
  Status speculation = OkStatus();
  if (s.speculator && s.speculator->armed()) {
    speculation = s.speculator->Stop();
    info.speculated = s.swapper->num_speculated();
  }
  ZINF_ASSIGN_OR_RETURN(StepPlan plan, MeasureGradient(loss, &info));
  ZINF_RETURN_IF_ERROR(Decide(loss.has_value(), &plan, &info));
  const storage::SwapStore::IoCounters io_optimizer_start = s.swapper->io_counters();
  if (plan.skip) {
    // No swap I/O, the weights and the schedule stay; the gradient was consumed.
    DiscardSpeculation(&info);
    ZINF_RETURN_IF_ERROR(s.scaler->Update(/*overflow=*/true));
    return FinishStep(info, /*skipped=*/true, io_start, io_optimizer_start, io_optimizer_start,
                      0.0);
  }
  s.last_step_clipped = info.clipped;
  // A failed speculation fails the step on every rank, with nothing stepped (a step that is
  // skipped needs none of it).
  if (s.speculator) ZINF_RETURN_IF_ERROR(comm().AgreeOnStatus(speculation));
  ZINF_ASSIGN_OR_RETURN(const double optimizer_seconds, Optimize(plan, &info));
  const storage::SwapStore::IoCounters io_optimizer_end = s.swapper->io_counters();
  // The scale for the next step (a clean step may double it).
  ZINF_RETURN_IF_ERROR(s.scaler->Update(/*overflow=*/false));
  // The updated partitions into every parameter's weights.
  step_ = info.step;
  ZINF_RETURN_IF_ERROR(GatherWholeWeights());
  return FinishStep(info, /*skipped=*/false, io_start, io_optimizer_start, io_optimizer_end,
                    optimizer_seconds);
}

// Reduce: the last micro-batch's gradient is reduced (the earlier ones were), after the ranks
// agreed that they all make this call the same way: a rank whose loop made other calls must not
// leave the rest in a collective it skips.
Status ZeroEngine::Impl::ReduceGradients(std::int64_t step) {
  State& s = *state_;
  const int gas = static_cast<int>(config_.gradient_accumulation_steps);
  Status calls = OkStatus();
  if (s.micro_batches != 0 && s.micro_batches != gas - 1) {
    calls = FailedPreconditionError(
        fmt::format("engine: step {}: AccumulateGradients was called {} times; with "
                    "gradient_accumulation_steps {} call it {} times per step, or not at all",
                    step, s.micro_batches, gas, gas - 1));
  }
  if (calls && s.held_refs > 0) {
    calls = FailedPreconditionError(fmt::format(
        "engine: step {}: {} gathered parameter(s) are still held by a Gathered scope; release "
        "them before Step (the step changes their weights)",
        step, s.held_refs));
  }
  const Status handed = HandGradient(s.micro_batches);
  s.micro_batches = 0;
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("Step", calls));
  s.NextStep();
  ZINF_RETURN_IF_ERROR(handed);
  return AgreeOnGroups(step);
}

// Measure: the global norm of the averaged gradient, the loss and the stop flag, in one
// allreduce. With fp16 the gradient is of the loss times the scale: the norm is divided by it.
Result<ZeroEngine::Impl::StepPlan> ZeroEngine::Impl::MeasureGradient(std::optional<double> loss,
                                                                     StepInfo* info) {
  State& s = *state_;
  const double scale = s.scaler->scale();
  const double average = Average();
  ZINF_ASSIGN_OR_RETURN(const double squared, PartitionGradSquaredSum());
  const double my_loss = loss.value_or(std::numeric_limits<double>::quiet_NaN());
  std::array<double, 3> sums = {squared, my_loss, g_stop_signal.load() != 0 ? 1.0 : 0.0};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<double>(sums, ReduceOp::kSum));
  info->grad_norm = std::sqrt(sums[0]) * average / scale;
  info->loss = sums[1] / world_.size();
  info->stop_requested = sums[2] > 0;
  info->stop_signal = g_stop_signal.load();
  info->loss_scale = scale;
  return StepPlan{.squared_sum = sums[0], .average = average, .loss_scale = scale};
}

// Decide, the same on every rank (from the agreed sums): an fp16 overflow (a non-finite sum: an
// Inf or NaN anywhere, on any rank) skips the step; a gradient that is zero everywhere or not
// finite, or a non-finite loss, fails it with nothing stepped; a norm above gradient_clipping
// scales the gradient down.
Status ZeroEngine::Impl::Decide(bool have_loss, StepPlan* plan, StepInfo* info) {
  if (state_->scaler->enabled() && !std::isfinite(plan->squared_sum)) {
    plan->skip = true;
    info->lr = next_lr();  // what the step would have run at, and the next one will
    return OkStatus();
  }
  if (plan->squared_sum == 0) {
    // Adam would still move every weight (momentum, weight decay): a loop that forgot its
    // backward pass, or wrote elsewhere, must not train silently on nothing.
    return FailedPreconditionError(fmt::format(
        "step {}: the gradient is zero on every rank: Step was called before any gradient was "
        "written into the registered grads buffers; nothing was stepped",
        info->step));
  }
  if (!std::isfinite(info->grad_norm) || (have_loss && !std::isfinite(info->loss))) {
    return FailedPreconditionError(fmt::format(
        "step {}: the loss ({}) or the gradient norm ({}) is not finite; lower the learning rate "
        "or set gradient_clipping{}",
        info->step, info->loss, info->grad_norm,
        config_.bf16 || config_.fp16.enabled
            ? ""
            : " (fp16.enabled skips such steps and lowers the loss scale)"));
  }
  if (config_.gradient_clipping > 0 && info->grad_norm > config_.gradient_clipping) {
    plan->clip = config_.gradient_clipping / (info->grad_norm + 1e-6);
    info->clipped = true;
  }
  return OkStatus();
}

double ZeroEngine::Impl::Average() const {
  return 1.0 / (static_cast<double>(config_.gradient_accumulation_steps) * world_.size());
}

swapper::StepOptions ZeroEngine::Impl::StepOptionsFor(const StepPlan& plan, std::int64_t applied) {
  return {.grad_scale = static_cast<float>(plan.average * plan.clip / plan.loss_scale),
          .adam_step = applied};
}

// The scheduled hyper-parameters of every group for `step` (Optimize's, and the speculation's).
// Skipped steps advance neither Adam's step count nor the schedule (DeepSpeed): the k-th applied
// step runs at the scheduler's last_batch_iteration k - 2 (lr_schedule.h).
Result<std::vector<HyperParams>> ZeroEngine::Impl::StepHyperParams(std::int64_t step) const {
  const std::int64_t applied = step - skipped_steps_;
  std::vector<HyperParams> hyper;
  for (const HyperParams& group : groups_) {
    hyper.push_back(Scheduled(config_.scheduler, group, applied - 2));
    if (!(hyper.back().betas[0] < 1.0)) {
      // DeepSpeed's OneCycle multiplies beta1 after the cycle, without a bound.
      return FailedPreconditionError(fmt::format(
          "step {}: OneCycle's momentum decay made beta1 {} (cycle_max_mom * (1 + "
          "decay_mom_rate * intervals), DeepSpeed's formula); Adam needs beta1 < 1: lower "
          "scheduler.params.decay_mom_rate; nothing was stepped",
          step, hyper.back().betas[0]));
    }
  }
  return hyper;
}

// The partition's runs of parameter groups with their hyper-parameters, for the swapper.
std::vector<swapper::AdamSegment> ZeroEngine::Impl::StepSegments(
    std::span<const HyperParams> hyper) const {
  std::vector<swapper::AdamSegment> segments;
  for (const auto& [begin, g] : state_->group_runs) {
    segments.push_back({.begin = begin, .hyper = hyper[g]});
  }
  return segments;
}

// Optimize: the swapped Adam step over the rank's sub-groups, each parameter group at its
// scheduled hyper-parameters; the sink writes this rank's new weights into the parameters (its
// own part of them), from where GatherWholeWeights gathers them. What was speculated for the
// same arguments is committed first (UseSpeculation). Returns the step's seconds.
Result<double> ZeroEngine::Impl::Optimize(const StepPlan& plan, StepInfo* info) {
  State& s = *state_;
  const std::int64_t applied = info->step - skipped_steps_;
  ZINF_ASSIGN_OR_RETURN(const std::vector<HyperParams> hyper, StepHyperParams(info->step));
  info->lr = hyper[0].lr;
  const std::vector<swapper::AdamSegment> segments = StepSegments(hyper);
  swapper::StepOptions options = StepOptionsFor(plan, applied);
  options.segments = segments;
  swapper::GradientSwapper* gradients = s.swapper->gradient_swapper();
  const swapper::GradientSource source =
      gradients != nullptr
          ? gradients->Source()
          : swapper::GradientSource::FromView(
                [&s](const partition::SubGroup& sg) -> Result<std::span<const float>> {
                  return std::span<const float>(s.partition_grad)
                      .subspan(sg.partition_offset, sg.numel);
                });
  const swapper::ParamSink sink = [&s, rank = world_.rank()](const partition::SubGroup& sg,
                                                             std::span<const float> fp32,
                                                             std::span<const std::uint16_t>) {
    s.UnpackWeights(rank, sg.partition_offset, fp32.first(sg.numel), Working::kFp32, rank);
    return OkStatus();
  };
  const double start = MonotonicSeconds();
  {
    comm::ScopedTimer timer(s.timers, "optimizer_step");
    UseSpeculation(options, info);
    ZINF_RETURN_IF_ERROR(s.swapper->Step(info->step, source, sink, options));
  }
  const double seconds = MonotonicSeconds() - start;
  s.swap_seconds += seconds;
  return seconds;
}

// The end of Step, applied or skipped: the per-step figures (peak RSS and the slowest rank's
// times; swap bytes as the store counted them, summed over the ranks, over the whole step and
// within the optimizer step), the report, and the marks for the next step.
Result<StepInfo> ZeroEngine::Impl::FinishStep(
    StepInfo info, bool skipped, const storage::SwapStore::IoCounters& io_start,
    const storage::SwapStore::IoCounters& io_optimizer_start,
    const storage::SwapStore::IoCounters& io_optimizer_end, double optimizer_seconds) {
  State& s = *state_;
  const swapper::OptimizerSwapper& io = *s.swapper;
  if (skipped) {
    step_ = info.step;
    ++skipped_steps_;
    info.skipped = true;
  }
  info.skipped_steps = skipped_steps_;
  info.next_loss_scale = s.scaler->scale();
  const config::CheckpointConfig& cadence = config_.zinf.checkpoint;
  info.checkpoint_due =
      !cadence.dir.empty() &&
      (info.step % cadence.every == 0 || info.step == options_.total_steps || info.stop_requested);
  const double now = MonotonicSeconds();
  const double step_seconds = now - s.last_step_end;
  const storage::SwapStore::IoCounters io_end = io.io_counters();
  std::array<double, 3> maxima = {static_cast<double>(PeakRssBytes()), step_seconds,
                                  optimizer_seconds};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<double>(maxima, ReduceOp::kMax));
  std::array<std::uint64_t, 8> bytes = {
      io_end.read_bytes - io_start.read_bytes,
      io_end.write_bytes - io_start.write_bytes,
      io_optimizer_end.read_bytes - io_optimizer_start.read_bytes,
      io_optimizer_end.write_bytes - io_optimizer_start.write_bytes,
      info.speculated,
      info.speculation_committed,
      info.speculation_redone,
      info.speculation_discarded};
  s.swap_bytes += bytes[2] + bytes[3];
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(bytes, ReduceOp::kSum));
  info.speculated = bytes[4];
  info.speculation_committed = bytes[5];
  info.speculation_redone = bytes[6];
  info.speculation_discarded = bytes[7];
  info.peak_rss_bytes = static_cast<std::uint64_t>(maxima[0]);
  info.plan_bytes = s.plan_bytes;
  info.budget_bytes = s.budget_bytes;
  info.step_seconds = maxima[1];
  info.optimizer_seconds = maxima[2];
  info.swap_read_bytes = bytes[0];
  info.swap_write_bytes = bytes[1];
  info.optimizer_swap_read_bytes = bytes[2];
  info.optimizer_swap_write_bytes = bytes[3];
  const double numel = static_cast<double>(std::max<std::uint64_t>(s.total_numel, 1));
  info.read_bytes_per_element = static_cast<double>(bytes[2]) / numel;
  info.write_bytes_per_element = static_cast<double>(bytes[3]) / numel;
  ZINF_RETURN_IF_ERROR(Report(info));
  s.last_step_end = MonotonicSeconds();
  s.io_mark = io.io_counters();
  s.ReadAhead();  // the next step's first shards, while the loop loads its next batch
  return info;
}

// Rank 0: the log line every steps_per_print steps (and at total_steps), the live line on a
// terminal, and the metrics record. Collective only in agreeing on the metrics write.
Status ZeroEngine::Impl::Report(const StepInfo& info) {
  State& s = *state_;
  auto gbps = [&](std::uint64_t b) {
    return static_cast<double>(b) / std::max(info.optimizer_seconds, 1e-9) / 1e9;
  };
  const std::string total =
      options_.total_steps > 0 ? fmt::format("/{}", options_.total_steps) : std::string();
  const bool print =
      options_.progress && (info.step % config_.steps_per_print == 0 ||
                            info.step == options_.total_steps || info.stop_requested);
  if (s.tty) {
    const double now = MonotonicSeconds();
    if (print || now - s.last_tty_line >= 0.2) {
      s.last_tty_line = now;
      std::string eta;
      if (options_.total_steps > info.step && info.step >= s.first_step) {
        const double per_step =
            (now - s.loop_start) / static_cast<double>(info.step - s.first_step + 1);
        eta = fmt::format(", ETA {:.0f} s",
                          per_step * static_cast<double>(options_.total_steps - info.step));
      }
      std::fprintf(stderr, "\r[step %lld%s] loss %.4f, %.2f GB/s swap%s\033[K",
                   static_cast<long long>(info.step), total.c_str(), info.loss,
                   gbps(info.optimizer_swap_read_bytes + info.optimizer_swap_write_bytes),
                   eta.c_str());
      if (print) std::fprintf(stderr, "\r\033[K");
      std::fflush(stderr);
    }
  }
  if (info.skipped && options_.progress) {
    ZINF_LOG_INFO("step {}{}: fp16 overflow, step skipped (loss scale {} -> {}, {} skipped)",
                  info.step, total, info.loss_scale, info.next_loss_scale, info.skipped_steps);
  } else if (print) {
    std::string fp16;
    if (config_.fp16.enabled) {
      fp16 = fmt::format(" loss scale {} skipped {}", info.loss_scale, info.skipped_steps);
    }
    ZINF_LOG_INFO(
        "step {}{} loss {:.6f} lr {:.2e} time {:.3f} s swap read {:.2f} GB/s write "
        "{:.2f} GB/s ({:.2f} + {:.2f} B/element) peak RSS {} (plan {}){}{}",
        info.step, total, info.loss, info.lr, info.step_seconds,
        gbps(info.optimizer_swap_read_bytes), gbps(info.optimizer_swap_write_bytes),
        info.read_bytes_per_element, info.write_bytes_per_element, FormatBytes(info.peak_rss_bytes),
        FormatBytes(s.plan_bytes), fp16,
        info.clipped ? fmt::format(" (clipped, norm {:.3g})", info.grad_norm) : "");
  }
  if (config_.wall_clock_breakdown && print) {
    ZINF_RETURN_IF_ERROR(s.timers.LogSummary(*s.comm, "engine timers"));
  }
  Status written = OkStatus();
  if (s.metrics) {
    Json record = StepInfoJson(info);
    record["world_size"] = world_.size();
    written = storage::WriteAll(s.metrics.get(), record.dump() + "\n",
                                fmt::format("--metrics {}", options_.metrics_path));
  }
  return comm().AgreeOnStatus(written);
}

Result<SavedCheckpointInfo> ZeroEngine::Impl::SaveCheckpoint(const nlohmann::json& user_state,
                                                             const std::string& dir) {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: SaveCheckpoint after Close");
  s.buckets->WaitIdle();        // mid-micro-batch: its worker's collectives first
  DiscardSpeculation(nullptr);  // the checkpoint reads the committed state with the pool
  Status check = OkStatus();
  const std::string target = dir.empty() ? config_.zinf.checkpoint.dir : dir;
  if (target.empty()) {
    check = InvalidArgumentError(
        "engine: SaveCheckpoint without a directory (set zinf.checkpoint.dir)");
  } else if (!user_state.is_null() && !user_state.is_object()) {
    check = InvalidArgumentError("engine: the user state of a checkpoint must be a JSON object");
  } else if (Result<Json> readable = ParseJson(Json{{kUserStateKey, user_state}}.dump());
             !readable) {
    // A restore reads it back within ParseJson's bounds (RestoreCheckpoint): a state beyond
    // them would make a checkpoint that cannot be restored.
    check = InvalidArgumentError(
        fmt::format("engine: the user state of a checkpoint is not restorable: {}",
                    readable.error().message()));
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("SaveCheckpoint", check));
  checkpoint::CheckpointSaveOptions options;
  options.dir = target;
  options.keep_last = static_cast<int>(config_.zinf.checkpoint.keep_last);
  const Json effective = Json::parse(config::EffectiveConfigJson(config_));
  options.optimizer = effective.at("optimizer");
  options.config = effective;
  options.trainer = Json{{"step", step_},
                         {"world_size", world_.size()},
                         {"train_batch_size", config_.train_batch_size},
                         {"train_micro_batch_size_per_gpu", config_.train_micro_batch_size_per_gpu},
                         {"gradient_accumulation_steps", config_.gradient_accumulation_steps},
                         {"lr", next_lr()},
                         {"scheduler_last_batch_iteration", step_ - skipped_steps_ - 1},
                         {"skipped_steps", skipped_steps_},
                         {"loss_scaler", s.scaler->ToJson()},
                         {"param_groups", GroupsJson()},
                         {kUserStateKey, user_state}};  // null stays null
  options.progress = options_.progress;
  comm::ScopedTimer timer(s.timers, "checkpoint");
  ZINF_ASSIGN_OR_RETURN(checkpoint::SavedCheckpoint saved,
                        checkpoint::SaveCheckpoint(*s.swapper, step_, options));
  s.io_mark = s.swapper->io_counters();  // the save's reads are not the next step's
  ZINF_LOG_INFO("checkpoint {}: {} in {:.2f} s ({:.2f} GB/s){}", saved.path,
                FormatBytes(saved.state_bytes), saved.seconds,
                static_cast<double>(saved.state_bytes) / std::max(saved.seconds, 1e-9) / 1e9,
                saved.removed.empty() ? "" : fmt::format(", removed {}", saved.removed.size()));
  return SavedCheckpointInfo{.path = saved.path,
                             .state_bytes = saved.state_bytes,
                             .seconds = saved.seconds,
                             .removed = std::move(saved.removed)};
}

Status ZeroEngine::Impl::Load(const std::string& path) {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: Load after Close");
  Status calls = OkStatus();
  if (s.micro_batches != 0 || s.buckets->in_micro_batch()) {
    calls = FailedPreconditionError(
        "engine: Load in the middle of a step (gradients were handed since the last Step); "
        "load between steps");
  } else if (s.held_refs > 0) {
    calls = FailedPreconditionError(fmt::format(
        "engine: Load while {} gathered parameter(s) are held by a Gathered scope; release them "
        "first (the load changes their weights)",
        s.held_refs));
  }
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("Load", calls));
  s.NextStep();  // what is gathered or read ahead is of the weights about to be replaced
  // Verified whole before the live store is written: a bad file changes nothing.
  ZINF_RETURN_IF_ERROR(Restore(path, /*verify_before_write=*/true));
  ZINF_RETURN_IF_ERROR(ReadBackWeights());
  s.io_mark = s.swapper->io_counters();
  s.last_step_end = MonotonicSeconds();
  return OkStatus();
}

Status ZeroEngine::Impl::LogSummary() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: LogSummary after Close");
  s.buckets->WaitIdle();
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("LogSummary"));
  ZINF_RETURN_IF_ERROR(s.timers.LogSummary(*s.comm, "engine timers"));
  ZINF_RETURN_IF_ERROR(s.swapper->LogTimers());
  return LogPerNode();
}

// Rank 0 logs the swap bandwidth of every node (its ranks' bytes over their slowest optimizer
// time): on several hosts, the node with the slow disk stands out.
Status ZeroEngine::Impl::LogPerNode() {
  State& s = *state_;
  constexpr std::size_t kHostChars = 64;
  const comm::Topology& topo = world_.topology();
  std::string host = topo.hostname.substr(0, kHostChars - 1);
  host.resize(kHostChars, '\0');
  std::string hosts(kHostChars * static_cast<std::size_t>(world_.size()), '\0');
  ZINF_RETURN_IF_ERROR(s.comm->Allgather<char>(host, hosts));
  const std::array<double, 3> mine = {static_cast<double>(topo.node),
                                      static_cast<double>(s.swap_bytes), s.swap_seconds};
  std::vector<double> all(3 * static_cast<std::size_t>(world_.size()));
  ZINF_RETURN_IF_ERROR(s.comm->Allgather<double>(mine, all));
  if (world_.rank() != 0) return OkStatus();
  struct Node {
    std::string host;
    int ranks = 0;
    double bytes = 0, seconds = 0;
  };
  std::vector<Node> nodes(static_cast<std::size_t>(topo.num_nodes));
  for (int r = 0; r < world_.size(); ++r) {
    const auto ri = static_cast<std::size_t>(r);
    Node& n = nodes.at(static_cast<std::size_t>(all[3 * ri]));
    n.host = hosts.substr(kHostChars * ri, kHostChars).c_str();
    ++n.ranks;
    n.bytes += all[3 * ri + 1];
    n.seconds = std::max(n.seconds, all[3 * ri + 2]);
  }
  std::string table;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    table += fmt::format("\n  node {} ({}): {} rank(s), {} swapped in {:.2f} s: {:.2f} GB/s", i,
                         n.host, n.ranks, FormatBytes(static_cast<std::uint64_t>(n.bytes)),
                         n.seconds, n.bytes / std::max(n.seconds, 1e-9) / 1e9);
  }
  ZINF_LOG_INFO("swap read + write per node (over the optimizer steps):{}", table);
  return OkStatus();
}

Status ZeroEngine::Impl::Close() {
  if (closed_) return OkStatus();
  State& s = *state_;
  if (s.buckets) s.buckets->WaitIdle();
  DiscardSpeculation(nullptr);
  // A rank in another call (Step) must not match this close's collectives: the call is agreed
  // first. Once the ranks' calls diverged (here or earlier: every rank knows), nothing collective
  // can run again and each rank closes its own part.
  const bool diverged_before = comm().diverged();
  Status same_call = comm().AgreeOnCall("Close");
  if (!same_call) {
    if (!comm().diverged()) return same_call;
    CloseLocally({});
    return diverged_before ? OkStatus() : same_call;  // reported once, by the call that diverged
  }
  closed_ = true;
  s.buckets.reset();     // joins its worker before the swapper goes
  s.speculator.reset();  // likewise, and waits for its writes
  s.reader.reset();      // likewise
  Status local = s.metrics.Close(options_.metrics_path);
  if (s.swapper) {
    Status swapper_closed = s.swapper->Close();
    if (local) local = std::move(swapper_closed);
  }
  s.stop_signals.reset();
  return comm().AgreeOnStatus(local);
}

// ---- The interface: each call forwards to Impl's ----

Status ZeroEngine::AccumulateGradients() { return impl_->AccumulateGradients(); }
Status ZeroEngine::DropGradients() { return impl_->DropGradients(); }
Status ZeroEngine::GradientReady(std::size_t index) { return impl_->GradientReady(index); }
Status ZeroEngine::GradientReady(std::size_t index, std::span<const float> grad) {
  return impl_->GradientReady(index, grad);
}
Result<Gathered> ZeroEngine::Gather(std::span<const std::string> names) {
  return impl_->Gather(names);
}
Result<Gathered> ZeroEngine::GatherByIndex(std::span<const std::size_t> params) {
  return impl_->GatherByIndex(params);
}
Result<StepInfo> ZeroEngine::Step(std::optional<double> loss) { return impl_->Step(loss); }
Result<SavedCheckpointInfo> ZeroEngine::SaveCheckpoint(const nlohmann::json& user_state,
                                                       const std::string& dir) {
  return impl_->SaveCheckpoint(user_state, dir);
}
Status ZeroEngine::Load(const std::string& path) { return impl_->Load(path); }
Status ZeroEngine::LogSummary() { return impl_->LogSummary(); }
Status ZeroEngine::Close() { return impl_->Close(); }
void ZeroEngine::Detach(std::string_view reason) { impl_->Detach(reason); }
Status ZeroEngine::AgreeOnCall(std::string_view call, const Status& local) {
  return impl_->AgreeOnCall(call, local);
}
bool ZeroEngine::closed() const { return impl_->closed_; }
std::int64_t ZeroEngine::step_count() const { return impl_->step_; }
const GatherCounters& ZeroEngine::gather_counters() const { return impl_->state_->counters; }
std::size_t ZeroEngine::num_partitioned_params() const { return impl_->state_->num_partitioned; }
double ZeroEngine::next_lr() const { return impl_->next_lr(); }
std::size_t ZeroEngine::num_param_groups() const { return impl_->groups_.size(); }
HyperParams ZeroEngine::next_hyper_params(std::size_t g) const {
  return impl_->next_hyper_params(g);
}
Status ZeroEngine::SetHyperParams(std::span<const HyperParams> groups) {
  return impl_->SetHyperParams(groups);
}
double ZeroEngine::loss_scale() const { return impl_->loss_scale(); }
std::int64_t ZeroEngine::skipped_steps() const { return impl_->skipped_steps_; }
const std::string& ZeroEngine::resumed_from() const { return impl_->resumed_from_; }
const nlohmann::json& ZeroEngine::user_state() const { return impl_->user_state_; }
int ZeroEngine::resumed_world_size() const { return impl_->resumed_world_size_; }
const config::Config& ZeroEngine::config() const { return impl_->config_; }
const partition::ParamLayout& ZeroEngine::layout() const { return impl_->layout(); }
const comm::Communicator& ZeroEngine::world() const { return impl_->world_; }

}  // namespace zinf::engine
