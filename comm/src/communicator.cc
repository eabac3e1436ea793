#include "zinf/comm/communicator.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "mpi_util.h"
#include "zinf/comm/mpi_native.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"

namespace zinf::comm {
namespace {

using Clock = std::chrono::steady_clock;

MPI_Comm& Raw(void* handle) { return *static_cast<MPI_Comm*>(handle); }

bool MpiIsFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Tags of the notices on a failure domain's control communicator.
constexpr int kLeaveTag = 1;    // "<agreements> <rejoin or -> <reason>" (Communicator::Leave)
constexpr int kArrivalTag = 2;  // "<agreement index>": the sender waits in that agreement
constexpr std::size_t kNoticeBytes = 1024;

// Ends the job from inside an agreement that cannot complete: the pending MPI request can be
// neither cancelled nor completed, so nothing on this communicator may run again.
[[noreturn]] void EndJob(const std::string& message) {
  LogLine(LogLevel::kError, message + "; ending the job");
  std::fflush(stderr);
  MpiSession::AbortJob(1);
}

// "zinf::engine::ZeroEngine::Step" out of a function signature, for messages.
std::string FunctionName(const std::source_location& loc) {
  std::string_view name = loc.function_name();
  name = name.substr(0, name.find('('));
  if (const std::size_t space = name.rfind(' '); space != std::string_view::npos) {
    name.remove_prefix(space + 1);
  }
  return std::string(name);
}

// A call name as a non-zero tag (FNV-1a, 31 bits).
int CallTag(std::string_view call) {
  std::uint32_t h = 2166136261u;
  for (char c : call) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  h &= 0x7fffffffu;
  return h == 0 ? 1 : static_cast<int>(h);
}

}  // namespace

// The ranks' shared fate for a communicator and its Dup()s: a private control communicator on
// which a rank that leaves tells the others (and a rank that waits long in an agreement says it
// arrived), the count of agreements entered (the same sequence on every rank), and the wait
// timeout.
struct FailureDomain {
  struct Departure {
    int rank = 0;
    std::uint64_t agreements = 0;  // agreements the rank entered before it left
    std::string rejoin;            // the one call it will still make ("" none)
    std::string reason;
  };

  MPI_Comm control = MPI_COMM_NULL;
  MPI_Request notice_request = MPI_REQUEST_NULL;
  std::array<char, kNoticeBytes> notice{};
  std::atomic<std::uint64_t> agreements{0};
  std::atomic<std::int64_t> timeout_ms{
      std::chrono::duration_cast<std::chrono::milliseconds>(kDefaultWaitTimeout).count()};
  std::vector<Departure> departed;  // touched only inside agreements (one thread at a time)
  // Rank -> the latest agreement it announced it waits in (Announce); inside agreements only.
  std::vector<std::optional<std::uint64_t>> arrived;
  // Announcements still being sent: their text lives until every send completed.
  struct Announcement {
    std::string text;
    std::vector<MPI_Request> sends;
  };
  std::vector<std::unique_ptr<Announcement>> announcements;
  // Set alike on every rank when an agreement found the ranks in different calls: their
  // sequences of collectives diverged for good, so every later agreement fails with it at once.
  std::optional<Error> diverged;

  FailureDomain() = default;
  FailureDomain(const FailureDomain&) = delete;
  FailureDomain& operator=(const FailureDomain&) = delete;

  ~FailureDomain() {
    if (MpiIsFinalized()) return;
    for (std::unique_ptr<Announcement>& a : announcements) {
      // A send to a rank that never receives it may never complete: let MPI finish it, and
      // leave its few bytes of text to it.
      for (MPI_Request& send : a->sends) {
        if (send != MPI_REQUEST_NULL) MPI_Request_free(&send);
      }
      (void)a.release();
    }
    if (notice_request == MPI_REQUEST_NULL) return;
    MPI_Cancel(&notice_request);
    MPI_Wait(&notice_request, MPI_STATUS_IGNORE);
    // `control` is never freed: a notice another rank sends after this one let go would stay
    // unreceived, and Open MPI would deliver it into whatever communicator reuses the context id
    // (breaking its message order). A live communicator keeps it harmlessly until MPI_Finalize.
  }

  // `notices`: with the control communicator (Leave); without, departures are not seen, only
  // the timeout bounds a wait (short-lived helper communicators: Split, SplitNode).
  static Result<std::shared_ptr<FailureDomain>> Create(MPI_Comm comm, bool notices) {
    auto domain = std::make_shared<FailureDomain>();
    if (!notices) return domain;
    ZINF_RETURN_IF_ERROR(MpiStatus(MPI_Comm_dup(comm, &domain->control), "MPI_Comm_dup"));
    ZINF_RETURN_IF_ERROR(MpiStatus(MPI_Comm_set_errhandler(domain->control, MPI_ERRORS_RETURN),
                                   "MPI_Comm_set_errhandler"));
    ZINF_RETURN_IF_ERROR(domain->PostReceive());
    return domain;
  }

  Status PostReceive() {
    return MpiStatus(MPI_Irecv(notice.data(), static_cast<int>(notice.size()), MPI_CHAR,
                               MPI_ANY_SOURCE, MPI_ANY_TAG, control, &notice_request),
                     "MPI_Irecv");
  }

  // Takes in the notices that arrived: departures and arrivals.
  void TakeNotices() {
    ReapAnnouncements();
    for (;;) {
      int received = 0;
      MPI_Status status;
      if (notice_request == MPI_REQUEST_NULL ||
          MPI_Test(&notice_request, &received, &status) != MPI_SUCCESS || !received) {
        break;
      }
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      const std::string text(notice.data(), static_cast<std::size_t>(std::max(length, 0)));
      if (!PostReceive()) notice_request = MPI_REQUEST_NULL;
      if (status.MPI_TAG == kArrivalTag) {
        const auto source = static_cast<std::size_t>(status.MPI_SOURCE);
        if (arrived.size() <= source) arrived.resize(source + 1);
        const std::uint64_t index = std::strtoull(text.c_str(), nullptr, 10);
        if (!arrived[source] || *arrived[source] < index) arrived[source] = index;
        continue;
      }
      if (status.MPI_TAG != kLeaveTag) continue;
      Departure d;
      d.rank = status.MPI_SOURCE;
      // "<agreements> <rejoin or -> <reason>" (Communicator::Leave).
      char* end = nullptr;
      d.agreements = std::strtoull(text.c_str(), &end, 10);
      std::string_view rest = end != nullptr && *end == ' ' ? std::string_view(end + 1) : "";
      const std::size_t space = std::min(rest.find(' '), rest.size());
      if (rest.substr(0, space) != "-") d.rejoin = std::string(rest.substr(0, space));
      d.reason = std::string(rest.substr(std::min(space + 1, rest.size())));
      departed.push_back(std::move(d));
    }
  }

  // A departure that makes agreement `index`, named `label`, impossible (the rank left before
  // entering it, and not to make this call), or null.
  const Departure* DepartedBefore(std::uint64_t index, std::string_view label) {
    TakeNotices();
    for (const Departure& d : departed) {
      if (d.agreements <= index && d.rejoin != label) return &d;
    }
    return nullptr;
  }

  // Tells the other ranks of the control communicator (`rank` of `size`) that this rank waits in
  // agreement `index`, so that a rank that times out there can name the ones that never came.
  // Nonblocking; sent only by ranks that waited long (the common path sends nothing).
  void Announce(std::uint64_t index, int rank, int size) {
    if (control == MPI_COMM_NULL || size <= 1) return;
    auto a = std::make_unique<Announcement>();
    a->text = std::to_string(index);
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      MPI_Request send = MPI_REQUEST_NULL;
      if (MPI_Isend(a->text.data(), static_cast<int>(a->text.size()), MPI_CHAR, r, kArrivalTag,
                    control, &send) == MPI_SUCCESS) {
        a->sends.push_back(send);
      }
    }
    announcements.push_back(std::move(a));
  }

  // Frees the announcements whose sends completed.
  void ReapAnnouncements() {
    std::erase_if(announcements, [](std::unique_ptr<Announcement>& a) {
      int done = 0;
      return MPI_Testall(static_cast<int>(a->sends.size()), a->sends.data(), &done,
                         MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
             done != 0;
    });
  }

  // The ranks of `size` other than `rank` that announced no arrival at agreement `index` (or a
  // later one), in order.
  std::vector<int> Absent(std::uint64_t index, int rank, int size) {
    TakeNotices();
    std::vector<int> absent;
    for (int r = 0; r < size; ++r) {
      const auto k = static_cast<std::size_t>(r);
      const bool came = k < arrived.size() && arrived[k] && *arrived[k] >= index;
      if (r != rank && !came) absent.push_back(r);
    }
    return absent;
  }

  // Agreement `label` completed: the ranks that left to make only that call took part in it.
  void Rejoined(std::string_view label) {
    std::erase_if(departed, [label](const Departure& d) { return d.rejoin == label; });
  }
};

namespace {

// Dups `parent` into a new owned handle with MPI_ERRORS_RETURN, in `domain` (null: a new one,
// with a control communicator for departures when `notices`).
Result<Communicator> DupInto(MPI_Comm parent, const char* what,
                             std::shared_ptr<FailureDomain> domain = nullptr,
                             bool notices = false) {
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
  Communicator comm = CommunicatorAccess::Make(owned);
  if (domain == nullptr) {
    ZINF_ASSIGN_OR_RETURN(domain, FailureDomain::Create(*owned, notices));
  }
  CommunicatorAccess::domain(comm) = std::move(domain);
  return comm;
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

Result<Communicator> DupNative(MPI_Comm comm) {
  return DupInto(comm, "MPI_Comm_dup", nullptr, /*notices=*/true);
}

Communicator::~Communicator() { (void)Free(); }

Communicator::Communicator(Communicator&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      domain_(std::move(other.domain_)),
      rank_(other.rank_),
      size_(other.size_),
      topology_(std::move(other.topology_)) {}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    (void)Free();
    handle_ = std::exchange(other.handle_, nullptr);
    domain_ = std::move(other.domain_);
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
  domain_.reset();
  return status;
}

Result<Communicator> Communicator::Dup() const {
  // MPI_Comm_dup waits for every rank: agree first, so that a rank that never comes is bounded.
  ZINF_RETURN_IF_ERROR(Agree(OkStatus(), 0, "Communicator::Dup", std::source_location::current()));
  ZINF_ASSIGN_OR_RETURN(Communicator dup, DupInto(Raw(handle_), "MPI_Comm_dup", domain_));
  dup.topology_ = topology_;
  return dup;
}

Result<Communicator> Communicator::DupDomain() const {
  ZINF_RETURN_IF_ERROR(
      Agree(OkStatus(), 0, "Communicator::DupDomain", std::source_location::current()));
  ZINF_ASSIGN_OR_RETURN(Communicator dup,
                        DupInto(Raw(handle_), "MPI_Comm_dup", nullptr, /*notices=*/true));
  dup.topology_ = topology_;
  dup.SetWaitTimeout(wait_timeout());
  return dup;
}

void Communicator::SetWaitTimeout(std::chrono::milliseconds timeout) {
  ZINF_CHECK(domain_ != nullptr, "SetWaitTimeout on an empty Communicator");
  domain_->timeout_ms.store(std::max<std::int64_t>(timeout.count(), 1));
}

std::chrono::milliseconds Communicator::wait_timeout() const {
  ZINF_CHECK(domain_ != nullptr, "wait_timeout of an empty Communicator");
  return std::chrono::milliseconds(domain_->timeout_ms.load());
}

void Communicator::Leave(std::string_view reason, std::string_view rejoin) const {
  if (domain_ == nullptr || domain_->control == MPI_COMM_NULL || size_ <= 1 ||
      domain_->diverged || MpiIsFinalized()) {
    return;
  }
  // Held until sent; leaked (a few hundred bytes) if a rank does not take it within a second.
  auto* text = new std::string(fmt::format("{} {} {}", domain_->agreements.load(),
                                           rejoin.empty() ? "-" : rejoin, reason));
  if (text->size() > kNoticeBytes) text->resize(kNoticeBytes);
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(text->data(), static_cast<int>(text->size()), MPI_CHAR, r, kLeaveTag,
                  domain_->control, &request) == MPI_SUCCESS) {
      sends.push_back(request);
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  int done = 0;
  while (!done && Clock::now() < deadline) {
    if (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) !=
        MPI_SUCCESS) {
      break;
    }
    if (!done) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (done) {
    delete text;
    return;
  }
  for (MPI_Request& request : sends) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
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
  if (out) out->SetWaitTimeout(wait_timeout());
  return out;
}

Result<Communicator> Communicator::SplitNode() const {
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(OkStatus()));  // bounded: every rank is here
  MPI_Comm split = MPI_COMM_NULL;
  ZINF_RETURN_IF_ERROR(AgreeOnStatus(
      MpiStatus(MPI_Comm_split_type(Raw(handle_), MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL,
                                    &split),
                "MPI_Comm_split_type(SHARED)")));
  Result<Communicator> out = DupInto(split, "MPI_Comm_dup");
  MPI_Comm_free(&split);
  if (out) out->SetWaitTimeout(wait_timeout());
  return out;
}

Status Communicator::AgreeOnStatus(const Status& local, std::source_location loc) const {
  return Agree(local, 0, FunctionName(loc), loc);
}

Status Communicator::AgreeOnCall(std::string_view call, const Status& local,
                                 std::source_location loc) const {
  return Agree(local, CallTag(call), call, loc);
}

namespace {

// Why an agreement timed out, as far as the arrivals announced tell.
std::string WhoDidNotArrive(const std::vector<int>& absent, bool announced) {
  if (!announced) return "a rank failed, stopped or left without a word";
  if (absent.empty()) {
    return "every rank arrived, yet the agreement did not complete: a rank failed while waiting";
  }
  return fmt::format(
      "{} {} did not arrive: failed, stopped, hangs in its own code or left without a word",
      absent.size() == 1 ? "rank" : "ranks", fmt::join(absent, ", "));
}

}  // namespace

Status Communicator::WaitForRanks(void* request, std::string_view what) const {
  FailureDomain& domain = *domain_;
  const std::uint64_t index = domain.agreements.fetch_add(1);
  const auto start = Clock::now();
  const auto timeout = std::chrono::milliseconds(domain.timeout_ms.load());
  // A rank that waited half the timeout says it arrived: by the timeout, the others' word has
  // come, and whoever has not spoken is named.
  const bool announces = domain.control != MPI_COMM_NULL && size_ > 1;
  bool announced = false;
  auto pause = std::chrono::microseconds(0);
  for (std::uint64_t polls = 0;; ++polls) {
    // Departures first: a rank's notice goes out before anything it sends later, so a rank that
    // left and then entered another call (its Close at exit) is named as having left.
    if (const FailureDomain::Departure* gone = domain.DepartedBefore(index, what)) {
      EndJob(fmt::format("{}: rank {} left and will not join this collective: {}", what,
                         gone->rank, gone->reason));
    }
    int done = 0;
    const int rc = MPI_Test(static_cast<MPI_Request*>(request), &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiStatus(rc, fmt::format("{}: MPI_Test", what));
    if (done) {
      domain.TakeNotices();  // who just rejoined
      domain.Rejoined(what);
      return OkStatus();
    }
    if (polls % 64 != 0) continue;
    // Spin for the first milliseconds (a collective's usual wait), then poll ever more slowly,
    // so that a rank waiting for a slow one leaves the cores to it.
    const auto waited = Clock::now() - start;
    if (announces && !announced && waited > timeout / 2) {
      domain.Announce(index, rank_, size_);
      announced = true;
    }
    if (waited > timeout) {
      EndJob(fmt::format(
          "{}: waited {} s for the other ranks (zinf.collective_timeout_seconds); {}", what,
          std::chrono::duration_cast<std::chrono::seconds>(waited).count(),
          WhoDidNotArrive(announces ? domain.Absent(index, rank_, size_) : std::vector<int>{},
                          announces)));
    }
    if (waited > std::chrono::milliseconds(2)) {
      pause = std::clamp(pause * 2, std::chrono::microseconds(20), std::chrono::microseconds(1000));
      std::this_thread::sleep_for(pause);
    }
  }
}

Status Communicator::Agree(const Status& local, int tag, std::string_view label,
                           std::source_location loc) const {
  ZINF_CHECK(handle_ != nullptr, "AgreeOnStatus on an empty Communicator");
  if (domain_->diverged) return *domain_->diverged;
  // One allreduce in the common case: {worst code, -(lowest failing rank), tag, -tag} under MAX;
  // the tags differ when some rank is in another call.
  int flags[4] = {local ? 0 : static_cast<int>(local.error().code()), local ? -size_ : -rank_,
                  tag, -tag};
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, flags, 4, MPI_INT, MPI_MAX, Raw(handle_), &request);
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnStatus: MPI_Iallreduce", loc);
  ZINF_RETURN_IF_ERROR(WaitForRanks(&request, label));
  if (flags[2] != -flags[3]) return CallMismatch(label, loc);
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

Status Communicator::CallMismatch(std::string_view label, std::source_location loc) const {
  // Every rank is in this agreement (the allreduce matched): exchange the labels.
  constexpr std::size_t kLabel = 96;
  std::array<char, kLabel> mine{};
  std::memcpy(mine.data(), label.data(), std::min(label.size(), kLabel - 1));
  std::vector<char> all(kLabel * static_cast<std::size_t>(size_));
  const int rc = MPI_Allgather(mine.data(), static_cast<int>(kLabel), MPI_CHAR, all.data(),
                               static_cast<int>(kLabel), MPI_CHAR, Raw(handle_));
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "AgreeOnCall: MPI_Allgather", loc);
  std::string where;
  for (int r = 0; r < size_; ++r) {
    const char* text = all.data() + kLabel * static_cast<std::size_t>(r);
    where += fmt::format("{}rank {} in {}", r == 0 ? "" : ", ", r,
                         std::string_view(text, strnlen(text, kLabel)));
  }
  Error error(ErrorCode::kFailedPrecondition,
              fmt::format("the ranks are in different calls ({}): every rank must make the same "
                          "collective calls in the same order",
                          where),
              0, loc);
  domain_->diverged = error;
  return error;
}

bool Communicator::diverged() const { return domain_ != nullptr && domain_->diverged.has_value(); }

template <typename F>
Status Communicator::Collective(const Status& local_check, const char* what, F&& mpi_call) const {
  ZINF_CHECK(handle_ != nullptr, "{} on an empty Communicator", what);
  const auto here = std::source_location::current();
  ZINF_RETURN_IF_ERROR(Agree(local_check, 0, what, here));
  return Agree(MpiStatus(mpi_call(), what), 0, what, here);
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

namespace {

// ReduceScatter's checks (the same for both forms); fills `recv_counts` on success.
Status ReduceScatterChecks(std::size_t in_size, std::size_t out_size,
                           std::span<const std::int64_t> counts, int rank, int size,
                           std::vector<int>* recv_counts) {
  recv_counts->assign(static_cast<std::size_t>(size), 0);
  if (counts.size() != static_cast<std::size_t>(size)) {
    return InvalidArgumentError(
        fmt::format("ReduceScatter: {} counts for {} ranks", counts.size(), size));
  }
  std::uint64_t total = 0;
  for (int r = 0; r < size; ++r) {
    if (counts[r] < 0) {
      return InvalidArgumentError(
          fmt::format("ReduceScatter: count of rank {} is {}", r, counts[r]));
    }
    total += static_cast<std::uint64_t>(counts[r]);
    ZINF_RETURN_IF_ERROR(CountFitsInt(total, "ReduceScatter"));
    (*recv_counts)[r] = static_cast<int>(counts[r]);
  }
  ZINF_RETURN_IF_ERROR(SizeMatches(in_size, total, "ReduceScatter", "in"));
  return SizeMatches(out_size, static_cast<std::uint64_t>(counts[rank]), "ReduceScatter", "out");
}

}  // namespace

template <typename T>
Status Communicator::ReduceScatter(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                                   std::span<const std::int64_t> counts, ReduceOp op) const {
  std::vector<int> recv_counts;
  const Status check =
      ReduceScatterChecks(in.size(), out.size(), counts, rank_, size_, &recv_counts);
  return Collective(check, "MPI_Reduce_scatter", [&] {
    return MPI_Reduce_scatter(in.data(), out.data(), recv_counts.data(), MpiType<T>(), MpiOp(op),
                              Raw(handle_));
  });
}

template <typename T>
Status Communicator::ReduceScatterSum(std::span<const std::type_identity_t<T>> in,
                                      std::span<T> out, std::span<const std::int64_t> counts,
                                      std::span<T> scratch) const {
  const auto n = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  std::vector<int> block_counts;
  Status check = ReduceScatterChecks(in.size(), out.size(), counts, rank_, size_, &block_counts);
  const std::size_t mine = check ? static_cast<std::size_t>(counts[me]) : 0;
  const std::size_t need = n > 1 ? mine : 0;
  if (check && scratch.size() < need) {
    check = InvalidArgumentError(
        fmt::format("ReduceScatterSum: scratch has {} elements, needs {}", scratch.size(), need));
  }
  std::vector<std::size_t> offsets(n, 0);  // of each block in `in`
  for (std::size_t q = 1; check && q < n; ++q) offsets[q] = offsets[q - 1] + block_counts[q - 1];
  // The data communicator carries no other point-to-point messages (notices go over the
  // failure domain's own), and round k pairs each rank with one sender only: one tag suffices.
  constexpr int kTag = 0x5253;
  return Collective(check, "ReduceScatterSum (MPI_Isend/MPI_Irecv)", [&] {
    std::copy_n(in.data() + offsets[me], mine, out.data());
    for (std::size_t k = 1; k < n; ++k) {
      const std::size_t to = (me + k) % n, from = (me + n - k) % n;
      std::array<MPI_Request, 2> requests = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
      int rc = MPI_Irecv(scratch.data(), static_cast<int>(mine), MpiType<T>(),
                         static_cast<int>(from), kTag, Raw(handle_), &requests[0]);
      if (rc == MPI_SUCCESS) {
        rc = MPI_Isend(in.data() + offsets[to], block_counts[to], MpiType<T>(),
                       static_cast<int>(to), kTag, Raw(handle_), &requests[1]);
      }
      const int waited = MPI_Waitall(2, requests.data(), MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS || waited != MPI_SUCCESS) return rc != MPI_SUCCESS ? rc : waited;
      for (std::size_t i = 0; i < mine; ++i) out[i] += scratch[i];
    }
    return MPI_SUCCESS;
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
                                                 std::span<const std::int64_t>, ReduceOp) const;  \
  template Status Communicator::ReduceScatterSum<T>(std::span<const T>, std::span<T>,             \
                                                    std::span<const std::int64_t>, std::span<T>)  \
      const;
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
