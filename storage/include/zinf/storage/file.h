// File: an owned file descriptor opened for backend I/O, with what the backends need to know about
// it: its path (for error messages), whether it is O_DIRECT, and the direct-I/O alignment.
//
// Alignment comes from the file system: statx(STATX_DIOALIGN) where the kernel has it, else the
// block device's logical block size, else 4096. File systems without O_DIRECT (tmpfs) are opened
// buffered: direct() is false, alignment() is 1, and durability comes from Sync() (fdatasync).
//
// Move-only. The destructor closes the descriptor and ignores errors; call Close() to see them.
#pragma once

#include <cstdint>
#include <string>

#include "zinf/core/status.h"
#include "zinf/storage/fs.h"

namespace zinf::storage {

enum class OpenMode {
  kRead,          // existing file, read only
  kReadWrite,     // existing file, read and write
  kCreate,        // create a new file (O_EXCL), read and write; fails if it exists
  kCreateOrOpen,  // create if missing, else open; read and write
};

struct OpenOptions {
  OpenMode mode = OpenMode::kRead;
  bool direct = true;           // try O_DIRECT; falls back to buffered where it is unsupported
  bool no_follow = true;        // O_NOFOLLOW: refuse a symlink as the last path component
  unsigned permissions = 0600;  // for created files
};

class File {
 public:
  // Errors: NotFound, AlreadyExists, FailedPrecondition (symlink refused, permission), with path.
  static Result<File> Open(const std::string& path, const OpenOptions& options);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const { return fd_.valid(); }
  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  bool writable() const { return writable_; }
  // Required alignment (bytes) of buffer addresses, offsets and lengths for I/O on this file.
  std::uint64_t alignment() const { return alignment_; }

  Result<std::uint64_t> Size() const;
  // fallocate(0, offset, length): reserves blocks so that later writes cannot hit ENOSPC.
  // Falls back to posix_fallocate where fallocate is unsupported.
  Status Allocate(std::uint64_t offset_bytes, std::uint64_t length_bytes);
  Status Truncate(std::uint64_t size_bytes);
  // fdatasync (retried on EINTR).
  Status Sync();
  Status Close();

 private:
  UniqueFd fd_;
  std::string path_;
  bool direct_ = false;
  bool writable_ = false;
  std::uint64_t alignment_ = 1;
};

// The direct-I/O alignment for files in `dir` (see above) and whether O_DIRECT works there
// (probed by opening a temporary file with O_DIRECT). Errors: NotFound if `dir` does not exist.
struct DirectIoInfo {
  bool direct_supported = false;
  std::uint64_t memory_alignment = 4096;  // buffer address alignment
  std::uint64_t offset_alignment = 4096;  // file offset and length alignment
  std::string source;                     // "statx", "logical_block_size", "default"
};
Result<DirectIoInfo> ProbeDirectIo(const std::string& dir);

}  // namespace zinf::storage
