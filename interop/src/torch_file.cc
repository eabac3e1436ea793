#include "zinf/interop/torch_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "text.h"
#include <fmt/ranges.h>

namespace zinf::interop {
namespace {

// Storage bytes are little-endian; they are copied to and from memory as they are.
static_assert(std::endian::native == std::endian::little, "torch files are read as little-endian");

struct DtypeInfo {
  std::string_view name;
  std::size_t bytes;
};
constexpr std::array kDtypes = {
    DtypeInfo{"float32", 4}, DtypeInfo{"float16", 2},   DtypeInfo{"bfloat16", 2},
    DtypeInfo{"float64", 8}, DtypeInfo{"int64", 8},     DtypeInfo{"int32", 4},
    DtypeInfo{"int16", 2},   DtypeInfo{"int8", 1},      DtypeInfo{"uint8", 1},
    DtypeInfo{"bool", 1},    DtypeInfo{"complex64", 8}, DtypeInfo{"complex128", 16},
};

// torch has no hard limit on dimensions; no checkpoint has more than a handful.
constexpr std::size_t kMaxDims = 64;
// Storage bytes are read through a buffer of this size (or straight into the output).
constexpr std::size_t kChunkBytes = std::size_t{1} << 20;
// data.pkl's companion: torch writes "3\n"; its readers accept 1..10.
constexpr std::uint64_t kMaxVersionBytes = 64;
constexpr std::string_view kLegacyMessage =
    "torch's legacy (non-zip) serialization; save it again with torch.save's default "
    "(_use_new_zipfile_serialization=True)";
// How much of a str key an error quotes.
constexpr std::size_t kMaxKeyInPath = 64;

std::string QuoteForPath(std::string_view s) {
  std::string out = "[\"";
  for (std::size_t i = 0; i < s.size() && i < kMaxKeyInPath; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMaxKeyInPath) out += "...";
  out += "\"]";
  return out;
}

// How a dict key reads in a tree path: ["name"], [3], [tuple].
std::string KeyForPath(const PyValue& key) {
  if (const auto* s = key.as<std::string>()) return QuoteForPath(*s);
  if (const auto* i = key.as<std::int64_t>()) return fmt::format("[{}]", *i);
  return fmt::format("[<{}>]", key.TypeName());
}

bool IsContiguous(const PyTensor& t) {
  std::uint64_t expected = 1;
  for (std::size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] == 0) return true;  // no elements: any strides
  }
  for (std::size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] != 1 && static_cast<std::uint64_t>(t.stride[d]) != expected) return false;
    expected *= static_cast<std::uint64_t>(t.shape[d]);  // bounded by CheckTensorShape
  }
  return true;
}

// What a tensor view spans, once checked: its element count and how many storage elements from
// its offset it reaches (0 when empty).
struct TensorExtent {
  std::uint64_t numel = 0;
  std::uint64_t end = 0;  // offset + the largest element index + 1 (0 when numel is 0)
};

// Checks `t`'s shape, strides and offset against its own storage_numel (no file involved).
// `where` names the tensor in errors.
Result<TensorExtent> CheckTensorShape(const PyTensor& t, std::string_view where) {
  if (t.shape.size() != t.stride.size()) {
    return DataLossError(fmt::format("{}: {} dims of shape but {} of stride", where, t.shape.size(),
                                     t.stride.size()));
  }
  if (t.shape.size() > kMaxDims) {
    return DataLossError(
        fmt::format("{}: {} dims (at most {} are read)", where, t.shape.size(), kMaxDims));
  }
  TensorExtent ext;
  ext.numel = 1;
  std::uint64_t last = 0;  // the largest element index relative to the offset
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0 || t.stride[d] < 0) {
      return DataLossError(fmt::format("{}: negative size or stride ({} / {}) in dim {}", where,
                                       t.shape[d], t.stride[d], d));
    }
    const auto size = static_cast<std::uint64_t>(t.shape[d]);
    if (__builtin_mul_overflow(ext.numel, size, &ext.numel)) {
      return DataLossError(fmt::format("{}: the element count overflows 64 bits", where));
    }
  }
  if (ext.numel == 0) {
    if (t.offset > t.storage_numel) {
      return DataLossError(fmt::format("{}: storage offset {} past its storage of {} elements",
                                       where, t.offset, t.storage_numel));
    }
    return ext;
  }
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    std::uint64_t span = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(t.shape[d] - 1),
                               static_cast<std::uint64_t>(t.stride[d]), &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return DataLossError(fmt::format("{}: its extent overflows 64 bits", where));
    }
  }
  if (__builtin_add_overflow(t.offset, last, &ext.end) ||
      __builtin_add_overflow(ext.end, std::uint64_t{1}, &ext.end)) {
    return DataLossError(fmt::format("{}: its extent overflows 64 bits", where));
  }
  if (ext.end > t.storage_numel) {
    return DataLossError(fmt::format(
        "{}: reaches element {} (offset {}, shape [{}], stride [{}]) of a storage of {} elements",
        where, ext.end - 1, t.offset, fmt::join(t.shape, ", "), fmt::join(t.stride, ", "),
        t.storage_numel));
  }
  return ext;
}

std::string StorageEntryName(std::string_view archive, std::string_view key) {
  return fmt::format("{}/data/{}", archive, key);
}

// Checks `t` against the storage entry it names in `zip`: dtype known, entry present and of
// storage_numel * dtype bytes, the view within it.
struct CheckedTensor {
  const ZipEntry* entry = nullptr;
  TensorExtent extent;
};
Result<CheckedTensor> CheckTensorInFile(const ZipReader& zip, std::string_view archive,
                                        const PyTensor& t, std::string_view where) {
  const std::size_t elem = DtypeBytes(t.dtype);
  if (elem == 0) {
    return DataLossError(fmt::format("{}: unknown dtype '{}'", where, Printable(t.dtype)));
  }
  if (t.storage_key.empty()) {
    return DataLossError(fmt::format("{}: empty storage key", where));
  }
  const std::string name = StorageEntryName(archive, t.storage_key);
  const ZipEntry* entry = zip.Find(name);
  if (entry == nullptr) {
    return DataLossError(
        fmt::format("{}: its storage entry {} is missing", where, Printable(name)));
  }
  std::uint64_t bytes = 0;
  const bool overflow = __builtin_mul_overflow(t.storage_numel, std::uint64_t{elem}, &bytes);
  if (overflow || bytes != entry->size) {
    return DataLossError(
        fmt::format("{}: storage entry {} holds {} bytes, but {} elements of {} need {}", where,
                    Printable(name), entry->size, t.storage_numel, t.dtype,
                    overflow ? std::string("more than 2^64") : std::to_string(bytes)));
  }
  ZINF_ASSIGN_OR_RETURN(TensorExtent extent, CheckTensorShape(t, where));
  return CheckedTensor{entry, extent};
}

// Visits every PyTensor of `root` with its path ("root[\"a\"][0]"), depth first, without
// recursion (the depth of a tree is the pickle's to choose).
Status ForEachTensor(const PyValue& root,
                     const std::function<Status(const PyTensor&, std::string_view)>& fn) {
  struct Frame {
    const PyValue* value;
    std::size_t next = 0;      // the next child to visit
    std::size_t path_len = 0;  // of `path` at this frame
  };
  std::string path = "root";
  std::vector<Frame> stack;
  stack.push_back({&root, 0, path.size()});
  while (!stack.empty()) {
    Frame& f = stack.back();
    path.resize(f.path_len);
    const PyValue* child = nullptr;
    std::string suffix;
    if (const auto* t = f.value->as<PyTensor>()) {
      ZINF_RETURN_IF_ERROR(fn(*t, std::string_view(path)));
    } else if (const auto* l = f.value->as<PyList>()) {
      if (f.next < l->items.size()) {
        suffix = fmt::format("[{}]", f.next);
        child = &l->items[f.next];
      }
    } else if (const auto* tu = f.value->as<PyTuple>()) {
      if (f.next < tu->items.size()) {
        suffix = fmt::format("[{}]", f.next);
        child = &tu->items[f.next];
      }
    } else if (const auto* d = f.value->as<PyDict>()) {
      // Keys first (a tuple key may hold anything), then values.
      const std::size_t n = d->items.size();
      if (f.next < n) {
        suffix = fmt::format("<key {}>", f.next);
        child = &d->items[f.next].first;
      } else if (f.next < 2 * n) {
        suffix = KeyForPath(d->items[f.next - n].first);
        child = &d->items[f.next - n].second;
      }
    } else if (const auto* o = f.value->as<PyObject>()) {
      if (f.next == 0 && o->state != nullptr) {
        suffix = ".__dict__";
        child = o->state.get();
      }
    }
    if (child == nullptr) {
      stack.pop_back();
      continue;
    }
    ++f.next;
    path += suffix;
    stack.push_back({child, 0, path.size()});
  }
  return OkStatus();
}

// The archive prefix: the first path component every entry shares.
Result<std::string> ArchivePrefix(const ZipReader& zip) {
  if (zip.entries().empty()) {
    return DataLossError(fmt::format("{}: the zip archive has no entries", zip.path()));
  }
  std::string_view archive;
  for (const ZipEntry& e : zip.entries()) {
    const std::size_t slash = e.name.find('/');
    if (slash == std::string::npos || slash == 0) {
      return DataLossError(fmt::format(
          "{}: entry '{}' is not under an archive folder (torch puts every entry in one)",
          zip.path(), Printable(e.name)));
    }
    const std::string_view first = std::string_view(e.name).substr(0, slash);
    if (archive.empty()) {
      archive = first;
    } else if (first != archive) {
      return DataLossError(fmt::format(
          "{}: entries lie under two folders, '{}' and '{}' (torch puts every entry in one)",
          zip.path(), Printable(archive), Printable(first)));
    }
  }
  return std::string(archive);
}

Status CheckVersion(const ZipReader& zip, const std::string& archive) {
  std::string name = archive + "/version";
  if (zip.Find(name) == nullptr && zip.Find(archive + "/.data/version") != nullptr) {
    name = archive + "/.data/version";  // where torch >= 2.x puts it for format versions >= 6
  }
  const ZipEntry* entry = zip.Find(name);
  if (entry == nullptr) {
    return DataLossError(fmt::format("{}: no entry {}", zip.path(), Printable(name)));
  }
  if (entry->size > kMaxVersionBytes) {
    return DataLossError(fmt::format("{}: {} holds {} bytes, not a format version", zip.path(),
                                     Printable(name), entry->size));
  }
  auto text = zip.ReadEntry(name, kMaxVersionBytes);
  if (!text) {
    return std::move(text).error().WithContext(
        fmt::format("{}: {}: ", zip.path(), Printable(name)));
  }
  std::string_view v = *text;
  while (!v.empty() && (v.back() == '\n' || v.back() == '\r' || v.back() == ' ')) {
    v.remove_suffix(1);
  }
  std::uint64_t version = 0;
  bool ok = !v.empty() && v.size() <= 3;
  for (char c : v) {
    if (c < '0' || c > '9') ok = false;
    version = version * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (!ok || version < 1 || version > 10) {
    return DataLossError(fmt::format("{}: {} holds '{}', not a format version torch writes (1..10)",
                                     zip.path(), Printable(name), Printable(v, 32)));
  }
  return OkStatus();
}

// Whether `name` (in `dir_fd`; `path` in errors) starts like torch's legacy format: a pickle
// (PROTO 0x80) instead of "PK".
Result<bool> StartsWithPickle(int dir_fd, const std::string& name, const std::string& path) {
  ZINF_ASSIGN_OR_RETURN(
      storage::UniqueFd fd,
      storage::OpenFileAt(dir_fd, name, path, storage::FileAccess::kRead, storage::Follow::kNo));
  unsigned char first = 0;
  ssize_t n;
  do {
    n = ::pread(fd.get(), &first, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoError(errno, fmt::format("pread {}", path));
  return n == 1 && first == 0x80;
}

// A storage element to fp32, exactly.
float HalfToFloat(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1f;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0x1f) {
    // inf; a NaN keeps its payload and comes out quiet, as IEEE conversion, F16C's vcvtph2ps
    // and torch's .float() make it.
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal: mant * 2^-24, normal in fp32.
    std::uint32_t e = 113;  // the biased fp32 exponent of 2^-14
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}
float BFloat16ToFloat(std::uint16_t b) { return std::bit_cast<float>(std::uint32_t{b} << 16); }

// The checks every Read* makes on a tensor the caller hands in: it is of this file, of `dtype`
// (one of `dtypes`), contiguous and of at most max_numel elements.
struct ReadPlan {
  const ZipEntry* entry = nullptr;
  std::uint64_t numel = 0;
  std::size_t elem = 0;
};
Result<ReadPlan> PlanRead(const ZipReader& zip, const std::string& archive, const PyTensor& t,
                          std::initializer_list<std::string_view> dtypes, std::uint64_t max_numel) {
  const std::string where =
      fmt::format("{}: tensor of storage '{}'", zip.path(), Printable(t.storage_key));
  if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
    return InvalidArgumentError(
        fmt::format("{}: dtype {}, not {}", where, Printable(t.dtype), fmt::join(dtypes, " or ")));
  }
  ZINF_ASSIGN_OR_RETURN(CheckedTensor checked, CheckTensorInFile(zip, archive, t, where));
  if (!IsContiguous(t)) {
    return InvalidArgumentError(fmt::format("{}: not contiguous (shape [{}], stride [{}])", where,
                                            fmt::join(t.shape, ", "), fmt::join(t.stride, ", ")));
  }
  if (checked.extent.numel > max_numel) {
    return InvalidArgumentError(fmt::format("{}: {} elements, more than the {} expected", where,
                                            checked.extent.numel, max_numel));
  }
  return ReadPlan{checked.entry, checked.extent.numel, DtypeBytes(t.dtype)};
}

// Reads the plan's elements (from element `offset`) into `out` through `sink(bytes, first)`,
// in chunks, and checks the entry's CRC-32: in the same pass when the tensor covers its whole
// entry, else by reading the entry through once first.
template <typename Sink>
Status ReadElements(const ZipReader& zip, const ReadPlan& plan, std::uint64_t offset, Sink&& sink) {
  const std::uint64_t first_byte = offset * plan.elem;  // within the entry: checked
  const std::uint64_t total = plan.numel * plan.elem;
  if (total == 0) return OkStatus();  // nothing read, nothing to check
  const bool whole = first_byte == 0 && total == plan.entry->size;
  if (!whole) ZINF_RETURN_IF_ERROR(zip.VerifyCrc(*plan.entry));
  std::vector<std::byte> buffer(static_cast<std::size_t>(
      std::min<std::uint64_t>(total, kChunkBytes / plan.elem * plan.elem)));
  std::uint32_t crc = 0;
  for (std::uint64_t done = 0; done < total;) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), total - done));
    std::span<std::byte> chunk(buffer.data(), n);
    ZINF_RETURN_IF_ERROR(zip.ReadRange(*plan.entry, first_byte + done, chunk));
    if (whole) crc = Crc32(chunk, crc);
    sink(std::span<const std::byte>(chunk), done / plan.elem);
    done += n;
  }
  if (whole && crc != plan.entry->crc32) {
    return DataLossError(fmt::format("{}: entry {}: CRC-32 {:08x}, but the directory says {:08x}",
                                     zip.path(), Printable(plan.entry->name), crc,
                                     plan.entry->crc32));
  }
  return OkStatus();
}

}  // namespace

std::size_t DtypeBytes(std::string_view dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == dtype) return d.bytes;
  }
  return 0;
}

Result<TorchFile> TorchFile::Read(const std::string& path, const PickleLimits& limits) {
  return ReadAt(AT_FDCWD, path, path, limits);
}

Result<TorchFile> TorchFile::ReadAt(int dir_fd, const std::string& name, std::string display,
                                    const PickleLimits& limits) {
  const std::string path = std::move(display);
  ZINF_ASSIGN_OR_RETURN(bool legacy, StartsWithPickle(dir_fd, name, path));
  if (legacy) return InvalidArgumentError(fmt::format("{}: {}", path, kLegacyMessage));
  ZINF_ASSIGN_OR_RETURN(ZipReader zip, ZipReader::OpenAt(dir_fd, name, path));
  ZINF_ASSIGN_OR_RETURN(std::string archive, ArchivePrefix(zip));
  const std::string pkl_name = archive + "/data.pkl";
  const ZipEntry* pkl_entry = zip.Find(pkl_name);
  if (pkl_entry == nullptr) {
    return DataLossError(fmt::format("{}: no entry {}", path, Printable(pkl_name)));
  }
  if (pkl_entry->size > limits.max_bytes) {
    return DataLossError(fmt::format("{}: {} holds {} bytes, more than the {} a pickle may have",
                                     path, Printable(pkl_name), pkl_entry->size, limits.max_bytes));
  }
  ZINF_RETURN_IF_ERROR(CheckVersion(zip, archive));
  auto pkl = zip.ReadEntry(pkl_name, limits.max_bytes);
  if (!pkl) {
    return std::move(pkl).error().WithContext(fmt::format("{}: {}: ", path, Printable(pkl_name)));
  }
  auto root = ReadPickle(*pkl, limits);
  if (!root) {
    return std::move(root).error().WithContext(fmt::format("{}: {}: ", path, Printable(pkl_name)));
  }

  // A storage is one array of one dtype, however many tensors view it.
  std::map<std::string_view, std::string_view> dtype_of_key;
  auto check = [&](const PyTensor& t, std::string_view where) -> Status {
    const std::string what = fmt::format("{}: tensor {}", path, where);
    ZINF_RETURN_IF_ERROR(CheckTensorInFile(zip, archive, t, what));
    auto [it, added] = dtype_of_key.emplace(t.storage_key, t.dtype);
    if (!added && it->second != t.dtype) {
      return DataLossError(fmt::format("{}: storage '{}' is read as {} here and as {} elsewhere",
                                       what, Printable(t.storage_key), Printable(t.dtype),
                                       Printable(it->second)));
    }
    return OkStatus();
  };
  ZINF_RETURN_IF_ERROR(ForEachTensor(*root, check));
  return TorchFile(std::move(zip), std::move(archive), std::move(*root));
}

Result<std::vector<float>> TorchFile::ReadFloat32(const PyTensor& tensor,
                                                  std::uint64_t max_numel) const {
  ZINF_ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(zip_, archive_, tensor,
                                                {"float32", "float16", "bfloat16"}, max_numel));
  std::vector<float> out(static_cast<std::size_t>(plan.numel));
  auto sink = [&](std::span<const std::byte> bytes, std::uint64_t first) {
    float* dst = out.data() + first;
    if (plan.elem == 4) {
      std::memcpy(dst, bytes.data(), bytes.size());
      return;
    }
    const bool half = tensor.dtype == "float16";
    for (std::size_t i = 0; i + 1 < bytes.size(); i += 2) {
      const auto lo = static_cast<std::uint16_t>(bytes[i]);
      const auto hi = static_cast<std::uint16_t>(bytes[i + 1]);
      const auto v = static_cast<std::uint16_t>(lo | (hi << 8));
      dst[i / 2] = half ? HalfToFloat(v) : BFloat16ToFloat(v);
    }
  };
  ZINF_RETURN_IF_ERROR(ReadElements(zip_, plan, tensor.offset, sink));
  return out;
}

Result<std::vector<std::int64_t>> TorchFile::ReadInt64(const PyTensor& tensor,
                                                       std::uint64_t max_numel) const {
  ZINF_ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(zip_, archive_, tensor, {"int64"}, max_numel));
  std::vector<std::int64_t> out(static_cast<std::size_t>(plan.numel));
  auto sink = [&](std::span<const std::byte> bytes, std::uint64_t first) {
    std::memcpy(out.data() + first, bytes.data(), bytes.size());
  };
  ZINF_RETURN_IF_ERROR(ReadElements(zip_, plan, tensor.offset, sink));
  return out;
}

Status TorchFile::ReadFloat32Range(const PyTensor& tensor, std::uint64_t begin,
                                   std::span<float> out) const {
  ZINF_ASSIGN_OR_RETURN(ReadPlan plan,
                        PlanRead(zip_, archive_, tensor, {"float32", "float16", "bfloat16"},
                                 std::numeric_limits<std::uint64_t>::max()));
  const std::uint64_t count = out.size();
  if (begin > plan.numel || count > plan.numel - begin) {
    return InvalidArgumentError(
        fmt::format("{}: tensor of storage '{}': elements [{}, +{}) of its {}", zip_.path(),
                    Printable(tensor.storage_key), begin, count, plan.numel));
  }
  if (count == 0) return OkStatus();
  // Element offsets within the storage: tensor.offset + plan.numel <= storage_numel (checked),
  // so neither sum nor product below overflows (storage_numel * elem == the entry's size).
  const std::uint64_t first_byte = (tensor.offset + begin) * plan.elem;
  if (plan.elem == 4) {
    return zip_.ReadRange(*plan.entry, first_byte, std::as_writable_bytes(out));
  }
  const bool half = tensor.dtype == "float16";
  std::vector<std::byte> buffer(
      static_cast<std::size_t>(std::min<std::uint64_t>(count * 2, kChunkBytes)));
  for (std::uint64_t done = 0; done < count;) {
    const auto n =
        static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size() / 2, count - done));
    std::span<std::byte> chunk(buffer.data(), n * 2);
    ZINF_RETURN_IF_ERROR(zip_.ReadRange(*plan.entry, first_byte + done * 2, chunk));
    for (std::size_t i = 0; i < n; ++i) {
      const auto lo = static_cast<std::uint16_t>(chunk[2 * i]);
      const auto hi = static_cast<std::uint16_t>(chunk[2 * i + 1]);
      const auto v = static_cast<std::uint16_t>(lo | (hi << 8));
      out[done + i] = half ? HalfToFloat(v) : BFloat16ToFloat(v);
    }
    done += n;
  }
  return OkStatus();
}

Status TorchFile::VerifyStorage(const PyTensor& tensor) const {
  const std::string where =
      fmt::format("{}: tensor of storage '{}'", zip_.path(), Printable(tensor.storage_key));
  ZINF_ASSIGN_OR_RETURN(CheckedTensor checked, CheckTensorInFile(zip_, archive_, tensor, where));
  return zip_.VerifyCrc(*checked.entry);
}

Result<TorchWriter> TorchWriter::Create(const std::string& path, storage::Overwrite overwrite,
                                        std::string archive) {
  if (archive.empty() || archive == "." || archive == ".." ||
      archive.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos ||
      archive.size() > 255) {
    return InvalidArgumentError(fmt::format("{}: archive name '{}' is not one path component", path,
                                            Printable(archive, 64)));
  }
  ZINF_ASSIGN_OR_RETURN(ZipWriter zip, ZipWriter::Create(path, overwrite));
  return TorchWriter(std::move(zip), std::move(archive));
}

namespace {

// torch's contiguous strides for `shape` (a 0 size counts as 1), and the element count; errors
// name `what`.
Result<std::vector<std::int64_t>> ContiguousStrides(const std::vector<std::int64_t>& shape,
                                                    std::uint64_t numel, std::string_view what) {
  if (shape.size() > kMaxDims) {
    return InvalidArgumentError(
        fmt::format("{}: {} dims (at most {})", what, shape.size(), kMaxDims));
  }
  std::uint64_t product = 1;
  for (std::int64_t s : shape) {
    if (s < 0) {
      return InvalidArgumentError(
          fmt::format("{}: shape [{}] has a negative size", what, fmt::join(shape, ", ")));
    }
    if (__builtin_mul_overflow(product, static_cast<std::uint64_t>(s), &product)) {
      return InvalidArgumentError(
          fmt::format("{}: shape [{}] overflows 64 bits", what, fmt::join(shape, ", ")));
    }
  }
  if (product != numel) {
    return InvalidArgumentError(fmt::format("{}: shape [{}] holds {} elements, the data {}", what,
                                            fmt::join(shape, ", "), product, numel));
  }
  std::vector<std::int64_t> stride(shape.size());
  std::int64_t next = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    stride[d] = next;
    next *= std::max<std::int64_t>(shape[d], 1);  // <= numel or a product of sizes <= 1
  }
  return stride;
}

}  // namespace

Result<PyTensor> TorchWriter::NewTensor(std::string dtype, std::uint64_t numel,
                                        std::vector<std::int64_t> shape,
                                        std::string_view what) const {
  ZINF_ASSIGN_OR_RETURN(std::vector<std::int64_t> stride, ContiguousStrides(shape, numel, what));
  return PyTensor{.dtype = std::move(dtype),
                  .storage_key = std::to_string(next_key_),
                  .location = "cpu",
                  .storage_numel = numel,
                  .offset = 0,
                  .shape = std::move(shape),
                  .stride = std::move(stride),
                  .requires_grad = false};
}

void TorchWriter::Added(const PyTensor& tensor) {
  ++next_key_;
  storages_.emplace_back(tensor.dtype, tensor.storage_numel);
}

Result<PyTensor> TorchWriter::AddStorage(std::string dtype, std::span<const std::byte> bytes,
                                         std::uint64_t numel, std::vector<std::int64_t> shape,
                                         std::string_view what) {
  ZINF_ASSIGN_OR_RETURN(PyTensor t, NewTensor(std::move(dtype), numel, std::move(shape), what));
  ZINF_RETURN_IF_ERROR(zip_.Add(StorageEntryName(archive_, t.storage_key), bytes));
  Added(t);
  return t;
}

Result<PyTensor> TorchWriter::AddFloat32(std::span<const float> data,
                                         std::vector<std::int64_t> shape) {
  return AddStorage("float32", std::as_bytes(data), data.size(), std::move(shape),
                    "TorchWriter::AddFloat32");
}

Result<PyTensor> TorchWriter::AddInt64(std::span<const std::int64_t> data,
                                       std::vector<std::int64_t> shape) {
  if (shape.size() > 1) {
    return InvalidArgumentError(fmt::format(
        "TorchWriter::AddInt64: shape [{}]: only 0-dim or 1-dim", fmt::join(shape, ", ")));
  }
  return AddStorage("int64", std::as_bytes(data), data.size(), std::move(shape),
                    "TorchWriter::AddInt64");
}

Status TorchWriter::Finish(const PyValue& root) {
  // Every tensor must view a storage written here, as it was written: else torch.load (and
  // TorchFile::Read) would refuse the file.
  auto check = [&](const PyTensor& t, std::string_view where) -> Status {
    const std::string what = fmt::format("TorchWriter::Finish: tensor {}", where);
    std::uint64_t key = 0;
    bool ok = !t.storage_key.empty() && t.storage_key.size() <= 19 &&
              (t.storage_key.size() == 1 || t.storage_key[0] != '0');
    for (char c : t.storage_key) {
      if (c < '0' || c > '9') ok = false;
      key = key * 10 + static_cast<std::uint64_t>(c - '0');
    }
    if (!ok || key >= storages_.size()) {
      return InvalidArgumentError(fmt::format("{}: storage '{}' was not added to this writer", what,
                                              Printable(t.storage_key)));
    }
    const auto& [dtype, numel] = storages_[key];
    if (t.dtype != dtype || t.storage_numel != numel) {
      return InvalidArgumentError(
          fmt::format("{}: storage '{}' holds {} elements of {}, the tensor says {} of {}", what,
                      t.storage_key, numel, dtype, t.storage_numel, Printable(t.dtype)));
    }
    auto ext = CheckTensorShape(t, what);
    if (!ext) return InvalidArgumentError(ext.error().message());
    return OkStatus();
  };
  ZINF_RETURN_IF_ERROR(ForEachTensor(root, check));
  ZINF_ASSIGN_OR_RETURN(std::string pkl, WritePickle(root));
  ZINF_RETURN_IF_ERROR(zip_.Add(archive_ + "/data.pkl", std::string_view(pkl)));
  ZINF_RETURN_IF_ERROR(zip_.Add(archive_ + "/version", std::string_view("3\n")));
  return zip_.Finish();
}

Result<PyTensor> TorchWriter::AddFloat32Streaming(
    std::vector<std::int64_t> shape,
    const std::function<Status(std::uint64_t offset, std::span<float> out)>& fill,
    std::uint64_t piece_numel) {
  constexpr std::string_view kWhat = "TorchWriter::AddFloat32Streaming";
  if (piece_numel == 0) return InvalidArgumentError(fmt::format("{}: piece_numel 0", kWhat));
  std::uint64_t numel = 1;
  for (std::int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(numel, static_cast<std::uint64_t>(s), &numel) ||
        numel > (std::uint64_t{1} << 61)) {
      return InvalidArgumentError(
          fmt::format("{}: shape [{}] is negative or too large", kWhat, fmt::join(shape, ", ")));
    }
  }
  ZINF_ASSIGN_OR_RETURN(PyTensor t, NewTensor("float32", numel, std::move(shape), kWhat));
  ZINF_RETURN_IF_ERROR(
      zip_.Begin(StorageEntryName(archive_, t.storage_key), numel * sizeof(float)));
  std::vector<float> piece(std::min(numel, piece_numel));
  for (std::uint64_t offset = 0; offset < numel;) {
    const std::uint64_t n = std::min<std::uint64_t>(piece.size(), numel - offset);
    std::span<float> out(piece.data(), n);
    ZINF_RETURN_IF_ERROR(fill(offset, out));
    ZINF_RETURN_IF_ERROR(zip_.Append(std::as_bytes(out)));
    offset += n;
  }
  ZINF_RETURN_IF_ERROR(zip_.End());
  Added(t);
  return t;
}

}  // namespace zinf::interop
