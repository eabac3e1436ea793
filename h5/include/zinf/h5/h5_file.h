// H5File: an HDF5 file opened either collectively by every rank of a communicator (parallel HDF5
// over MPI-IO, used for checkpoints) or serially by one process (tools such as zinf-ckpt).
//
//   ZINF_ASSIGN_OR_RETURN(H5File file, H5File::CreateCollective(comm, "step-10.h5.partial"));
//   ZINF_RETURN_IF_ERROR(file.CreateDataset1D("/state/fp32", total_numel, 1 << 20,
//                                             H5DataType::kFloat32));
//   ZINF_RETURN_IF_ERROR(file.WriteSlab("/state/fp32", my_offset, my_values));  // may be empty
//   ZINF_RETURN_IF_ERROR(file.WriteInt64Attribute("/", "step", 10));
//   ZINF_RETURN_IF_ERROR(file.Close());
//
// Collectiveness. On a file made by CreateCollective/OpenCollective, every method that is not a
// const accessor is "Collective over comm": all ranks of the communicator must call it, in the
// same order, with the same names and the same metadata arguments (dataset sizes, attribute
// values: parallel HDF5 requires it for every metadata change). Only the slab offset and data of
// WriteSlab/ReadSlab may differ per rank. Every collective method returns the same Status on all
// ranks (comm::Communicator::AgreeOnStatus): arguments are checked locally and agreed on before
// any collective HDF5 call, so one rank's bad argument fails every rank instead of hanging them.
// Results (numel, attribute values) are read by every rank from the file's metadata and are the
// same everywhere. On a serial file the same methods are plain local calls.
//
// Names. Datasets, groups and the objects that carry attributes are named by absolute or
// relative paths from the root ("/state/fp32" and "state/fp32" are the same); "/" is the root.
//
// Hostile files. Nothing read from a file may make this process read another file or load code:
// every path component must be a hard link (soft, external and user-defined links are
// FailedPrecondition), datasets that are virtual, keep their elements in external files or have
// filters are FailedPrecondition when opened, HDF5 plugin loading is off, and string attributes
// are bounded in size (max_bytes).
//
// Errors. HDF5's automatic error printing is turned off; when an HDF5 call fails, its error
// stack ("H5Fopen: unable to open file; H5F_open: ...") is copied into the Error's message.
//   NotFound:        the file, dataset, object or attribute does not exist.
//   AlreadyExists:   Create* on an existing path; CreateDataset1D on an existing name.
//   InvalidArgument: a slab outside the dataset, an element type that does not match the
//                    dataset's, a zero or too large chunk, an empty name, an attribute of
//                    another type than the one asked for.
//   DataLoss:        the file exists but is not a readable HDF5 file; a read or write failed.
//   FailedPrecondition: the file is closed, or read-only and a write was asked for.
//   Internal:        any other HDF5 failure.
//
// Ownership and thread safety. H5File owns the HDF5 file handle (move-only; a moved-from H5File
// is closed). The Communicator passed to the collective factories must outlive the H5File.
// HDF5 here is not built thread-safe: use HDF5 (every H5File) from one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf::comm {
class Communicator;
}  // namespace zinf::comm

namespace zinf::h5 {

// Element types of datasets. Stored little-endian (IEEE f32 LE, U64 LE, I64 LE).
enum class H5DataType { kFloat32, kUInt64, kInt64, kUInt8 };
std::string_view H5DataTypeName(H5DataType type);  // "float32", "uint64", "int64", "uint8"
std::uint64_t H5DataTypeBytes(H5DataType type);    // 4, 8, 8, 1

// How MPI-IO carried out the last WriteSlab/ReadSlab on this rank (H5Pget_mpio_actual_io_mode).
enum class H5TransferMode {
  kNotCollective,         // serial file, no transfer yet, or HDF5 fell back to independent I/O
  kChunkIndependent,      // chunked dataset, each chunk accessed independently
  kChunkCollective,       // chunked dataset, each chunk accessed collectively
  kChunkMixed,            // chunked dataset, some chunks collectively, some independently
  kContiguousCollective,  // contiguous dataset, collective
};
std::string_view H5TransferModeName(H5TransferMode mode);

// What Create* does when the path exists already.
enum class H5CreateMode {
  kFailIfExists,  // AlreadyExists
  kTruncate,      // the old file is replaced
};

class H5File {
 public:
  static constexpr std::uint64_t kMaxStringAttributeBytes = 64ull << 20;

  // ---- Collective (MPI-IO driver). Collective over `comm`. ----
  // Creates `path` (its directory must exist and be shared by all ranks).
  static Result<H5File> CreateCollective(const comm::Communicator& comm, const std::string& path,
                                         H5CreateMode mode = H5CreateMode::kFailIfExists);
  static Result<H5File> OpenCollective(const comm::Communicator& comm, const std::string& path,
                                       bool read_only);

  // ---- Serial (default sec2 driver; MPI need not be initialized). ----
  static Result<H5File> CreateSerial(const std::string& path,
                                     H5CreateMode mode = H5CreateMode::kFailIfExists);
  static Result<H5File> OpenSerial(const std::string& path, bool read_only);

  H5File(H5File&& other) noexcept;
  H5File& operator=(H5File&& other) noexcept;
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;
  // Closes the file if still open, ignoring errors. For a collective file H5Fclose is collective:
  // all ranks must destroy their H5File at the same point; prefer an explicit Close().
  ~H5File();

  // Flushes and closes the file, reporting errors. Idempotent: closing a closed file is OK.
  Status Close();

  // Writes HDF5's buffers to the file (H5Fflush, global scope).
  Status Flush();

  const std::string& path() const { return path_; }
  bool is_open() const { return impl_ != nullptr; }
  bool is_collective() const { return comm_ != nullptr; }
  bool read_only() const { return read_only_; }
  // Local: how the last slab transfer on this rank was carried out.
  H5TransferMode last_transfer_mode() const { return last_transfer_mode_; }

  // ---- Datasets ----
  // Creates a 1-D dataset of `numel` elements, chunked by `chunk_numel` elements (clamped to
  // numel; an empty dataset is contiguous), creating missing intermediate groups. Space is
  // allocated at creation and never filled: elements that are never written read back
  // unspecified. chunk_numel must be >= 1 and a chunk must stay below 4 GiB.
  Status CreateDataset1D(std::string_view name, std::uint64_t numel, std::uint64_t chunk_numel,
                         H5DataType type);
  Result<bool> HasDataset(std::string_view name);
  Result<std::uint64_t> DatasetNumel(std::string_view name);
  Result<H5DataType> DatasetType(std::string_view name);
  // Size, type and storage of a 1-D dataset, from the file's metadata. allocated_bytes is what
  // the file holds for its elements (H5Dget_storage_size): numel x element size when every chunk
  // was allocated, less when chunks are missing (they would read back as fill values).
  struct DatasetStorage {
    std::uint64_t numel = 0;
    H5DataType type = H5DataType::kFloat32;
    std::uint64_t chunk_numel = 0;  // 0: not chunked (contiguous or compact)
    std::uint64_t allocated_bytes = 0;
  };
  Result<DatasetStorage> DatasetStorageOf(std::string_view name);

  // Writes `data` to elements [offset, offset + data.size()) of the dataset, or reads them into
  // `data`. Collective I/O (H5FD_MPIO_COLLECTIVE) on a collective file: every rank calls, each
  // with its own offset and span; a rank with nothing to transfer passes an empty span. The
  // element type must match the dataset's.
  Status WriteSlab(std::string_view dataset, std::uint64_t offset, std::span<const float> data);
  Status WriteSlab(std::string_view dataset, std::uint64_t offset,
                   std::span<const std::uint64_t> data);
  Status WriteSlab(std::string_view dataset, std::uint64_t offset,
                   std::span<const std::int64_t> data);
  Status ReadSlab(std::string_view dataset, std::uint64_t offset, std::span<float> data);
  Status WriteSlab(std::string_view dataset, std::uint64_t offset,
                   std::span<const std::uint8_t> data);
  Status ReadSlab(std::string_view dataset, std::uint64_t offset, std::span<std::uint8_t> data);
  Status ReadSlab(std::string_view dataset, std::uint64_t offset, std::span<std::uint64_t> data);
  Status ReadSlab(std::string_view dataset, std::uint64_t offset, std::span<std::int64_t> data);

  // ---- Groups ----
  // Creates the group and any missing parents; OK if it exists already.
  Status CreateGroup(std::string_view name);

  // ---- Attributes (scalar) on the root ("/"), a group or a dataset ----
  // Writing replaces an existing attribute of the same name (whatever its type). Strings are
  // stored as fixed-length, NUL-terminated UTF-8 strings; JSON (optimizer, config) is written as
  // a string attribute holding the dumped text. Reading a string also accepts variable-length
  // strings (as written by h5py).
  Status WriteStringAttribute(std::string_view object, std::string_view name,
                              std::string_view value);
  Status WriteInt64Attribute(std::string_view object, std::string_view name, std::int64_t value);
  Status WriteDoubleAttribute(std::string_view object, std::string_view name, double value);
  // Strings longer than `max_bytes` are InvalidArgument (checked before they are read).
  Result<std::string> ReadStringAttribute(std::string_view object, std::string_view name,
                                          std::uint64_t max_bytes = kMaxStringAttributeBytes);
  // Accepts any integer attribute that fits in int64.
  Result<std::int64_t> ReadInt64Attribute(std::string_view object, std::string_view name);
  // Accepts any floating-point attribute.
  Result<double> ReadDoubleAttribute(std::string_view object, std::string_view name);
  // NotFound if `object` does not exist.
  Result<bool> HasAttribute(std::string_view object, std::string_view name);

 private:
  struct Impl;
  struct ImplDeleter {
    void operator()(Impl* impl) const;
  };
  H5File(std::unique_ptr<Impl, ImplDeleter> impl, const comm::Communicator* comm, std::string path,
         bool read_only);

  // The agreed status on a collective file, `local` on a serial one.
  Status Agree(const Status& local) const;
  // T const: write; otherwise read.
  template <typename T>
  Status TransferSlab(std::string_view dataset, std::uint64_t offset, std::span<T> data);

  std::unique_ptr<Impl, ImplDeleter> impl_;   // null once closed
  const comm::Communicator* comm_ = nullptr;  // not owned; null for a serial file
  std::string path_;
  bool read_only_ = false;
  H5TransferMode last_transfer_mode_ = H5TransferMode::kNotCollective;
};

}  // namespace zinf::h5
