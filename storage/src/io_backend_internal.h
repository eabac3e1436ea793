// Private to zinf::storage: what UringBackend and PosixBackend share. BackendBase owns the request
// bookkeeping (ids, per-request part counts, the completion queue, Wait semantics) and request
// validation; a backend only implements Dispatch (hand the parts of a request to its workers) and
// reports each part with FinishPart. BlockProgress holds the one result-checking routine both
// backends run on every completion.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/fault_injection.h"
#include "zinf/storage/file.h"
#include "zinf/storage/io_backend.h"

namespace zinf::storage::internal {

// EAGAIN/EINTR results (and writes that move nothing) are retried this many times per block.
inline constexpr int kMaxRetries = 1000;
// Largest block: the kernel moves at most ~2 GiB per call and io_uring lengths are 32-bit.
inline constexpr std::uint64_t kMaxBlockSize = std::uint64_t{1} << 30;
inline constexpr int kMaxParallelism = 64;
inline constexpr int kMaxQueueDepth = 4096;

Status ValidateOptions(const AioOptions& options);

struct RequestState {
  std::uint64_t id = 0;
  IoRequest request;
  // Guarded by BackendBase::mu_ once the request is dispatched.
  int parts_left = 0;
  std::uint64_t bytes_done = 0;
  std::optional<Error> error;
  // Set by the first failing part, so that the other parts stop issuing blocks.
  std::atomic<bool> failed{false};
};

// A contiguous piece of a request handled by one worker.
struct Part {
  RequestState* state = nullptr;
  std::uint64_t begin_bytes = 0;  // offset of the part within the request
  std::uint64_t length_bytes = 0;
};

// Splits a request of `length_bytes` into at most `parallelism` contiguous parts whose lengths
// (except the last) are multiples of `block_size`.
std::vector<Part> SplitRequest(RequestState* state, std::uint64_t block_size, int parallelism);

// One block transfer in progress: what is left and how often it was retried.
struct BlockProgress {
  IoOp op = IoOp::kRead;
  const File* file = nullptr;
  std::uint64_t offset_bytes = 0;  // file offset of the block
  std::byte* data = nullptr;       // buffer of the block
  std::uint64_t length_bytes = 0;
  std::uint64_t done_bytes = 0;  // moved so far
  int retries = 0;

  std::byte* next_data() const { return data + done_bytes; }
  std::uint64_t next_offset() const { return offset_bytes + done_bytes; }
  std::uint64_t remaining() const { return length_bytes - done_bytes; }
};

enum class BlockNext { kDone, kResubmit, kFailed };

// Checks one completion `result` (bytes moved or -errno) of `block`, after passing it through
// `injector` (may be null): advances the block on progress, counts retries, and on failure sets
// *error to an error naming op, path, offset, length and errno.
BlockNext ApplyResult(BlockProgress* block, std::int64_t result, FaultInjector* injector,
                      std::optional<Error>* error);

class BackendBase : public IoBackend {
 public:
  BackendBase(std::string name, const AioOptions& options);
  ~BackendBase() override;

  std::string_view name() const override { return name_; }
  const AioOptions& options() const override { return options_; }
  Result<std::uint64_t> Submit(const IoRequest& request) final;
  Status Wait(std::size_t min_requests, std::vector<IoCompletion>* done) final;
  std::size_t pending() const final;

  // Attaches (or with nullptr detaches) the completion hook. Call while nothing is pending.
  void SetFaultInjector(std::shared_ptr<FaultInjector> injector);
  // Makes the next id 1 again, after CreateIoBackend's probe used the backend. Nothing pending.
  void ResetIds() { next_id_ = 1; }

 protected:
  // Hands a validated, non-empty request to the workers. Must set state->parts_left to the number
  // of parts before any part can finish; then FinishPart must be called once per part, and the
  // last call takes the state back. Called from the submitting thread.
  virtual void Dispatch(RequestState* state) = 0;
  // Reports one finished part (thread safe). `error` is the part's first failure, if any.
  void FinishPart(RequestState* state, std::uint64_t bytes, std::optional<Error> error);
  FaultInjector* injector() const { return injector_.get(); }

 private:
  const std::string name_;
  const AioOptions options_;
  std::shared_ptr<FaultInjector> injector_;
  std::uint64_t next_id_ = 1;  // submitting thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::size_t pending_ = 0;                              // guarded by mu_
  std::deque<std::unique_ptr<RequestState>> completed_;  // guarded by mu_
};

// The two backends; CreateIoBackend picks one.
Result<std::unique_ptr<BackendBase>> CreateUringBackend(const AioOptions& options);
Result<std::unique_ptr<BackendBase>> CreatePosixBackend(const AioOptions& options);

// "" if io_uring may be used, else why not (sysctl kernel.io_uring_disabled).
std::string UringDisabledReason();

}  // namespace zinf::storage::internal
