#include "zinf/storage/io_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include <fmt/format.h>

#include "io_backend_internal.h"
#include "zinf/core/env.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/fault_injection.h"

namespace zinf::storage {

std::string_view IoOpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string_view IoBackendKindName(IoBackendKind kind) {
  const auto index = static_cast<std::size_t>(kind);
  return index < kIoBackendNames.size() ? kIoBackendNames[index] : "unknown";
}

Result<IoBackendKind> ParseIoBackendKind(std::string_view text) {
  for (std::size_t i = 0; i < kIoBackendNames.size(); ++i) {
    if (text == kIoBackendNames[i]) return static_cast<IoBackendKind>(i);
  }
  if (text == "io_uring") return IoBackendKind::kUring;
  return InvalidArgumentError(
      fmt::format("unknown I/O engine '{}': expected uring, posix or auto", text));
}

Status IoBackend::RegisterBuffers(std::span<const std::span<std::byte>> /*buffers*/) {
  if (pending() != 0) {
    return FailedPreconditionError(
        fmt::format("RegisterBuffers with {} requests pending", pending()));
  }
  return OkStatus();
}

Status IoBackend::WaitAll() {
  Status first = OkStatus();
  std::vector<IoCompletion> done;
  while (pending() > 0) {
    done.clear();
    Status status = Wait(pending(), &done);
    if (!status && first) first = std::move(status);
  }
  return first;
}

namespace internal {

Status ValidateOptions(const AioOptions& options) {
  if (options.block_size == 0 || options.block_size > kMaxBlockSize) {
    return InvalidArgumentError(
        fmt::format("aio.block_size {} must be in [1, {}]", options.block_size, kMaxBlockSize));
  }
  if (options.queue_depth < 1 || options.queue_depth > kMaxQueueDepth) {
    return InvalidArgumentError(
        fmt::format("aio.queue_depth {} must be in [1, {}]", options.queue_depth, kMaxQueueDepth));
  }
  if (options.intra_op_parallelism < 1 || options.intra_op_parallelism > kMaxParallelism) {
    return InvalidArgumentError(fmt::format("aio.intra_op_parallelism {} must be in [1, {}]",
                                            options.intra_op_parallelism, kMaxParallelism));
  }
  return OkStatus();
}

std::vector<Part> SplitRequest(RequestState* state, std::uint64_t block_size, int parallelism) {
  const std::uint64_t length = state->request.buffer.size();
  const std::uint64_t blocks = (length + block_size - 1) / block_size;
  const std::uint64_t parts =
      std::min<std::uint64_t>(static_cast<std::uint64_t>(parallelism), blocks);
  const std::uint64_t blocks_per_part = (blocks + parts - 1) / parts;
  std::vector<Part> out;
  out.reserve(parts);
  for (std::uint64_t begin = 0; begin < length;) {
    const std::uint64_t part_length = std::min(blocks_per_part * block_size, length - begin);
    out.push_back(Part{state, begin, part_length});
    begin += part_length;
  }
  return out;
}

BlockNext ApplyResult(BlockProgress* block, std::int64_t result, FaultInjector* injector,
                      std::optional<Error>* error) {
  if (injector != nullptr) result = injector->Apply(block->op, result, block->file->alignment());
  auto where = [block] {
    return fmt::format("{} {} offset {} length {}", IoOpName(block->op), block->file->path(),
                       block->next_offset(), block->remaining());
  };
  if (result < 0) {
    const int err = static_cast<int>(-result);
    if (err == EAGAIN || err == EINTR) {
      if (++block->retries <= kMaxRetries) return BlockNext::kResubmit;
      *error =
          ErrnoError(err, fmt::format("{} (still failing after {} retries)", where(), kMaxRetries));
      return BlockNext::kFailed;
    }
    *error = ErrnoError(err, where());
    return BlockNext::kFailed;
  }
  const auto moved = static_cast<std::uint64_t>(result);
  if (moved > block->remaining()) {
    *error = InternalError(fmt::format("{}: the kernel reported {} bytes moved", where(), moved));
    return BlockNext::kFailed;
  }
  if (moved == 0) {
    if (block->op == IoOp::kRead) {
      *error = DataLossError(fmt::format("short read at EOF: {}: the file ends at offset {}",
                                         where(), block->next_offset()));
      return BlockNext::kFailed;
    }
    if (++block->retries <= kMaxRetries) return BlockNext::kResubmit;
    *error = DataLossError(
        fmt::format("{}: the write moved no data {} times in a row", where(), kMaxRetries));
    return BlockNext::kFailed;
  }
  block->done_bytes += moved;
  if (block->done_bytes == block->length_bytes) return BlockNext::kDone;
  if (block->file->direct() && !IsAligned(moved, block->file->alignment())) {
    // The remainder would start unaligned and fail with EINVAL. A direct read stops at an
    // unaligned count only at end-of-file.
    if (block->op == IoOp::kRead) {
      *error = DataLossError(fmt::format("short read at EOF: {}: the file ends at offset {}",
                                         where(), block->next_offset()));
    } else {
      *error = DataLossError(
          fmt::format("{}: O_DIRECT write stopped at an unaligned count {}", where(), moved));
    }
    return BlockNext::kFailed;
  }
  return BlockNext::kResubmit;
}

BackendBase::BackendBase(std::string name, const AioOptions& options)
    : name_(std::move(name)), options_(options) {}

BackendBase::~BackendBase() = default;

void BackendBase::SetFaultInjector(std::shared_ptr<FaultInjector> injector) {
  injector_ = std::move(injector);
}

Result<std::uint64_t> BackendBase::Submit(const IoRequest& request) {
  if (request.file == nullptr || !request.file->is_open()) {
    return InvalidArgumentError(
        fmt::format("{} request without an open file", IoOpName(request.op)));
  }
  const File& file = *request.file;
  if (request.op == IoOp::kWrite && !file.writable()) {
    return InvalidArgumentError(fmt::format("write to {}, which is open read-only", file.path()));
  }
  const std::uint64_t length = request.buffer.size();
  std::uint64_t end = 0;
  if (!CheckedAdd(request.offset_bytes, length, &end) ||
      end > static_cast<std::uint64_t>(INT64_MAX)) {
    return InvalidArgumentError(fmt::format("{} {} offset {} length {}: beyond the largest offset",
                                            IoOpName(request.op), file.path(), request.offset_bytes,
                                            length));
  }
  if (file.direct()) {
    const std::uint64_t align = file.alignment();
    const auto address = reinterpret_cast<std::uintptr_t>(request.buffer.data());
    if (!IsAligned(address, align) || !IsAligned(request.offset_bytes, align) ||
        !IsAligned(length, align)) {
      return InvalidArgumentError(fmt::format(
          "{} {} (O_DIRECT, alignment {}): buffer address {:#x}, offset {} and length {} must "
          "all be multiples of {}",
          IoOpName(request.op), file.path(), align, address, request.offset_bytes, length, align));
    }
    if (!IsAligned(options_.block_size, align)) {
      return InvalidArgumentError(
          fmt::format("{} {}: aio.block_size {} is not a multiple of the file's alignment {}",
                      IoOpName(request.op), file.path(), options_.block_size, align));
    }
  }
  auto state = std::make_unique<RequestState>();
  state->id = next_id_++;
  state->request = request;
  const std::uint64_t id = state->id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
    if (length == 0) {
      completed_.push_back(std::move(state));
      cv_.notify_all();
      return id;
    }
  }
  Dispatch(state.release());
  return id;
}

void BackendBase::FinishPart(RequestState* state, std::uint64_t bytes, std::optional<Error> error) {
  std::lock_guard<std::mutex> lock(mu_);
  state->bytes_done += bytes;
  if (error.has_value() && !state->error.has_value()) state->error = std::move(error);
  if (--state->parts_left == 0) {
    completed_.emplace_back(state);
    cv_.notify_all();
  }
}

Status BackendBase::Wait(std::size_t min_requests, std::vector<IoCompletion>* done) {
  std::optional<Error> first;
  std::vector<std::string> more_failures;
  {
    std::unique_lock<std::mutex> lock(mu_);
    std::size_t collected = 0;
    while (true) {
      while (!completed_.empty()) {
        std::unique_ptr<RequestState> state = std::move(completed_.front());
        completed_.pop_front();
        --pending_;
        ++collected;
        if (state->error.has_value()) {
          if (!first.has_value()) {
            first = std::move(state->error);
          } else {
            more_failures.push_back(state->error->ToString());
          }
        } else if (done != nullptr) {
          done->push_back(IoCompletion{state->id, state->bytes_done});
        }
      }
      if (collected >= min_requests || pending_ == 0) break;
      cv_.wait(lock);
    }
  }
  // Only the first failure is returned; the others must not vanish silently.
  for (const std::string& failure : more_failures) {
    ZINF_LOG_WARN("{} backend: another request failed in the same Wait: {}", name_, failure);
  }
  if (first.has_value()) return std::move(*first);
  return OkStatus();
}

std::size_t BackendBase::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

std::string UringDisabledReason() {
  std::ifstream in("/proc/sys/kernel/io_uring_disabled");
  int value = 0;
  if (in >> value && value == 2) {
    return "io_uring is disabled on this machine (sysctl kernel.io_uring_disabled=2)";
  }
  return "";
}

}  // namespace internal

namespace {

// A tiny write and read back through `backend` in `dir`, on a file unlinked right after it is made.
Status ProbeRoundTrip(IoBackend& backend, const std::string& dir) {
  static std::atomic<int> counter{0};
  const std::string path =
      fmt::format("{}/.zinf-io-probe-{}-{}", dir, ::getpid(), counter.fetch_add(1));
  OpenOptions open_options;
  open_options.mode = OpenMode::kCreate;
  ZINF_ASSIGN_OR_RETURN(File file, File::Open(path, open_options));
  if (::unlink(path.c_str()) != 0) {
    return ErrnoError(errno, fmt::format("unlink {}", path));
  }
  const std::uint64_t alignment = std::max<std::uint64_t>(4096, file.alignment());
  BufferOptions buffer_options;
  buffer_options.alignment = alignment;
  buffer_options.register_cuda = false;
  ZINF_ASSIGN_OR_RETURN(AlignedBuffer out, AlignedBuffer::Allocate(alignment, buffer_options));
  ZINF_ASSIGN_OR_RETURN(AlignedBuffer in, AlignedBuffer::Allocate(alignment, buffer_options));
  for (std::uint64_t i = 0; i < out.size(); ++i) {
    out.data()[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  }
  ZINF_RETURN_IF_ERROR(backend.Submit(IoRequest{IoOp::kWrite, &file, 0, out.span()}));
  ZINF_RETURN_IF_ERROR(backend.WaitAll());
  ZINF_RETURN_IF_ERROR(backend.Submit(IoRequest{IoOp::kRead, &file, 0, in.span()}));
  ZINF_RETURN_IF_ERROR(backend.WaitAll());
  if (std::memcmp(out.data(), in.data(), out.size()) != 0) {
    return DataLossError(fmt::format("probe file {}: the data read back differs", path));
  }
  return file.Close();
}

Result<std::unique_ptr<internal::BackendBase>> ProbeUring(const AioOptions& options,
                                                          std::string_view probe_dir) {
  const std::string disabled = internal::UringDisabledReason();
  if (!disabled.empty()) return UnimplementedError(disabled);
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<internal::BackendBase> backend,
                        internal::CreateUringBackend(options));
  if (!probe_dir.empty()) {
    ZINF_RETURN_IF_ERROR(Annotate(ProbeRoundTrip(*backend, std::string(probe_dir)),
                                  fmt::format("O_DIRECT round trip in {}: ", probe_dir)));
    backend->ResetIds();
  }
  return backend;
}

}  // namespace

Result<std::unique_ptr<IoBackend>> CreateIoBackend(IoBackendKind kind, const AioOptions& options,
                                                   std::string_view probe_dir) {
  ZINF_RETURN_IF_ERROR(internal::ValidateOptions(options));
  std::string origin = "requested";
  if (std::optional<std::string> env = GetEnv("ZINF_IO_ENGINE")) {
    Result<IoBackendKind> parsed = ParseIoBackendKind(*env);
    if (!parsed) return std::move(parsed).error().WithContext("ZINF_IO_ENGINE: ");
    kind = *parsed;
    origin = "ZINF_IO_ENGINE";
  }
  // A bad fault spec is reported before any backend is made.
  ZINF_ASSIGN_OR_RETURN(std::shared_ptr<FaultInjector> injector, FaultInjectorFromEnv());

  std::unique_ptr<internal::BackendBase> backend;
  std::string reason;
  if (kind != IoBackendKind::kPosix) {
    Result<std::unique_ptr<internal::BackendBase>> uring = ProbeUring(options, probe_dir);
    if (uring) {
      backend = std::move(*uring);
      reason = kind == IoBackendKind::kUring ? fmt::format("{} uring", origin)
                                             : "auto: the io_uring probe passed";
    } else if (kind == IoBackendKind::kUring) {
      return UnimplementedError(
          fmt::format("io_uring backend unavailable: {}", uring.error().message()));
    } else {
      reason = fmt::format("auto: io_uring unavailable ({})", uring.error().message());
    }
  } else {
    reason = fmt::format("{} posix", origin);
  }
  if (backend == nullptr) {
    ZINF_ASSIGN_OR_RETURN(backend, internal::CreatePosixBackend(options));
  }

  static std::atomic<bool> logged{false};
  const LogLevel level = logged.exchange(true) ? LogLevel::kDebug : LogLevel::kInfo;
  Log(level,
      "I/O engine: {} ({}); block_size {}, queue_depth {}, intra_op_parallelism {}, "
      "single_submit {}, overlap_events {}",
      backend->name(), reason, FormatBytes(options.block_size), options.queue_depth,
      options.intra_op_parallelism, options.single_submit, options.overlap_events);

  std::unique_ptr<IoBackend> result = std::move(backend);
  if (injector != nullptr) {
    ZINF_LOG_WARN("ZINF_FAULT_INJECT='{}': injecting I/O faults into the {} backend",
                  FormatFaultSpec(injector->spec()), result->name());
    ZINF_ASSIGN_OR_RETURN(result, FaultInjectingBackend::Wrap(std::move(result), injector));
  }
  return result;
}

}  // namespace zinf::storage
