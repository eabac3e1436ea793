#include "zinf/swapper/gradient_swapper.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/log.h"

namespace zinf::swapper {
namespace {

// Most buffers the write-behind keeps in flight; more would only add memory.
constexpr std::size_t kMaxWriteBehindBuffers = 4;

void CopyOrAdd(const float* src, float* dst, std::uint64_t numel, bool add) {
  if (add) {
    for (std::uint64_t k = 0; k < numel; ++k) dst[k] += src[k];
  } else {
    std::memcpy(dst, src, numel * sizeof(float));
  }
}

}  // namespace

GradientSwapper::GradientSwapper(GradientAccumulation mode, int gradient_accumulation_steps,
                                 const std::vector<SubGroupSwapInfo>* infos,
                                 std::uint64_t partition_numel, storage::SwapStore* store,
                                 std::unique_ptr<storage::IoBackend> backend, BufferPool* pool,
                                 comm::Timers* timers)
    : mode_(mode),
      gradient_accumulation_steps_(gradient_accumulation_steps),
      infos_(infos),
      store_(store),
      backend_(std::move(backend)),
      pool_(pool),
      timers_(timers) {
  ZINF_CHECK(mode_ != GradientAccumulation::kAuto);
  ZINF_CHECK(mode_ == GradientAccumulation::kInMemory || backend_ != nullptr);
  if (mode_ == GradientAccumulation::kInMemory) {
    in_memory_.assign(partition_numel, 0.0f);
  } else {
    unswapped_.resize(infos_->size());
    for (std::size_t i = 0; i < infos_->size(); ++i) {
      std::uint64_t numel = 0;
      for (const partition::GradientPiece& piece : (*infos_)[i].unswapped_gradients) {
        numel += piece.numel;
      }
      unswapped_[i].assign(numel, 0.0f);
    }
  }
  last_micro_batch_.assign(infos_->size(), -1);
}

GradientSwapper::~GradientSwapper() {
  // Buffers of in-flight writes must not go back to the pool before the writes are done.
  if (backend_) (void)backend_->WaitAll();
}

void GradientSwapper::Record(const Status& status) {
  if (!status && !error_) error_ = status.error();
}

Status GradientSwapper::DrainAll() {
  Status status = backend_->WaitAll();
  std::fill(busy_.begin(), busy_.end(), false);
  Record(status);
  return status;
}

Result<std::size_t> GradientSwapper::AcquireBuffer(std::uint64_t numel) {
  if (lease_.empty()) {
    const std::size_t count =
        std::clamp<std::size_t>(pool_->free_count(), 1, kMaxWriteBehindBuffers);
    ZINF_ASSIGN_OR_RETURN(lease_, Annotate(pool_->Allocate(numel, count), "gradient swapper: "));
    busy_.assign(lease_.size(), false);
  }
  auto it = std::find(busy_.begin(), busy_.end(), false);
  if (it == busy_.end()) {
    // Every buffer carries a write in flight: wait for them (all, the simplest correct choice).
    ZINF_RETURN_IF_ERROR(DrainAll());
    it = busy_.begin();
  }
  *it = true;
  return static_cast<std::size_t>(it - busy_.begin());
}

Status GradientSwapper::SubmitPieces(std::size_t sub_group, std::span<std::byte> buffer,
                                     storage::IoOp op) {
  const SubGroupSwapInfo& info = (*infos_)[sub_group];
  for (const partition::GradientPiece& piece : info.swapped_gradients) {
    const std::uint64_t offset = piece.sub_group_offset * sizeof(float);
    const std::uint64_t length = piece.numel * sizeof(float);
    std::span<std::byte> bytes = buffer.subspan(offset, length);
    Result<std::vector<std::uint64_t>> ids =
        op == storage::IoOp::kWrite
            ? store_->SubmitWriteRange(info.gradient_name, offset, length,
                                       std::span<const std::byte>(bytes.data(), bytes.size()),
                                       *backend_)
            : store_->SubmitReadRange(info.gradient_name, offset, length, bytes, *backend_);
    if (!ids) {
      return std::move(ids).error().WithContext(fmt::format(
          "{} {} elements [{}, {}): ", storage::IoOpName(op), info.gradient_name,
          piece.sub_group_offset, piece.sub_group_offset + piece.numel));
    }
  }
  return OkStatus();
}

Status GradientSwapper::SwapOut(int micro_batch, std::size_t sub_group,
                                std::span<const float> grad) {
  if (sub_group >= infos_->size()) {
    return InvalidArgumentError(
        fmt::format("gradient swap-out: sub-group {} of {}", sub_group, infos_->size()));
  }
  const SubGroupSwapInfo& info = (*infos_)[sub_group];
  if (grad.size() != info.sub_group.numel) {
    return InvalidArgumentError(fmt::format("gradient swap-out: sub-group {} has {} elements, "
                                            "the gradient {}",
                                            sub_group, info.sub_group.numel, grad.size()));
  }
  if (micro_batch < 0 || (micro_batch != 0 && micro_batch < micro_batch_)) {
    return InvalidArgumentError(fmt::format(
        "gradient swap-out: micro-batch {} after micro-batch {}", micro_batch, micro_batch_));
  }
  if (error_) return *error_;
  const std::string context =
      fmt::format("gradient swap-out of sub-group {}, micro-batch {}: ", sub_group, micro_batch);
  comm::ScopedTimer timer(*timers_, "swap_out_gradient");
  // A new micro-batch reads what the previous one wrote: those writes must be done.
  if (mode_ == GradientAccumulation::kReadAddWrite && micro_batch != micro_batch_) {
    ZINF_RETURN_IF_ERROR(Annotate(DrainAll(), context));
  }
  micro_batch_ = micro_batch;
  const bool add = micro_batch > 0 && last_micro_batch_[sub_group] >= 0;
  last_micro_batch_[sub_group] = micro_batch;

  if (mode_ == GradientAccumulation::kInMemory) {
    float* partition = in_memory_.data() + info.sub_group.partition_offset;
    for (const partition::SubGroupFragment& f : info.sub_group.fragments) {
      CopyOrAdd(grad.data() + f.sub_group_offset, partition + f.sub_group_offset, f.numel, add);
    }
    return OkStatus();
  }

  Status status = [&]() -> Status {
    std::uint64_t next = 0;
    for (const partition::GradientPiece& piece : info.unswapped_gradients) {
      CopyOrAdd(grad.data() + piece.sub_group_offset, unswapped_[sub_group].data() + next,
                piece.numel, add);
      next += piece.numel;
    }
    if (info.swapped_gradients.empty()) return OkStatus();
    ZINF_ASSIGN_OR_RETURN(std::size_t b, AcquireBuffer(info.sub_group.numel));
    std::span<std::byte> buffer = lease_.bytes(b);
    float* values = lease_.floats(b).data();
    if (add) {
      ZINF_RETURN_IF_ERROR(SubmitPieces(sub_group, buffer, storage::IoOp::kRead));
      ZINF_RETURN_IF_ERROR(DrainAll());
      busy_[b] = true;
    }
    for (const partition::GradientPiece& piece : info.swapped_gradients) {
      CopyOrAdd(grad.data() + piece.sub_group_offset, values + piece.sub_group_offset,
                piece.numel, add);
    }
    return SubmitPieces(sub_group, buffer, storage::IoOp::kWrite);
  }();
  if (!status) {
    // Leave nothing in flight behind an error, and keep it for Flush().
    (void)DrainAll();
    Record(status);
  }
  return Annotate(std::move(status), context);
}

Status GradientSwapper::SwapOutPartition(int micro_batch, std::span<const float> partition_grad) {
  for (std::size_t i = 0; i < infos_->size(); ++i) {
    const partition::SubGroup& sub_group = (*infos_)[i].sub_group;
    if (partition_grad.size() < sub_group.partition_offset + sub_group.numel) {
      return InvalidArgumentError(fmt::format(
          "gradient swap-out: partition gradient of {} elements, sub-group {} ends at {}",
          partition_grad.size(), i, sub_group.partition_offset + sub_group.numel));
    }
    ZINF_RETURN_IF_ERROR(
        SwapOut(micro_batch, i, partition_grad.subspan(sub_group.partition_offset,
                                                       sub_group.numel)));
  }
  return OkStatus();
}

Status GradientSwapper::Flush() {
  if (backend_) {
    comm::ScopedTimer timer(*timers_, "async_swap_gradient_wait");
    (void)DrainAll();
  }
  lease_.Release();
  busy_.clear();
  if (error_) {
    Error error = std::move(*error_);
    error_.reset();
    return error;
  }
  return OkStatus();
}

Status GradientSwapper::SwapIn(std::size_t sub_group, std::span<float> grad) {
  ZINF_RETURN_IF_ERROR(Flush());
  if (sub_group >= infos_->size() || grad.size() != (*infos_)[sub_group].sub_group.numel) {
    return InvalidArgumentError(fmt::format("gradient swap-in: sub-group {} with {} elements",
                                            sub_group, grad.size()));
  }
  const SubGroupSwapInfo& info = (*infos_)[sub_group];
  std::fill(grad.begin(), grad.end(), 0.0f);
  if (mode_ == GradientAccumulation::kInMemory) {
    const float* partition = in_memory_.data() + info.sub_group.partition_offset;
    for (const partition::SubGroupFragment& f : info.sub_group.fragments) {
      std::memcpy(grad.data() + f.sub_group_offset, partition + f.sub_group_offset,
                  f.numel * sizeof(float));
    }
    return OkStatus();
  }
  if (!info.swapped_gradients.empty()) {
    std::span<std::byte> bytes(reinterpret_cast<std::byte*>(grad.data()),
                               grad.size() * sizeof(float));
    Status submitted = OkStatus();
    {
      comm::ScopedTimer timer(*timers_, "swap_submit_read_gradient");
      submitted = SubmitPieces(sub_group, bytes, storage::IoOp::kRead);
    }
    Status waited = OkStatus();
    {
      comm::ScopedTimer timer(*timers_, "swap_submit_wait_gradient");
      waited = backend_->WaitAll();
    }
    const std::string context = fmt::format("gradient swap-in of sub-group {}: ", sub_group);
    ZINF_RETURN_IF_ERROR(Annotate(std::move(submitted), context));
    ZINF_RETURN_IF_ERROR(Annotate(std::move(waited), context + info.gradient_name + ": "));
  }
  std::uint64_t next = 0;
  for (const partition::GradientPiece& piece : info.unswapped_gradients) {
    std::memcpy(grad.data() + piece.sub_group_offset, unswapped_[sub_group].data() + next,
                piece.numel * sizeof(float));
    next += piece.numel;
  }
  return OkStatus();
}

GradientSource GradientSwapper::Source() {
  return [this](const partition::SubGroup& sub_group, std::span<float> grad) {
    return SwapIn(sub_group.index, grad);
  };
}

}  // namespace zinf::swapper
