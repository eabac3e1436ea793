// PosixBackend: the fallback where io_uring is unavailable. Synchronous pread/pwrite cannot keep
// several blocks in flight from one thread, so the pool has intra_op_parallelism * queue_depth
// threads (at most kMaxThreads): the same number of blocks in flight as the io_uring backend.
// All threads pull blocks, in order, from one FIFO of requests, so a request's blocks are spread
// over every thread rather than over fixed slices: with blocking calls, contiguous slices per
// thread would only serialize a large request behind a slow block.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "io_backend_internal.h"

namespace zinf::storage::internal {
namespace {

constexpr int kMaxThreads = 64;

class PosixBackend final : public BackendBase {
 public:
  explicit PosixBackend(const AioOptions& options) : BackendBase("posix", options) {}

  ~PosixBackend() override {
    std::deque<Queued> cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cancelled.swap(queue_);
    }
    cv_.notify_all();
    // Blocks not started are reported as aborted; blocks in progress finish before the join.
    for (const Queued& queued : cancelled) {
      const std::uint64_t length = queued.state->request.buffer.size();
      for (std::uint64_t next = queued.next_bytes; next < length; next += options().block_size) {
        FinishPart(queued.state, 0,
                   AbortedError(fmt::format("{} {}: the backend was destroyed first",
                                            IoOpName(queued.state->request.op),
                                            queued.state->request.file->path())));
      }
    }
    for (std::thread& thread : threads_) thread.join();
  }

  Status Start() {
    const int count =
        std::clamp(options().intra_op_parallelism * options().queue_depth, 1, kMaxThreads);
    try {
      for (int i = 0; i < count; ++i) threads_.emplace_back([this] { Run(); });
    } catch (const std::system_error& e) {
      return Error(ErrorCode::kResourceExhausted,
                   fmt::format("posix backend: starting thread {} of {}: {}", threads_.size() + 1,
                               count, e.what()),
                   e.code().value());
    }
    return OkStatus();
  }

 protected:
  void Dispatch(RequestState* state) override {
    const std::uint64_t length = state->request.buffer.size();
    const std::uint64_t block = options().block_size;
    state->parts_left = static_cast<int>((length + block - 1) / block);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Queued{state, 0});
    }
    cv_.notify_all();
  }

 private:
  struct Queued {
    RequestState* state;
    std::uint64_t next_bytes;  // first byte of the request not yet taken by a thread
  };

  void Run() {
    while (true) {
      RequestState* state = nullptr;
      std::uint64_t begin = 0;
      std::uint64_t length = 0;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        Queued& front = queue_.front();
        state = front.state;
        begin = front.next_bytes;
        length =
            std::min<std::uint64_t>(options().block_size, state->request.buffer.size() - begin);
        front.next_bytes += length;
        if (front.next_bytes == state->request.buffer.size()) queue_.pop_front();
      }
      if (state->failed.load(std::memory_order_relaxed)) {
        FinishPart(state, 0, std::nullopt);
        continue;
      }
      const IoRequest& request = state->request;
      BlockProgress block;
      block.op = request.op;
      block.file = request.file;
      block.offset_bytes = request.offset_bytes + begin;
      block.data = request.buffer.data() + begin;
      block.length_bytes = length;
      std::optional<Error> error = Transfer(&block);
      if (error.has_value()) {
        state->failed.store(true, std::memory_order_relaxed);
        FinishPart(state, block.done_bytes, std::move(error));
      } else {
        FinishPart(state, length, std::nullopt);
      }
    }
  }

  std::optional<Error> Transfer(BlockProgress* block) {
    const int fd = block->file->fd();
    while (true) {
      const ssize_t moved = block->op == IoOp::kRead
                                ? ::pread(fd, block->next_data(), block->remaining(),
                                          static_cast<off_t>(block->next_offset()))
                                : ::pwrite(fd, block->next_data(), block->remaining(),
                                           static_cast<off_t>(block->next_offset()));
      const std::int64_t result = moved < 0 ? -static_cast<std::int64_t>(errno) : moved;
      std::optional<Error> error;
      switch (ApplyResult(block, result, injector(), &error)) {
        case BlockNext::kDone:
          return std::nullopt;
        case BlockNext::kResubmit:
          continue;
        case BlockNext::kFailed:
          return error;
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;  // guarded by mu_
  bool stop_ = false;         // guarded by mu_
};

}  // namespace

Result<std::unique_ptr<BackendBase>> CreatePosixBackend(const AioOptions& options) {
  ZINF_RETURN_IF_ERROR(ValidateOptions(options));
  auto backend = std::make_unique<PosixBackend>(options);
  ZINF_RETURN_IF_ERROR(backend->Start());
  return std::unique_ptr<BackendBase>(std::move(backend));
}

}  // namespace zinf::storage::internal
