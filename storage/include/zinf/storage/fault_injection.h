// Fault injection for the I/O backends: make the Nth block transfer fail with EIO or ENOSPC, report
// a short transfer, or ask for a retry (EAGAIN/EINTR), so that tests and end-to-end runs exercise
// every error and retry path of the backends and of the code above them.
//
// Faults are injected inside the backends' completion handling (UringBackend, PosixBackend): the
// real transfer happens, then its result is rewritten before the backend looks at it. So an
// injected short transfer really makes the backend resubmit the remainder, an injected EAGAIN
// really makes it retry the block, and an injected EIO/ENOSPC surfaces from Wait() as the error
// the backend builds for a real one (op, path, offset, length, errno; DataLoss / ResourceExhausted).
//
// Spec syntax (code: ParseFaultSpec; environment: ZINF_FAULT_INJECT, applied by CreateIoBackend):
//
//   ZINF_FAULT_INJECT="write:3:eio,read:1:short,read:2:eagain,rank=1"
//
//   rule   := OP ':' N ['+'] ':' KIND
//   OP     := read | write | any                      the backends' block transfers
//           | open | stat | mkdir | rename | unlink | fsync | fallocate | fwrite | fread
//           | pwrite | pread | ftruncate | fcntl | flock | fchmod | fadvise
//           | sync_file_range | statfs | readdir | close
//                                                     the file-system calls of Env (env.h)
//   N      := 1, 2, ...: the Nth block completion of OP in this process (every completion counts,
//             resubmissions and retries included; "any" counts reads and writes together), or
//             the Nth call of an Env OP (Env::Default()'s, or a FaultInjectingEnv's).
//             With '+', the Nth and every later one ("write:1+:enospc": every write fails).
//   KIND   := eio | enospc | eagain | eintr | short
//             short: the transfer reports half of what it moved, rounded down to the file's
//             alignment (a no-op when that is 0, e.g. a one-sector O_DIRECT block); of the Env
//             ops only fwrite and pwrite take it (they write half of the bytes).
//   rank=R := apply the spec only on world rank R (zinf::ProcessRank()); default: every rank.
//
// E.g. "rename:1:eio" fails the first rename of the process: a checkpoint save's rename of its
// partial file, which must leave `latest` and the previous checkpoint as they were.
//
// Rules are separated by commas; whitespace around tokens is ignored. A malformed spec is
// InvalidArgument naming the bad token. The environment spec has one process-wide injector, shared
// by every backend CreateIoBackend makes, so "the 3rd write" counts across backends.
//
// Thread safety: FaultInjector is thread safe (backends call it from their worker threads).
// FaultInjectingBackend has the IoBackend threading contract.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/storage/io_backend.h"

namespace zinf::storage {

enum class FaultKind { kEio, kEnospc, kEagain, kEintr, kShort };
std::string_view FaultKindName(FaultKind kind);  // "eio", "enospc", ...

// The Env calls (env.h) a rule can fail.
enum class FsOp {
  kOpen,
  kStat,
  kMkdir,
  kRename,
  kUnlink,
  kFsync,
  kFallocate,
  kWrite,  // "fwrite"
  kRead,   // "fread"
  kPWrite,
  kPRead,
  kTruncate,  // "ftruncate"
  kFcntl,
  kFlock,
  kChmod,      // "fchmod"
  kFadvise,    // "fadvise"
  kSyncRange,  // "sync_file_range"
  kStatFs,
  kReadDir,
  kClose,
};
inline constexpr int kNumFsOps = static_cast<int>(FsOp::kClose) + 1;
std::string_view FsOpName(FsOp op);  // "open", ..., "fwrite", ...

struct FaultRule {
  std::optional<IoOp> op;     // nullopt: any backend op (unless fs_op is set)
  std::optional<FsOp> fs_op;  // set: the rule is for this Env call, not for backends
  std::uint64_t nth = 1;      // 1-based count of block completions of `op`
  bool and_later = false;     // also every completion after the nth
  FaultKind kind = FaultKind::kEio;
};

struct FaultSpec {
  std::vector<FaultRule> rules;
  int rank = -1;  // apply only on this world rank; -1: every rank
};

// Parses the syntax above. Errors: InvalidArgument naming the bad token.
Result<FaultSpec> ParseFaultSpec(std::string_view text);
// The spec in the syntax above ("write:3:eio,rank=1").
std::string FormatFaultSpec(const FaultSpec& spec);

class FaultInjector {
 public:
  explicit FaultInjector(FaultSpec spec);

  // Called by a backend once per block completion with the kernel's result (`result` bytes moved,
  // or -errno) and the file's alignment; returns the result the backend must act on.
  std::int64_t Apply(IoOp op, std::int64_t result, std::uint64_t alignment);

  // Called by FaultInjectingEnv once per call of `op`: 0 to make the call, else the errno to
  // fail it with; -1 for a short write (kWrite only).
  int ApplyFs(FsOp op);
  // Whether some rule is for an Env call (Env::Default() then injects).
  bool has_fs_rules() const;
  // How many calls of `op` were counted so far (made or failed).
  std::uint64_t fs_calls(FsOp op) const {
    return fs_calls_[static_cast<int>(op)].load(std::memory_order_relaxed);
  }

  // How many results were rewritten so far.
  std::uint64_t injected() const { return injected_.load(std::memory_order_relaxed); }
  const FaultSpec& spec() const { return spec_; }

 private:
  FaultSpec spec_;
  std::atomic<std::uint64_t> reads_{0};
  std::atomic<std::uint64_t> writes_{0};
  std::atomic<std::uint64_t> any_{0};
  std::atomic<std::uint64_t> fs_calls_[kNumFsOps] = {};
  std::atomic<std::uint64_t> injected_{0};
};

// The injector for ZINF_FAULT_INJECT: nullptr when the variable is unset or the spec names another
// rank; one shared instance per distinct spec text. Errors: InvalidArgument for a malformed spec.
Result<std::shared_ptr<FaultInjector>> FaultInjectorFromEnv();

// A backend whose block completions pass through `injector`. Takes ownership of `inner`, which must
// be a backend made by CreateIoBackend (directly or unwrapped); other IoBackend implementations have
// no completion hook and give Unimplemented. Replaces any injector already attached to `inner`.
class FaultInjectingBackend final : public IoBackend {
 public:
  static Result<std::unique_ptr<IoBackend>> Wrap(std::unique_ptr<IoBackend> inner,
                                                std::shared_ptr<FaultInjector> injector);

  std::string_view name() const override { return name_; }
  const AioOptions& options() const override { return inner_->options(); }
  Result<std::uint64_t> Submit(const IoRequest& request) override {
    return inner_->Submit(request);
  }
  Status Wait(std::size_t min_requests, std::vector<IoCompletion>* done) override {
    return inner_->Wait(min_requests, done);
  }
  std::size_t pending() const override { return inner_->pending(); }
  Status RegisterBuffers(std::span<const std::span<std::byte>> buffers) override {
    return inner_->RegisterBuffers(buffers);
  }

  FaultInjector& injector() { return *injector_; }

 private:
  FaultInjectingBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultInjector> injector);
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultInjector> injector_;
  std::string name_;
};

}  // namespace zinf::storage
