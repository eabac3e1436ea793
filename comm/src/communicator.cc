#include "zinf/comm/communicator.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "mpi_util.h"
#include "zinf/comm/mpi_native.h"
#include "zinf/core/check.h"

namespace zinf::comm {
namespace {

MPI_Comm& Raw(void* handle) { return *static_cast<MPI_Comm*>(handle); }

bool MpiIsFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Dups `parent` into a new owned handle with MPI_ERRORS_RETURN.
Result<Communicator> DupInto(MPI_Comm parent, const char* what) {
  auto* owned = new MPI_Comm(MPI_COMM_NULL);
  int rc = MPI_Comm_dup(parent, owned);
  if (rc != MPI_SUCCESS) {
    delete owned;
    return MpiStatus(rc, what).error();
  }
  rc = MPI_Comm_set_errhandler(*owned, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(owned);
    delete owned;
    return MpiStatus(rc, "MPI_Comm_set_errhandler").error();
  }
  return CommunicatorAccess::Make(owned);
}

Status ValidRoot(int root, int size, const char* what) {
  if (root < 0 || root >= size) {
    return InvalidArgumentError(fmt::format("{}: root {} is not a rank of this communicator of {} "
                                            "ranks",
                                            what, root, size));
  }
  return OkStatus();
}

Status SizeMatches(std::size_t got, std::uint64_t want, const char* what, const char* which) {
  if (got != want) {
    return InvalidArgumentError(
        fmt::format("{}: {} has {} elements, expected {}", what, which, got, want));
  }
  return OkStatus();
}

Status CountFitsInt(std::uint64_t count, const char* what) {
  if (count > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    return InvalidArgumentError(
        fmt::format("{}: {} elements exceed MPI's int count; split the buffer", what, count));
  }
  return OkStatus();
}

}  // namespace

MPI_Comm NativeComm(const Communicator& comm) {
  ZINF_CHECK(comm.native_handle() != nullptr, "NativeComm of an empty Communicator");
  return Raw(comm.native_handle());
}

Status MpiStatus(int mpi_result, std::string_view what, std::source_location loc) {
  if (mpi_result == MPI_SUCCESS) return OkStatus();
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int length = 0;
  if (MPI_Error_string(mpi_result, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof text, "unknown MPI error");
  }
  int error_class = mpi_result;
  MPI_Error_class(mpi_result, &error_class);
  ErrorCode code = ErrorCode::kInternal;
  switch (error_class) {
    case MPI_ERR_ARG:
    case MPI_ERR_COUNT:
    case MPI_ERR_ROOT:
    case MPI_ERR_RANK:
    case MPI_ERR_TYPE:
    case MPI_ERR_OP:
    case MPI_ERR_BUFFER:
    case MPI_ERR_COMM:
    case MPI_ERR_TAG:
      code = ErrorCode::kInvalidArgument;
      break;
    case MPI_ERR_NO_MEM:
      code = ErrorCode::kResourceExhausted;
      break;
    case MPI_ERR_IO:
    case MPI_ERR_FILE:
      code = ErrorCode::kDataLoss;
      break;
    default:
      break;
  }
  return Error(code, fmt::format("{}: {} (MPI error class {})", what, text, error_class), 0, loc);
}

Result<Communicator> DupNative(MPI_Comm comm) { return DupInto(comm, "MPI_Comm_dup"); }

Communicator::~Communicator() { (void)Free(); }

Communicator::Communicator(Communicator&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      rank_(other.rank_),
      size_(other.size_),
      topology_(std::move(other.topology_)) {}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    (void)Free();
    handle_ = std::exchange(other.handle_, nullptr);
    rank_ = other.rank_;
    size_ = other.size_;
    topology_ = std::move(other.topology_);
  }
  return *this;
}

Status Communicator::Free() {
  if (handle_ == nullptr) return OkStatus();
  auto* comm = static_cast<MPI_Comm*>(handle_);
  handle_ = nullptr;
  Status status = OkStatus();
  // After MPI_Finalize the communicator is gone with MPI; freeing it then would be an error.
  if (*comm != MPI_COMM_NULL && !MpiIsFinalized()) status = MpiStatus(MPI_Comm_free(comm), "MPI_Comm_free");
  delete comm;
  return status;
}

Result<Communicator> Communicator::Dup() const {
  ZINF_ASSIGN_OR_RETURN(Communicator dup, DupInto(Raw(handle_), "MPI_Comm_dup"));
  dup.topology_ = topology_;
  return dup;
}

Result<Communicator> Communicator::Split(int color, int key) const {
  Status check = color >= 0 ? OkStatus()
                            : Status(InvalidArgumentError(
                                  fmt::format("Split: color {} must be >= 0", color)));
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(check));
  MPI_Comm split = MPI_COMM_NULL;
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(MpiStatus(MPI_Comm_split(Raw(handle_), color, key, &split),
                                               "MPI_Comm_split")));
  Result<Communicator> out = DupInto(split, "MPI_Comm_dup");
  MPI_Comm_free(&split);
  return out;
}

Result<Communicator> Communicator::SplitNode() const {
  MPI_Comm split = MPI_COMM_NULL;
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(
      MpiStatus(MPI_Comm_split_type(Raw(handle_), MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL,
                                    &split),
                "MPI_Comm_split_type(SHARED)")));
  Result<Communicator> out = DupInto(split, "MPI_Comm_dup");
  MPI_Comm_free(&split);
  return out;
}

Status Communicator::AgreeOnStatus(const Status& local, std::source_location loc) const {
  ZINF_CHECK(handle_ != nullptr, "AgreeOnStatus on an empty Communicator");
  // One allreduce in the common case: {worst code, -(lowest failing rank)} under MAX.
  int flags[2] = {local ? 0 : static_cast<int>(local.error().code()), local ? -size_ : -rank_};
  int rc = MPI_Allreduce(MPI_IN_PLACE, flags, 2, MPI_INT, MPI_MAX, Raw(handle_));
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnStatus: MPI_Allreduce", loc);
  if (flags[0] == 0) return OkStatus();

  const int first = -flags[1];
  int failed = local ? 0 : 1;
  rc = MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, Raw(handle_));
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnStatus: MPI_Allreduce", loc);

  // The first failing rank sends its errno and message.
  std::string message;
  int header[2] = {0, 0};  // errno, message length
  if (rank_ == first) {
    message = local.error().message();
    header[0] = local.error().sys_errno();
    header[1] = static_cast<int>(message.size());
  }
  rc = MPI_Bcast(header, 2, MPI_INT, first, Raw(handle_));
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnStatus: MPI_Bcast", loc);
  message.resize(static_cast<std::size_t>(header[1]));
  rc = MPI_Bcast(message.data(), header[1], MPI_CHAR, first, Raw(handle_));
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnStatus: MPI_Bcast", loc);

  std::string text = fmt::format("rank {}: {}", first, message);
  if (failed > 1) text += fmt::format(" (and {} more rank{} failed)", failed - 1, failed > 2 ? "s" : "");
  const auto code = static_cast<ErrorCode>(flags[0]);
  return Error(code, std::move(text), header[0], rank_ == first ? local.error().location() : loc);
}

template <typename F>
Status Communicator::Collective(const Status& local_check, const char* what, F&& mpi_call) const {
  ZINF_CHECK(handle_ != nullptr, "{} on an empty Communicator", what);
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(local_check));
  return AgreeOnStatus(MpiStatus(mpi_call(), what));
}

Status Communicator::Barrier() const {
  return Collective(OkStatus(), "MPI_Barrier", [&] { return MPI_Barrier(Raw(handle_)); });
}

template <typename T>
Status Communicator::Broadcast(std::span<T> data, int root) const {
  Status check = ValidRoot(root, size_, "Broadcast");
  if (check) check = CountFitsInt(data.size(), "Broadcast");
  return Collective(check, "MPI_Bcast", [&] {
    return MPI_Bcast(data.data(), static_cast<int>(data.size()), MpiType<std::remove_const_t<T>>(),
                     root, Raw(handle_));
  });
}

Status Communicator::BroadcastString(std::string* text, int root) const {
  std::int64_t length = static_cast<std::int64_t>(text->size());
  ZINF_RETURN_IF_ERROR(Broadcast(std::span<std::int64_t>(&length, 1), root));
  text->resize(static_cast<std::size_t>(length));
  return Broadcast(std::span<char>(text->data(), text->size()), root);
}

template <typename T>
Status Communicator::Allreduce(std::span<const std::type_identity_t<T>> in, std::span<T> out, ReduceOp op) const {
  Status check = SizeMatches(out.size(), in.size(), "Allreduce", "out");
  if (check) check = CountFitsInt(in.size(), "Allreduce");
  const bool in_place = static_cast<const void*>(in.data()) == static_cast<const void*>(out.data());
  return Collective(check, "MPI_Allreduce", [&] {
    return MPI_Allreduce(in_place ? MPI_IN_PLACE : in.data(), out.data(),
                         static_cast<int>(out.size()), MpiType<T>(), MpiOp(op), Raw(handle_));
  });
}

template <typename T>
Status Communicator::Allgather(std::span<const std::type_identity_t<T>> in, std::span<T> out) const {
  Status check = SizeMatches(out.size(), in.size() * static_cast<std::uint64_t>(size_), "Allgather",
                             "out");
  if (check) check = CountFitsInt(out.size(), "Allgather");
  return Collective(check, "MPI_Allgather", [&] {
    return MPI_Allgather(in.data(), static_cast<int>(in.size()), MpiType<T>(), out.data(),
                         static_cast<int>(in.size()), MpiType<T>(), Raw(handle_));
  });
}

template <typename T>
Status Communicator::Allgatherv(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                std::span<const std::int64_t> counts) const {
  Status check = OkStatus();
  std::vector<int> recv_counts(static_cast<std::size_t>(size_));
  std::vector<int> displs(static_cast<std::size_t>(size_));
  if (counts.size() != static_cast<std::size_t>(size_)) {
    check = InvalidArgumentError(fmt::format("Allgatherv: {} counts for {} ranks", counts.size(), size_));
  } else {
    std::uint64_t total = 0;
    for (int r = 0; r < size_ && check; ++r) {
      if (counts[r] < 0) {
        check = InvalidArgumentError(fmt::format("Allgatherv: count of rank {} is {}", r, counts[r]));
        break;
      }
      check = CountFitsInt(total + static_cast<std::uint64_t>(counts[r]), "Allgatherv");
      recv_counts[r] = static_cast<int>(counts[r]);
      displs[r] = static_cast<int>(total);
      total += static_cast<std::uint64_t>(counts[r]);
    }
    if (check) check = SizeMatches(in.size(), static_cast<std::uint64_t>(counts[rank_]), "Allgatherv", "in");
    if (check) check = SizeMatches(out.size(), total, "Allgatherv", "out");
  }
  return Collective(check, "MPI_Allgatherv", [&] {
    return MPI_Allgatherv(in.data(), static_cast<int>(in.size()), MpiType<T>(), out.data(),
                          recv_counts.data(), displs.data(), MpiType<T>(), Raw(handle_));
  });
}

template <typename T>
Status Communicator::ReduceScatterBlock(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                        ReduceOp op) const {
  Status check = SizeMatches(in.size(), out.size() * static_cast<std::uint64_t>(size_),
                             "ReduceScatterBlock", "in");
  if (check) check = CountFitsInt(in.size(), "ReduceScatterBlock");
  return Collective(check, "MPI_Reduce_scatter_block", [&] {
    return MPI_Reduce_scatter_block(in.data(), out.data(), static_cast<int>(out.size()),
                                    MpiType<T>(), MpiOp(op), Raw(handle_));
  });
}

template <typename T>
Status Communicator::ReduceScatter(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                   std::span<const std::int64_t> counts, ReduceOp op) const {
  Status check = OkStatus();
  std::vector<int> recv_counts(static_cast<std::size_t>(size_));
  if (counts.size() != static_cast<std::size_t>(size_)) {
    check = InvalidArgumentError(
        fmt::format("ReduceScatter: {} counts for {} ranks", counts.size(), size_));
  } else {
    std::uint64_t total = 0;
    for (int r = 0; r < size_ && check; ++r) {
      if (counts[r] < 0) {
        check = InvalidArgumentError(
            fmt::format("ReduceScatter: count of rank {} is {}", r, counts[r]));
        break;
      }
      total += static_cast<std::uint64_t>(counts[r]);
      check = CountFitsInt(total, "ReduceScatter");
      recv_counts[r] = static_cast<int>(counts[r]);
    }
    if (check) check = SizeMatches(in.size(), total, "ReduceScatter", "in");
    if (check) {
      check = SizeMatches(out.size(), static_cast<std::uint64_t>(counts[rank_]), "ReduceScatter",
                          "out");
    }
  }
  return Collective(check, "MPI_Reduce_scatter", [&] {
    return MPI_Reduce_scatter(in.data(), out.data(), recv_counts.data(), MpiType<T>(), MpiOp(op),
                              Raw(handle_));
  });
}

#define ZINF_INSTANTIATE_NUMERIC(T)                                                               \
  template Status Communicator::Broadcast<T>(std::span<T>, int) const;                            \
  template Status Communicator::Allreduce<T>(std::span<const T>, std::span<T>, ReduceOp) const;   \
  template Status Communicator::Allgather<T>(std::span<const T>, std::span<T>) const;             \
  template Status Communicator::Allgatherv<T>(std::span<const T>, std::span<T>,                   \
                                              std::span<const std::int64_t>) const;               \
  template Status Communicator::ReduceScatterBlock<T>(std::span<const T>, std::span<T>, ReduceOp) \
      const;                                                                                      \
  template Status Communicator::ReduceScatter<T>(std::span<const T>, std::span<T>,                \
                                                 std::span<const std::int64_t>, ReduceOp) const;
ZINF_INSTANTIATE_NUMERIC(std::int32_t)
ZINF_INSTANTIATE_NUMERIC(std::int64_t)
ZINF_INSTANTIATE_NUMERIC(std::uint64_t)
ZINF_INSTANTIATE_NUMERIC(float)
ZINF_INSTANTIATE_NUMERIC(double)
#undef ZINF_INSTANTIATE_NUMERIC
template Status Communicator::Broadcast<std::byte>(std::span<std::byte>, int) const;
template Status Communicator::Broadcast<char>(std::span<char>, int) const;
template Status Communicator::Allgather<std::byte>(std::span<const std::byte>, std::span<std::byte>) const;
template Status Communicator::Allgather<char>(std::span<const char>, std::span<char>) const;
template Status Communicator::Allgatherv<std::byte>(std::span<const std::byte>, std::span<std::byte>,
                                                    std::span<const std::int64_t>) const;
template Status Communicator::Allgatherv<char>(std::span<const char>, std::span<char>,
                                               std::span<const std::int64_t>) const;

}  // namespace zinf::comm
