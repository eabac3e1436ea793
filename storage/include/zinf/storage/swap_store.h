// SwapStore: one rank's optimizer state on node-local NVMe (DESIGN.md, "Swap store").
//
// On-disk layout. For each configured path P (in order, index p of n):
//
//   <P>/zinf-<job_id>/                 job directory, 0700, shared by the job's ranks on the node
//   <P>/zinf-<job_id>/rank<r>/         this rank's store directory, 0700
//   <P>/zinf-<job_id>/rank<r>/swap.bin preallocated (fallocate) data file, 0600, O_NOFOLLOW,
//                                      O_DIRECT where the file system supports it
//   <P>/zinf-<job_id>/rank<r>/manifest "zinf-swap-store 3", stripe unit, path count, path
//                                      weights, the reserved tensors in order and an XXH3-64
//                                      checksum of all that (swap_manifest.h); the same text on
//                                      every path, written when the rank directory is made and
//                                      replaced atomically; the first path's is read when
//                                      resuming (versions 1 and 2 of older zinf too)
//   <P>/zinf-<job_id>/rank<r>/probe.tmp  only while Open probes the path's bandwidth (unlinked
//                                      right after it is created)
//   <P>/zinf-<job_id>/rank<r>/kept     empty, 0600: the store was opened with `keep` (written at
//                                      Open, so it marks a kept store whose process was killed)
//
// Striping. Reserved tensors are laid out one after the other in a logical space of stripe units
// (`stripe_unit_bytes` each); tensor t occupies units [first_unit, first_unit + num_units) with
// num_units = ceil(size_bytes / stripe_unit_bytes), so every tensor starts on a unit boundary and
// its tail is padded. A StripeMap (stripe_map.h) places logical unit g: with equal weights (the
// default) in the swap.bin of path g % n at file offset (g / n) * stripe_unit_bytes, so several
// drives add up without RAID-0; with weights w_p, path p takes w_p of every w_0 + ... + w_{n-1}
// consecutive units, spread over that cycle, so that paths of unequal bandwidth finish a tensor
// together. Each path's swap.bin holds exactly its share. One path means one plain file with
// tensors back to back.
//
// Weights. `path_weights` gives them; with `probe_path_weights` Open measures each path, one
// after the other (an O_DIRECT write and read of `probe_bytes`, twice, keeping the faster of
// each, through an IoBackend, in probe.tmp) and uses the ratios of (bytes read + written) / time
// (StripeMap::FromRatios; paths within 15% of each other get equal shares); neither: equal
// shares. The manifest records the weights in effect, and a resumed store uses those, whatever
// the options say (an INFO line when they differ).
//
// Alignment. alignment() is the largest File::alignment() of the data files (the direct-I/O
// alignment of each path's file system; 1 where the file system has no O_DIRECT, e.g. tmpfs,
// and the file is used buffered). stripe_unit_bytes must be a multiple of it. An I/O transfers
// AlignUp(length, alignment()) bytes: buffers for the asynchronous calls must be that large and
// their address aligned to alignment() (an AlignedBuffer from the same file system qualifies).
//
// Lifetime and cleanup. Open() creates the directories (or, with `resume`, reopens an existing
// store), Reserve() places tensors and preallocates space after a free-space preflight,
// Close() (or the destructor, best effort) removes the store unless `keep` is set. Removal only
// happens at a clean Close()/destruction: a process that is killed leaves its store behind.
//
// Locks (flock, released by the kernel when the process dies, however it dies). An open store
// holds LOCK_EX on each of its rank directories and LOCK_SH on each of its job directories for
// its lifetime, so "no live process holds it" is a lock that can be taken:
//   - a store in use by a live instance is AlreadyExists at Open whatever the options; resume
//     and reclaim_stale only ever touch stores whose owner is gone;
//   - a job directory that some live store uses cannot be locked exclusively, so ReclaimStale
//     leaves it alone. Open takes its LOCK_SH waiting (bounded, 30 s) for a reclaimer's LOCK_EX,
//     then checks that the directory it locked is still the one linked at its name and starts
//     over (a few times) if a reclaimer removed it in between;
//   - Close removes a job directory only while it holds it exclusively (no other live store of
//     the job on this path) and it is empty: the last store out removes it.
// A store opened with `keep` writes an empty file `kept` into each of its rank directories at
// Open (and a store opened without `keep` removes one it finds), so a kept store is
// recognisable even after its process was killed.
//
// Stale stores. Left by a killed run, a store is reclaimed by the next run on the same path,
// but only a directory that proves to be a store that zinf made: it holds nothing but regular
// files of the store's names, and its manifest is of version 3, parses fully and its checksum
// matches. Anything else named zinf-<id>/rank<r> (a user's files, a store of an older zinf, a
// creation killed before its manifest was written) is never emptied or removed:
//   - the same job_id and rank: Open with reclaim_stale empties and reuses a proven store (WARN
//     line, also for a kept one); a directory that is not one is AlreadyExists naming it, why,
//     and `rm -rf <dir>`; without reclaim_stale either is AlreadyExists unless `resume`;
//   - any other stale store on a configured path: ReclaimStale() removes it (WARN line naming
//     it and its size), unless it is kept (WARN line naming it, its size and `rm -rf <dir>`),
//     owned by another uid (skipped silently), holds entries a store never has or is not
//     provably a store (left, WARN line saying why and naming `rm -rf <dir>`). A job directory
//     is removed only when the scan removed a store from it and it is then empty.
// A store of an older zinf that is resumed gets a version 3 manifest on every path.
//
// Hostile directories. Every configured path, job and rank directory is opened with O_NOFOLLOW
// and checked for its owner; files are created exclusively; ReclaimStale examines at most
// kMaxScanEntries entries of any directory (WARN when there are more), only names of the forms
// zinf-<job_id> and rank<r>, only directories that are not symbolic links, and removes only the
// store's own file names (swap.bin, manifest, manifest.tmp, kept, probe.tmp), regular files
// only, with unlinkat.
// Nothing follows a planted symlink, blocks on a FIFO, or loops without bound.
//
// Verification (`verify_swap`). A checksum (XXH3-64) is recorded per stripe unit of a tensor
// whenever a write covers that unit's bytes completely, and checked when a read covers it
// completely (Read(), or VerifyRead() after an asynchronous read): a mismatch is DataLoss naming
// tensor, file and offset. Units without a recorded checksum (partly written, or written by an
// earlier process before a resume) are not checked. Checksums live in memory only.
//
// Thread safety: Open/Reserve/Sync/Close must not run concurrently with any other call. Between
// them, Submit*/Read/Write/VerifyRead and the accessors may be called from several threads (the
// checksum table is locked); each backend keeps its own threading rule (see io_backend.h).
//
// Ownership: the store owns its files and directory descriptors. Requests it submits point at
// its File objects: every request must have been waited for before Close() or destruction.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/file.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/io_backend.h"
#include "zinf/storage/stripe_map.h"

namespace zinf::storage {

// The longest job_id (SwapStoreOptions::job_id), which names the directory zinf-<job_id>.
inline constexpr std::size_t kMaxJobIdLength = 200;

// Whether `job_id` can key a store: 1 to kMaxJobIdLength characters of [A-Za-z0-9_.-], neither "."
// nor holding "..". The one rule for the store and the config (zinf.job_id). Errors:
// InvalidArgument saying what is wrong, without naming the key (callers prefix it), e.g.
// "\"my/job\" may contain only A-Z a-z 0-9 _ . - (and no \"..\")".
Status ValidateJobId(std::string_view job_id);

struct SwapStoreOptions {
  std::vector<std::string> paths;  // node-local directories; at least one; tensors are striped
  std::string job_id;              // [A-Za-z0-9_.-]+, no ".."; keys the store directory
  int world_rank = 0;              // this rank; names rank<world_rank>/
  std::uint64_t stripe_unit_bytes = 1 << 20;  // striping unit; a multiple of alignment()
  bool keep = false;    // keep the store at Close() (for inspection or a later resume)
  bool resume = false;  // reopen an existing store of this job and rank instead of failing
  // Without resume: a store of this job and rank that no live instance holds (its process was
  // killed) is emptied and reused, with a WARN line, instead of AlreadyExists. Callers that set
  // it also run ReclaimStale (the optimizer swapper does, once per node).
  bool reclaim_stale = false;
  bool verify_swap = false;  // checksum every stripe unit on write, check it on read
  bool direct = true;        // O_DIRECT where supported (falls back to buffered otherwise)
  // Each path's share of the stripe units: one weight >= 1 per path (StripeMap::FromWeights; a
  // cycle of at most 64 units). Empty: equal shares, the layout of stores before weights.
  std::vector<std::uint32_t> path_weights;
  // Measure each path's bandwidth at Open and use the ratios as the weights (new stores only;
  // not with path_weights). The probe writes and reads `probe_bytes` per path, one path after
  // the other, through a backend of `probe_backend` and `probe_aio`.
  bool probe_path_weights = false;
  std::uint64_t probe_bytes = 32 << 20;
  IoBackendKind probe_backend = IoBackendKind::kAuto;
  AioOptions probe_aio;
};

// A store that no live process holds, found by SwapStore::ReclaimStale.
enum class StaleAction {
  kRemoved,  // its files and rank directory were removed
  kKept,     // it has the `kept` marker (keep_swap): left, with a WARN line naming rm -rf <dir>
  kLeft,     // it holds unexpected entries, is not provably a store (no current manifest with
             // a matching checksum), or removing it failed: left, with a WARN line
};
struct StaleStore {
  std::string directory;         // <P>/zinf-<job_id>/rank<r>
  std::string job_id;            // the job that left it behind
  int world_rank = 0;            // r of rank<r>
  std::uint64_t size_bytes = 0;  // sum of the sizes of its files (what removing it frees)
  StaleAction action = StaleAction::kLeft;
};

struct TensorSpec {
  std::string name;  // unique in the store, no whitespace, e.g. "sg3/exp_avg"
  std::uint64_t size_bytes = 0;
};

// Where a reserved tensor lives, in units of the store's striping.
struct TensorExtent {
  std::string name;
  std::uint64_t size_bytes = 0;         // the tensor's bytes
  std::uint64_t io_size_bytes = 0;      // AlignUp(size_bytes, alignment()): minimum buffer size
  std::uint64_t padded_size_bytes = 0;  // num_units * stripe_unit_bytes (space used on disk)
  std::uint64_t first_unit = 0;         // logical stripe unit of the first byte
  std::uint64_t num_units = 0;
};

// Space a store needs on one configured path (see PlanSpace).
struct PathSpace {
  std::string path;                   // the configured path
  std::uint64_t device_id = 0;        // st_dev of the path: equal ids share a file system
  std::uint64_t needed_bytes = 0;     // bytes the store adds to this path's file
  std::uint64_t fs_needed_bytes = 0;  // sum of needed_bytes over the paths on this file system
  std::uint64_t available_bytes = 0;  // statvfs f_bavail * f_frsize of the file system
};

class SwapStore {
 public:
  // Validates `options`, then creates (or with `resume`, reopens) the store directories and
  // opens the data files (empty when new; no space is allocated before Reserve()).
  // With probe_path_weights (and a new store), measures every path first (see "Weights").
  // Errors: InvalidArgument (bad job_id, empty or duplicate paths, stripe unit not a multiple of
  // the alignment, negative rank, path_weights not one valid weight per path or given together
  // with probe_path_weights); NotFound (a path does not exist); FailedPrecondition (a path,
  // the job or rank directory or a file is a symlink or not a directory/file, a store directory
  // or file is owned by another uid, a resumed store is incomplete or its manifest disagrees
  // with `options` on stripe unit or path count); DataLoss (a corrupt manifest, bad weights in
  // it included, and a version 3 manifest whose checksum does not match); errors of the probe's
  // backend and I/O, naming the path; AlreadyExists (the rank directory exists and `resume` is
  // false, or a live instance holds it; with reclaim_stale, one that is not provably a store,
  // the message saying why and naming `rm -rf <dir>`); Unavailable (a job directory stayed
  // locked exclusively for 30 s, or was removed under us again and again; the rank directory was
  // removed while we opened it); errno errors from mkdir/open. On failure, whatever this call
  // created is removed again.
  static Result<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options);

  // The space a fresh store with `specs` (reserved in this order) needs on each path of
  // `options`, with the free space there: each path's share under options.path_weights. Reads
  // only the file systems (statvfs/stat); creates nothing. For a per-node collective check, sum
  // needed_bytes over ranks per device_id. For an open store (probed or resumed weights), pass
  // its options(). Errors: InvalidArgument (options as in Open; probe_path_weights set, since
  // the weights are known only once a store measured them), NotFound / errno errors from stat.
  static Result<std::vector<PathSpace>> PlanSpace(const SwapStoreOptions& options,
                                                  std::span<const TensorSpec> specs);
  // ResourceExhausted if any file system lacks fs_needed_bytes; the message names every short
  // path with its needed and available bytes.
  static Status CheckSpace(std::span<const PathSpace> space);

  // Scans every path of `options` for stores that no live process holds and removes them (see
  // "Stale stores" above): job directories zinf-<id> of other job ids that no live store holds
  // (LOCK_EX | LOCK_NB on the job directory succeeds), and in this job's directory
  // (zinf-<options.job_id>) each rank directory whose LOCK_EX | LOCK_NB succeeds (this job's
  // live stores, in this process or another, hold theirs). A stale rank directory is removed
  // only when it is provably a store (see "Stale stores") and not kept; an other job's
  // directory is removed when this scan removed a store from it and it became empty (this
  // job's never). Only paths, job_id and world_rank of
  // `options` are used; run it after this job's stores were opened, so their locks are held.
  // Returns the stale stores found, each with what was done; removals and everything left
  // behind are WARN lines (every rank that calls it logs its own). Problems with single
  // entries, and a path that cannot be opened, are WARN lines and skip them, never errors.
  // Errors: InvalidArgument (options as in Open).
  static Result<std::vector<StaleStore>> ReclaimStale(const SwapStoreOptions& options);
  // Entries ReclaimStale examines per directory; the rest is skipped with a WARN line.
  static constexpr std::size_t kMaxScanEntries = 4096;

  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;
  // Best-effort Close() if it was not called (errors are logged).
  ~SwapStore();

  // Places `specs` after the tensors reserved so far, checks free space (ResourceExhausted with
  // needed and available bytes per path, before anything is allocated), grows the data files
  // with fallocate and, for a new layout, rewrites the manifest. May be called more than once.
  // Resumed stores: the first specs must match the manifest's tensors (name and size, in order;
  // FailedPrecondition otherwise) and the files must hold them (DataLoss if truncated).
  // Errors: InvalidArgument (bad name), AlreadyExists (name reserved twice), ResourceExhausted,
  // errno errors from fallocate. On failure no tensor of `specs` is reserved.
  Status Reserve(std::vector<TensorSpec> specs);

  // Synchronous whole-tensor I/O through an internal bounce buffer of one stripe unit (pwrite /
  // pread); `data`/`out` may have any address and must be exactly the tensor's size_bytes.
  // Read() verifies checksums when `verify_swap` is on. Errors: NotFound (unknown name),
  // InvalidArgument (size), DataLoss (short read at EOF, checksum mismatch), errno errors.
  Status Write(std::string_view name, std::span<const std::byte> data);
  Status Read(std::string_view name, std::span<std::byte> out);

  // Asynchronous I/O: splits the tensor (or the range [offset_bytes, offset_bytes + length_bytes)
  // of it) into per-stripe-unit requests on the right files and offsets, submits them to
  // `backend` and returns their ids; the caller waits for them on `backend` and keeps `buffer`
  // alive and untouched until then. buffer[0] is the range's first byte; the buffer's address
  // must be aligned to alignment() and its size at least AlignUp(length, alignment()).
  // offset_bytes must be a multiple of alignment(), and length_bytes too unless the range ends
  // at the end of the tensor. SubmitWrite records checksums (verify_swap) at submit time.
  // Errors: NotFound, InvalidArgument (range, buffer size or alignment), backend Submit errors
  // (requests already submitted before an error stay in the backend: wait for them).
  Result<std::vector<std::uint64_t>> SubmitWrite(std::string_view name,
                                                 std::span<const std::byte> buffer,
                                                 IoBackend& backend);
  Result<std::vector<std::uint64_t>> SubmitRead(std::string_view name, std::span<std::byte> buffer,
                                                IoBackend& backend);
  Result<std::vector<std::uint64_t>> SubmitWriteRange(std::string_view name,
                                                      std::uint64_t offset_bytes,
                                                      std::uint64_t length_bytes,
                                                      std::span<const std::byte> buffer,
                                                      IoBackend& backend);
  Result<std::vector<std::uint64_t>> SubmitReadRange(std::string_view name,
                                                     std::uint64_t offset_bytes,
                                                     std::uint64_t length_bytes,
                                                     std::span<std::byte> buffer, IoBackend& backend);

  // After an asynchronous read completed: checks the recorded checksums of the stripe units that
  // [offset_bytes, offset_bytes + data.size()) covers completely (data[0] is the byte at
  // offset_bytes; pass the tensor's bytes, not the alignment padding). OK without verify_swap.
  // Errors: NotFound, InvalidArgument (range outside the tensor), DataLoss (mismatch).
  Status VerifyRead(std::string_view name, std::span<const std::byte> data,
                    std::uint64_t offset_bytes = 0) const;

  // fdatasync of every data file: the durability point (on buffered file systems, the only one).
  Status Sync();

  // Closes the files and, unless `keep`, removes the data files, the manifest, the rank
  // directories and the job directories that became empty. With `keep`, syncs first.
  // Idempotent: later calls return OK. Every submitted request must have completed.
  Status Close();

  // Bytes this store has asked of its files so far: requests submitted without error (Submit*)
  // and transfers done (Read, Write), alignment padding included. A submitted request that later
  // fails still counts. Thread-safe; callers take differences, e.g. around one optimizer step.
  struct IoCounters {
    std::uint64_t read_bytes = 0;
    std::uint64_t write_bytes = 0;
  };
  IoCounters io_counters() const {
    return {read_bytes_.load(std::memory_order_relaxed),
            write_bytes_.load(std::memory_order_relaxed)};
  }

  // Accessors.
  Result<TensorExtent> Extent(std::string_view name) const;
  std::uint64_t alignment() const { return alignment_; }
  std::uint64_t stripe_unit_bytes() const { return options_.stripe_unit_bytes; }
  std::size_t num_paths() const { return paths_.size(); }
  // Rank directory on path `index` (<P>/zinf-<job_id>/rank<r>) and its data file.
  const std::string& directory(std::size_t index) const { return paths_[index].rank_dir; }
  const File& file(std::size_t index) const { return paths_[index].file; }
  // True when every data file is open with O_DIRECT.
  bool direct() const;
  // True when Open() found and reopened an existing store.
  bool resumed() const { return resumed_; }
  // Logical stripe units reserved so far.
  std::uint64_t total_units() const { return total_units_; }
  // Where the units live: the weights in effect (given, probed, or the resumed manifest's).
  const StripeMap& stripe_map() const { return stripe_map_; }
  // The options in effect: path_weights holds the weights of stripe_map(), one per path, and
  // probe_path_weights is false (a later PlanSpace(options()) plans this store's layout).
  const SwapStoreOptions& options() const { return options_; }

 private:
  struct PathState {
    std::string path;      // configured path P
    std::string job_dir;   // P/zinf-<job_id>
    std::string rank_dir;  // P/zinf-<job_id>/rank<r>
    UniqueFd path_fd;
    UniqueFd job_fd;   // holds LOCK_SH while the store is open
    UniqueFd rank_fd;  // holds LOCK_EX while the store is open
    bool created_job_dir = false;
    bool created_rank_dir = false;
    bool stale = false;           // a killed instance's proven store, emptied for reuse
    bool stale_was_kept = false;  // ... which had the `kept` marker
    File file;
  };
  struct Tensor {
    TensorExtent extent;
    std::vector<std::uint64_t> checksums;  // per unit, when verify_swap
    std::vector<bool> checksum_valid;
  };
  // One contiguous piece of a tensor range inside one stripe unit.
  struct Segment {
    std::size_t path_index;
    std::uint64_t file_offset_bytes;
    std::uint64_t tensor_offset_bytes;
    std::uint64_t length_bytes;  // I/O length (aligned, may include tail padding)
  };

  explicit SwapStore(const SwapStoreOptions& options);

  // Open's work in three passes over the paths (job directories, existing rank directories,
  // new rank directories and the data files); the partial state is cleaned up by Open.
  Status OpenImpl();
  // Pass 1 for the configured `path`: fills `ps`, refuses a directory already in `inodes`, and
  // opens its job directory.
  Status OpenPath(PathState& ps, const std::string& path,
                  std::set<std::pair<dev_t, ino_t>>* inodes);
  // Creates or opens the job directory of `ps` and takes LOCK_SH.
  Status OpenJobDirectory(PathState& ps);
  // Pass 2: true when this rank's store exists at `ps` and is ours to resume (locked); a killed
  // instance's store that proves to be one is marked `stale` when reclaim_stale is set and
  // resume is not (false); errors for a store in use, a directory that is not provably a store
  // (with reclaim_stale), or one that exists without resume.
  Result<bool> OpenExistingRankDirectory(PathState& ps);
  // After pass 2 of a new store: replaces the manifest of a `stale` rank directory and removes
  // its other files (WARN line).
  Status EmptyStaleRankDirectory(PathState& ps);
  // Pass 3 of a new store: makes and locks the rank directory and writes its manifest.
  Status CreateRankDirectory(PathState& ps);
  // Opens (resumed) or creates the data file of `ps` and checks its type, owner and mode.
  Status OpenDataFile(PathState& ps);
  // Writes (keep) or removes (otherwise) the `kept` marker in every rank directory.
  Status MarkKept();
  // The weights of a new store: probed (probe_path_weights), given, or equal.
  Status ChooseWeights();
  // Bytes per second of each path: a timed write and read of probe_bytes through a temporary
  // file in its rank directory.
  Result<std::vector<double>> ProbeBandwidths() const;
  // The first path's manifest (any version) into stripe_map_, manifest_tensors_ and
  // manifest_version_.
  Status ReadManifest();
  // The manifest of the store's weights and tensors, into every rank directory.
  Status WriteManifest();
  Status WriteManifestAt(const PathState& ps, const std::string& text);
  Result<std::size_t> Find(std::string_view name) const;
  Status CheckRange(const Tensor& tensor, std::uint64_t offset_bytes, std::uint64_t length_bytes,
                    std::size_t buffer_size, const void* buffer_address) const;
  std::vector<Segment> MapRange(const Tensor& tensor, std::uint64_t offset_bytes,
                                std::uint64_t io_length_bytes) const;
  Result<std::vector<std::uint64_t>> SubmitRange(IoOp op, std::string_view name,
                                                 std::uint64_t offset_bytes,
                                                 std::uint64_t length_bytes,
                                                 std::span<std::byte> buffer, IoBackend& backend);
  // Records (or, with `invalidate`, forgets) the checksums of the units `data` touches.
  void RecordChecksums(std::size_t tensor_index, std::uint64_t offset_bytes,
                       std::span<const std::byte> data, bool invalidate = false);
  Status VerifyChecksums(const Tensor& tensor, std::uint64_t offset_bytes,
                         std::span<const std::byte> data) const;
  // Removes what this instance created (all = false) or the whole store (all = true).
  Status RemoveStore(bool all);
  void CloseDescriptors();

  SwapStoreOptions options_;
  std::vector<PathState> paths_;
  std::uint64_t alignment_ = 1;
  StripeMap stripe_map_ = StripeMap::Equal(1);
  std::string weights_source_;  // for the INFO line: "given", "probed: ...", "manifest"
  std::uint64_t total_units_ = 0;
  bool resumed_ = false;
  bool closed_ = false;
  std::vector<TensorSpec> manifest_tensors_;  // from the manifest when resumed
  int manifest_version_ = 0;                  // of the manifest when resumed
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string, std::size_t> index_;
  mutable std::mutex checksum_mutex_;
  std::atomic<std::uint64_t> read_bytes_{0};
  std::atomic<std::uint64_t> write_bytes_{0};
};

}  // namespace zinf::storage
