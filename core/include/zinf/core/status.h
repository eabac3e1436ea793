// zinf::Error, zinf::Status and zinf::Result<T>: the error vocabulary of every zinf API.
//
// Library functions return Status (success or an Error) or Result<T> (a T or an Error); no
// exception crosses a module API. An Error carries a code, the errno that caused it (0 if none),
// a human-readable message and the source location where it was made.
//
//   zinf::Result<int> ParseCount(std::string_view s);
//   zinf::Status Run() {
//     ZINF_ASSIGN_OR_RETURN(int n, ParseCount("12"));
//     ZINF_RETURN_IF_ERROR(DoWork(n));
//     return zinf::OkStatus();
//   }
//
// Thread safety: all types here are values; distinct objects may be used from distinct threads.
#pragma once

#include <array>
#include <cstdint>
#include <expected>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>

namespace zinf {

// Error codes, ordered by severity: when ranks disagree, the highest code wins (see
// comm::AgreeOnStatus). kOk is never stored in an Error.
//
// The one table of them, X(Name, value). The enum (ErrorCode::kName), kErrorCodes,
// ErrorCodeName ("Name") and the factories (NameError(message)) are all made from it.
#define ZINF_ERROR_CODES(X)                                                                    \
  X(Unavailable, 1)        /* transient: EAGAIN, EINTR, a busy resource; retrying may work */  \
  X(NotFound, 2)           /* a file, key or dataset does not exist */                         \
  X(AlreadyExists, 3)      /* something to be created exists already */                        \
  X(InvalidArgument, 4)    /* the caller passed a bad value (config, flag, argument) */        \
  X(FailedPrecondition, 5) /* the system is not in the state the call needs (permissions) */   \
  X(ResourceExhausted, 6)  /* out of space, memory, buffers, file descriptors */               \
  X(Unimplemented, 7)      /* not supported here (kernel feature, build option) */             \
  X(Aborted, 8)            /* the operation was cancelled, e.g. because another rank failed */ \
  X(DataLoss, 9)           /* I/O error, checksum mismatch, truncated or corrupted data */     \
  X(Internal, 10)          /* a broken invariant or an unexpected library failure */

enum class ErrorCode : int {
  kOk = 0,
#define ZINF_ERROR_CODE_ENUM(name, value) k##name = value,
  ZINF_ERROR_CODES(ZINF_ERROR_CODE_ENUM)
#undef ZINF_ERROR_CODE_ENUM
};

// Every error code (kOk excluded), in order: the list zinf's Python exceptions are checked
// against (python/zinf/errors.py).
inline constexpr std::array kErrorCodes = {
#define ZINF_ERROR_CODE_ITEM(name, value) ErrorCode::k##name,
    ZINF_ERROR_CODES(ZINF_ERROR_CODE_ITEM)
#undef ZINF_ERROR_CODE_ITEM
};
static_assert(static_cast<std::size_t>(kErrorCodes.back()) == kErrorCodes.size(),
              "error codes are numbered 1..N in order");

// "InvalidArgument", "DataLoss", ...; "Ok" for kOk; "Unknown" for anything else.
std::string_view ErrorCodeName(ErrorCode code);
// The code ErrorCodeName names `name` (kOk excluded); nullopt for any other text.
std::optional<ErrorCode> ErrorCodeNamed(std::string_view name);

// Maps an errno value to the code that best describes it (ENOENT -> kNotFound, ENOSPC ->
// kResourceExhausted, EIO -> kDataLoss, EAGAIN -> kUnavailable, ...). Unknown values -> kInternal.
ErrorCode ErrorCodeFromErrno(int err);

class Error {
 public:
  Error(ErrorCode code, std::string message, int sys_errno = 0,
        std::source_location location = std::source_location::current());

  ErrorCode code() const { return code_; }
  int sys_errno() const { return sys_errno_; }
  const std::string& message() const { return message_; }
  const std::source_location& location() const { return location_; }

  // Returns this error with `context` put in front of the message ("swap-in sub-group 3: " +
  // message). Code, errno and location are kept: the location stays where the error was born.
  Error WithContext(std::string_view context) &&;
  Error WithContext(std::string_view context) const&;

  // "DataLoss: pread /x offset 4096: Input/output error (errno 5) [io_backend.cc:120]"
  std::string ToString() const;

 private:
  ErrorCode code_;
  int sys_errno_;
  std::string message_;
  std::source_location location_;
};

// Result<T> is std::expected<T, Error> that must not be ignored. It also converts from an Error,
// so a function can `return InvalidArgumentError("...")`.
template <typename T>
class [[nodiscard]] Result : public std::expected<T, Error> {
 public:
  using Base = std::expected<T, Error>;
  using Base::Base;
  Result(const Base& b) : Base(b) {}
  Result(Base&& b) : Base(std::move(b)) {}
  Result(const Error& e) : Base(std::unexpect, e) {}
  Result(Error&& e) : Base(std::unexpect, std::move(e)) {}
};

using Status = Result<void>;

inline Status OkStatus() { return Status(); }

// Factories, one per code: UnavailableError(message), ..., InternalError(message). The location
// defaults to the caller's line.
#define ZINF_ERROR_CODE_FACTORY(name, value) \
  Error name##Error(std::string message,     \
                    std::source_location loc = std::source_location::current());
ZINF_ERROR_CODES(ZINF_ERROR_CODE_FACTORY)
#undef ZINF_ERROR_CODE_FACTORY

// An error for a failed system call: code from ErrorCodeFromErrno(err), message
// "<what>: <strerror(err)> (errno <err>)".
Error ErrnoError(int err, std::string_view what,
                 std::source_location loc = std::source_location::current());

// Prefixes the error of a failed result with `context`; success passes through unchanged.
template <typename T>
Result<T> Annotate(Result<T> result, std::string_view context) {
  if (result) return result;
  return std::move(result).error().WithContext(context);
}

}  // namespace zinf

#define ZINF_STATUS_CONCAT_INNER_(a, b) a##b
#define ZINF_STATUS_CONCAT_(a, b) ZINF_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (a Status or Result<T>); on failure returns its Error from the enclosing
// function, which must return a Status or Result<U>.
#define ZINF_RETURN_IF_ERROR(expr)                              \
  do {                                                          \
    auto&& zinf_status_or_ = (expr);                            \
    if (!zinf_status_or_.has_value()) [[unlikely]] {            \
      return ::zinf::Error(std::move(zinf_status_or_).error()); \
    }                                                           \
  } while (false)

// Evaluates `expr` (a Result<T>); on failure returns its Error, otherwise moves the value into
// `lhs`, which may be a declaration (`ZINF_ASSIGN_OR_RETURN(auto fd, OpenFile(p))`).
#define ZINF_ASSIGN_OR_RETURN(lhs, expr) \
  ZINF_ASSIGN_OR_RETURN_IMPL_(ZINF_STATUS_CONCAT_(zinf_result_, __COUNTER__), lhs, expr)
#define ZINF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.has_value()) [[unlikely]] {              \
    return ::zinf::Error(std::move(tmp).error());   \
  }                                                 \
  lhs = std::move(*tmp)
