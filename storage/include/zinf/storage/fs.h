// The small file-system layer every zinf reader and writer of files goes through: an owning file
// descriptor, opening without following a planted symlink and without blocking on a FIFO, bounded
// reads of small files, atomic replacement of a small file, outputs that appear under their name
// only when complete, and durability points (fsync of files and directories).
//
//   ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 16 * kMiB, Follow::kYes));
//   ZINF_RETURN_IF_ERROR(WriteFileAtomic(dir + "/latest", "step-10.h5\n"));
//   ZINF_ASSIGN_OR_RETURN(AtomicFile out, AtomicFile::Create(out_path, Overwrite::kNo));
//   ZINF_RETURN_IF_ERROR(out.Write(bytes));
//   ZINF_RETURN_IF_ERROR(out.Commit());   // without Commit the output never appears
//
// Rules every function here keeps:
//   - the last path component is never followed when it is a symbolic link, unless the caller
//     says Follow::kYes (for a path the user named on purpose, e.g. a config file): a planted
//     link is FailedPrecondition "is a symbolic link", never a write through it;
//   - an existing file is first looked at through an O_PATH descriptor (fstat, which opens
//     nothing) and opened only if it is a regular file, by reopening that very inode: a FIFO,
//     socket, device or directory is FailedPrecondition "<type>, not a regular file", never
//     opened (so never a hang, and no device driver sees an open), never truncated;
//   - an output never replaces anything but a regular file: a directory, device, FIFO or socket
//     at an output name is FailedPrecondition, and nothing is written;
//   - reads are bounded in bytes (InvalidArgument "larger than N bytes") before anything is
//     allocated for them;
//   - files that are created are created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW), so a
//     create never opens something that was already there (nor creates through a dangling link);
//   - EINTR is retried everywhere; every other failure is an Error naming the path and errno.
//
// Thread safety: free functions are thread safe; UniqueFd and AtomicFile are values owned by one
// thread at a time.
#pragma once

#include <fcntl.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::storage {

// An owned file descriptor. Move-only; the moved-from object is empty. The destructor closes
// and ignores errors; Close() reports them (Linux releases the descriptor even on EINTR, so
// close is never retried).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept;
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  // Gives up ownership: the caller closes the returned descriptor.
  int Release();
  // Closes the current descriptor (ignoring errors) and owns `fd` instead.
  void Reset(int fd = -1);
  // Closes and reports: ErrnoError naming `what`. Empty afterwards either way.
  Status Close(std::string_view what);

 private:
  int fd_ = -1;
};

// Whether the last path component may be a symbolic link.
enum class Follow { kNo, kYes };

// How OpenFileAt opens a file. The file must be a regular file (FailedPrecondition otherwise).
enum class FileAccess {
  kRead,              // existing file, read only
  kReadWrite,         // existing file, read and write
  kCreateNew,         // create (O_EXCL), read and write: AlreadyExists if the name exists
  kAppendOrCreate,    // write only, appending; created (with `mode`) if missing
  kTruncateOrCreate,  // write only, truncated to 0; created (with `mode`) if missing
};

// Opens `name` relative to the directory `dir_fd` (AT_FDCWD: relative to the working directory,
// or `name` is absolute) as a regular file. `display` names the file in errors (the full path).
// An existing name is opened only when it is a regular file (see the rules above); a missing one
// (k*OrCreate) is created exclusively. Errors: NotFound, AlreadyExists (kCreateNew),
// FailedPrecondition (a symbolic link with Follow::kNo, or a dangling one when creating; not a
// regular file, naming its type; permission), errno errors.
Result<UniqueFd> OpenFileAt(int dir_fd, const std::string& name, const std::string& display,
                            FileAccess access, Follow follow = Follow::kNo, unsigned mode = 0644);
inline Result<UniqueFd> OpenFile(const std::string& path, FileAccess access,
                                 Follow follow = Follow::kNo, unsigned mode = 0644) {
  return OpenFileAt(AT_FDCWD, path, path, access, follow, mode);
}

// Opens a directory (O_DIRECTORY, read only) relative to `dir_fd`. Errors: NotFound,
// FailedPrecondition (a symbolic link with Follow::kNo, not a directory), errno errors.
Result<UniqueFd> OpenDirectoryAt(int dir_fd, const std::string& name, const std::string& display,
                                 Follow follow = Follow::kNo);
inline Result<UniqueFd> OpenDirectory(const std::string& path, Follow follow = Follow::kYes) {
  return OpenDirectoryAt(AT_FDCWD, path, path, follow);
}

// The whole content of the regular file `path` (at most `max_bytes`). Errors: those of
// OpenFileAt (kRead), InvalidArgument "larger than <max_bytes> bytes" (checked with fstat before
// reading and again while reading, for a file that grows), errno errors of read.
Result<std::string> ReadSmallFile(const std::string& path, std::uint64_t max_bytes,
                                  Follow follow = Follow::kNo);
Result<std::string> ReadSmallFileAt(int dir_fd, const std::string& name, const std::string& display,
                                    std::uint64_t max_bytes, Follow follow = Follow::kNo);

// Writes all of `bytes` at the current offset of `fd` (short writes continued, EINTR retried).
// Errors: errno errors naming `what` (ENOSPC: ResourceExhausted).
Status WriteAll(int fd, std::span<const std::byte> bytes, std::string_view what);
inline Status WriteAll(int fd, std::string_view text, std::string_view what) {
  return WriteAll(fd, std::as_bytes(std::span(text.data(), text.size())), what);
}

// Replaces the file `name` in directory `dir_fd` with `contents`, atomically: the temporary
// `<name>.tmp` is removed if present (a stale file, or a link planted there: unlinked, never
// followed), created exclusively with `mode`, written, fsynced and renamed over `name`; then the
// directory is fsynced. A crash leaves the old file or the new one, and at worst the temporary.
// `name` may be missing, a regular file or a symbolic link (the link is replaced, its target
// never written); anything else at `name` or at the temporary name (a directory, device, FIFO,
// socket) is FailedPrecondition and nothing is written. `dir_display` names the directory in
// errors.
Status WriteFileAtomicAt(int dir_fd, const std::string& dir_display, const std::string& name,
                         std::string_view contents, unsigned mode = 0644);
// The same for a path: its directory is opened (following links in the directory part only).
Status WriteFileAtomic(const std::string& path, std::string_view contents, unsigned mode = 0644);

// What an AtomicFile may replace at its final name.
enum class Overwrite {
  kNo,           // nothing: an existing entry of any kind is AlreadyExists / FailedPrecondition
  kRegularFile,  // an existing regular file (not a link to one) is replaced
};

// Checks, before anything is written, what replacing the entry `name` of directory `dir_fd` by a
// rename would destroy, never following it: OK when nothing is there, a regular file, or a
// symbolic link (the link itself is replaced, never its target); FailedPrecondition "<display>:
// <type>, not a regular file; an output never replaces one" for a directory, device, FIFO or
// socket. For a writer that renames over a name it owns (WriteFileAtomicAt does this itself).
Status CheckReplaceableAt(int dir_fd, const std::string& name, const std::string& display);

// A new file that appears under `final_path` only when Commit() succeeds. It is written under a
// unique hidden temporary name in the same directory (".<name>.zinf-tmp-<pid>-<n>", created
// exclusively); Commit() fsyncs and closes it, renames it to `final_path` and fsyncs the
// directory. Without a successful Commit() the destructor (or Abandon()) removes the temporary:
// a failed or interrupted writer never leaves a partial output, nor destroys the previous one.
// What is at `final_path` is checked by Create(), before anything is written, and again by
// Commit(): a missing name is always fine; an existing regular file is AlreadyExists "exists"
// with Overwrite::kNo (the rename is then RENAME_NOREPLACE, so one made meanwhile survives too)
// and replaced with Overwrite::kRegularFile; a symbolic link, directory, device, FIFO or socket
// is FailedPrecondition "<type>, not a regular file" either way: never replaced, never opened.
// Move-only.
class AtomicFile {
 public:
  // Errors: NotFound (no such directory), AlreadyExists / FailedPrecondition (what is at
  // `final_path`, above), errno errors of the exclusive create.
  static Result<AtomicFile> Create(const std::string& final_path, Overwrite overwrite,
                                   unsigned mode = 0644);

  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  int fd() const { return fd_.get(); }
  const std::string& temp_path() const { return temp_path_; }
  const std::string& final_path() const { return final_path_; }

  Status Write(std::span<const std::byte> bytes);
  // Allocates the temporary's blocks for its first `bytes` bytes (fallocate; with `keep_size`
  // the file's size stays as it is), so that writing the output cannot run out of space half-way.
  // File systems without fallocate: OK, nothing reserved. Errors: ResourceExhausted (ENOSPC).
  Status Reserve(std::uint64_t bytes, bool keep_size);
  // Closes our descriptor without committing, for a writer that reopens temp_path() by name
  // (HDF5); Commit() still renames.
  Status CloseDescriptor();
  Status Commit();
  // Removes the temporary (errors ignored). Idempotent.
  void Abandon();

 private:
  AtomicFile() = default;

  UniqueFd fd_;
  std::string temp_path_;
  std::string final_path_;
  Overwrite overwrite_ = Overwrite::kNo;
  bool done_ = true;  // committed or abandoned (nothing to remove)
};

// The names in directory `dir_fd` (without "." and ".."), at most `max_entries` of them;
// `truncated` when there were more. Reads through its own descriptor (Env::ReadDir), so
// `dir_fd`'s offset and locks are untouched. Errors: errno errors "readdir <display>".
struct DirectoryListing {
  std::vector<std::string> names;
  bool truncated = false;
};
Result<DirectoryListing> ListDirectory(int dir_fd, const std::string& display,
                                       std::size_t max_entries);

// Clears O_NONBLOCK of `fd` (files are opened with it so that a FIFO cannot block the open).
// Errors: errno errors naming `display`.
Status ClearNonBlock(int fd, const std::string& display);

// Creates the directory `path` and any missing parents (mkdir -p, with `mode`); an existing
// directory is fine, a component that is something else is FailedPrecondition "not a directory".
// Components are followed when they are links (the path is the user's). Errors: errno errors
// naming the component.
Status CreateDirectories(const std::string& path, unsigned mode = 0755);

// The bytes available to this user on the file system of `dir` (statvfs f_bavail * f_frsize).
Result<std::uint64_t> AvailableBytes(const std::string& dir);

// fdatasync (data_only) or fsync of `fd`, EINTR retried. Errors: errno errors naming `what`.
Status SyncFd(int fd, bool data_only, std::string_view what);
// Durability points by path, for files this process does not hold open (a checkpoint after its
// collective close) and for directories (after a create or rename in them). SyncPath fdatasyncs
// a regular file (never following a final symlink); SyncDirectory fsyncs a directory.
Status SyncPath(const std::string& path);
Status SyncDirectory(const std::string& dir);

// "dir/name" -> {"dir", "name"}; "name" -> {".", "name"}; trailing slashes are removed first.
// InvalidArgument for an empty path or one that names no file ("/", "dir/..", "dir/.").
struct DirAndName {
  std::string dir;
  std::string name;
};
Result<DirAndName> SplitPath(const std::string& path);

}  // namespace zinf::storage
