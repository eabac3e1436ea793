// BufferPool: the fixed set of pinned, direct-I/O aligned host buffers that every optimizer swap
// goes through. It is the only optimizer host memory that scales with the model (with the
// sub-group size, not with the partition), so it is sized in bytes by one budget
// (`zinf.pinned_budget_bytes`), allocated once at Create and never grown: the pool can run out of
// buffers, but never out of memory in the middle of a step.
//
//   ZINF_ASSIGN_OR_RETURN(auto pool, BufferPool::Create({.budget_bytes = 4 * kGiB,
//                                                        .buffer_bytes = 256 * kMiB}));
//   ZINF_ASSIGN_OR_RETURN(PoolLease lease, pool->Allocate(numel, 4));
//   std::span<float> fp32 = lease.floats(0).first(numel);
//   ...                                   // the buffers go back to the pool with `lease`
//
// Sizing (DeepSpeed compatibility): with budget_bytes == 0 the pool holds buffer_count buffers
// (DeepSpeed's offload_optimizer.buffer_count); otherwise budget_bytes / buffer_bytes of them.
//
// Ownership: the pool owns its buffers; a PoolLease borrows some of them and must not outlive the
// pool (checked at pool destruction). A lease's buffers must not be in use by any I/O when the
// lease is destroyed or released (the swappers drain their backends first).
//
// Thread safety: Allocate/AllocateAll/free_count and lease destruction may be called from several
// threads (a mutex guards the free list). A PoolLease itself is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/aligned_buffer.h"

namespace zinf::swapper {

struct BufferPoolOptions {
  std::uint64_t budget_bytes = 0;   // total bytes of the pool; 0: buffer_count * buffer_bytes
  std::uint64_t buffer_count = 4;   // DeepSpeed's buffer_count; used only when budget_bytes == 0
  std::uint64_t buffer_bytes = 0;   // bytes per buffer (rounded up to `alignment`); > 0
  std::uint64_t alignment = 4096;   // buffer address/size alignment: a power of two >= the DIO one
  bool pin_memory = false;          // mlock the buffers (DeepSpeed's pin_memory)
};

class BufferPool;

// A set of buffers borrowed from a BufferPool; returns them when destroyed or Release()d.
// Move-only; a moved-from lease is empty.
class PoolLease {
 public:
  PoolLease() = default;
  PoolLease(PoolLease&& other) noexcept;
  PoolLease& operator=(PoolLease&& other) noexcept;
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;
  ~PoolLease() { Release(); }

  std::size_t size() const { return indices_.size(); }
  bool empty() const { return indices_.empty(); }
  // Buffer i of the lease (i < size(), checked), the pool's full buffer_bytes.
  std::span<std::byte> bytes(std::size_t i) const;
  std::span<float> floats(std::size_t i) const;
  // Returns the buffers to the pool now. Idempotent.
  void Release();

 private:
  friend class BufferPool;
  PoolLease(BufferPool* pool, std::vector<std::size_t> indices)
      : pool_(pool), indices_(std::move(indices)) {}
  BufferPool* pool_ = nullptr;
  std::vector<std::size_t> indices_;
};

class BufferPool {
 public:
  // Allocates every buffer now (zeroed, so the pages are resident; mlocked with pin_memory).
  // Errors: InvalidArgument (buffer_bytes == 0, alignment not a power of two, a budget smaller
  // than one buffer: the message names budget and buffer size), ResourceExhausted (allocation or
  // mlock failed, from AlignedBuffer, with the size asked for).
  static Result<std::unique_ptr<BufferPool>> Create(const BufferPoolOptions& options);

  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  // Precondition (checked): every lease has been returned.
  ~BufferPool();

  // Borrows `count` buffers able to hold `numel` float32 elements each (DeepSpeed's
  // swap_buffer_manager.allocate). Errors: InvalidArgument if numel * 4 > buffer_bytes();
  // ResourceExhausted "asked for N buffers of X bytes, the pool has M free of K (budget B); raise
  // zinf.pinned_budget_bytes to at least ..." when fewer than `count` are free. Never allocates.
  Result<PoolLease> Allocate(std::uint64_t numel, std::size_t count);
  // Borrows every free buffer (at least one, else ResourceExhausted as above).
  Result<PoolLease> AllocateAll(std::uint64_t numel);
  // Returns the buffers of `lease` (same as lease.Release()).
  void Free(PoolLease& lease) { lease.Release(); }

  std::size_t free_count() const;
  std::size_t buffer_count() const { return buffers_.size(); }
  std::uint64_t buffer_bytes() const { return buffer_bytes_; }
  std::uint64_t buffer_numel() const { return buffer_bytes_ / sizeof(float); }
  std::uint64_t total_bytes() const { return buffer_bytes_ * buffers_.size(); }
  std::uint64_t budget_bytes() const { return budget_bytes_; }
  bool pinned() const { return pinned_; }
  // Every buffer, for IoBackend::RegisterBuffers.
  std::vector<std::span<std::byte>> AllBuffers();

 private:
  friend class PoolLease;
  BufferPool() = default;
  Result<PoolLease> Take(std::uint64_t numel, std::size_t count, bool all);
  void Return(const std::vector<std::size_t>& indices);
  Error Exhausted(std::size_t count, std::size_t free) const;

  std::vector<storage::AlignedBuffer> buffers_;
  std::uint64_t buffer_bytes_ = 0;
  std::uint64_t budget_bytes_ = 0;
  bool pinned_ = false;
  mutable std::mutex mu_;
  std::vector<std::size_t> free_;  // indices of free buffers (guarded by mu_)
};

}  // namespace zinf::swapper
