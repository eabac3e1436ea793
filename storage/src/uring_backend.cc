// UringBackend: intra_op_parallelism rings, each owned by one worker thread that creates it, fills
// it, reaps it and tears it down, so a ring is never touched by two threads (which also allows
// IORING_SETUP_SINGLE_ISSUER). The submitting thread talks to a worker only through its mutex:
// parts of requests and control tasks (buffer registration) go in, FinishPart reports come out.
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "io_backend_internal.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"

namespace zinf::storage::internal {
namespace {

// Registered-file slots per ring. A file is registered while a part on it is active and
// unregistered when the last one finishes, so a slot never outlives the caller's descriptor.
constexpr unsigned kFileSlots = 64;
// The kernel registers at most 1 GiB per buffer and 16384 buffers.
constexpr std::uint64_t kMaxRegisteredChunk = std::uint64_t{1} << 30;
constexpr std::size_t kMaxRegisteredBuffers = 16384;
constexpr unsigned kReapBatch = 64;

class UringBackend;

struct RegisteredChunk {
  const std::byte* base;
  std::uint64_t size;
  int index;
};

class RingWorker {
 public:
  RingWorker(UringBackend* backend, const AioOptions& options, int index)
      : backend_(backend), options_(options), index_(index) {}
  RingWorker(const RingWorker&) = delete;
  RingWorker& operator=(const RingWorker&) = delete;

  // Starts the thread; returns once it has set up its ring (or failed to).
  Status Start() {
    std::promise<Status> started;
    std::future<Status> result = started.get_future();
    try {
      thread_ = std::thread([this, p = std::move(started)]() mutable { Run(std::move(p)); });
    } catch (const std::system_error& e) {
      return Error(ErrorCode::kResourceExhausted,
                   fmt::format("io_uring ring {}: starting its thread: {}", index_, e.what()),
                   e.code().value());
    }
    return result.get();
  }

  // Asks the thread to finish: parts not yet issued are aborted, ops in the kernel are reaped.
  void RequestStop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
  }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  void Enqueue(const Part& part) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming_.push_back(part);
    }
    cv_.notify_one();
  }

  // Runs `task` on the worker thread once it is idle; returns its status.
  Status RunOnWorker(std::function<Status()> task) {
    std::packaged_task<Status()> packaged(std::move(task));
    std::future<Status> result = packaged.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      controls_.push_back(std::move(packaged));
    }
    cv_.notify_one();
    return result.get();
  }

  // Worker thread only (through RunOnWorker).
  Status SetBuffers(const std::vector<iovec>& iovecs) {
    if (!buffers_.empty()) {
      const int ret = io_uring_unregister_buffers(&ring_);
      buffers_.clear();
      if (ret < 0) return ErrnoError(-ret, "io_uring_unregister_buffers");
    }
    if (iovecs.empty()) return OkStatus();
    const int ret =
        io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
    if (ret < 0) return ErrnoError(-ret, "io_uring_register_buffers");
    for (std::size_t i = 0; i < iovecs.size(); ++i) {
      buffers_.push_back(RegisteredChunk{static_cast<const std::byte*>(iovecs[i].iov_base),
                                         iovecs[i].iov_len, static_cast<int>(i)});
    }
    std::sort(buffers_.begin(), buffers_.end(),
              [](const RegisteredChunk& a, const RegisteredChunk& b) { return a.base < b.base; });
    return OkStatus();
  }

 private:
  struct Slice {
    RequestState* state = nullptr;
    IoOp op = IoOp::kRead;
    const File* file = nullptr;
    std::uint64_t offset_bytes = 0;  // file offset of the slice
    std::byte* data = nullptr;
    std::uint64_t length_bytes = 0;
    std::uint64_t next_bytes = 0;  // handed out as blocks so far
    std::uint64_t done_bytes = 0;  // completed
    int ops = 0;                   // blocks owned by the ring or waiting to be resubmitted
    bool stopped = false;          // hand out no more blocks (failure, abort)
    std::optional<Error> error;
    int file_slot = -1;
    std::list<Slice>::iterator self;
  };

  struct Op {
    BlockProgress block;
    Slice* slice = nullptr;
    int buffer_index = -1;
  };

  void Run(std::promise<Status> started);
  Status InitRing();
  bool TakeWork();
  bool Busy() const {
    return !slices_.empty() || in_kernel_ > 0 || !ready_.empty() || !unsubmitted_.empty();
  }
  void Activate(const Part& part);
  void AbortUnissued(const Error& error);
  Slice* NextFeedSlice();
  int NewOp(Slice* slice);
  void Prepare(io_uring_sqe* sqe, int op_index);
  void Fill();
  void Submit();
  void Reap();
  void HandleCompletion(int op_index, std::int64_t result);
  void CompleteOp(int op_index, std::optional<Error> error);
  void MaybeFinish(Slice* slice);
  void Break(const Error& error);
  int FindBuffer(const std::byte* data, std::uint64_t length) const;
  int AcquireFileSlot(int fd);
  void ReleaseFileSlot(int slot);

  UringBackend* const backend_;
  const AioOptions options_;
  const int index_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Part> incoming_;                          // guarded by mu_
  std::deque<std::packaged_task<Status()>> controls_;  // guarded by mu_
  bool stop_ = false;                                  // guarded by mu_

  // Everything below belongs to the worker thread.
  io_uring ring_{};
  bool stopping_ = false;
  std::list<Slice> slices_;  // active parts
  std::deque<Slice*> feed_;  // slices that may still hand out blocks, in order
  std::vector<Op> ops_;      // queue_depth slots
  std::vector<int> free_ops_;
  std::deque<int> ready_;        // ops to (re)submit
  std::deque<int> unsubmitted_;  // ops in the SQ, not yet taken by the kernel
  unsigned in_kernel_ = 0;
  std::optional<Error> broken_;  // the ring cannot submit any more
  bool files_registered_ = false;
  std::vector<int> slot_fd_;
  std::vector<int> slot_refs_;
  bool slot_warned_ = false;
  std::vector<RegisteredChunk> buffers_;
};

class UringBackend final : public BackendBase {
 public:
  explicit UringBackend(const AioOptions& options) : BackendBase("uring", options) {}

  ~UringBackend() override {
    for (auto& worker : workers_) worker->RequestStop();
    for (auto& worker : workers_) worker->Join();
  }

  Status Start() {
    for (int i = 0; i < options().intra_op_parallelism; ++i) {
      workers_.push_back(std::make_unique<RingWorker>(this, options(), i));
      ZINF_RETURN_IF_ERROR(workers_.back()->Start());
    }
    return OkStatus();
  }

  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    if (pending() != 0) {
      return FailedPreconditionError(
          fmt::format("RegisterBuffers with {} requests pending", pending()));
    }
    std::vector<iovec> iovecs;
    std::uint64_t total_bytes = 0;
    for (std::span<std::byte> buffer : buffers) {
      for (std::uint64_t begin = 0; begin < buffer.size(); begin += kMaxRegisteredChunk) {
        const std::uint64_t size =
            std::min<std::uint64_t>(kMaxRegisteredChunk, buffer.size() - begin);
        iovecs.push_back(iovec{buffer.data() + begin, static_cast<std::size_t>(size)});
        total_bytes += size;
      }
    }
    if (iovecs.size() > kMaxRegisteredBuffers) {
      ZINF_LOG_DEBUG("uring: {} buffers are more than io_uring registers ({}); using plain ops",
                     iovecs.size(), kMaxRegisteredBuffers);
      iovecs.clear();
    }
    std::optional<Error> failure;
    for (auto& worker : workers_) {
      Status status =
          worker->RunOnWorker([&worker, &iovecs] { return worker->SetBuffers(iovecs); });
      if (!status) {
        failure = std::move(status).error();
        break;
      }
    }
    if (failure.has_value()) {
      ZINF_LOG_DEBUG(
          "uring: registered buffers unavailable ({} in {} buffers: {}); using plain "
          "reads and writes",
          FormatBytes(total_bytes), iovecs.size(), failure->message());
      for (auto& worker : workers_) {
        (void)worker->RunOnWorker([&worker] { return worker->SetBuffers({}); });
      }
    }
    return OkStatus();
  }

  void ReportPart(RequestState* state, std::uint64_t bytes, std::optional<Error> error) {
    FinishPart(state, bytes, std::move(error));
  }
  FaultInjector* Injector() const { return injector(); }

 protected:
  void Dispatch(RequestState* state) override {
    std::vector<Part> parts =
        SplitRequest(state, options().block_size, static_cast<int>(workers_.size()));
    state->parts_left = static_cast<int>(parts.size());
    // Rotate the first ring so that many small requests spread over all of them.
    const std::size_t first = next_worker_;
    next_worker_ = (next_worker_ + 1) % workers_.size();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      workers_[(first + i) % workers_.size()]->Enqueue(parts[i]);
    }
  }

 private:
  std::vector<std::unique_ptr<RingWorker>> workers_;
  std::size_t next_worker_ = 0;  // submitting thread only
};

void RingWorker::Run(std::promise<Status> started) {
  Status init = InitRing();
  const bool ok = init.has_value();
  started.set_value(std::move(init));
  if (!ok) return;
  while (TakeWork()) {
    Fill();
    if (in_kernel_ > 0) Reap();
  }
  io_uring_queue_exit(&ring_);
}

Status RingWorker::InitRing() {
  const auto entries = static_cast<unsigned>(options_.queue_depth);
  io_uring_params params{};
  // One thread issues and reaps, and it never needs to be interrupted for completions.
  params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN;
  int ret = io_uring_queue_init_params(entries, &ring_, &params);
  if (ret == -EINVAL) {
    ZINF_LOG_DEBUG("uring ring {}: SINGLE_ISSUER|COOP_TASKRUN refused; plain ring", index_);
    params = io_uring_params{};
    ret = io_uring_queue_init_params(entries, &ring_, &params);
  }
  if (ret < 0) {
    return ErrnoError(-ret,
                      fmt::format("io_uring_queue_init({} entries) for ring {}", entries, index_));
  }
  ops_.resize(static_cast<std::size_t>(options_.queue_depth));
  for (int i = options_.queue_depth - 1; i >= 0; --i) free_ops_.push_back(i);
  ret = io_uring_register_files_sparse(&ring_, kFileSlots);
  if (ret == 0) {
    files_registered_ = true;
    slot_fd_.assign(kFileSlots, -1);
    slot_refs_.assign(kFileSlots, 0);
  } else {
    ZINF_LOG_DEBUG("uring ring {}: registered files unavailable ({}); using plain descriptors",
                   index_, ErrnoError(-ret, "io_uring_register_files_sparse").message());
  }
  return OkStatus();
}

bool RingWorker::TakeWork() {
  std::deque<Part> parts;
  std::deque<std::packaged_task<Status()>> controls;
  bool stop = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!Busy()) {
      cv_.wait(lock, [this] { return stop_ || !incoming_.empty() || !controls_.empty(); });
    }
    parts.swap(incoming_);
    // Control tasks (buffer registration) run only while no op is in the ring.
    if (!Busy() && parts.empty()) controls.swap(controls_);
    stop = stop_;
  }
  for (auto& control : controls) control();
  for (const Part& part : parts) Activate(part);
  if (stop && !stopping_) {
    stopping_ = true;
    AbortUnissued(AbortedError("the I/O backend was destroyed before this block was issued"));
  }
  return !stopping_ || Busy();
}

void RingWorker::Activate(const Part& part) {
  const IoRequest& request = part.state->request;
  Slice& slice = slices_.emplace_back();
  slice.self = std::prev(slices_.end());
  slice.state = part.state;
  slice.op = request.op;
  slice.file = request.file;
  slice.offset_bytes = request.offset_bytes + part.begin_bytes;
  slice.data = request.buffer.data() + part.begin_bytes;
  slice.length_bytes = part.length_bytes;
  slice.file_slot = AcquireFileSlot(request.file->fd());
  if (broken_.has_value()) {
    slice.error = *broken_;
    slice.stopped = true;
    MaybeFinish(&slice);
    return;
  }
  feed_.push_back(&slice);
}

void RingWorker::AbortUnissued(const Error& error) {
  for (Slice* slice : feed_) {
    slice->stopped = true;
    if (!slice->error.has_value()) slice->error = error;
  }
  feed_.clear();
  // Resubmissions waiting for a slot are not in the kernel: they can be dropped too.
  std::deque<int> ready;
  ready.swap(ready_);
  for (int op : ready) CompleteOp(op, error);
  // Finish slices with nothing in flight; the others finish as their ops come back.
  std::vector<Slice*> idle;
  for (Slice& slice : slices_) {
    if (slice.ops == 0) idle.push_back(&slice);
  }
  for (Slice* slice : idle) MaybeFinish(slice);
}

RingWorker::Slice* RingWorker::NextFeedSlice() {
  while (!feed_.empty()) {
    Slice* slice = feed_.front();
    if (slice->state->failed.load(std::memory_order_relaxed)) slice->stopped = true;
    if (!slice->stopped && slice->next_bytes < slice->length_bytes) return slice;
    feed_.pop_front();
    MaybeFinish(slice);
  }
  return nullptr;
}

int RingWorker::NewOp(Slice* slice) {
  const int index = free_ops_.back();
  free_ops_.pop_back();
  Op& op = ops_[static_cast<std::size_t>(index)];
  const std::uint64_t length =
      std::min(options_.block_size, slice->length_bytes - slice->next_bytes);
  op.block = BlockProgress{};
  op.block.op = slice->op;
  op.block.file = slice->file;
  op.block.offset_bytes = slice->offset_bytes + slice->next_bytes;
  op.block.data = slice->data + slice->next_bytes;
  op.block.length_bytes = length;
  op.slice = slice;
  op.buffer_index = FindBuffer(op.block.data, length);
  slice->next_bytes += length;
  ++slice->ops;
  if (slice->next_bytes == slice->length_bytes) feed_.pop_front();
  return index;
}

void RingWorker::Prepare(io_uring_sqe* sqe, int op_index) {
  Op& op = ops_[static_cast<std::size_t>(op_index)];
  const Slice& slice = *op.slice;
  const bool fixed_file = slice.file_slot >= 0;
  const int fd = fixed_file ? slice.file_slot : slice.file->fd();
  void* data = op.block.next_data();
  const auto length = static_cast<unsigned>(op.block.remaining());
  const std::uint64_t offset = op.block.next_offset();
  if (op.block.op == IoOp::kRead) {
    if (op.buffer_index >= 0) {
      io_uring_prep_read_fixed(sqe, fd, data, length, offset, op.buffer_index);
    } else {
      io_uring_prep_read(sqe, fd, data, length, offset);
    }
  } else {
    if (op.buffer_index >= 0) {
      io_uring_prep_write_fixed(sqe, fd, data, length, offset, op.buffer_index);
    } else {
      io_uring_prep_write(sqe, fd, data, length, offset);
    }
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, static_cast<std::uint64_t>(op_index));
}

void RingWorker::Fill() {
  if (broken_.has_value()) {
    AbortUnissued(*broken_);
    return;
  }
  // In waves (overlap_events off) a new wave starts only when the last one is fully reaped.
  if (!options_.overlap_events && in_kernel_ > 0) return;
  while (true) {
    int op_index = -1;
    if (!ready_.empty()) {
      op_index = ready_.front();
      ready_.pop_front();
    } else if (!free_ops_.empty() && !stopping_) {
      Slice* slice = NextFeedSlice();
      if (slice == nullptr) break;
      op_index = NewOp(slice);
    } else {
      break;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      // The SQ is full of entries the kernel has not taken yet: submit them first.
      ready_.push_front(op_index);
      break;
    }
    Prepare(sqe, op_index);
    unsubmitted_.push_back(op_index);
    if (options_.single_submit) Submit();
    if (broken_.has_value()) return;
  }
  Submit();
}

void RingWorker::Submit() {
  int busy_tries = 0;
  while (!unsubmitted_.empty() && !broken_.has_value()) {
    int ret = io_uring_submit(&ring_);
    if (ret > 0) {
      for (int i = 0; i < ret && !unsubmitted_.empty(); ++i) unsubmitted_.pop_front();
      in_kernel_ += static_cast<unsigned>(ret);
      continue;
    }
    if (ret == -EINTR) continue;
    if (ret == 0 || ret == -EAGAIN || ret == -EBUSY) {
      // Out of kernel resources for now: reaping completions frees them.
      if (in_kernel_ > 0) return;
      if (++busy_tries <= kMaxRetries) {
        std::this_thread::yield();
        continue;
      }
      if (ret == 0) ret = -EAGAIN;
    }
    Break(ErrnoError(-ret, fmt::format("io_uring_submit on ring {} ({} entries not taken)", index_,
                                       unsubmitted_.size())));
  }
}

void RingWorker::Break(const Error& error) {
  ZINF_LOG_ERROR("uring ring {}: {}; failing every op not yet in the kernel", index_,
                 error.message());
  broken_ = error;
  // The entries left in the SQ are never submitted: nothing calls io_uring_submit any more.
  std::deque<int> unsubmitted;
  unsubmitted.swap(unsubmitted_);
  for (int op : unsubmitted) CompleteOp(op, error);
  AbortUnissued(error);
}

void RingWorker::Reap() {
  // With overlap_events one completion is enough to refill; in waves, the whole wave.
  const unsigned want = options_.overlap_events ? 1 : in_kernel_;
  unsigned reaped = 0;
  int busy_tries = 0;
  while (in_kernel_ > 0 && reaped < want) {
    io_uring_cqe* cqe = nullptr;
    const int ret = io_uring_wait_cqe(&ring_, &cqe);
    if (ret == -EINTR) continue;
    if ((ret == -EAGAIN || ret == -EBUSY) && ++busy_tries <= kMaxRetries) {
      std::this_thread::yield();
      continue;
    }
    // Ops still in the kernel may write into their buffers at any time: giving the buffers back
    // would corrupt memory, so a ring that cannot be waited on is fatal.
    ZINF_CHECK(ret == 0, "io_uring_wait_cqe on ring {} failed with {} ops in flight: {}", index_,
               in_kernel_, ErrnoError(-ret, "io_uring_wait_cqe").message());
    io_uring_cqe* cqes[kReapBatch];
    const unsigned count = io_uring_peek_batch_cqe(&ring_, cqes, kReapBatch);
    std::pair<int, std::int64_t> results[kReapBatch];
    for (unsigned i = 0; i < count; ++i) {
      results[i] = {static_cast<int>(io_uring_cqe_get_data64(cqes[i])), cqes[i]->res};
    }
    io_uring_cq_advance(&ring_, count);
    in_kernel_ -= count;
    reaped += count;
    for (unsigned i = 0; i < count; ++i) HandleCompletion(results[i].first, results[i].second);
  }
}

void RingWorker::HandleCompletion(int op_index, std::int64_t result) {
  Op& op = ops_[static_cast<std::size_t>(op_index)];
  std::optional<Error> error;
  switch (ApplyResult(&op.block, result, backend_->Injector(), &error)) {
    case BlockNext::kResubmit:
      ready_.push_back(op_index);
      return;
    case BlockNext::kDone:
      CompleteOp(op_index, std::nullopt);
      return;
    case BlockNext::kFailed:
      CompleteOp(op_index, std::move(error));
      return;
  }
}

void RingWorker::CompleteOp(int op_index, std::optional<Error> error) {
  Op& op = ops_[static_cast<std::size_t>(op_index)];
  Slice* slice = op.slice;
  if (error.has_value()) {
    slice->done_bytes += op.block.done_bytes;
    slice->stopped = true;
    slice->state->failed.store(true, std::memory_order_relaxed);
    if (!slice->error.has_value()) slice->error = std::move(error);
  } else {
    slice->done_bytes += op.block.length_bytes;
  }
  --slice->ops;
  op.slice = nullptr;
  free_ops_.push_back(op_index);
  MaybeFinish(slice);
}

void RingWorker::MaybeFinish(Slice* slice) {
  if (slice->ops > 0) return;
  if (!slice->stopped && slice->next_bytes < slice->length_bytes) return;
  // A fully issued slice left feed_ with its last block; a stopped one may still be there.
  if (slice->stopped) std::erase(feed_, slice);
  ReleaseFileSlot(slice->file_slot);
  backend_->ReportPart(slice->state, slice->done_bytes, std::move(slice->error));
  slices_.erase(slice->self);
}

int RingWorker::FindBuffer(const std::byte* data, std::uint64_t length) const {
  if (buffers_.empty()) return -1;
  auto it =
      std::upper_bound(buffers_.begin(), buffers_.end(), data,
                       [](const std::byte* p, const RegisteredChunk& c) { return p < c.base; });
  if (it == buffers_.begin()) return -1;
  --it;
  const auto offset = static_cast<std::uint64_t>(data - it->base);
  if (offset + length <= it->size) return it->index;
  return -1;
}

int RingWorker::AcquireFileSlot(int fd) {
  if (!files_registered_) return -1;
  int free_slot = -1;
  for (int slot = 0; slot < static_cast<int>(kFileSlots); ++slot) {
    if (slot_fd_[static_cast<std::size_t>(slot)] == fd) {
      ++slot_refs_[static_cast<std::size_t>(slot)];
      return slot;
    }
    if (free_slot < 0 && slot_fd_[static_cast<std::size_t>(slot)] == -1) free_slot = slot;
  }
  if (free_slot < 0) return -1;
  const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(free_slot), &fd, 1);
  if (ret != 1) {
    if (!slot_warned_) {
      slot_warned_ = true;
      ZINF_LOG_DEBUG("uring ring {}: registering a file failed ({}); using plain descriptors",
                     index_, ret < 0 ? ErrnoError(-ret, "update").message() : "no slot updated");
    }
    return -1;
  }
  slot_fd_[static_cast<std::size_t>(free_slot)] = fd;
  slot_refs_[static_cast<std::size_t>(free_slot)] = 1;
  return free_slot;
}

void RingWorker::ReleaseFileSlot(int slot) {
  if (slot < 0) return;
  const auto index = static_cast<std::size_t>(slot);
  if (--slot_refs_[index] > 0) return;
  int empty = -1;
  const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &empty, 1);
  if (ret != 1) {
    // The slot keeps a reference to the file; never reuse it rather than risk a wrong target.
    ZINF_LOG_DEBUG("uring ring {}: unregistering file slot {} failed ({}); slot retired", index_,
                   slot, ret);
    slot_fd_[index] = -2;
    return;
  }
  slot_fd_[index] = -1;
}

}  // namespace

Result<std::unique_ptr<BackendBase>> CreateUringBackend(const AioOptions& options) {
  ZINF_RETURN_IF_ERROR(ValidateOptions(options));
  auto backend = std::make_unique<UringBackend>(options);
  ZINF_RETURN_IF_ERROR(backend->Start());
  return std::unique_ptr<BackendBase>(std::move(backend));
}

}  // namespace zinf::storage::internal
