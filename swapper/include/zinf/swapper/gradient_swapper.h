// GradientSwapper: the partition gradient during backward (DeepSpeed's AsyncTensorSwapper and
// the optimizer swapper's swap_out_gradients / flush_gradients / swap_in_gradients).
//
// Each micro-batch hands the reduced gradient of each sub-group to SwapOut(); micro-batch 0
// overwrites, later ones are added (in micro-batch order, so the sum is bitwise the sum a caller
// would form in memory). Two modes, chosen at creation and logged:
//  - in memory (kInMemory, or kAuto when the partition's gradient fits
//    accumulation_memory_limit_bytes): one partition-sized host buffer, no gradient I/O;
//  - read-add-write (kReadAddWrite): the gradient is split as DeepSpeed does
//    (partition::SplitGradientForSwap with the store's alignment): swapped pieces are written
//    behind to "grad<i>" through pool buffers (the call returns once the writes are submitted),
//    unswapped remainders stay in host memory. A later micro-batch first reads the pieces back,
//    adds, and writes them again. Writes of one micro-batch are all flushed when the next one
//    starts, and before a step (OptimizerSwapper::Step / FlushGradients).
// SwapIn (and Source(), a GradientSource for OptimizerSwapper::Step) fills a sub-group's
// accumulated gradient: reads the swapped pieces, copies the remainders, zeroes padding.
//
// Errors: a failed write-behind surfaces from a later SwapOut or from Flush(), and stays
// recorded until Flush() reports it, so that the collective Step/FlushGradients of the owning
// swapper report it on every rank. After a failed flush the accumulated gradient is undefined
// (the caller must recompute the micro-batches).
//
// Ownership and thread safety: owned by an OptimizerSwapper (it uses that swapper's store and
// pool and has its own backend). One thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "zinf/comm/timers.h"
#include "zinf/core/status.h"
#include "zinf/storage/io_backend.h"
#include "zinf/storage/swap_store.h"
#include "zinf/swapper/buffer_pool.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::swapper {

class GradientSwapper {
 public:
  // Used by CreateOptimizerSwapper. `mode` is resolved (never kAuto). `infos` carries the
  // gradient split and tensor names; `store`, `pool` and `timers` must outlive this object.
  GradientSwapper(GradientAccumulation mode, int gradient_accumulation_steps,
                  const std::vector<SubGroupSwapInfo>* infos, std::uint64_t partition_numel,
                  storage::SwapStore* store, std::unique_ptr<storage::IoBackend> backend,
                  BufferPool* pool, comm::Timers* timers);
  ~GradientSwapper();
  GradientSwapper(const GradientSwapper&) = delete;
  GradientSwapper& operator=(const GradientSwapper&) = delete;

  GradientAccumulation mode() const { return mode_; }
  int gradient_accumulation_steps() const { return gradient_accumulation_steps_; }

  // Adds micro-batch `micro_batch` (0-based, non-decreasing between flushes; 0 overwrites) of
  // sub-group `sub_group`'s gradient (`grad.size()` == the sub-group's numel; padding ignored).
  // Errors: InvalidArgument (index, size, micro_batch going backwards), ResourceExhausted (no
  // pool buffer free), I/O errors (also recorded for Flush()).
  Status SwapOut(int micro_batch, std::size_t sub_group, std::span<const float> grad);
  // SwapOut for every sub-group from a partition-sized gradient.
  Status SwapOutPartition(int micro_batch, std::span<const float> partition_grad);
  // Waits for every write-behind and gives the pool buffers back; returns (and clears) the first
  // error since the last Flush().
  Status Flush();
  // Fills `grad` (the sub-group's numel elements at the start of an aligned buffer of at least
  // its io_size_bytes, e.g. a pool buffer) with the accumulated gradient. Flushes first.
  Status SwapIn(std::size_t sub_group, std::span<float> grad);
  // A GradientSource that calls SwapIn. Valid while this object lives.
  GradientSource Source();

 private:
  // Submits the read or write of every swapped piece of `sub_group` from/to `buffer` (laid
  // out like the sub-group).
  Status SubmitPieces(std::size_t sub_group, std::span<std::byte> buffer, storage::IoOp op);
  // A free write-behind buffer (leased from the pool on first use); waits for the writes in
  // flight when every buffer is busy.
  Result<std::size_t> AcquireBuffer(std::uint64_t numel);
  // Waits for every request on the backend; all buffers are free afterwards.
  Status DrainAll();
  void Record(const Status& status);

  GradientAccumulation mode_;
  int gradient_accumulation_steps_;
  const std::vector<SubGroupSwapInfo>* infos_;
  storage::SwapStore* store_;
  std::unique_ptr<storage::IoBackend> backend_;
  BufferPool* pool_;
  comm::Timers* timers_;
  std::vector<float> in_memory_;                // kInMemory: the partition's gradient
  std::vector<std::vector<float>> unswapped_;   // kReadAddWrite: remainders per sub-group
  std::vector<std::uint64_t> sub_group_offset_;  // partition offset per sub-group
  PoolLease lease_;                              // write-behind buffers (kReadAddWrite)
  std::vector<bool> busy_;                       // per lease buffer: a write may be in flight
  int micro_batch_ = -1;
  std::vector<int> last_micro_batch_;  // per sub-group, -1: nothing written
  std::optional<Error> error_;
};

}  // namespace zinf::swapper
