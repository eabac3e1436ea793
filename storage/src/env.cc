#include "zinf/storage/env.h"

#include <dirent.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "zinf/core/log.h"
#include "zinf/storage/fault_injection.h"

namespace zinf::storage {
namespace {

class PosixEnv final : public Env {
 public:
  int OpenAt(int dir_fd, const char* name, int flags, mode_t mode) override {
    return ::openat(dir_fd, name, flags, mode);
  }
  int StatAt(int dir_fd, const char* name, struct stat* st, int flags) override {
    return ::fstatat(dir_fd, name, st, flags);
  }
  int MkdirAt(int dir_fd, const char* name, mode_t mode) override {
    return ::mkdirat(dir_fd, name, mode);
  }
  int RenameAt(int from_dir, const char* from, int to_dir, const char* to,
               unsigned flags) override {
    return flags == 0 ? ::renameat(from_dir, from, to_dir, to)
                      : ::renameat2(from_dir, from, to_dir, to, flags);
  }
  int UnlinkAt(int dir_fd, const char* name, int flags) override {
    return ::unlinkat(dir_fd, name, flags);
  }
  int Sync(int fd, bool data_only) override { return data_only ? ::fdatasync(fd) : ::fsync(fd); }
  int Allocate(int fd, int mode, off_t offset, off_t length) override {
    return ::fallocate(fd, mode, offset, length);
  }
  ssize_t Write(int fd, const void* data, std::size_t size) override {
    return ::write(fd, data, size);
  }
  ssize_t Read(int fd, void* data, std::size_t size) override { return ::read(fd, data, size); }
  ssize_t PWrite(int fd, const void* data, std::size_t size, off_t offset) override {
    return ::pwrite(fd, data, size, offset);
  }
  ssize_t PRead(int fd, void* data, std::size_t size, off_t offset) override {
    return ::pread(fd, data, size, offset);
  }
  int Truncate(int fd, off_t length) override { return ::ftruncate(fd, length); }
  int Fcntl(int fd, int command, int arg) override { return ::fcntl(fd, command, arg); }
  int Lock(int fd, int operation) override { return ::flock(fd, operation); }
  int ChangeMode(int fd, mode_t mode) override { return ::fchmod(fd, mode); }
  int Advise(int fd, off_t offset, off_t length, int advice) override {
    return ::posix_fadvise(fd, offset, length, advice);
  }
  int SyncRange(int fd, off_t offset, off_t length, unsigned flags) override {
    return ::sync_file_range(fd, offset, length, flags);
  }
  int StatFs(const char* path, struct statvfs* st) override { return ::statvfs(path, st); }
  int Close(int fd) override { return ::close(fd); }
  int ReadDir(int dir_fd, std::size_t max_names, std::vector<std::string>* names) override {
    names->clear();
    // A descriptor of its own (not a dup, which would share dir_fd's position).
    const int fd = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR* dir = ::fdopendir(fd);
    if (dir == nullptr) {
      const int err = errno;
      ::close(fd);
      errno = err;
      return -1;
    }
    int rc = 0;
    while (names->size() <= max_names) {
      errno = 0;
      const dirent* entry = ::readdir(dir);
      if (entry == nullptr) {
        if (errno != 0) rc = -1;
        break;
      }
      const std::string_view name = entry->d_name;
      if (name != "." && name != "..") names->emplace_back(name);
    }
    const int err = errno;
    ::closedir(dir);
    errno = err;
    return rc;
  }
};

std::atomic<Env*> g_scoped{nullptr};

// Env::Default() without a ScopedDefaultEnv: Posix(), through the process's injector when
// ZINF_FAULT_INJECT has Env rules for this rank.
Env& ProcessEnv() {
  static Env* const env = []() -> Env* {
    Result<std::shared_ptr<FaultInjector>> injector = FaultInjectorFromEnv();
    if (!injector) {
      // The backends refuse the same spec when they are made; here it only must not be half-used.
      ZINF_LOG_WARN("{}; no fault is injected into file-system calls", injector.error().message());
      return &Env::Posix();
    }
    if (*injector == nullptr || !(*injector)->has_fs_rules()) return &Env::Posix();
    ZINF_LOG_WARN("fault injection armed for file-system calls: ZINF_FAULT_INJECT={}",
                  FormatFaultSpec((*injector)->spec()));
    return new FaultInjectingEnv(Env::Posix(), std::move(*injector));  // lives to the end
  }();
  return *env;
}

}  // namespace

Env& Env::Posix() {
  static PosixEnv env;
  return env;
}

Env& Env::Default() {
  if (Env* scoped = g_scoped.load(std::memory_order_acquire)) return *scoped;
  return ProcessEnv();
}

FaultInjectingEnv::FaultInjectingEnv(Env& base, std::shared_ptr<FaultInjector> injector)
    : base_(base), injector_(std::move(injector)) {}

namespace {

// Whether `injector` fails this call of `op` (errno is then set).
bool Fails(FaultInjector& injector, FsOp op) {
  const int err = injector.ApplyFs(op);
  if (err <= 0) return false;
  errno = err;
  return true;
}

// For a write of `size` bytes (fwrite, pwrite): false when `injector` fails it (errno set);
// else *allowed is how many bytes to write: all, or half (at least one) for a short write.
bool WriteAllowed(FaultInjector& injector, FsOp op, std::size_t size, std::size_t* allowed) {
  const int err = injector.ApplyFs(op);
  if (err > 0) {
    errno = err;
    return false;
  }
  *allowed = err < 0 && size > 1 ? size / 2 : size;  // err < 0: short
  return true;
}

}  // namespace

int FaultInjectingEnv::OpenAt(int dir_fd, const char* name, int flags, mode_t mode) {
  if (Fails(*injector_, FsOp::kOpen)) return -1;
  return base_.OpenAt(dir_fd, name, flags, mode);
}
int FaultInjectingEnv::StatAt(int dir_fd, const char* name, struct stat* st, int flags) {
  if (Fails(*injector_, FsOp::kStat)) return -1;
  return base_.StatAt(dir_fd, name, st, flags);
}
int FaultInjectingEnv::MkdirAt(int dir_fd, const char* name, mode_t mode) {
  if (Fails(*injector_, FsOp::kMkdir)) return -1;
  return base_.MkdirAt(dir_fd, name, mode);
}
int FaultInjectingEnv::RenameAt(int from_dir, const char* from, int to_dir, const char* to,
                                unsigned flags) {
  if (Fails(*injector_, FsOp::kRename)) return -1;
  return base_.RenameAt(from_dir, from, to_dir, to, flags);
}
int FaultInjectingEnv::UnlinkAt(int dir_fd, const char* name, int flags) {
  if (Fails(*injector_, FsOp::kUnlink)) return -1;
  return base_.UnlinkAt(dir_fd, name, flags);
}
int FaultInjectingEnv::Sync(int fd, bool data_only) {
  if (Fails(*injector_, FsOp::kFsync)) return -1;
  return base_.Sync(fd, data_only);
}
int FaultInjectingEnv::Allocate(int fd, int mode, off_t offset, off_t length) {
  if (Fails(*injector_, FsOp::kFallocate)) return -1;
  return base_.Allocate(fd, mode, offset, length);
}
ssize_t FaultInjectingEnv::Write(int fd, const void* data, std::size_t size) {
  std::size_t allowed;
  if (!WriteAllowed(*injector_, FsOp::kWrite, size, &allowed)) return -1;
  return base_.Write(fd, data, allowed);
}
ssize_t FaultInjectingEnv::Read(int fd, void* data, std::size_t size) {
  if (Fails(*injector_, FsOp::kRead)) return -1;
  return base_.Read(fd, data, size);
}
ssize_t FaultInjectingEnv::PWrite(int fd, const void* data, std::size_t size, off_t offset) {
  std::size_t allowed;
  if (!WriteAllowed(*injector_, FsOp::kPWrite, size, &allowed)) return -1;
  return base_.PWrite(fd, data, allowed, offset);
}
ssize_t FaultInjectingEnv::PRead(int fd, void* data, std::size_t size, off_t offset) {
  if (Fails(*injector_, FsOp::kPRead)) return -1;
  return base_.PRead(fd, data, size, offset);
}
int FaultInjectingEnv::Truncate(int fd, off_t length) {
  if (Fails(*injector_, FsOp::kTruncate)) return -1;
  return base_.Truncate(fd, length);
}
int FaultInjectingEnv::Fcntl(int fd, int command, int arg) {
  if (Fails(*injector_, FsOp::kFcntl)) return -1;
  return base_.Fcntl(fd, command, arg);
}
int FaultInjectingEnv::Lock(int fd, int operation) {
  if (Fails(*injector_, FsOp::kFlock)) return -1;
  return base_.Lock(fd, operation);
}
int FaultInjectingEnv::ChangeMode(int fd, mode_t mode) {
  if (Fails(*injector_, FsOp::kChmod)) return -1;
  return base_.ChangeMode(fd, mode);
}
int FaultInjectingEnv::Advise(int fd, off_t offset, off_t length, int advice) {
  if (const int err = injector_->ApplyFs(FsOp::kFadvise); err > 0) return err;
  return base_.Advise(fd, offset, length, advice);
}
int FaultInjectingEnv::SyncRange(int fd, off_t offset, off_t length, unsigned flags) {
  if (Fails(*injector_, FsOp::kSyncRange)) return -1;
  return base_.SyncRange(fd, offset, length, flags);
}
int FaultInjectingEnv::StatFs(const char* path, struct statvfs* st) {
  if (Fails(*injector_, FsOp::kStatFs)) return -1;
  return base_.StatFs(path, st);
}
int FaultInjectingEnv::Close(int fd) {
  const int err = injector_->ApplyFs(FsOp::kClose);
  const int rc = base_.Close(fd);
  if (err > 0) {
    errno = err;
    return -1;
  }
  return rc;
}
int FaultInjectingEnv::ReadDir(int dir_fd, std::size_t max_names, std::vector<std::string>* names) {
  if (Fails(*injector_, FsOp::kReadDir)) return -1;
  return base_.ReadDir(dir_fd, max_names, names);
}

ScopedDefaultEnv::ScopedDefaultEnv(Env& env)
    : previous_(g_scoped.exchange(&env, std::memory_order_acq_rel)) {}

ScopedDefaultEnv::~ScopedDefaultEnv() { g_scoped.store(previous_, std::memory_order_release); }

}  // namespace zinf::storage
