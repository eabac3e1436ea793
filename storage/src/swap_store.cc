#include "zinf/storage/swap_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "swap_manifest.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"
#include "zinf/storage/stripe_map.h"

namespace zinf::storage {
namespace {

constexpr const char* kDataFileName = "swap.bin";
constexpr const char* kManifestName = "manifest";
constexpr const char* kManifestTmpName = "manifest.tmp";
constexpr const char* kKeptName = "kept";
constexpr const char* kProbeName = "probe.tmp";
// Every name a store creates in its rank directory: what ReclaimStale may remove.
constexpr const char* kStoreFileNames[] = {kDataFileName, kManifestName, kManifestTmpName,
                                           kKeptName, kProbeName};
constexpr std::uint64_t kMaxManifestBytes = 1 << 20;
// How long Open waits for a reclaimer's LOCK_EX on a job directory, and how often it starts
// over when a reclaimer removed the (empty) job directory under it.
constexpr std::chrono::milliseconds kJobLockWait{30'000};
constexpr std::chrono::milliseconds kJobLockPoll{10};
constexpr int kJobDirAttempts = 8;
// Probed paths whose bandwidths are all within this factor of each other get equal shares: a
// short probe of equal drives differs by some percent from run to run.
constexpr double kProbeEqualWithin = 1.15;

std::string JobDirName(const SwapStoreOptions& options) { return "zinf-" + options.job_id; }
std::string RankDirName(const SwapStoreOptions& options) {
  return fmt::format("rank{}", options.world_rank);
}

// "a/b//" -> "a/b" (a trailing slash would make O_NOFOLLOW follow a symlink); "/" stays.
std::string StripTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// The stripe map `options` ask for (equal shares when path_weights is empty).
Result<StripeMap> MapOfOptions(const SwapStoreOptions& options) {
  if (options.path_weights.empty()) return StripeMap::Equal(options.paths.size());
  if (options.path_weights.size() != options.paths.size()) {
    return InvalidArgumentError(
        fmt::format("swap store: {} path weights for {} paths (one weight per path)",
                    options.path_weights.size(), options.paths.size()));
  }
  return Annotate(StripeMap::FromWeights(options.path_weights), "swap store: ");
}

Status ValidateOptions(const SwapStoreOptions& options) {
  if (options.paths.empty()) {
    return InvalidArgumentError("swap store: no path configured (nvme_path is empty)");
  }
  std::set<std::string> seen;
  for (const std::string& raw : options.paths) {
    if (raw.empty()) return InvalidArgumentError("swap store: an empty path in nvme_path");
    std::string path = StripTrailingSlashes(raw);
    if (!seen.insert(path).second) {
      return InvalidArgumentError(
          fmt::format("swap store: path '{}' is configured twice in nvme_path", path));
    }
  }
  ZINF_RETURN_IF_ERROR(Annotate(ValidateJobId(options.job_id), "swap store: job_id: "));
  if (options.world_rank < 0) {
    return InvalidArgumentError(
        fmt::format("swap store: world_rank {} is negative", options.world_rank));
  }
  if (options.stripe_unit_bytes == 0) {
    return InvalidArgumentError("swap store: stripe_unit_bytes is 0");
  }
  if (options.probe_path_weights && !options.path_weights.empty()) {
    return InvalidArgumentError(
        "swap store: path_weights are given and probe_path_weights asks to measure them; set one");
  }
  if (options.probe_path_weights && options.probe_bytes == 0) {
    return InvalidArgumentError("swap store: probe_bytes is 0");
  }
  ZINF_RETURN_IF_ERROR(MapOfOptions(options));
  return OkStatus();
}

std::uint64_t UnitsFor(std::uint64_t size_bytes, std::uint64_t stripe_unit_bytes) {
  return size_bytes / stripe_unit_bytes + (size_bytes % stripe_unit_bytes != 0 ? 1 : 0);
}

// Bytes of the data file on path `index` when `total_units` units are reserved.
std::uint64_t FileBytes(const StripeMap& map, std::size_t index, std::uint64_t total_units,
                        std::uint64_t stripe_unit_bytes) {
  return map.UnitsOnPath(index, total_units) * stripe_unit_bytes;
}

Result<std::uint64_t> SumUnits(std::span<const TensorSpec> specs, std::uint64_t stripe_unit_bytes,
                               std::uint64_t start_units) {
  std::uint64_t total = start_units;
  for (const TensorSpec& spec : specs) {
    const std::uint64_t units = UnitsFor(spec.size_bytes, stripe_unit_bytes);
    std::uint64_t bytes = 0;
    if (!CheckedAdd(total, units, &total) || !CheckedMul(total, stripe_unit_bytes, &bytes)) {
      return InvalidArgumentError(
          fmt::format("swap store: reserving tensor '{}' ({} bytes) overflows 64 bits", spec.name,
                      spec.size_bytes));
    }
  }
  return total;
}

// Free space of the file systems of `paths`, with `needed` bytes per path.
Result<std::vector<PathSpace>> MeasureSpace(const std::vector<std::string>& paths,
                                            const std::vector<std::uint64_t>& needed) {
  std::vector<PathSpace> space(paths.size());
  std::map<std::uint64_t, std::uint64_t> per_device;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    struct stat st {};
    if (Env::Default().StatAt(AT_FDCWD, paths[i].c_str(), &st, 0) != 0) {
      return ErrnoError(errno, fmt::format("swap store: stat {}", paths[i]));
    }
    struct statvfs vfs {};
    int rc;
    do {
      rc = Env::Default().StatFs(paths[i].c_str(), &vfs);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return ErrnoError(errno, fmt::format("swap store: statvfs {}", paths[i]));
    space[i].path = paths[i];
    space[i].device_id = static_cast<std::uint64_t>(st.st_dev);
    space[i].needed_bytes = needed[i];
    space[i].available_bytes =
        static_cast<std::uint64_t>(vfs.f_bavail) * static_cast<std::uint64_t>(vfs.f_frsize);
    per_device[space[i].device_id] += needed[i];
  }
  for (PathSpace& s : space) s.fs_needed_bytes = per_device[s.device_id];
  return space;
}

// Opens directory `name` under `parent_fd` without following a symlink; `full_path` names it in
// errors.
Result<UniqueFd> OpenDirNoFollow(int parent_fd, const std::string& name,
                                 const std::string& full_path) {
  return Annotate(OpenDirectoryAt(parent_fd, name, full_path, Follow::kNo), "swap store: ");
}

Status CheckOwner(int fd, const std::string& what) {
  struct stat st {};
  if (Env::Default().StatAt(fd, "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("swap store: fstat {}", what));
  }
  if (st.st_uid != ::geteuid()) {
    return FailedPreconditionError(fmt::format(
        "swap store: {} is owned by uid {}, not by this process (uid {}); refusing to use "
        "another user's swap store",
        what, st.st_uid, ::geteuid()));
  }
  return OkStatus();
}

Status SetMode(int fd, mode_t mode, const std::string& what) {
  if (Env::Default().ChangeMode(fd, mode) != 0) {
    return ErrnoError(errno, fmt::format("swap store: chmod {:o} {}", mode, what));
  }
  return OkStatus();
}

Status PwriteFull(const File& file, const std::byte* data, std::uint64_t length_bytes,
                  std::uint64_t offset_bytes) {
  std::uint64_t done = 0;
  while (done < length_bytes) {
    const ssize_t n = Env::Default().PWrite(file.fd(), data + done, length_bytes - done,
                                            static_cast<off_t>(offset_bytes + done));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ErrnoError(errno, fmt::format("pwrite {} offset {} length {}", file.path(),
                                           offset_bytes + done, length_bytes - done));
    }
    done += static_cast<std::uint64_t>(n);
  }
  return OkStatus();
}

Status PreadFull(const File& file, std::byte* data, std::uint64_t length_bytes,
                 std::uint64_t offset_bytes) {
  std::uint64_t done = 0;
  while (done < length_bytes) {
    const ssize_t n = Env::Default().PRead(file.fd(), data + done, length_bytes - done,
                                           static_cast<off_t>(offset_bytes + done));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return ErrnoError(errno, fmt::format("pread {} offset {} length {}", file.path(),
                                           offset_bytes + done, length_bytes - done));
    }
    if (n == 0) {
      return DataLossError(fmt::format("pread {} offset {} length {}: short read at EOF",
                                       file.path(), offset_bytes + done, length_bytes - done));
    }
    done += static_cast<std::uint64_t>(n);
  }
  return OkStatus();
}

// Removes `name` under `dir_fd`; a missing entry is fine.
Status UnlinkIfPresent(int dir_fd, const char* name, int flags, const std::string& full_path) {
  if (Env::Default().UnlinkAt(dir_fd, name, flags) != 0 && errno != ENOENT) {
    return ErrnoError(errno, fmt::format("swap store: remove {}", full_path));
  }
  return OkStatus();
}

// flock(fd, operation), EINTR retried. False when LOCK_NB is set and another open file holds a
// conflicting lock.
Result<bool> TryFlock(int fd, int operation, const std::string& what) {
  while (Env::Default().Lock(fd, operation) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) return false;
    return ErrnoError(errno, fmt::format("swap store: flock {}", what));
  }
  return true;
}

// Takes the instance lock of a rank directory (held until the descriptor closes). Returns false
// when another live instance holds it.
Result<bool> TryLockRankDir(int rank_fd, const std::string& rank_dir) {
  return TryFlock(rank_fd, LOCK_EX | LOCK_NB, rank_dir);
}

// LOCK_SH on a job directory, waiting at most kJobLockWait for a reclaimer's LOCK_EX (polled:
// a blocking flock could wait forever on a process that never lets go).
Status LockJobDirShared(int job_fd, const std::string& job_dir) {
  const auto deadline = std::chrono::steady_clock::now() + kJobLockWait;
  for (;;) {
    ZINF_ASSIGN_OR_RETURN(const bool locked, TryFlock(job_fd, LOCK_SH | LOCK_NB, job_dir));
    if (locked) return OkStatus();
    if (std::chrono::steady_clock::now() >= deadline) {
      return UnavailableError(fmt::format(
          "swap store: {} stayed locked exclusively for {} s (by another job's cleanup of stale "
          "stores, or another process); try again",
          job_dir, kJobLockWait.count() / 1000));
    }
    std::this_thread::sleep_for(kJobLockPoll);
  }
}

// True when the entry `name` in `parent_fd` is (still) the directory open as `fd`: not removed,
// not replaced (same device and inode).
Result<bool> StillLinked(int parent_fd, const std::string& name, int fd, const std::string& what) {
  struct stat linked {};
  if (Env::Default().StatAt(parent_fd, name.c_str(), &linked, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    return ErrnoError(errno, fmt::format("swap store: stat {}", what));
  }
  struct stat opened {};
  if (Env::Default().StatAt(fd, "", &opened, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("swap store: fstat {}", what));
  }
  return linked.st_dev == opened.st_dev && linked.st_ino == opened.st_ino;
}

// "P" + "/" + name, for P == "/" too.
std::string JoinPath(const std::string& dir, const std::string& name) {
  return dir + (dir == "/" ? "" : "/") + name;
}

// ListDirectory (fs.h) with the store's prefix on its errors.
Result<DirectoryListing> ListStoreDirectory(int dir_fd, const std::string& display,
                                            std::size_t max_entries) {
  return Annotate(ListDirectory(dir_fd, display, max_entries), "swap store: ");
}

// "rank<digits>" -> the rank; nullopt for any other name.
std::optional<int> ParseRankDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "rank";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  int rank = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return rank;
}

bool IsStoreFileName(std::string_view name) {
  return std::any_of(std::begin(kStoreFileNames), std::end(kStoreFileNames),
                     [&](const char* known) { return name == known; });
}

// What a rank directory holds, and whether it is provably a store that zinf made: nothing but
// regular files of the store's names, one of them a manifest of the current version that parses
// and whose checksum matches. A user's directory that happens to be called zinf-<id>/rank<r>, a
// store of an older zinf (no checksum) and one whose creation was killed before its manifest was
// written all fail the proof: they are never emptied or removed automatically.
struct RankDirectoryFacts {
  std::vector<std::string> entries;  // the names listed
  std::uint64_t size_bytes = 0;      // sum of the sizes of its regular files
  bool kept = false;                 // it has the `kept` marker
  std::size_t foreign = 0;           // entries a store never has (other names or file types)
  bool truncated = false;            // more than kMaxScanEntries entries
  std::string unproven;              // why it is not provably a store; empty when it is
};

// `rank_fd` is the directory `rank_dir`, opened without following a link. Errors: those of
// listing it; the manifest's own problems are `unproven`, not errors.
Result<RankDirectoryFacts> ExamineRankDirectory(int rank_fd, const std::string& rank_dir) {
  ZINF_ASSIGN_OR_RETURN(DirectoryListing listing,
                        ListStoreDirectory(rank_fd, rank_dir, SwapStore::kMaxScanEntries));
  RankDirectoryFacts facts;
  facts.truncated = listing.truncated;
  bool has_manifest = false;
  for (const std::string& entry : listing.names) {
    struct stat st {};
    if (Env::Default().StatAt(rank_fd, entry.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != ENOENT) ++facts.foreign;
      continue;
    }
    if (!IsStoreFileName(entry) || !S_ISREG(st.st_mode)) {
      ++facts.foreign;
      continue;
    }
    facts.size_bytes += static_cast<std::uint64_t>(st.st_size);
    facts.kept = facts.kept || entry == kKeptName;
    has_manifest = has_manifest || entry == kManifestName;
  }
  facts.entries = std::move(listing.names);
  if (facts.foreign != 0 || facts.truncated) return facts;
  if (!has_manifest) {
    facts.unproven =
        "it has no manifest (a store whose creation was killed early, or not a swap store)";
    return facts;
  }
  const std::string path = rank_dir + "/" + kManifestName;
  Result<std::string> text =
      ReadSmallFileAt(rank_fd, kManifestName, path, kMaxManifestBytes, Follow::kNo);
  if (!text) {
    facts.unproven = fmt::format("its manifest cannot be read: {}", text.error().message());
    return facts;
  }
  Result<Manifest> manifest = ParseManifest(*text);
  if (!manifest) {
    facts.unproven =
        fmt::format("{} is not a swap store manifest: {}", path, manifest.error().message());
  } else if (manifest->version != kManifestVersion) {
    facts.unproven = fmt::format(
        "its manifest is of version {} (an older zinf's), which carries no checksum to prove it",
        manifest->version);
  }
  return facts;
}

}  // namespace

Status ValidateJobId(std::string_view job_id) {
  if (job_id.empty()) return InvalidArgumentError("is empty");
  if (job_id.size() > kMaxJobIdLength) {
    return InvalidArgumentError(fmt::format(
        "{} characters long, at most {} (it names the swap store directory zinf-<job_id>)",
        job_id.size(), kMaxJobIdLength));
  }
  const bool valid_chars = std::all_of(job_id.begin(), job_id.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
  if (!valid_chars || job_id.find("..") != std::string_view::npos || job_id == ".") {
    return InvalidArgumentError(
        fmt::format("\"{}\" may contain only A-Z a-z 0-9 _ . - (and no \"..\")", job_id));
  }
  return OkStatus();
}

SwapStore::SwapStore(const SwapStoreOptions& options) : options_(options) {
  for (std::string& path : options_.paths) path = StripTrailingSlashes(path);
}

SwapStore::~SwapStore() {
  if (closed_) return;
  Status status = Close();
  if (!status) ZINF_LOG_WARN("swap store: close in destructor: {}", status.error().ToString());
}

Result<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& options) {
  ZINF_RETURN_IF_ERROR(ValidateOptions(options));
  std::unique_ptr<SwapStore> store(new SwapStore(options));
  Status status = store->OpenImpl();
  if (!status) {
    Status removed = store->RemoveStore(/*all=*/false);
    if (!removed) {
      ZINF_LOG_WARN("swap store: cleaning up after a failed open: {}", removed.error().ToString());
    }
    store->CloseDescriptors();
    store->closed_ = true;
    return std::move(status).error();
  }
  ZINF_LOG_INFO("swap store {} ({} path(s)): {}, stripe unit {}, alignment {}{}{}{}",
                store->paths_[0].rank_dir, store->paths_.size(),
                store->direct() ? "O_DIRECT" : "buffered", FormatBytes(options.stripe_unit_bytes),
                store->alignment_,
                store->paths_.size() > 1
                    ? fmt::format(", path weights {} ({})", store->stripe_map_.WeightsText(),
                                  store->weights_source_)
                    : std::string(),
                store->resumed_ ? ", resumed" : "", options.verify_swap ? ", verify_swap" : "");
  return store;
}

Status SwapStore::OpenJobDirectory(PathState& ps) {
  const std::string job_name = JobDirName(options_);
  // Another rank of the job (its Close) or another job's ReclaimStale may remove an empty job
  // directory between our mkdir and our lock: after locking, check that the directory we hold
  // is still the one linked at its name, else start over.
  for (int attempt = 0;; ++attempt) {
    if (attempt == kJobDirAttempts) {
      return UnavailableError(fmt::format(
          "swap store: {} was removed under us {} times while opening it (other processes clean "
          "up this path); try again",
          ps.job_dir, kJobDirAttempts));
    }
    ps.created_job_dir = false;
    if (Env::Default().MkdirAt(ps.path_fd.get(), job_name.c_str(), 0700) == 0) {
      ps.created_job_dir = true;
    } else if (errno != EEXIST) {
      return ErrnoError(errno, fmt::format("swap store: mkdir {}", ps.job_dir));
    }
    Result<UniqueFd> fd = OpenDirNoFollow(ps.path_fd.get(), job_name, ps.job_dir);
    if (!fd) {
      if (fd.error().code() == ErrorCode::kNotFound) continue;
      return std::move(fd).error();
    }
    ZINF_RETURN_IF_ERROR(CheckOwner(fd->get(), ps.job_dir));
    ZINF_RETURN_IF_ERROR(LockJobDirShared(fd->get(), ps.job_dir));
    ZINF_ASSIGN_OR_RETURN(const bool linked,
                          StillLinked(ps.path_fd.get(), job_name, fd->get(), ps.job_dir));
    if (linked) {
      ps.job_fd = std::move(*fd);
      return OkStatus();
    }
  }
}

Status SwapStore::OpenImpl() {
  paths_.resize(options_.paths.size());
  std::set<std::pair<dev_t, ino_t>> inodes;
  // Pass 1: the configured paths and the job directories (shared with the node's other ranks).
  for (std::size_t i = 0; i < paths_.size(); ++i) {
    ZINF_RETURN_IF_ERROR(OpenPath(paths_[i], options_.paths[i], &inodes));
  }
  // Pass 2: does this rank's store exist already (on which paths)?
  std::size_t present = 0;
  for (PathState& ps : paths_) {
    ZINF_ASSIGN_OR_RETURN(const bool exists, OpenExistingRankDirectory(ps));
    if (exists) ++present;
  }
  if (present != 0 && present != paths_.size()) {
    return FailedPreconditionError(fmt::format(
        "swap store of job '{}' rank {} exists on {} of {} paths (e.g. {} is missing); cannot "
        "resume an incomplete store",
        options_.job_id, options_.world_rank, present, paths_.size(),
        std::find_if(paths_.begin(), paths_.end(), [](const PathState& p) {
          return !p.rank_fd;
        })->rank_dir));
  }
  resumed_ = present != 0;
  if (!resumed_) {
    // The weights of a new store, written into each rank directory's manifest as soon as it
    // exists (a probe's are known only after pass 3: equal shares until then).
    if (options_.probe_path_weights) {
      stripe_map_ = StripeMap::Equal(paths_.size());
    } else {
      ZINF_RETURN_IF_ERROR(ChooseWeights());
    }
  }
  for (PathState& ps : paths_) {
    if (ps.stale) ZINF_RETURN_IF_ERROR(EmptyStaleRankDirectory(ps));
  }
  // Pass 3: create the rank directories of a new store, then open (or create) the data files.
  for (PathState& ps : paths_) {
    if (!resumed_ && !ps.rank_fd) ZINF_RETURN_IF_ERROR(CreateRankDirectory(ps));
    ZINF_RETURN_IF_ERROR(SetMode(ps.rank_fd.get(), 0700, ps.rank_dir));
    ZINF_RETURN_IF_ERROR(OpenDataFile(ps));
    alignment_ =
        std::max<std::uint64_t>(alignment_, std::max<std::uint64_t>(1, ps.file.alignment()));
  }
  if (options_.stripe_unit_bytes % alignment_ != 0) {
    return InvalidArgumentError(fmt::format(
        "swap store: stripe_unit_bytes {} is not a multiple of the direct-I/O alignment {} of "
        "the swap paths",
        options_.stripe_unit_bytes, alignment_));
  }
  ZINF_RETURN_IF_ERROR(MarkKept());
  const bool probed = !resumed_ && options_.probe_path_weights;
  if (resumed_) {
    ZINF_RETURN_IF_ERROR(ReadManifest());
  } else if (probed) {
    ZINF_RETURN_IF_ERROR(ChooseWeights());
  }
  options_.path_weights = stripe_map_.weights();
  options_.probe_path_weights = false;
  // The probed weights; a resumed store of an older zinf gets a manifest of this version, with
  // its checksum, on every path (so that it is provably a store once its owner is gone).
  if (probed || (resumed_ && manifest_version_ != kManifestVersion)) return WriteManifest();
  return OkStatus();
}

Status SwapStore::OpenPath(PathState& ps, const std::string& path,
                           std::set<std::pair<dev_t, ino_t>>* inodes) {
  ps.path = path;
  ps.job_dir = JoinPath(ps.path, JobDirName(options_));
  ps.rank_dir = ps.job_dir + "/" + RankDirName(options_);
  ZINF_ASSIGN_OR_RETURN(ps.path_fd, OpenDirNoFollow(AT_FDCWD, ps.path, ps.path));
  struct stat st {};
  if (Env::Default().StatAt(ps.path_fd.get(), "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("swap store: fstat {}", ps.path));
  }
  if (!inodes->insert({st.st_dev, st.st_ino}).second) {
    return InvalidArgumentError(fmt::format(
        "swap store: path {} is the same directory as another configured path", ps.path));
  }
  ZINF_RETURN_IF_ERROR(OpenJobDirectory(ps));
  return SetMode(ps.job_fd.get(), 0700, ps.job_dir);
}

Result<bool> SwapStore::OpenExistingRankDirectory(PathState& ps) {
  const std::string rank_name = RankDirName(options_);
  struct stat st {};
  if (Env::Default().StatAt(ps.job_fd.get(), rank_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    return ErrnoError(errno, fmt::format("swap store: stat {}", ps.rank_dir));
  }
  ZINF_ASSIGN_OR_RETURN(ps.rank_fd, OpenDirNoFollow(ps.job_fd.get(), rank_name, ps.rank_dir));
  ZINF_RETURN_IF_ERROR(CheckOwner(ps.rank_fd.get(), ps.rank_dir));
  ZINF_ASSIGN_OR_RETURN(const bool locked, TryLockRankDir(ps.rank_fd.get(), ps.rank_dir));
  if (!locked) {
    ps.rank_fd.Reset();  // not ours: never touched by the cleanup of this failed open
    return AlreadyExistsError(fmt::format(
        "swap store {} is in use by another running instance of job '{}' (rank {}); give this "
        "run another job_id or nvme_path",
        ps.rank_dir, options_.job_id, options_.world_rank));
  }
  ZINF_ASSIGN_OR_RETURN(const bool linked,
                        StillLinked(ps.job_fd.get(), rank_name, ps.rank_fd.get(), ps.rank_dir));
  if (!linked) {
    ps.rank_fd.Reset();
    return UnavailableError(fmt::format(
        "swap store {} was removed while this instance opened it (a cleanup of stale stores); "
        "try again",
        ps.rank_dir));
  }
  if (!options_.resume && options_.reclaim_stale) {
    // Nobody holds the lock: a killed instance left this store behind, if the directory proves
    // to be one. It is emptied once every path's proves so (EmptyStaleRankDirectory).
    Result<RankDirectoryFacts> facts = ExamineRankDirectory(ps.rank_fd.get(), ps.rank_dir);
    std::string why;
    if (!facts) {
      why = std::string(facts.error().message());
    } else if (facts->foreign != 0 || facts->truncated) {
      why = facts->truncated ? fmt::format("it has more than {} entries", kMaxScanEntries)
                             : fmt::format("it holds {} entr{} a swap store never has",
                                           facts->foreign, facts->foreign == 1 ? "y" : "ies");
    } else {
      why = facts->unproven;
    }
    if (!why.empty()) {
      ps.rank_fd.Reset();  // not ours: never touched by the cleanup of this failed open
      return AlreadyExistsError(fmt::format(
          "swap store {} exists, but is not provably a swap store that zinf made ({}), so it is "
          "not emptied for reuse; if a killed run of job '{}' left it behind, remove it with: "
          "rm -rf {}; otherwise give this run another job_id or nvme_path",
          ps.rank_dir, why, options_.job_id, ps.rank_dir));
    }
    ps.stale = true;
    ps.stale_was_kept = facts->kept;
    return false;
  }
  if (!options_.resume) {
    return AlreadyExistsError(fmt::format(
        "swap store {} exists; a killed instance of job '{}' (rank {}) or one with keep_swap "
        "left it behind: set resume to reuse it, or remove it",
        ps.rank_dir, options_.job_id, options_.world_rank));
  }
  return true;
}

Status SwapStore::EmptyStaleRankDirectory(PathState& ps) {
  ZINF_LOG_WARN(
      "swap store {}: removing the store a killed instance of job '{}' left behind{}", ps.rank_dir,
      options_.job_id,
      ps.stale_was_kept ? " (it was kept with keep_swap; this run does not keep it)" : "");
  // The new manifest first (it replaces the old one atomically): the directory stays provably a
  // store whenever this process is killed.
  ps.created_rank_dir = true;  // ours now: removed at Close (or a failed Open) like a new one
  ZINF_RETURN_IF_ERROR(
      WriteManifestAt(ps, ManifestText(options_.stripe_unit_bytes, stripe_map_, {})));
  for (const char* name : kStoreFileNames) {
    if (std::string_view(name) == kManifestName) continue;
    ZINF_RETURN_IF_ERROR(UnlinkIfPresent(ps.rank_fd.get(), name, 0, ps.rank_dir + "/" + name));
  }
  return OkStatus();
}

Status SwapStore::CreateRankDirectory(PathState& ps) {
  const std::string rank_name = RankDirName(options_);
  if (Env::Default().MkdirAt(ps.job_fd.get(), rank_name.c_str(), 0700) != 0) {
    if (errno == EEXIST) {
      return AlreadyExistsError(
          fmt::format("swap store {} was created concurrently by another instance of job '{}'",
                      ps.rank_dir, options_.job_id));
    }
    return ErrnoError(errno, fmt::format("swap store: mkdir {}", ps.rank_dir));
  }
  ps.created_rank_dir = true;
  ZINF_ASSIGN_OR_RETURN(ps.rank_fd, OpenDirNoFollow(ps.job_fd.get(), rank_name, ps.rank_dir));
  ZINF_ASSIGN_OR_RETURN(const bool locked, TryLockRankDir(ps.rank_fd.get(), ps.rank_dir));
  ZINF_ASSIGN_OR_RETURN(const bool linked,
                        StillLinked(ps.job_fd.get(), rank_name, ps.rank_fd.get(), ps.rank_dir));
  if (!locked || !linked) {
    ps.rank_fd.Reset();
    ps.created_rank_dir = false;
    return AlreadyExistsError(fmt::format(
        "swap store {} was created or removed concurrently by another instance of job '{}'",
        ps.rank_dir, options_.job_id));
  }
  // At once: a directory without a manifest is never taken for a store (ExamineRankDirectory).
  return WriteManifestAt(ps, ManifestText(options_.stripe_unit_bytes, stripe_map_, {}));
}

Status SwapStore::OpenDataFile(PathState& ps) {
  OpenOptions open_options;
  open_options.mode = resumed_ ? OpenMode::kReadWrite : OpenMode::kCreate;
  open_options.direct = options_.direct;
  open_options.no_follow = true;
  open_options.permissions = 0600;
  const std::string file_path = ps.rank_dir + "/" + kDataFileName;
  ZINF_ASSIGN_OR_RETURN(ps.file, Annotate(File::Open(file_path, open_options), "swap store: "));
  struct stat st {};
  if (Env::Default().StatAt(ps.file.fd(), "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("swap store: fstat {}", file_path));
  }
  if (!S_ISREG(st.st_mode)) {
    return FailedPreconditionError(fmt::format("swap store: {} is not a regular file", file_path));
  }
  ZINF_RETURN_IF_ERROR(CheckOwner(ps.file.fd(), file_path));
  return SetMode(ps.file.fd(), 0600, file_path);
}

Status SwapStore::ChooseWeights() {
  if (!options_.probe_path_weights) {
    ZINF_ASSIGN_OR_RETURN(stripe_map_, MapOfOptions(options_));
    weights_source_ = options_.path_weights.empty() ? "equal shares" : "given";
    return OkStatus();
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<double> bandwidths, ProbeBandwidths());
  const auto [slowest, fastest] = std::minmax_element(bandwidths.begin(), bandwidths.end());
  if (*fastest <= *slowest * kProbeEqualWithin) {
    stripe_map_ = StripeMap::Equal(paths_.size());  // the same speed, within the probe's noise
  } else {
    ZINF_ASSIGN_OR_RETURN(stripe_map_, Annotate(StripeMap::FromRatios(bandwidths),
                                                "swap store: weights from the probe: "));
  }
  std::vector<std::string> measured;
  for (double b : bandwidths) measured.push_back(FormatBytes(static_cast<std::uint64_t>(b)) + "/s");
  weights_source_ = fmt::format("probed: {}", fmt::join(measured, ", "));
  return OkStatus();
}

Result<std::vector<double>> SwapStore::ProbeBandwidths() const {
  ZINF_ASSIGN_OR_RETURN(
      std::unique_ptr<IoBackend> backend,
      Annotate(CreateIoBackend(options_.probe_backend, options_.probe_aio, paths_[0].path),
               "swap store: the backend of the bandwidth probe: "));
  const std::uint64_t length = AlignUp(options_.probe_bytes, alignment_);
  BufferOptions buffer_options;
  buffer_options.alignment = std::bit_ceil(std::max<std::uint64_t>(alignment_, 4096));
  buffer_options.register_cuda = false;
  ZINF_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(length, buffer_options));
  std::vector<double> bandwidths;
  for (const PathState& ps : paths_) {
    const std::string context = fmt::format(
        "swap store: probing the bandwidth of {} ({} written and read in {}): ", ps.path,
        FormatBytes(length), ps.rank_dir);
    const std::string file_path = ps.rank_dir + "/" + kProbeName;
    // A killed probe's file is left under this name; the rank directory is ours (locked).
    ZINF_RETURN_IF_ERROR(
        Annotate(UnlinkIfPresent(ps.rank_fd.get(), kProbeName, 0, file_path), context));
    OpenOptions open_options;
    open_options.mode = OpenMode::kCreate;
    open_options.direct = options_.direct;
    open_options.no_follow = true;
    open_options.permissions = 0600;
    ZINF_ASSIGN_OR_RETURN(File file, Annotate(File::Open(file_path, open_options), context));
    // Unlinked at once: the probe leaves nothing behind, however it ends.
    ZINF_RETURN_IF_ERROR(
        Annotate(UnlinkIfPresent(ps.rank_fd.get(), kProbeName, 0, file_path), context));
    ZINF_RETURN_IF_ERROR(Annotate(file.Allocate(0, length), context));
    // The best of two rounds of a write then a read: the first may pay for the extents'
    // conversion from unwritten.
    double best[2] = {0, 0};
    for (int round = 0; round < 2; ++round) {
      for (const IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        const auto start = std::chrono::steady_clock::now();
        ZINF_RETURN_IF_ERROR(Annotate(
            backend->Submit({.op = op, .file = &file, .offset_bytes = 0, .buffer = buffer.span()}),
            context));
        ZINF_RETURN_IF_ERROR(Annotate(backend->WaitAll(), context));
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        double& slot = best[op == IoOp::kWrite ? 0 : 1];
        if (round == 0 || seconds < slot) slot = seconds;
      }
    }
    ZINF_RETURN_IF_ERROR(Annotate(file.Close(), context));
    // Reads and writes move the same bytes in a step: the path's rate for both together.
    const double seconds = std::max(best[0] + best[1], 1e-9);
    bandwidths.push_back(2.0 * static_cast<double>(length) / seconds);
  }
  return bandwidths;
}

Status SwapStore::MarkKept() {
  for (PathState& ps : paths_) {
    const std::string marker = ps.rank_dir + "/" + kKeptName;
    if (!options_.keep) {
      // A resumed kept store is no longer kept once this instance owns it without `keep`.
      ZINF_RETURN_IF_ERROR(UnlinkIfPresent(ps.rank_fd.get(), kKeptName, 0, marker));
      continue;
    }
    Result<UniqueFd> created =
        OpenFileAt(ps.rank_fd.get(), kKeptName, marker, FileAccess::kCreateNew, Follow::kNo, 0600);
    if (!created && created.error().code() == ErrorCode::kAlreadyExists) {
      // A resumed kept store has it already; anything but a regular file is refused.
      created = OpenFileAt(ps.rank_fd.get(), kKeptName, marker, FileAccess::kRead, Follow::kNo);
    }
    ZINF_RETURN_IF_ERROR(Annotate(std::move(created), "swap store: "));
    // Durable with the directory entry, so a crashed machine's store is still known as kept.
    ZINF_RETURN_IF_ERROR(
        Annotate(SyncFd(ps.rank_fd.get(), /*data_only=*/false, ps.rank_dir), "swap store: "));
  }
  return OkStatus();
}

Status SwapStore::WriteManifestAt(const PathState& ps, const std::string& text) {
  return Annotate(WriteFileAtomicAt(ps.rank_fd.get(), ps.rank_dir, kManifestName, text, 0600),
                  "swap store: ");
}

Status SwapStore::WriteManifest() {
  // A resumed store whose tensors are not all reserved again yet keeps the manifest's list (the
  // reserved ones are its prefix, Reserve checks).
  std::vector<TensorSpec> specs = manifest_tensors_;
  if (tensors_.size() >= manifest_tensors_.size()) {
    specs.clear();
    for (const Tensor& t : tensors_) specs.push_back({t.extent.name, t.extent.size_bytes});
  }
  const std::string text = ManifestText(options_.stripe_unit_bytes, stripe_map_, specs);
  // The first path's (the one a resume reads) last: a failure leaves it as it was.
  for (std::size_t i = paths_.size(); i-- > 0;) {
    ZINF_RETURN_IF_ERROR(WriteManifestAt(paths_[i], text));
  }
  return OkStatus();
}

Status SwapStore::ReadManifest() {
  const PathState& ps = paths_[0];
  const std::string path = ps.rank_dir + "/" + kManifestName;
  Result<std::string> read =
      ReadSmallFileAt(ps.rank_fd.get(), kManifestName, path, kMaxManifestBytes, Follow::kNo);
  if (!read) {
    const ErrorCode code = read.error().code();
    if (code == ErrorCode::kNotFound) {
      return FailedPreconditionError(fmt::format(
          "swap store: cannot resume: {} is missing (not a zinf swap store, or its creation was "
          "interrupted)",
          path));
    }
    if (code == ErrorCode::kInvalidArgument) {  // larger than kMaxManifestBytes
      return DataLossError(fmt::format("swap store: manifest {} is corrupt: larger than {} bytes",
                                       path, kMaxManifestBytes));
    }
    return std::move(read).error().WithContext("swap store: ");
  }
  Result<Manifest> manifest = ParseManifest(*read);
  if (!manifest) {
    return DataLossError(
        fmt::format("swap store: manifest {} is corrupt: {}", path, manifest.error().message()));
  }
  if (manifest->stripe_unit_bytes != options_.stripe_unit_bytes ||
      manifest->num_paths != paths_.size()) {
    return FailedPreconditionError(fmt::format(
        "swap store: cannot resume {}: it was created with stripe_unit_bytes {} over {} path(s), "
        "now configured {} over {}",
        ps.rank_dir, manifest->stripe_unit_bytes, manifest->num_paths, options_.stripe_unit_bytes,
        paths_.size()));
  }
  const StripeMap& map = manifest->map;
  Result<StripeMap> asked = MapOfOptions(options_);  // validated by Open
  if (options_.probe_path_weights || (asked && *asked != map)) {
    ZINF_LOG_INFO("swap store {}: resumed with the path weights {} it was created with ({})",
                  ps.rank_dir, map.WeightsText(),
                  options_.probe_path_weights     ? "not probed again"
                  : options_.path_weights.empty() ? "no weights given"
                                                  : fmt::format("{} given", asked->WeightsText()));
  }
  stripe_map_ = map;
  weights_source_ = "from the manifest";
  manifest_version_ = manifest->version;
  manifest_tensors_ = std::move(manifest->tensors);
  return OkStatus();
}

Result<std::vector<PathSpace>> SwapStore::PlanSpace(const SwapStoreOptions& options,
                                                    std::span<const TensorSpec> specs) {
  ZINF_RETURN_IF_ERROR(ValidateOptions(options));
  if (options.probe_path_weights) {
    return InvalidArgumentError(
        "swap store: PlanSpace with probe_path_weights: the weights are measured when the store "
        "opens; plan the open store's layout with PlanSpace(store.options(), specs)");
  }
  ZINF_ASSIGN_OR_RETURN(const StripeMap map, MapOfOptions(options));
  ZINF_ASSIGN_OR_RETURN(std::uint64_t total_units, SumUnits(specs, options.stripe_unit_bytes, 0));
  std::vector<std::string> paths;
  std::vector<std::uint64_t> needed;
  for (std::size_t i = 0; i < options.paths.size(); ++i) {
    paths.push_back(StripTrailingSlashes(options.paths[i]));
    needed.push_back(FileBytes(map, i, total_units, options.stripe_unit_bytes));
  }
  return MeasureSpace(paths, needed);
}

Status SwapStore::CheckSpace(std::span<const PathSpace> space) {
  std::string shortfall;
  std::set<std::uint64_t> reported;
  for (const PathSpace& s : space) {
    if (s.fs_needed_bytes <= s.available_bytes || !reported.insert(s.device_id).second) continue;
    std::string paths;
    for (const PathSpace& other : space) {
      if (other.device_id != s.device_id) continue;
      paths += fmt::format("{}{} needs {}", paths.empty() ? "" : ", ", other.path,
                           FormatBytes(other.needed_bytes));
    }
    shortfall += fmt::format("{}{}: {} needed on that file system, {} available",
                             shortfall.empty() ? "" : "; ", paths, FormatBytes(s.fs_needed_bytes),
                             FormatBytes(s.available_bytes));
  }
  if (shortfall.empty()) return OkStatus();
  return ResourceExhaustedError("not enough free space for the swap store: " + shortfall);
}

namespace {

// One pass of SwapStore::ReclaimStale over one configured path.
class StaleScan {
 public:
  StaleScan(const SwapStoreOptions& options, std::vector<StaleStore>* found)
      : options_(options), found_(found), uid_(::geteuid()) {}

  void ScanPath(const std::string& path) {
    Result<UniqueFd> path_fd = OpenDirNoFollow(AT_FDCWD, path, path);
    if (!path_fd) return Warn(path_fd.error());
    Result<DirectoryListing> listing =
        ListStoreDirectory(path_fd->get(), path, SwapStore::kMaxScanEntries);
    if (!listing) return Warn(listing.error());
    WarnIfTruncated(*listing, path);
    for (const std::string& name : listing->names) {
      if (!name.starts_with("zinf-")) continue;
      const std::string job_id = name.substr(5);
      if (!ValidateJobId(job_id)) continue;
      ScanJobDirectory(path_fd->get(), name, JoinPath(path, name), job_id);
    }
  }

 private:
  void Warn(const Error& error) {
    std::string_view message = error.message();
    if (message.starts_with("swap store: ")) message.remove_prefix(12);
    ZINF_LOG_WARN("swap store: looking for stale stores: {}", message);
  }

  void WarnIfTruncated(const DirectoryListing& listing, const std::string& dir) {
    if (!listing.truncated) return;
    ZINF_LOG_WARN(
        "swap store: looking for stale stores: {} has more than {} entries; examined only the "
        "first {}",
        dir, SwapStore::kMaxScanEntries, SwapStore::kMaxScanEntries);
  }

  // The directory `name` in `parent_fd`, opened without following a link, when it is a
  // directory of ours; nullopt (silently) for anything else or a name that vanished.
  std::optional<UniqueFd> OpenOwnDirectory(int parent_fd, const std::string& name,
                                           const std::string& display) {
    struct stat st {};
    if (Env::Default().StatAt(parent_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != ENOENT) Warn(ErrnoError(errno, fmt::format("stat {}", display)));
      return std::nullopt;
    }
    if (!S_ISDIR(st.st_mode) || st.st_uid != uid_) return std::nullopt;
    Result<UniqueFd> fd = OpenDirNoFollow(parent_fd, name, display);
    if (!fd) {
      // Replaced by a link or a file since the fstatat, or removed: not a store of ours.
      if (fd.error().code() != ErrorCode::kNotFound &&
          fd.error().code() != ErrorCode::kFailedPrecondition) {
        Warn(fd.error());
      }
      return std::nullopt;
    }
    if (Env::Default().StatAt(fd->get(), "", &st, AT_EMPTY_PATH) != 0 || st.st_uid != uid_) {
      return std::nullopt;
    }
    return std::move(*fd);
  }

  // True when this process now holds LOCK_EX on `fd`, still linked as `name` in `parent_fd`.
  bool LockStale(int parent_fd, const std::string& name, int fd, const std::string& display) {
    Result<bool> locked = TryFlock(fd, LOCK_EX | LOCK_NB, display);
    if (!locked) {
      Warn(locked.error());
      return false;
    }
    if (!*locked) return false;  // a live instance holds it
    Result<bool> linked = StillLinked(parent_fd, name, fd, display);
    if (!linked) Warn(linked.error());
    return linked && *linked;
  }

  void ScanJobDirectory(int path_fd, const std::string& name, const std::string& job_dir,
                        const std::string& job_id) {
    const bool ours = job_id == options_.job_id;
    std::optional<UniqueFd> job_fd = OpenOwnDirectory(path_fd, name, job_dir);
    if (!job_fd) return;
    // Our own job's directory is held (LOCK_SH) by our live stores: look at its rank
    // directories one by one. Another job's directory held by any live store is left alone.
    if (!ours && !LockStale(path_fd, name, job_fd->get(), job_dir)) return;
    Result<DirectoryListing> listing =
        ListStoreDirectory(job_fd->get(), job_dir, SwapStore::kMaxScanEntries);
    if (!listing) return Warn(listing.error());
    WarnIfTruncated(*listing, job_dir);
    std::size_t removed = 0;
    for (const std::string& rank_name : listing->names) {
      const std::optional<int> rank = ParseRankDirName(rank_name);
      if (!rank) continue;
      if (ScanRankDirectory(job_fd->get(), rank_name, job_dir + "/" + rank_name, job_id, *rank)) {
        ++removed;
      }
    }
    // Removed when this scan emptied it of proven stores (ENOTEMPTY: a kept store or other
    // entries stay in it); a job directory that held none may be anybody's.
    if (ours || removed == 0) return;
    Result<bool> linked = StillLinked(path_fd, name, job_fd->get(), job_dir);
    if (linked && *linked && Env::Default().UnlinkAt(path_fd, name.c_str(), AT_REMOVEDIR) != 0 &&
        errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT) {
      Warn(ErrnoError(errno, fmt::format("remove {}", job_dir)));
    }
  }

  // True when it removed the rank directory: a proven store that no live process holds.
  bool ScanRankDirectory(int job_fd, const std::string& name, const std::string& rank_dir,
                         const std::string& job_id, int rank) {
    std::optional<UniqueFd> rank_fd = OpenOwnDirectory(job_fd, name, rank_dir);
    if (!rank_fd || !LockStale(job_fd, name, rank_fd->get(), rank_dir)) return false;
    Result<RankDirectoryFacts> facts = ExamineRankDirectory(rank_fd->get(), rank_dir);
    if (!facts) {
      Warn(facts.error());
      return false;
    }
    StaleStore stale{.directory = rank_dir,
                     .job_id = job_id,
                     .world_rank = rank,
                     .size_bytes = facts->size_bytes};
    const std::string size = FormatBytes(stale.size_bytes);
    if (facts->foreign != 0 || facts->truncated) {
      const std::string what = facts->truncated
                                   ? fmt::format("more than {} entries", SwapStore::kMaxScanEntries)
                                   : fmt::format("{} entr{} a swap store never has", facts->foreign,
                                                 facts->foreign == 1 ? "y" : "ies");
      ZINF_LOG_WARN(
          "swap store {} ({}) that a killed run of job '{}' may have left behind holds {}; not "
          "removed: remove it with: rm -rf {}",
          rank_dir, size, job_id, what, rank_dir);
      stale.action = StaleAction::kLeft;
    } else if (!facts->unproven.empty()) {
      ZINF_LOG_WARN(
          "{} ({}) is not provably a swap store that zinf made: {}; not removed: if a killed run "
          "of job '{}' left it behind, remove it with: rm -rf {}",
          rank_dir, size, facts->unproven, job_id, rank_dir);
      stale.action = StaleAction::kLeft;
    } else if (facts->kept) {
      ZINF_LOG_WARN(
          "swap store {} ({}) of job '{}' was kept (keep_swap) by a run that has ended; it is "
          "not removed automatically: remove it with: rm -rf {}",
          rank_dir, size, job_id, rank_dir);
      stale.action = StaleAction::kKept;
    } else {
      stale.action = Remove(job_fd, name, rank_fd->get(), rank_dir, facts->entries)
                         ? StaleAction::kRemoved
                         : StaleAction::kLeft;
      if (stale.action == StaleAction::kRemoved) {
        ZINF_LOG_WARN("removed the swap store {} ({}) that a killed run of job '{}' left behind",
                      rank_dir, size, job_id);
      }
    }
    const bool removed = stale.action == StaleAction::kRemoved;
    found_->push_back(std::move(stale));
    return removed;
  }

  // Unlinks the store's files (`entries`, all known names) and the rank directory itself.
  bool Remove(int job_fd, const std::string& name, int rank_fd, const std::string& rank_dir,
              const std::vector<std::string>& entries) {
    for (const std::string& entry : entries) {
      if (Env::Default().UnlinkAt(rank_fd, entry.c_str(), 0) != 0 && errno != ENOENT) {
        const int err = errno;
        ZINF_LOG_WARN(
            "swap store {} that a killed run left behind: remove {}: {}; remove it "
            "with: rm -rf {}",
            rank_dir, entry, std::strerror(err), rank_dir);
        return false;
      }
    }
    Result<bool> linked = StillLinked(job_fd, name, rank_fd, rank_dir);
    if (!linked || !*linked) return true;  // removed by someone else meanwhile
    if (Env::Default().UnlinkAt(job_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      const int err = errno;
      ZINF_LOG_WARN(
          "swap store {} that a killed run left behind: rmdir: {}; remove it with: "
          "rm -rf {}",
          rank_dir, std::strerror(err), rank_dir);
      return false;
    }
    return true;
  }

  const SwapStoreOptions& options_;
  std::vector<StaleStore>* found_;
  uid_t uid_;
};

// Reserve's names: valid, and each new (neither in `index` nor twice in `specs`).
Status CheckNewNames(std::span<const TensorSpec> specs,
                     const std::unordered_map<std::string, std::size_t>& index) {
  std::set<std::string> names;
  for (const TensorSpec& spec : specs) {
    ZINF_RETURN_IF_ERROR(ValidateTensorName(spec.name));
    if (index.contains(spec.name) || !names.insert(spec.name).second) {
      return AlreadyExistsError(
          fmt::format("swap store: tensor '{}' is reserved twice", spec.name));
    }
  }
  return OkStatus();
}

// A resumed store must be reserved in the order its manifest recorded: `specs`, placed after
// `reserved` tensors, against the manifest's tensors of the store in `rank_dir`.
Status CheckResumeOrder(std::span<const TensorSpec> specs, std::size_t reserved,
                        std::span<const TensorSpec> manifest_tensors, const std::string& rank_dir) {
  for (std::size_t k = 0; k < specs.size(); ++k) {
    const std::size_t i = reserved + k;
    if (i >= manifest_tensors.size()) break;
    const TensorSpec& old = manifest_tensors[i];
    if (old.name != specs[k].name || old.size_bytes != specs[k].size_bytes) {
      return FailedPreconditionError(fmt::format(
          "swap store: cannot resume {}: tensor {} is '{}' of {} bytes there, but '{}' of {} "
          "bytes now (the layout changed)",
          rank_dir, i, old.name, old.size_bytes, specs[k].name, specs[k].size_bytes));
    }
  }
  return OkStatus();
}

// The size of `file`, which must hold the `resumed_bytes` a resumed manifest promises (DataLoss
// for a truncated file).
Result<std::uint64_t> SizeHolding(const File& file, std::uint64_t resumed_bytes) {
  ZINF_ASSIGN_OR_RETURN(std::uint64_t current, Annotate(file.Size(), "swap store: "));
  if (current < resumed_bytes) {
    return DataLossError(
        fmt::format("swap store: cannot resume: {} holds {} bytes, the manifest's tensors need {} "
                    "(truncated file)",
                    file.path(), current, resumed_bytes));
  }
  return current;
}

// The extent of the tensor `spec` placed at logical stripe unit `first_unit`.
TensorExtent ExtentAt(TensorSpec spec, std::uint64_t first_unit, std::uint64_t alignment,
                      std::uint64_t stripe_unit_bytes) {
  TensorExtent extent;
  extent.name = std::move(spec.name);
  extent.size_bytes = spec.size_bytes;
  extent.io_size_bytes = AlignUp(spec.size_bytes, alignment);
  extent.num_units = UnitsFor(spec.size_bytes, stripe_unit_bytes);
  extent.padded_size_bytes = extent.num_units * stripe_unit_bytes;
  extent.first_unit = first_unit;
  return extent;
}

}  // namespace

Result<std::vector<StaleStore>> SwapStore::ReclaimStale(const SwapStoreOptions& options) {
  ZINF_RETURN_IF_ERROR(ValidateOptions(options));
  std::vector<StaleStore> found;
  StaleScan scan(options, &found);
  for (const std::string& path : options.paths) scan.ScanPath(StripTrailingSlashes(path));
  return found;
}

Status SwapStore::Reserve(std::vector<TensorSpec> specs) {
  if (closed_) return FailedPreconditionError("swap store: Reserve after Close");
  ZINF_RETURN_IF_ERROR(CheckNewNames(specs, index_));
  ZINF_RETURN_IF_ERROR(
      CheckResumeOrder(specs, tensors_.size(), manifest_tensors_, paths_[0].rank_dir));
  const std::uint64_t su = options_.stripe_unit_bytes;
  ZINF_ASSIGN_OR_RETURN(std::uint64_t new_total, SumUnits(specs, su, total_units_));

  // Units the manifest promises are on disk already: the files must hold them.
  std::uint64_t resumed_units = total_units_;
  for (std::size_t k = 0; k < specs.size() && tensors_.size() + k < manifest_tensors_.size(); ++k) {
    resumed_units += UnitsFor(specs[k].size_bytes, su);
  }
  std::vector<std::string> paths;
  std::vector<std::uint64_t> needed;
  std::vector<std::uint64_t> target;
  bool grow = false;
  for (std::size_t i = 0; i < paths_.size(); ++i) {
    ZINF_ASSIGN_OR_RETURN(
        std::uint64_t current,
        SizeHolding(paths_[i].file, FileBytes(stripe_map_, i, resumed_units, su)));
    target.push_back(FileBytes(stripe_map_, i, new_total, su));
    needed.push_back(target.back() > current ? target.back() - current : 0);
    grow = grow || needed.back() > 0;
    paths.push_back(paths_[i].path);
  }
  if (grow) {
    ZINF_ASSIGN_OR_RETURN(std::vector<PathSpace> space, MeasureSpace(paths, needed));
    ZINF_RETURN_IF_ERROR(
        Annotate(CheckSpace(space), fmt::format("rank {}: ", options_.world_rank)));
  }
  for (std::size_t i = 0; i < paths_.size(); ++i) {
    if (target[i] == 0) continue;
    ZINF_RETURN_IF_ERROR(Annotate(paths_[i].file.Allocate(0, target[i]),
                                  fmt::format("swap store: preallocate {} of {}",
                                              FormatBytes(target[i]), paths_[i].file.path())));
  }

  const std::size_t old_count = tensors_.size();
  const std::uint64_t old_total = total_units_;
  for (TensorSpec& spec : specs) {
    Tensor t;
    t.extent = ExtentAt(std::move(spec), total_units_, alignment_, su);
    total_units_ += t.extent.num_units;
    if (options_.verify_swap) {
      t.checksums.assign(t.extent.num_units, 0);
      t.checksum_valid.assign(t.extent.num_units, false);
    }
    index_.emplace(t.extent.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }
  if (tensors_.size() > manifest_tensors_.size()) {
    Status written = WriteManifest();
    if (!written) {
      for (std::size_t i = old_count; i < tensors_.size(); ++i)
        index_.erase(tensors_[i].extent.name);
      tensors_.resize(old_count);
      total_units_ = old_total;
      return written;
    }
  }
  return OkStatus();
}

Result<std::size_t> SwapStore::Find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) {
    return NotFoundError(fmt::format("swap store: no tensor '{}' is reserved", name));
  }
  return it->second;
}

Result<TensorExtent> SwapStore::Extent(std::string_view name) const {
  ZINF_ASSIGN_OR_RETURN(std::size_t i, Find(name));
  return tensors_[i].extent;
}

bool SwapStore::direct() const {
  return std::all_of(paths_.begin(), paths_.end(),
                     [](const PathState& ps) { return ps.file.direct(); });
}

std::vector<SwapStore::Segment> SwapStore::MapRange(const Tensor& tensor,
                                                    std::uint64_t offset_bytes,
                                                    std::uint64_t io_length_bytes) const {
  const std::uint64_t su = options_.stripe_unit_bytes;
  std::vector<Segment> segments;
  std::uint64_t pos = offset_bytes;
  const std::uint64_t end = offset_bytes + io_length_bytes;
  while (pos < end) {
    const std::uint64_t unit = pos / su;
    const std::uint64_t within = pos % su;
    const std::uint64_t length = std::min(su - within, end - pos);
    const StripeMap::Location at = stripe_map_.Locate(tensor.extent.first_unit + unit);
    segments.push_back(Segment{at.path, at.unit * su + within, pos, length});
    pos += length;
  }
  return segments;
}

Status SwapStore::CheckRange(const Tensor& tensor, std::uint64_t offset_bytes,
                             std::uint64_t length_bytes, std::size_t buffer_size,
                             const void* buffer_address) const {
  const TensorExtent& e = tensor.extent;
  if (offset_bytes > e.size_bytes || length_bytes > e.size_bytes - offset_bytes) {
    return InvalidArgumentError(
        fmt::format("swap store: range [{}, +{}) is outside tensor '{}' of {} bytes", offset_bytes,
                    length_bytes, e.name, e.size_bytes));
  }
  if (offset_bytes % alignment_ != 0 ||
      (length_bytes % alignment_ != 0 && offset_bytes + length_bytes != e.size_bytes)) {
    return InvalidArgumentError(fmt::format(
        "swap store: range [{}, +{}) of tensor '{}' is not aligned to {} (only the tensor's "
        "tail may have an unaligned length)",
        offset_bytes, length_bytes, e.name, alignment_));
  }
  const std::uint64_t io_length = AlignUp(length_bytes, alignment_);
  if (buffer_size < io_length) {
    return InvalidArgumentError(fmt::format(
        "swap store: buffer of {} bytes for {} bytes of tensor '{}' (needs {} bytes: the length "
        "rounded up to the alignment {})",
        buffer_size, length_bytes, e.name, io_length, alignment_));
  }
  if (reinterpret_cast<std::uintptr_t>(buffer_address) % alignment_ != 0) {
    return InvalidArgumentError(
        fmt::format("swap store: buffer for tensor '{}' at {} is not aligned to {}", e.name,
                    buffer_address, alignment_));
  }
  return OkStatus();
}

void SwapStore::RecordChecksums(std::size_t tensor_index, std::uint64_t offset_bytes,
                                std::span<const std::byte> data, bool invalidate) {
  if (!options_.verify_swap || data.empty()) return;
  const std::uint64_t su = options_.stripe_unit_bytes;
  std::lock_guard<std::mutex> lock(checksum_mutex_);
  Tensor& t = tensors_[tensor_index];
  const std::uint64_t end = offset_bytes + data.size();
  for (std::uint64_t u = offset_bytes / su; u < t.extent.num_units && u * su < end; ++u) {
    const std::uint64_t unit_begin = u * su;
    const std::uint64_t unit_end = std::min(unit_begin + su, t.extent.size_bytes);
    const bool covered = unit_begin >= offset_bytes && unit_end <= end;
    if (covered && !invalidate) {
      t.checksums[u] = Checksum64(data.subspan(unit_begin - offset_bytes, unit_end - unit_begin));
      t.checksum_valid[u] = true;
    } else {
      t.checksum_valid[u] = false;
    }
  }
}

Status SwapStore::VerifyChecksums(const Tensor& t, std::uint64_t offset_bytes,
                                  std::span<const std::byte> data) const {
  if (!options_.verify_swap || data.empty()) return OkStatus();
  const std::uint64_t su = options_.stripe_unit_bytes;
  const std::uint64_t end = offset_bytes + data.size();
  std::lock_guard<std::mutex> lock(checksum_mutex_);
  for (std::uint64_t u = offset_bytes / su; u < t.extent.num_units && u * su < end; ++u) {
    const std::uint64_t unit_begin = u * su;
    const std::uint64_t unit_end = std::min(unit_begin + su, t.extent.size_bytes);
    if (unit_begin < offset_bytes || unit_end > end || !t.checksum_valid[u]) continue;
    const StripeMap::Location at = stripe_map_.Locate(t.extent.first_unit + u);
    ZINF_RETURN_IF_ERROR(VerifyChecksum(
        data.subspan(unit_begin - offset_bytes, unit_end - unit_begin), t.checksums[u],
        fmt::format("swap store tensor '{}' bytes [{}, {}) (stripe unit {} of {} at offset {}, "
                    "rank {})",
                    t.extent.name, unit_begin, unit_end, u, paths_[at.path].file.path(),
                    at.unit * su, options_.world_rank)));
  }
  return OkStatus();
}

Status SwapStore::VerifyRead(std::string_view name, std::span<const std::byte> data,
                             std::uint64_t offset_bytes) const {
  ZINF_ASSIGN_OR_RETURN(std::size_t i, Find(name));
  const Tensor& t = tensors_[i];
  if (offset_bytes > t.extent.size_bytes || data.size() > t.extent.size_bytes - offset_bytes) {
    return InvalidArgumentError(
        fmt::format("swap store: VerifyRead range [{}, +{}) is outside tensor '{}' of {} bytes",
                    offset_bytes, data.size(), t.extent.name, t.extent.size_bytes));
  }
  return VerifyChecksums(t, offset_bytes, data);
}

Result<std::vector<std::uint64_t>> SwapStore::SubmitRange(IoOp op, std::string_view name,
                                                          std::uint64_t offset_bytes,
                                                          std::uint64_t length_bytes,
                                                          std::span<std::byte> buffer,
                                                          IoBackend& backend) {
  if (closed_) return FailedPreconditionError("swap store: I/O after Close");
  ZINF_ASSIGN_OR_RETURN(std::size_t index, Find(name));
  const Tensor& t = tensors_[index];
  ZINF_RETURN_IF_ERROR(CheckRange(t, offset_bytes, length_bytes, buffer.size(), buffer.data()));
  const std::uint64_t io_length = AlignUp(length_bytes, alignment_);
  std::vector<Segment> segments = MapRange(t, offset_bytes, io_length);
  // Units that follow each other in one file (always, with one path) become one request.
  std::vector<Segment> merged;
  for (const Segment& s : segments) {
    if (!merged.empty()) {
      Segment& last = merged.back();
      if (last.path_index == s.path_index &&
          last.file_offset_bytes + last.length_bytes == s.file_offset_bytes &&
          last.tensor_offset_bytes + last.length_bytes == s.tensor_offset_bytes) {
        last.length_bytes += s.length_bytes;
        continue;
      }
    }
    merged.push_back(s);
  }
  const auto data = std::span<const std::byte>(buffer).first(length_bytes);
  if (op == IoOp::kWrite) RecordChecksums(index, offset_bytes, data);
  std::vector<std::uint64_t> ids;
  ids.reserve(merged.size());
  for (const Segment& s : merged) {
    IoRequest request;
    request.op = op;
    request.file = &paths_[s.path_index].file;
    request.offset_bytes = s.file_offset_bytes;
    request.buffer = buffer.subspan(s.tensor_offset_bytes - offset_bytes, s.length_bytes);
    Result<std::uint64_t> id = backend.Submit(request);
    if (!id) {
      if (op == IoOp::kWrite) RecordChecksums(index, offset_bytes, data, /*invalidate=*/true);
      return std::move(id).error().WithContext(fmt::format(
          "swap store: submit {} of tensor '{}' bytes [{}, +{}) ({} of {} requests submitted): ",
          IoOpName(op), t.extent.name, offset_bytes, length_bytes, ids.size(), merged.size()));
    }
    ids.push_back(*id);
    (op == IoOp::kRead ? read_bytes_ : write_bytes_)
        .fetch_add(s.length_bytes, std::memory_order_relaxed);
  }
  return ids;
}

Result<std::vector<std::uint64_t>> SwapStore::SubmitWrite(std::string_view name,
                                                          std::span<const std::byte> buffer,
                                                          IoBackend& backend) {
  ZINF_ASSIGN_OR_RETURN(std::size_t i, Find(name));
  return SubmitWriteRange(name, 0, tensors_[i].extent.size_bytes, buffer, backend);
}

Result<std::vector<std::uint64_t>> SwapStore::SubmitRead(std::string_view name,
                                                         std::span<std::byte> buffer,
                                                         IoBackend& backend) {
  ZINF_ASSIGN_OR_RETURN(std::size_t i, Find(name));
  return SubmitReadRange(name, 0, tensors_[i].extent.size_bytes, buffer, backend);
}

Result<std::vector<std::uint64_t>> SwapStore::SubmitWriteRange(std::string_view name,
                                                               std::uint64_t offset_bytes,
                                                               std::uint64_t length_bytes,
                                                               std::span<const std::byte> buffer,
                                                               IoBackend& backend) {
  // The backend takes one span type for both directions; a write only reads the buffer.
  std::span<std::byte> mutable_buffer(const_cast<std::byte*>(buffer.data()), buffer.size());
  return SubmitRange(IoOp::kWrite, name, offset_bytes, length_bytes, mutable_buffer, backend);
}

Result<std::vector<std::uint64_t>> SwapStore::SubmitReadRange(std::string_view name,
                                                              std::uint64_t offset_bytes,
                                                              std::uint64_t length_bytes,
                                                              std::span<std::byte> buffer,
                                                              IoBackend& backend) {
  return SubmitRange(IoOp::kRead, name, offset_bytes, length_bytes, buffer, backend);
}

namespace {

// One stripe unit of aligned host memory for the synchronous Read/Write paths.
Result<AlignedBuffer> AllocateBounce(std::uint64_t alignment, std::uint64_t stripe_unit_bytes) {
  BufferOptions options;
  options.alignment = std::bit_ceil(std::max<std::uint64_t>(alignment, 4096));
  options.register_cuda = false;
  options.zero = false;
  return AlignedBuffer::Allocate(stripe_unit_bytes, options);
}

}  // namespace

Status SwapStore::Write(std::string_view name, std::span<const std::byte> data) {
  if (closed_) return FailedPreconditionError("swap store: Write after Close");
  ZINF_ASSIGN_OR_RETURN(std::size_t index, Find(name));
  const Tensor& t = tensors_[index];
  if (data.size() != t.extent.size_bytes) {
    return InvalidArgumentError(fmt::format("swap store: Write of {} bytes to tensor '{}' of {}",
                                            data.size(), t.extent.name, t.extent.size_bytes));
  }
  if (data.empty()) return OkStatus();
  ZINF_ASSIGN_OR_RETURN(AlignedBuffer bounce,
                        AllocateBounce(alignment_, options_.stripe_unit_bytes));
  // Forget old checksums first: a failed write leaves the units in an unknown state.
  RecordChecksums(index, 0, data, /*invalidate=*/true);
  for (const Segment& s : MapRange(t, 0, t.extent.io_size_bytes)) {
    const std::uint64_t payload =
        std::min(s.length_bytes, t.extent.size_bytes - s.tensor_offset_bytes);
    std::memcpy(bounce.data(), data.data() + s.tensor_offset_bytes, payload);
    std::memset(bounce.data() + payload, 0, s.length_bytes - payload);
    ZINF_RETURN_IF_ERROR(Annotate(
        PwriteFull(paths_[s.path_index].file, bounce.data(), s.length_bytes, s.file_offset_bytes),
        fmt::format("swap store: write tensor '{}': ", t.extent.name)));
    write_bytes_.fetch_add(s.length_bytes, std::memory_order_relaxed);
  }
  RecordChecksums(index, 0, data);
  return OkStatus();
}

Status SwapStore::Read(std::string_view name, std::span<std::byte> out) {
  if (closed_) return FailedPreconditionError("swap store: Read after Close");
  ZINF_ASSIGN_OR_RETURN(std::size_t index, Find(name));
  const Tensor& t = tensors_[index];
  if (out.size() != t.extent.size_bytes) {
    return InvalidArgumentError(fmt::format("swap store: Read of {} bytes from tensor '{}' of {}",
                                            out.size(), t.extent.name, t.extent.size_bytes));
  }
  if (out.empty()) return OkStatus();
  ZINF_ASSIGN_OR_RETURN(AlignedBuffer bounce,
                        AllocateBounce(alignment_, options_.stripe_unit_bytes));
  for (const Segment& s : MapRange(t, 0, t.extent.io_size_bytes)) {
    ZINF_RETURN_IF_ERROR(Annotate(
        PreadFull(paths_[s.path_index].file, bounce.data(), s.length_bytes, s.file_offset_bytes),
        fmt::format("swap store: read tensor '{}': ", t.extent.name)));
    read_bytes_.fetch_add(s.length_bytes, std::memory_order_relaxed);
    const std::uint64_t payload =
        std::min(s.length_bytes, t.extent.size_bytes - s.tensor_offset_bytes);
    std::memcpy(out.data() + s.tensor_offset_bytes, bounce.data(), payload);
  }
  return VerifyChecksums(t, 0, out);
}

Status SwapStore::Sync() {
  if (closed_) return FailedPreconditionError("swap store: Sync after Close");
  for (PathState& ps : paths_) {
    ZINF_RETURN_IF_ERROR(Annotate(ps.file.Sync(), "swap store: sync: "));
  }
  return OkStatus();
}

Status SwapStore::RemoveStore(bool all) {
  const std::string job_name = JobDirName(options_);
  const std::string rank_name = RankDirName(options_);
  Status first = OkStatus();
  auto note = [&first](Status s) {
    if (!s && first) first = std::move(s);
  };
  for (std::size_t i = 0; i < paths_.size(); ++i) {
    PathState& ps = paths_[i];
    if (ps.file.is_open()) note(ps.file.Close());
    if (ps.rank_fd && (all || ps.created_rank_dir)) {
      for (const char* name : kStoreFileNames) {
        note(UnlinkIfPresent(ps.rank_fd.get(), name, 0, ps.rank_dir + "/" + name));
      }
      ps.rank_fd.Reset();
      note(UnlinkIfPresent(ps.job_fd.get(), rank_name.c_str(), AT_REMOVEDIR, ps.rank_dir));
    }
    // The job directory is shared with the node's other ranks, which hold LOCK_SH on it: the
    // last one out (the only one that gets LOCK_EX) removes it when it is empty.
    if (ps.job_fd && (all || ps.created_job_dir)) {
      Result<bool> exclusive = TryFlock(ps.job_fd.get(), LOCK_UN, ps.job_dir);
      if (exclusive) exclusive = TryFlock(ps.job_fd.get(), LOCK_EX | LOCK_NB, ps.job_dir);
      if (exclusive && *exclusive &&
          Env::Default().UnlinkAt(ps.path_fd.get(), job_name.c_str(), AT_REMOVEDIR) != 0 &&
          errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT && errno != EBUSY) {
        note(ErrnoError(errno, fmt::format("swap store: remove {}", ps.job_dir)));
      }
      if (!exclusive) note(std::move(exclusive).error());
      ps.job_fd.Reset();
    }
  }
  return first;
}

void SwapStore::CloseDescriptors() {
  for (PathState& ps : paths_) {
    ps.rank_fd.Reset();
    ps.job_fd.Reset();
    ps.path_fd.Reset();
  }
}

Status SwapStore::Close() {
  if (closed_) return OkStatus();
  closed_ = true;
  Status first = OkStatus();
  if (options_.keep) {
    for (PathState& ps : paths_) {
      Status s = Annotate(ps.file.Sync(), "swap store: sync at close: ");
      if (!s && first) first = std::move(s);
    }
    for (PathState& ps : paths_) {
      Status s = Annotate(ps.file.Close(), "swap store: close: ");
      if (!s && first) first = std::move(s);
    }
    ZINF_LOG_INFO("swap store {} kept (keep_swap)", paths_[0].rank_dir);
  } else {
    Status s = RemoveStore(/*all=*/true);
    if (!s && first) first = std::move(s);
  }
  CloseDescriptors();
  return first;
}

}  // namespace zinf::storage
