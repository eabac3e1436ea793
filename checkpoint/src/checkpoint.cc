// Collective checkpoint save and restore (see checkpoint.h for the format and the protocol).
//
// Checksums. Every rank streams its runs of the flat vector in ascending flat order (true for
// flat and per-parameter plans), so it hashes every chunk it writes completely, as it goes. A
// chunk that no rank wrote completely (it straddles two partitions, or a run boundary) is an
// "orphan": after the state is written and flushed, the orphans are spread over the ranks, read
// back collectively in bounded pieces and hashed. For a flat plan there are at most
// world_size - 1 orphans per state, so the extra read is a few chunks.
#include "zinf/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <optional>
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
#include "zinf/h5/h5_file.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/env.h"
#include "zinf/storage/file.h"
#include "zinf/storage/fs.h"

namespace zinf::checkpoint {
namespace {

using h5::H5DataType;
using h5::H5File;
using internal::DumpJson;
using internal::EstimateFileBytes;
using internal::FileHeader;
using internal::kQ8Checksums;
using internal::kQ8Datasets;
using internal::kStates;
using internal::NumChunks;
using internal::ProgressReporter;
using internal::StateDatasets;
using internal::StateDatasetSpec;
using internal::StateReader;
using internal::UtcNow;

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
      : path_(path),
        fd_(storage::Env::Default().OpenAt(AT_FDCWD, path.c_str(),
                                           O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0)) {}
  ~WriteBehind() {
    if (fd_ >= 0) storage::Env::Default().Close(fd_);
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
    (void)storage::Env::Default().Advise(fd_, 0, 0, POSIX_FADV_DONTNEED);
    return OkStatus();
  }

 private:
  Status Sync(unsigned int flags) {
    if (fd_ < 0) return Opened();
    while (storage::Env::Default().SyncRange(fd_, 0, 0, flags) != 0) {
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

// q8: this rank's quantization blocks as flat segments (checkpoint.h). Blocks are numbered
// locally in sub-group order, those holding only padding left out; a block's segments are
// consecutive, in flat order, adjacent pieces merged.
struct LocalSegment {
  std::size_t sub_group = 0;
  std::uint64_t sub_group_block = 0;  // block index within the sub-group
  std::uint64_t block = 0;            // local block number
  std::uint64_t sub_group_offset = 0;
  std::uint64_t flat_start = 0;
  std::uint64_t numel = 0;
};

std::vector<LocalSegment> LocalQ8Segments(const OptimizerSwapper& swapper) {
  std::vector<LocalSegment> segments;
  std::uint64_t next_block = 0;
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    std::size_t f = 0;
    for (std::uint64_t b = 0; b < q8::NumBlocks(sg.numel); ++b) {
      const std::uint64_t begin = b * q8::kBlockNumel;
      const std::uint64_t end = std::min<std::uint64_t>(begin + q8::kBlockNumel, sg.numel);
      bool any = false;
      for (; f < sg.fragments.size(); ++f) {
        const partition::SubGroupFragment& frag = sg.fragments[f];
        if (frag.sub_group_offset >= end) break;
        const std::uint64_t lo = std::max(begin, frag.sub_group_offset);
        const std::uint64_t hi = std::min(end, frag.sub_group_offset + frag.numel);
        if (lo < hi) {
          const std::uint64_t flat = frag.flat_offset + (lo - frag.sub_group_offset);
          LocalSegment* last = segments.empty() ? nullptr : &segments.back();
          if (any && last->sub_group_offset + last->numel == lo &&
              last->flat_start + last->numel == flat) {
            last->numel += hi - lo;
          } else {
            segments.push_back(LocalSegment{i, b, next_block, lo, flat, hi - lo});
          }
          any = true;
        }
        if (frag.sub_group_offset + frag.numel > end) break;  // continues in the next block
      }
      if (any) ++next_block;
    }
  }
  return segments;
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

  // `data`: elements from `flat` on, `element_bytes` each.
  void Feed(std::uint64_t flat, std::span<const std::byte> data, std::uint64_t element_bytes) {
    while (!data.empty()) {
      const std::uint64_t k = flat / chunk_;
      const std::uint64_t begin = k * chunk_;
      const std::uint64_t end = std::min(begin + chunk_, total_);
      const std::uint64_t n = std::min<std::uint64_t>(data.size() / element_bytes, end - flat);
      if (k != current_ || flat != next_) {
        current_ = k;
        valid_ = flat == begin;
        builder_.Reset();
      }
      if (valid_) builder_.Update(data.first(n * element_bytes));
      next_ = flat + n;
      if (valid_ && next_ == end) {
        digests_[k] = builder_.Digest();
        have_[k] = 1;
        valid_ = false;
      }
      flat += n;
      data = data.subspan(n * element_bytes);
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

// Rank 0, before the ranks open the file collectively: the whole structure of the checkpoint
// (attributes, the layout, every dataset with its space allocated), written serially and closed.
// The collective phase then writes raw elements only and never flushes HDF5 metadata: in a
// collective flush or close, a rank whose metadata write failed (ENOSPC) leaves HDF5 before its
// barrier and the other ranks wait in it forever.
Status WriteStructure(const std::string& path, const OptimizerSwapper& swapper,
                      const FileHeader& header) {
  // O_EXCL: the name was cleared just before; a link planted there since is never followed.
  ZINF_ASSIGN_OR_RETURN(H5File file, H5File::CreateSerial(path, h5::H5CreateMode::kFailIfExists));
  const Status written = internal::WriteStructure(file, swapper.plan().layout(), header);
  Status closed = file.Close();
  ZINF_RETURN_IF_ERROR(written);
  ZINF_RETURN_IF_ERROR(closed);
  // The other ranks (other nodes too) open it next.
  return storage::SyncPath(path);
}

// Every rank makes its writes durable and visible to the others (MPI-IO's sync-barrier), with
// our own fdatasync: MPI_File_sync, like HDF5's collective flush, skips its barrier on a rank
// whose sync failed.
Status SyncAndAgree(const comm::Communicator& comm, const std::string& path) {
  return comm.AgreeOnStatus(storage::SyncPath(path));
}

// A save's staging buffers: this rank's state is read from the swap store into them run by run.
struct Staging {
  std::uint64_t numel = 0;    // elements per buffer
  std::vector<Run> runs;      // this rank's runs, split at `numel`
  std::int64_t max_runs = 0;  // the most runs of any rank (agreed)
  std::size_t depth = 1;      // buffers: with 2, the next read overlaps the current write
  PoolLease lease;
};

// Collective: splits this rank's runs at the staging size, agrees on the most runs of any rank,
// and leases the staging buffers (errors agreed).
Result<Staging> LeaseStaging(OptimizerSwapper& swapper) {
  const comm::Communicator& comm = swapper.comm();
  Staging staging;
  staging.numel = std::min(
      {swapper.sub_groups().max_sub_group_numel(), swapper.pool().buffer_numel(), kMaxSlabNumel});
  staging.runs = RunsOf(swapper, staging.numel);
  ZINF_ASSIGN_OR_RETURN(staging.max_runs,
                        AgreeMax(comm, static_cast<std::int64_t>(staging.runs.size())));
  // Two buffers when the pool has three free (ReadState borrows one more), else one: the depth
  // is local, the sequence of collective calls is the same either way.
  staging.depth = swapper.pool().free_count() >= 3 ? 2 : 1;
  Result<PoolLease> lease = swapper.pool().Allocate(staging.numel, staging.depth);
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(
      lease ? OkStatus() : Status(std::move(lease).error().WithContext("checkpoint staging: "))));
  staging.lease = std::move(*lease);
  return staging;
}

// One slab of the state: one state dataset (index into kStates) of one run (`mine` false: a
// rank with fewer runs than max_runs writes an empty slab, as the collective write needs every
// rank).
struct Item {
  Run run;
  std::size_t which;
  bool mine;
};

// The items in the order every rank writes them: the state tensors of run 0, of run 1, ...
std::vector<Item> ItemsOf(const Staging& staging) {
  std::vector<Item> items;
  for (std::int64_t k = 0; k < staging.max_runs; ++k) {
    const bool mine = k < static_cast<std::int64_t>(staging.runs.size());
    for (std::size_t which = 0; which < kNumStateTensors; ++which) {
      items.push_back(Item{mine ? staging.runs[static_cast<std::size_t>(k)] : Run{}, which, mine});
    }
  }
  return items;
}

// q8: each sub-group's scales, kept as its moments are read for the codes (exp_avg, exp_avg_sq).
using SubGroupScales = std::array<std::vector<std::vector<float>>, 2>;

// Reads an item of this rank from the swap store into `out` and hashes it. q8 moments: the
// item's codes, and the sub-group's scales into `scales`.
Status ReadItem(OptimizerSwapper& swapper, const Item& item, std::span<std::byte> out,
                ChunkHasher& hasher, SubGroupScales& scales) {
  comm::Timers& timers = swapper.timers();
  const bool codes = swapper.state_format() == StateFormat::kQ8 && item.which > 0;
  {
    ScopedTimer t(timers, "ckpt_save_read_state");
    if (codes) {
      ZINF_RETURN_IF_ERROR(swapper.ReadQ8Moments(item.run.sub_group, [&](const Q8Moments& m) {
        const Q8Moment& moment = item.which == 1 ? m.exp_avg : m.exp_avg_sq;
        std::memcpy(out.data(), moment.codes.data() + item.run.sub_group_offset, item.run.numel);
        std::vector<float>& kept = scales[item.which - 1][item.run.sub_group];
        kept.assign(moment.scales.begin(), moment.scales.end());
        return OkStatus();
      }));
    } else {
      std::span<float> values(reinterpret_cast<float*>(out.data()), item.run.numel);
      ZINF_RETURN_IF_ERROR(swapper.ReadState(item.run.sub_group, kStates[item.which],
                                             item.run.sub_group_offset, values));
    }
  }
  ScopedTimer t(timers, "ckpt_save_checksum");
  hasher.Feed(item.run.flat_offset, out, codes ? 1 : sizeof(float));
  return OkStatus();
}

// Collective: writes `data` (the elements of dataset `spec` from `flat_offset` on) as one slab.
Status WriteSlabOf(H5File& file, const StateDatasetSpec& spec, std::uint64_t flat_offset,
                   std::span<const std::byte> data) {
  if (spec.type == H5DataType::kUInt8) {
    return file.WriteSlab(spec.name, flat_offset,
                          std::span<const std::uint8_t>(
                              reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  }
  return file.WriteSlab(spec.name, flat_offset,
                        std::span<const float>(reinterpret_cast<const float*>(data.data()),
                                               data.size() / sizeof(float)));
}

// Collective: writes every item's slab, each after agreeing on its read and on the write-behind;
// with two staging buffers the next item is read on a helper thread meanwhile.
Status WriteItems(OptimizerSwapper& swapper, H5File& file, const Staging& staging,
                  std::vector<ChunkHasher>& hashers, SubGroupScales& scales,
                  WriteBehind& write_behind, ProgressReporter* progress) {
  const comm::Communicator& comm = swapper.comm();
  comm::Timers& timers = swapper.timers();
  const std::array<StateDatasetSpec, kNumStateTensors>& specs =
      StateDatasets(swapper.state_format());
  std::uint64_t bytes_per_element = 0;
  for (const StateDatasetSpec& spec : specs) bytes_per_element += spec.element_bytes;
  const std::uint64_t total = swapper.plan().layout().total_numel();
  const std::vector<Item> items = ItemsOf(staging);
  auto buffer_of = [&](std::size_t i) {
    return staging.lease.bytes(i % staging.depth)
        .first(items[i].run.numel * specs[items[i].which].element_bytes);
  };
  // Reads and hashes item i (the hashers see the items in order: one read at a time).
  auto read_item = [&](std::size_t i) -> Status {
    const Item& item = items[i];
    if (!item.mine) return OkStatus();
    return ReadItem(swapper, item, buffer_of(i), hashers[item.which], scales);
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
    if (staging.depth == 2 && i + 1 < items.size()) {
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
                                      StateTensorName(kStates[item.which])))));
    }
    std::span<const std::byte> data;
    if (item.mine) data = buffer_of(i);
    {
      ScopedTimer t(timers, "ckpt_save_write_slab");
      ZINF_RETURN_IF_ERROR(WriteSlabOf(file, specs[item.which], item.run.flat_offset, data));
    }
    write_behind.Start();
    if (item.which == kNumStateTensors - 1) {
      const double runs_done = static_cast<double>(i / kNumStateTensors + 1);
      progress->Update(
          static_cast<std::uint64_t>(runs_done / static_cast<double>(staging.max_runs) *
                                     static_cast<double>(bytes_per_element * total)));
    }
  }
  return OkStatus();
}

// Collective: waits for the last write-behind, then syncs every rank's writes.
Status FlushState(const comm::Communicator& comm, H5File& file, WriteBehind& write_behind,
                  comm::Timers& timers) {
  {
    ScopedTimer t(timers, "ckpt_save_writeback_wait");
    ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(write_behind.Wait()));
  }
  ScopedTimer t(timers, "ckpt_save_flush");
  return SyncAndAgree(comm, file.path());
}

// Collective: reads flat elements [begin, end) of dataset `spec` back in `pieces` reads of at
// most piece_numel elements (empty ones past `end`) through `piece` and returns their digest.
Result<std::uint64_t> HashReadBack(H5File& file, const StateDatasetSpec& spec, std::uint64_t begin,
                                   std::uint64_t end, std::uint64_t pieces,
                                   std::uint64_t piece_numel, std::span<std::byte> piece) {
  storage::ChecksumBuilder builder;
  for (std::uint64_t p = 0; p < pieces; ++p) {
    const std::uint64_t from = std::min(begin + p * piece_numel, end);
    const std::uint64_t to = std::min(from + piece_numel, end);
    if (spec.type == H5DataType::kUInt8) {
      std::span<std::uint8_t> out(reinterpret_cast<std::uint8_t*>(piece.data()), to - from);
      ZINF_RETURN_IF_ERROR(file.ReadSlab(spec.name, from, out));
      builder.Update(std::as_bytes(out));
    } else {
      std::span<float> out(reinterpret_cast<float*>(piece.data()), to - from);
      ZINF_RETURN_IF_ERROR(file.ReadSlab(spec.name, from, out));
      builder.Update(std::as_bytes(out));
    }
  }
  return builder.Digest();
}

// Collective: hashes the chunks no rank hashed completely (orphan j is read back by rank
// j % size) and writes each state's checksum table (rank 0's digests).
Status WriteChecksums(const comm::Communicator& comm, H5File& file, StateFormat format,
                      std::span<std::byte> staging, std::vector<ChunkHasher>& hashers,
                      std::uint64_t total, std::uint64_t chunk) {
  // Orphan chunks: read back by rank (j % size), in pieces of the (agreed) staging size.
  std::int64_t piece =
      static_cast<std::int64_t>(std::min<std::uint64_t>(staging.size() / sizeof(float), chunk));
  ZINF_RETURN_IF_ERROR(
      comm.AllreduceInPlace<std::int64_t>(std::span(&piece, 1), comm::ReduceOp::kMin));
  const std::uint64_t piece_numel = static_cast<std::uint64_t>(piece);
  const std::uint64_t pieces_per_chunk = (std::min(chunk, total) + piece_numel - 1) / piece_numel;
  const std::uint64_t num_chunks = NumChunks(total, chunk);
  const std::uint64_t size = static_cast<std::uint64_t>(comm.size());
  for (std::size_t which = 0; which < kNumStateTensors; ++which) {
    const StateDatasetSpec& spec = StateDatasets(format)[which];
    ChunkHasher& hasher = hashers[which];
    ZINF_RETURN_IF_ERROR(
        comm.AllreduceInPlace<std::uint64_t>(std::span(hasher.have()), comm::ReduceOp::kMax));
    std::vector<std::uint64_t> orphans;
    for (std::uint64_t c = 0; c < num_chunks; ++c) {
      if (hasher.have()[c] == 0) orphans.push_back(c);
    }
    const std::uint64_t rounds = (orphans.size() + size - 1) / size;
    for (std::uint64_t r = 0; r < rounds; ++r) {
      const std::uint64_t j = r * size + static_cast<std::uint64_t>(comm.rank());
      const bool mine = j < orphans.size();
      const std::uint64_t c = mine ? orphans[j] : 0;
      const std::uint64_t begin = c * chunk;
      const std::uint64_t end = mine ? std::min(begin + chunk, total) : begin;
      ZINF_ASSIGN_OR_RETURN(
          const std::uint64_t digest,
          HashReadBack(file, spec, begin, end, pieces_per_chunk, piece_numel, staging));
      if (mine) hasher.digests()[c] = digest;
    }
    // Exactly one rank contributes each chunk's digest.
    ZINF_RETURN_IF_ERROR(
        comm.AllreduceInPlace<std::uint64_t>(std::span(hasher.digests()), comm::ReduceOp::kSum));
    std::span<const std::uint64_t> sums;
    if (comm.rank() == 0) sums = hasher.digests();
    ZINF_RETURN_IF_ERROR(file.WriteSlab(spec.checksum, 0, sums));
  }
  return OkStatus();
}

// q8: where this rank's segments and blocks go in the file's tables (ranks in order), and the
// totals (agreed).
struct Q8Placement {
  std::vector<LocalSegment> segments;
  std::uint64_t local_blocks = 0;
  std::uint64_t first_segment = 0;
  std::uint64_t first_block = 0;
  std::uint64_t num_segments = 0;
  std::uint64_t num_blocks = 0;
};

// Collective (every format; empty for fp32).
Result<Q8Placement> PlaceQ8Tables(const OptimizerSwapper& swapper) {
  Q8Placement p;
  if (swapper.state_format() == StateFormat::kQ8) p.segments = LocalQ8Segments(swapper);
  p.local_blocks = p.segments.empty() ? 0 : p.segments.back().block + 1;
  const comm::Communicator& comm = swapper.comm();
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(comm.size()));
  const std::uint64_t mine[2] = {p.segments.size(), p.local_blocks};
  ZINF_RETURN_IF_ERROR(comm.Allgather<std::uint64_t>(std::span<const std::uint64_t>(mine), all));
  for (int r = 0; r < comm.size(); ++r) {
    const auto k = 2 * static_cast<std::size_t>(r);
    if (r < comm.rank()) {
      p.first_segment += all[k];
      p.first_block += all[k + 1];
    }
    p.num_segments += all[k];
    p.num_blocks += all[k + 1];
  }
  return p;
}

// Collective (q8): each rank's segments and its blocks' scales at its place in the tables.
Status WriteQ8Tables(H5File& file, const Q8Placement& p, const SubGroupScales& scales) {
  std::vector<std::uint64_t> start, numel, block;
  std::array<std::vector<float>, 2> block_scales;
  Status local = OkStatus();
  for (const LocalSegment& seg : p.segments) {
    start.push_back(seg.flat_start);
    numel.push_back(seg.numel);
    block.push_back(p.first_block + seg.block);
    if (seg.block < block_scales[0].size()) continue;  // a later segment of the same block
    for (std::size_t m = 0; m < 2; ++m) {
      const std::vector<float>& kept = scales[m][seg.sub_group];
      if (seg.sub_group_block >= kept.size()) {
        local = InternalError(fmt::format("checkpoint: no scales of sub-group {}", seg.sub_group));
        block_scales[m].push_back(0.0f);
      } else {
        block_scales[m].push_back(kept[seg.sub_group_block]);
      }
    }
  }
  ZINF_RETURN_IF_ERROR(local);
  using internal::Q8Dataset;
  ZINF_RETURN_IF_ERROR(file.WriteSlab(kQ8Datasets[Q8Dataset::kSegmentStart], p.first_segment,
                                      std::span<const std::uint64_t>(start)));
  ZINF_RETURN_IF_ERROR(file.WriteSlab(kQ8Datasets[Q8Dataset::kSegmentNumel], p.first_segment,
                                      std::span<const std::uint64_t>(numel)));
  ZINF_RETURN_IF_ERROR(file.WriteSlab(kQ8Datasets[Q8Dataset::kSegmentBlock], p.first_segment,
                                      std::span<const std::uint64_t>(block)));
  ZINF_RETURN_IF_ERROR(file.WriteSlab(kQ8Datasets[Q8Dataset::kExpAvgScales], p.first_block,
                                      std::span<const float>(block_scales[0])));
  return file.WriteSlab(kQ8Datasets[Q8Dataset::kExpAvgSqScales], p.first_block,
                        std::span<const float>(block_scales[1]));
}

// Collective (q8), after the tables are flushed: rank 0 reads them back whole (the others read
// nothing) and writes their checksums (entries 2.. of /checksum/q8).
Status WriteQ8Checksums(const comm::Communicator& comm, H5File& file, const Q8Placement& p) {
  const bool root = comm.rank() == 0;
  std::vector<std::uint64_t> sums;
  using internal::Q8Dataset;
  for (Q8Dataset d :
       {Q8Dataset::kSegmentStart, Q8Dataset::kSegmentNumel, Q8Dataset::kSegmentBlock}) {
    std::vector<std::uint64_t> values(root ? p.num_segments : 0);
    ZINF_RETURN_IF_ERROR(file.ReadSlab(kQ8Datasets[d], 0, std::span(values)));
    sums.push_back(storage::Checksum64(std::as_bytes(std::span(values))));
  }
  for (Q8Dataset d : {Q8Dataset::kExpAvgScales, Q8Dataset::kExpAvgSqScales}) {
    std::vector<float> values(root ? p.num_blocks : 0);
    ZINF_RETURN_IF_ERROR(file.ReadSlab(kQ8Datasets[d], 0, std::span(values)));
    sums.push_back(storage::Checksum64(std::as_bytes(std::span(values))));
  }
  if (!root) sums.clear();
  return file.WriteSlab(kQ8Checksums, Q8Dataset::kSegmentStart,
                        std::span<const std::uint64_t>(sums));
}

// Collective: the state (and then the checksums) of every rank into the open file.
Status WriteContents(OptimizerSwapper& swapper, H5File& file, const CheckpointSaveOptions& options,
                     const Q8Placement& placement, ProgressReporter* progress) {
  const comm::Communicator& comm = swapper.comm();
  const std::uint64_t total = swapper.plan().layout().total_numel();
  const std::uint64_t chunk = options.chunk_numel;
  comm::Timers& timers = swapper.timers();

  // State: run by run, each state tensor in turn. With two staging buffers (the common case) the
  // next tensor is read from the swap store and hashed on a helper thread while this thread
  // writes the current one, so a save costs about max(read, write) instead of their sum. Only the
  // helper uses the swapper while a read is pending (ReadState is local and the engines take
  // requests from any one thread), and every pending read is joined before its buffer is reused
  // or released (std::async futures join on destruction: WriteItems' is gone when it returns,
  // and the lease in `staging` outlives it).
  ZINF_ASSIGN_OR_RETURN(Staging staging, LeaseStaging(swapper));
  std::vector<ChunkHasher> hashers;
  for (std::size_t t = 0; t < kNumStateTensors; ++t) hashers.emplace_back(total, chunk);
  SubGroupScales scales;
  for (std::vector<std::vector<float>>& per_sub_group : scales) {
    per_sub_group.resize(swapper.num_sub_groups());
  }
  WriteBehind write_behind(file.path());
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(write_behind.Opened()));
  ZINF_RETURN_IF_ERROR(WriteItems(swapper, file, staging, hashers, scales, write_behind, progress));
  const bool q8 = swapper.state_format() == StateFormat::kQ8;
  if (q8) ZINF_RETURN_IF_ERROR(WriteQ8Tables(file, placement, scales));
  ZINF_RETURN_IF_ERROR(FlushState(comm, file, write_behind, timers));
  ScopedTimer orphan_timer(timers, "ckpt_save_orphans_and_checksums");
  ZINF_RETURN_IF_ERROR(WriteChecksums(comm, file, swapper.state_format(),
                                      staging.lease.bytes(0).first(staging.numel * sizeof(float)),
                                      hashers, total, chunk));
  if (q8) {
    ZINF_RETURN_IF_ERROR(SyncAndAgree(comm, file.path()));  // the tables, before reading back
    ZINF_RETURN_IF_ERROR(WriteQ8Checksums(comm, file, placement));
  }
  staging.lease.Release();
  return OkStatus();
}

// The header of a checkpoint of `swapper` saved with `options` (q8 table sizes: 0, set later).
FileHeader MakeHeader(const OptimizerSwapper& swapper, std::int64_t step,
                      const CheckpointSaveOptions& options) {
  FileHeader header;
  header.format = swapper.state_format();
  header.step = step;
  header.world_size = swapper.comm().size();
  header.sub_group_size = static_cast<std::int64_t>(swapper.options().sub_group_size);
  header.chunk_numel = std::max<std::uint64_t>(options.chunk_numel, 1);
  header.optimizer =
      DumpJson(options.optimizer.is_null() ? DerivedOptimizerJson(swapper.options().adam)
                                           : options.optimizer);
  header.config = options.config.is_null() ? "{}" : DumpJson(options.config);
  header.trainer = options.trainer.is_null() ? "{}" : DumpJson(options.trainer);
  header.created = UtcNow();
  return header;
}

// The bytes of state a checkpoint of `swapper` holds.
std::uint64_t StateBytes(const OptimizerSwapper& swapper) {
  std::uint64_t per_element = 0;
  for (const StateDatasetSpec& spec : StateDatasets(swapper.state_format())) {
    per_element += spec.element_bytes;
  }
  return per_element * swapper.plan().layout().total_numel();
}

// Rank 0's side of the file: the checkpoint directory (opened once, so that every name below is
// resolved in it and never through a link planted in it) and the space of the partial file.
class PartialFile {
 public:
  // Creates the directory (with parents) if missing, checks that it has room for about
  // `estimate_bytes`, and removes whatever entry is named `partial_name` (a stale partial file,
  // or a link planted there: unlinked, never followed), for WriteStructure's exclusive create.
  // Errors: ResourceExhausted (too little space), FailedPrecondition (the partial, step or
  // `latest` name is a directory, device, FIFO or socket: never replaced), errno errors.
  static Result<PartialFile> Prepare(const std::string& dir, const std::string& partial_name,
                                     std::uint64_t estimate_bytes, std::int64_t step) {
    ZINF_RETURN_IF_ERROR(
        Annotate(storage::CreateDirectories(dir), "create the checkpoint directory: "));
    PartialFile partial;
    partial.dir_ = dir;
    partial.name_ = partial_name;
    ZINF_ASSIGN_OR_RETURN(partial.dir_fd_, storage::OpenDirectory(dir, storage::Follow::kYes));
    ZINF_ASSIGN_OR_RETURN(const std::uint64_t available, storage::AvailableBytes(dir));
    if (available < estimate_bytes) {
      return ResourceExhaustedError(fmt::format(
          "checkpoint step {} needs about {} in {}, which has {} available; free space there "
          "(or set keep_last)",
          step, FormatBytes(estimate_bytes), dir, FormatBytes(available)));
    }
    // The names the save replaces (the partial, the step file, `latest`) must be regular files
    // or links, never a device, FIFO, socket or directory someone put there.
    std::string final_name = partial_name;
    if (final_name.ends_with(".partial")) final_name.resize(final_name.size() - 8);
    for (const std::string& name : {partial_name, final_name, std::string("latest")}) {
      ZINF_RETURN_IF_ERROR(
          storage::CheckReplaceableAt(partial.dir_fd_.get(), name, dir + "/" + name));
    }
    if (storage::Env::Default().UnlinkAt(partial.dir_fd_.get(), partial_name.c_str(), 0) != 0 &&
        errno != ENOENT) {
      return ErrnoError(errno, fmt::format("remove the stale {}/{}", dir, partial_name));
    }
    partial.created_ = true;  // from here on, Remove() cleans up whatever WriteStructure made
    return partial;
  }

  std::string path() const { return dir_ + "/" + name_; }

  // After WriteStructure made the file: reserves its blocks up to `estimate_bytes` (fallocate
  // KEEP_SIZE), so that the collective writes of the elements cannot run out of space half-way
  // (MPI-IO's collective writes, like HDF5's flushes, can hang the other ranks when one rank's
  // write fails). A file system without fallocate is used without the reservation, with a WARN.
  Status Reserve(std::uint64_t estimate_bytes) {
    ZINF_ASSIGN_OR_RETURN(
        fd_, storage::OpenFileAt(dir_fd_.get(), name_, path(), storage::FileAccess::kReadWrite));
    int rc;
    do {
      rc = storage::Env::Default().Allocate(fd_.get(), FALLOC_FL_KEEP_SIZE, 0,
                                            static_cast<off_t>(estimate_bytes));
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) {
      reserved_bytes_ = estimate_bytes;
      return OkStatus();
    }
    if (errno == EOPNOTSUPP || errno == ENOSYS) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        ZINF_LOG_WARN(
            "{}: the file system cannot reserve space (no fallocate); a disk that "
            "fills up during a checkpoint save may stall it",
            dir_);
      }
      return OkStatus();
    }
    return ErrnoError(errno, fmt::format("reserve {} for {}", FormatBytes(estimate_bytes), path()));
  }

  // After a successful close: returns the reserved blocks beyond the end of the file.
  void TrimReservation() {
    struct stat st {};
    storage::Env& env = storage::Env::Default();
    if (reserved_bytes_ == 0 || !fd_ || env.StatAt(fd_.get(), "", &st, AT_EMPTY_PATH) != 0 ||
        static_cast<std::uint64_t>(st.st_size) >= reserved_bytes_) {
      return;
    }
    // Advisory: failure only keeps a few unused blocks allocated.
    (void)env.Allocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size,
                       static_cast<off_t>(reserved_bytes_) - st.st_size);
  }

  // On failure: removes the partial file.
  void Remove() {
    fd_.Reset();
    if (created_) storage::Env::Default().UnlinkAt(dir_fd_.get(), name_.c_str(), 0);
    created_ = false;
  }

  // Renames the partial file to `final_name`, fsyncs the directory, replaces `latest`
  // atomically, then removes stale partial files and applies keep_last.
  Status Commit(const std::string& final_name, int keep_last, std::vector<std::string>* removed) {
    ZINF_RETURN_IF_ERROR(fd_.Close(path()));
    if (storage::Env::Default().RenameAt(dir_fd_.get(), name_.c_str(), dir_fd_.get(),
                                         final_name.c_str(), 0) != 0) {
      return ErrnoError(errno, fmt::format("rename {} -> {}/{}", path(), dir_, final_name));
    }
    created_ = false;
    ZINF_RETURN_IF_ERROR(storage::SyncFd(dir_fd_.get(), /*data_only=*/false, dir_));
    ZINF_RETURN_IF_ERROR(
        storage::WriteFileAtomicAt(dir_fd_.get(), dir_, "latest", final_name + "\n"));
    *removed = ApplyRetention(final_name, keep_last);
    return OkStatus();
  }

 private:
  // Removes stale .partial files and applies keep_last. Only names the checkpoint protocol
  // makes are touched (ParseCheckpointFileName), each with unlinkat (a link is removed, never
  // followed); at most kMaxEntries directory entries are examined.
  std::vector<std::string> ApplyRetention(const std::string& keep_name, int keep_last) {
    constexpr std::size_t kMaxEntries = 1 << 20;
    std::vector<std::string> removed;
    std::vector<std::pair<std::int64_t, std::string>> others;
    storage::Env& env = storage::Env::Default();
    Result<storage::DirectoryListing> listing =
        storage::ListDirectory(dir_fd_.get(), dir_, kMaxEntries);
    if (!listing) {
      ZINF_LOG_WARN("checkpoint retention: {}", listing.error().ToString());
      return removed;
    }
    if (listing->truncated) {
      ZINF_LOG_WARN("checkpoint retention: {} holds more than {} entries; looked at the first",
                    dir_, kMaxEntries);
    }
    const std::vector<std::string>& names = listing->names;
    auto remove = [&](const std::string& name) {
      if (env.UnlinkAt(dir_fd_.get(), name.c_str(), 0) == 0) {
        removed.push_back(dir_ + "/" + name);
      } else if (errno != ENOENT) {
        ZINF_LOG_WARN("checkpoint retention: cannot remove {}/{}: {}", dir_,
                      EscapeForTerminal(name), std::strerror(errno));
      }
    };
    for (const std::string& name : names) {
      // A crashed save's partial file, and the shared-file-pointer lock file Open MPI's MPI-IO
      // keeps next to it (<file>-<jobid>-<pid>.lock), which only a clean close removes.
      if (IsStalePartialName(name)) {
        remove(name);
        continue;
      }
      if (name == keep_name) continue;
      if (const std::optional<std::int64_t> step = ParseCheckpointFileName(name)) {
        others.emplace_back(*step, name);
      }
    }
    if (keep_last <= 0) return removed;
    std::sort(others.begin(), others.end(), std::greater<>());
    for (std::size_t i = static_cast<std::size_t>(keep_last - 1); i < others.size(); ++i) {
      remove(others[i].second);
    }
    return removed;
  }

  // "step-<N>.h5.partial" or "step-<N>.h5.partial-<digits>-<digits>.lock".
  static bool IsStalePartialName(std::string_view name) {
    if (ParseCheckpointFileName(name, ".partial")) return true;
    const std::size_t at = name.find(".h5.partial-");
    if (at == std::string_view::npos || !name.ends_with(".lock")) return false;
    if (!ParseCheckpointFileName(name.substr(0, at + 3))) return false;
    const std::string_view ids =
        name.substr(at + 12, name.size() - (at + 12) - std::string_view(".lock").size());
    const std::size_t dash = ids.find('-');
    auto digits = [](std::string_view d) {
      return !d.empty() && d.size() <= 20 &&
             std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    return dash != std::string_view::npos && digits(ids.substr(0, dash)) &&
           digits(ids.substr(dash + 1));
  }

  std::string dir_;
  std::string name_;
  storage::UniqueFd dir_fd_;
  storage::UniqueFd fd_;
  bool created_ = false;
  std::uint64_t reserved_bytes_ = 0;
};

// SaveCheckpoint's arguments: dir, step, chunk_numel and the JSON objects.
Status CheckSaveArguments(std::int64_t step, const CheckpointSaveOptions& options) {
  Status check = OkStatus();
  if (options.dir.empty()) {
    check = InvalidArgumentError("SaveCheckpoint: empty dir");
  } else if (step < 0 || step > kMaxCheckpointStep) {
    check = InvalidArgumentError(
        fmt::format("SaveCheckpoint: step {} not in [0, {}]", step, kMaxCheckpointStep));
  } else if (options.chunk_numel == 0 || options.chunk_numel > kMaxCheckpointChunkNumel) {
    check = InvalidArgumentError(fmt::format("SaveCheckpoint: chunk_numel {} not in [1, {}]",
                                             options.chunk_numel, kMaxCheckpointChunkNumel));
  }
  for (const nlohmann::json* j : {&options.optimizer, &options.config, &options.trainer}) {
    if (check && !j->is_null() && !j->is_object()) {
      check = InvalidArgumentError(
          "SaveCheckpoint: optimizer, config and trainer must be JSON "
          "objects");
    }
  }
  return check;
}

// Rank 0: checks the space and clears the partial file's name (into `partial`, kept when a later
// step fails so that the caller removes the file), writes the file's structure and reserves the
// estimated space.
Status PreparePartialFile(const OptimizerSwapper& swapper, std::int64_t step,
                          const CheckpointSaveOptions& options, const std::string& partial_name,
                          const std::string& partial_path, const Q8Placement& placement,
                          std::optional<PartialFile>& partial) {
  FileHeader header = MakeHeader(swapper, step, options);
  header.num_segments = placement.num_segments;
  header.num_blocks = placement.num_blocks;
  const std::uint64_t estimate = EstimateFileBytes(swapper.plan().layout(), header);
  ZINF_ASSIGN_OR_RETURN(partial, PartialFile::Prepare(options.dir, partial_name, estimate, step));
  ZINF_RETURN_IF_ERROR(WriteStructure(partial_path, swapper, header));
  return partial->Reserve(estimate);
}

// Collective: closes the file and makes this rank's writes durable before the rename.
// `written` is WriteContents' status, agreed already: agreeing it again would name rank 0 and
// count every rank as failed.
Status CloseAndSync(const comm::Communicator& comm, H5File& file, Status written,
                    const std::string& partial_path, comm::Timers& timers) {
  timers.Start("ckpt_save_close");
  Status closed = file.Close();
  timers.Stop("ckpt_save_close");
  Status local = written ? closed : written;
  // Durability of the data before the rename: every rank syncs what it wrote.
  timers.Start("ckpt_save_fdatasync");
  if (local) local = storage::SyncPath(partial_path);
  timers.Stop("ckpt_save_fdatasync");
  return written ? comm.AgreeOnStatus(local) : std::move(written);
}

// Collective: rank 0 (the one holding `partial`) renames it to `name` and applies retention,
// the files it removed into `removed`; the status is agreed.
Status CommitPartial(const comm::Communicator& comm, std::optional<PartialFile>& partial,
                     const std::string& name, int keep_last, std::vector<std::string>* removed,
                     comm::Timers& timers) {
  Status committed = OkStatus();
  ScopedTimer t(timers, "ckpt_save_commit");
  if (partial) {
    partial->TrimReservation();
    committed = partial->Commit(name, keep_last, removed);
  }
  return comm.AgreeOnStatus(Annotate(committed, "checkpoint commit: "));
}

}  // namespace

std::uint64_t EstimateCheckpointBytes(const OptimizerSwapper& swapper,
                                      const CheckpointSaveOptions& options) {
  // An upper bound on the q8 tables without the collective count: every sub-group's blocks, a
  // segment per block and fragment.
  std::uint64_t segments = 0;
  std::uint64_t blocks = 0;
  if (swapper.state_format() == StateFormat::kQ8) {
    const std::uint64_t ranks = static_cast<std::uint64_t>(swapper.comm().size());
    for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
      const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
      blocks += ranks * q8::NumBlocks(sg.numel);
      segments += ranks * (q8::NumBlocks(sg.numel) + sg.fragments.size());
    }
  }
  FileHeader header = MakeHeader(swapper, /*step=*/0, options);
  header.num_segments = segments;
  header.num_blocks = blocks;
  return EstimateFileBytes(swapper.plan().layout(), header);
}

Result<SavedCheckpoint> SaveCheckpoint(OptimizerSwapper& swapper, std::int64_t step,
                                       const CheckpointSaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const comm::Communicator& comm = swapper.comm();
  const bool root = comm.rank() == 0;
  Status check = CheckSaveArguments(step, options);
  const std::string name = CheckpointFileName(step);
  const std::string partial_name = name + ".partial";
  const std::string partial_path = options.dir + "/" + partial_name;
  const std::string context = fmt::format("checkpoint save step {}: ", step);
  comm::Timers& timers = swapper.timers();
  // q8: every rank's blocks, counted before rank 0 writes the tables' structure.
  Result<Q8Placement> placement = PlaceQ8Tables(swapper);
  if (!placement) return std::move(placement).error().WithContext(context);
  // Rank 0 checks the space, clears the partial file's name and writes the file's structure.
  std::optional<PartialFile> partial;
  if (root && check) {
    ScopedTimer t(timers, "ckpt_save_header");
    check =
        PreparePartialFile(swapper, step, options, partial_name, partial_path, *placement, partial);
  }
  // From here on, every failure removes the partial file on rank 0.
  auto fail = [&](Error error) -> Error {
    if (partial) partial->Remove();
    return std::move(error).WithContext(context);
  };
  if (Status agreed = comm.AgreeOnStatus(check); !agreed) return fail(std::move(agreed).error());

  const std::uint64_t state_bytes = StateBytes(swapper);
  ProgressReporter progress(fmt::format("checkpoint save step {}", step), state_bytes,
                            root && options.progress, options.progress_interval_s);
  Result<H5File> opened = H5File::OpenCollective(comm, partial_path, /*read_only=*/false);
  if (!opened) return fail(std::move(opened).error());
  H5File file = std::move(*opened);
  // WriteContents' errors are agreed already. The collective close below is safe after them:
  // the file holds no unwritten HDF5 metadata (see WriteStructure).
  Status written = WriteContents(swapper, file, options, *placement, &progress);
  Status agreed = CloseAndSync(comm, file, std::move(written), partial_path, timers);
  SavedCheckpoint saved;
  if (agreed) {
    agreed = CommitPartial(comm, partial, name, options.keep_last, &saved.removed, timers);
  }
  if (!agreed) return fail(std::move(agreed).error());
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

// Collective: rank 0 resolves `path` once (`latest`), so that every rank reads the same file.
Result<std::string> AgreeOnRestorePath(const comm::Communicator& comm, const std::string& path) {
  std::string file_path;
  Status resolved = OkStatus();
  if (comm.rank() == 0) {
    Result<std::string> r = ResolveCheckpointPath(path);
    if (r) {
      file_path = *r;
    } else {
      resolved = std::move(r).error();
    }
  }
  ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(resolved), "checkpoint restore: "));
  ZINF_RETURN_IF_ERROR(comm.BroadcastString(&file_path, 0));
  return file_path;
}

// A checkpoint opened for restore. Not movable: the readers point into `file`.
struct RestoreSource {
  RestoreSource() = default;
  RestoreSource(const RestoreSource&) = delete;
  RestoreSource& operator=(const RestoreSource&) = delete;

  std::optional<H5File> file;
  std::optional<CheckpointInfo> info;
  std::optional<internal::Q8Tables> tables;  // q8 files
  std::vector<StateReader> readers;          // one per state tensor
};

// Local: opens this rank's read-only handle, validates the header against the swapper, and
// makes a verified reader per state tensor.
Status OpenForRestore(const OptimizerSwapper& swapper, const std::string& file_path,
                      const CheckpointRestoreOptions& options, RestoreSource* source) {
  Result<H5File> opened = H5File::OpenSerial(file_path, /*read_only=*/true);
  if (!opened) return std::move(opened).error();
  source->file.emplace(std::move(*opened));
  Result<CheckpointInfo> i = internal::ReadInfo(*source->file, file_path);
  if (!i) return std::move(i).error();
  source->info.emplace(std::move(*i));
  const CheckpointInfo& info = *source->info;
  ZINF_RETURN_IF_ERROR(partition::CompareLayouts(*info.layout, swapper.plan().layout(),
                                                 /*compare_dtype=*/false));
  if (options.check_optimizer) {
    ZINF_RETURN_IF_ERROR(CheckOptimizer(info.optimizer, swapper.options().adam));
  }
  if (options.check_info) ZINF_RETURN_IF_ERROR(options.check_info(info));
  if (info.state_format == StateFormat::kQ8) {
    ZINF_ASSIGN_OR_RETURN(source->tables, internal::ReadQ8Tables(*source->file, info));
  }
  for (std::size_t t = 0; t < kNumStateTensors; ++t) {
    ZINF_ASSIGN_OR_RETURN(
        StateReader reader,
        StateReader::Open(&*source->file, info, t, source->tables ? &*source->tables : nullptr));
    source->readers.push_back(std::move(reader));
  }
  return OkStatus();
}

// q8 file into a q8 swapper: for each local block of sub-group `i` (LocalQ8Segments), the file's
// block with exactly its segments; nullopt if some block of the sub-group has none (other world
// size or sub_group_size), or the file's maps are not this build's.
std::optional<std::vector<std::uint64_t>> MatchingFileBlocks(
    const internal::Q8Tables& tables, std::span<const LocalSegment> segments) {
  if (tables.maps[0] != q8::MapValues(q8::MapKind::kSigned) ||
      tables.maps[1] != q8::MapValues(q8::MapKind::kUnsigned)) {
    return std::nullopt;
  }
  std::vector<std::uint64_t> file_block;  // by local block, from the first local block
  std::size_t k = 0;
  while (k < segments.size()) {
    std::size_t end = k;
    while (end < segments.size() && segments[end].block == segments[k].block) ++end;
    const internal::Q8Segment& first = tables.segments[tables.SegmentOf(segments[k].flat_start)];
    for (std::size_t j = k; j < end; ++j) {
      const internal::Q8Segment& f = tables.segments[tables.SegmentOf(segments[j].flat_start)];
      if (f.start != segments[j].flat_start || f.numel != segments[j].numel ||
          f.block != first.block) {
        return std::nullopt;
      }
    }
    if (tables.block_segments[first.block] != end - k) return std::nullopt;
    file_block.push_back(first.block);
    k = end;
  }
  return file_block;
}

// Local: verifies every chunk this rank's runs touch, state tensor by state tensor.
Status VerifyRuns(std::vector<StateReader>& readers, const std::vector<Run>& runs,
                  ProgressReporter& progress, std::uint64_t* done) {
  for (StateReader& reader : readers) {
    for (const Run& r : runs) {
      ZINF_RETURN_IF_ERROR(reader.Verify(r.flat_offset, r.numel));
      *done += r.numel * reader.element_bytes();
      progress.Update(*done);
    }
  }
  return OkStatus();
}

// Local: sub-group `i`'s q8 state copied exactly from a q8 file whose blocks are its blocks
// (`segments`: the sub-group's, `file_blocks`: MatchingFileBlocks).
Status WriteExactQ8(OptimizerSwapper& swapper, RestoreSource& source, std::size_t i,
                    std::span<const Run> runs, std::span<const LocalSegment> segments,
                    const std::vector<std::uint64_t>& file_blocks, std::int64_t step,
                    ProgressReporter& progress, std::uint64_t* done) {
  const internal::Q8Tables& tables = *source.tables;
  return swapper.WriteQ8State(
      i, step,
      [&](std::span<float> fp32) -> Status {
        for (const Run& run : runs) {
          ZINF_RETURN_IF_ERROR(source.readers[0].Read(
              run.flat_offset, fp32.subspan(run.sub_group_offset, run.numel)));
          *done += run.numel * sizeof(float);
        }
        progress.Update(*done);
        return OkStatus();
      },
      [&](const Q8Moments& m) -> Status {
        std::ranges::fill(m.exp_avg.codes, q8::ZeroCode(q8::MapKind::kSigned));
        std::ranges::fill(m.exp_avg_sq.codes, q8::ZeroCode(q8::MapKind::kUnsigned));
        std::ranges::fill(m.exp_avg.scales, 0.0f);
        std::ranges::fill(m.exp_avg_sq.scales, 0.0f);
        const std::uint64_t first_block = segments.empty() ? 0 : segments.front().block;
        for (const LocalSegment& seg : segments) {
          const std::uint64_t file_block = file_blocks[seg.block - first_block];
          const Q8Moment* moments[2] = {&m.exp_avg, &m.exp_avg_sq};
          for (std::size_t t = 0; t < 2; ++t) {
            ZINF_RETURN_IF_ERROR(source.readers[1 + t].ReadCodes(
                seg.flat_start, moments[t]->codes.subspan(seg.sub_group_offset, seg.numel)));
            moments[t]->scales[seg.sub_group_block] = tables.scales[t][file_block];
          }
          *done += 2 * seg.numel;
        }
        progress.Update(*done);
        return OkStatus();
      });
}

// Local: writes each sub-group's state, read from the checkpoint run by run, to the swap store
// (committed as `step`).
// q8 file into a q8 swapper: a sub-group whose blocks are the file's is copied exactly
// (WriteExactQ8); any other is decoded and quantized again (WriteState).
Status WriteRuns(OptimizerSwapper& swapper, RestoreSource& source, const std::vector<Run>& runs,
                 std::int64_t step, ProgressReporter& progress, std::uint64_t* done,
                 std::size_t* exact_sub_groups) {
  comm::Timers& timers = swapper.timers();
  const bool q8_to_q8 = source.tables && swapper.state_format() == StateFormat::kQ8;
  const std::vector<LocalSegment> segments =
      q8_to_q8 ? LocalQ8Segments(swapper) : std::vector<LocalSegment>();
  Status local = OkStatus();
  std::size_t next_run = 0;
  std::size_t next_segment = 0;
  for (std::size_t i = 0; i < swapper.num_sub_groups() && local; ++i) {
    const std::size_t first = next_run;
    while (next_run < runs.size() && runs[next_run].sub_group == i) ++next_run;
    const std::size_t last = next_run;
    const std::size_t first_segment = next_segment;
    while (next_segment < segments.size() && segments[next_segment].sub_group == i) {
      ++next_segment;
    }
    const std::span<const LocalSegment> mine =
        std::span(segments).subspan(first_segment, next_segment - first_segment);
    ScopedTimer write_timer(timers, "ckpt_restore_write_state");
    if (q8_to_q8) {
      if (std::optional<std::vector<std::uint64_t>> file_blocks =
              MatchingFileBlocks(*source.tables, mine)) {
        ScopedTimer read_timer(timers, "ckpt_restore_read_in_write_state");
        local = WriteExactQ8(swapper, source, i, std::span(runs).subspan(first, last - first), mine,
                             *file_blocks, step, progress, done);
        ++*exact_sub_groups;
        continue;
      }
    }
    local = swapper.WriteState(i, step, [&](StateTensor which, std::span<float> out) -> Status {
      ScopedTimer read_timer(timers, "ckpt_restore_read_in_write_state");
      for (std::size_t r = first; r < last; ++r) {
        const Run& run = runs[r];
        ZINF_RETURN_IF_ERROR(source.readers[static_cast<std::size_t>(which)].Read(
            run.flat_offset, out.subspan(run.sub_group_offset, run.numel)));
        *done += run.numel * source.readers[static_cast<std::size_t>(which)].element_bytes();
      }
      progress.Update(*done);
      return OkStatus();
    });
  }
  return local;
}

// What RestoreCheckpoint returns: the file's metadata (moved out of `info`).
RestoredCheckpoint Restored(const std::string& file_path, CheckpointInfo& info,
                            std::chrono::steady_clock::time_point start) {
  RestoredCheckpoint restored;
  restored.path = file_path;
  restored.step = info.step;
  restored.world_size = static_cast<int>(info.world_size);
  restored.optimizer = std::move(info.optimizer);
  restored.config = std::move(info.config);
  restored.trainer = std::move(info.trainer);
  restored.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return restored;
}

}  // namespace

Result<RestoredCheckpoint> RestoreCheckpoint(OptimizerSwapper& swapper, const std::string& path,
                                             const CheckpointRestoreOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const comm::Communicator& comm = swapper.comm();
  ZINF_ASSIGN_OR_RETURN(const std::string file_path, AgreeOnRestorePath(comm, path));
  const std::string context = fmt::format("checkpoint restore from {}: ", file_path);

  comm::Timers& timers = swapper.timers();
  std::optional<ScopedTimer> open_timer(std::in_place, timers, "ckpt_restore_open");
  RestoreSource source;
  ZINF_RETURN_IF_ERROR(
      Annotate(comm.AgreeOnStatus(OpenForRestore(swapper, file_path, options, &source)), context));
  open_timer.reset();

  const std::vector<Run> runs = RunsOf(swapper, UINT64_MAX);
  std::uint64_t my_bytes = 0;
  for (const Run& r : runs) {
    for (const StateReader& reader : source.readers) my_bytes += r.numel * reader.element_bytes();
  }
  const int passes = options.verify_before_write ? 2 : 1;
  ProgressReporter progress(fmt::format("checkpoint restore step {}", source.info->step),
                            my_bytes * static_cast<std::uint64_t>(passes),
                            comm.rank() == 0 && options.progress, options.progress_interval_s);
  std::uint64_t done = 0;
  if (options.verify_before_write) {
    ScopedTimer verify_timer(timers, "ckpt_restore_verify_pass");
    ZINF_RETURN_IF_ERROR(
        Annotate(comm.AgreeOnStatus(VerifyRuns(source.readers, runs, progress, &done)), context));
  }
  std::size_t exact = 0;
  Status local = WriteRuns(swapper, source, runs, source.info->step, progress, &done, &exact);
  if (local) local = source.file->Close();
  ZINF_RETURN_IF_ERROR(Annotate(comm.AgreeOnStatus(local), context));
  progress.Finish();
  if (source.info->state_format != swapper.state_format() ||
      (swapper.state_format() == StateFormat::kQ8 && exact < swapper.num_sub_groups())) {
    ZINF_LOG_INFO(
        "checkpoint restore: {} state into {} state ({} of {} sub-groups of rank {} copied "
        "exactly{})",
        StateFormatName(source.info->state_format), StateFormatName(swapper.state_format()), exact,
        swapper.num_sub_groups(), comm.rank(),
        swapper.state_format() == StateFormat::kQ8 ? ", the others quantized again" : "");
  }
  return Restored(file_path, *source.info, start);
}

}  // namespace zinf::checkpoint
