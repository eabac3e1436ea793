// Zip archives as torch.save writes them (its default, "zipfile" serialization): every entry
// stored, not compressed; data aligned to 64 bytes (padding in the local header's extra field);
// ZIP64 records once an entry or the archive passes 4 GiB. The reader checks what it reads
// against the limits below before it allocates or loops on anything, checks every entry's CRC-32
// when it reads the entry whole, and never follows a symbolic link to the archive. The writer
// writes through a temporary file renamed at Finish() (storage::AtomicFile): a failed or
// abandoned write leaves nothing.
#ifndef ZINF_INTEROP_ZIP_H_
#define ZINF_INTEROP_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {

struct ZipLimits {
  std::uint64_t max_entries = 1 << 16;
  std::uint64_t max_name_bytes = 4096;
  std::uint64_t max_archive_bytes = std::uint64_t{1} << 44;  // 16 TiB
};

struct ZipEntry {
  std::string name;
  std::uint64_t data_offset = 0;  // of the entry's bytes in the archive
  std::uint64_t size = 0;         // stored = uncompressed
  std::uint32_t crc32 = 0;
};

class ZipReader {
 public:
  // Opens `path` (a regular file; a link is refused) and reads its central directory.
  // Errors: those of storage::OpenFile; DataLoss "not a zip archive" / "truncated" / naming the
  // record that is wrong (an entry that is compressed, encrypted, overlaps another or lies past
  // the end; a duplicate or empty name; more entries or longer names than `limits`).
  static Result<ZipReader> Open(const std::string& path, const ZipLimits& limits = {});
  // The same for the file `name` relative to the directory descriptor `dir_fd` (openat;
  // AT_FDCWD: relative to the working directory), so that a reader that opened a folder once
  // reads the files of that very folder even if its path is later replaced (by a link, ...).
  // `name` may hold several components; a link is refused only as the last one, as in Open, so
  // a caller that must not follow links passes one component. `display` names the file in
  // errors and is path().
  static Result<ZipReader> OpenAt(int dir_fd, const std::string& name, std::string display,
                                  const ZipLimits& limits = {});

  ZipReader(ZipReader&&) noexcept = default;
  ZipReader& operator=(ZipReader&&) noexcept = default;

  const std::string& path() const { return path_; }
  // In the order of the central directory.
  const std::vector<ZipEntry>& entries() const { return entries_; }
  // The entry named `name`, or nullptr.
  const ZipEntry* Find(std::string_view name) const;

  // The whole entry, when it is at most `max_bytes`, its CRC-32 checked. Errors: NotFound (no
  // such entry), InvalidArgument (larger than max_bytes), DataLoss (CRC mismatch, short read).
  Result<std::string> ReadEntry(std::string_view name, std::uint64_t max_bytes) const;
  // `out.size()` bytes of `entry` from `offset` (bounds checked; no CRC: see VerifyCrc).
  Status ReadRange(const ZipEntry& entry, std::uint64_t offset, std::span<std::byte> out) const;
  // Reads `entry` through in bounded chunks and checks its CRC-32 (DataLoss when it differs).
  Status VerifyCrc(const ZipEntry& entry) const;

 private:
  ZipReader() = default;

  std::string path_;
  storage::UniqueFd fd_;
  std::vector<ZipEntry> entries_;
  std::vector<std::size_t> by_name_;  // indices into entries_, sorted by name (for Find)
};

class ZipWriter {
 public:
  // A new archive at `path` (see storage::AtomicFile for what may be there already).
  static Result<ZipWriter> Create(const std::string& path, storage::Overwrite overwrite);

  // Defined where State is complete. Destroying a writer without Finish() is Abandon().
  ZipWriter(ZipWriter&&) noexcept;
  ZipWriter& operator=(ZipWriter&&) noexcept;
  ~ZipWriter();

  // Adds an entry whose bytes are `data` (stored, its data 64-byte aligned). Errors:
  // InvalidArgument (an empty or repeated name, longer than 4096 bytes), write errors.
  Status Add(std::string_view name, std::span<const std::byte> data);
  Status Add(std::string_view name, std::string_view data) {
    return Add(name, std::as_bytes(std::span(data.data(), data.size())));
  }
  // An entry of `size` bytes written in pieces: Begin, then Append until `size` bytes are in,
  // then End (checks the count; the CRC is computed on the way).
  Status Begin(std::string_view name, std::uint64_t size);
  Status Append(std::span<const std::byte> data);
  Status End();
  // Writes the central directory (ZIP64 where needed) and commits the file.
  Status Finish();
  // Removes the temporary; also what the destructor does without Finish().
  void Abandon();

 private:
  ZipWriter() = default;
  // Implementation state (the AtomicFile, the offset, the entries written, the open entry).
  struct State;
  std::unique_ptr<State> state_;
};

// CRC-32 (the zip polynomial) of `data`, continuing from `crc` (0 to start).
std::uint32_t Crc32(std::span<const std::byte> data, std::uint32_t crc = 0);

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_ZIP_H_
