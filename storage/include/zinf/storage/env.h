// Env: the file-system calls zinf makes outside its I/O backends, behind one seam (LevelDB's Env):
// the small-file layer (fs.h), File's open and sizing (file.h), the swap store (its directories,
// locks and weights file) and the checkpoint commit protocol and write-behind: open, stat, mkdir,
// rename, unlink, fsync, fallocate, ftruncate, write, read, pwrite, pread, fcntl, flock, fchmod,
// posix_fadvise, sync_file_range, statfs, readdir, close. The I/O backends' block reads and writes
// (io_backend.h) have their own fault hook.
// A test or a run with ZINF_FAULT_INJECT can make any of them fail (FaultInjectingEnv), so the
// code that handles each failure is exercised, not just written.
//
//   Env& env = Env::Default();
//   int fd = env.OpenAt(dir_fd, "latest.tmp", O_WRONLY | O_CREAT | O_EXCL, 0644);
//   if (fd < 0) return ErrnoError(errno, ...);
//
//   FaultInjectingEnv faulty(Env::Posix(), injector);   // "rename:1:eio"
//   ScopedDefaultEnv scope(faulty);                    // Env::Default() is `faulty` meanwhile
//
// Each method is the system call of its name with that call's contract: it returns what the call
// returns (-1 with errno set on failure) and retries nothing (callers retry EINTR as they did).
//
// Env::Default() is the process's Env: Env::Posix(), or, when ZINF_FAULT_INJECT has rules for
// these calls (fault_injection.h's FsOp names) and applies to this rank, Posix() through the
// process's injector.
//
// Thread safety: Env implementations are thread safe. ScopedDefaultEnv is for tests: make one
// before the code under test starts threads that touch files, and let it end after they stopped.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace zinf::storage {

class FaultInjector;

class Env {
 public:
  virtual ~Env() = default;

  // The real system calls.
  static Env& Posix();
  // The process's Env (above); ScopedDefaultEnv's while one is alive.
  static Env& Default();

  virtual int OpenAt(int dir_fd, const char* name, int flags, mode_t mode) = 0;  // openat
  // fstatat; with AT_EMPTY_PATH and name "", fstat of dir_fd.
  virtual int StatAt(int dir_fd, const char* name, struct stat* st, int flags) = 0;
  virtual int MkdirAt(int dir_fd, const char* name, mode_t mode) = 0;  // mkdirat
  // renameat2; flags 0 is renameat.
  virtual int RenameAt(int from_dir, const char* from, int to_dir, const char* to,
                       unsigned flags) = 0;
  virtual int UnlinkAt(int dir_fd, const char* name, int flags) = 0;       // unlinkat
  virtual int Sync(int fd, bool data_only) = 0;                            // fdatasync / fsync
  virtual int Allocate(int fd, int mode, off_t offset, off_t length) = 0;  // fallocate
  virtual ssize_t Write(int fd, const void* data, std::size_t size) = 0;   // write
  virtual ssize_t Read(int fd, void* data, std::size_t size) = 0;          // read
  virtual ssize_t PWrite(int fd, const void* data, std::size_t size, off_t offset) = 0;  // pwrite
  virtual ssize_t PRead(int fd, void* data, std::size_t size, off_t offset) = 0;         // pread
  virtual int Truncate(int fd, off_t length) = 0;       // ftruncate
  virtual int Fcntl(int fd, int command, int arg) = 0;  // fcntl with an int argument (F_GETFL, ...)
  virtual int Lock(int fd, int operation) = 0;          // flock
  virtual int ChangeMode(int fd, mode_t mode) = 0;      // fchmod
  // posix_fadvise: 0 or the error number (that call's contract: errno is not set).
  virtual int Advise(int fd, off_t offset, off_t length, int advice) = 0;
  virtual int SyncRange(int fd, off_t offset, off_t length, unsigned flags) = 0;  // sync_file_range
  virtual int StatFs(const char* path, struct statvfs* st) = 0;                   // statvfs
  virtual int Close(int fd) = 0;                                                  // close
  // The names in the directory `dir_fd` (through a descriptor of its own: dir_fd's position
  // stays),
  // without "." and "..", at most `max_names` + 1 of them (one more than allowed tells the
  // caller there were too many). 0, or -1 with errno (opendir, readdir).
  virtual int ReadDir(int dir_fd, std::size_t max_names, std::vector<std::string>* names) = 0;
};

// `base`'s calls, each first counted by `injector` (FaultInjector::ApplyFs), which may fail it
// instead: the call is then not made, and -1 is returned with the injected errno (a close is made
// all the same, as Linux releases a descriptor even when close fails). An injected short write
// or pwrite writes half of the bytes (at least one). An injected posix_fadvise failure returns its
// errno, as that call does.
class FaultInjectingEnv final : public Env {
 public:
  FaultInjectingEnv(Env& base, std::shared_ptr<FaultInjector> injector);

  int OpenAt(int dir_fd, const char* name, int flags, mode_t mode) override;
  int StatAt(int dir_fd, const char* name, struct stat* st, int flags) override;
  int MkdirAt(int dir_fd, const char* name, mode_t mode) override;
  int RenameAt(int from_dir, const char* from, int to_dir, const char* to, unsigned flags) override;
  int UnlinkAt(int dir_fd, const char* name, int flags) override;
  int Sync(int fd, bool data_only) override;
  int Allocate(int fd, int mode, off_t offset, off_t length) override;
  ssize_t Write(int fd, const void* data, std::size_t size) override;
  ssize_t Read(int fd, void* data, std::size_t size) override;
  ssize_t PWrite(int fd, const void* data, std::size_t size, off_t offset) override;
  ssize_t PRead(int fd, void* data, std::size_t size, off_t offset) override;
  int Truncate(int fd, off_t length) override;
  int Fcntl(int fd, int command, int arg) override;
  int Lock(int fd, int operation) override;
  int ChangeMode(int fd, mode_t mode) override;
  int Advise(int fd, off_t offset, off_t length, int advice) override;
  int SyncRange(int fd, off_t offset, off_t length, unsigned flags) override;
  int StatFs(const char* path, struct statvfs* st) override;
  int Close(int fd) override;
  int ReadDir(int dir_fd, std::size_t max_names, std::vector<std::string>* names) override;

  FaultInjector& injector() { return *injector_; }

 private:
  Env& base_;
  std::shared_ptr<FaultInjector> injector_;
};

// Makes `env` the process's Env::Default() for the scope's lifetime (tests). Scopes nest.
class ScopedDefaultEnv {
 public:
  explicit ScopedDefaultEnv(Env& env);
  ~ScopedDefaultEnv();
  ScopedDefaultEnv(const ScopedDefaultEnv&) = delete;
  ScopedDefaultEnv& operator=(const ScopedDefaultEnv&) = delete;

 private:
  Env* previous_;
};

}  // namespace zinf::storage
