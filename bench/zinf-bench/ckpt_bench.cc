// zinf-bench ckpt: timed SaveCheckpoint / RestoreCheckpoint of --state-bytes of Adam state
// (fp32, exp_avg, exp_avg_sq: 12 bytes per element) split over the ranks of the job with a flat
// plan. Run under mpirun; rank 0 prints one JSON line per trial and operation:
//
//   mpirun -np 2 zinf-bench ckpt --path /nvme/swap --dir /nvme/ckpt --state-bytes 4G --trials 3
//   {"bench":"ckpt","op":"save","trial":1,"bytes":4294967292,"seconds":3.1,"gb_per_s":1.38,...}
//   {"bench":"ckpt","op":"restore","trial":1,"verify_before_write":true,...}
//
// "seconds" is the slowest rank's wall time of the collective call (SavedCheckpoint::seconds /
// RestoredCheckpoint::seconds), commit and fdatasync included. The checkpoint of a trial is
// removed after its restores, so every save writes a fresh file. With --drop-caches rank 0 runs
// sync and writes 3 to /proc/sys/vm/drop_caches (root only) before every timed operation, so
// that a restore reads the file from the disk and not from the page cache the save filled; the
// JSON says whether that worked ("cache_dropped").
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "bench_state.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/comm/timers.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/io_backend.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::bench {
namespace {

using swapper::OptimizerSwapper;

struct CkptFlags {
  std::string state_bytes = "4G";
  std::string sub_group_size = "32M";
  std::string path;  // swap store directory
  std::string dir;   // checkpoint directory
  int trials = 1;
  bool verify_before_write = true;  // the default restore mode (always measured)
  bool single_pass = false;         // also measure verify_before_write = false
  bool drop_caches = false;
  bool timers = false;  // log the swapper's timers (checkpoint phases) after every operation
  bool keep = false;    // keep the last trial's checkpoint
  std::string backend = "auto";
  std::string chunk_numel = "1M";
};

// Rank 0 only; true when the page cache was dropped.
bool DropCaches() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "3\n", 2) == 2;
  ::close(fd);
  return ok;
}

Result<double> MaxOverRanks(const comm::Communicator& comm, double value) {
  double v = value;
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<double>(std::span(&v, 1), comm::ReduceOp::kMax));
  return v;
}

// Barrier, then (rank 0) the optional cache drop, then barrier: every rank starts together.
Result<bool> Prepare(const comm::Communicator& comm, bool drop) {
  ZINF_RETURN_IF_ERROR(comm.Barrier());
  std::int64_t dropped = 0;
  if (comm.rank() == 0 && drop) dropped = DropCaches() ? 1 : 0;
  ZINF_RETURN_IF_ERROR(comm.Broadcast(std::span(&dropped, 1), 0));
  ZINF_RETURN_IF_ERROR(comm.Barrier());
  return dropped != 0;
}

// The checkpoint phases the swapper's timers recorded ("ckpt_*"), max over ranks, and reset.
Result<nlohmann::json> PhaseTimes(OptimizerSwapper& swapper, bool log, std::string_view title) {
  if (log) ZINF_RETURN_IF_ERROR(swapper.timers().LogSummary(swapper.comm(), title));
  ZINF_ASSIGN_OR_RETURN(std::vector<comm::TimerStats> stats,
                        swapper.timers().Reduce(swapper.comm()));
  nlohmann::json phases = nlohmann::json::object();
  for (const comm::TimerStats& s : stats) phases[s.name] = s.max_seconds;
  swapper.timers().Reset();
  return phases;
}

void Print(const comm::Communicator& comm, const nlohmann::json& line) {
  if (comm.rank() != 0) return;
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// --dir receives the checkpoint of every trial through the commit protocol, which replaces
// `latest` and step-<N>.h5, and the trial removes it again: a directory that holds anything (a
// real run's checkpoints, say) is refused rather than overwritten. Missing is fine (created).
Status CheckEmptyDirectory(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(dir, ec))) return OkStatus();
  std::filesystem::directory_iterator entries(dir, ec);
  if (ec) return ErrnoError(ec.value(), "--dir " + dir);
  if (entries != std::filesystem::directory_iterator()) {
    return FailedPreconditionError(fmt::format(
        "--dir {} is not empty: zinf-bench ckpt writes its checkpoints (step-<N>.h5, latest) "
        "there and removes them; give a new or empty directory",
        dir));
  }
  return OkStatus();
}

Result<int> Run(const comm::Communicator& world, const CkptFlags& flags) {
  ZINF_RETURN_IF_ERROR(
      world.AgreeOnStatus(world.rank() == 0 ? CheckEmptyDirectory(flags.dir) : OkStatus()));
  ZINF_ASSIGN_OR_RETURN(std::uint64_t state_bytes, ParseBytes(flags.state_bytes));
  ZINF_ASSIGN_OR_RETURN(std::uint64_t sub_group_numel, ParseBytes(flags.sub_group_size));
  ZINF_ASSIGN_OR_RETURN(std::uint64_t chunk_numel, ParseBytes(flags.chunk_numel));
  ZINF_ASSIGN_OR_RETURN(storage::IoBackendKind kind, storage::ParseIoBackendKind(flags.backend));
  ZINF_ASSIGN_OR_RETURN(partition::PartitionPlan plan, FlatStatePlan(state_bytes, world.size()));
  const std::uint64_t numel = plan.layout().total_numel();
  std::error_code mkdir_ec;  // a real failure shows up when the store opens it
  std::filesystem::create_directories(flags.path, mkdir_ec);
  swapper::SwapperOptions options;
  options.store.paths = {flags.path};
  std::string job_id = fmt::format("bench-ckpt-{}", getpid());
  ZINF_RETURN_IF_ERROR(world.BroadcastString(&job_id, 0));
  options.store.job_id = job_id;
  options.backend = kind;
  options.sub_group_size = sub_group_numel;
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerSwapper> swapper,
                        swapper::CreateOptimizerSwapper(world, plan, options));
  const double init_start = MonotonicSeconds();
  ZINF_RETURN_IF_ERROR(swapper->Initialize([](std::uint64_t flat, std::span<float> out) {
    // Not constant, so that a wrong offset would fail the checksums of a later restore.
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<float>((flat + i) % 1000003) * 1e-6f;
    }
    return OkStatus();
  }));
  ZINF_ASSIGN_OR_RETURN(const double init_seconds,
                        MaxOverRanks(world, MonotonicSeconds() - init_start));
  swapper->timers().Reset();
  const std::uint64_t bytes = numel * kStateBytesPerElement;
  const nlohmann::json common = {
      {"bench", "ckpt"},
      {"ranks", world.size()},
      {"bytes", bytes},
      {"numel", numel},
      {"sub_group_numel", swapper->sub_groups().max_sub_group_numel()},
      {"chunk_numel", chunk_numel},
      {"direct_swap", swapper->store().direct()},
      {"initialize_seconds", init_seconds},
  };
  std::vector<bool> restore_modes = {flags.verify_before_write};
  if (flags.single_pass && flags.verify_before_write) restore_modes.push_back(false);

  for (int t = 1; t <= flags.trials; ++t) {
    checkpoint::CheckpointSaveOptions save;
    save.dir = flags.dir;
    save.keep_last = 1;
    save.chunk_numel = chunk_numel;
    save.progress = false;
    save.trainer = {{"step", t}};
    ZINF_ASSIGN_OR_RETURN(bool dropped, Prepare(world, flags.drop_caches));
    ZINF_ASSIGN_OR_RETURN(checkpoint::SavedCheckpoint saved,
                          checkpoint::SaveCheckpoint(*swapper, t, save));
    ZINF_ASSIGN_OR_RETURN(const double save_seconds, MaxOverRanks(world, saved.seconds));
    ZINF_ASSIGN_OR_RETURN(nlohmann::json save_phases,
                          PhaseTimes(*swapper, flags.timers, "checkpoint save"));
    nlohmann::json line = common;
    line.update({{"op", "save"},
                 {"trial", t},
                 {"seconds", save_seconds},
                 {"gb_per_s", static_cast<double>(bytes) / save_seconds / 1e9},
                 {"cache_dropped", dropped},
                 {"phases", save_phases}});
    Print(world, line);

    // Both modes: alternate which goes first, since the first read of a fresh checkpoint was
    // measurably slower than the next on the VM this was written on.
    std::vector<bool> order = restore_modes;
    if (order.size() == 2 && t % 2 == 0) order = {order[1], order[0]};
    for (bool verify : order) {
      checkpoint::CheckpointRestoreOptions restore;
      restore.verify_before_write = verify;
      restore.progress = false;
      ZINF_ASSIGN_OR_RETURN(dropped, Prepare(world, flags.drop_caches));
      ZINF_ASSIGN_OR_RETURN(checkpoint::RestoredCheckpoint restored,
                            checkpoint::RestoreCheckpoint(*swapper, flags.dir, restore));
      ZINF_ASSIGN_OR_RETURN(const double restore_seconds, MaxOverRanks(world, restored.seconds));
      ZINF_ASSIGN_OR_RETURN(
          nlohmann::json restore_phases,
          PhaseTimes(*swapper, flags.timers,
                     verify ? "checkpoint restore (verify first)" : "checkpoint restore (1 pass)"));
      if (restored.step != t) {
        return InternalError(fmt::format("restored step {}, saved {}", restored.step, t));
      }
      line = common;
      line.update({{"op", "restore"},
                   {"trial", t},
                   {"verify_before_write", verify},
                   {"seconds", restore_seconds},
                   {"gb_per_s", static_cast<double>(bytes) / restore_seconds / 1e9},
                   {"cache_dropped", dropped},
                   {"phases", restore_phases}});
      Print(world, line);
    }
    ZINF_RETURN_IF_ERROR(world.Barrier());
    if (world.rank() == 0 && !(flags.keep && t == flags.trials)) {
      std::error_code ec;
      std::filesystem::remove(saved.path, ec);
      std::filesystem::remove(flags.dir + "/latest", ec);
    }
    ZINF_RETURN_IF_ERROR(world.Barrier());
  }
  ZINF_RETURN_IF_ERROR(swapper->Close());
  return 0;
}

int RunCkpt(const CkptFlags& flags) {
  Result<comm::MpiSession> session = comm::MpiSession::Init(nullptr, nullptr);
  if (!session) {
    std::fprintf(stderr, "zinf-bench ckpt: %s\n", session.error().ToString().c_str());
    return 1;
  }
  Result<int> rc = Run(session->world(), flags);
  if (!rc) {
    std::fprintf(stderr, "zinf-bench ckpt (rank %d): %s\n", session->world().rank(),
                 rc.error().ToString().c_str());
  }
  Status finalized = session->Finalize();
  return rc && finalized ? *rc : 1;
}

const bool kRegistered = RegisterBenchCommand(
    "ckpt", "timed collective checkpoint save and restore (run under mpirun)",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<CkptFlags>();
      app.add_option("--path", flags->path, "swap store directory (node-local NVMe)")->required();
      app.add_option("--dir", flags->dir,
                     "checkpoint directory (shared by the ranks): new or empty, as the trials' "
                     "checkpoints are written there and removed")
          ->required();
      app.add_option("--state-bytes", flags->state_bytes,
                     "bytes of fp32 + exp_avg + exp_avg_sq over all ranks, e.g. 4G")
          ->capture_default_str()
          ->check(SizeIn(kStateBytesPerElement));
      app.add_option("--sub-group-size", flags->sub_group_size,
                     "elements per sub-group, e.g. 32M (binary multiples)")
          ->capture_default_str()
          ->check(SizeIn(1));
      app.add_option("--chunk-numel", flags->chunk_numel, "checkpoint chunk (elements), e.g. 1M")
          ->capture_default_str()
          ->check(SizeIn(1));
      app.add_option("--trials", flags->trials, "save + restore rounds")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000));
      app.add_option("--verify-before-write", flags->verify_before_write,
                     "restore mode measured first (true: verify, then write)")
          ->capture_default_str();
      app.add_flag("--single-pass", flags->single_pass,
                   "also measure the restore with verify_before_write = false");
      app.add_flag("--drop-caches", flags->drop_caches,
                   "rank 0 drops the page cache before every timed operation (root)");
      app.add_flag("--timers", flags->timers, "log the checkpoint phase timers (stderr)");
      app.add_flag("--keep", flags->keep, "keep the last trial's checkpoint in --dir");
      app.add_option("--engine", flags->backend, "uring, posix or auto")
          ->capture_default_str()
          ->check(OneOf(storage::kIoBackendNames));
      return [flags] { return RunCkpt(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
