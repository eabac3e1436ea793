#include "zinf/core/status.h"

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace zinf {

std::string_view ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "Ok";
#define ZINF_ERROR_CODE_CASE(name, value) \
  case ErrorCode::k##name:                \
    return #name;
      ZINF_ERROR_CODES(ZINF_ERROR_CODE_CASE)
#undef ZINF_ERROR_CODE_CASE
  }
  return "Unknown";
}

std::optional<ErrorCode> ErrorCodeNamed(std::string_view name) {
  for (ErrorCode code : kErrorCodes) {
    if (ErrorCodeName(code) == name) return code;
  }
  return std::nullopt;
}

ErrorCode ErrorCodeFromErrno(int err) {
  switch (err) {
    case 0:
      return ErrorCode::kOk;
    case EAGAIN:
    case EINTR:
    case EBUSY:
    case ETIMEDOUT:
    case ECONNREFUSED:
    case ECONNRESET:
      return ErrorCode::kUnavailable;
    case ENOENT:
    case ENXIO:
    case ENODEV:
      return ErrorCode::kNotFound;
    case EEXIST:
    case ENOTEMPTY:
      return ErrorCode::kAlreadyExists;
    case EINVAL:
    case ENAMETOOLONG:
    case EDOM:
    case ERANGE:
    case E2BIG:
    case EOVERFLOW:
      return ErrorCode::kInvalidArgument;
    case EACCES:
    case EPERM:
    case ELOOP:
    case ENOTDIR:
    case EISDIR:
    case EROFS:
    case ETXTBSY:
      return ErrorCode::kFailedPrecondition;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return ErrorCode::kResourceExhausted;
    case ENOSYS:
    case EOPNOTSUPP:
    case EPROTONOSUPPORT:
      return ErrorCode::kUnimplemented;
    case ECANCELED:
      return ErrorCode::kAborted;
    case EIO:
    case EBADMSG:
    case ENODATA:
      return ErrorCode::kDataLoss;
    default:
      return ErrorCode::kInternal;
  }
}

Error::Error(ErrorCode code, std::string message, int sys_errno, std::source_location location)
    : code_(code == ErrorCode::kOk ? ErrorCode::kInternal : code),
      sys_errno_(sys_errno),
      message_(std::move(message)),
      location_(location) {}

Error Error::WithContext(std::string_view context) && {
  message_.insert(0, context);
  return std::move(*this);
}

Error Error::WithContext(std::string_view context) const& {
  Error copy = *this;
  return std::move(copy).WithContext(context);
}

std::string Error::ToString() const {
  std::string_view file = location_.file_name();
  if (auto slash = file.rfind('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return fmt::format("{}: {} [{}:{}]", ErrorCodeName(code_), message_, file, location_.line());
}

#define ZINF_ERROR_CODE_FACTORY(name, value)                         \
  Error name##Error(std::string message, std::source_location loc) { \
    return Error(ErrorCode::k##name, std::move(message), 0, loc);    \
  }
ZINF_ERROR_CODES(ZINF_ERROR_CODE_FACTORY)
#undef ZINF_ERROR_CODE_FACTORY

Error ErrnoError(int err, std::string_view what, std::source_location loc) {
  char buf[256];
  // GNU strerror_r returns the message, which may or may not be in buf.
  const char* text = strerror_r(err, buf, sizeof buf);
  return Error(ErrorCodeFromErrno(err), fmt::format("{}: {} (errno {})", what, text, err), err,
               loc);
}

}  // namespace zinf
