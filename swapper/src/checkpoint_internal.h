// Pieces shared by the collective checkpoint code (checkpoint.cc) and the serial readers
// (checkpoint_read.cc): dataset names, header validation, verified chunk reads, progress lines.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/hdf5.h"
#include "zinf/swapper/checkpoint.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper::checkpoint_internal {

inline constexpr std::array<StateTensor, kNumStateTensors> kStates = {
    StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq};

std::string StateDataset(StateTensor which);     // "/state/fp32"
std::string ChecksumDataset(StateTensor which);  // "/checksum/fp32"

inline std::uint64_t NumChunks(std::uint64_t total_numel, std::uint64_t chunk_numel) {
  return (total_numel + chunk_numel - 1) / chunk_numel;
}

// Validates the structure of an open checkpoint (see checkpoint.h for the errors) and reads its
// metadata. Local: `file` may be serial or collective (then every rank must call it).
Result<CheckpointInfo> ReadInfo(storage::H5File& file, const std::string& path);

// The checksum table of one state dataset (info.num_chunks entries).
Result<std::vector<std::uint64_t>> ReadChecksums(storage::H5File& file, StateTensor which,
                                                 std::uint64_t num_chunks);

// Reads whole chunks of one state dataset from a serial file and verifies each against its
// checksum before handing out any element of it. Keeps the last chunk read (one chunk_numel
// buffer), so consecutive ranges inside one chunk read it once.
class VerifiedChunkReader {
 public:
  VerifiedChunkReader(storage::H5File* file, StateTensor which, std::uint64_t total_numel,
                      std::uint64_t chunk_numel, std::vector<std::uint64_t> checksums);

  // Chunk k, verified. The span lives until the next call.
  Result<std::span<const float>> Chunk(std::uint64_t k);
  // Copies flat elements [flat_offset, flat_offset + out.size()) into `out`, each chunk verified
  // first; whole chunks inside `out` are read and verified in place (on error `out` is garbage).
  Status Read(std::uint64_t flat_offset, std::span<float> out);
  // Verifies every chunk that overlaps [flat_offset, flat_offset + numel).
  Status Verify(std::uint64_t flat_offset, std::uint64_t numel);

 private:
  storage::H5File* file_;
  StateTensor which_;
  std::string dataset_;
  std::uint64_t total_numel_;
  std::uint64_t chunk_numel_;
  std::vector<std::uint64_t> checksums_;
  std::vector<float> buffer_;
  std::uint64_t cached_ = UINT64_MAX;
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

}  // namespace zinf::swapper::checkpoint_internal
