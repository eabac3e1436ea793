#include "zinf/storage/fault_injection.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "io_backend_internal.h"
#include "zinf/core/check.h"
#include "zinf/core/env.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"

namespace zinf::storage {
namespace {

std::string_view Trim(std::string_view text) {
  const auto begin = text.find_first_not_of(" \t\n");
  if (begin == std::string_view::npos) return {};
  const auto end = text.find_last_not_of(" \t\n");
  return text.substr(begin, end - begin + 1);
}

Error BadToken(std::string_view token, std::string_view why) {
  return InvalidArgumentError(fmt::format(
      "fault injection spec: bad token '{}': {} (expected OP:N[+]:KIND with OP read|write|any "
      "or an Env call (open|stat|mkdir|rename|unlink|fsync|fallocate|fwrite|fread|statfs|"
      "readdir|close), N >= 1, KIND eio|enospc|eagain|eintr|short; or rank=R)",
      token, why));
}

bool ParseUint(std::string_view text, std::uint64_t* value) {
  if (text.empty()) return false;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), *value);
  return ec == std::errc() && ptr == text.data() + text.size();
}

std::optional<FsOp> FsOpNamed(std::string_view name) {
  for (int i = 0; i < kNumFsOps; ++i) {
    if (FsOpName(static_cast<FsOp>(i)) == name) return static_cast<FsOp>(i);
  }
  return std::nullopt;
}

// The errno a rule's kind injects (0 for kShort, which is not an error).
int FaultErrno(FaultKind kind) {
  switch (kind) {
    case FaultKind::kEio:
      return EIO;
    case FaultKind::kEnospc:
      return ENOSPC;
    case FaultKind::kEagain:
      return EAGAIN;
    case FaultKind::kEintr:
      return EINTR;
    case FaultKind::kShort:
      return 0;
  }
  return EIO;
}

}  // namespace

std::string_view FsOpName(FsOp op) {
  switch (op) {
    case FsOp::kOpen:
      return "open";
    case FsOp::kStat:
      return "stat";
    case FsOp::kMkdir:
      return "mkdir";
    case FsOp::kRename:
      return "rename";
    case FsOp::kUnlink:
      return "unlink";
    case FsOp::kFsync:
      return "fsync";
    case FsOp::kFallocate:
      return "fallocate";
    case FsOp::kWrite:
      return "fwrite";
    case FsOp::kRead:
      return "fread";
    case FsOp::kPWrite:
      return "pwrite";
    case FsOp::kPRead:
      return "pread";
    case FsOp::kTruncate:
      return "ftruncate";
    case FsOp::kFcntl:
      return "fcntl";
    case FsOp::kFlock:
      return "flock";
    case FsOp::kChmod:
      return "fchmod";
    case FsOp::kFadvise:
      return "fadvise";
    case FsOp::kSyncRange:
      return "sync_file_range";
    case FsOp::kStatFs:
      return "statfs";
    case FsOp::kReadDir:
      return "readdir";
    case FsOp::kClose:
      return "close";
  }
  return "unknown";
}

std::string_view FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kEio:
      return "eio";
    case FaultKind::kEnospc:
      return "enospc";
    case FaultKind::kEagain:
      return "eagain";
    case FaultKind::kEintr:
      return "eintr";
    case FaultKind::kShort:
      return "short";
  }
  return "unknown";
}

Result<FaultSpec> ParseFaultSpec(std::string_view text) {
  FaultSpec spec;
  if (Trim(text).empty()) return InvalidArgumentError("fault injection spec is empty");
  bool have_rank = false;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view token = Trim(text.substr(pos, comma - pos));
    pos = comma + 1;
    if (token.empty()) return BadToken(token, "empty rule");
    if (token.starts_with("rank=")) {
      std::uint64_t rank = 0;
      if (!ParseUint(token.substr(5), &rank) || rank > 1'000'000) {
        return BadToken(token, "rank must be a non-negative integer");
      }
      if (have_rank) return BadToken(token, "rank given twice");
      have_rank = true;
      spec.rank = static_cast<int>(rank);
      continue;
    }
    const std::size_t c1 = token.find(':');
    const std::size_t c2 = c1 == std::string_view::npos ? c1 : token.find(':', c1 + 1);
    if (c2 == std::string_view::npos || token.find(':', c2 + 1) != std::string_view::npos) {
      return BadToken(token, "a rule has three fields separated by ':'");
    }
    const std::string_view op = token.substr(0, c1);
    std::string_view nth = token.substr(c1 + 1, c2 - c1 - 1);
    const std::string_view kind = token.substr(c2 + 1);
    FaultRule rule;
    if (op == "read") {
      rule.op = IoOp::kRead;
    } else if (op == "write") {
      rule.op = IoOp::kWrite;
    } else if (std::optional<FsOp> fs_op = FsOpNamed(op)) {
      rule.fs_op = fs_op;
    } else if (op != "any") {
      return BadToken(token, fmt::format("unknown op '{}'", op));
    }
    if (nth.ends_with('+')) {
      rule.and_later = true;
      nth.remove_suffix(1);
    }
    if (!ParseUint(nth, &rule.nth) || rule.nth == 0) {
      return BadToken(token, fmt::format("'{}' is not a count >= 1", nth));
    }
    if (kind == "eio") {
      rule.kind = FaultKind::kEio;
    } else if (kind == "enospc") {
      rule.kind = FaultKind::kEnospc;
    } else if (kind == "eagain") {
      rule.kind = FaultKind::kEagain;
    } else if (kind == "eintr") {
      rule.kind = FaultKind::kEintr;
    } else if (kind == "short") {
      rule.kind = FaultKind::kShort;
    } else {
      return BadToken(token, fmt::format("unknown kind '{}'", kind));
    }
    if (rule.kind == FaultKind::kShort && rule.fs_op && *rule.fs_op != FsOp::kWrite &&
        *rule.fs_op != FsOp::kPWrite) {
      return BadToken(token,
                      fmt::format("'short' applies to transfers, fwrite and pwrite, not {}", op));
    }
    spec.rules.push_back(rule);
  }
  if (spec.rules.empty()) return InvalidArgumentError("fault injection spec has no rule");
  return spec;
}

std::string FormatFaultSpec(const FaultSpec& spec) {
  std::string out;
  for (const FaultRule& rule : spec.rules) {
    if (!out.empty()) out += ',';
    const std::string_view op = rule.fs_op ? FsOpName(*rule.fs_op)
                                : rule.op  ? IoOpName(*rule.op)
                                           : "any";
    out += fmt::format("{}:{}{}:{}", op, rule.nth, rule.and_later ? "+" : "",
                       FaultKindName(rule.kind));
  }
  if (spec.rank >= 0) out += fmt::format(",rank={}", spec.rank);
  return out;
}

FaultInjector::FaultInjector(FaultSpec spec) : spec_(std::move(spec)) {}

std::int64_t FaultInjector::Apply(IoOp op, std::int64_t result, std::uint64_t alignment) {
  if (spec_.rank >= 0 && ProcessRank() != spec_.rank) return result;
  const std::uint64_t op_count =
      (op == IoOp::kRead ? reads_ : writes_).fetch_add(1, std::memory_order_relaxed) + 1;
  const std::uint64_t any_count = any_.fetch_add(1, std::memory_order_relaxed) + 1;
  for (const FaultRule& rule : spec_.rules) {
    if (rule.fs_op.has_value() || (rule.op.has_value() && *rule.op != op)) continue;
    const std::uint64_t count = rule.op.has_value() ? op_count : any_count;
    if (count != rule.nth && !(rule.and_later && count > rule.nth)) continue;
    std::int64_t rewritten = -FaultErrno(rule.kind);
    if (rule.kind == FaultKind::kShort) {
      rewritten = result;
      if (result > 0) {
        rewritten = static_cast<std::int64_t>(AlignDown(static_cast<std::uint64_t>(result) / 2,
                                                        std::max<std::uint64_t>(1, alignment)));
        // Reporting 0 bytes would mean end-of-file, not a short transfer.
        if (rewritten == 0) rewritten = result;
      }
    }
    if (rewritten != result) {
      injected_.fetch_add(1, std::memory_order_relaxed);
      ZINF_LOG_DEBUG("fault injection: {} #{} ({}): result {} -> {}", IoOpName(op), count,
                     FaultKindName(rule.kind), result, rewritten);
    }
    return rewritten;
  }
  return result;
}

int FaultInjector::ApplyFs(FsOp op) {
  if (spec_.rank >= 0 && ProcessRank() != spec_.rank) return 0;
  const std::uint64_t count =
      fs_calls_[static_cast<int>(op)].fetch_add(1, std::memory_order_relaxed) + 1;
  for (const FaultRule& rule : spec_.rules) {
    if (rule.fs_op != op) continue;
    if (count != rule.nth && !(rule.and_later && count > rule.nth)) continue;
    injected_.fetch_add(1, std::memory_order_relaxed);
    ZINF_LOG_DEBUG("fault injection: {} #{} ({})", FsOpName(op), count, FaultKindName(rule.kind));
    return rule.kind == FaultKind::kShort ? -1 : FaultErrno(rule.kind);
  }
  return 0;
}

bool FaultInjector::has_fs_rules() const {
  return std::any_of(spec_.rules.begin(), spec_.rules.end(),
                     [](const FaultRule& rule) { return rule.fs_op.has_value(); });
}

Result<std::shared_ptr<FaultInjector>> FaultInjectorFromEnv() {
  const std::optional<std::string> text = GetEnv("ZINF_FAULT_INJECT");
  if (!text.has_value()) return std::shared_ptr<FaultInjector>();
  // One injector per spec text, so that counts run across all backends of the process.
  static std::mutex mu;
  static std::string cached_text;
  static std::shared_ptr<FaultInjector> cached;
  std::lock_guard<std::mutex> lock(mu);
  if (cached == nullptr || cached_text != *text) {
    Result<FaultSpec> spec = ParseFaultSpec(*text);
    if (!spec) return std::move(spec).error().WithContext("ZINF_FAULT_INJECT: ");
    cached = std::make_shared<FaultInjector>(std::move(*spec));
    cached_text = *text;
  }
  if (cached->spec().rank >= 0 && cached->spec().rank != ProcessRank()) {
    return std::shared_ptr<FaultInjector>();
  }
  return cached;
}

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<IoBackend> inner,
                                           std::shared_ptr<FaultInjector> injector)
    : inner_(std::move(inner)),
      injector_(std::move(injector)),
      name_(fmt::format("{}+faults", inner_->name())) {}

Result<std::unique_ptr<IoBackend>> FaultInjectingBackend::Wrap(
    std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultInjector> injector) {
  if (inner == nullptr || injector == nullptr) {
    return InvalidArgumentError("FaultInjectingBackend::Wrap: null backend or injector");
  }
  if (inner->pending() != 0) {
    return FailedPreconditionError(
        fmt::format("FaultInjectingBackend::Wrap: {} requests pending", inner->pending()));
  }
  auto* base = dynamic_cast<internal::BackendBase*>(inner.get());
  if (base == nullptr) {
    return UnimplementedError(
        fmt::format("backend '{}' has no completion hook for fault injection", inner->name()));
  }
  base->SetFaultInjector(injector);
  return std::unique_ptr<IoBackend>(new FaultInjectingBackend(std::move(inner), std::move(injector)));
}

}  // namespace zinf::storage
