// Collective checkpoint save and restore (see checkpoint.h for the format and the protocol).
//
// Checksums. Every rank streams its runs of the flat vector in ascending flat order (true for
// flat and per-parameter plans), so it hashes every chunk it writes completely, as it goes. A
// chunk that no rank wrote completely (it straddles two partitions, or a run boundary) is an
// "orphan": after the state is written and flushed, the orphans are spread over the ranks, read
// back collectively in bounded pieces and hashed. For a flat plan there are at most
// world_size - 1 orphans per state, so the extra read is a few chunks.
#include "zinf/swapper/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <future>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint_internal.h"
#include "zinf/comm/communicator.h"
#include "zinf/comm/timers.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/file.h"
#include "zinf/storage/hdf5.h"

namespace zinf::swapper {
namespace {

using checkpoint_internal::ChecksumDataset;
using checkpoint_internal::kStates;
using checkpoint_internal::NumChunks;
using checkpoint_internal::ProgressReporter;
using checkpoint_internal::StateDataset;
using checkpoint_internal::VerifiedChunkReader;
using storage::H5DataType;
using storage::H5File;

using comm::ScopedTimer;  // the "ckpt_*" phases go into the swapper's timers

// Write-behind for the checkpoint file. HDF5 writes through MPI-IO land in the page cache, and
// the kernel's background writeback of a large dirty set runs several times slower than the disk
// (measured on a virtio disk: 4 GiB buffered + fdatasync at 0.2 GB/s; the same writes with the
// writeback started after every 32 MiB and waited for one window later, 1.5 GB/s; O_DIRECT
// fio 1.7 GB/s). So each rank starts the writeback of the file after every slab it wrote and
// waits for it (then drops the clean pages) after it read the next run from the swap store: the
// swap-store read overlaps the writeback, and at most about one slab per rank stays dirty.
// This is only a hint to the kernel: durability still comes from the flush, close and
// fdatasync of the commit protocol. An error of sync_file_range (EIO) fails the save.
class WriteBehind {
 public:
  explicit WriteBehind(const std::string& path)
      : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~WriteBehind() {
    if (fd_ >= 0) ::close(fd_);
  }
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  // Status of opening the file (rank-local).
  Status Opened() const {
    return fd_ >= 0 ? OkStatus()
                    : ErrnoError(errno_at_open_, "checkpoint write-behind: open " + path_);
  }
  // Starts the writeback of every dirty page of the file; an error comes back from Wait.
  void Start() {
    Status started = Sync(SYNC_FILE_RANGE_WRITE);
    if (!started && deferred_) deferred_ = std::move(started);
  }
  // Writes back and waits for every dirty page of the file, then drops its clean pages.
  Status Wait() {
    ZINF_RETURN_IF_ERROR(std::exchange(deferred_, OkStatus()));
    ZINF_RETURN_IF_ERROR(
        Sync(SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER));
    // Advisory: failure only keeps the pages cached.
    (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
    return OkStatus();
  }

 private:
  Status Sync(unsigned int flags) {
    if (fd_ < 0) return Opened();
    while (::sync_file_range(fd_, 0, 0, flags) != 0) {
      if (errno != EINTR) {
        return ErrnoError(errno, "checkpoint write-behind: sync_file_range " + path_);
      }
    }
    return OkStatus();
  }

  std::string path_;
  int fd_;
  int errno_at_open_ = fd_ < 0 ? errno : 0;
  Status deferred_ = OkStatus();
};

// One slab transfer stays below 2 GiB (MPI-IO counts are ints).
constexpr std::uint64_t kMaxSlabNumel = 1ull << 28;

// A run of real elements of one sub-group that is contiguous in the flat vector.
struct Run {
  std::size_t sub_group = 0;
  std::uint64_t sub_group_offset = 0;
  std::uint64_t flat_offset = 0;
  std::uint64_t numel = 0;
};

// The swapper's runs in sub-group order (hence ascending flat order), split at `max_numel`.
std::vector<Run> RunsOf(const OptimizerSwapper& swapper, std::uint64_t max_numel) {
  std::vector<Run> merged;
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    for (const partition::SubGroupFragment& f : swapper.swap_info(i).sub_group.fragments) {
      if (!merged.empty()) {
        Run& last = merged.back();
        if (last.sub_group == i && last.sub_group_offset + last.numel == f.sub_group_offset &&
            last.flat_offset + last.numel == f.flat_offset) {
          last.numel += f.numel;
          continue;
        }
      }
      merged.push_back(Run{i, f.sub_group_offset, f.flat_offset, f.numel});
    }
  }
  std::vector<Run> runs;
  for (const Run& r : merged) {
    for (std::uint64_t off = 0; off < r.numel; off += max_numel) {
      const std::uint64_t n = std::min(max_numel, r.numel - off);
      runs.push_back(Run{r.sub_group, r.sub_group_offset + off, r.flat_offset + off, n});
    }
  }
  return runs;
}

Result<std::int64_t> AgreeMax(const comm::Communicator& comm, std::int64_t value) {
  std::int64_t v = value;
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<std::int64_t>(std::span(&v, 1), comm::ReduceOp::kMax));
  return v;
}

// Hashes the chunks a rank feeds completely, in order (see the file comment).
class ChunkHasher {
 public:
  ChunkHasher(std::uint64_t total_numel, std::uint64_t chunk_numel)
      : total_(total_numel),
        chunk_(chunk_numel),
        digests_(NumChunks(total_numel, chunk_numel), 0),
        have_(digests_.size(), 0) {}

  void Feed(std::uint64_t flat, std::span<const float> data) {
    while (!data.empty()) {
      const std::uint64_t k = flat / chunk_;
      const std::uint64_t begin = k * chunk_;
      const std::uint64_t end = std::min(begin + chunk_, total_);
      const std::uint64_t n = std::min<std::uint64_t>(data.size(), end - flat);
      if (k != current_ || flat != next_) {
        current_ = k;
        valid_ = flat == begin;
        builder_.Reset();
      }
      if (valid_) builder_.Update(std::as_bytes(data.first(n)));
      next_ = flat + n;
      if (valid_ && next_ == end) {
        digests_[k] = builder_.Digest();
        have_[k] = 1;
        valid_ = false;
      }
      flat += n;
      data = data.subspan(n);
    }
  }

  std::vector<std::uint64_t>& digests() { return digests_; }
  std::vector<std::uint64_t>& have() { return have_; }

 private:
  std::uint64_t total_;
  std::uint64_t chunk_;
  std::vector<std::uint64_t> digests_;
  std::vector<std::uint64_t> have_;  // 0/1 (uint64 for the allreduce)
  storage::ChecksumBuilder builder_;
  std::uint64_t current_ = UINT64_MAX;
  std::uint64_t next_ = 0;
  bool valid_ = false;
};

nlohmann::json DerivedOptimizerJson(const AdamOptions& adam) {
  return {{"type", adam.adamw ? "AdamW" : "Adam"},
          {"params",
           {{"lr", adam.lr},
            {"betas", {adam.beta1, adam.beta2}},
            {"eps", adam.eps},
            {"weight_decay", adam.weight_decay},
            {"adam_w_mode", adam.adamw}}}};
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

Status RenamePath(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(errno, fmt::format("rename {} -> {}", from, to));
  }
  return OkStatus();
}

// Rank 0: the metadata every rank writes (parallel HDF5 needs identical values everywhere).
struct Header {
  std::string optimizer, config, trainer, created;
};

Status WriteContents(OptimizerSwapper& swapper, H5File& file, std::int64_t step,
                     const CheckpointSaveOptions& options, const Header& header,
                     ProgressReporter* progress) {
  const comm::Communicator& comm = swapper.comm();
  const partition::ParamLayout& layout = swapper.plan().layout();
  const std::uint64_t total = layout.total_numel();
  const std::uint64_t chunk = options.chunk_numel;
  const std::uint64_t num_chunks = NumChunks(total, chunk);
  const bool root = comm.rank() == 0;
  comm::Timers& timers = swapper.timers();
  std::optional<ScopedTimer> header_timer(std::in_place, timers, "ckpt_save_header");

  // Header and layout.
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "format", kCheckpointFormat));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "format_version", kCheckpointFormatVersion));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "step", step));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "world_size", comm.size()));
  ZINF_RETURN_IF_ERROR(
      file.WriteInt64Attribute("/", "total_numel", static_cast<std::int64_t>(total)));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute(
      "/", "sub_group_size", static_cast<std::int64_t>(swapper.options().sub_group_size)));
  ZINF_RETURN_IF_ERROR(
      file.WriteInt64Attribute("/", "chunk_numel", static_cast<std::int64_t>(chunk)));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "optimizer", header.optimizer));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "config", header.config));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "created", header.created));
  ZINF_RETURN_IF_ERROR(file.CreateGroup("/layout"));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/layout", "json", layout.ToJsonString()));
  const std::uint64_t num_params = layout.num_params();
  std::vector<std::uint64_t> offsets, numels;
  if (root) {
    for (const partition::ParamInfo& p : layout.params()) {
      offsets.push_back(p.flat_offset);
      numels.push_back(p.numel);
    }
  }
  const std::uint64_t param_chunk = std::min<std::uint64_t>(num_params, 1 << 16);
  ZINF_RETURN_IF_ERROR(
      file.CreateDataset1D("/layout/flat_offset", num_params, param_chunk, H5DataType::kUInt64));
  ZINF_RETURN_IF_ERROR(
      file.CreateDataset1D("/layout/numel", num_params, param_chunk, H5DataType::kUInt64));
  ZINF_RETURN_IF_ERROR(
      file.WriteSlab("/layout/flat_offset", 0, std::span<const std::uint64_t>(offsets)));
  ZINF_RETURN_IF_ERROR(file.WriteSlab("/layout/numel", 0, std::span<const std::uint64_t>(numels)));
  ZINF_RETURN_IF_ERROR(file.CreateGroup("/trainer"));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/trainer", "state", header.trainer));
  for (StateTensor which : kStates) {
    ZINF_RETURN_IF_ERROR(file.CreateDataset1D(StateDataset(which), total, std::min(chunk, total),
                                              H5DataType::kFloat32));
    ZINF_RETURN_IF_ERROR(file.CreateDataset1D(ChecksumDataset(which), num_chunks,
                                              std::min<std::uint64_t>(num_chunks, 1 << 16),
                                              H5DataType::kUInt64));
  }
  ZINF_RETURN_IF_ERROR(
      file.WriteStringAttribute("/checksum", "algorithm", storage::kChecksumAlgorithm));
  ZINF_RETURN_IF_ERROR(
      file.WriteInt64Attribute("/checksum", "chunk_numel", static_cast<std::int64_t>(chunk)));

  header_timer.reset();

  // State: run by run, each state tensor in turn. With two staging buffers (the common case) the
  // next tensor is read from the swap store and hashed on a helper thread while this thread
  // writes the current one, so a save costs about max(read, write) instead of their sum. Only the
  // helper uses the swapper while a read is pending (ReadState is local and the engines take
  // requests from any one thread), and every pending read is joined before its buffer is reused
  // or released (std::async futures join on destruction, and are declared after the lease).
  const std::uint64_t staging_numel = std::min(
      {swapper.sub_groups().max_sub_group_numel(), swapper.pool().buffer_numel(), kMaxSlabNumel});
  const std::vector<Run> runs = RunsOf(swapper, staging_numel);
  ZINF_ASSIGN_OR_RETURN(const std::int64_t max_runs,
                        AgreeMax(comm, static_cast<std::int64_t>(runs.size())));
  // Two buffers when the pool has three free (ReadState borrows one more), else one: the depth
  // is local, the sequence of collective calls is the same either way.
  const std::size_t depth = swapper.pool().free_count() >= 3 ? 2 : 1;
  Result<PoolLease> lease = swapper.pool().Allocate(staging_numel, depth);
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(
      lease ? OkStatus() : Status(std::move(lease).error().WithContext("checkpoint staging: "))));
  std::span<float> staging = lease->floats(0).first(staging_numel);
  std::vector<ChunkHasher> hashers;
  for (std::size_t t = 0; t < kNumStateTensors; ++t) hashers.emplace_back(total, chunk);
  WriteBehind write_behind(file.path());
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(write_behind.Opened()));

  struct Item {
    Run run;
    StateTensor which;
    bool mine;
  };
  std::vector<Item> items;
  for (std::int64_t k = 0; k < max_runs; ++k) {
    const bool mine = k < static_cast<std::int64_t>(runs.size());
    for (StateTensor which : kStates) {
      items.push_back(Item{mine ? runs[static_cast<std::size_t>(k)] : Run{}, which, mine});
    }
  }
  auto buffer_of = [&](std::size_t i) {
    return lease->floats(i % depth).first(items[i].run.numel);
  };
  // Reads and hashes item i (the hashers see the items in order: one read at a time).
  auto read_item = [&](std::size_t i) -> Status {
    const Item& item = items[i];
    if (!item.mine) return OkStatus();
    std::span<float> out = buffer_of(i);
    {
      ScopedTimer t(timers, "ckpt_save_read_state");
      ZINF_RETURN_IF_ERROR(
          swapper.ReadState(item.run.sub_group, item.which, item.run.sub_group_offset, out));
    }
    ScopedTimer t(timers, "ckpt_save_checksum");
    hashers[static_cast<std::size_t>(item.which)].Feed(item.run.flat_offset, out);
    return OkStatus();
  };
  std::future<Status> pending;  // the read of item i + 1; joined on every return
  for (std::size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    Status local = OkStatus();
    if (pending.valid()) {
      ScopedTimer t(timers, "ckpt_save_read_wait");
      local = pending.get();
    } else {
      local = read_item(i);
    }
    if (depth == 2 && i + 1 < items.size()) {
      pending = std::async(std::launch::async, read_item, i + 1);
    }
    {
      ScopedTimer t(timers, "ckpt_save_writeback_wait");
      Status waited = write_behind.Wait();
      if (local) local = std::move(waited);
    }
    {
      ScopedTimer t(timers, "ckpt_save_agree");
      ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(
          Annotate(local, fmt::format("checkpoint: sub-group {} {}: ", item.run.sub_group,
                                      StateTensorName(item.which)))));
    }
    std::span<const float> data;
    if (item.mine) data = buffer_of(i);
    {
      ScopedTimer t(timers, "ckpt_save_write_slab");
      ZINF_RETURN_IF_ERROR(file.WriteSlab(StateDataset(item.which), item.run.flat_offset, data));
    }
    write_behind.Start();
    if (item.which == kStates.back()) {
      const double runs_done = static_cast<double>(i / kNumStateTensors + 1);
      progress->Update(static_cast<std::uint64_t>(
          runs_done / static_cast<double>(max_runs) *
          static_cast<double>(kNumStateTensors * total * sizeof(float))));
    }
  }
  {
    ScopedTimer t(timers, "ckpt_save_writeback_wait");
    ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(write_behind.Wait()));
  }
  {
    ScopedTimer t(timers, "ckpt_save_flush");
    ZINF_RETURN_IF_ERROR(file.Flush());
  }
  ScopedTimer orphan_timer(timers, "ckpt_save_orphans_and_checksums");

  // Orphan chunks: read back by rank (j % size), in pieces of the (agreed) staging size.
  std::int64_t piece = static_cast<std::int64_t>(std::min(staging_numel, chunk));
  ZINF_RETURN_IF_ERROR(
      comm.AllreduceInPlace<std::int64_t>(std::span(&piece, 1), comm::ReduceOp::kMin));
  const std::uint64_t piece_numel = static_cast<std::uint64_t>(piece);
  const std::uint64_t pieces_per_chunk = (std::min(chunk, total) + piece_numel - 1) / piece_numel;
  for (StateTensor which : kStates) {
    ChunkHasher& hasher = hashers[static_cast<std::size_t>(which)];
    ZINF_RETURN_IF_ERROR(
        comm.AllreduceInPlace<std::uint64_t>(std::span(hasher.have()), comm::ReduceOp::kMax));
    std::vector<std::uint64_t> orphans;
    for (std::uint64_t c = 0; c < num_chunks; ++c) {
      if (hasher.have()[c] == 0) orphans.push_back(c);
    }
    const std::uint64_t size = static_cast<std::uint64_t>(comm.size());
    const std::uint64_t rounds = (orphans.size() + size - 1) / size;
    for (std::uint64_t r = 0; r < rounds; ++r) {
      const std::uint64_t j = r * size + static_cast<std::uint64_t>(comm.rank());
      const bool mine = j < orphans.size();
      const std::uint64_t c = mine ? orphans[j] : 0;
      const std::uint64_t begin = c * chunk;
      const std::uint64_t end = mine ? std::min(begin + chunk, total) : begin;
      storage::ChecksumBuilder builder;
      for (std::uint64_t p = 0; p < pieces_per_chunk; ++p) {
        const std::uint64_t from = std::min(begin + p * piece_numel, end);
        const std::uint64_t to = std::min(from + piece_numel, end);
        std::span<float> out = staging.first(to - from);
        ZINF_RETURN_IF_ERROR(file.ReadSlab(StateDataset(which), from, out));
        builder.Update(std::as_bytes(out));
      }
      if (mine) hasher.digests()[c] = builder.Digest();
    }
    // Exactly one rank contributes each chunk's digest.
    ZINF_RETURN_IF_ERROR(
        comm.AllreduceInPlace<std::uint64_t>(std::span(hasher.digests()), comm::ReduceOp::kSum));
    std::span<const std::uint64_t> sums;
    if (root) sums = hasher.digests();
    ZINF_RETURN_IF_ERROR(file.WriteSlab(ChecksumDataset(which), 0, sums));
  }
  lease->Release();
  return file.Flush();
}

// Rank 0, after the new file is committed: removes stale .partial files and applies keep_last.
std::vector<std::string> ApplyRetention(const std::string& dir, const std::string& keep_name,
                                        int keep_last) {
  std::vector<std::string> removed;
  static const std::regex kName(R"(step-(\d+)\.h5)");
  // A crashed save's partial file, and the shared-file-pointer lock file Open MPI's MPI-IO keeps
  // next to it (<file>-<jobid>-<pid>.lock), which only a clean close removes.
  static const std::regex kPartial(R"(step-(\d+)\.h5\.partial(-[0-9]+-[0-9]+\.lock)?)");
  std::vector<std::pair<std::int64_t, std::string>> others;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, kPartial)) {
      // Left by a save that crashed (one job saves into a directory at a time).
      if (std::filesystem::remove(dir + "/" + name, ec)) removed.push_back(dir + "/" + name);
      continue;
    }
    if (name == keep_name || !std::regex_match(name, m, kName)) continue;
    others.emplace_back(std::stoll(m[1].str()), name);
  }
  if (keep_last <= 0) return removed;
  std::sort(others.begin(), others.end(), std::greater<>());
  for (std::size_t i = static_cast<std::size_t>(keep_last - 1); i < others.size(); ++i) {
    const std::string path = dir + "/" + others[i].second;
    if (std::filesystem::remove(path, ec)) {
      removed.push_back(path);
    } else {
      ZINF_LOG_WARN("checkpoint retention: cannot remove {}: {}", path, ec.message());
    }
  }
  return removed;
}

// Rank 0: rename, fsync the directory, replace `latest`, retention.
Status Commit(const std::string& dir, const std::string& partial, const std::string& name,
              int keep_last, std::vector<std::string>* removed) {
  const std::string final_path = dir + "/" + name;
  ZINF_RETURN_IF_ERROR(RenamePath(partial, final_path));
  ZINF_RETURN_IF_ERROR(storage::SyncDirectory(dir));
  const std::string tmp = dir + "/latest.tmp";
  {
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) return ErrnoError(errno, "create " + tmp);
    const bool ok = std::fprintf(f, "%s\n", name.c_str()) > 0;
    const int err = errno;
    if (std::fclose(f) != 0 || !ok) return ErrnoError(ok ? errno : err, "write " + tmp);
  }
  ZINF_RETURN_IF_ERROR(storage::SyncPath(tmp));
  ZINF_RETURN_IF_ERROR(RenamePath(tmp, dir + "/latest"));
  ZINF_RETURN_IF_ERROR(storage::SyncDirectory(dir));
  *removed = ApplyRetention(dir, name, keep_last);
  return OkStatus();
}

}  // namespace

Result<SavedCheckpoint> SaveCheckpoint(OptimizerSwapper& swapper, std::int64_t step,
                                       const CheckpointSaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const comm::Communicator& comm = swapper.comm();
  const bool root = comm.rank() == 0;
  Status check = OkStatus();
  if (options.dir.empty()) {
    check = InvalidArgumentError("SaveCheckpoint: empty dir");
  } else if (step < 0) {
    check = InvalidArgumentError(fmt::format("SaveCheckpoint: step {} < 0", step));
  } else if (options.chunk_numel == 0 || options.chunk_numel >= (1ull << 30)) {
    check = InvalidArgumentError(
        fmt::format("SaveCheckpoint: chunk_numel {} not in [1, 2^30)", options.chunk_numel));
  }
  for (const nlohmann::json* j : {&options.optimizer, &options.config, &options.trainer}) {
    if (check && !j->is_null() && !j->is_object()) {
      check = InvalidArgumentError(
          "SaveCheckpoint: optimizer, config and trainer must be JSON "
          "objects");
    }
  }
  Header header;
  if (root && check) {
    header.optimizer = (options.optimizer.is_null() ? DerivedOptimizerJson(swapper.options().adam)
                                                    : options.optimizer)
                           .dump();
    header.config = options.config.is_null() ? "{}" : options.config.dump();
    header.trainer = options.trainer.is_null() ? "{}" : options.trainer.dump();
    header.created = UtcNow();
    std::error_code ec;
    std::filesystem::create_directories(options.dir, ec);
    if (ec) check = ErrnoError(ec.value(), "create checkpoint directory " + options.dir);
  }
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(check));
  for (std::string* s : {&header.optimizer, &header.config, &header.trainer, &header.created}) {
    ZINF_RETURN_IF_ERROR(comm.BroadcastString(s, 0));
  }

  const std::string name = CheckpointFileName(step);
  const std::string partial = options.dir + "/" + name + ".partial";
  const std::uint64_t state_bytes =
      kNumStateTensors * swapper.plan().layout().total_numel() * sizeof(float);
  ProgressReporter progress(fmt::format("checkpoint save step {}", step), state_bytes,
                            root && options.progress, options.progress_interval_s);
  ZINF_ASSIGN_OR_RETURN(H5File file, Annotate(H5File::CreateCollective(
                                                  comm, partial, storage::H5CreateMode::kTruncate),
                                              "checkpoint save: "));
  Status written = WriteContents(swapper, file, step, options, header, &progress);
  comm::Timers& timers = swapper.timers();
  timers.Start("ckpt_save_close");
  Status closed = file.Close();
  timers.Stop("ckpt_save_close");
  Status local = written ? closed : written;
  // Durability of the data before the rename: every rank syncs what it wrote.
  timers.Start("ckpt_save_fdatasync");
  if (local) local = storage::SyncPath(partial);
  timers.Stop("ckpt_save_fdatasync");
  // WriteContents' errors are agreed already (every rank holds the failing rank's error): agreeing
  // them again would name rank 0 and count every rank as failed.
  Status agreed = written ? comm.AgreeOnStatus(local) : std::move(written);
  SavedCheckpoint saved;
  if (agreed) {
    Status committed = OkStatus();
    ScopedTimer t(timers, "ckpt_save_commit");
    if (root) committed = Commit(options.dir, partial, name, options.keep_last, &saved.removed);
    agreed = comm.AgreeOnStatus(Annotate(committed, "checkpoint commit: "));
  }
  if (!agreed) {
    if (root) {
      std::error_code ec;
      std::filesystem::remove(partial, ec);
    }
    return std::move(agreed).error().WithContext(fmt::format("checkpoint save step {}: ", step));
  }
  progress.Finish();
  saved.path = options.dir + "/" + name;
  saved.state_bytes = state_bytes;
  saved.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return saved;
}

namespace {

Status CheckOptimizer(const nlohmann::json& optimizer, const AdamOptions& adam) {
  if (!optimizer.is_object() || !optimizer.contains("type") || !optimizer["type"].is_string()) {
    return DataLossError("checkpoint attribute 'optimizer' has no string 'type'");
  }
  const std::string type = optimizer["type"].get<std::string>();
  std::optional<bool> adam_w_mode;
  if (optimizer.contains("params") && optimizer["params"].is_object() &&
      optimizer["params"].contains("adam_w_mode") &&
      optimizer["params"]["adam_w_mode"].is_boolean()) {
    adam_w_mode = optimizer["params"]["adam_w_mode"].get<bool>();
  }
  Result<bool> adamw = ResolveAdamWMode(type, adam_w_mode);
  if (!adamw) {
    return FailedPreconditionError(fmt::format(
        "checkpoint optimizer type '{}' is not supported: {}", type, adamw.error().message()));
  }
  if (*adamw != adam.adamw) {
    return FailedPreconditionError(fmt::format(
        "optimizer mismatch: the checkpoint holds {} state (type '{}'), the swapper runs {}",
        *adamw ? "AdamW" : "Adam", type, adam.adamw ? "AdamW" : "Adam"));
  }
  return OkStatus();
}

}  // namespace

Result<RestoredCheckpoint> RestoreCheckpoint(OptimizerSwapper& swapper, const std::string& path,
                                             const CheckpointRestoreOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const comm::Communicator& comm = swapper.comm();
  const bool root = comm.rank() == 0;

  // Rank 0 resolves `latest` once, so that every rank reads the same file.
  std::string file_path;
  Status resolved = OkStatus();
  if (root) {
    Result<std::string> r = ResolveCheckpointPath(path);
    if (r) {
      file_path = *r;
    } else {
      resolved = std::move(r).error();
    }
  }
  ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(resolved), "checkpoint restore: "));
  ZINF_RETURN_IF_ERROR(comm.BroadcastString(&file_path, 0));
  const std::string context = fmt::format("checkpoint restore from {}: ", file_path);

  comm::Timers& timers = swapper.timers();
  std::optional<ScopedTimer> open_timer(std::in_place, timers, "ckpt_restore_open");
  // Every rank opens its own read-only handle and validates the header.
  Result<H5File> opened = H5File::OpenSerial(file_path, /*read_only=*/true);
  std::optional<H5File> file;
  std::optional<CheckpointInfo> info;
  Status local = OkStatus();
  if (!opened) {
    local = std::move(opened).error();
  } else {
    file.emplace(std::move(*opened));
    Result<CheckpointInfo> i = checkpoint_internal::ReadInfo(*file, file_path);
    if (!i) {
      local = std::move(i).error();
    } else {
      info.emplace(std::move(*i));
      local = partition::CompareLayouts(*info->layout, swapper.plan().layout(),
                                        /*compare_dtype=*/false);
      if (local && options.check_optimizer) {
        local = CheckOptimizer(info->optimizer, swapper.options().adam);
      }
    }
  }
  std::vector<VerifiedChunkReader> readers;
  if (local) {
    for (StateTensor which : kStates) {
      Result<std::vector<std::uint64_t>> sums =
          checkpoint_internal::ReadChecksums(*file, which, info->num_chunks);
      if (!sums) {
        local = std::move(sums).error();
        break;
      }
      readers.emplace_back(&*file, which, info->total_numel, info->chunk_numel, std::move(*sums));
    }
  }
  ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(local), context));
  open_timer.reset();

  const std::vector<Run> runs = RunsOf(swapper, UINT64_MAX);
  std::uint64_t my_bytes = 0;
  for (const Run& r : runs) my_bytes += kNumStateTensors * r.numel * sizeof(float);
  const int passes = options.verify_before_write ? 2 : 1;
  ProgressReporter progress(fmt::format("checkpoint restore step {}", info->step),
                            my_bytes * static_cast<std::uint64_t>(passes), root && options.progress,
                            options.progress_interval_s);
  std::uint64_t done = 0;

  if (options.verify_before_write) {
    ScopedTimer verify_timer(timers, "ckpt_restore_verify_pass");
    local = OkStatus();
    for (StateTensor which : kStates) {
      for (const Run& r : runs) {
        local = readers[static_cast<std::size_t>(which)].Verify(r.flat_offset, r.numel);
        if (!local) break;
        done += r.numel * sizeof(float);
        progress.Update(done);
      }
      if (!local) break;
    }
    ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(local), context));
  }

  local = OkStatus();
  std::size_t next_run = 0;
  for (std::size_t i = 0; i < swapper.num_sub_groups() && local; ++i) {
    const std::size_t first = next_run;
    while (next_run < runs.size() && runs[next_run].sub_group == i) ++next_run;
    const std::size_t last = next_run;
    ScopedTimer write_timer(timers, "ckpt_restore_write_state");
    local =
        swapper.WriteState(i, info->step, [&](StateTensor which, std::span<float> out) -> Status {
          ScopedTimer read_timer(timers, "ckpt_restore_read_in_write_state");
          for (std::size_t r = first; r < last; ++r) {
            const Run& run = runs[r];
            ZINF_RETURN_IF_ERROR(readers[static_cast<std::size_t>(which)].Read(
                run.flat_offset, out.subspan(run.sub_group_offset, run.numel)));
            done += run.numel * sizeof(float);
          }
          progress.Update(done);
          return OkStatus();
        });
  }
  if (local) local = file->Close();
  ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(local), context));
  progress.Finish();

  RestoredCheckpoint restored;
  restored.path = file_path;
  restored.step = info->step;
  restored.world_size = static_cast<int>(info->world_size);
  restored.optimizer = std::move(info->optimizer);
  restored.config = std::move(info->config);
  restored.trainer = std::move(info->trainer);
  restored.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return restored;
}

}  // namespace zinf::swapper
