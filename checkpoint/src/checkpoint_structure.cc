// The structure of a checkpoint file (checkpoint.h): what SaveCheckpoint's rank 0 and the serial
// CheckpointWriter write before any element.
#include <algorithm>
#include <array>
#include <ctime>
#include <span>
#include <string>
#include <vector>

#include "checkpoint_internal.h"
#include "zinf/storage/checksum.h"

namespace zinf::checkpoint::internal {
namespace {

using h5::H5DataType;
using h5::H5File;

// The root attributes: format and version, step, sizes, and the JSON and text of `header`.
Status WriteRootAttributes(H5File& file, std::uint64_t total, const FileHeader& header) {
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "format", kCheckpointFormat));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute(
      "/", "format_version",
      header.format == StateFormat::kQ8 ? kCheckpointFormatVersionQ8 : kCheckpointFormatVersion));
  if (header.format == StateFormat::kQ8) {
    ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "optimizer_state", "q8"));
  }
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "step", header.step));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "world_size", header.world_size));
  ZINF_RETURN_IF_ERROR(
      file.WriteInt64Attribute("/", "total_numel", static_cast<std::int64_t>(total)));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "sub_group_size", header.sub_group_size));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "chunk_numel",
                                                static_cast<std::int64_t>(header.chunk_numel)));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "optimizer", header.optimizer));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/", "config", header.config));
  return file.WriteStringAttribute("/", "created", header.created);
}

// /layout: the layout's JSON, and each parameter's flat offset and numel as datasets.
Status WriteLayout(H5File& file, const partition::ParamLayout& layout) {
  ZINF_RETURN_IF_ERROR(file.CreateGroup("/layout"));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/layout", "json", layout.ToJsonString()));
  const std::uint64_t num_params = layout.num_params();
  std::vector<std::uint64_t> offsets, numels;
  for (const partition::ParamInfo& p : layout.params()) {
    offsets.push_back(p.flat_offset);
    numels.push_back(p.numel);
  }
  const std::uint64_t param_chunk = std::min<std::uint64_t>(num_params, 1 << 16);
  ZINF_RETURN_IF_ERROR(
      file.CreateDataset1D("/layout/flat_offset", num_params, param_chunk, H5DataType::kUInt64));
  ZINF_RETURN_IF_ERROR(
      file.CreateDataset1D("/layout/numel", num_params, param_chunk, H5DataType::kUInt64));
  ZINF_RETURN_IF_ERROR(
      file.WriteSlab("/layout/flat_offset", 0, std::span<const std::uint64_t>(offsets)));
  return file.WriteSlab("/layout/numel", 0, std::span<const std::uint64_t>(numels));
}

// The q8 group. The block table and scales are written by the ranks; the maps (and their
// checksums, entries 0 and 1 of /checksum/q8) here.
Status WriteQ8Structure(H5File& file, std::uint64_t num_segments, std::uint64_t num_blocks) {
  ZINF_RETURN_IF_ERROR(file.CreateGroup(kQ8Group));
  ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute(kQ8Group, "block_numel", q8::kBlockNumel));
  const std::uint64_t sizes[] = {256,          256,        num_segments, num_segments,
                                 num_segments, num_blocks, num_blocks};
  const H5DataType types[] = {H5DataType::kFloat32, H5DataType::kFloat32, H5DataType::kUInt64,
                              H5DataType::kUInt64,  H5DataType::kUInt64,  H5DataType::kFloat32,
                              H5DataType::kFloat32};
  for (std::size_t d = 0; d < kQ8Datasets.size(); ++d) {
    ZINF_RETURN_IF_ERROR(file.CreateDataset1D(
        kQ8Datasets[d], sizes[d], std::min<std::uint64_t>(sizes[d], 1 << 20), types[d]));
  }
  ZINF_RETURN_IF_ERROR(file.CreateDataset1D(kQ8Checksums, kQ8Datasets.size(), kQ8Datasets.size(),
                                            H5DataType::kUInt64));
  std::array<std::uint64_t, 2> map_sums{};
  for (std::size_t m = 0; m < 2; ++m) {
    const std::array<float, 256>& map =
        q8::MapValues(m == 0 ? q8::MapKind::kSigned : q8::MapKind::kUnsigned);
    ZINF_RETURN_IF_ERROR(file.WriteSlab(kQ8Datasets[m], 0, std::span<const float>(map)));
    map_sums[m] = storage::Checksum64(std::as_bytes(std::span(map)));
  }
  return file.WriteSlab(kQ8Checksums, 0, std::span<const std::uint64_t>(map_sums));
}

}  // namespace

std::string DumpJson(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

Status WriteStructure(H5File& file, const partition::ParamLayout& layout,
                      const FileHeader& header) {
  const std::uint64_t total = layout.total_numel();
  const std::uint64_t chunk = header.chunk_numel;
  const std::uint64_t num_chunks = NumChunks(total, chunk);
  ZINF_RETURN_IF_ERROR(WriteRootAttributes(file, total, header));
  ZINF_RETURN_IF_ERROR(WriteLayout(file, layout));
  ZINF_RETURN_IF_ERROR(file.CreateGroup("/trainer"));
  ZINF_RETURN_IF_ERROR(file.WriteStringAttribute("/trainer", "state", header.trainer));
  for (const StateDatasetSpec& spec : StateDatasets(header.format)) {
    ZINF_RETURN_IF_ERROR(file.CreateDataset1D(spec.name, total, std::min(chunk, total), spec.type));
    ZINF_RETURN_IF_ERROR(file.CreateDataset1D(spec.checksum, num_chunks,
                                              std::min<std::uint64_t>(num_chunks, 1 << 16),
                                              H5DataType::kUInt64));
  }
  if (header.format == StateFormat::kQ8) {
    ZINF_RETURN_IF_ERROR(WriteQ8Structure(file, header.num_segments, header.num_blocks));
  }
  ZINF_RETURN_IF_ERROR(
      file.WriteStringAttribute("/checksum", "algorithm", storage::kChecksumAlgorithm));
  return file.WriteInt64Attribute("/checksum", "chunk_numel", static_cast<std::int64_t>(chunk));
}

std::uint64_t EstimateFileBytes(const partition::ParamLayout& layout, const FileHeader& header) {
  const std::uint64_t total = layout.total_numel();
  const std::uint64_t chunks = NumChunks(total, header.chunk_numel);
  const std::uint64_t json = header.optimizer.size() + header.config.size() +
                             header.trainer.size() + layout.ToJsonString().size();
  std::uint64_t state = 0;
  for (const StateDatasetSpec& spec : StateDatasets(header.format)) {
    state += spec.element_bytes * total;
  }
  const std::uint64_t q8_tables = 24 * header.num_segments + 8 * header.num_blocks + (64ull << 10);
  return state + kNumStateTensors * chunks * (8 + 512) + 16 * layout.num_params() + 2 * json +
         (header.format == StateFormat::kQ8 ? q8_tables : 0) + (1ull << 20);
}

}  // namespace zinf::checkpoint::internal
