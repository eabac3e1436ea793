// The engine's checkpoint glue (engine.h, "Checkpoints"): Create's fresh start or restore
// (InitializeOrRestore, Initialize, Restore), SaveCheckpoint and Load, and the committed weights
// read back into the parameters (ReadBackWeights, ReadPartition, GatherWholeWeights).
#include "engine_impl.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "zinf/comm/timers.h"
#include "zinf/config/config.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"

namespace zinf::engine {

namespace {

using Json = nlohmann::json;

// The checkpoint's trainer JSON: the engine's own state, and the user's under "user".
constexpr const char* kUserStateKey = "user";

}  // namespace

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

}  // namespace zinf::engine
