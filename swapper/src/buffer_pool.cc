#include "zinf/swapper/buffer_pool.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/units.h"

namespace zinf::swapper {

PoolLease::PoolLease(PoolLease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), indices_(std::move(other.indices_)) {
  other.indices_.clear();
}

PoolLease& PoolLease::operator=(PoolLease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    indices_ = std::move(other.indices_);
    other.indices_.clear();
  }
  return *this;
}

std::span<std::byte> PoolLease::bytes(std::size_t i) const {
  ZINF_CHECK_LT(i, indices_.size());
  return pool_->buffers_[indices_[i]].span();
}

std::span<float> PoolLease::floats(std::size_t i) const {
  std::span<std::byte> b = bytes(i);
  return {reinterpret_cast<float*>(b.data()), b.size() / sizeof(float)};
}

void PoolLease::Release() {
  if (pool_ != nullptr && !indices_.empty()) pool_->Return(indices_);
  indices_.clear();
  pool_ = nullptr;
}

Result<std::unique_ptr<BufferPool>> BufferPool::Create(const BufferPoolOptions& options) {
  if (options.buffer_bytes == 0) return InvalidArgumentError("buffer pool: buffer_bytes is 0");
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return InvalidArgumentError(
        fmt::format("buffer pool: alignment {} is not a power of two", options.alignment));
  }
  const std::uint64_t buffer_bytes = AlignUp(options.buffer_bytes, options.alignment);
  std::uint64_t count = 0;
  std::uint64_t budget = options.budget_bytes;
  if (budget == 0) {
    count = options.buffer_count;
    if (count == 0) return InvalidArgumentError("buffer pool: buffer_count is 0 and no budget");
    if (!CheckedMul(count, buffer_bytes, &budget)) {
      return InvalidArgumentError("buffer pool: buffer_count * buffer_bytes overflows");
    }
  } else {
    count = budget / buffer_bytes;
    if (count == 0) {
      return InvalidArgumentError(fmt::format(
          "zinf.pinned_budget_bytes {} ({}) holds no swap buffer of {} ({} bytes: the largest "
          "sub-group); raise it to at least {}",
          budget, FormatBytes(budget), FormatBytes(buffer_bytes), buffer_bytes, buffer_bytes));
    }
  }
  auto pool = std::unique_ptr<BufferPool>(new BufferPool());
  pool->buffer_bytes_ = buffer_bytes;
  pool->budget_bytes_ = budget;
  pool->pinned_ = options.pin_memory;
  pool->buffers_.reserve(count);
  for (std::uint64_t i = 0; i < count; ++i) {
    ZINF_ASSIGN_OR_RETURN(
        storage::AlignedBuffer buffer,
        Annotate(storage::AlignedBuffer::Allocate(
                     buffer_bytes, storage::BufferOptions{.alignment = options.alignment,
                                                          .lock = options.pin_memory}),
                 fmt::format("buffer pool: buffer {} of {} ({} each): ", i + 1, count,
                             FormatBytes(buffer_bytes))));
    pool->buffers_.push_back(std::move(buffer));
  }
  // Handing out low indices first keeps the same buffers hot in caches and TLBs.
  for (std::size_t i = count; i-- > 0;) pool->free_.push_back(i);
  return pool;
}

BufferPool::~BufferPool() {
  std::lock_guard<std::mutex> lock(mu_);
  ZINF_CHECK_EQ(free_.size(), buffers_.size());
}

Error BufferPool::Exhausted(std::size_t count, std::size_t free) const {
  const std::uint64_t in_use = buffers_.size() - free;
  const std::uint64_t needed = (in_use + count) * buffer_bytes_;
  return ResourceExhaustedError(fmt::format(
      "swap buffer pool: asked for {} buffers of {} bytes, the pool has {} free of {} (budget {} "
      "= {}); raise zinf.pinned_budget_bytes to at least {} ({})",
      count, buffer_bytes_, free, buffers_.size(), budget_bytes_, FormatBytes(budget_bytes_),
      needed, FormatBytes(needed)));
}

Result<PoolLease> BufferPool::Allocate(std::uint64_t numel, std::size_t count) {
  if (count == 0) return InvalidArgumentError("swap buffer pool: asked for 0 buffers");
  return Take(numel, count, /*all=*/false);
}

Result<PoolLease> BufferPool::Take(std::uint64_t numel, std::size_t count, bool all) {
  if (numel > buffer_numel()) {
    return InvalidArgumentError(fmt::format(
        "swap buffer pool: asked for buffers of {} elements ({} bytes), the pool's buffers hold "
        "{} bytes",
        numel, numel * sizeof(float), buffer_bytes_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (all) count = std::max<std::size_t>(free_.size(), 1);
  if (free_.size() < count) return Exhausted(count, free_.size());
  std::vector<std::size_t> indices(free_.end() - static_cast<std::ptrdiff_t>(count), free_.end());
  std::reverse(indices.begin(), indices.end());
  free_.resize(free_.size() - count);
  return PoolLease(this, std::move(indices));
}

Result<PoolLease> BufferPool::AllocateAll(std::uint64_t numel) {
  return Take(numel, 0, /*all=*/true);
}

std::size_t BufferPool::free_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

std::vector<std::span<std::byte>> BufferPool::AllBuffers() {
  std::vector<std::span<std::byte>> spans;
  spans.reserve(buffers_.size());
  for (storage::AlignedBuffer& buffer : buffers_) spans.push_back(buffer.span());
  return spans;
}

void BufferPool::Return(const std::vector<std::size_t>& indices) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = indices.rbegin(); it != indices.rend(); ++it) free_.push_back(*it);
}

}  // namespace zinf::swapper
