// IoBackend: asynchronous, checked block I/O between aligned host buffers and files.
//
// The contract every backend keeps (DESIGN.md, "I/O backend contract"):
// - A request (op, file, offset, buffer) is split into blocks of `block_size`; up to
//   `queue_depth` blocks are in flight per ring/worker, and `intra_op_parallelism` rings/workers
//   each take a contiguous slice of a request.
// - EVERY completion is checked. A negative result becomes an Error naming the op, the path, the
//   offset, the length and the errno; a short transfer is resubmitted for the remainder; EAGAIN
//   and EINTR are retried. A read that hits end-of-file before the requested length is DataLoss
//   ("short read at EOF"), never silently zero-filled.
// - A request's buffer must stay alive and untouched until Wait() has reported that request. The
//   backend never frees or reuses a buffer: destroying a backend first drains every op in flight.
// - For O_DIRECT files, buffer address, offset and length must be multiples of the file's
//   alignment (File::alignment()); a violation is InvalidArgument at Submit, not an EINVAL later.
//
// Thread safety: one thread submits and waits on a backend at a time (a backend may use worker
// threads internally). Use two backends to read and write concurrently (the pipelined swapper
// does).
//
// The backends:
// - "uring": `intra_op_parallelism` io_uring rings, each created, filled and reaped by its own
//   worker thread; each takes one contiguous slice of a request and keeps up to `queue_depth`
//   blocks of it (and of the requests queued behind it) in flight. Files are registered with the
//   ring while a slice on them is active; buffers given to RegisterBuffers use fixed-buffer ops.
//   An io_uring_wait_cqe failure with ops in flight aborts the process: their buffers could
//   still be written by the kernel, so they can never be handed back.
// - "posix": intra_op_parallelism * queue_depth threads (at most 64) doing pread/pwrite, pulling
//   blocks in order from one queue, so the same number of blocks is in flight.
// Destroying a backend with requests pending drops blocks not yet issued and waits for those in
// the kernel. Faults can be injected into either backend's completions (fault_injection.h).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/file.h"

namespace zinf::storage {

// DeepSpeed's `aio` section: same names, same defaults.
struct AioOptions {
  std::uint64_t block_size = 1 << 20;  // bytes per block I/O; a multiple of the file alignment
  int queue_depth = 8;                 // blocks in flight per ring (worker)
  int intra_op_parallelism = 1;        // rings (workers), each with its own thread and slice
  bool single_submit = false;          // submit blocks one at a time instead of in batches
  bool overlap_events = true;          // keep the queue full while reaping (else submit in waves)
};

enum class IoOp { kRead, kWrite };
std::string_view IoOpName(IoOp op);  // "read" / "write"

struct IoRequest {
  IoOp op = IoOp::kRead;
  const File* file = nullptr;      // must outlive the request
  std::uint64_t offset_bytes = 0;  // file offset
  std::span<std::byte> buffer;     // read into / write from; see alignment rules above
};

struct IoCompletion {
  std::uint64_t id = 0;     // the id Submit returned
  std::uint64_t bytes = 0;  // bytes transferred (== buffer size on success)
};

enum class IoBackendKind { kAuto, kUring, kPosix };
// The kinds' names, indexed by IoBackendKind: the one list zinf.io_engine, ZINF_IO_ENGINE and the
// benches' --engine accept.
inline constexpr std::array<std::string_view, 3> kIoBackendNames = {"auto", "uring", "posix"};
std::string_view IoBackendKindName(IoBackendKind kind);  // kIoBackendNames[kind]
// A name of kIoBackendNames (or "io_uring" for kUring) -> kind; InvalidArgument otherwise.
Result<IoBackendKind> ParseIoBackendKind(std::string_view text);

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual std::string_view name() const = 0;
  virtual const AioOptions& options() const = 0;

  // Queues a request and returns its id (increasing from 1). Errors: InvalidArgument for
  // misaligned O_DIRECT requests, a null file or a write to a read-only file.
  virtual Result<std::uint64_t> Submit(const IoRequest& request) = 0;

  // Blocks until at least `min_requests` requests (whole requests, not blocks) have completed, or
  // none are pending; appends their completions to *done. If any completed request failed, returns
  // the first failure (and still reports the successful ones in *done); later calls go on with the
  // remaining requests.
  virtual Status Wait(std::size_t min_requests, std::vector<IoCompletion>* done) = 0;

  // Waits for every pending request; returns the first failure among them, if any.
  Status WaitAll();

  // Requests submitted and not yet returned by Wait.
  virtual std::size_t pending() const = 0;

  // Optional speed-up: registers long-lived I/O buffers (e.g. the pool) with the backend, replacing
  // any earlier set; an empty list unregisters. Blocks that lie inside a registered buffer then
  // use fixed-buffer ops (io_uring READ_FIXED/WRITE_FIXED), which skip pinning pages per I/O.
  // Where the kernel or RLIMIT_MEMLOCK refuses, the backend silently keeps plain ops (a DEBUG line
  // says so): success means "accepted", not "registered". The buffers must stay alive until they
  // are replaced, unregistered or the backend is destroyed. Precondition: pending() == 0, else
  // FailedPrecondition. The default does nothing.
  virtual Status RegisterBuffers(std::span<const std::span<std::byte>> buffers);
};

// Creates a backend. kAuto probes io_uring (ring setup plus a tiny O_DIRECT round trip in
// `probe_dir`) and falls back to the POSIX thread-pool backend; the choice and the reason are
// logged once. ZINF_IO_ENGINE overrides `kind`. Errors: Unimplemented if kUring is asked for and
// io_uring is unavailable (the message says why); InvalidArgument for bad options.
Result<std::unique_ptr<IoBackend>> CreateIoBackend(IoBackendKind kind, const AioOptions& options,
                                                   std::string_view probe_dir);

}  // namespace zinf::storage
