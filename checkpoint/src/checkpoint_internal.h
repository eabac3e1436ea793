// Pieces shared by the collective checkpoint code (checkpoint.cc) and the serial readers
// (checkpoint_read.cc): dataset names, header validation, verified chunk reads, progress lines.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/status.h"
#include "zinf/h5/h5_file.h"
#include "zinf/partition/layout.h"
#include "zinf/swapper/optimizer_swapper.h"
#include "zinf/swapper/q8.h"

namespace zinf::checkpoint {
// The swapper's types the checkpoint code reads and writes.
using swapper::AdamOptions;
using swapper::kNumStateTensors;
using swapper::OptimizerSwapper;
using swapper::PoolLease;
using swapper::Q8Moment;
using swapper::Q8Moments;
using swapper::ResolveAdamWMode;
using swapper::StateFormat;
using swapper::StateTensor;
namespace q8 = swapper::q8;
}  // namespace zinf::checkpoint

namespace zinf::checkpoint::internal {

inline constexpr std::array<StateTensor, kNumStateTensors> kStates = {
    StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq};

// The three state datasets of a checkpoint, in the order of kStates (fp32 weights, exp_avg,
// exp_avg_sq), by the file's state format (checkpoint.h):
//   fp32: /state/fp32, /state/exp_avg, /state/exp_avg_sq, float32;
//   q8:   /state/fp32 (float32), /state/exp_avg_codes, /state/exp_avg_sq_codes (uint8).
// Each has its per-chunk checksum table /checksum/<same name>.
struct StateDatasetSpec {
  std::string name;
  std::string checksum;
  h5::H5DataType type;
  std::uint64_t element_bytes;
};
const std::array<StateDatasetSpec, kNumStateTensors>& StateDatasets(StateFormat format);

// q8 files: the maps, the segment table and the scales, with one XXH3-64 each in kQ8Checksums
// (in this order; checkpoint.h).
inline constexpr std::string_view kQ8Group = "/q8";
enum Q8Dataset : std::size_t {
  kMapSigned,
  kMapUnsigned,
  kSegmentStart,
  kSegmentNumel,
  kSegmentBlock,
  kExpAvgScales,
  kExpAvgSqScales
};
inline constexpr std::array<std::string_view, 7> kQ8Datasets = {
    "/q8/map_signed",    "/q8/map_unsigned",   "/q8/segment_start",    "/q8/segment_numel",
    "/q8/segment_block", "/q8/exp_avg_scales", "/q8/exp_avg_sq_scales"};
inline constexpr std::string_view kQ8Checksums = "/checksum/q8";

inline std::uint64_t NumChunks(std::uint64_t total_numel, std::uint64_t chunk_numel) {
  return (total_numel + chunk_numel - 1) / chunk_numel;
}

// What a checkpoint file's structure records (checkpoint.h): its format, root attributes and
// JSON attributes (as text), and the sizes of a q8 file's tables.
struct FileHeader {
  StateFormat format = StateFormat::kFp32;
  std::int64_t step = 0;
  std::int64_t world_size = 0;
  std::int64_t sub_group_size = 0;
  std::uint64_t chunk_numel = 0;
  std::uint64_t num_segments = 0;  // q8
  std::uint64_t num_blocks = 0;    // q8
  std::string optimizer, config, trainer, created;
};

// Compact JSON; invalid UTF-8 replaced rather than thrown on.
std::string DumpJson(const nlohmann::json& j);
// The current time as ISO-8601 UTC ("2026-12-06T19:30:00Z").
std::string UtcNow();

// Writes the whole structure of a checkpoint of `layout` into the new, empty `file`: root
// attributes, /layout, /trainer, every state and checksum dataset with its space allocated, the
// q8 maps (the other q8 tables and every element are written later). Serial.
Status WriteStructure(h5::H5File& file, const partition::ParamLayout& layout,
                      const FileHeader& header);

// An upper estimate of the size of that file once written: the state, the checksum tables, the
// layout, the JSON attributes, and generous room for HDF5's object headers and chunk indexes.
std::uint64_t EstimateFileBytes(const partition::ParamLayout& layout, const FileHeader& header);

// Validates the structure of an open checkpoint (see checkpoint.h for the errors) and reads its
// metadata. Local: `file` may be serial or collective (then every rank must call it).
Result<CheckpointInfo> ReadInfo(h5::H5File& file, const std::string& path);

// The checksum table `dataset` (num_chunks entries).
Result<std::vector<std::uint64_t>> ReadChecksums(h5::H5File& file, const std::string& dataset,
                                                 std::uint64_t num_chunks);

// Reads whole chunks of one state dataset (elements of type T: float or std::uint8_t) from a
// serial file and verifies each against its checksum before handing out any element of it.
// Keeps the last chunk read (one chunk_numel buffer), so consecutive ranges inside one chunk
// read it once.
template <typename T>
class VerifiedChunkReader {
 public:
  VerifiedChunkReader(h5::H5File* file, std::string dataset, std::uint64_t total_numel,
                      std::uint64_t chunk_numel, std::vector<std::uint64_t> checksums);

  // Chunk k, verified. The span lives until the next call.
  Result<std::span<const T>> Chunk(std::uint64_t k);
  // Copies flat elements [flat_offset, flat_offset + out.size()) into `out`, each chunk verified
  // first; whole chunks inside `out` are read and verified in place (on error `out` is garbage).
  Status Read(std::uint64_t flat_offset, std::span<T> out);
  // Verifies every chunk that overlaps [flat_offset, flat_offset + numel).
  Status Verify(std::uint64_t flat_offset, std::uint64_t numel);
  // Read and Verify refuse a range outside the dataset (InvalidArgument) before any chunk.

 private:
  Status CheckRange(std::uint64_t flat_offset, std::uint64_t numel) const;

  h5::H5File* file_;
  std::string dataset_;
  std::uint64_t total_numel_;
  std::uint64_t chunk_numel_;
  std::vector<std::uint64_t> checksums_;
  std::vector<T> buffer_;
  std::uint64_t cached_ = UINT64_MAX;
};
extern template class VerifiedChunkReader<float>;
extern template class VerifiedChunkReader<std::uint8_t>;

// One flat range of a q8 file's block (checkpoint.h).
struct Q8Segment {
  std::uint64_t start = 0;
  std::uint64_t numel = 0;
  std::uint64_t block = 0;
};

// A q8 file's tables: its segments sorted by start (they tile [0, total_numel)), the number of
// segments of each block, the scales of each block per moment, and the maps.
struct Q8Tables {
  std::vector<Q8Segment> segments;
  std::vector<std::uint32_t> block_segments;
  std::array<std::vector<float>, 2> scales;    // exp_avg, exp_avg_sq
  std::array<std::array<float, 256>, 2> maps;  // signed (exp_avg), unsigned (exp_avg_sq)

  // The index into `segments` of the segment holding flat element `flat` (< total_numel).
  std::size_t SegmentOf(std::uint64_t flat) const;
};
// Reads and verifies (checksums; segments tiling [0, total_numel), blocks of at most
// q8::kBlockNumel elements; scales in [0, kMaxQ8ExpAvgScale] for exp_avg, finite and >= 0 for
// exp_avg_sq; maps ascending in [-1, 1]) a q8 file's tables: verify, restore and export alike.
Result<Q8Tables> ReadQ8Tables(h5::H5File& file, const CheckpointInfo& info);

// The fp32 values of one state (index into kStates) of a checkpoint whatever its format: q8
// moments are decoded (map[code] * scale of the element's block). Verified as it reads.
class StateReader {
 public:
  // `tables`: a q8 file's tables (outliving the reader); nullptr for fp32 files.
  static Result<StateReader> Open(h5::H5File* file, const CheckpointInfo& info, std::size_t index,
                                  const Q8Tables* tables);
  Status Read(std::uint64_t flat_offset, std::span<float> out);
  Status Verify(std::uint64_t flat_offset, std::uint64_t numel);
  // q8 moments only: the codes as stored.
  Status ReadCodes(std::uint64_t flat_offset, std::span<std::uint8_t> out);
  std::uint64_t element_bytes() const { return codes_ ? 1 : sizeof(float); }

 private:
  std::optional<VerifiedChunkReader<float>> values_;
  std::optional<VerifiedChunkReader<std::uint8_t>> codes_;
  const Q8Tables* tables_ = nullptr;
  std::size_t moment_ = 0;  // 0: exp_avg, 1: exp_avg_sq
  std::vector<std::uint8_t> scratch_;
};

// Bytes done / total, GB/s and ETA: a live '\r' line on stderr when it is a TTY, an INFO line
// every interval_s otherwise. Silent when disabled.
class ProgressReporter {
 public:
  ProgressReporter(std::string label, std::uint64_t total_bytes, bool enabled, double interval_s);
  void Update(std::uint64_t done_bytes);
  // The final line ("<label>: 4.0 GiB in 2.1 s, 2.0 GB/s").
  void Finish();

 private:
  std::string Line(std::uint64_t done_bytes) const;

  std::string label_;
  std::uint64_t total_bytes_;
  bool enabled_;
  bool tty_;
  double interval_s_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace zinf::checkpoint::internal
