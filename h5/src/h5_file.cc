#include "zinf/h5/h5_file.h"

#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "handles.h"
#include "zinf/comm/communicator.h"
#include "zinf/comm/mpi_native.h"

#ifndef H5_HAVE_PARALLEL
#error "zinf needs parallel HDF5 (Debian: libhdf5-openmpi-dev)"
#endif

namespace zinf::h5 {

using handles::AttributeHandle;
using handles::Check;
using handles::CheckErr;
using handles::DatasetHandle;
using handles::DataspaceHandle;
using handles::DatatypeHandle;
using handles::FileHandle;
using handles::ObjectHandle;
using handles::PropListHandle;
using handles::StackError;

struct H5File::Impl {
  FileHandle file;
};

void H5File::ImplDeleter::operator()(Impl* impl) const { delete impl; }

std::string_view H5DataTypeName(H5DataType type) {
  switch (type) {
    case H5DataType::kFloat32:
      return "float32";
    case H5DataType::kUInt64:
      return "uint64";
    case H5DataType::kInt64:
      return "int64";
    case H5DataType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

std::uint64_t H5DataTypeBytes(H5DataType type) {
  switch (type) {
    case H5DataType::kFloat32:
      return 4;
    case H5DataType::kUInt8:
      return 1;
    case H5DataType::kUInt64:
    case H5DataType::kInt64:
      return 8;
  }
  return 8;
}

std::string_view H5TransferModeName(H5TransferMode mode) {
  switch (mode) {
    case H5TransferMode::kNotCollective:
      return "not collective";
    case H5TransferMode::kChunkIndependent:
      return "chunk independent";
    case H5TransferMode::kChunkCollective:
      return "chunk collective";
    case H5TransferMode::kChunkMixed:
      return "chunk mixed";
    case H5TransferMode::kContiguousCollective:
      return "contiguous collective";
  }
  return "unknown";
}

namespace {

template <typename T>
constexpr H5DataType kTypeOf = H5DataType::kFloat32;
template <>
constexpr H5DataType kTypeOf<std::uint64_t> = H5DataType::kUInt64;
template <>
constexpr H5DataType kTypeOf<std::int64_t> = H5DataType::kInt64;
template <>
constexpr H5DataType kTypeOf<std::uint8_t> = H5DataType::kUInt8;

// The predefined type ids are globals that H5open() initializes, so these are functions.
hid_t FileType(H5DataType type) {
  switch (type) {
    case H5DataType::kFloat32:
      return H5T_IEEE_F32LE;
    case H5DataType::kUInt64:
      return H5T_STD_U64LE;
    case H5DataType::kInt64:
      return H5T_STD_I64LE;
    case H5DataType::kUInt8:
      return H5T_STD_U8LE;
  }
  return H5I_INVALID_HID;
}

hid_t MemType(H5DataType type) {
  switch (type) {
    case H5DataType::kFloat32:
      return H5T_NATIVE_FLOAT;
    case H5DataType::kUInt64:
      return H5T_NATIVE_UINT64;
    case H5DataType::kInt64:
      return H5T_NATIVE_INT64;
    case H5DataType::kUInt8:
      return H5T_NATIVE_UINT8;
  }
  return H5I_INVALID_HID;
}

// "/a/b" for "a/b" or "/a/b"; "/" only where the root is allowed (attribute carriers).
Result<std::string> NormalizeName(std::string_view name, bool allow_root) {
  if (name.empty()) return InvalidArgumentError("empty HDF5 object name");
  std::string path = name.front() == '/' ? std::string(name) : "/" + std::string(name);
  if (path == "/") {
    if (allow_root) return path;
    return InvalidArgumentError("the root group '/' is not a dataset");
  }
  if (path.back() == '/' || path.find("//") != std::string::npos ||
      path.find('\0') != std::string::npos) {
    return InvalidArgumentError(fmt::format("malformed HDF5 object name '{}'", name));
  }
  return path;
}

// Refuses any link other than a hard link at `prefix`: a soft or external link (or a user-defined
// one) would make a read leave the object tree the writer made, or the file itself.
Status CheckHardLink(hid_t file, const std::string& prefix, const std::string& file_path) {
  H5L_info_t link{};
  if (H5Lget_info(file, prefix.c_str(), &link, H5P_DEFAULT) < 0) {
    return StackError(ErrorCode::kInternal, fmt::format("{}: H5Lget_info {}", file_path, prefix));
  }
  if (link.type != H5L_TYPE_HARD) {
    const char* kind = link.type == H5L_TYPE_SOFT       ? "a soft link"
                       : link.type == H5L_TYPE_EXTERNAL ? "an external link (to another file)"
                                                        : "a user-defined link";
    return Error(ErrorCode::kFailedPrecondition,
                 fmt::format("{}: {} is {}; zinf follows only hard links (a read must not leave "
                             "the file)",
                             file_path, prefix, kind));
  }
  return OkStatus();
}

// The type of the object at `path`; NotFound when it or a parent group is missing. Each
// prefix is checked with H5Lexists, because H5Lexists on "/a/b" fails (rather than saying no)
// when "/a" is missing, and must be a hard link before anything traverses it.
Result<H5O_type_t> ObjectType(hid_t file, const std::string& path, const std::string& file_path) {
  if (path != "/") {
    std::size_t pos = 0;
    while (pos != std::string::npos) {
      pos = path.find('/', pos + 1);
      const std::string prefix = path.substr(0, pos);
      const htri_t exists = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
      if (exists < 0) {
        return StackError(ErrorCode::kInternal, fmt::format("{}: H5Lexists {}", file_path, prefix));
      }
      if (exists == 0) {
        return NotFoundError(fmt::format("{}: no object {}", file_path, path));
      }
      ZINF_RETURN_IF_ERROR(CheckHardLink(file, prefix, file_path));
      if (pos != std::string::npos) {
        H5O_info_t info;
        if (H5Oget_info_by_name2(file, prefix.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0) {
          return StackError(ErrorCode::kInternal,
                            fmt::format("{}: H5Oget_info_by_name {}", file_path, prefix));
        }
        if (info.type != H5O_TYPE_GROUP) {
          return NotFoundError(
              fmt::format("{}: no object {} ({} is not a group)", file_path, path, prefix));
        }
      }
    }
  }
  H5O_info_t info;
  if (H5Oget_info_by_name2(file, path.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0) {
    return StackError(ErrorCode::kInternal,
                      fmt::format("{}: H5Oget_info_by_name {}", file_path, path));
  }
  return info.type;
}

struct DatasetInfo {
  std::uint64_t numel = 0;
  H5DataType type = H5DataType::kFloat32;
};

// How a dataset stores its elements. Only storage inside the file itself is accepted: virtual
// datasets (elements in other files), external raw-data files and filters (which may need a
// plugin, and whose output size says nothing about the elements) are refused when opened.
struct StorageLayout {
  H5D_layout_t layout = H5D_CONTIGUOUS;
  std::uint64_t chunk_numel = 0;  // chunked 1-D datasets; 0 otherwise
};

Result<StorageLayout> GetStorageLayout(hid_t dataset, const std::string& name,
                                       const std::string& file_path) {
  ZINF_ASSIGN_OR_RETURN(
      PropListHandle dcpl,
      Check<PropListHandle>(H5Dget_create_plist(dataset), ErrorCode::kInternal,
                            fmt::format("{}: H5Dget_create_plist {}", file_path, name)));
  StorageLayout out;
  out.layout = H5Pget_layout(dcpl.get());
  if (out.layout < 0) {
    return StackError(ErrorCode::kInternal, fmt::format("{}: H5Pget_layout {}", file_path, name));
  }
  auto refuse = [&](std::string_view why) {
    return Error(ErrorCode::kFailedPrecondition,
                 fmt::format("{}: dataset {} {}; zinf reads only data stored in the file itself, "
                             "unfiltered",
                             file_path, name, why));
  };
  if (out.layout == H5D_VIRTUAL) return refuse("is a virtual dataset");
  if (out.layout != H5D_CONTIGUOUS && out.layout != H5D_CHUNKED && out.layout != H5D_COMPACT) {
    return refuse("has an unknown storage layout");
  }
  const int externals = H5Pget_external_count(dcpl.get());
  if (externals < 0) {
    return StackError(ErrorCode::kInternal,
                      fmt::format("{}: H5Pget_external_count {}", file_path, name));
  }
  if (externals > 0) return refuse("keeps its elements in external files");
  const int filters = H5Pget_nfilters(dcpl.get());
  if (filters < 0) {
    return StackError(ErrorCode::kInternal, fmt::format("{}: H5Pget_nfilters {}", file_path, name));
  }
  if (filters > 0) return refuse("has filters (compression)");
  if (out.layout == H5D_CHUNKED) {
    hsize_t dims[H5S_MAX_RANK] = {};
    const int rank = H5Pget_chunk(dcpl.get(), H5S_MAX_RANK, dims);
    if (rank < 0) {
      return StackError(ErrorCode::kInternal, fmt::format("{}: H5Pget_chunk {}", file_path, name));
    }
    if (rank == 1) out.chunk_numel = dims[0];
  }
  return out;
}

Result<DatasetHandle> OpenDataset(hid_t file, const std::string& name,
                                  const std::string& file_path) {
  ZINF_ASSIGN_OR_RETURN(const H5O_type_t type, ObjectType(file, name, file_path));
  if (type != H5O_TYPE_DATASET) {
    return InvalidArgumentError(fmt::format("{}: {} is not a dataset", file_path, name));
  }
  ZINF_ASSIGN_OR_RETURN(
      DatasetHandle dataset,
      Check<DatasetHandle>(H5Dopen2(file, name.c_str(), H5P_DEFAULT), ErrorCode::kInternal,
                           fmt::format("{}: H5Dopen {}", file_path, name)));
  ZINF_RETURN_IF_ERROR(GetStorageLayout(dataset.get(), name, file_path));
  return dataset;
}

Result<DatasetInfo> GetDatasetInfo(hid_t dataset, const std::string& name,
                                   const std::string& file_path) {
  DatasetInfo info;
  ZINF_ASSIGN_OR_RETURN(
      DataspaceHandle space,
      Check<DataspaceHandle>(H5Dget_space(dataset), ErrorCode::kInternal,
                             fmt::format("{}: H5Dget_space {}", file_path, name)));
  const int ndims = H5Sget_simple_extent_ndims(space.get());
  if (ndims < 0) {
    return StackError(ErrorCode::kInternal,
                      fmt::format("{}: H5Sget_simple_extent_ndims {}", file_path, name));
  }
  if (ndims != 1) {
    return InvalidArgumentError(fmt::format(
        "{}: dataset {} has {} dimensions; zinf handles 1-D datasets", file_path, name, ndims));
  }
  hsize_t dims[1] = {0};
  if (H5Sget_simple_extent_dims(space.get(), dims, nullptr) < 0) {
    return StackError(ErrorCode::kInternal,
                      fmt::format("{}: H5Sget_simple_extent_dims {}", file_path, name));
  }
  info.numel = dims[0];

  ZINF_ASSIGN_OR_RETURN(DatatypeHandle dtype,
                        Check<DatatypeHandle>(H5Dget_type(dataset), ErrorCode::kInternal,
                                              fmt::format("{}: H5Dget_type {}", file_path, name)));
  for (H5DataType candidate :
       {H5DataType::kFloat32, H5DataType::kUInt64, H5DataType::kInt64, H5DataType::kUInt8}) {
    const htri_t equal = H5Tequal(dtype.get(), FileType(candidate));
    if (equal < 0) {
      return StackError(ErrorCode::kInternal, fmt::format("{}: H5Tequal {}", file_path, name));
    }
    if (equal > 0) {
      info.type = candidate;
      return info;
    }
  }
  return InvalidArgumentError(fmt::format(
      "{}: dataset {} has an element type other than float32/uint64/int64/uint8 (little-endian)",
      file_path, name));
}

Result<PropListHandle> MakeFileAccess(const comm::Communicator* comm) {
  ZINF_ASSIGN_OR_RETURN(PropListHandle fapl,
                        Check<PropListHandle>(H5Pcreate(H5P_FILE_ACCESS), ErrorCode::kInternal,
                                              "H5Pcreate(H5P_FILE_ACCESS)"));
  // The 1.8 object header format lets attributes exceed 64 KiB (dense storage), which a large
  // JSON config needs; h5py and h5dump >= 1.8 read it.
  ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST),
                                ErrorCode::kInternal, "H5Pset_libver_bounds"));
  if (comm != nullptr) {
    ZINF_RETURN_IF_ERROR(
        CheckErr(H5Pset_fapl_mpio(fapl.get(), comm::NativeComm(*comm), MPI_INFO_NULL),
                 ErrorCode::kInternal, "H5Pset_fapl_mpio"));
    // Rank 0 then writes metadata in one collective operation instead of many small writes.
    ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_coll_metadata_write(fapl.get(), true),
                                  ErrorCode::kInternal, "H5Pset_coll_metadata_write"));
  }
  return fapl;
}

Status CheckCreatable(const std::string& path, H5CreateMode mode) {
  if (path.empty()) return InvalidArgumentError("empty HDF5 file path");
  struct stat st;
  if (mode == H5CreateMode::kFailIfExists && ::stat(path.c_str(), &st) == 0) {
    return AlreadyExistsError(fmt::format("create HDF5 file {}: it exists already", path));
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  if (::stat(dir.c_str(), &st) != 0) {
    return ErrnoError(errno, fmt::format("create HDF5 file {}: directory {}", path, dir));
  }
  return OkStatus();
}

Status CheckOpenable(const std::string& path, bool read_only) {
  if (path.empty()) return InvalidArgumentError("empty HDF5 file path");
  if (::access(path.c_str(), read_only ? R_OK : (R_OK | W_OK)) != 0) {
    return ErrnoError(errno, fmt::format("open HDF5 file {}", path));
  }
  return OkStatus();
}

Status ToStatus(const Error& error) { return Status(error); }

template <typename T>
Status StatusOf(const Result<T>& result) {
  if (result) return OkStatus();
  return ToStatus(result.error());
}

}  // namespace

// ---- Files ----

H5File::H5File(std::unique_ptr<Impl, ImplDeleter> impl, const comm::Communicator* comm,
               std::string path, bool read_only)
    : impl_(std::move(impl)), comm_(comm), path_(std::move(path)), read_only_(read_only) {}

H5File::H5File(H5File&& other) noexcept = default;
H5File& H5File::operator=(H5File&& other) noexcept = default;
H5File::~H5File() = default;

Status H5File::Agree(const Status& local) const {
  if (comm_ == nullptr) return local;
  return comm_->AgreeOnStatus(local);
}

namespace {

// Shared by the four factories. `comm` null: serial. Two agreements on a collective file: on the
// local checks (so that no rank enters H5Fcreate/H5Fopen, which are collective, alone), then on
// the result.
Result<FileHandle> OpenOrCreate(const comm::Communicator* comm, const std::string& path,
                                bool create, H5CreateMode mode, bool read_only) {
  handles::InitHdf5();
  auto agree = [comm](const Status& local) {
    return comm == nullptr ? local : comm->AgreeOnStatus(local);
  };
  Result<PropListHandle> fapl = [&]() -> Result<PropListHandle> {
    ZINF_RETURN_IF_ERROR(create ? CheckCreatable(path, mode) : CheckOpenable(path, read_only));
    return MakeFileAccess(comm);
  }();
  ZINF_RETURN_IF_ERROR(agree(StatusOf(fapl)));

  Result<FileHandle> file =
      create ? Check<FileHandle>(
                   H5Fcreate(path.c_str(),
                             mode == H5CreateMode::kTruncate ? H5F_ACC_TRUNC : H5F_ACC_EXCL,
                             H5P_DEFAULT, fapl->get()),
                   ErrorCode::kDataLoss, fmt::format("H5Fcreate {}", path))
             : Check<FileHandle>(
                   H5Fopen(path.c_str(), read_only ? H5F_ACC_RDONLY : H5F_ACC_RDWR, fapl->get()),
                   ErrorCode::kDataLoss,
                   fmt::format("H5Fopen {} (not an HDF5 file, or a damaged one?)", path));
  ZINF_RETURN_IF_ERROR(agree(StatusOf(file)));
  return file;
}

}  // namespace

Result<H5File> H5File::CreateCollective(const comm::Communicator& comm, const std::string& path,
                                        H5CreateMode mode) {
  ZINF_ASSIGN_OR_RETURN(FileHandle file, OpenOrCreate(&comm, path, true, mode, false));
  std::unique_ptr<Impl, ImplDeleter> impl(new Impl{std::move(file)});
  return H5File(std::move(impl), &comm, path, false);
}

Result<H5File> H5File::OpenCollective(const comm::Communicator& comm, const std::string& path,
                                      bool read_only) {
  ZINF_ASSIGN_OR_RETURN(FileHandle file,
                        OpenOrCreate(&comm, path, false, H5CreateMode::kFailIfExists, read_only));
  std::unique_ptr<Impl, ImplDeleter> impl(new Impl{std::move(file)});
  return H5File(std::move(impl), &comm, path, read_only);
}

Result<H5File> H5File::CreateSerial(const std::string& path, H5CreateMode mode) {
  ZINF_ASSIGN_OR_RETURN(FileHandle file, OpenOrCreate(nullptr, path, true, mode, false));
  std::unique_ptr<Impl, ImplDeleter> impl(new Impl{std::move(file)});
  return H5File(std::move(impl), nullptr, path, false);
}

Result<H5File> H5File::OpenSerial(const std::string& path, bool read_only) {
  ZINF_ASSIGN_OR_RETURN(FileHandle file,
                        OpenOrCreate(nullptr, path, false, H5CreateMode::kFailIfExists, read_only));
  std::unique_ptr<Impl, ImplDeleter> impl(new Impl{std::move(file)});
  return H5File(std::move(impl), nullptr, path, read_only);
}

Status H5File::Close() {
  if (impl_ == nullptr) return OkStatus();
  const Status local = impl_->file.Close(fmt::format("H5Fclose {}", path_), ErrorCode::kDataLoss);
  impl_.reset();
  return Agree(local);
}

Status H5File::Flush() {
  Status local =
      impl_ == nullptr
          ? Status(FailedPreconditionError(fmt::format("flush {}: file is closed", path_)))
          : CheckErr(H5Fflush(impl_->file.get(), H5F_SCOPE_GLOBAL), ErrorCode::kDataLoss,
                     fmt::format("H5Fflush {}", path_));
  return Agree(local);
}

namespace {

Status CheckUsable(bool open, bool read_only, bool write, const std::string& path,
                   std::string_view op) {
  if (!open) return FailedPreconditionError(fmt::format("{} in {}: file is closed", op, path));
  if (write && read_only) {
    return FailedPreconditionError(fmt::format("{} in {}: file is open read-only", op, path));
  }
  return OkStatus();
}

}  // namespace

// ---- Datasets ----

Status H5File::CreateDataset1D(std::string_view name, std::uint64_t numel,
                               std::uint64_t chunk_numel, H5DataType type) {
  std::string path;
  PropListHandle lcpl;
  PropListHandle dcpl;
  DataspaceHandle space;
  const Status prepared = [&]() -> Status {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, true, path_, "create dataset"));
    ZINF_ASSIGN_OR_RETURN(path, NormalizeName(name, false));
    const std::uint64_t chunk = std::min(chunk_numel, numel);
    if (numel > 0 && chunk_numel == 0) {
      return InvalidArgumentError(
          fmt::format("create dataset {} in {}: chunk_numel must be >= 1", path, path_));
    }
    constexpr std::uint64_t kMaxChunkBytes = std::numeric_limits<std::uint32_t>::max();
    if (chunk > kMaxChunkBytes / H5DataTypeBytes(type)) {
      return InvalidArgumentError(fmt::format(
          "create dataset {} in {}: chunk of {} {} elements is not below HDF5's 4 GiB limit", path,
          path_, chunk, H5DataTypeName(type)));
    }
    Result<H5O_type_t> existing = ObjectType(impl_->file.get(), path, path_);
    if (existing) {
      return AlreadyExistsError(
          fmt::format("create dataset {} in {}: exists already", path, path_));
    }
    if (existing.error().code() != ErrorCode::kNotFound) return ToStatus(existing.error());

    ZINF_ASSIGN_OR_RETURN(lcpl, Check<PropListHandle>(H5Pcreate(H5P_LINK_CREATE),
                                                      ErrorCode::kInternal, "H5Pcreate(lcpl)"));
    ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_create_intermediate_group(lcpl.get(), 1),
                                  ErrorCode::kInternal, "H5Pset_create_intermediate_group"));
    ZINF_ASSIGN_OR_RETURN(dcpl, Check<PropListHandle>(H5Pcreate(H5P_DATASET_CREATE),
                                                      ErrorCode::kInternal, "H5Pcreate(dcpl)"));
    if (chunk > 0) {
      const hsize_t chunk_dims[1] = {chunk};
      ZINF_RETURN_IF_ERROR(
          CheckErr(H5Pset_chunk(dcpl.get(), 1, chunk_dims), ErrorCode::kInternal, "H5Pset_chunk"));
    }
    // Every element of a checkpoint is written, so filling first would write it all twice.
    ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER),
                                  ErrorCode::kInternal, "H5Pset_fill_time"));
    // Early allocation: parallel HDF5 requires it, and a file whose structure was written
    // serially can then be filled collectively without any change to its metadata.
    ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY),
                                  ErrorCode::kInternal, "H5Pset_alloc_time"));
    const hsize_t dims[1] = {numel};
    ZINF_ASSIGN_OR_RETURN(space, Check<DataspaceHandle>(H5Screate_simple(1, dims, nullptr),
                                                        ErrorCode::kInternal, "H5Screate_simple"));
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(Agree(prepared));

  Result<DatasetHandle> dataset =
      Check<DatasetHandle>(H5Dcreate2(impl_->file.get(), path.c_str(), FileType(type), space.get(),
                                      lcpl.get(), dcpl.get(), H5P_DEFAULT),
                           ErrorCode::kDataLoss,
                           fmt::format("{}: H5Dcreate {} ({} x {}, chunk {})", path_, path, numel,
                                       H5DataTypeName(type), chunk_numel));
  Status local = StatusOf(dataset);
  if (dataset) {
    local = dataset->Close(fmt::format("{}: H5Dclose {}", path_, path), ErrorCode::kDataLoss);
  }
  return Agree(local);
}

Result<bool> H5File::HasDataset(std::string_view name) {
  Result<bool> local = [&]() -> Result<bool> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "look up dataset"));
    ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(name, false));
    Result<H5O_type_t> type = ObjectType(impl_->file.get(), path, path_);
    if (!type) {
      if (type.error().code() == ErrorCode::kNotFound) return false;
      return type.error();
    }
    return *type == H5O_TYPE_DATASET;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<std::uint64_t> H5File::DatasetNumel(std::string_view name) {
  Result<std::uint64_t> local = [&]() -> Result<std::uint64_t> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "look up dataset"));
    ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(name, false));
    ZINF_ASSIGN_OR_RETURN(DatasetHandle dataset, OpenDataset(impl_->file.get(), path, path_));
    ZINF_ASSIGN_OR_RETURN(const DatasetInfo info, GetDatasetInfo(dataset.get(), path, path_));
    return info.numel;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<H5DataType> H5File::DatasetType(std::string_view name) {
  Result<H5DataType> local = [&]() -> Result<H5DataType> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "look up dataset"));
    ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(name, false));
    ZINF_ASSIGN_OR_RETURN(DatasetHandle dataset, OpenDataset(impl_->file.get(), path, path_));
    ZINF_ASSIGN_OR_RETURN(const DatasetInfo info, GetDatasetInfo(dataset.get(), path, path_));
    return info.type;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<H5File::DatasetStorage> H5File::DatasetStorageOf(std::string_view name) {
  Result<DatasetStorage> local = [&]() -> Result<DatasetStorage> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "look up dataset"));
    ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(name, false));
    ZINF_ASSIGN_OR_RETURN(DatasetHandle dataset, OpenDataset(impl_->file.get(), path, path_));
    ZINF_ASSIGN_OR_RETURN(const DatasetInfo info, GetDatasetInfo(dataset.get(), path, path_));
    ZINF_ASSIGN_OR_RETURN(const StorageLayout layout, GetStorageLayout(dataset.get(), path, path_));
    DatasetStorage out;
    out.numel = info.numel;
    out.type = info.type;
    out.chunk_numel = layout.chunk_numel;
    out.allocated_bytes = H5Dget_storage_size(dataset.get());
    H5Eclear2(H5E_DEFAULT);  // 0 is both "nothing allocated" and an error: both mean none
    return out;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

namespace {

H5TransferMode ToTransferMode(H5D_mpio_actual_io_mode_t mode) {
  switch (mode) {
    case H5D_MPIO_NO_COLLECTIVE:
      return H5TransferMode::kNotCollective;
    case H5D_MPIO_CHUNK_INDEPENDENT:
      return H5TransferMode::kChunkIndependent;
    case H5D_MPIO_CHUNK_COLLECTIVE:
      return H5TransferMode::kChunkCollective;
    case H5D_MPIO_CHUNK_MIXED:
      return H5TransferMode::kChunkMixed;
    case H5D_MPIO_CONTIGUOUS_COLLECTIVE:
      return H5TransferMode::kContiguousCollective;
  }
  return H5TransferMode::kNotCollective;
}

// How HDF5 carried out the last transfer with `dxpl` (kNotCollective when it cannot say).
H5TransferMode ActualTransferMode(hid_t dxpl) {
  H5D_mpio_actual_io_mode_t mode = H5D_MPIO_NO_COLLECTIVE;
  if (H5Pget_mpio_actual_io_mode(dxpl, &mode) >= 0) return ToTransferMode(mode);
  H5Eclear2(H5E_DEFAULT);
  return H5TransferMode::kNotCollective;
}

// The dataspaces of a transfer: the dataset's, with the slab selected, and the buffer's.
struct SlabSpaces {
  DataspaceHandle file;
  DataspaceHandle mem;
};

// Selects elements [offset, offset + count) of `dataset`. With count 0 nothing is selected in
// either space (the rank still takes part in a collective transfer).
Result<SlabSpaces> SelectSlab(hid_t dataset, std::uint64_t offset, std::uint64_t count) {
  SlabSpaces spaces;
  ZINF_ASSIGN_OR_RETURN(spaces.file, Check<DataspaceHandle>(H5Dget_space(dataset),
                                                            ErrorCode::kInternal, "H5Dget_space"));
  const hsize_t mem_dims[1] = {std::max<hsize_t>(count, 1)};
  ZINF_ASSIGN_OR_RETURN(spaces.mem,
                        Check<DataspaceHandle>(H5Screate_simple(1, mem_dims, nullptr),
                                               ErrorCode::kInternal, "H5Screate_simple"));
  if (count == 0) {
    ZINF_RETURN_IF_ERROR(
        CheckErr(H5Sselect_none(spaces.file.get()), ErrorCode::kInternal, "H5Sselect_none"));
    ZINF_RETURN_IF_ERROR(
        CheckErr(H5Sselect_none(spaces.mem.get()), ErrorCode::kInternal, "H5Sselect_none"));
  } else {
    const hsize_t start[1] = {offset};
    const hsize_t counts[1] = {count};
    ZINF_RETURN_IF_ERROR(CheckErr(
        H5Sselect_hyperslab(spaces.file.get(), H5S_SELECT_SET, start, nullptr, counts, nullptr),
        ErrorCode::kInternal, "H5Sselect_hyperslab"));
  }
  return spaces;
}

// The transfer property list: MPI-IO collective transfers on a collective file.
Result<PropListHandle> TransferProperties(bool collective) {
  ZINF_ASSIGN_OR_RETURN(
      PropListHandle dxpl,
      Check<PropListHandle>(H5Pcreate(H5P_DATASET_XFER), ErrorCode::kInternal, "H5Pcreate(dxpl)"));
  if (collective) {
    ZINF_RETURN_IF_ERROR(CheckErr(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE),
                                  ErrorCode::kInternal, "H5Pset_dxpl_mpio"));
  }
  return dxpl;
}

}  // namespace

template <typename T>
Status H5File::TransferSlab(std::string_view dataset, std::uint64_t offset, std::span<T> data) {
  constexpr bool kWrite = std::is_const_v<T>;
  constexpr H5DataType kType = kTypeOf<std::remove_const_t<T>>;
  const char* const op = kWrite ? "write" : "read";
  const std::uint64_t count = data.size();

  // Everything that can fail locally happens before the collective H5Dwrite/H5Dread, and the
  // ranks agree on it first: a rank that skipped the transfer would leave the others blocked.
  std::string path;
  DatasetHandle ds;
  SlabSpaces spaces;
  PropListHandle dxpl;
  const Status prepared = [&]() -> Status {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, kWrite, path_, op));
    ZINF_ASSIGN_OR_RETURN(path, NormalizeName(dataset, false));
    ZINF_ASSIGN_OR_RETURN(ds, OpenDataset(impl_->file.get(), path, path_));
    ZINF_ASSIGN_OR_RETURN(const DatasetInfo info, GetDatasetInfo(ds.get(), path, path_));
    if (info.type != kType) {
      return InvalidArgumentError(fmt::format("{} {} in {}: dataset holds {}, the buffer {}", op,
                                              path, path_, H5DataTypeName(info.type),
                                              H5DataTypeName(kType)));
    }
    if (count > info.numel || offset > info.numel - count) {
      return InvalidArgumentError(
          fmt::format("{} {} elements [{}, {}) in {}: outside the dataset's {} elements", op, path,
                      offset, offset + count, path_, info.numel));
    }
    ZINF_ASSIGN_OR_RETURN(spaces, SelectSlab(ds.get(), offset, count));
    ZINF_ASSIGN_OR_RETURN(dxpl, TransferProperties(is_collective()));
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(Agree(prepared));

  // HDF5 rejects a null buffer unless nothing is selected; an empty span may carry one anyway.
  std::remove_const_t<T> dummy{};
  herr_t rc;
  if constexpr (kWrite) {
    const void* buffer = data.empty() ? &dummy : static_cast<const void*>(data.data());
    rc =
        H5Dwrite(ds.get(), MemType(kType), spaces.mem.get(), spaces.file.get(), dxpl.get(), buffer);
  } else {
    void* buffer = data.empty() ? &dummy : static_cast<void*>(data.data());
    rc = H5Dread(ds.get(), MemType(kType), spaces.mem.get(), spaces.file.get(), dxpl.get(), buffer);
  }
  Status local = CheckErr(
      rc, ErrorCode::kDataLoss,
      fmt::format("{}: H5D{} {} elements [{}, {})", path_, op, path, offset, offset + count));
  last_transfer_mode_ = H5TransferMode::kNotCollective;
  if (local && is_collective()) last_transfer_mode_ = ActualTransferMode(dxpl.get());
  if (local) local = ds.Close(fmt::format("{}: H5Dclose {}", path_, path), ErrorCode::kDataLoss);
  return Agree(local);
}

Status H5File::WriteSlab(std::string_view dataset, std::uint64_t offset,
                         std::span<const float> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::WriteSlab(std::string_view dataset, std::uint64_t offset,
                         std::span<const std::uint64_t> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::WriteSlab(std::string_view dataset, std::uint64_t offset,
                         std::span<const std::int64_t> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::ReadSlab(std::string_view dataset, std::uint64_t offset, std::span<float> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::WriteSlab(std::string_view dataset, std::uint64_t offset,
                         std::span<const std::uint8_t> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::ReadSlab(std::string_view dataset, std::uint64_t offset,
                        std::span<std::uint8_t> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::ReadSlab(std::string_view dataset, std::uint64_t offset,
                        std::span<std::uint64_t> data) {
  return TransferSlab(dataset, offset, data);
}
Status H5File::ReadSlab(std::string_view dataset, std::uint64_t offset,
                        std::span<std::int64_t> data) {
  return TransferSlab(dataset, offset, data);
}

// ---- Groups ----

Status H5File::CreateGroup(std::string_view name) {
  std::string path;
  bool exists = false;
  PropListHandle lcpl;
  const Status prepared = [&]() -> Status {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, true, path_, "create group"));
    ZINF_ASSIGN_OR_RETURN(path, NormalizeName(name, true));
    Result<H5O_type_t> type = ObjectType(impl_->file.get(), path, path_);
    if (type) {
      if (*type != H5O_TYPE_GROUP) {
        return AlreadyExistsError(
            fmt::format("create group {} in {}: exists and is not a group", path, path_));
      }
      exists = true;
      return OkStatus();
    }
    if (type.error().code() != ErrorCode::kNotFound) return ToStatus(type.error());
    ZINF_ASSIGN_OR_RETURN(lcpl, Check<PropListHandle>(H5Pcreate(H5P_LINK_CREATE),
                                                      ErrorCode::kInternal, "H5Pcreate(lcpl)"));
    return CheckErr(H5Pset_create_intermediate_group(lcpl.get(), 1), ErrorCode::kInternal,
                    "H5Pset_create_intermediate_group");
  }();
  ZINF_RETURN_IF_ERROR(Agree(prepared));
  if (exists) return OkStatus();
  Result<handles::GroupHandle> group = Check<handles::GroupHandle>(
      H5Gcreate2(impl_->file.get(), path.c_str(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
      ErrorCode::kDataLoss, fmt::format("{}: H5Gcreate {}", path_, path));
  Status local = StatusOf(group);
  if (group) local = group->Close(fmt::format("{}: H5Gclose {}", path_, path));
  return Agree(local);
}

// ---- Attributes ----

namespace {

// A scalar attribute value ready to be written: its file type and bytes.
struct AttributeValue {
  DatatypeHandle owned_type;  // for strings; numbers use predefined types
  hid_t file_type = H5I_INVALID_HID;
  hid_t mem_type = H5I_INVALID_HID;
  std::vector<char> bytes;
};

Result<AttributeValue> StringValue(std::string_view value) {
  AttributeValue out;
  ZINF_ASSIGN_OR_RETURN(out.owned_type,
                        Check<DatatypeHandle>(H5Tcopy(H5T_C_S1), ErrorCode::kInternal, "H5Tcopy"));
  const hid_t type = out.owned_type.get();
  ZINF_RETURN_IF_ERROR(
      CheckErr(H5Tset_size(type, value.size() + 1), ErrorCode::kInternal, "H5Tset_size"));
  ZINF_RETURN_IF_ERROR(
      CheckErr(H5Tset_strpad(type, H5T_STR_NULLTERM), ErrorCode::kInternal, "H5Tset_strpad"));
  ZINF_RETURN_IF_ERROR(
      CheckErr(H5Tset_cset(type, H5T_CSET_UTF8), ErrorCode::kInternal, "H5Tset_cset"));
  out.file_type = type;
  out.mem_type = type;
  out.bytes.assign(value.begin(), value.end());
  out.bytes.push_back('\0');
  return out;
}

template <typename T>
AttributeValue NumberValue(T value, hid_t file_type, hid_t mem_type) {
  AttributeValue out;
  out.file_type = file_type;
  out.mem_type = mem_type;
  out.bytes.resize(sizeof(T));
  std::memcpy(out.bytes.data(), &value, sizeof(T));
  return out;
}

}  // namespace

namespace {

// Writes `value` as attribute `name` of `object`, replacing an existing one. The local checks
// and the metadata operations are separated by an agreement, as for datasets.
// `file` is only used when `usable` is OK.
Status WriteAttribute(const Status& usable, hid_t file, const std::string& file_path,
                      std::string_view object, std::string_view name,
                      const std::function<Result<AttributeValue>()>& make_value,
                      const std::function<Status(const Status&)>& agree) {
  std::string path;
  DataspaceHandle space;
  Result<AttributeValue> value = InternalError("attribute value not made");
  const Status prepared = [&]() -> Status {
    ZINF_RETURN_IF_ERROR(usable);
    value = make_value();
    ZINF_RETURN_IF_ERROR(StatusOf(value));
    ZINF_ASSIGN_OR_RETURN(path, NormalizeName(object, true));
    if (name.empty()) return InvalidArgumentError("empty attribute name");
    ZINF_RETURN_IF_ERROR(StatusOf(ObjectType(file, path, file_path)));
    ZINF_ASSIGN_OR_RETURN(
        space, Check<DataspaceHandle>(H5Screate(H5S_SCALAR), ErrorCode::kInternal, "H5Screate"));
    return OkStatus();
  }();
  ZINF_RETURN_IF_ERROR(agree(prepared));

  const std::string attr_name(name);
  const std::string what = fmt::format("{}: attribute {} of {}", file_path, attr_name, path);
  const Status local = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(ObjectHandle obj,
                          Check<ObjectHandle>(H5Oopen(file, path.c_str(), H5P_DEFAULT),
                                              ErrorCode::kInternal, what + ": H5Oopen"));
    const htri_t exists = H5Aexists(obj.get(), attr_name.c_str());
    if (exists < 0) return StackError(ErrorCode::kInternal, what + ": H5Aexists");
    if (exists > 0) {
      ZINF_RETURN_IF_ERROR(CheckErr(H5Adelete(obj.get(), attr_name.c_str()), ErrorCode::kDataLoss,
                                    what + ": H5Adelete"));
    }
    ZINF_ASSIGN_OR_RETURN(
        AttributeHandle attr,
        Check<AttributeHandle>(H5Acreate2(obj.get(), attr_name.c_str(), value->file_type,
                                          space.get(), H5P_DEFAULT, H5P_DEFAULT),
                               ErrorCode::kDataLoss, what + ": H5Acreate"));
    ZINF_RETURN_IF_ERROR(CheckErr(H5Awrite(attr.get(), value->mem_type, value->bytes.data()),
                                  ErrorCode::kDataLoss, what + ": H5Awrite"));
    ZINF_RETURN_IF_ERROR(attr.Close(what + ": H5Aclose", ErrorCode::kDataLoss));
    return obj.Close(what + ": H5Oclose");
  }();
  return agree(local);
}

// Opens attribute `name` of `object` and checks that it holds one element.
Result<AttributeHandle> OpenScalarAttribute(hid_t file, const std::string& file_path,
                                            std::string_view object, std::string_view name) {
  ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(object, true));
  if (name.empty()) return InvalidArgumentError("empty attribute name");
  ZINF_RETURN_IF_ERROR(StatusOf(ObjectType(file, path, file_path)));
  const std::string attr_name(name);
  const std::string what = fmt::format("{}: attribute {} of {}", file_path, attr_name, path);
  const htri_t exists = H5Aexists_by_name(file, path.c_str(), attr_name.c_str(), H5P_DEFAULT);
  if (exists < 0) return StackError(ErrorCode::kInternal, what + ": H5Aexists");
  if (exists == 0) return NotFoundError(what + ": no such attribute");
  ZINF_ASSIGN_OR_RETURN(
      AttributeHandle attr,
      Check<AttributeHandle>(
          H5Aopen_by_name(file, path.c_str(), attr_name.c_str(), H5P_DEFAULT, H5P_DEFAULT),
          ErrorCode::kInternal, what + ": H5Aopen"));
  ZINF_ASSIGN_OR_RETURN(DataspaceHandle space,
                        Check<DataspaceHandle>(H5Aget_space(attr.get()), ErrorCode::kInternal,
                                               what + ": H5Aget_space"));
  const hssize_t npoints = H5Sget_simple_extent_npoints(space.get());
  if (npoints < 0) return StackError(ErrorCode::kInternal, what + ": H5Sget_simple_extent_npoints");
  if (npoints != 1) {
    return InvalidArgumentError(
        fmt::format("{}: holds {} elements, not a single value", what, npoints));
  }
  return attr;
}

Result<H5T_class_t> AttributeClass(hid_t attr, DatatypeHandle* type, const std::string& what) {
  ZINF_ASSIGN_OR_RETURN(*type, Check<DatatypeHandle>(H5Aget_type(attr), ErrorCode::kInternal,
                                                     what + ": H5Aget_type"));
  const H5T_class_t cls = H5Tget_class(type->get());
  if (cls == H5T_NO_CLASS) return StackError(ErrorCode::kInternal, what + ": H5Tget_class");
  return cls;
}

std::string_view ClassName(H5T_class_t cls) {
  switch (cls) {
    case H5T_INTEGER:
      return "an integer";
    case H5T_FLOAT:
      return "a floating-point number";
    case H5T_STRING:
      return "a string";
    default:
      return "another type";
  }
}

}  // namespace

Status H5File::WriteStringAttribute(std::string_view object, std::string_view name,
                                    std::string_view value) {
  return WriteAttribute(
      CheckUsable(is_open(), read_only_, true, path_, "write attribute"),
      is_open() ? impl_->file.get() : H5I_INVALID_HID, path_, object, name,
      [&]() -> Result<AttributeValue> { return StringValue(value); },
      [this](const Status& s) { return Agree(s); });
}

Status H5File::WriteInt64Attribute(std::string_view object, std::string_view name,
                                   std::int64_t value) {
  return WriteAttribute(
      CheckUsable(is_open(), read_only_, true, path_, "write attribute"),
      is_open() ? impl_->file.get() : H5I_INVALID_HID, path_, object, name,
      [&]() -> Result<AttributeValue> {
        return NumberValue(value, H5T_STD_I64LE, H5T_NATIVE_INT64);
      },
      [this](const Status& s) { return Agree(s); });
}

Status H5File::WriteDoubleAttribute(std::string_view object, std::string_view name, double value) {
  return WriteAttribute(
      CheckUsable(is_open(), read_only_, true, path_, "write attribute"),
      is_open() ? impl_->file.get() : H5I_INVALID_HID, path_, object, name,
      [&]() -> Result<AttributeValue> {
        return NumberValue(value, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE);
      },
      [this](const Status& s) { return Agree(s); });
}

Result<std::string> H5File::ReadStringAttribute(std::string_view object, std::string_view name,
                                                std::uint64_t max_bytes) {
  Result<std::string> local = [&]() -> Result<std::string> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "read attribute"));
    const hid_t file = impl_->file.get();
    const std::string what = fmt::format("{}: attribute {} of {}", path_, name, object);
    ZINF_ASSIGN_OR_RETURN(AttributeHandle attr, OpenScalarAttribute(file, path_, object, name));
    DatatypeHandle type;
    ZINF_ASSIGN_OR_RETURN(const H5T_class_t cls, AttributeClass(attr.get(), &type, what));
    if (cls != H5T_STRING) {
      return InvalidArgumentError(fmt::format("{}: is {}, not a string", what, ClassName(cls)));
    }
    const htri_t variable = H5Tis_variable_str(type.get());
    if (variable < 0) return StackError(ErrorCode::kInternal, what + ": H5Tis_variable_str");
    if (variable > 0) {
      char* text = nullptr;
      ZINF_RETURN_IF_ERROR(CheckErr(H5Aread(attr.get(), type.get(), &text), ErrorCode::kDataLoss,
                                    what + ": H5Aread"));
      std::string out = text != nullptr ? text : "";
      H5free_memory(text);
      if (out.size() > max_bytes) {
        return InvalidArgumentError(
            fmt::format("{}: a string of {} bytes, more than {}", what, out.size(), max_bytes));
      }
      return out;
    }
    const std::size_t size = H5Tget_size(type.get());
    if (size == 0) return StackError(ErrorCode::kInternal, what + ": H5Tget_size");
    if (size > max_bytes + 1) {
      return InvalidArgumentError(
          fmt::format("{}: a string of {} bytes, more than {}", what, size, max_bytes));
    }
    std::string out(size, '\0');
    ZINF_RETURN_IF_ERROR(CheckErr(H5Aread(attr.get(), type.get(), out.data()), ErrorCode::kDataLoss,
                                  what + ": H5Aread"));
    out.resize(std::min(out.find('\0'), out.size()));
    return out;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<std::int64_t> H5File::ReadInt64Attribute(std::string_view object, std::string_view name) {
  Result<std::int64_t> local = [&]() -> Result<std::int64_t> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "read attribute"));
    const std::string what = fmt::format("{}: attribute {} of {}", path_, name, object);
    ZINF_ASSIGN_OR_RETURN(AttributeHandle attr,
                          OpenScalarAttribute(impl_->file.get(), path_, object, name));
    DatatypeHandle type;
    ZINF_ASSIGN_OR_RETURN(const H5T_class_t cls, AttributeClass(attr.get(), &type, what));
    if (cls != H5T_INTEGER) {
      return InvalidArgumentError(fmt::format("{}: is {}, not an integer", what, ClassName(cls)));
    }
    // Converting to int64 would silently clip a large unsigned value, so read those as uint64.
    if (H5Tget_sign(type.get()) == H5T_SGN_NONE) {
      std::uint64_t value = 0;
      ZINF_RETURN_IF_ERROR(CheckErr(H5Aread(attr.get(), H5T_NATIVE_UINT64, &value),
                                    ErrorCode::kDataLoss, what + ": H5Aread"));
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return InvalidArgumentError(fmt::format("{}: {} does not fit in int64", what, value));
      }
      return static_cast<std::int64_t>(value);
    }
    std::int64_t value = 0;
    ZINF_RETURN_IF_ERROR(CheckErr(H5Aread(attr.get(), H5T_NATIVE_INT64, &value),
                                  ErrorCode::kDataLoss, what + ": H5Aread"));
    return value;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<double> H5File::ReadDoubleAttribute(std::string_view object, std::string_view name) {
  Result<double> local = [&]() -> Result<double> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "read attribute"));
    const std::string what = fmt::format("{}: attribute {} of {}", path_, name, object);
    ZINF_ASSIGN_OR_RETURN(AttributeHandle attr,
                          OpenScalarAttribute(impl_->file.get(), path_, object, name));
    DatatypeHandle type;
    ZINF_ASSIGN_OR_RETURN(const H5T_class_t cls, AttributeClass(attr.get(), &type, what));
    if (cls != H5T_FLOAT) {
      return InvalidArgumentError(
          fmt::format("{}: is {}, not a floating-point number", what, ClassName(cls)));
    }
    double value = 0;
    ZINF_RETURN_IF_ERROR(CheckErr(H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &value),
                                  ErrorCode::kDataLoss, what + ": H5Aread"));
    return value;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

Result<bool> H5File::HasAttribute(std::string_view object, std::string_view name) {
  Result<bool> local = [&]() -> Result<bool> {
    ZINF_RETURN_IF_ERROR(CheckUsable(is_open(), read_only_, false, path_, "look up attribute"));
    ZINF_ASSIGN_OR_RETURN(const std::string path, NormalizeName(object, true));
    if (name.empty()) return InvalidArgumentError("empty attribute name");
    const hid_t file = impl_->file.get();
    ZINF_RETURN_IF_ERROR(StatusOf(ObjectType(file, path, path_)));
    const std::string attr_name(name);
    const htri_t exists = H5Aexists_by_name(file, path.c_str(), attr_name.c_str(), H5P_DEFAULT);
    if (exists < 0) {
      return StackError(ErrorCode::kInternal,
                        fmt::format("{}: H5Aexists {} of {}", path_, attr_name, path));
    }
    return exists > 0;
  }();
  ZINF_RETURN_IF_ERROR(Agree(StatusOf(local)));
  return local;
}

}  // namespace zinf::h5
