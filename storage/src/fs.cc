#include "zinf/storage/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "zinf/storage/env.h"

namespace zinf::storage {
namespace {

// open(2) flags for `access`, without the flags every open gets.
int AccessFlags(FileAccess access) {
  switch (access) {
    case FileAccess::kRead:
      return O_RDONLY;
    case FileAccess::kReadWrite:
      return O_RDWR;
    case FileAccess::kCreateNew:
      return O_RDWR | O_CREAT | O_EXCL;
    case FileAccess::kAppendOrCreate:
      return O_WRONLY | O_CREAT | O_APPEND;
    case FileAccess::kTruncateOrCreate:
      return O_WRONLY | O_CREAT | O_TRUNC;
  }
  return O_RDONLY;
}

// The error for an open that failed with `err`: a refused symbolic link is named as such.
Error OpenError(int err, int dir_fd, const std::string& name, const std::string& display,
                Follow follow, std::string_view what) {
  if (follow == Follow::kNo && (err == ELOOP || err == ENOTDIR || err == EEXIST)) {
    struct stat st {};
    if (Env::Default().StatAt(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISLNK(st.st_mode)) {
      return Error(ErrorCode::kFailedPrecondition,
                   fmt::format("{} {}: is a symbolic link; refusing to follow it", what, display),
                   ELOOP);
    }
  }
  return ErrnoError(err, fmt::format("{} {}", what, display));
}

std::string_view TypeName(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

std::atomic<std::uint64_t> g_temp_counter{0};

}  // namespace

Result<DirectoryListing> ListDirectory(int dir_fd, const std::string& display,
                                       std::size_t max_entries) {
  DirectoryListing listing;
  if (Env::Default().ReadDir(dir_fd, max_entries, &listing.names) != 0) {
    return ErrnoError(errno, fmt::format("readdir {}", display));
  }
  if (listing.names.size() > max_entries) {
    listing.names.resize(max_entries);
    listing.truncated = true;
  }
  return listing;
}

Status ClearNonBlock(int fd, const std::string& display) {
  Env& env = Env::Default();
  const int flags = env.Fcntl(fd, F_GETFL, 0);
  if (flags < 0 || env.Fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoError(errno, fmt::format("fcntl {}", display));
  }
  return OkStatus();
}

// ---- UniqueFd ----

UniqueFd::UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) Reset(std::exchange(other.fd_, -1));
  return *this;
}

UniqueFd::~UniqueFd() { Reset(); }

int UniqueFd::Release() { return std::exchange(fd_, -1); }

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) Env::Default().Close(fd_);  // errors ignored: Close() reports them
  fd_ = fd;
}

Status UniqueFd::Close(std::string_view what) {
  if (fd_ < 0) return OkStatus();
  if (Env::Default().Close(std::exchange(fd_, -1)) != 0 && errno != EINTR) {
    return ErrnoError(errno, fmt::format("close {}", what));
  }
  return OkStatus();
}

// ---- Opening ----

namespace {

int Retried(auto open_call) {
  int fd;
  do {
    fd = open_call();
  } while (fd < 0 && errno == EINTR);
  return fd;
}

Error NotRegularError(std::string_view what, const std::string& display, mode_t mode) {
  if (S_ISLNK(mode)) {
    return Error(ErrorCode::kFailedPrecondition,
                 fmt::format("{} {}: is a symbolic link; refusing to follow it", what, display),
                 ELOOP);
  }
  return Error(ErrorCode::kFailedPrecondition,
               fmt::format("{} {}: {}, not a regular file", what, display, TypeName(mode)),
               S_ISDIR(mode) ? EISDIR : EINVAL);
}

// What an output would replace at `name` (never followed): nothing (false), a regular file
// (true), a symbolic link (true, when `links_too`); anything else is refused.
Result<bool> ReplaceableAt(int dir_fd, const std::string& name, const std::string& display,
                           bool links_too) {
  struct stat st {};
  if (Env::Default().StatAt(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    return ErrnoError(errno, fmt::format("stat {}", display));
  }
  if (S_ISREG(st.st_mode) || (links_too && S_ISLNK(st.st_mode))) return true;
  return Error(ErrorCode::kFailedPrecondition,
               fmt::format("{}: {}, not a regular file; an output never replaces one", display,
                           TypeName(st.st_mode)),
               S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
}

// Creates `name` exclusively with `flags` (an access mode, O_CREAT among them): a regular file
// that did not exist, never something that was there already, never through a link.
Result<UniqueFd> CreateExclusiveAt(int dir_fd, const std::string& name, const std::string& display,
                                   int flags, unsigned mode) {
  const int fd = Retried([&] {
    return Env::Default().OpenAt(dir_fd, name.c_str(),
                                 flags | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY,
                                 static_cast<mode_t>(mode));
  });
  if (fd < 0) return OpenError(errno, dir_fd, name, display, Follow::kNo, "create");
  return UniqueFd(fd);
}

// Opens for real the regular file `path_fd` (an O_PATH descriptor of it, whose fstat is `seen`)
// refers to: through /proc/self/fd, which reaches that very inode whatever happened to the name
// since; without /proc, by name again, refused unless it is still the same inode.
Result<UniqueFd> ReopenRegular(const UniqueFd& path_fd, const struct stat& seen, int dir_fd,
                               const std::string& name, const std::string& display, int flags,
                               Follow follow) {
  flags |= O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  const std::string proc = fmt::format("/proc/self/fd/{}", path_fd.get());
  int fd = Retried([&] { return Env::Default().OpenAt(AT_FDCWD, proc.c_str(), flags, 0); });
  if (fd < 0 && errno == ENOENT) {
    if (follow == Follow::kNo) flags |= O_NOFOLLOW;
    fd = Retried([&] { return Env::Default().OpenAt(dir_fd, name.c_str(), flags, 0); });
  }
  if (fd < 0) return OpenError(errno, dir_fd, name, display, follow, "open");
  UniqueFd owned(fd);
  struct stat st {};
  if (Env::Default().StatAt(fd, "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("fstat {}", display));
  }
  if (st.st_dev != seen.st_dev || st.st_ino != seen.st_ino || !S_ISREG(st.st_mode)) {
    return Error(ErrorCode::kFailedPrecondition,
                 fmt::format("open {}: replaced by something else while being opened", display),
                 EAGAIN);
  }
  ZINF_RETURN_IF_ERROR(ClearNonBlock(fd, display));
  return owned;
}

}  // namespace

Result<UniqueFd> OpenFileAt(int dir_fd, const std::string& name, const std::string& display,
                            FileAccess access, Follow follow, unsigned mode) {
  if (name.empty()) return InvalidArgumentError("open: empty file name");
  const int flags = AccessFlags(access);
  if (access == FileAccess::kCreateNew) {
    return CreateExclusiveAt(dir_fd, name, display, flags, mode);
  }
  const bool may_create = (flags & O_CREAT) != 0;
  // A name that appears between the look and the exclusive create is looked at again.
  for (int attempt = 0;; ++attempt) {
    const int path_fd = Retried([&] {
      return Env::Default().OpenAt(
          dir_fd, name.c_str(), O_PATH | O_CLOEXEC | (follow == Follow::kNo ? O_NOFOLLOW : 0), 0);
    });
    if (path_fd >= 0) {
      UniqueFd looked_at(path_fd);
      struct stat st {};
      if (Env::Default().StatAt(path_fd, "", &st, AT_EMPTY_PATH) != 0) {
        return ErrnoError(errno, fmt::format("fstat {}", display));
      }
      if (!S_ISREG(st.st_mode)) return NotRegularError("open", display, st.st_mode);
      return ReopenRegular(looked_at, st, dir_fd, name, display, flags & ~O_CREAT, follow);
    }
    if (errno != ENOENT || !may_create) {
      return OpenError(errno, dir_fd, name, display, follow, "open");
    }
    Result<UniqueFd> created = CreateExclusiveAt(dir_fd, name, display, flags, mode);
    if (created || created.error().code() != ErrorCode::kAlreadyExists || attempt == 2) {
      return created;
    }
  }
}

Result<UniqueFd> OpenDirectoryAt(int dir_fd, const std::string& name, const std::string& display,
                                 Follow follow) {
  if (name.empty()) return InvalidArgumentError("open: empty directory name");
  int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
  if (follow == Follow::kNo) flags |= O_NOFOLLOW;
  int fd;
  do {
    fd = Env::Default().OpenAt(dir_fd, name.c_str(), flags, 0);
  } while (fd < 0 && errno == EINTR);
  if (fd >= 0) return UniqueFd(fd);
  const int err = errno;
  if (err == ENOTDIR || err == ELOOP) {
    struct stat st {};
    const int at_flags = follow == Follow::kNo ? AT_SYMLINK_NOFOLLOW : 0;
    if (Env::Default().StatAt(dir_fd, name.c_str(), &st, at_flags) == 0) {
      if (S_ISLNK(st.st_mode)) {
        return Error(
            ErrorCode::kFailedPrecondition,
            fmt::format("open directory {}: is a symbolic link; refusing to follow it", display),
            ELOOP);
      }
      if (!S_ISDIR(st.st_mode)) {
        return Error(
            ErrorCode::kFailedPrecondition,
            fmt::format("open directory {}: {}, not a directory", display, TypeName(st.st_mode)),
            ENOTDIR);
      }
    }
  }
  return ErrnoError(err, fmt::format("open directory {}", display));
}

// ---- Reading ----

Result<std::string> ReadSmallFileAt(int dir_fd, const std::string& name, const std::string& display,
                                    std::uint64_t max_bytes, Follow follow) {
  ZINF_ASSIGN_OR_RETURN(UniqueFd fd, OpenFileAt(dir_fd, name, display, FileAccess::kRead, follow));
  struct stat st {};
  if (Env::Default().StatAt(fd.get(), "", &st, AT_EMPTY_PATH) != 0) {
    return ErrnoError(errno, fmt::format("fstat {}", display));
  }
  auto too_large = [&] {
    return InvalidArgumentError(
        fmt::format("{}: larger than {} bytes; not read", display, max_bytes));
  };
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) return too_large();
  std::string text;
  text.reserve(static_cast<std::size_t>(st.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = Env::Default().Read(fd.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, fmt::format("read {}", display));
    }
    if (n == 0) break;
    if (text.size() + static_cast<std::size_t>(n) > max_bytes) return too_large();
    text.append(buffer, static_cast<std::size_t>(n));
  }
  return text;
}

Result<std::string> ReadSmallFile(const std::string& path, std::uint64_t max_bytes, Follow follow) {
  return ReadSmallFileAt(AT_FDCWD, path, path, max_bytes, follow);
}

// ---- Writing ----

Status WriteAll(int fd, std::span<const std::byte> bytes, std::string_view what) {
  while (!bytes.empty()) {
    const ssize_t n = Env::Default().Write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, fmt::format("write {}", what));
    }
    if (n == 0) return ErrnoError(EIO, fmt::format("write {}: no progress", what));
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
  return OkStatus();
}

Status SyncFd(int fd, bool data_only, std::string_view what) {
  int rc;
  do {
    rc = Env::Default().Sync(fd, data_only);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0)
    return ErrnoError(errno, fmt::format("{} {}", data_only ? "fdatasync" : "fsync", what));
  return OkStatus();
}

Status CheckReplaceableAt(int dir_fd, const std::string& name, const std::string& display) {
  ZINF_RETURN_IF_ERROR(ReplaceableAt(dir_fd, name, display, /*links_too=*/true));
  return OkStatus();
}

Status WriteFileAtomicAt(int dir_fd, const std::string& dir_display, const std::string& name,
                         std::string_view contents, unsigned mode) {
  const std::string temp = name + ".tmp";
  const std::string temp_display = dir_display + "/" + temp;
  const std::string final_display = dir_display + "/" + name;
  ZINF_RETURN_IF_ERROR(CheckReplaceableAt(dir_fd, name, final_display));
  ZINF_ASSIGN_OR_RETURN(const bool stale,
                        ReplaceableAt(dir_fd, temp, temp_display, /*links_too=*/true));
  if (stale && Env::Default().UnlinkAt(dir_fd, temp.c_str(), 0) != 0 && errno != ENOENT) {
    return ErrnoError(errno, fmt::format("remove stale {}", temp_display));
  }
  ZINF_ASSIGN_OR_RETURN(UniqueFd fd, OpenFileAt(dir_fd, temp, temp_display, FileAccess::kCreateNew,
                                                Follow::kNo, mode));
  Status written = WriteAll(fd.get(), contents, temp_display);
  if (written) written = SyncFd(fd.get(), /*data_only=*/false, temp_display);
  if (written) written = fd.Close(temp_display);
  if (written && Env::Default().RenameAt(dir_fd, temp.c_str(), dir_fd, name.c_str(), 0) != 0) {
    written = ErrnoError(errno, fmt::format("rename {} -> {}", temp_display, final_display));
  }
  if (!written) {
    Env::Default().UnlinkAt(dir_fd, temp.c_str(), 0);
    return written;
  }
  return SyncFd(dir_fd, /*data_only=*/false, dir_display);
}

Result<DirAndName> SplitPath(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  if (p.empty()) return InvalidArgumentError("empty path");
  const std::size_t slash = p.rfind('/');
  DirAndName out;
  if (slash == std::string::npos) {
    out.dir = ".";
    out.name = p;
  } else {
    out.dir = slash == 0 ? "/" : p.substr(0, slash);
    out.name = p.substr(slash + 1);
  }
  if (out.name.empty() || out.name == "." || out.name == "..") {
    return InvalidArgumentError(fmt::format("path '{}' does not name a file", path));
  }
  return out;
}

Status WriteFileAtomic(const std::string& path, std::string_view contents, unsigned mode) {
  ZINF_ASSIGN_OR_RETURN(DirAndName parts, SplitPath(path));
  ZINF_ASSIGN_OR_RETURN(UniqueFd dir, OpenDirectory(parts.dir, Follow::kYes));
  return WriteFileAtomicAt(dir.get(), parts.dir, parts.name, contents, mode);
}

// ---- AtomicFile ----

namespace {

// Whether an AtomicFile may be renamed to `final_path` (see AtomicFile in fs.h).
Status CheckFinalPath(const std::string& final_path, Overwrite overwrite) {
  ZINF_ASSIGN_OR_RETURN(const bool exists,
                        ReplaceableAt(AT_FDCWD, final_path, final_path, /*links_too=*/false));
  if (exists && overwrite == Overwrite::kNo) {
    return Error(ErrorCode::kAlreadyExists, fmt::format("{}: exists; not replaced", final_path),
                 EEXIST);
  }
  return OkStatus();
}

// rename(2), never over an existing entry with Overwrite::kNo. A file system without
// RENAME_NOREPLACE relies on the CheckFinalPath just before.
Status RenameOutput(const std::string& from, const std::string& to, Overwrite overwrite) {
  if (overwrite == Overwrite::kNo) {
    if (Env::Default().RenameAt(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) ==
        0) {
      return OkStatus();
    }
    if (errno == EEXIST) {
      return Error(ErrorCode::kAlreadyExists,
                   fmt::format("{}: appeared while being written; not replaced", to), EEXIST);
    }
    if (errno != EINVAL && errno != ENOSYS) {
      return ErrnoError(errno, fmt::format("rename {} -> {}", from, to));
    }
  }
  if (Env::Default().RenameAt(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), 0) != 0) {
    return ErrnoError(errno, fmt::format("rename {} -> {}", from, to));
  }
  return OkStatus();
}

}  // namespace

Result<AtomicFile> AtomicFile::Create(const std::string& final_path, Overwrite overwrite,
                                      unsigned mode) {
  ZINF_ASSIGN_OR_RETURN(DirAndName parts, SplitPath(final_path));
  ZINF_RETURN_IF_ERROR(CheckFinalPath(final_path, overwrite));
  AtomicFile file;
  file.final_path_ = final_path;
  file.overwrite_ = overwrite;
  file.temp_path_ = fmt::format("{}/.{}.zinf-tmp-{}-{}", parts.dir, parts.name, ::getpid(),
                                g_temp_counter.fetch_add(1));
  ZINF_ASSIGN_OR_RETURN(file.fd_,
                        OpenFile(file.temp_path_, FileAccess::kCreateNew, Follow::kNo, mode));
  file.done_ = false;
  return file;
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept
    : fd_(std::move(other.fd_)),
      temp_path_(std::move(other.temp_path_)),
      final_path_(std::move(other.final_path_)),
      overwrite_(other.overwrite_),
      done_(std::exchange(other.done_, true)) {}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    Abandon();
    fd_ = std::move(other.fd_);
    temp_path_ = std::move(other.temp_path_);
    final_path_ = std::move(other.final_path_);
    overwrite_ = other.overwrite_;
    done_ = std::exchange(other.done_, true);
  }
  return *this;
}

AtomicFile::~AtomicFile() { Abandon(); }

void AtomicFile::Abandon() {
  fd_.Reset();
  if (!done_) Env::Default().UnlinkAt(AT_FDCWD, temp_path_.c_str(), 0);
  done_ = true;
}

Status AtomicFile::Write(std::span<const std::byte> bytes) {
  if (!fd_) return FailedPreconditionError(fmt::format("write {}: not open", temp_path_));
  return WriteAll(fd_.get(), bytes, temp_path_);
}

Status AtomicFile::Reserve(std::uint64_t bytes, bool keep_size) {
  if (!fd_) return FailedPreconditionError(fmt::format("reserve {}: not open", temp_path_));
  int rc;
  do {
    rc = Env::Default().Allocate(fd_.get(), keep_size ? FALLOC_FL_KEEP_SIZE : 0, 0,
                                 static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0 || errno == EOPNOTSUPP || errno == ENOSYS) return OkStatus();
  return ErrnoError(errno, fmt::format("reserve {} bytes for {}", bytes, temp_path_));
}

Status AtomicFile::CloseDescriptor() { return fd_.Close(temp_path_); }

Status AtomicFile::Commit() {
  if (done_)
    return FailedPreconditionError(fmt::format("commit {}: nothing to commit", final_path_));
  Status status = OkStatus();
  if (fd_) {
    status = SyncFd(fd_.get(), /*data_only=*/false, temp_path_);
    if (status) status = fd_.Close(temp_path_);
  } else {
    status = SyncPath(temp_path_);
  }
  // Looked at again: the name may have changed while the output was being written.
  if (status) status = CheckFinalPath(final_path_, overwrite_);
  if (status) status = RenameOutput(temp_path_, final_path_, overwrite_);
  if (!status) {
    Abandon();
    return status;
  }
  done_ = true;
  ZINF_ASSIGN_OR_RETURN(DirAndName parts, SplitPath(final_path_));
  return SyncDirectory(parts.dir);
}

Status CreateDirectories(const std::string& path, unsigned mode) {
  if (path.empty()) return InvalidArgumentError("create directories: empty path");
  Env& env = Env::Default();
  // Each prefix ending before a '/' (and the whole path), from the root down.
  for (std::size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    if (!prefix.empty() && !prefix.ends_with('/')) {
      if (env.MkdirAt(AT_FDCWD, prefix.c_str(), static_cast<mode_t>(mode)) != 0) {
        // EEXIST, or EACCES for an existing directory in one we may not write: what is there?
        const int err = errno;
        struct stat st {};
        if (env.StatAt(AT_FDCWD, prefix.c_str(), &st, 0) != 0) {
          // Missing: mkdir's own failure; there but not to be looked at: the stat's.
          return errno == ENOENT ? ErrnoError(err, fmt::format("mkdir {}", prefix))
                                 : ErrnoError(errno, fmt::format("stat {}", prefix));
        }
        if (!S_ISDIR(st.st_mode)) {
          return Error(ErrorCode::kFailedPrecondition,
                       fmt::format("mkdir {}: {}, not a directory", prefix, TypeName(st.st_mode)),
                       ENOTDIR);
        }
      }
    }
    if (end == std::string::npos) return OkStatus();
  }
}

Result<std::uint64_t> AvailableBytes(const std::string& dir) {
  struct statvfs vfs {};
  int rc;
  do {
    rc = Env::Default().StatFs(dir.c_str(), &vfs);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return ErrnoError(errno, fmt::format("statvfs {}", dir));
  return static_cast<std::uint64_t>(vfs.f_bavail) * static_cast<std::uint64_t>(vfs.f_frsize);
}

// ---- Durability by path ----

Status SyncPath(const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, FileAccess::kRead, Follow::kNo));
  ZINF_RETURN_IF_ERROR(SyncFd(fd.get(), /*data_only=*/true, path));
  return fd.Close(path);
}

Status SyncDirectory(const std::string& dir) {
  ZINF_ASSIGN_OR_RETURN(UniqueFd fd, OpenDirectory(dir, Follow::kYes));
  return SyncFd(fd.get(), /*data_only=*/false, dir);
}

}  // namespace zinf::storage
