#include "zinf/storage/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "zinf/core/log.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"

namespace zinf::storage {
namespace {

// Our own copy of the kernel's struct statx and STATX_DIOALIGN (Linux 6.1): older C library
// headers lack the direct-I/O fields, and one code path is easier to trust than two.
constexpr unsigned kStatxDioAlign = 0x00002000U;
struct KernelStatxTimestamp {
  std::int64_t tv_sec;
  std::uint32_t tv_nsec;
  std::int32_t reserved;
};
struct KernelStatx {
  std::uint32_t stx_mask;
  std::uint32_t stx_blksize;
  std::uint64_t stx_attributes;
  std::uint32_t stx_nlink;
  std::uint32_t stx_uid;
  std::uint32_t stx_gid;
  std::uint16_t stx_mode;
  std::uint16_t spare0;
  std::uint64_t stx_ino;
  std::uint64_t stx_size;
  std::uint64_t stx_blocks;
  std::uint64_t stx_attributes_mask;
  KernelStatxTimestamp stx_atime;
  KernelStatxTimestamp stx_btime;
  KernelStatxTimestamp stx_ctime;
  KernelStatxTimestamp stx_mtime;
  std::uint32_t stx_rdev_major;
  std::uint32_t stx_rdev_minor;
  std::uint32_t stx_dev_major;
  std::uint32_t stx_dev_minor;
  std::uint64_t stx_mnt_id;
  std::uint32_t stx_dio_mem_align;
  std::uint32_t stx_dio_offset_align;
  std::uint64_t spare3[12];
};
static_assert(sizeof(KernelStatx) == 256, "struct statx is 256 bytes in every kernel ABI");

struct Alignment {
  bool known_unsupported = false;  // statx says the file system has no O_DIRECT
  std::uint64_t memory = 4096;
  std::uint64_t offset = 4096;
  std::string source = "default";
};

std::uint64_t ReadSysfsNumber(const std::string& path) {
  std::ifstream in(path);
  std::uint64_t value = 0;
  if (in >> value) return value;
  return 0;
}

Alignment AlignmentOf(int fd) {
  Alignment out;
  KernelStatx stx{};
  if (::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, kStatxDioAlign, &stx) == 0 &&
      (stx.stx_mask & kStatxDioAlign) != 0) {
    out.source = "statx";
    if (stx.stx_dio_offset_align == 0 || stx.stx_dio_mem_align == 0) {
      out.known_unsupported = true;
    } else {
      out.memory = stx.stx_dio_mem_align;
      out.offset = stx.stx_dio_offset_align;
    }
    return out;
  }
  struct stat st {};
  if (Env::Default().StatAt(fd, "", &st, AT_EMPTY_PATH) == 0 && major(st.st_dev) != 0) {
    const std::string base =
        fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev));
    std::uint64_t size = ReadSysfsNumber(base + "/queue/logical_block_size");
    // A partition has no queue of its own; its disk's is one level up.
    if (size == 0) size = ReadSysfsNumber(base + "/../queue/logical_block_size");
    if (size != 0 && (size & (size - 1)) == 0) {
      out.memory = size;
      out.offset = size;
      out.source = "logical_block_size";
    }
  }
  return out;
}

// Turns on O_DIRECT for an open descriptor; false where the file system refuses it.
Result<bool> EnableDirect(int fd, const std::string& path) {
  Env& env = Env::Default();
  const int flags = env.Fcntl(fd, F_GETFL, 0);
  if (flags < 0) return ErrnoError(errno, fmt::format("fcntl(F_GETFL) {}", path));
  if (env.Fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) return true;
  if (errno == EINVAL) return false;
  return ErrnoError(errno, fmt::format("fcntl(F_SETFL, O_DIRECT) {}", path));
}

Status DisableDirect(int fd, const std::string& path) {
  Env& env = Env::Default();
  const int flags = env.Fcntl(fd, F_GETFL, 0);
  if (flags < 0) return ErrnoError(errno, fmt::format("fcntl(F_GETFL) {}", path));
  if (env.Fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) {
    return ErrnoError(errno, fmt::format("fcntl(F_SETFL) {}", path));
  }
  return OkStatus();
}

void WarnBufferedOnce(const std::string& path) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  ZINF_LOG_WARN(
      "{}: the file system does not support O_DIRECT; using buffered I/O with fdatasync at "
      "durability points",
      path);
}

}  // namespace

Result<File> File::Open(const std::string& path, const OpenOptions& options) {
  // O_NONBLOCK: opening a FIFO must not wait for its writer; it is refused below and the flag
  // cleared for the regular file or block device that is accepted.
  int flags = O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  if (options.no_follow) flags |= O_NOFOLLOW;
  bool writable = true;
  switch (options.mode) {
    case OpenMode::kRead:
      flags |= O_RDONLY;
      writable = false;
      break;
    case OpenMode::kReadWrite:
      flags |= O_RDWR;
      break;
    case OpenMode::kCreate:
      flags |= O_RDWR | O_CREAT | O_EXCL;
      break;
    case OpenMode::kCreateOrOpen:
      flags |= O_RDWR | O_CREAT;
      break;
  }
  // O_DIRECT is switched on afterwards with fcntl: where the file system refuses it, open(O_CREAT)
  // could already have made the file, and a second open with O_EXCL would then fail.
  int fd = -1;
  do {
    fd = Env::Default().OpenAt(AT_FDCWD, path.c_str(), flags,
                               static_cast<mode_t>(options.permissions));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP && options.no_follow) {
      return Error(ErrorCode::kFailedPrecondition,
                   fmt::format("open {}: refusing symlink (O_NOFOLLOW)", path), err);
    }
    return ErrnoError(err, fmt::format("open {}", path));
  }
  File file;
  file.fd_.Reset(fd);
  file.path_ = path;
  file.writable_ = writable;

  struct stat st {};
  if (Env::Default().StatAt(fd, "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("fstat {}", path));
  }
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    return Error(ErrorCode::kFailedPrecondition,
                 fmt::format("open {}: not a regular file or block device", path), EISDIR);
  }
  ZINF_RETURN_IF_ERROR(ClearNonBlock(fd, path));
  if (options.direct) {
    ZINF_ASSIGN_OR_RETURN(bool direct, EnableDirect(fd, path));
    Alignment alignment;
    if (direct) {
      alignment = AlignmentOf(fd);
      if (alignment.known_unsupported) {
        ZINF_RETURN_IF_ERROR(DisableDirect(fd, path));
        direct = false;
      }
    }
    if (direct) {
      file.direct_ = true;
      file.alignment_ = std::max(alignment.memory, alignment.offset);
    } else {
      WarnBufferedOnce(path);
    }
  }
  return file;
}

File::File(File&& other) noexcept
    : fd_(std::move(other.fd_)),
      path_(std::move(other.path_)),
      direct_(std::exchange(other.direct_, false)),
      writable_(std::exchange(other.writable_, false)),
      alignment_(std::exchange(other.alignment_, 1)) {
  other.path_.clear();
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
    other.path_.clear();
    direct_ = std::exchange(other.direct_, false);
    writable_ = std::exchange(other.writable_, false);
    alignment_ = std::exchange(other.alignment_, 1);
  }
  return *this;
}

File::~File() = default;

Result<std::uint64_t> File::Size() const {
  struct stat st {};
  if (Env::Default().StatAt(fd_.get(), "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("fstat {}", path_));
  }
  return static_cast<std::uint64_t>(st.st_size);
}

Status File::Allocate(std::uint64_t offset_bytes, std::uint64_t length_bytes) {
  if (length_bytes == 0) return OkStatus();
  const auto offset = static_cast<off_t>(offset_bytes);
  const auto length = static_cast<off_t>(length_bytes);
  int rc = 0;
  do {
    rc = Env::Default().Allocate(fd_.get(), 0, offset, length);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return OkStatus();
  int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS) {
    // posix_fallocate writes zeros where the file system has no fallocate.
    do {
      err = ::posix_fallocate(fd_.get(), offset, length);
    } while (err == EINTR);
    if (err == 0) return OkStatus();
  }
  return ErrnoError(
      err, fmt::format("fallocate {} offset {} length {}", path_, offset_bytes, length_bytes));
}

Status File::Truncate(std::uint64_t size_bytes) {
  int rc = 0;
  do {
    rc = Env::Default().Truncate(fd_.get(), static_cast<off_t>(size_bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return ErrnoError(errno, fmt::format("ftruncate {} to {}", path_, size_bytes));
  return OkStatus();
}

Status File::Sync() { return SyncFd(fd_.get(), /*data_only=*/true, path_); }

Status File::Close() { return fd_.Close(path_); }

Result<DirectIoInfo> ProbeDirectIo(const std::string& dir) {
  Env& env = Env::Default();
  struct stat st {};
  if (env.StatAt(AT_FDCWD, dir.c_str(), &st, 0) != 0) {
    return ErrnoError(errno, fmt::format("stat {}", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return Error(ErrorCode::kFailedPrecondition, fmt::format("{} is not a directory", dir),
                 ENOTDIR);
  }
  static std::atomic<int> counter{0};
  const std::string path =
      fmt::format("{}/.zinf-dio-probe-{}-{}", dir, ::getpid(), counter.fetch_add(1));
  int fd = -1;
  do {
    fd = env.OpenAt(AT_FDCWD, path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                    0600);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoError(errno, fmt::format("create probe file {}", path));
  (void)env.UnlinkAt(AT_FDCWD, path.c_str(), 0);  // a leftover probe file harms nothing
  Result<bool> direct = EnableDirect(fd, path);
  Alignment alignment = AlignmentOf(fd);
  (void)env.Close(fd);
  if (!direct) return std::move(direct).error();
  DirectIoInfo info;
  info.direct_supported = *direct && !alignment.known_unsupported;
  info.memory_alignment = alignment.memory;
  info.offset_alignment = alignment.offset;
  info.source = alignment.source;
  return info;
}

}  // namespace zinf::storage
