// Checkpoints of the swapped optimizer state: one parallel-HDF5 file per checkpoint, written
// collectively by the N ranks of a job and restorable on any number M of ranks (DESIGN.md,
// "Checkpoint").
//
//   CheckpointSaveOptions save{.dir = "/ckpt", .keep_last = 3};
//   save.trainer = {{"step", step}, {"data_position", pos}};
//   ZINF_ASSIGN_OR_RETURN(SavedCheckpoint saved, SaveCheckpoint(*swapper, step, save));
//   ...
//   ZINF_ASSIGN_OR_RETURN(RestoredCheckpoint restored, RestoreCheckpoint(*swapper, "/ckpt"));
//
// File format (format "zinf"; format_version 1 for fp32 state, 2 for q8 state, as the swapper's
// SwapperOptions::state_format). Any HDF5 reader (h5py, h5dump) sees:
//   /                attributes: format = "zinf", format_version (int64), step, world_size,
//                    total_numel, sub_group_size, chunk_numel (int64), optimizer (JSON string:
//                    {"type", "params"}), config (JSON string), created (ISO-8601 UTC string)
//   /layout          attribute `json` (ParamLayout::ToJson: names, shapes, dtype, in order);
//                    datasets /layout/flat_offset and /layout/numel (uint64, one per parameter)
//   /state/fp32, /state/exp_avg, /state/exp_avg_sq
//                    float32 [total_numel], the global unpadded flat vector, HDF5-chunked by
//                    chunk_numel elements
//   /checksum/fp32, /checksum/exp_avg, /checksum/exp_avg_sq
//                    uint64 [ceil(total_numel / chunk_numel)]: entry k is XXH3-64 (seed 0) of the
//                    little-endian bytes of elements [k * chunk_numel, min((k + 1) * chunk_numel,
//                    total_numel)); group attributes `algorithm` = "xxh3-64", `chunk_numel`
// A q8 file (format_version 2, root attribute optimizer_state = "q8") holds the quantized state
// exactly, instead of /state/exp_avg and /state/exp_avg_sq:
//   /state/exp_avg_codes, /state/exp_avg_sq_codes
//                    uint8 [total_numel], chunked and checksummed (/checksum/<name>) as above
//   /q8/segment_start, /q8/segment_numel, /q8/segment_block
//                    uint64 [num_segments]: the quantization blocks as they were on the saving
//                    ranks (q8::kBlockNumel elements of a sub-group from its first element) as
//                    flat ranges: segment j is flat elements [segment_start[j], segment_start[j]
//                    + segment_numel[j]) of block segment_block[j]; the segments tile the flat
//                    vector (one per block for flat ZeRO-1/2 plans, more where a block holds
//                    pieces of several parameters)
//   /q8/exp_avg_scales, /q8/exp_avg_sq_scales   float32 [num_blocks]: each block's scale
//   /q8/map_signed, /q8/map_unsigned            float32 [256]: the code maps (q8.h)
//   /checksum/q8     uint64 [7]: XXH3-64 of each of those seven datasets' bytes, in the order
//                    map_signed, map_unsigned, segment_start, segment_numel, segment_block,
//                    exp_avg_scales, exp_avg_sq_scales
// so that exp_avg[e] = map_signed[exp_avg_codes[e]] * exp_avg_scales[block(e)]; in NumPy,
// o = argsort(segment_start); block = repeat(segment_block[o], segment_numel[o]);
// exp_avg = map_signed[exp_avg_codes] * exp_avg_scales[block], exp_avg_sq likewise with
// map_unsigned. `zinf-ckpt export --moments` writes them as fp32.
//   /trainer         attribute `state`: the caller's JSON (step counters, data position, RNG
//                    state, learning-rate schedule); "{}" when none was given
// Gradients are not saved.
//
// Commit protocol (SaveCheckpoint). Rank 0 checks that `<dir>` has room for the file
// (EstimateCheckpointBytes; ResourceExhausted otherwise), removes any entry named
// `<dir>/step-<N>.h5.partial` (never following it), creates that file exclusively, writes its
// whole structure serially (attributes, layout, every dataset with its space allocated), closes
// it and reserves its blocks (fallocate). The ranks then open it collectively and write elements
// only (state, then checksums): no HDF5 metadata is flushed collectively, so one rank's failed
// write cannot leave the others in HDF5's barriers. They close it and every rank fdatasyncs it.
// Only after every rank agreed on success does rank 0 rename it to `<dir>/step-<N>.h5`, fsync the
// directory, replace `<dir>/latest` (the file name, one line) through an exclusively created,
// fsynced `latest.tmp` and fsync the directory again; then `.partial` files left by crashed saves
// are removed and `keep_last` retention deletes older `step-*.h5` files (names parsed strictly,
// unlinked without following). A crash at any point therefore leaves `latest` naming a complete
// checkpoint (the previous one until the rename of `latest`), and at worst a stale `.partial`
// file, which the next save of that step replaces.
//
// Write-behind (save). The file is written through MPI-IO into the page cache; after every slab
// each rank starts the writeback of the file (sync_file_range) and, after reading its next run
// from the swap store, waits for it and drops the file's clean pages (POSIX_FADV_DONTNEED). So
// the swap-store reads overlap the writeback, at most about one slab per rank is dirty, and a
// save leaves no checkpoint pages in the page cache (a restore right after reads the disk). A
// sync_file_range error (EIO, ...) fails the save like a write error. Durability is unchanged:
// it comes from the flush, close and fdatasync above.
//
// Timers. Save and restore accumulate their phases into swapper.timers() (so LogTimers shows
// them): ckpt_save_{header,read_state,checksum,read_wait,agree,writeback_wait,write_slab,flush,
// orphans_and_checksums,close,fdatasync,commit} and ckpt_restore_{open,verify_pass,write_state,
// read_in_write_state} (the last is the part of write_state spent reading and verifying the
// file). zinf-bench ckpt reports them.
//
// Memory. Save streams each sub-group run through two pool buffers when the pool has three
// free (plus the one ReadState borrows), else through one; restore writes through WriteState's
// three pool buffers and reads through three chunk buffers of chunk_numel floats (12 MiB at the
// default chunk size). Host memory therefore
// stays bounded by the pool and the chunk size, whatever the model size. Per-chunk checksum
// tables (8 bytes per chunk per state) are held in memory.
//
// Overlap (save). With two staging buffers, the next tensor run is read from the swap store and
// hashed on a helper thread (std::async) while the calling thread writes the current one; only
// that thread uses the swapper while its read is pending, and it is joined before SaveCheckpoint
// returns (also on errors). A save then costs about max(swap-store read, file write), not the
// sum. The ckpt_save_read_state and ckpt_save_checksum timers run on the helper thread
// (overlapped); ckpt_save_read_wait is the time the calling thread waited for it.
//
// Thread safety: one thread at a time per swapper (SaveCheckpoint's helper thread included);
// HDF5 is used from the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/core/status.h"
#include "zinf/partition/layout.h"
#include "zinf/storage/fs.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::checkpoint {

inline constexpr std::string_view kCheckpointFormat = "zinf";
inline constexpr std::int64_t kCheckpointFormatVersion = 1;    // fp32 state
inline constexpr std::int64_t kCheckpointFormatVersionQ8 = 2;  // q8 state
// 1 Mi elements (4 MiB) per HDF5 chunk and per checksum.
inline constexpr std::uint64_t kDefaultCheckpointChunkNumel = 1ull << 20;
// Bounds of what a checkpoint may say, checked on save and on every read (a file is hostile
// input): steps up to 2^53 - 1 (exact in the JSON metrics), chunks up to 64 Mi elements (one
// 256 MiB buffer), up to 2^24 ranks, `latest` up to 4 KiB.
inline constexpr std::int64_t kMaxCheckpointStep = (std::int64_t{1} << 53) - 1;
inline constexpr std::uint64_t kMaxCheckpointChunkNumel = 1ull << 26;
inline constexpr std::int64_t kMaxCheckpointWorldSize = std::int64_t{1} << 24;
inline constexpr std::uint64_t kMaxLatestBytes = 4096;
// The largest q8 block scale of exp_avg (its largest |element|) a writer can produce. Every
// gradient g that reached a committed q8 state left exp_avg_sq finite (a q8 step refuses
// non-finite moments): (1 - beta2) * g^2 <= FLT_MAX with 1 - beta2 >= 2^-53 (beta2 < 1 in
// double), so |g| < 2^91; exp_avg, a running weighted mean of the gradients (weights summing to
// at most 1), is bounded alike. 2^92 leaves a factor 2 for rounding. exp_avg_sq scales are
// bounded by finiteness only.
inline constexpr float kMaxQ8ExpAvgScale = 0x1p92f;

// "step-<N>.h5".
std::string CheckpointFileName(std::int64_t step);
// N when `name` is exactly CheckpointFileName(N) + `suffix` with 0 <= N <= kMaxCheckpointStep
// (canonical decimal: no sign, no leading zero); nullopt for anything else
// ("step-99999999999999999999.h5", "step-007.h5", "step-1.h5.bak").
std::optional<std::int64_t> ParseCheckpointFileName(std::string_view name,
                                                    std::string_view suffix = {});

struct CheckpointSaveOptions {
  std::string dir;    // shared by all ranks; created (with parents) by rank 0 if missing
  int keep_last = 0;  // > 0: keep only the newest keep_last complete checkpoints; 0: keep all
  std::uint64_t chunk_numel = kDefaultCheckpointChunkNumel;  // HDF5 chunk and checksum unit
  // JSON attributes. Rank 0's values are written (broadcast), so they need not match elsewhere.
  nlohmann::json optimizer;  // {"type", "params"}; null: derived from the swapper's AdamOptions
  nlohmann::json config;     // the effective config; null: {}
  nlohmann::json trainer;    // the caller's state; null: {}
  bool progress = true;      // rank 0: live line on a TTY, periodic INFO lines otherwise
  double progress_interval_s = 10;  // period of the INFO lines when stderr is not a TTY
};

struct SavedCheckpoint {
  std::string path;                  // the committed <dir>/step-<N>.h5
  std::uint64_t state_bytes = 0;     // bytes of state written (fp32: 12 per element, q8: 6)
  double seconds = 0;                // wall time of the whole save, commit included
  std::vector<std::string> removed;  // stale .partial files and checkpoints deleted by keep_last
};

// Collective over swapper.comm(). Saves the committed state of every sub-group as checkpoint
// `step` (>= 0) in options.dir with the commit protocol above. Precondition: no Step in progress
// (the swapper holds no pool buffers). Returns the same Status on every rank. Errors:
// InvalidArgument (empty dir, step < 0, chunk_numel 0 or above kMaxCheckpointChunkNumel, a JSON
// value that is not an object), ResourceExhausted (no pool buffer), the swap store's and HDF5's
// errors (DataLoss, ...), and file-system errors of the commit (rename, fsync). On error nothing
// is committed: `latest` and every older checkpoint are untouched, and rank 0 removes the partial
// file; only a failed durability point after `latest` was replaced (its directory's fsync)
// leaves `latest` naming the new, complete checkpoint while the save reports the error.
Result<SavedCheckpoint> SaveCheckpoint(swapper::OptimizerSwapper& swapper, std::int64_t step,
                                       const CheckpointSaveOptions& options);

// Local. An upper estimate of the size of the file SaveCheckpoint writes with `options`: the free
// space it requires in options.dir (ResourceExhausted otherwise, before anything is written) and
// reserves for the file (fallocate) before the ranks write it.
std::uint64_t EstimateCheckpointBytes(const swapper::OptimizerSwapper& swapper,
                                      const CheckpointSaveOptions& options);

struct CheckpointInfo;

struct CheckpointRestoreOptions {
  // true: first read and verify every chunk this rank needs, agree, and only then write the
  // swapper's store (two reads of the file): a corrupted file leaves the store untouched.
  // false: one pass; a checksum or I/O error part-way leaves some sub-groups restored.
  bool verify_before_write = true;
  bool check_optimizer = true;  // the file's optimizer type must match swapper AdamOptions.adamw
  bool progress = true;
  double progress_interval_s = 10;
  // Local, on every rank: a further check of the file's metadata (ZeroEngine: the trainer state,
  // engine/trainer_state.h), called once the structure, the layout and the optimizer passed and
  // before the q8 tables and the state are read. Its error fails the restore on every rank
  // before anything is written. Empty: none.
  std::function<Status(const CheckpointInfo&)> check_info;
};

struct RestoredCheckpoint {
  std::string path;  // the file read
  std::int64_t step = 0;
  int world_size = 0;  // ranks that saved it
  nlohmann::json optimizer, config, trainer;
  double seconds = 0;
};

// Collective over swapper.comm(). Restores the checkpoint `path` (a checkpoint file, or a
// directory whose `latest` names one, or that `latest` file) into `swapper`, whatever world size it
// was saved on: each rank reads the flat ranges its own plan owns, verifying the checksum of every
// chunk it reads (whole chunks), and writes each sub-group's state with WriteState (last_step = the
// file's step; padding 0). State formats: a q8 file into a q8 swapper whose sub-group's blocks are
// the file's blocks (same world size and sub_group_size) is copied exactly (WriteQ8State: the
// resumed run is bitwise the uninterrupted one); other q8 sub-groups are decoded and quantized
// again in the new blocks (each element within one quantization step of its decoded value, q8.h);
// a q8 file into an fp32 swapper is decoded, an fp32 file into a q8 swapper is quantized. Every
// rank reads through its own read-only (serial) HDF5 handle. Returns the same Status on every rank.
// Errors, all before the store is written (see verify_before_write):
//   NotFound: no file, no `latest` in the directory, or `latest` names a missing file;
//   DataLoss: not an HDF5 file or truncated, a missing attribute or dataset or one of the wrong
//             size/type ("missing dataset /state/exp_avg"), a checksum mismatch naming the
//             dataset, chunk and element range, a q8 table out of range (a scale below 0, an
//             exp_avg scale above kMaxQ8ExpAvgScale or a non-finite exp_avg_sq scale, ...);
//   FailedPrecondition: format is not "zinf", an unsupported format_version, a layout that
//             differs from the swapper's (first mismatch named, dtype ignored), an optimizer type
//             that differs (check_optimizer);
//   options.check_info's errors; the swap store's errors from WriteState.
Result<RestoredCheckpoint> RestoreCheckpoint(swapper::OptimizerSwapper& swapper,
                                             const std::string& path,
                                             const CheckpointRestoreOptions& options = {});

// ---- Serial inspection (no MPI needed; used by zinf-ckpt and tests) ----

// `path` itself if it is a file other than `latest`; for a directory, or its `latest` file,
// <dir>/<contents of <dir>/latest>.
// Errors: NotFound (no such path, no `latest`), DataLoss (empty `latest`).
Result<std::string> ResolveCheckpointPath(const std::string& path);

struct CheckpointInfo {
  std::string path;
  std::int64_t format_version = 0;
  std::int64_t step = 0;
  std::int64_t world_size = 0;
  std::uint64_t total_numel = 0;
  std::int64_t sub_group_size = 0;
  std::uint64_t chunk_numel = 0;
  std::uint64_t num_chunks = 0;  // per state dataset
  swapper::StateFormat state_format = swapper::StateFormat::kFp32;
  std::uint64_t num_segments = 0;  // q8: entries of /q8/segment_*
  std::uint64_t num_blocks = 0;    // q8: entries of /q8/*_scales
  std::string created;
  std::string checksum_algorithm;
  nlohmann::json optimizer, config, trainer;
  std::optional<partition::ParamLayout> layout;  // always set on success
  std::uint64_t file_size_bytes = 0;
};

// Opens `path` (a file; see ResolveCheckpointPath) read-only and validates its structure:
// attributes, layout, datasets and their sizes and types. Reads no state data. Errors as
// RestoreCheckpoint's (NotFound, DataLoss, FailedPrecondition for format/format_version).
Result<CheckpointInfo> ReadCheckpointInfo(const std::string& path);

// Called with (bytes done, bytes total) while verifying or exporting.
using CheckpointProgressFn = std::function<void(std::uint64_t done, std::uint64_t total)>;

// Reads every chunk of every state dataset and recomputes its checksum, and checks a q8 file's
// tables as RestoreCheckpoint does. OK if all pass; otherwise the first bad chunk: DataLoss
// "checksum mismatch in dataset /state/exp_avg chunk 3 elements [3145728, 4194304): ..." (or
// the structural errors of ReadCheckpointInfo, or a q8 table's). The trainer state is the
// engine's: `zinf-ckpt verify` runs engine::VerifyResumable, this and the engine's check of it.
Status VerifyCheckpoint(const std::string& path, const CheckpointProgressFn& progress = {});

enum class ExportFormat { kHdf5, kSafetensors };

// Writes the consolidated fp32 master weights (/state/fp32), one tensor per parameter with its
// shape, to `out_path`, streaming chunk by chunk (checksums verified);
// with `moments` also Adam's moments as fp32 (a q8 file's decoded), as tensors named
// "exp_avg/<name>" and "exp_avg_sq/<name>" after the weights:
//   kHdf5:        one 1-D float32 dataset per parameter, named by the parameter name (a '/' in
//                 the name makes groups), with a string attribute `shape` ("[4, 8]"); root
//                 attributes step and source.
//   kSafetensors: the safetensors format (8-byte little-endian header size, JSON header with
//                 dtype "F32", shape and data_offsets per tensor, padded with spaces to a
//                 multiple of 8, then the raw little-endian data in layout order).
// The output is a storage::AtomicFile: written under a temporary name, renamed to `out_path`
// when complete. `out_path` may be missing, or an existing regular file when `overwrite` is
// kRegularFile (replaced whole; a failed export leaves it as it was); a symbolic link,
// directory, device, FIFO or socket is never replaced nor opened, nor is the checkpoint itself,
// its `latest` or a step-<N>.h5 name of its directory.
// Errors: those of ReadCheckpointInfo and VerifyCheckpoint (DataLoss on a bad chunk);
// AlreadyExists (`out_path` exists, kNo), FailedPrecondition (`out_path` is not a regular
// file), InvalidArgument (it is the checkpoint or a name of its directory); I/O errors writing
// out_path.
Status ExportCheckpoint(const std::string& path, const std::string& out_path, ExportFormat format,
                        const CheckpointProgressFn& progress = {}, bool moments = false,
                        storage::Overwrite overwrite = storage::Overwrite::kNo);

// Reads any range of a checkpoint's state serially (no MPI): the fp32 master weights and Adam's
// moments as fp32, a q8 file's moments decoded (map[code] * scale of the element's block, as
// ExportCheckpoint does). Every chunk a read touches is verified against its checksum before
// any element of it is handed out (whole chunks are read; the last chunk of each state is kept,
// so consecutive small reads inside one chunk read it once). A q8 file's tables are read and
// checked by Open. Memory: about one chunk (chunk_numel floats) per state read, plus a q8
// file's tables.
//
//   ZINF_ASSIGN_OR_RETURN(CheckpointStateReader reader, CheckpointStateReader::Open(path));
//   std::vector<float> w(p.numel);
//   ZINF_RETURN_IF_ERROR(reader.Read(swapper::StateTensor::kFp32, p.flat_offset, w));
//
// Thread safety: one thread at a time (HDF5 is used from the calling thread). Move-only.
class CheckpointStateReader {
 public:
  // Opens `path` (as ResolveCheckpointPath takes it) read-only. Errors: those of
  // ReadCheckpointInfo, and DataLoss for a q8 file's bad tables (as VerifyCheckpoint).
  static Result<CheckpointStateReader> Open(const std::string& path);

  CheckpointStateReader(CheckpointStateReader&&) noexcept;
  CheckpointStateReader& operator=(CheckpointStateReader&&) noexcept;
  ~CheckpointStateReader();

  const CheckpointInfo& info() const;
  // Flat elements [flat_offset, flat_offset + out.size()) of `state` into `out`. Errors:
  // InvalidArgument for a range past info().total_numel (nothing read); DataLoss for a checksum
  // mismatch (naming the dataset, chunk and element range) or a read error (`out` is then
  // partly written).
  Status Read(swapper::StateTensor state, std::uint64_t flat_offset, std::span<float> out);
  // Closes the file (also done by the destructor, which cannot report an error).
  Status Close();

 private:
  struct Impl;
  explicit CheckpointStateReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes a checkpoint file serially (no MPI, no swapper) in the format above, fp32 state
// (format_version 1): what an importer (zinf-ckpt import-deepspeed) makes from another
// framework's state. The file restores and verifies like one SaveCheckpoint wrote.
//
//   CheckpointWriterOptions o{.step = 7, .world_size = 2, .sub_group_size = 1 << 24, ...};
//   ZINF_ASSIGN_OR_RETURN(CheckpointWriter w, CheckpointWriter::Create(out, layout, o));
//   for (each state, in flat order) ZINF_RETURN_IF_ERROR(w.Append(state, values));
//   ZINF_RETURN_IF_ERROR(w.Commit());
//
// The output is a storage::AtomicFile (written under a temporary name beside `out_path`, renamed
// to it by Commit): until Commit succeeds nothing is at `out_path` (an existing file there, with
// Overwrite::kRegularFile, stays as it was), and a writer destroyed without Commit removes its
// temporary. Memory: one chunk (chunk_numel floats) per state.
//
// Thread safety: one thread at a time (HDF5 is used from the calling thread). Move-only.
struct CheckpointWriterOptions {
  std::int64_t step = 0;        // in [0, kMaxCheckpointStep]
  std::int64_t world_size = 1;  // the ranks it was saved on, in [1, kMaxCheckpointWorldSize]
  std::int64_t sub_group_size = 1 << 24;  // the saving run's, >= 1 (recorded; see Restore)
  std::uint64_t chunk_numel = kDefaultCheckpointChunkNumel;
  nlohmann::json optimizer;  // {"type": "Adam" | "AdamW", "params": {...}} (required)
  nlohmann::json config;     // the effective config (an object; null: {})
  nlohmann::json trainer;    // the trainer state (engine/trainer_state.h; null: {})
};

class CheckpointWriter {
 public:
  // Creates the temporary and writes the file's structure (attributes, layout, datasets).
  // Errors: InvalidArgument (an option out of range, optimizer without a "type" of Adam or
  // AdamW, a JSON value that is not an object, a layout with no elements); those of
  // storage::AtomicFile::Create (AlreadyExists, FailedPrecondition for what is at out_path);
  // ResourceExhausted (too little space for the file, before anything is written); HDF5's.
  static Result<CheckpointWriter> Create(const std::string& out_path,
                                         const partition::ParamLayout& layout,
                                         const CheckpointWriterOptions& options,
                                         storage::Overwrite overwrite = storage::Overwrite::kNo);

  CheckpointWriter(CheckpointWriter&&) noexcept;
  CheckpointWriter& operator=(CheckpointWriter&&) noexcept;
  ~CheckpointWriter();

  const std::string& temp_path() const;
  // The next values.size() elements of `state`: each state is written from flat element 0 to
  // the layout's total_numel, in order, in pieces of any size; the values are taken as they are
  // (the caller checks them). Errors: InvalidArgument (past total_numel: nothing taken), HDF5's.
  Status Append(swapper::StateTensor state, std::span<const float> values);
  // Every state complete: writes the checksums, closes, syncs the file, runs `check` on the
  // complete temporary (its path; e.g. engine::VerifyResumable) and renames it to out_path.
  // Errors: FailedPrecondition (a state not complete, Commit called twice), check's, HDF5's and
  // the file system's; on any error nothing is at out_path.
  Status Commit(const std::function<Status(const std::string& temp_path)>& check = {});

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf::checkpoint
