// AlignedBuffer: host memory for backend I/O. Aligned to the direct-I/O alignment of its target
// file system, length rounded up to it; optionally locked in RAM (mlock) and, in a CUDA build on a
// machine with a GPU, registered with the CUDA runtime (cudaHostRegister) so device copies from it
// run at full speed. Buffers of 2 MiB or more start on a 2 MiB boundary and are advised onto
// transparent huge pages (MADV_HUGEPAGE) before their first touch: a block I/O then spans a few
// physically contiguous pages rather than hundreds of 4 KiB ones, which on a virtio disk made the
// swapped step 2.5x faster.
//
// Move-only; a moved-from buffer is empty. The caller guarantees that no I/O uses the buffer when
// it is destroyed (backends report every request before they let go of it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "zinf/core/status.h"

namespace zinf::storage {

struct BufferOptions {
  std::uint64_t alignment = 4096;  // power of two; at least the file system's DIO alignment
  bool lock = false;               // mlock: fails with ResourceExhausted naming RLIMIT_MEMLOCK
  bool register_cuda = true;       // cudaHostRegister when built with CUDA and a GPU is present
  bool zero = true;                // fill with zeros (also faults the pages in)
};

class AlignedBuffer {
 public:
  // Errors: InvalidArgument (alignment not a power of two), ResourceExhausted (allocation or
  // mlock failed: the message gives the size, RLIMIT_MEMLOCK and how to raise it).
  static Result<AlignedBuffer> Allocate(std::uint64_t size_bytes, const BufferOptions& options);

  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  // The usable size: the requested size rounded up to the alignment.
  std::uint64_t size() const { return size_; }
  std::uint64_t alignment() const { return alignment_; }
  bool locked() const { return locked_; }
  bool cuda_registered() const { return cuda_registered_; }
  bool empty() const { return data_ == nullptr; }

  std::span<std::byte> span() { return {data_, static_cast<std::size_t>(size_)}; }
  std::span<const std::byte> span() const { return {data_, static_cast<std::size_t>(size_)}; }
  template <typename T>
  std::span<T> as() {
    return {reinterpret_cast<T*>(data_), static_cast<std::size_t>(size_ / sizeof(T))};
  }

 private:
  void Release();
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  std::uint64_t alignment_ = 0;
  bool locked_ = false;
  bool cuda_registered_ = false;
};

}  // namespace zinf::storage
