// Serial side of checkpoints: header validation, verified chunk reads, verify and export (used by
// zinf-ckpt and by every rank of a restore through its own read-only handle).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint_internal.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/core/check.h"
#include "zinf/core/json.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/h5/h5_file.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"

namespace zinf::checkpoint {
namespace internal {
namespace {

using h5::H5DataType;
using h5::H5File;

// A missing piece of the structure is DataLoss: the file is not a complete checkpoint.
Error Missing(std::string what, const Error& cause) {
  return DataLossError(
      fmt::format("checkpoint is incomplete: missing {} ({})", what, cause.message()));
}

// A missing attribute means an incomplete checkpoint, one of another type, rank or size a bad
// one: DataLoss either way, whatever code the attribute reader used.
Error AttrError(std::string_view object, std::string_view name, const Error& cause) {
  if (cause.code() == ErrorCode::kNotFound) {
    return Missing(fmt::format("attribute '{}' of {}", name, object), cause);
  }
  return DataLossError(fmt::format("attribute '{}': {}", name, cause.message()));
}

Result<std::int64_t> IntAttr(H5File& file, std::string_view object, std::string_view name) {
  Result<std::int64_t> v = file.ReadInt64Attribute(object, name);
  if (!v) return AttrError(object, name, v.error());
  return v;
}

Result<std::string> StringAttr(H5File& file, std::string_view object, std::string_view name) {
  Result<std::string> v = file.ReadStringAttribute(object, name);
  if (!v) return AttrError(object, name, v.error());
  return v;
}

// A JSON object attribute (parsed within ParseJson's default bounds: 64 MiB, 64 levels).
Result<nlohmann::json> JsonAttr(H5File& file, std::string_view object, std::string_view name) {
  ZINF_ASSIGN_OR_RETURN(std::string text, StringAttr(file, object, name));
  Result<nlohmann::json> json = ParseJson(text);
  if (!json) {
    return DataLossError(fmt::format("attribute '{}' of {} is not valid JSON: {}", name, object,
                                     json.error().message()));
  }
  if (!json->is_object()) {
    return DataLossError(fmt::format("attribute '{}' of {} is not a JSON object", name, object));
  }
  return json;
}

// An integer attribute within [min, max].
Result<std::int64_t> IntAttrIn(H5File& file, std::string_view name, std::int64_t min,
                               std::int64_t max, const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(const std::int64_t value, IntAttr(file, "/", name));
  if (value < min || value > max) {
    return DataLossError(
        fmt::format("{}: attribute '{}' is {}, outside [{}, {}]", path, name, value, min, max));
  }
  return value;
}

// A dataset of exactly `numel` elements of `type`, every element stored in the file (no missing
// chunk, which would read back as a fill value and make verify and export loop over data that
// is not there), chunked by at most `max_chunk_numel` (when chunked) and no larger than the file.
Status CheckDataset(H5File& file, const std::string& name, std::uint64_t numel, H5DataType type,
                    std::uint64_t max_chunk_numel, std::uint64_t file_size) {
  Result<bool> has = file.HasDataset(name);
  if (!has) return std::move(has).error();
  if (!*has) {
    return DataLossError(fmt::format("checkpoint is incomplete: missing dataset {}", name));
  }
  Result<H5File::DatasetStorage> storage_of = file.DatasetStorageOf(name);
  if (!storage_of) {
    // A dataset of another rank or element type than any zinf writes: a bad checkpoint.
    if (storage_of.error().code() != ErrorCode::kInvalidArgument) {
      return std::move(storage_of).error();
    }
    return DataLossError(storage_of.error().message());
  }
  const H5File::DatasetStorage& ds = *storage_of;
  if (ds.numel != numel || ds.type != type) {
    return DataLossError(fmt::format("dataset {} has {} elements of {}, expected {} of {}", name,
                                     ds.numel, h5::H5DataTypeName(ds.type), numel,
                                     h5::H5DataTypeName(type)));
  }
  if (ds.chunk_numel > max_chunk_numel) {
    return DataLossError(fmt::format("dataset {} is chunked by {} elements, more than {}", name,
                                     ds.chunk_numel, max_chunk_numel));
  }
  std::uint64_t bytes = 0;
  if (!CheckedMul(numel, h5::H5DataTypeBytes(type), &bytes)) {
    return DataLossError(
        fmt::format("dataset {} of {} elements is larger than 2^64 bytes", name, numel));
  }
  if (ds.allocated_bytes < bytes) {
    return DataLossError(
        fmt::format("dataset {} stores {} bytes for {} elements ({} bytes): chunks are missing",
                    name, ds.allocated_bytes, numel, bytes));
  }
  if (file_size != 0 && ds.allocated_bytes > file_size) {
    return DataLossError(fmt::format("dataset {} claims {} bytes of storage in a file of {} bytes",
                                     name, ds.allocated_bytes, file_size));
  }
  return OkStatus();
}

}  // namespace

const std::array<StateDatasetSpec, kNumStateTensors>& StateDatasets(StateFormat format) {
  auto spec = [](std::string_view name, H5DataType type) {
    return StateDatasetSpec{.name = fmt::format("/state/{}", name),
                            .checksum = fmt::format("/checksum/{}", name),
                            .type = type,
                            .element_bytes = h5::H5DataTypeBytes(type)};
  };
  static const std::array<StateDatasetSpec, kNumStateTensors> fp32 = {
      spec("fp32", H5DataType::kFloat32), spec("exp_avg", H5DataType::kFloat32),
      spec("exp_avg_sq", H5DataType::kFloat32)};
  static const std::array<StateDatasetSpec, kNumStateTensors> q8 = {
      spec("fp32", H5DataType::kFloat32), spec("exp_avg_codes", H5DataType::kUInt8),
      spec("exp_avg_sq_codes", H5DataType::kUInt8)};
  return format == StateFormat::kQ8 ? q8 : fp32;
}

namespace {

// ReadInfo's parts: the root attributes (format, version, sizes, optimizer, config), the
// layout (JSON and datasets, which must agree) and the state, checksum and q8 datasets (present,
// of the sizes and types the root attributes imply).
Status ReadRootAttributes(H5File& file, const std::string& path, CheckpointInfo* info) {
  ZINF_ASSIGN_OR_RETURN(std::string format, StringAttr(file, "/", "format"));
  if (format != kCheckpointFormat) {
    return FailedPreconditionError(fmt::format("{} is not a zinf checkpoint (format '{}')", path,
                                               EscapeForTerminal(format.substr(0, 64))));
  }
  ZINF_ASSIGN_OR_RETURN(info->format_version, IntAttr(file, "/", "format_version"));
  if (info->format_version != kCheckpointFormatVersion &&
      info->format_version != kCheckpointFormatVersionQ8) {
    return FailedPreconditionError(fmt::format(
        "{}: unsupported format_version {} (this build reads format_version {} and {})", path,
        info->format_version, kCheckpointFormatVersion, kCheckpointFormatVersionQ8));
  }
  if (info->format_version == kCheckpointFormatVersionQ8) {
    ZINF_ASSIGN_OR_RETURN(std::string state, StringAttr(file, "/", "optimizer_state"));
    if (state != "q8") {
      return DataLossError(fmt::format("{}: format_version {} with optimizer_state '{}', not 'q8'",
                                       path, info->format_version,
                                       EscapeForTerminal(state.substr(0, 64))));
    }
    info->state_format = StateFormat::kQ8;
  }
  // Every number is range-checked before it sizes a buffer, a loop or a resumed step counter.
  ZINF_ASSIGN_OR_RETURN(info->step, IntAttrIn(file, "step", 0, kMaxCheckpointStep, path));
  ZINF_ASSIGN_OR_RETURN(info->world_size,
                        IntAttrIn(file, "world_size", 1, kMaxCheckpointWorldSize, path));
  ZINF_ASSIGN_OR_RETURN(const std::int64_t total,
                        IntAttrIn(file, "total_numel", 1,
                                  static_cast<std::int64_t>(partition::kMaxLayoutNumel), path));
  ZINF_ASSIGN_OR_RETURN(info->sub_group_size,
                        IntAttrIn(file, "sub_group_size", 1,
                                  static_cast<std::int64_t>(partition::kMaxLayoutNumel), path));
  ZINF_ASSIGN_OR_RETURN(
      const std::int64_t chunk,
      IntAttrIn(file, "chunk_numel", 1, static_cast<std::int64_t>(kMaxCheckpointChunkNumel), path));
  info->total_numel = static_cast<std::uint64_t>(total);
  info->chunk_numel = static_cast<std::uint64_t>(chunk);
  info->num_chunks = NumChunks(info->total_numel, info->chunk_numel);
  ZINF_ASSIGN_OR_RETURN(info->created, StringAttr(file, "/", "created"));
  if (info->created.size() > 64) info->created = info->created.substr(0, 64) + "...";
  ZINF_ASSIGN_OR_RETURN(info->optimizer, JsonAttr(file, "/", "optimizer"));
  if (!info->optimizer.contains("type") || !info->optimizer["type"].is_string()) {
    return DataLossError(fmt::format("{}: attribute 'optimizer' has no string 'type'", path));
  }
  if (Result<bool> adamw =
          ResolveAdamWMode(info->optimizer["type"].get<std::string>(), std::nullopt);
      !adamw) {
    return FailedPreconditionError(
        fmt::format("{}: optimizer: {}", path, EscapeForTerminal(adamw.error().message())));
  }
  ZINF_ASSIGN_OR_RETURN(info->config, JsonAttr(file, "/", "config"));
  return OkStatus();
}

Status ReadLayout(H5File& file, const std::string& path, CheckpointInfo* info) {
  ZINF_ASSIGN_OR_RETURN(std::string layout_text, StringAttr(file, "/layout", "json"));
  Result<partition::ParamLayout> layout = partition::ParamLayout::FromJsonString(layout_text);
  if (!layout) {
    return DataLossError(fmt::format("{}: unreadable /layout: {}", path, layout.error().message()));
  }
  if (layout->total_numel() != info->total_numel) {
    return DataLossError(fmt::format("{}: /layout holds {} elements, total_numel says {}", path,
                                     layout->total_numel(), info->total_numel));
  }
  // The per-parameter datasets must say what the JSON layout says.
  const std::uint64_t num_params = layout->num_params();
  for (const char* name : {"/layout/flat_offset", "/layout/numel"}) {
    ZINF_RETURN_IF_ERROR(CheckDataset(file, name, num_params, H5DataType::kUInt64,
                                      kMaxCheckpointChunkNumel, info->file_size_bytes));
  }
  std::vector<std::uint64_t> offsets(num_params), numels(num_params);
  ZINF_RETURN_IF_ERROR(file.ReadSlab("/layout/flat_offset", 0, std::span(offsets)));
  ZINF_RETURN_IF_ERROR(file.ReadSlab("/layout/numel", 0, std::span(numels)));
  for (std::uint64_t i = 0; i < num_params; ++i) {
    const partition::ParamInfo& p = layout->params()[i];
    if (offsets[i] != p.flat_offset || numels[i] != p.numel) {
      return DataLossError(fmt::format(
          "{}: /layout/flat_offset and /layout/numel disagree with the layout JSON at parameter "
          "{} ({}: offset {} numel {}, the JSON: offset {} numel {})",
          path, i, EscapeForTerminal(p.name), offsets[i], numels[i], p.flat_offset, p.numel));
    }
  }
  info->layout = std::move(*layout);
  return OkStatus();
}

Status CheckStateDatasets(H5File& file, const std::string& path, CheckpointInfo* info) {
  for (const StateDatasetSpec& spec : StateDatasets(info->state_format)) {
    ZINF_RETURN_IF_ERROR(CheckDataset(file, spec.name, info->total_numel, spec.type,
                                      kMaxCheckpointChunkNumel, info->file_size_bytes));
    ZINF_RETURN_IF_ERROR(CheckDataset(file, spec.checksum, info->num_chunks, H5DataType::kUInt64,
                                      kMaxCheckpointChunkNumel, info->file_size_bytes));
  }
  if (info->state_format == StateFormat::kQ8) {
    // At least one block per kBlockNumel elements, at most one segment per element and at
    // least one per block.
    for (Q8Dataset d : {kSegmentStart, kExpAvgScales}) {
      Result<bool> has = file.HasDataset(kQ8Datasets[d]);
      if (!has) return std::move(has).error();
      if (!*has) {
        return DataLossError(
            fmt::format("checkpoint is incomplete: missing dataset {}", kQ8Datasets[d]));
      }
    }
    ZINF_ASSIGN_OR_RETURN(info->num_segments, file.DatasetNumel(kQ8Datasets[kSegmentStart]));
    ZINF_ASSIGN_OR_RETURN(info->num_blocks, file.DatasetNumel(kQ8Datasets[kExpAvgScales]));
    if (info->num_blocks < q8::NumBlocks(info->total_numel) ||
        info->num_segments < info->num_blocks || info->num_segments > info->total_numel) {
      return DataLossError(fmt::format("{}: {} segments in {} blocks for {} elements", path,
                                       info->num_segments, info->num_blocks, info->total_numel));
    }
    const std::uint64_t s = info->num_segments;
    const std::uint64_t b = info->num_blocks;
    const std::uint64_t sizes[] = {256, 256, s, s, s, b, b};
    const H5DataType types[] = {H5DataType::kFloat32, H5DataType::kFloat32, H5DataType::kUInt64,
                                H5DataType::kUInt64,  H5DataType::kUInt64,  H5DataType::kFloat32,
                                H5DataType::kFloat32};
    for (std::size_t d = 0; d < kQ8Datasets.size(); ++d) {
      ZINF_RETURN_IF_ERROR(CheckDataset(file, std::string(kQ8Datasets[d]), sizes[d], types[d],
                                        kMaxCheckpointChunkNumel, info->file_size_bytes));
    }
    ZINF_RETURN_IF_ERROR(CheckDataset(file, std::string(kQ8Checksums), kQ8Datasets.size(),
                                      H5DataType::kUInt64, kMaxCheckpointChunkNumel,
                                      info->file_size_bytes));
  }
  return OkStatus();
}

}  // namespace

Result<CheckpointInfo> ReadInfo(H5File& file, const std::string& path) {
  CheckpointInfo info;
  info.path = path;
  struct stat st {};
  info.file_size_bytes = storage::Env::Default().StatAt(AT_FDCWD, path.c_str(), &st, 0) == 0
                             ? static_cast<std::uint64_t>(st.st_size)
                             : 0;
  ZINF_RETURN_IF_ERROR(ReadRootAttributes(file, path, &info));
  ZINF_RETURN_IF_ERROR(ReadLayout(file, path, &info));
  ZINF_RETURN_IF_ERROR(CheckStateDatasets(file, path, &info));
  ZINF_ASSIGN_OR_RETURN(info.checksum_algorithm, StringAttr(file, "/checksum", "algorithm"));
  if (info.checksum_algorithm != storage::kChecksumAlgorithm) {
    return FailedPreconditionError(fmt::format(
        "{}: checksum algorithm '{}' (this build: '{}')", path,
        EscapeForTerminal(info.checksum_algorithm.substr(0, 64)), storage::kChecksumAlgorithm));
  }
  ZINF_ASSIGN_OR_RETURN(info.trainer, JsonAttr(file, "/trainer", "state"));
  return info;
}

Result<std::vector<std::uint64_t>> ReadChecksums(H5File& file, const std::string& dataset,
                                                 std::uint64_t num_chunks) {
  std::vector<std::uint64_t> sums(num_chunks);
  ZINF_RETURN_IF_ERROR(
      Annotate(file.ReadSlab(dataset, 0, std::span(sums)), "reading " + dataset + ": "));
  return sums;
}

template <typename T>
VerifiedChunkReader<T>::VerifiedChunkReader(H5File* file, std::string dataset,
                                            std::uint64_t total_numel, std::uint64_t chunk_numel,
                                            std::vector<std::uint64_t> checksums)
    : file_(file),
      dataset_(std::move(dataset)),
      total_numel_(total_numel),
      chunk_numel_(chunk_numel),
      checksums_(std::move(checksums)),
      buffer_(std::min(chunk_numel, total_numel)) {}

template <typename T>
Status VerifiedChunkReader<T>::CheckRange(std::uint64_t flat_offset, std::uint64_t numel) const {
  if (flat_offset > total_numel_ || numel > total_numel_ - flat_offset) {
    return InvalidArgumentError(fmt::format("{}: elements [{}, +{}) lie outside its {}", dataset_,
                                            flat_offset, numel, total_numel_));
  }
  return OkStatus();
}

template <typename T>
Result<std::span<const T>> VerifiedChunkReader<T>::Chunk(std::uint64_t k) {
  const std::uint64_t begin = k * chunk_numel_;
  const std::uint64_t end = std::min(begin + chunk_numel_, total_numel_);
  std::span<T> data(buffer_.data(), end - begin);
  if (cached_ == k) return std::span<const T>(data);
  cached_ = UINT64_MAX;
  ZINF_RETURN_IF_ERROR(
      Annotate(file_->ReadSlab(dataset_, begin, data),
               fmt::format("reading {} chunk {} elements [{}, {}): ", dataset_, k, begin, end)));
  ZINF_RETURN_IF_ERROR(storage::VerifyChecksum(
      std::as_bytes(data), checksums_.at(k),
      fmt::format("dataset {} chunk {} elements [{}, {})", dataset_, k, begin, end)));
  cached_ = k;
  return std::span<const T>(data);
}

template <typename T>
Status VerifiedChunkReader<T>::Read(std::uint64_t flat_offset, std::span<T> out) {
  ZINF_RETURN_IF_ERROR(CheckRange(flat_offset, out.size()));
  while (!out.empty()) {
    const std::uint64_t k = flat_offset / chunk_numel_;
    const std::uint64_t begin = k * chunk_numel_;
    const std::uint64_t end = std::min(begin + chunk_numel_, total_numel_);
    if (flat_offset == begin && out.size() >= end - begin && cached_ != k) {
      // A whole chunk: read and verify it in place, saving the copy through buffer_. On a
      // mismatch `out` holds unverified data, but the error tells the caller not to use it.
      std::span<T> data = out.first(end - begin);
      ZINF_RETURN_IF_ERROR(Annotate(
          file_->ReadSlab(dataset_, begin, data),
          fmt::format("reading {} chunk {} elements [{}, {}): ", dataset_, k, begin, end)));
      ZINF_RETURN_IF_ERROR(storage::VerifyChecksum(
          std::as_bytes(data), checksums_.at(k),
          fmt::format("dataset {} chunk {} elements [{}, {})", dataset_, k, begin, end)));
      out = out.subspan(data.size());
      flat_offset = end;
      continue;
    }
    ZINF_ASSIGN_OR_RETURN(std::span<const T> chunk, Chunk(k));
    const std::uint64_t in_chunk = flat_offset - k * chunk_numel_;
    const std::uint64_t n = std::min<std::uint64_t>(out.size(), chunk.size() - in_chunk);
    std::memcpy(out.data(), chunk.data() + in_chunk, n * sizeof(T));
    out = out.subspan(n);
    flat_offset += n;
  }
  return OkStatus();
}

template <typename T>
Status VerifiedChunkReader<T>::Verify(std::uint64_t flat_offset, std::uint64_t numel) {
  ZINF_RETURN_IF_ERROR(CheckRange(flat_offset, numel));
  if (numel == 0) return OkStatus();
  const std::uint64_t first = flat_offset / chunk_numel_;
  const std::uint64_t last = (flat_offset + numel - 1) / chunk_numel_;
  for (std::uint64_t k = first; k <= last; ++k) {
    ZINF_RETURN_IF_ERROR(Chunk(k));
  }
  return OkStatus();
}

template class VerifiedChunkReader<float>;
template class VerifiedChunkReader<std::uint8_t>;

std::size_t Q8Tables::SegmentOf(std::uint64_t flat) const {
  const auto it =
      std::upper_bound(segments.begin(), segments.end(), flat,
                       [](std::uint64_t f, const Q8Segment& seg) { return f < seg.start; });
  return static_cast<std::size_t>(it - segments.begin()) - 1;  // segments[0].start == 0
}

namespace {

// Reads q8 dataset `d` whole into `out` and verifies it against its entry in `sums` (those of
// kQ8Checksums).
Status ReadQ8Dataset(H5File& file, const std::vector<std::uint64_t>& sums, Q8Dataset d, auto out) {
  ZINF_RETURN_IF_ERROR(
      Annotate(file.ReadSlab(kQ8Datasets[d], 0, out), fmt::format("reading {}: ", kQ8Datasets[d])));
  return storage::VerifyChecksum(std::as_bytes(out), sums[d],
                                 fmt::format("dataset {}", kQ8Datasets[d]));
}

// The signed and the unsigned map, each ascending in [-1, 1].
Status ReadQ8Maps(H5File& file, const std::vector<std::uint64_t>& sums, const CheckpointInfo& info,
                  std::array<std::array<float, 256>, 2>& maps) {
  for (Q8Dataset d : {kMapSigned, kMapUnsigned}) {
    std::array<float, 256>& map = maps[d == kMapSigned ? 0 : 1];
    ZINF_RETURN_IF_ERROR(ReadQ8Dataset(file, sums, d, std::span(map)));
    for (std::size_t c = 0; c < 256; ++c) {
      if (!(map[c] >= -1.0f && map[c] <= 1.0f) || (c > 0 && !(map[c] > map[c - 1]))) {
        return DataLossError(fmt::format("{}: {} is not ascending in [-1, 1] at code {}", info.path,
                                         kQ8Datasets[d], c));
      }
    }
  }
  return OkStatus();
}

// The segment table into t.segments (sorted by start) and t.block_segments: each segment inside
// the flat vector and the blocks, each block holding 1 to q8::kBlockNumel elements.
Status ReadQ8Segments(H5File& file, const std::vector<std::uint64_t>& sums,
                      const CheckpointInfo& info, Q8Tables& t) {
  const std::uint64_t n = info.num_segments;
  std::vector<std::uint64_t> start(n), numel(n), block(n);
  ZINF_RETURN_IF_ERROR(ReadQ8Dataset(file, sums, kSegmentStart, std::span(start)));
  ZINF_RETURN_IF_ERROR(ReadQ8Dataset(file, sums, kSegmentNumel, std::span(numel)));
  ZINF_RETURN_IF_ERROR(ReadQ8Dataset(file, sums, kSegmentBlock, std::span(block)));
  t.segments.resize(n);
  t.block_segments.assign(info.num_blocks, 0);
  std::vector<std::uint64_t> block_numel(info.num_blocks, 0);
  for (std::uint64_t j = 0; j < n; ++j) {
    if (block[j] >= info.num_blocks || numel[j] == 0 || numel[j] > q8::kBlockNumel ||
        start[j] >= info.total_numel || numel[j] > info.total_numel - start[j]) {
      return DataLossError(fmt::format(
          "{}: q8 segment {} (start {}, {} elements, block {}) is outside {} elements or {} "
          "blocks",
          info.path, j, start[j], numel[j], block[j], info.total_numel, info.num_blocks));
    }
    block_numel[block[j]] += numel[j];
    ++t.block_segments[block[j]];
    t.segments[j] = Q8Segment{start[j], numel[j], block[j]};
  }
  for (std::uint64_t k = 0; k < info.num_blocks; ++k) {
    if (block_numel[k] == 0 || block_numel[k] > q8::kBlockNumel) {
      return DataLossError(fmt::format("{}: q8 block {} holds {} elements (1 to {} allowed)",
                                       info.path, k, block_numel[k], q8::kBlockNumel));
    }
  }
  std::sort(t.segments.begin(), t.segments.end(),
            [](const Q8Segment& a, const Q8Segment& b) { return a.start < b.start; });
  return OkStatus();
}

// The `segments` (sorted by start) tile [0, total_numel): no gap, no overlap.
Status CheckQ8Tiling(const std::vector<Q8Segment>& segments, const CheckpointInfo& info) {
  std::uint64_t next = 0;
  for (const Q8Segment& seg : segments) {
    if (seg.start != next) {
      return DataLossError(fmt::format(
          "{}: the q8 segments do not tile the flat vector: element {} is {}", info.path,
          std::min(seg.start, next), seg.start > next ? "in no segment" : "in two segments"));
    }
    next = seg.start + seg.numel;
  }
  if (next != info.total_numel) {
    return DataLossError(fmt::format("{}: the q8 segments end at element {} of {}", info.path, next,
                                     info.total_numel));
  }
  return OkStatus();
}

// Each block's scales: exp_avg's in [0, kMaxQ8ExpAvgScale], exp_avg_sq's finite and >= 0.
Status ReadQ8Scales(H5File& file, const std::vector<std::uint64_t>& sums,
                    const CheckpointInfo& info, std::array<std::vector<float>, 2>& scales) {
  for (std::size_t m = 0; m < 2; ++m) {
    const Q8Dataset d = m == 0 ? kExpAvgScales : kExpAvgSqScales;
    scales[m].resize(info.num_blocks);
    ZINF_RETURN_IF_ERROR(ReadQ8Dataset(file, sums, d, std::span(scales[m])));
    const float max = m == 0 ? kMaxQ8ExpAvgScale : std::numeric_limits<float>::max();
    for (std::uint64_t k = 0; k < info.num_blocks; ++k) {
      if (!(scales[m][k] >= 0.0f && scales[m][k] <= max)) {
        return DataLossError(fmt::format("{}: {} block {} has scale {}, outside [0, {}]", info.path,
                                         kQ8Datasets[d], k, scales[m][k], max));
      }
    }
  }
  return OkStatus();
}

}  // namespace

Result<Q8Tables> ReadQ8Tables(H5File& file, const CheckpointInfo& info) {
  Q8Tables t;
  std::vector<std::uint64_t> sums(kQ8Datasets.size());
  ZINF_RETURN_IF_ERROR(Annotate(file.ReadSlab(kQ8Checksums, 0, std::span(sums)),
                                fmt::format("reading {}: ", kQ8Checksums)));
  ZINF_RETURN_IF_ERROR(ReadQ8Maps(file, sums, info, t.maps));
  ZINF_RETURN_IF_ERROR(ReadQ8Segments(file, sums, info, t));
  ZINF_RETURN_IF_ERROR(CheckQ8Tiling(t.segments, info));
  ZINF_RETURN_IF_ERROR(ReadQ8Scales(file, sums, info, t.scales));
  return t;
}

Result<StateReader> StateReader::Open(H5File* file, const CheckpointInfo& info, std::size_t index,
                                      const Q8Tables* tables) {
  const StateDatasetSpec& spec = StateDatasets(info.state_format).at(index);
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> sums,
                        ReadChecksums(*file, spec.checksum, info.num_chunks));
  StateReader reader;
  if (spec.type == H5DataType::kUInt8) {
    ZINF_CHECK(tables != nullptr, "q8 state reader without tables");
    reader.codes_.emplace(file, spec.name, info.total_numel, info.chunk_numel, std::move(sums));
    reader.tables_ = tables;
    reader.moment_ = index - 1;
  } else {
    reader.values_.emplace(file, spec.name, info.total_numel, info.chunk_numel, std::move(sums));
  }
  return reader;
}

Status StateReader::Read(std::uint64_t flat_offset, std::span<float> out) {
  if (values_) return values_->Read(flat_offset, out);
  // Decode in pieces through the scratch buffer (at most 1 Mi codes at a time).
  constexpr std::uint64_t kPiece = 1u << 20;
  const std::array<float, 256>& map = tables_->maps[moment_];
  const std::vector<float>& scales = tables_->scales[moment_];
  while (!out.empty()) {
    const std::uint64_t n = std::min<std::uint64_t>(out.size(), kPiece);
    scratch_.resize(n);
    ZINF_RETURN_IF_ERROR(codes_->Read(flat_offset, std::span(scratch_)));
    std::size_t seg = tables_->SegmentOf(flat_offset);
    for (std::uint64_t i = 0; i < n; ++i) {
      const Q8Segment* s = &tables_->segments[seg];
      if (flat_offset + i >= s->start + s->numel) s = &tables_->segments[++seg];
      out[i] = map[scratch_[i]] * scales[s->block];
    }
    out = out.subspan(n);
    flat_offset += n;
  }
  return OkStatus();
}

Status StateReader::Verify(std::uint64_t flat_offset, std::uint64_t numel) {
  return values_ ? values_->Verify(flat_offset, numel) : codes_->Verify(flat_offset, numel);
}

Status StateReader::ReadCodes(std::uint64_t flat_offset, std::span<std::uint8_t> out) {
  ZINF_CHECK(codes_.has_value(), "ReadCodes on an fp32 state");
  return codes_->Read(flat_offset, out);
}

ProgressReporter::ProgressReporter(std::string label, std::uint64_t total_bytes, bool enabled,
                                   double interval_s)
    : label_(std::move(label)),
      total_bytes_(total_bytes),
      enabled_(enabled),
      tty_(enabled && isatty(STDERR_FILENO) == 1),
      interval_s_(interval_s),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

std::string ProgressReporter::Line(std::uint64_t done_bytes) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done_bytes) / elapsed : 0.0;
  const double eta =
      rate > 0 ? static_cast<double>(total_bytes_ - std::min(done_bytes, total_bytes_)) / rate
               : 0.0;
  const double percent =
      total_bytes_ > 0 ? 100.0 * static_cast<double>(done_bytes) / static_cast<double>(total_bytes_)
                       : 100.0;
  return fmt::format("{}: {} / {} ({:.0f}%), {:.2f} GB/s, ETA {:.0f} s", label_,
                     FormatBytes(done_bytes), FormatBytes(total_bytes_), percent, rate / 1e9, eta);
}

void ProgressReporter::Update(std::uint64_t done_bytes) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_).count();
  if (tty_) {
    if (since < 0.2) return;
    last_ = now;
    std::fprintf(stderr, "\r%s\033[K", Line(done_bytes).c_str());
    std::fflush(stderr);
  } else if (since >= interval_s_) {
    last_ = now;
    ZINF_LOG_INFO("{}", Line(done_bytes));
  }
}

void ProgressReporter::Finish() {
  if (!enabled_) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const std::string line =
      fmt::format("{}: {} in {:.2f} s, {:.2f} GB/s", label_, FormatBytes(total_bytes_), elapsed,
                  elapsed > 0 ? static_cast<double>(total_bytes_) / elapsed / 1e9 : 0.0);
  if (tty_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
  }
  ZINF_LOG_INFO("{}", line);
}

}  // namespace internal

using internal::kStates;
using internal::ReadChecksums;
using internal::StateDatasets;
using internal::StateDatasetSpec;
using internal::StateReader;
using internal::VerifiedChunkReader;

std::string CheckpointFileName(std::int64_t step) { return fmt::format("step-{}.h5", step); }

std::optional<std::int64_t> ParseCheckpointFileName(std::string_view name,
                                                    std::string_view suffix) {
  constexpr std::string_view kPrefix = "step-";
  constexpr std::string_view kExtension = ".h5";
  if (name.size() < kPrefix.size() + kExtension.size() + suffix.size() ||
      !name.starts_with(kPrefix) || !name.ends_with(suffix)) {
    return std::nullopt;
  }
  name.remove_suffix(suffix.size());
  if (!name.ends_with(kExtension)) return std::nullopt;
  const std::string_view digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kExtension.size());
  if (digits.empty() || digits.size() > 16 || (digits.size() > 1 && digits[0] == '0')) {
    return std::nullopt;
  }
  std::int64_t step = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || end != digits.data() + digits.size() || step < 0 ||
      step > kMaxCheckpointStep) {
    return std::nullopt;
  }
  return step;
}

Result<std::string> ResolveCheckpointPath(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("empty checkpoint path");
  struct stat st {};
  if (storage::Env::Default().StatAt(AT_FDCWD, path.c_str(), &st, 0) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return NotFoundError(fmt::format("no checkpoint at {}", path));
    }
    return ErrnoError(errno, fmt::format("checkpoint {}", path));
  }
  if (S_ISREG(st.st_mode)) {
    // <dir>/latest itself stands for the checkpoint it names, as the directory does.
    const std::filesystem::path file(path);
    if (file.filename() != "latest") return path;
    return ResolveCheckpointPath(file.has_parent_path() ? file.parent_path().string() : ".");
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPreconditionError(
        fmt::format("checkpoint {} is not a regular file or a directory", path));
  }
  // A directory: `latest` must be a small regular file (not a link) naming a step-<N>.h5
  // regular file (not a link) in the same directory.
  ZINF_ASSIGN_OR_RETURN(storage::UniqueFd dir, storage::OpenDirectory(path, storage::Follow::kYes));
  const std::string latest = path + "/latest";
  Result<std::string> text =
      storage::ReadSmallFileAt(dir.get(), "latest", latest, kMaxLatestBytes, storage::Follow::kNo);
  if (!text) {
    if (text.error().code() == ErrorCode::kNotFound) {
      return NotFoundError(fmt::format("checkpoint directory {} has no 'latest'", path));
    }
    // Larger than any name it could hold: a damaged pointer, not a bad argument.
    if (text.error().code() == ErrorCode::kInvalidArgument) {
      return DataLossError(text.error().message());
    }
    return std::move(text).error();
  }
  std::string name = std::move(*text);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) {
    name.pop_back();
  }
  if (name.empty()) return DataLossError(fmt::format("{} is empty", latest));
  if (!ParseCheckpointFileName(name)) {
    return DataLossError(fmt::format("{} names '{}', not a step-<N>.h5 file of this directory",
                                     latest, EscapeForTerminal(name.substr(0, 80))));
  }
  const std::string file = path + "/" + name;
  if (storage::Env::Default().StatAt(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) {
      return NotFoundError(fmt::format("{} names {}, which does not exist", latest, file));
    }
    return ErrnoError(errno, fmt::format("{} names {}", latest, file));
  }
  if (!S_ISREG(st.st_mode)) {
    return FailedPreconditionError(
        fmt::format("{} names {}, which is {}; a checkpoint is a regular file", latest, file,
                    S_ISLNK(st.st_mode) ? "a symbolic link" : "not a regular file"));
  }
  return file;
}

Result<CheckpointInfo> ReadCheckpointInfo(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_ASSIGN_OR_RETURN(h5::H5File file, h5::H5File::OpenSerial(file_path, /*read_only=*/true));
  Result<CheckpointInfo> info = internal::ReadInfo(file, file_path);
  Status closed = file.Close();
  if (!info) return info;
  ZINF_RETURN_IF_ERROR(closed);
  return info;
}

Status VerifyCheckpoint(const std::string& path, const CheckpointProgressFn& progress) {
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_ASSIGN_OR_RETURN(h5::H5File file, h5::H5File::OpenSerial(file_path, /*read_only=*/true));
  ZINF_ASSIGN_OR_RETURN(CheckpointInfo info, internal::ReadInfo(file, file_path));
  std::uint64_t total_bytes = 0;
  for (const StateDatasetSpec& spec : StateDatasets(info.state_format)) {
    total_bytes += info.total_numel * spec.element_bytes;
  }
  std::uint64_t done = 0;
  if (info.state_format == StateFormat::kQ8) {
    ZINF_RETURN_IF_ERROR(internal::ReadQ8Tables(file, info));
  }
  for (const StateDatasetSpec& spec : StateDatasets(info.state_format)) {
    ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> sums,
                          ReadChecksums(file, spec.checksum, info.num_chunks));
    auto verify_all = [&](auto reader) -> Status {
      for (std::uint64_t k = 0; k < info.num_chunks; ++k) {
        ZINF_ASSIGN_OR_RETURN(auto chunk, reader.Chunk(k));
        done += chunk.size_bytes();
        if (progress) progress(done, total_bytes);
      }
      return OkStatus();
    };
    if (spec.type == h5::H5DataType::kUInt8) {
      ZINF_RETURN_IF_ERROR(verify_all(VerifiedChunkReader<std::uint8_t>(
          &file, spec.name, info.total_numel, info.chunk_numel, std::move(sums))));
    } else {
      ZINF_RETURN_IF_ERROR(verify_all(VerifiedChunkReader<float>(
          &file, spec.name, info.total_numel, info.chunk_numel, std::move(sums))));
    }
  }
  return file.Close();
}

namespace {

// An export must never replace what it reads: not the checkpoint file itself (under any name
// that resolves to it), not `latest`, and no name the commit protocol uses in the checkpoint's
// directory (step-<N>.h5, its .partial, latest.tmp), where a later save or retention would
// take it for a checkpoint.
Status CheckExportTarget(const std::string& input, const std::string& out_path) {
  ZINF_ASSIGN_OR_RETURN(const storage::DirAndName out, storage::SplitPath(out_path));
  ZINF_ASSIGN_OR_RETURN(const storage::DirAndName in, storage::SplitPath(input));
  auto refuse = [&](std::string_view why) {
    return InvalidArgumentError(
        fmt::format("export: refusing to write {}: {}; choose another output", out_path, why));
  };
  struct stat out_st {
  }, in_st{};
  storage::Env& env = storage::Env::Default();
  if (env.StatAt(AT_FDCWD, out_path.c_str(), &out_st, 0) == 0 &&
      env.StatAt(AT_FDCWD, input.c_str(), &in_st, 0) == 0 && out_st.st_dev == in_st.st_dev &&
      out_st.st_ino == in_st.st_ino) {
    return refuse("it is the checkpoint being read");
  }
  // The same directory is the same inode, whatever the paths say (links, "..", bind mounts).
  struct stat out_dir_st {
  }, in_dir_st{};
  if (env.StatAt(AT_FDCWD, out.dir.c_str(), &out_dir_st, 0) != 0) {
    return ErrnoError(errno, fmt::format("export: output directory {}", out.dir));
  }
  if (env.StatAt(AT_FDCWD, in.dir.c_str(), &in_dir_st, 0) != 0) {
    return ErrnoError(errno, fmt::format("export: checkpoint directory {}", in.dir));
  }
  if (out_dir_st.st_dev != in_dir_st.st_dev || out_dir_st.st_ino != in_dir_st.st_ino) {
    return OkStatus();
  }
  if (out.name == "latest" || out.name == "latest.tmp") {
    return refuse("it is the checkpoint directory's `latest` pointer");
  }
  if (out.name.starts_with("step-") && out.name.find(".h5") != std::string::npos) {
    return refuse("step-<N>.h5 names in a checkpoint directory belong to its checkpoints");
  }
  return OkStatus();
}

}  // namespace

namespace {

// What an export writes and how it reads it: the weights, then (with `moments`) exp_avg and
// exp_avg_sq, each as one tensor per parameter named "<state>/<parameter>", streamed from the
// checkpoint piece by piece (at most a chunk of floats in memory).
struct ExportPlan {
  const CheckpointInfo& info;
  std::string source;  // the checkpoint file, recorded in the output
  std::size_t num_states = 1;
  std::uint64_t piece_numel = 0;
  std::function<std::string(std::size_t t, const partition::ParamInfo& p)> name;
  // Streams state t of parameter p into sink(offset in the parameter, values).
  std::function<Status(std::size_t t, const partition::ParamInfo& p,
                       const std::function<Status(std::uint64_t, std::span<const float>)>& sink)>
      stream;
};

// One 1-D float32 dataset per tensor with a `shape` attribute; root attributes source and step.
// `estimate` bytes are allocated up front.
Status WriteHdf5Export(const ExportPlan& plan, storage::AtomicFile& out, std::uint64_t estimate) {
  ZINF_ASSIGN_OR_RETURN(h5::H5File h5,
                        h5::H5File::CreateSerial(out.temp_path(), h5::H5CreateMode::kTruncate));
  // Blocks allocated up front, the file grown past what HDF5 will write (it cuts the file back
  // to its own end when it closes).
  if (Status reserved = out.Reserve(estimate, /*keep_size=*/false); !reserved) {
    (void)h5.Close();
    return reserved;
  }
  ZINF_RETURN_IF_ERROR(out.CloseDescriptor());
  ZINF_RETURN_IF_ERROR(h5.WriteStringAttribute("/", "source", plan.source));
  ZINF_RETURN_IF_ERROR(h5.WriteInt64Attribute("/", "step", plan.info.step));
  for (std::size_t t = 0; t < plan.num_states; ++t) {
    for (const partition::ParamInfo& p : plan.info.layout->params()) {
      const std::string name = plan.name(t, p);
      ZINF_RETURN_IF_ERROR(h5.CreateDataset1D(name, p.numel, std::min(p.numel, plan.piece_numel),
                                              h5::H5DataType::kFloat32));
      ZINF_RETURN_IF_ERROR(h5.WriteStringAttribute(name, "shape", partition::FormatShape(p.shape)));
      ZINF_RETURN_IF_ERROR(plan.stream(t, p, [&](std::uint64_t off, std::span<const float> values) {
        return h5.WriteSlab(name, off, values);
      }));
    }
  }
  return h5.Close();
}

// The safetensors layout (checkpoint.h, ExportCheckpoint).
Status WriteSafetensorsExport(const ExportPlan& plan, storage::AtomicFile& out) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {
      {"format", "pt"}, {"source", plan.source}, {"step", std::to_string(plan.info.step)}};
  std::uint64_t offset = 0;
  for (std::size_t t = 0; t < plan.num_states; ++t) {
    for (const partition::ParamInfo& p : plan.info.layout->params()) {
      header[plan.name(t, p)] = {{"dtype", "F32"},
                                 {"shape", p.shape},
                                 {"data_offsets", {offset, offset + p.numel * sizeof(float)}}};
      offset += p.numel * sizeof(float);
    }
  }
  std::string text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t header_size = text.size();
  ZINF_RETURN_IF_ERROR(out.Reserve(8 + header_size + offset, /*keep_size=*/true));
  ZINF_RETURN_IF_ERROR(out.Write(std::as_bytes(std::span(&header_size, 1))));
  ZINF_RETURN_IF_ERROR(out.Write(std::as_bytes(std::span(text.data(), text.size()))));
  for (std::size_t t = 0; t < plan.num_states; ++t) {
    for (const partition::ParamInfo& p : plan.info.layout->params()) {
      ZINF_RETURN_IF_ERROR(plan.stream(t, p, [&](std::uint64_t, std::span<const float> values) {
        return out.Write(std::as_bytes(values));
      }));
    }
  }
  return OkStatus();
}

// The bytes an export of `num_states` tensors per parameter may need, checked against the free
// space of out_path's directory (ResourceExhausted when short).
Result<std::uint64_t> CheckExportSpace(const std::string& out_path, const CheckpointInfo& info,
                                       std::size_t num_states) {
  ZINF_ASSIGN_OR_RETURN(const storage::DirAndName out_parts, storage::SplitPath(out_path));
  const std::uint64_t estimate =
      num_states * (info.total_numel * sizeof(float) + info.layout->num_params() * (8u << 10)) +
      (1u << 20);
  ZINF_ASSIGN_OR_RETURN(const std::uint64_t available, storage::AvailableBytes(out_parts.dir));
  if (available < estimate) {
    return ResourceExhaustedError(fmt::format("export needs about {} in {}, which has {} available",
                                              FormatBytes(estimate), out_parts.dir,
                                              FormatBytes(available)));
  }
  return estimate;
}

}  // namespace

Status ExportCheckpoint(const std::string& path, const std::string& out_path, ExportFormat format,
                        const CheckpointProgressFn& progress, bool moments,
                        storage::Overwrite overwrite) {
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_RETURN_IF_ERROR(CheckExportTarget(file_path, out_path));
  // The output is looked at before anything else is done: what may not be replaced is refused
  // before a byte is written (and looked at again just before the rename).
  ZINF_ASSIGN_OR_RETURN(storage::AtomicFile out,
                        Annotate(storage::AtomicFile::Create(out_path, overwrite), "export: "));
  ZINF_ASSIGN_OR_RETURN(h5::H5File file, h5::H5File::OpenSerial(file_path, /*read_only=*/true));
  ZINF_ASSIGN_OR_RETURN(CheckpointInfo info, internal::ReadInfo(file, file_path));
  std::optional<internal::Q8Tables> tables;
  if (moments && info.state_format == StateFormat::kQ8) {
    ZINF_ASSIGN_OR_RETURN(tables, internal::ReadQ8Tables(file, info));
  }
  const std::size_t num_states = moments ? kNumStateTensors : 1;
  std::vector<StateReader> readers;
  for (std::size_t t = 0; t < num_states; ++t) {
    ZINF_ASSIGN_OR_RETURN(StateReader reader,
                          StateReader::Open(&file, info, t, tables ? &*tables : nullptr));
    readers.push_back(std::move(reader));
  }
  const std::uint64_t total_bytes = num_states * info.total_numel * sizeof(float);
  const std::uint64_t piece_numel = std::min(info.chunk_numel, info.total_numel);
  std::vector<float> piece(piece_numel);
  std::uint64_t done = 0;
  const ExportPlan plan{
      .info = info,
      .source = file_path,
      .num_states = num_states,
      .piece_numel = piece_numel,
      .name =
          [](std::size_t t, const partition::ParamInfo& p) {
            return t == 0 ? p.name : fmt::format("{}/{}", StateTensorName(kStates[t]), p.name);
          },
      .stream =
          [&](std::size_t t, const partition::ParamInfo& p,
              const std::function<Status(std::uint64_t, std::span<const float>)>& sink) -> Status {
        for (std::uint64_t off = 0; off < p.numel; off += piece_numel) {
          const std::uint64_t n = std::min(piece_numel, p.numel - off);
          std::span<float> values(piece.data(), n);
          ZINF_RETURN_IF_ERROR(readers[t].Read(p.flat_offset + off, values));
          ZINF_RETURN_IF_ERROR(sink(off, std::span<const float>(values)));
          done += n * sizeof(float);
          if (progress) progress(done, total_bytes);
        }
        return OkStatus();
      }};

  // The output appears under out_path only when complete: a failed export (a bad chunk, a full
  // disk) leaves the previous output, if any, as it was. Its space is checked and reserved
  // first: HDF5 (1.10) cannot close a file cleanly after a write failed for lack of space.
  ZINF_ASSIGN_OR_RETURN(const std::uint64_t estimate, CheckExportSpace(out_path, info, num_states));
  ZINF_RETURN_IF_ERROR(format == ExportFormat::kHdf5 ? WriteHdf5Export(plan, out, estimate)
                                                     : WriteSafetensorsExport(plan, out));
  ZINF_RETURN_IF_ERROR(file.Close());
  return out.Commit();
}

// ---- CheckpointStateReader: the public face of the verified StateReaders ----

struct CheckpointStateReader::Impl {
  // Heap-held so that the readers' pointers to them stay valid when the reader moves.
  std::unique_ptr<h5::H5File> file;
  CheckpointInfo info;
  std::unique_ptr<internal::Q8Tables> tables;                        // q8 files
  std::array<std::optional<StateReader>, kNumStateTensors> readers;  // opened on first use
  bool closed = false;
};

CheckpointStateReader::CheckpointStateReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointStateReader::CheckpointStateReader(CheckpointStateReader&&) noexcept = default;
CheckpointStateReader& CheckpointStateReader::operator=(CheckpointStateReader&&) noexcept = default;
CheckpointStateReader::~CheckpointStateReader() {
  if (impl_) (void)Close();
}

Result<CheckpointStateReader> CheckpointStateReader::Open(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  auto impl = std::make_unique<Impl>();
  ZINF_ASSIGN_OR_RETURN(h5::H5File file, h5::H5File::OpenSerial(file_path, /*read_only=*/true));
  impl->file = std::make_unique<h5::H5File>(std::move(file));
  ZINF_ASSIGN_OR_RETURN(impl->info, internal::ReadInfo(*impl->file, file_path));
  if (impl->info.state_format == StateFormat::kQ8) {
    ZINF_ASSIGN_OR_RETURN(internal::Q8Tables tables,
                          internal::ReadQ8Tables(*impl->file, impl->info));
    impl->tables = std::make_unique<internal::Q8Tables>(std::move(tables));
  }
  return CheckpointStateReader(std::move(impl));
}

const CheckpointInfo& CheckpointStateReader::info() const { return impl_->info; }

Status CheckpointStateReader::Read(swapper::StateTensor state, std::uint64_t flat_offset,
                                   std::span<float> out) {
  ZINF_CHECK(impl_ != nullptr && !impl_->closed, "CheckpointStateReader::Read after Close");
  const auto it = std::find(kStates.begin(), kStates.end(), state);
  if (it == kStates.end()) {
    return InvalidArgumentError(
        fmt::format("CheckpointStateReader::Read: no state {}", static_cast<int>(state)));
  }
  const std::uint64_t total = impl_->info.total_numel;
  if (flat_offset > total || out.size() > total - flat_offset) {
    return InvalidArgumentError(fmt::format(
        "{}: elements [{}, {} + {}) of {} are past the state's {} elements", impl_->info.path,
        flat_offset, flat_offset, out.size(), StateTensorName(state), total));
  }
  if (out.empty()) return OkStatus();
  const std::size_t index = static_cast<std::size_t>(it - kStates.begin());
  std::optional<StateReader>& reader = impl_->readers[index];
  if (!reader) {
    ZINF_ASSIGN_OR_RETURN(
        reader, StateReader::Open(impl_->file.get(), impl_->info, index, impl_->tables.get()));
  }
  return reader->Read(flat_offset, out);
}

Status CheckpointStateReader::Close() {
  if (!impl_ || impl_->closed) return OkStatus();
  impl_->closed = true;
  for (auto& r : impl_->readers) r.reset();
  return impl_->file->Close();
}

}  // namespace zinf::checkpoint
