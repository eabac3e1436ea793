// Files torch.save writes (the zip format; torch's older "legacy" format is refused with an
// error saying so), read into a PyValue tree and tensors, and written for torch.load (any torch
// from 1.6 on) and DeepSpeed's tools. Reading never runs code (see pickle.h) and checks every
// tensor against its storage (dtype size x extent within the storage entry) before its data is
// read.
#ifndef ZINF_INTEROP_TORCH_FILE_H_
#define ZINF_INTEROP_TORCH_FILE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/interop/pickle.h"
#include "zinf/interop/zip.h"
#include "zinf/storage/fs.h"

namespace zinf::interop {

// The bytes of one element of torch dtype `dtype` ("float32" -> 4), or 0 when unknown.
std::size_t DtypeBytes(std::string_view dtype);

class TorchFile {
 public:
  // Reads `path`: its zip directory, "<archive>/data.pkl" (through ReadPickle with `limits`) and
  // "<archive>/version"; checks every PyTensor in the tree against its storage entry. Errors:
  // those of ZipReader::Open and ReadPickle; DataLoss naming the file and what is wrong;
  // InvalidArgument "torch's legacy (non-zip) format" for a file that starts with a pickle.
  static Result<TorchFile> Read(const std::string& path, const PickleLimits& limits = {});
  // The same for the file `name` relative to the directory descriptor `dir_fd` (see
  // ZipReader::OpenAt: a link is refused as the last component only), named `display` in errors
  // and by path(). For a reader that holds a folder's descriptor and must read that very folder.
  static Result<TorchFile> ReadAt(int dir_fd, const std::string& name, std::string display,
                                  const PickleLimits& limits = {});

  const PyValue& root() const { return root_; }
  const std::string& path() const { return zip_.path(); }

  // The elements of `tensor` (which must be in this file, contiguous, of at most `max_numel`
  // elements) as fp32: float32 copied, float16 and bfloat16 widened exactly. Errors:
  // InvalidArgument (another dtype, not contiguous, too large), DataLoss (read errors, the
  // storage entry's CRC-32: checked on the way when the tensor spans its whole storage, else by
  // reading the entry through first).
  Result<std::vector<float>> ReadFloat32(const PyTensor& tensor, std::uint64_t max_numel) const;
  // The same for an int64 tensor of at most `max_numel` elements (a 0-dim step, ...).
  Result<std::vector<std::int64_t>> ReadInt64(const PyTensor& tensor,
                                              std::uint64_t max_numel) const;
  // Elements [begin, begin + out.size()) of `tensor` (of this file, contiguous, float32,
  // float16 or bfloat16; the elements counted in its row-major order) as fp32 into `out`,
  // widened as ReadFloat32 does: for reading a part of a large tensor without holding all of it
  // (memory: `out` plus a buffer of at most 1 MiB for 16-bit dtypes). The storage entry's
  // CRC-32 is NOT checked (the range is only a part of the entry): call VerifyStorage once per
  // storage first. Errors: InvalidArgument (another dtype, not contiguous, the range past the
  // tensor's elements), DataLoss (read errors).
  Status ReadFloat32Range(const PyTensor& tensor, std::uint64_t begin, std::span<float> out) const;
  // Reads the storage entry `tensor` views (of this file) through in bounded chunks and checks
  // its CRC-32. Errors: DataLoss (a CRC mismatch, read errors, a tensor not of this file).
  Status VerifyStorage(const PyTensor& tensor) const;

 private:
  TorchFile(ZipReader zip, std::string archive, PyValue root)
      : zip_(std::move(zip)), archive_(std::move(archive)), root_(std::move(root)) {}

  ZipReader zip_;
  std::string archive_;  // the entries' common first component, such as "archive"
  PyValue root_;
};

// Writes a torch file: tensors are added first (each its own storage), then the tree that
// references them is written by Finish. Nothing is at `path` until Finish succeeds.
class TorchWriter {
 public:
  // `archive` is the entries' first component (torch uses the file's stem; "archive" is fine).
  static Result<TorchWriter> Create(const std::string& path, storage::Overwrite overwrite,
                                    std::string archive = "archive");

  // A contiguous fp32 tensor of `shape` holding `data` (its own storage).
  Result<PyTensor> AddFloat32(std::span<const float> data, std::vector<std::int64_t> shape);
  // A 0-dim or 1-dim int64 tensor.
  Result<PyTensor> AddInt64(std::span<const std::int64_t> data, std::vector<std::int64_t> shape);
  // A contiguous fp32 tensor of `shape` (its own storage) whose elements are not in memory at
  // once: `fill(offset, out)` is called for consecutive pieces of at most `piece_numel`
  // elements, in order, to write elements [offset, offset + out.size()); they are written as
  // they come (memory: one piece). Errors: InvalidArgument (a bad shape, piece_numel 0, nothing
  // written); `fill`'s error or a write error part-way, after which the writer is unusable
  // (abandon it: nothing is left at its path).
  Result<PyTensor> AddFloat32Streaming(
      std::vector<std::int64_t> shape,
      const std::function<Status(std::uint64_t offset, std::span<float> out)>& fill,
      std::uint64_t piece_numel = std::uint64_t{1} << 20);
  // Writes data.pkl for `root`, version, and commits. Errors: InvalidArgument for a tensor in
  // `root` that is not one this writer added (storage key, dtype, element count) or whose view
  // passes its storage (nothing is written then, and Finish may be called again); those of
  // WritePickle and ZipWriter.
  Status Finish(const PyValue& root);

 private:
  TorchWriter(ZipWriter zip, std::string archive)
      : zip_(std::move(zip)), archive_(std::move(archive)) {}

  // The contiguous tensor of `shape` the next storage entry will hold (not yet written).
  Result<PyTensor> NewTensor(std::string dtype, std::uint64_t numel,
                             std::vector<std::int64_t> shape, std::string_view what) const;
  // Records `tensor`'s storage entry as written (Finish checks trees against these).
  void Added(const PyTensor& tensor);
  // A contiguous tensor of `shape` over a new storage entry holding `bytes` (`numel` elements).
  Result<PyTensor> AddStorage(std::string dtype, std::span<const std::byte> bytes,
                              std::uint64_t numel, std::vector<std::int64_t> shape,
                              std::string_view what);

  ZipWriter zip_;
  std::string archive_;
  std::uint64_t next_key_ = 0;
  // The dtype and element count of storage n ("<archive>/data/<n>"), which Finish checks the
  // tree's tensors against.
  std::vector<std::pair<std::string, std::uint64_t>> storages_;
};

}  // namespace zinf::interop

#endif  // ZINF_INTEROP_TORCH_FILE_H_
