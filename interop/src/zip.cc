#include "zinf/interop/zip.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "text.h"
#include "zinf/storage/env.h"

namespace zinf::interop {

// Test hook (declared by the test only): every record the writer writes uses the ZIP64 forms, so
// that the ZIP64 paths of writer and reader are exercised without a 4 GiB file.
namespace internal {
std::atomic<bool> g_force_zip64_for_testing{false};
void ForceZip64ForTesting(bool force) { g_force_zip64_for_testing.store(force); }
}  // namespace internal

namespace {

constexpr std::uint32_t kLocalSig = 0x04034b50;
constexpr std::uint32_t kCentralSig = 0x02014b50;
constexpr std::uint32_t kEocdSig = 0x06054b50;
constexpr std::uint32_t kZip64EocdSig = 0x06064b50;
constexpr std::uint32_t kZip64LocatorSig = 0x07064b50;
constexpr std::size_t kLocalSize = 30;
constexpr std::size_t kCentralSize = 46;
constexpr std::size_t kEocdSize = 22;
constexpr std::size_t kZip64EocdSize = 56;
constexpr std::size_t kZip64LocatorSize = 20;
constexpr std::uint64_t kMaxComment = 0xFFFF;
constexpr std::uint32_t kMax32 = 0xFFFFFFFF;
constexpr std::uint16_t kMax16 = 0xFFFF;
constexpr std::uint16_t kZip64ExtraId = 0x0001;
constexpr std::uint16_t kPaddingExtraId = 0x4246;  // "FB", as torch writes it
constexpr std::uint64_t kAlignment = 64;
constexpr std::uint64_t kMaxWriterNameBytes = 4096;
constexpr std::size_t kChunkBytes = std::size_t{4} << 20;
constexpr std::size_t kCentralWindowBytes = std::size_t{1} << 20;
// Flags: bit 0 encrypted, bit 6 strong encryption, bit 13 central directory encrypted.
constexpr std::uint16_t kEncryptedFlags = 0x0001 | 0x0040 | 0x2000;
constexpr std::uint16_t kDataDescriptorFlag = 0x0008;
constexpr std::uint16_t kUtf8Flag = 0x0800;
// 1980-01-01 00:00, so that the same entries give the same bytes.
constexpr std::uint16_t kDosTime = 0;
constexpr std::uint16_t kDosDate = (1 << 5) | 1;

// --- CRC-32 (reflected, polynomial 0xEDB88320), slicing by 8 ---
constexpr std::array<std::array<std::uint32_t, 256>, 8> MakeCrcTables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
    t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i) {
    for (std::size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
  return t;
}
constexpr auto kCrcTables = MakeCrcTables();

// --- little-endian fields ---
std::uint16_t Get16(const std::byte* p) {
  return static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) |
                                    (std::to_integer<unsigned>(p[1]) << 8));
}
std::uint32_t Get32(const std::byte* p) {
  return static_cast<std::uint32_t>(Get16(p)) | (static_cast<std::uint32_t>(Get16(p + 2)) << 16);
}
std::uint64_t Get64(const std::byte* p) {
  return static_cast<std::uint64_t>(Get32(p)) | (static_cast<std::uint64_t>(Get32(p + 4)) << 32);
}
void Put16(std::string& out, std::uint16_t v) {
  out.push_back(static_cast<char>(v & 0xFF));
  out.push_back(static_cast<char>(v >> 8));
}
void Put32(std::string& out, std::uint32_t v) {
  Put16(out, static_cast<std::uint16_t>(v & 0xFFFF));
  Put16(out, static_cast<std::uint16_t>(v >> 16));
}
void Put64(std::string& out, std::uint64_t v) {
  Put32(out, static_cast<std::uint32_t>(v & 0xFFFFFFFF));
  Put32(out, static_cast<std::uint32_t>(v >> 32));
}
std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}
std::string_view AsView(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// All of `out` from `offset` of `fd`: EINTR retried, short reads continued; end of file before
// the last byte is DataLoss.
Status PreadAll(int fd, std::uint64_t offset, std::span<std::byte> out, const std::string& path) {
  std::size_t done = 0;
  while (done < out.size()) {
    const std::uint64_t at = offset + done;
    if (at > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max())) {
      return DataLossError(fmt::format("{}: offset {} is out of range", path, at));
    }
    const std::size_t want = std::min<std::size_t>(out.size() - done, std::size_t{1} << 30);
    const ssize_t n = ::pread(fd, out.data() + done, want, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, fmt::format("pread {} offset {}", path, at));
    }
    if (n == 0) {
      return DataLossError(
          fmt::format("{}: truncated: end of file at byte {} reading {} bytes at {}", path, at,
                      out.size(), offset));
    }
    done += static_cast<std::size_t>(n);
  }
  return OkStatus();
}

// ZIP64 extended information (extra id 1): the fields whose fixed value is 0xFFFFFFFF (0xFFFF for
// the disk), in the order usize, csize, offset, disk. `extra` is the whole extra area.
struct Zip64Fields {
  std::uint64_t* usize = nullptr;
  std::uint64_t* csize = nullptr;
  std::uint64_t* offset = nullptr;
  std::uint32_t* disk = nullptr;
};
Status ParseExtra(std::span<const std::byte> extra, const Zip64Fields& want, bool local,
                  const std::string& where) {
  std::size_t pos = 0;
  bool seen_zip64 = false;
  while (pos < extra.size()) {
    if (extra.size() - pos < 4) {
      return DataLossError(fmt::format("{}: malformed extra field (a {}-byte tail at {})", where,
                                       extra.size() - pos, pos));
    }
    const std::uint16_t id = Get16(extra.data() + pos);
    const std::uint16_t size = Get16(extra.data() + pos + 2);
    pos += 4;
    if (size > extra.size() - pos) {
      return DataLossError(fmt::format(
          "{}: malformed extra field (block 0x{:04x} of {} bytes at {} runs past its {} bytes)",
          where, id, size, pos - 4, extra.size()));
    }
    if (id == kZip64ExtraId && !seen_zip64) {
      seen_zip64 = true;
      std::size_t at = pos;
      const std::size_t end = pos + size;
      auto take64 = [&](std::uint64_t* field, const char* what) -> Status {
        if (end - at < 8) {
          return DataLossError(
              fmt::format("{}: ZIP64 extra field too short for the {}", where, what));
        }
        *field = Get64(extra.data() + at);
        at += 8;
        return OkStatus();
      };
      // A local header's ZIP64 field holds both sizes when it is there at all.
      if (want.usize) ZINF_RETURN_IF_ERROR(take64(want.usize, "size"));
      if (want.csize) ZINF_RETURN_IF_ERROR(take64(want.csize, "compressed size"));
      if (!local && want.offset) ZINF_RETURN_IF_ERROR(take64(want.offset, "local header offset"));
      if (!local && want.disk) {
        if (end - at < 4) {
          return DataLossError(fmt::format("{}: ZIP64 extra field too short for the disk", where));
        }
        *want.disk = Get32(extra.data() + at);
      }
    }
    pos += size;
  }
  if (!seen_zip64 && (want.usize || want.csize || (!local && (want.offset || want.disk)))) {
    return DataLossError(
        fmt::format("{}: a field is 0xFFFFFFFF but there is no ZIP64 extra field", where));
  }
  return OkStatus();
}

// Reads the central directory [begin, begin + size) in windows, so that its size (bounded only by
// the file) is never allocated at once.
class CentralCursor {
 public:
  CentralCursor(int fd, const std::string& path, std::uint64_t begin, std::uint64_t size)
      : fd_(fd), path_(path), pos_(begin), end_(begin + size) {}

  std::uint64_t pos() const { return pos_; }
  std::uint64_t remaining() const { return end_ - pos_; }

  // The next `n` bytes (n <= kCentralWindowBytes), valid until the next call.
  Result<std::span<const std::byte>> Take(std::size_t n, std::string_view what) {
    if (n > remaining()) {
      return DataLossError(
          fmt::format("{}: {} at byte {} runs past the end of the central "
                      "directory (byte {})",
                      path_, what, pos_, end_));
    }
    if (pos_ < win_begin_ || pos_ + n > win_begin_ + window_.size()) {
      const std::size_t len = static_cast<std::size_t>(
          std::min<std::uint64_t>(std::max(n, kCentralWindowBytes), remaining()));
      window_.resize(len);
      ZINF_RETURN_IF_ERROR(PreadAll(fd_, pos_, std::span(window_), path_));
      win_begin_ = pos_;
    }
    std::span<const std::byte> out(window_.data() + (pos_ - win_begin_), n);
    pos_ += n;
    return out;
  }

 private:
  int fd_;
  const std::string& path_;
  std::uint64_t pos_;
  std::uint64_t end_;
  std::vector<std::byte> window_;
  std::uint64_t win_begin_ = 0;
};

struct Extent {
  std::uint64_t begin;  // local header
  std::uint64_t end;    // past the data
  std::size_t index;
};

}  // namespace

std::uint32_t Crc32(std::span<const std::byte> data, std::uint32_t crc) {
  std::uint32_t c = ~crc;
  const std::byte* p = data.data();
  std::size_t n = data.size();
  const auto& t = kCrcTables;
  while (n >= 8) {
    const std::uint32_t lo = c ^ Get32(p);
    const std::uint32_t hi = Get32(p + 4);
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ std::to_integer<std::uint32_t>(*p++)) & 0xFF];
  return ~c;
}

// ----------------------------------------------------------------------------------------------
// ZipReader

Result<ZipReader> ZipReader::Open(const std::string& path, const ZipLimits& limits) {
  return OpenAt(AT_FDCWD, path, path, limits);
}

Result<ZipReader> ZipReader::OpenAt(int dir_fd, const std::string& file_name, std::string display,
                                    const ZipLimits& limits) {
  ZipReader r;
  r.path_ = std::move(display);
  const std::string& path = r.path_;
  ZINF_ASSIGN_OR_RETURN(r.fd_,
                        storage::OpenFileAt(dir_fd, file_name, path, storage::FileAccess::kRead,
                                            storage::Follow::kNo));
  ZINF_RETURN_IF_ERROR(storage::ClearNonBlock(r.fd_.get(), path));
  const int fd = r.fd_.get();
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, fmt::format("fstat {}", path));
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size > limits.max_archive_bytes) {
    return DataLossError(fmt::format("{}: {} bytes, larger than the limit of {} bytes", path,
                                     file_size, limits.max_archive_bytes));
  }
  if (file_size < kEocdSize) {
    return DataLossError(fmt::format(
        "{}: not a zip archive ({} bytes, shorter than an end of central directory record)", path,
        file_size));
  }

  // The end of central directory record: the last one whose comment reaches the end of the file
  // exactly, within the last 64 KiB + 22 bytes.
  const std::uint64_t tail_size = std::min<std::uint64_t>(file_size, kEocdSize + kMaxComment);
  const std::uint64_t tail_begin = file_size - tail_size;
  std::vector<std::byte> tail(static_cast<std::size_t>(tail_size));
  ZINF_RETURN_IF_ERROR(PreadAll(fd, tail_begin, std::span(tail), path));
  std::optional<std::uint64_t> eocd_pos;
  for (std::size_t i = tail.size() - kEocdSize + 1; i-- > 0;) {
    if (Get32(tail.data() + i) != kEocdSig) continue;
    if (i + kEocdSize + Get16(tail.data() + i + 20) == tail.size()) {
      eocd_pos = tail_begin + i;
      break;
    }
  }
  if (!eocd_pos) {
    return DataLossError(fmt::format(
        "{}: not a zip archive (no end of central directory record in its last {} bytes)", path,
        tail_size));
  }
  const std::byte* e = tail.data() + (*eocd_pos - tail_begin);
  const std::uint16_t disk = Get16(e + 4);
  const std::uint16_t cd_disk = Get16(e + 6);
  std::uint64_t count_disk = Get16(e + 8);
  std::uint64_t count = Get16(e + 10);
  std::uint64_t cd_size = Get32(e + 12);
  std::uint64_t cd_offset = Get32(e + 16);
  std::uint64_t cd_limit = *eocd_pos;  // the central directory ends before this

  // ZIP64: a locator right before the record points at the ZIP64 end of central directory.
  if (*eocd_pos >= kZip64LocatorSize) {
    const std::uint64_t loc_pos = *eocd_pos - kZip64LocatorSize;
    std::array<std::byte, kZip64LocatorSize> loc{};
    ZINF_RETURN_IF_ERROR(PreadAll(fd, loc_pos, std::span(loc), path));
    if (Get32(loc.data()) == kZip64LocatorSig) {
      const std::uint32_t rec_disk = Get32(loc.data() + 4);
      const std::uint64_t rec_pos = Get64(loc.data() + 8);
      const std::uint32_t disks = Get32(loc.data() + 16);
      if (rec_disk != 0 || disks > 1) {
        return DataLossError(
            fmt::format("{}: ZIP64 locator at byte {}: a multi-disk archive "
                        "(disk {}, {} disks) is not supported",
                        path, loc_pos, rec_disk, disks));
      }
      if (rec_pos > loc_pos || loc_pos - rec_pos < kZip64EocdSize) {
        return DataLossError(
            fmt::format("{}: ZIP64 locator at byte {} points at byte {}, which "
                        "leaves no room for a ZIP64 end of central directory",
                        path, loc_pos, rec_pos));
      }
      std::array<std::byte, kZip64EocdSize> rec{};
      ZINF_RETURN_IF_ERROR(PreadAll(fd, rec_pos, std::span(rec), path));
      if (Get32(rec.data()) != kZip64EocdSig) {
        return DataLossError(fmt::format(
            "{}: no ZIP64 end of central directory at byte {} (where the locator points)", path,
            rec_pos));
      }
      const std::uint64_t rec_rest = Get64(rec.data() + 4);
      if (rec_rest < kZip64EocdSize - 12 || rec_rest > loc_pos - rec_pos - 12) {
        return DataLossError(
            fmt::format("{}: ZIP64 end of central directory at byte {}: bad record size {}", path,
                        rec_pos, rec_rest));
      }
      if (Get32(rec.data() + 16) != 0 || Get32(rec.data() + 20) != 0) {
        return DataLossError(fmt::format(
            "{}: ZIP64 end of central directory: a multi-disk archive is not supported", path));
      }
      count_disk = Get64(rec.data() + 24);
      count = Get64(rec.data() + 32);
      cd_size = Get64(rec.data() + 40);
      cd_offset = Get64(rec.data() + 48);
      cd_limit = rec_pos;
    } else if (disk != 0 || cd_disk != 0) {
      return DataLossError(fmt::format(
          "{}: a multi-disk archive (disk {}, central directory on disk {}) is not supported", path,
          disk, cd_disk));
    }
  } else if (disk != 0 || cd_disk != 0) {
    return DataLossError(fmt::format(
        "{}: a multi-disk archive (disk {}, central directory on disk {}) is not supported", path,
        disk, cd_disk));
  }

  if (count_disk != count) {
    return DataLossError(
        fmt::format("{}: end of central directory: {} entries on this disk but "
                    "{} in all (multi-disk archives are not supported)",
                    path, count_disk, count));
  }
  if (count > limits.max_entries) {
    return DataLossError(
        fmt::format("{}: {} entries, more than the limit of {}", path, count, limits.max_entries));
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset) {
    return DataLossError(fmt::format(
        "{}: truncated or corrupt: the central directory ({} bytes at byte {}) lies past the "
        "end of central directory record at byte {} (file of {} bytes)",
        path, cd_size, cd_offset, cd_limit, file_size));
  }
  if (count > cd_size / kCentralSize) {
    return DataLossError(fmt::format("{}: {} entries cannot fit in a central directory of {} bytes",
                                     path, count, cd_size));
  }

  // The central directory.
  CentralCursor cur(fd, path, cd_offset, cd_size);
  std::vector<Extent> extents;
  r.entries_.reserve(static_cast<std::size_t>(count));
  extents.reserve(static_cast<std::size_t>(count));
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t at = cur.pos();
    const std::string where = fmt::format("{}: central directory entry {} at byte {}", path, i, at);
    ZINF_ASSIGN_OR_RETURN(auto fixed, cur.Take(kCentralSize, "central directory entry"));
    if (Get32(fixed.data()) != kCentralSig) {
      return DataLossError(fmt::format("{}: bad signature 0x{:08x}", where, Get32(fixed.data())));
    }
    const std::uint16_t flags = Get16(fixed.data() + 8);
    const std::uint16_t method = Get16(fixed.data() + 10);
    const std::uint32_t crc = Get32(fixed.data() + 16);
    std::uint64_t csize = Get32(fixed.data() + 20);
    std::uint64_t usize = Get32(fixed.data() + 24);
    const std::uint16_t name_len = Get16(fixed.data() + 28);
    const std::uint16_t extra_len = Get16(fixed.data() + 30);
    const std::uint16_t comment_len = Get16(fixed.data() + 32);
    std::uint32_t start_disk = Get16(fixed.data() + 34);
    std::uint64_t local_offset = Get32(fixed.data() + 42);
    if (name_len == 0) return DataLossError(fmt::format("{}: empty name", where));
    if (name_len > limits.max_name_bytes) {
      return DataLossError(fmt::format("{}: a name of {} bytes, longer than the limit of {}", where,
                                       name_len, limits.max_name_bytes));
    }
    ZINF_ASSIGN_OR_RETURN(auto var, cur.Take(std::size_t{name_len} + extra_len + comment_len,
                                             "central directory entry"));
    std::string name(AsView(var.subspan(0, name_len)));
    // torch's and DeepSpeed's names are ASCII paths; a name that is not printable ASCII would
    // carry terminal escapes into every message that names the entry.
    if (!std::all_of(name.begin(), name.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) {
      return DataLossError(fmt::format("{}: the name '{}' is not printable ASCII", where,
                                       Printable(name)));
    }
    const std::string ewhere =
        fmt::format("{}: entry '{}' (central directory byte {})", path, name, at);
    if (flags & kEncryptedFlags) {
      return DataLossError(
          fmt::format("{}: encrypted (flags 0x{:04x}); not supported", ewhere, flags));
    }
    if (method != 0) {
      return DataLossError(
          fmt::format("{}: compressed (method {}); only stored entries (method 0) are supported",
                      ewhere, method));
    }
    Zip64Fields want;
    if (usize == kMax32) want.usize = &usize;
    if (csize == kMax32) want.csize = &csize;
    if (local_offset == kMax32) want.offset = &local_offset;
    if (start_disk == kMax16) want.disk = &start_disk;
    ZINF_RETURN_IF_ERROR(
        ParseExtra(var.subspan(name_len, extra_len), want, /*local=*/false, ewhere));
    if (start_disk != 0) {
      return DataLossError(
          fmt::format("{}: on disk {}; multi-disk archives are not supported", ewhere, start_disk));
    }
    if (csize != usize) {
      return DataLossError(
          fmt::format("{}: stored, but its size {} differs from its compressed "
                      "size {}",
                      ewhere, usize, csize));
    }

    // The local header, checked against the central one.
    if (local_offset > cd_offset || cd_offset - local_offset < kLocalSize) {
      return DataLossError(
          fmt::format("{}: local header at byte {} lies past the start of the "
                      "central directory (byte {})",
                      ewhere, local_offset, cd_offset));
    }
    std::array<std::byte, kLocalSize> lh{};
    ZINF_RETURN_IF_ERROR(PreadAll(fd, local_offset, std::span(lh), path));
    if (Get32(lh.data()) != kLocalSig) {
      return DataLossError(fmt::format("{}: no local header at byte {} (signature 0x{:08x})",
                                       ewhere, local_offset, Get32(lh.data())));
    }
    const std::uint16_t lflags = Get16(lh.data() + 6);
    const std::uint16_t lmethod = Get16(lh.data() + 8);
    const std::uint32_t lcrc = Get32(lh.data() + 14);
    std::uint64_t lcsize = Get32(lh.data() + 18);
    std::uint64_t lusize = Get32(lh.data() + 22);
    const std::uint16_t lname_len = Get16(lh.data() + 26);
    const std::uint16_t lextra_len = Get16(lh.data() + 28);
    const std::string lwhere = fmt::format("{}: local header at byte {}", ewhere, local_offset);
    if (lflags & kEncryptedFlags) {
      return DataLossError(fmt::format("{}: encrypted (flags 0x{:04x})", lwhere, lflags));
    }
    if (lmethod != 0) {
      return DataLossError(fmt::format("{}: compressed (method {})", lwhere, lmethod));
    }
    const std::uint64_t var_len = std::uint64_t{lname_len} + lextra_len;
    if (var_len > cd_offset - local_offset - kLocalSize) {
      return DataLossError(
          fmt::format("{}: its name and extra field ({} bytes) run into the "
                      "central directory",
                      lwhere, var_len));
    }
    if (lname_len != name_len) {
      return DataLossError(
          fmt::format("{}: its name ({} bytes) differs from the central "
                      "directory's ({} bytes)",
                      lwhere, lname_len, name_len));
    }
    std::vector<std::byte> lvar(static_cast<std::size_t>(var_len));
    ZINF_RETURN_IF_ERROR(PreadAll(fd, local_offset + kLocalSize, std::span(lvar), path));
    if (AsView(std::span(lvar).subspan(0, lname_len)) != name) {
      return DataLossError(fmt::format("{}: its name '{}' differs from the central directory's",
                                       lwhere,
                                       Printable(AsView(std::span(lvar).subspan(0, lname_len)))));
    }
    Zip64Fields lwant;
    if (lusize == kMax32 || lcsize == kMax32) {
      lwant.usize = &lusize;
      lwant.csize = &lcsize;
    }
    ZINF_RETURN_IF_ERROR(
        ParseExtra(std::span(lvar).subspan(lname_len), lwant, /*local=*/true, lwhere));
    // With a data descriptor (bit 3, as torch writes), the local fields may be zero.
    const bool deferred = (lflags & kDataDescriptorFlag) && lcrc == 0 && lcsize == 0 && lusize == 0;
    if (!deferred && (lcrc != crc || lcsize != csize || lusize != usize)) {
      return DataLossError(fmt::format(
          "{}: size {} / CRC 0x{:08x} differ from the central directory's size {} / CRC 0x{:08x}",
          lwhere, lusize, lcrc, usize, crc));
    }
    const std::uint64_t data_offset = local_offset + kLocalSize + var_len;
    if (usize > cd_offset - data_offset) {
      return DataLossError(
          fmt::format("{}: its {} bytes at byte {} run past the start of the "
                      "central directory (byte {})",
                      ewhere, usize, data_offset, cd_offset));
    }
    extents.push_back({local_offset, data_offset + usize, r.entries_.size()});
    r.entries_.push_back(ZipEntry{std::move(name), data_offset, usize, crc});
  }
  if (cur.remaining() != 0) {
    return DataLossError(fmt::format("{}: the central directory has {} bytes after its {} entries",
                                     path, cur.remaining(), count));
  }

  // Names unique: the index sorted by name.
  r.by_name_.resize(r.entries_.size());
  for (std::size_t i = 0; i < r.by_name_.size(); ++i) r.by_name_[i] = i;
  std::sort(r.by_name_.begin(), r.by_name_.end(),
            [&](std::size_t a, std::size_t b) { return r.entries_[a].name < r.entries_[b].name; });
  for (std::size_t i = 1; i < r.by_name_.size(); ++i) {
    const ZipEntry& a = r.entries_[r.by_name_[i - 1]];
    if (a.name == r.entries_[r.by_name_[i]].name) {
      return DataLossError(fmt::format("{}: duplicate entry name '{}' (entries {} and {})", path,
                                       a.name, std::min(r.by_name_[i - 1], r.by_name_[i]),
                                       std::max(r.by_name_[i - 1], r.by_name_[i])));
    }
  }
  // Entries never overlap (from local header to the end of the data).
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].begin < extents[i - 1].end) {
      return DataLossError(fmt::format(
          "{}: entry '{}' (bytes {}..{}) overlaps entry '{}' (bytes {}..{})", path,
          r.entries_[extents[i].index].name, extents[i].begin, extents[i].end,
          r.entries_[extents[i - 1].index].name, extents[i - 1].begin, extents[i - 1].end));
    }
  }
  return r;
}

const ZipEntry* ZipReader::Find(std::string_view name) const {
  auto it =
      std::lower_bound(by_name_.begin(), by_name_.end(), name,
                       [&](std::size_t i, std::string_view n) { return entries_[i].name < n; });
  if (it == by_name_.end() || entries_[*it].name != name) return nullptr;
  return &entries_[*it];
}

Result<std::string> ZipReader::ReadEntry(std::string_view name, std::uint64_t max_bytes) const {
  const ZipEntry* entry = Find(name);
  if (!entry) return NotFoundError(fmt::format("{}: no entry '{}'", path_, name));
  if (entry->size > max_bytes) {
    return InvalidArgumentError(fmt::format("{}: entry '{}' is {} bytes, larger than {} bytes",
                                            path_, name, entry->size, max_bytes));
  }
  std::string out(static_cast<std::size_t>(entry->size), '\0');
  ZINF_RETURN_IF_ERROR(
      ReadRange(*entry, 0, std::as_writable_bytes(std::span(out.data(), out.size()))));
  const std::uint32_t crc = Crc32(AsBytes(out));
  if (crc != entry->crc32) {
    return DataLossError(
        fmt::format("{}: entry '{}' (at byte {}): CRC-32 0x{:08x}, expected "
                    "0x{:08x}",
                    path_, name, entry->data_offset, crc, entry->crc32));
  }
  return out;
}

Status ZipReader::ReadRange(const ZipEntry& entry, std::uint64_t offset,
                            std::span<std::byte> out) const {
  if (offset > entry.size || out.size() > entry.size - offset) {
    return InvalidArgumentError(
        fmt::format("{}: entry '{}': {} bytes at offset {} run past its "
                    "{} bytes",
                    path_, entry.name, out.size(), offset, entry.size));
  }
  if (entry.data_offset > std::numeric_limits<std::uint64_t>::max() - entry.size) {
    return InvalidArgumentError(
        fmt::format("{}: entry '{}': bad data offset {}", path_, entry.name, entry.data_offset));
  }
  return Annotate(PreadAll(fd_.get(), entry.data_offset + offset, out, path_),
                  fmt::format("entry '{}': ", entry.name));
}

Status ZipReader::VerifyCrc(const ZipEntry& entry) const {
  std::vector<std::byte> buf(
      static_cast<std::size_t>(std::min<std::uint64_t>(entry.size, kChunkBytes)));
  std::uint32_t crc = 0;
  for (std::uint64_t done = 0; done < entry.size;) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), entry.size - done));
    ZINF_RETURN_IF_ERROR(ReadRange(entry, done, std::span(buf.data(), n)));
    crc = Crc32(std::span<const std::byte>(buf.data(), n), crc);
    done += n;
  }
  if (crc != entry.crc32) {
    return DataLossError(
        fmt::format("{}: entry '{}' (at byte {}): CRC-32 0x{:08x}, expected "
                    "0x{:08x}",
                    path_, entry.name, entry.data_offset, crc, entry.crc32));
  }
  return OkStatus();
}

// ----------------------------------------------------------------------------------------------
// ZipWriter

struct ZipWriter::State {
  struct Written {
    std::string name;
    std::uint64_t local_offset;
    std::uint64_t size;
    std::uint32_t crc;
  };

  explicit State(storage::AtomicFile f) : file(std::move(f)) {}

  storage::AtomicFile file;
  std::uint64_t offset = 0;
  std::uint64_t started = 0;  // write-behind: writeback started for [0, started)
  std::uint64_t waited = 0;   // and waited for [0, waited)
  std::vector<Written> written;
  std::unordered_set<std::string> names;
  bool force_zip64 = false;
  bool failed = false;  // a write failed: the output is unusable
  bool finished = false;
  // The entry between Begin and End.
  bool open = false;
  std::uint64_t open_size = 0;
  std::uint64_t open_done = 0;
  std::uint32_t open_crc = 0;

  Status Usable(std::string_view op) const {
    if (finished) {
      return FailedPreconditionError(
          fmt::format("zip {}: {} after Finish/Abandon", file.final_path(), op));
    }
    if (failed) {
      return FailedPreconditionError(
          fmt::format("zip {}: {} after an earlier write failed", file.final_path(), op));
    }
    return OkStatus();
  }
  Status Write(std::span<const std::byte> bytes) {
    Status s = file.Write(bytes);
    if (s) {
      offset += bytes.size();
      s = WriteBehind();
    }
    if (!s) failed = true;
    return s;
  }
  // Write-behind: the writeback of each kWriteBehindBytes window is started as soon as it is
  // written, and waited for (its clean pages then dropped) one window later. So the disk writes
  // while the caller produces the next window (reads its source), the commit's fsync finds
  // little left to write, and the output keeps at most about two windows dirty in the page
  // cache. Only a hint to the kernel: durability comes from the commit's fsync. An error of
  // sync_file_range (EIO) fails the write.
  Status WriteBehind() {
    constexpr std::uint64_t kWriteBehindBytes = 32ull << 20;
    if (offset - started < kWriteBehindBytes) return OkStatus();
    storage::Env& env = storage::Env::Default();
    const int fd = file.fd();
    if (started > waited) {
      while (env.SyncRange(fd, static_cast<off_t>(waited), static_cast<off_t>(started - waited),
                           SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                               SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
        if (errno != EINTR) return ErrnoError(errno, "zip " + file.temp_path() + ": write-behind");
      }
      (void)env.Advise(fd, static_cast<off_t>(waited), static_cast<off_t>(started - waited),
                       POSIX_FADV_DONTNEED);
      waited = started;
    }
    while (env.SyncRange(fd, static_cast<off_t>(started), static_cast<off_t>(offset - started),
                         SYNC_FILE_RANGE_WRITE) != 0) {
      if (errno != EINTR) return ErrnoError(errno, "zip " + file.temp_path() + ": write-behind");
    }
    started = offset;
    return OkStatus();
  }
  Status CheckName(std::string_view name) const {
    if (name.empty()) {
      return InvalidArgumentError(fmt::format("zip {}: empty entry name", file.final_path()));
    }
    if (name.size() > kMaxWriterNameBytes) {
      return InvalidArgumentError(fmt::format("zip {}: entry name of {} bytes, longer than {}",
                                              file.final_path(), name.size(), kMaxWriterNameBytes));
    }
    if (names.contains(std::string(name))) {
      return InvalidArgumentError(
          fmt::format("zip {}: entry '{}' added twice", file.final_path(), name));
    }
    return OkStatus();
  }
  // Writes the local header of an entry of `size` bytes at the current offset, its data then
  // starting at a multiple of 64.
  Status WriteLocalHeader(std::string_view name, std::uint64_t size, std::uint32_t crc) {
    const bool zip64 = force_zip64 || size >= kMax32;
    std::string h;
    Put32(h, kLocalSig);
    Put16(h, zip64 ? 45 : 20);
    Put16(h, kUtf8Flag);
    Put16(h, 0);  // stored
    Put16(h, kDosTime);
    Put16(h, kDosDate);
    Put32(h, crc);
    Put32(h, zip64 ? kMax32 : static_cast<std::uint32_t>(size));
    Put32(h, zip64 ? kMax32 : static_cast<std::uint32_t>(size));
    Put16(h, static_cast<std::uint16_t>(name.size()));
    const std::uint64_t zip64_len = zip64 ? 4 + 16 : 0;
    const std::uint64_t unpadded = offset + kLocalSize + name.size() + zip64_len + 4;
    const std::uint64_t pad = (kAlignment - unpadded % kAlignment) % kAlignment;
    Put16(h, static_cast<std::uint16_t>(zip64_len + 4 + pad));
    h.append(name);
    if (zip64) {
      Put16(h, kZip64ExtraId);
      Put16(h, 16);
      Put64(h, size);
      Put64(h, size);
    }
    Put16(h, kPaddingExtraId);
    Put16(h, static_cast<std::uint16_t>(pad));
    h.append(pad, 'Z');
    written.push_back({std::string(name), offset, size, crc});
    names.insert(std::string(name));
    return Write(AsBytes(h));
  }
};

ZipWriter::ZipWriter(ZipWriter&&) noexcept = default;
ZipWriter& ZipWriter::operator=(ZipWriter&&) noexcept = default;
ZipWriter::~ZipWriter() = default;  // the AtomicFile removes an uncommitted temporary

Result<ZipWriter> ZipWriter::Create(const std::string& path, storage::Overwrite overwrite) {
  ZINF_ASSIGN_OR_RETURN(storage::AtomicFile file, storage::AtomicFile::Create(path, overwrite));
  ZipWriter w;
  w.state_ = std::make_unique<State>(std::move(file));
  w.state_->force_zip64 = internal::g_force_zip64_for_testing.load();
  return w;
}

Status ZipWriter::Add(std::string_view name, std::span<const std::byte> data) {
  if (!state_) return FailedPreconditionError("zip writer: moved from");
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(s.Usable("Add"));
  if (s.open) {
    return FailedPreconditionError(
        fmt::format("zip {}: Add('{}') while an entry is open", s.file.final_path(), name));
  }
  ZINF_RETURN_IF_ERROR(s.CheckName(name));
  ZINF_RETURN_IF_ERROR(s.WriteLocalHeader(name, data.size(), Crc32(data)));
  return s.Write(data);
}

Status ZipWriter::Begin(std::string_view name, std::uint64_t size) {
  if (!state_) return FailedPreconditionError("zip writer: moved from");
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(s.Usable("Begin"));
  if (s.open) {
    return FailedPreconditionError(
        fmt::format("zip {}: Begin('{}') while an entry is open", s.file.final_path(), name));
  }
  ZINF_RETURN_IF_ERROR(s.CheckName(name));
  // The CRC is not known yet: written as 0 and patched by End().
  ZINF_RETURN_IF_ERROR(s.WriteLocalHeader(name, size, 0));
  s.open = true;
  s.open_size = size;
  s.open_done = 0;
  s.open_crc = 0;
  return OkStatus();
}

Status ZipWriter::Append(std::span<const std::byte> data) {
  if (!state_) return FailedPreconditionError("zip writer: moved from");
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(s.Usable("Append"));
  if (!s.open) {
    return FailedPreconditionError(
        fmt::format("zip {}: Append without Begin", s.file.final_path()));
  }
  if (data.size() > s.open_size - s.open_done) {
    return InvalidArgumentError(fmt::format(
        "zip {}: entry '{}': appending {} bytes to {} of {} would pass its size",
        s.file.final_path(), s.written.back().name, data.size(), s.open_done, s.open_size));
  }
  ZINF_RETURN_IF_ERROR(s.Write(data));
  s.open_crc = Crc32(data, s.open_crc);
  s.open_done += data.size();
  return OkStatus();
}

Status ZipWriter::End() {
  if (!state_) return FailedPreconditionError("zip writer: moved from");
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(s.Usable("End"));
  if (!s.open) {
    return FailedPreconditionError(fmt::format("zip {}: End without Begin", s.file.final_path()));
  }
  State::Written& entry = s.written.back();
  if (s.open_done != s.open_size) {
    return InvalidArgumentError(fmt::format("zip {}: entry '{}': {} bytes appended, {} declared",
                                            s.file.final_path(), entry.name, s.open_done,
                                            s.open_size));
  }
  entry.crc = s.open_crc;
  std::string crc;
  Put32(crc, s.open_crc);
  const std::uint64_t at = entry.local_offset + 14;
  for (std::size_t done = 0; done < crc.size();) {
    const ssize_t n =
        ::pwrite(s.file.fd(), crc.data() + done, crc.size() - done, static_cast<off_t>(at + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      s.failed = true;
      return ErrnoError(errno, fmt::format("pwrite {} offset {}", s.file.temp_path(), at + done));
    }
    done += static_cast<std::size_t>(n);
  }
  s.open = false;
  return OkStatus();
}

Status ZipWriter::Finish() {
  if (!state_) return FailedPreconditionError("zip writer: moved from");
  State& s = *state_;
  ZINF_RETURN_IF_ERROR(s.Usable("Finish"));
  if (s.open) {
    return FailedPreconditionError(fmt::format("zip {}: Finish while entry '{}' is open",
                                               s.file.final_path(), s.written.back().name));
  }
  const std::uint64_t cd_offset = s.offset;
  std::string cd;
  for (const State::Written& w : s.written) {
    const bool big_size = s.force_zip64 || w.size >= kMax32;
    const bool big_offset = s.force_zip64 || w.local_offset >= kMax32;
    std::string extra;
    if (big_size || big_offset) {
      Put16(extra, kZip64ExtraId);
      Put16(extra, static_cast<std::uint16_t>((big_size ? 16 : 0) + (big_offset ? 8 : 0)));
      if (big_size) {
        Put64(extra, w.size);
        Put64(extra, w.size);
      }
      if (big_offset) Put64(extra, w.local_offset);
    }
    const bool zip64 = !extra.empty();
    Put32(cd, kCentralSig);
    Put16(cd, zip64 ? 45 : 20);  // made by: MS-DOS, spec version
    Put16(cd, zip64 ? 45 : 20);
    Put16(cd, kUtf8Flag);
    Put16(cd, 0);
    Put16(cd, kDosTime);
    Put16(cd, kDosDate);
    Put32(cd, w.crc);
    Put32(cd, big_size ? kMax32 : static_cast<std::uint32_t>(w.size));
    Put32(cd, big_size ? kMax32 : static_cast<std::uint32_t>(w.size));
    Put16(cd, static_cast<std::uint16_t>(w.name.size()));
    Put16(cd, static_cast<std::uint16_t>(extra.size()));
    Put16(cd, 0);  // comment
    Put16(cd, 0);  // disk
    Put16(cd, 0);  // internal attributes
    Put32(cd, 0);  // external attributes
    Put32(cd, big_offset ? kMax32 : static_cast<std::uint32_t>(w.local_offset));
    cd.append(w.name);
    cd.append(extra);
    if (cd.size() >= kCentralWindowBytes) {
      ZINF_RETURN_IF_ERROR(s.Write(AsBytes(cd)));
      cd.clear();
    }
  }
  ZINF_RETURN_IF_ERROR(s.Write(AsBytes(cd)));
  cd.clear();
  const std::uint64_t cd_size = s.offset - cd_offset;
  const std::uint64_t count = s.written.size();
  std::string tail;
  const bool zip64 = s.force_zip64 || count >= kMax16 || cd_size >= kMax32 || cd_offset >= kMax32;
  if (zip64) {
    const std::uint64_t rec_pos = s.offset;
    Put32(tail, kZip64EocdSig);
    Put64(tail, kZip64EocdSize - 12);
    Put16(tail, 45);
    Put16(tail, 45);
    Put32(tail, 0);
    Put32(tail, 0);
    Put64(tail, count);
    Put64(tail, count);
    Put64(tail, cd_size);
    Put64(tail, cd_offset);
    Put32(tail, kZip64LocatorSig);
    Put32(tail, 0);
    Put64(tail, rec_pos);
    Put32(tail, 1);
  }
  const auto count16 = static_cast<std::uint16_t>(zip64 ? kMax16 : count);
  Put32(tail, kEocdSig);
  Put16(tail, 0);
  Put16(tail, 0);
  Put16(tail, count16);
  Put16(tail, count16);
  Put32(tail, zip64 ? kMax32 : static_cast<std::uint32_t>(cd_size));
  Put32(tail, zip64 ? kMax32 : static_cast<std::uint32_t>(cd_offset));
  Put16(tail, 0);
  ZINF_RETURN_IF_ERROR(s.Write(AsBytes(tail)));
  Status commit = s.file.Commit();
  if (!commit) {
    s.failed = true;
    return commit;
  }
  s.finished = true;
  return OkStatus();
}

void ZipWriter::Abandon() {
  if (!state_) return;
  state_->file.Abandon();
  state_->finished = true;
}

}  // namespace zinf::interop
