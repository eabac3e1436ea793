// Serial side of checkpoints: header validation, verified chunk reads, verify and export (used by
// zinf-ckpt and by every rank of a restore through its own read-only handle).
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint_internal.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/hdf5.h"
#include "zinf/swapper/checkpoint.h"

namespace zinf::swapper {
namespace checkpoint_internal {
namespace {

using storage::H5DataType;
using storage::H5File;

// A missing piece of the structure is DataLoss: the file is not a complete checkpoint.
Error Missing(std::string what, const Error& cause) {
  return DataLossError(
      fmt::format("checkpoint is incomplete: missing {} ({})", what, cause.message()));
}

Result<std::int64_t> IntAttr(H5File& file, std::string_view object, std::string_view name) {
  Result<std::int64_t> v = file.ReadInt64Attribute(object, name);
  if (!v) {
    if (v.error().code() == ErrorCode::kNotFound) {
      return Missing(fmt::format("attribute '{}' of {}", name, object), v.error());
    }
    return std::move(v).error().WithContext(fmt::format("attribute '{}': ", name));
  }
  return v;
}

Result<std::string> StringAttr(H5File& file, std::string_view object, std::string_view name) {
  Result<std::string> v = file.ReadStringAttribute(object, name);
  if (!v) {
    if (v.error().code() == ErrorCode::kNotFound) {
      return Missing(fmt::format("attribute '{}' of {}", name, object), v.error());
    }
    return std::move(v).error().WithContext(fmt::format("attribute '{}': ", name));
  }
  return v;
}

Result<nlohmann::json> JsonAttr(H5File& file, std::string_view object, std::string_view name) {
  ZINF_ASSIGN_OR_RETURN(std::string text, StringAttr(file, object, name));
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return DataLossError(fmt::format("attribute '{}' of {} is not valid JSON", name, object));
  }
  return json;
}

Status CheckDataset(H5File& file, const std::string& name, std::uint64_t numel, H5DataType type) {
  Result<bool> has = file.HasDataset(name);
  if (!has || !*has) {
    return DataLossError(fmt::format("checkpoint is incomplete: missing dataset {}", name));
  }
  ZINF_ASSIGN_OR_RETURN(std::uint64_t actual, file.DatasetNumel(name));
  ZINF_ASSIGN_OR_RETURN(H5DataType actual_type, file.DatasetType(name));
  if (actual != numel || actual_type != type) {
    return DataLossError(fmt::format("dataset {} has {} elements of {}, expected {} of {}", name,
                                     actual, storage::H5DataTypeName(actual_type), numel,
                                     storage::H5DataTypeName(type)));
  }
  return OkStatus();
}

}  // namespace

std::string StateDataset(StateTensor which) {
  return fmt::format("/state/{}", StateTensorName(which));
}
std::string ChecksumDataset(StateTensor which) {
  return fmt::format("/checksum/{}", StateTensorName(which));
}

Result<CheckpointInfo> ReadInfo(H5File& file, const std::string& path) {
  CheckpointInfo info;
  info.path = path;
  ZINF_ASSIGN_OR_RETURN(std::string format, StringAttr(file, "/", "format"));
  if (format != kCheckpointFormat) {
    return FailedPreconditionError(
        fmt::format("{} is not a zinf checkpoint (format '{}')", path, format));
  }
  ZINF_ASSIGN_OR_RETURN(info.format_version, IntAttr(file, "/", "format_version"));
  if (info.format_version != kCheckpointFormatVersion) {
    return FailedPreconditionError(
        fmt::format("{}: unsupported format_version {} (this build reads format_version {})", path,
                    info.format_version, kCheckpointFormatVersion));
  }
  ZINF_ASSIGN_OR_RETURN(info.step, IntAttr(file, "/", "step"));
  ZINF_ASSIGN_OR_RETURN(info.world_size, IntAttr(file, "/", "world_size"));
  ZINF_ASSIGN_OR_RETURN(std::int64_t total, IntAttr(file, "/", "total_numel"));
  ZINF_ASSIGN_OR_RETURN(info.sub_group_size, IntAttr(file, "/", "sub_group_size"));
  ZINF_ASSIGN_OR_RETURN(std::int64_t chunk, IntAttr(file, "/", "chunk_numel"));
  if (total <= 0 || chunk <= 0 || info.world_size <= 0) {
    return DataLossError(
        fmt::format("{}: bad header (total_numel {}, chunk_numel {}, "
                    "world_size {})",
                    path, total, chunk, info.world_size));
  }
  info.total_numel = static_cast<std::uint64_t>(total);
  info.chunk_numel = static_cast<std::uint64_t>(chunk);
  info.num_chunks = NumChunks(info.total_numel, info.chunk_numel);
  ZINF_ASSIGN_OR_RETURN(info.created, StringAttr(file, "/", "created"));
  ZINF_ASSIGN_OR_RETURN(info.optimizer, JsonAttr(file, "/", "optimizer"));
  ZINF_ASSIGN_OR_RETURN(info.config, JsonAttr(file, "/", "config"));

  ZINF_ASSIGN_OR_RETURN(std::string layout_text, StringAttr(file, "/layout", "json"));
  Result<partition::ParamLayout> layout = partition::ParamLayout::FromJsonString(layout_text);
  if (!layout) {
    return DataLossError(fmt::format("{}: unreadable /layout: {}", path, layout.error().message()));
  }
  if (layout->total_numel() != info.total_numel) {
    return DataLossError(fmt::format("{}: /layout holds {} elements, total_numel says {}", path,
                                     layout->total_numel(), info.total_numel));
  }
  info.layout = std::move(*layout);

  for (StateTensor which : kStates) {
    ZINF_RETURN_IF_ERROR(
        CheckDataset(file, StateDataset(which), info.total_numel, H5DataType::kFloat32));
    ZINF_RETURN_IF_ERROR(
        CheckDataset(file, ChecksumDataset(which), info.num_chunks, H5DataType::kUInt64));
  }
  ZINF_ASSIGN_OR_RETURN(info.checksum_algorithm, StringAttr(file, "/checksum", "algorithm"));
  if (info.checksum_algorithm != storage::kChecksumAlgorithm) {
    return FailedPreconditionError(fmt::format("{}: checksum algorithm '{}' (this build: '{}')",
                                               path, info.checksum_algorithm,
                                               storage::kChecksumAlgorithm));
  }
  ZINF_ASSIGN_OR_RETURN(info.trainer, JsonAttr(file, "/trainer", "state"));

  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  info.file_size_bytes = ec ? 0 : static_cast<std::uint64_t>(size);
  return info;
}

Result<std::vector<std::uint64_t>> ReadChecksums(H5File& file, StateTensor which,
                                                 std::uint64_t num_chunks) {
  std::vector<std::uint64_t> sums(num_chunks);
  ZINF_RETURN_IF_ERROR(Annotate(file.ReadSlab(ChecksumDataset(which), 0, std::span(sums)),
                                "reading " + ChecksumDataset(which) + ": "));
  return sums;
}

VerifiedChunkReader::VerifiedChunkReader(H5File* file, StateTensor which, std::uint64_t total_numel,
                                         std::uint64_t chunk_numel,
                                         std::vector<std::uint64_t> checksums)
    : file_(file),
      which_(which),
      dataset_(StateDataset(which)),
      total_numel_(total_numel),
      chunk_numel_(chunk_numel),
      checksums_(std::move(checksums)),
      buffer_(std::min(chunk_numel, total_numel)) {}

Result<std::span<const float>> VerifiedChunkReader::Chunk(std::uint64_t k) {
  const std::uint64_t begin = k * chunk_numel_;
  const std::uint64_t end = std::min(begin + chunk_numel_, total_numel_);
  std::span<float> data(buffer_.data(), end - begin);
  if (cached_ == k) return std::span<const float>(data);
  cached_ = UINT64_MAX;
  ZINF_RETURN_IF_ERROR(
      Annotate(file_->ReadSlab(dataset_, begin, data),
               fmt::format("reading {} chunk {} elements [{}, {}): ", dataset_, k, begin, end)));
  ZINF_RETURN_IF_ERROR(storage::VerifyChecksum(
      std::as_bytes(data), checksums_.at(k),
      fmt::format("dataset {} chunk {} elements [{}, {})", dataset_, k, begin, end)));
  cached_ = k;
  return std::span<const float>(data);
}

Status VerifiedChunkReader::Read(std::uint64_t flat_offset, std::span<float> out) {
  while (!out.empty()) {
    const std::uint64_t k = flat_offset / chunk_numel_;
    const std::uint64_t begin = k * chunk_numel_;
    const std::uint64_t end = std::min(begin + chunk_numel_, total_numel_);
    if (flat_offset == begin && out.size() >= end - begin && cached_ != k) {
      // A whole chunk: read and verify it in place, saving the copy through buffer_. On a
      // mismatch `out` holds unverified data, but the error tells the caller not to use it.
      std::span<float> data = out.first(end - begin);
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
    ZINF_ASSIGN_OR_RETURN(std::span<const float> chunk, Chunk(k));
    const std::uint64_t in_chunk = flat_offset - k * chunk_numel_;
    const std::uint64_t n = std::min<std::uint64_t>(out.size(), chunk.size() - in_chunk);
    std::memcpy(out.data(), chunk.data() + in_chunk, n * sizeof(float));
    out = out.subspan(n);
    flat_offset += n;
  }
  return OkStatus();
}

Status VerifiedChunkReader::Verify(std::uint64_t flat_offset, std::uint64_t numel) {
  if (numel == 0) return OkStatus();
  const std::uint64_t first = flat_offset / chunk_numel_;
  const std::uint64_t last = (flat_offset + numel - 1) / chunk_numel_;
  for (std::uint64_t k = first; k <= last; ++k) {
    ZINF_RETURN_IF_ERROR(Chunk(k));
  }
  return OkStatus();
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

}  // namespace checkpoint_internal

using checkpoint_internal::kStates;
using checkpoint_internal::ReadChecksums;
using checkpoint_internal::VerifiedChunkReader;

std::string CheckpointFileName(std::int64_t step) { return fmt::format("step-{}.h5", step); }

Result<std::string> ResolveCheckpointPath(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return NotFoundError(fmt::format("no checkpoint at {}", path));
  }
  if (!std::filesystem::is_directory(status)) return path;
  const std::string latest = path + "/latest";
  std::ifstream in(latest);
  if (!in) return NotFoundError(fmt::format("checkpoint directory {} has no 'latest'", path));
  std::string name;
  std::getline(in, name);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) {
    name.pop_back();
  }
  if (name.empty()) return DataLossError(fmt::format("{} is empty", latest));
  const std::string file = path + "/" + name;
  if (!std::filesystem::exists(file, ec)) {
    return NotFoundError(fmt::format("{} names {}, which does not exist", latest, file));
  }
  return file;
}

Result<CheckpointInfo> ReadCheckpointInfo(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_ASSIGN_OR_RETURN(storage::H5File file,
                        storage::H5File::OpenSerial(file_path, /*read_only=*/true));
  Result<CheckpointInfo> info = checkpoint_internal::ReadInfo(file, file_path);
  Status closed = file.Close();
  if (!info) return info;
  ZINF_RETURN_IF_ERROR(closed);
  return info;
}

Status VerifyCheckpoint(const std::string& path, const CheckpointProgressFn& progress) {
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_ASSIGN_OR_RETURN(storage::H5File file,
                        storage::H5File::OpenSerial(file_path, /*read_only=*/true));
  ZINF_ASSIGN_OR_RETURN(CheckpointInfo info, checkpoint_internal::ReadInfo(file, file_path));
  const std::uint64_t total_bytes = kNumStateTensors * info.total_numel * sizeof(float);
  std::uint64_t done = 0;
  for (StateTensor which : kStates) {
    ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> sums,
                          ReadChecksums(file, which, info.num_chunks));
    VerifiedChunkReader reader(&file, which, info.total_numel, info.chunk_numel, std::move(sums));
    for (std::uint64_t k = 0; k < info.num_chunks; ++k) {
      ZINF_ASSIGN_OR_RETURN(std::span<const float> chunk, reader.Chunk(k));
      done += chunk.size() * sizeof(float);
      if (progress) progress(done, total_bytes);
    }
  }
  return file.Close();
}

namespace {

// Buffered writer of a plain file that reports every failure.
class OutFile {
 public:
  static Result<OutFile> Create(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return ErrnoError(errno, "open " + path);
    return OutFile(f, path);
  }
  OutFile(OutFile&& other) noexcept
      : file_(std::exchange(other.file_, nullptr)), path_(std::move(other.path_)) {}
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  OutFile& operator=(OutFile&&) = delete;
  ~OutFile() {
    if (file_ != nullptr) std::fclose(file_);
  }
  Status Write(std::span<const std::byte> bytes) {
    if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) {
      return ErrnoError(errno, "write " + path_);
    }
    return OkStatus();
  }
  Status Close() {
    std::FILE* f = std::exchange(file_, nullptr);
    if (std::fflush(f) != 0) {
      const int err = errno;
      std::fclose(f);
      return ErrnoError(err, "flush " + path_);
    }
    if (fdatasync(fileno(f)) != 0) {
      const int err = errno;
      std::fclose(f);
      return ErrnoError(err, "fdatasync " + path_);
    }
    if (std::fclose(f) != 0) return ErrnoError(errno, "close " + path_);
    return OkStatus();
  }

 private:
  OutFile(std::FILE* f, std::string path) : file_(f), path_(std::move(path)) {}
  std::FILE* file_;
  std::string path_;
};

}  // namespace

Status ExportCheckpoint(const std::string& path, const std::string& out_path, ExportFormat format,
                        const CheckpointProgressFn& progress) {
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  ZINF_ASSIGN_OR_RETURN(std::string file_path, ResolveCheckpointPath(path));
  ZINF_ASSIGN_OR_RETURN(storage::H5File file,
                        storage::H5File::OpenSerial(file_path, /*read_only=*/true));
  ZINF_ASSIGN_OR_RETURN(CheckpointInfo info, checkpoint_internal::ReadInfo(file, file_path));
  ZINF_ASSIGN_OR_RETURN(std::vector<std::uint64_t> sums,
                        ReadChecksums(file, StateTensor::kFp32, info.num_chunks));
  VerifiedChunkReader reader(&file, StateTensor::kFp32, info.total_numel, info.chunk_numel,
                             std::move(sums));
  const partition::ParamLayout& layout = *info.layout;
  const std::uint64_t total_bytes = info.total_numel * sizeof(float);
  const std::uint64_t piece_numel = std::min(info.chunk_numel, info.total_numel);
  std::vector<float> piece(piece_numel);
  std::uint64_t done = 0;

  // Streams parameter `p` piece by piece into `sink(offset_in_param, values)`.
  auto stream = [&](const partition::ParamInfo& p, const auto& sink) -> Status {
    for (std::uint64_t off = 0; off < p.numel; off += piece_numel) {
      const std::uint64_t n = std::min(piece_numel, p.numel - off);
      std::span<float> values(piece.data(), n);
      ZINF_RETURN_IF_ERROR(reader.Read(p.flat_offset + off, values));
      ZINF_RETURN_IF_ERROR(sink(off, std::span<const float>(values)));
      done += n * sizeof(float);
      if (progress) progress(done, total_bytes);
    }
    return OkStatus();
  };

  if (format == ExportFormat::kHdf5) {
    ZINF_ASSIGN_OR_RETURN(storage::H5File out, storage::H5File::CreateSerial(
                                                   out_path, storage::H5CreateMode::kTruncate));
    ZINF_RETURN_IF_ERROR(out.WriteStringAttribute("/", "source", file_path));
    ZINF_RETURN_IF_ERROR(out.WriteInt64Attribute("/", "step", info.step));
    for (const partition::ParamInfo& p : layout.params()) {
      ZINF_RETURN_IF_ERROR(out.CreateDataset1D(p.name, p.numel, std::min(p.numel, piece_numel),
                                               storage::H5DataType::kFloat32));
      ZINF_RETURN_IF_ERROR(
          out.WriteStringAttribute(p.name, "shape", partition::FormatShape(p.shape)));
      ZINF_RETURN_IF_ERROR(stream(p, [&](std::uint64_t off, std::span<const float> values) {
        return out.WriteSlab(p.name, off, values);
      }));
    }
    ZINF_RETURN_IF_ERROR(out.Close());
    return file.Close();
  }

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {
      {"format", "pt"}, {"source", file_path}, {"step", std::to_string(info.step)}};
  std::uint64_t offset = 0;
  for (const partition::ParamInfo& p : layout.params()) {
    header[p.name] = {{"dtype", "F32"},
                      {"shape", p.shape},
                      {"data_offsets", {offset, offset + p.numel * sizeof(float)}}};
    offset += p.numel * sizeof(float);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t header_size = text.size();
  ZINF_ASSIGN_OR_RETURN(OutFile out, OutFile::Create(out_path));
  ZINF_RETURN_IF_ERROR(out.Write(std::as_bytes(std::span(&header_size, 1))));
  ZINF_RETURN_IF_ERROR(out.Write(std::as_bytes(std::span(text.data(), text.size()))));
  for (const partition::ParamInfo& p : layout.params()) {
    ZINF_RETURN_IF_ERROR(stream(p, [&](std::uint64_t, std::span<const float> values) {
      return out.Write(std::as_bytes(values));
    }));
  }
  ZINF_RETURN_IF_ERROR(out.Close());
  return file.Close();
}

}  // namespace zinf::swapper
