// CheckpointWriter (checkpoint.h): a checkpoint file written serially from values handed in flat
// order, in the format SaveCheckpoint writes (fp32 state).
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "checkpoint_internal.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/fs.h"

namespace zinf::checkpoint {

using internal::FileHeader;
using internal::NumChunks;
using internal::StateDatasets;

struct CheckpointWriter::Impl {
  storage::AtomicFile out;
  h5::H5File file;
  std::uint64_t total = 0;
  std::uint64_t chunk = 0;
  // Per state: the elements taken so far, the values of the chunk being filled, and the
  // checksums of the chunks written.
  std::array<std::uint64_t, kNumStateTensors> taken{};
  std::array<std::vector<float>, kNumStateTensors> pending;
  std::array<std::vector<std::uint64_t>, kNumStateTensors> sums;
  bool done = false;

  Impl(storage::AtomicFile o, h5::H5File f) : out(std::move(o)), file(std::move(f)) {}

  // Writes the pending chunk of state `s` and records its checksum.
  Status FlushChunk(std::size_t s) {
    const std::vector<float>& values = pending[s];
    const std::uint64_t first = static_cast<std::uint64_t>(sums[s].size()) * chunk;
    ZINF_RETURN_IF_ERROR(file.WriteSlab(StateDatasets(StateFormat::kFp32)[s].name, first,
                                        std::span<const float>(values)));
    sums[s].push_back(storage::Checksum64(std::as_bytes(std::span(values))));
    pending[s].clear();
    return OkStatus();
  }
};

namespace {

Status CheckWriterOptions(const partition::ParamLayout& layout,
                          const CheckpointWriterOptions& o) {
  auto bad = [](std::string what) {
    return InvalidArgumentError("CheckpointWriter: " + std::move(what));
  };
  if (o.step < 0 || o.step > kMaxCheckpointStep) return bad(fmt::format("step {}", o.step));
  if (o.world_size < 1 || o.world_size > kMaxCheckpointWorldSize) {
    return bad(fmt::format("world_size {}", o.world_size));
  }
  if (o.sub_group_size < 1) return bad(fmt::format("sub_group_size {}", o.sub_group_size));
  if (o.chunk_numel < 1 || o.chunk_numel > kMaxCheckpointChunkNumel) {
    return bad(fmt::format("chunk_numel {}", o.chunk_numel));
  }
  if (layout.total_numel() == 0) return bad("a layout without elements");
  const nlohmann::json& opt = o.optimizer;
  if (!opt.is_object() || !opt.contains("type") || !opt["type"].is_string() ||
      (opt["type"] != "Adam" && opt["type"] != "AdamW")) {
    return bad("optimizer must be an object whose \"type\" is \"Adam\" or \"AdamW\"");
  }
  if (!o.config.is_null() && !o.config.is_object()) return bad("config is not a JSON object");
  if (!o.trainer.is_null() && !o.trainer.is_object()) return bad("trainer is not a JSON object");
  return OkStatus();
}

}  // namespace

Result<CheckpointWriter> CheckpointWriter::Create(const std::string& out_path,
                                                  const partition::ParamLayout& layout,
                                                  const CheckpointWriterOptions& options,
                                                  storage::Overwrite overwrite) {
  ZINF_RETURN_IF_ERROR(CheckWriterOptions(layout, options));
  FileHeader header;
  header.format = StateFormat::kFp32;
  header.step = options.step;
  header.world_size = options.world_size;
  header.sub_group_size = options.sub_group_size;
  header.chunk_numel = options.chunk_numel;
  header.optimizer = internal::DumpJson(options.optimizer);
  header.config = options.config.is_null() ? "{}" : internal::DumpJson(options.config);
  header.trainer = options.trainer.is_null() ? "{}" : internal::DumpJson(options.trainer);
  header.created = internal::UtcNow();

  ZINF_ASSIGN_OR_RETURN(storage::AtomicFile out, storage::AtomicFile::Create(out_path, overwrite));
  // The file's blocks first (ENOSPC now, not half-way), then HDF5 opens the temporary by name.
  ZINF_RETURN_IF_ERROR(
      out.Reserve(internal::EstimateFileBytes(layout, header), /*keep_size=*/false));
  ZINF_ASSIGN_OR_RETURN(h5::H5File file,
                        h5::H5File::CreateSerial(out.temp_path(), h5::H5CreateMode::kTruncate));
  ZINF_RETURN_IF_ERROR(out.CloseDescriptor());
  auto impl = std::make_unique<Impl>(std::move(out), std::move(file));
  impl->total = layout.total_numel();
  impl->chunk = options.chunk_numel;
  ZINF_RETURN_IF_ERROR(internal::WriteStructure(impl->file, layout, header));
  for (std::size_t s = 0; s < kNumStateTensors; ++s) {
    impl->pending[s].reserve(std::min(impl->chunk, impl->total));
    impl->sums[s].reserve(NumChunks(impl->total, impl->chunk));
  }
  return CheckpointWriter(std::move(impl));
}

CheckpointWriter::CheckpointWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointWriter::CheckpointWriter(CheckpointWriter&&) noexcept = default;
CheckpointWriter& CheckpointWriter::operator=(CheckpointWriter&&) noexcept = default;
// Uncommitted: the HDF5 file closes (declared after `out`), then the AtomicFile removes the
// temporary.
CheckpointWriter::~CheckpointWriter() = default;

const std::string& CheckpointWriter::temp_path() const { return impl_->out.temp_path(); }

Status CheckpointWriter::Append(StateTensor state, std::span<const float> values) {
  Impl& m = *impl_;
  const auto s = static_cast<std::size_t>(state);
  if (m.done) return FailedPreconditionError("CheckpointWriter: Append after Commit");
  if (s >= kNumStateTensors || values.size() > m.total - m.taken[s]) {
    return InvalidArgumentError(
        fmt::format("CheckpointWriter: {} elements past the {} of state {} ({} taken)",
                    values.size(), m.total, s, m.taken[s]));
  }
  while (!values.empty()) {
    const std::uint64_t chunk_end =
        std::min(m.total, (m.sums[s].size() + 1) * m.chunk);  // end of the chunk being filled
    const std::uint64_t room = chunk_end - m.taken[s];
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(room, values.size()));
    m.pending[s].insert(m.pending[s].end(), values.begin(), values.begin() + n);
    m.taken[s] += n;
    values = values.subspan(n);
    if (m.taken[s] == chunk_end) ZINF_RETURN_IF_ERROR(m.FlushChunk(s));
  }
  return OkStatus();
}

Status CheckpointWriter::Commit(const std::function<Status(const std::string&)>& check) {
  Impl& m = *impl_;
  if (m.done) return FailedPreconditionError("CheckpointWriter: Commit called twice");
  for (std::size_t s = 0; s < kNumStateTensors; ++s) {
    if (m.taken[s] != m.total) {
      return FailedPreconditionError(
          fmt::format("CheckpointWriter: state {} holds {} of its {} elements",
                      StateDatasets(StateFormat::kFp32)[s].name, m.taken[s], m.total));
    }
  }
  for (std::size_t s = 0; s < kNumStateTensors; ++s) {
    ZINF_RETURN_IF_ERROR(m.file.WriteSlab(StateDatasets(StateFormat::kFp32)[s].checksum, 0,
                                          std::span<const std::uint64_t>(m.sums[s])));
  }
  ZINF_RETURN_IF_ERROR(m.file.Close());
  if (check) ZINF_RETURN_IF_ERROR(check(m.out.temp_path()));
  ZINF_RETURN_IF_ERROR(m.out.Commit());
  m.done = true;
  return OkStatus();
}

}  // namespace zinf::checkpoint
