#include "zinf/comm/timers.h"

#include <algorithm>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "zinf/core/check.h"
#include "zinf/core/log.h"

namespace zinf::comm {

using Clock = std::chrono::steady_clock;

void Timers::Start(std::string_view name) {
  std::lock_guard lock(mu_);
  auto it = timers_.find(name);
  if (it == timers_.end()) it = timers_.emplace(std::string(name), Timer{}).first;
  ZINF_CHECK(!it->second.running, "timer '{}' started twice", name);
  it->second.running = true;
  it->second.started = Clock::now();
}

void Timers::Stop(std::string_view name) {
  std::lock_guard lock(mu_);
  auto it = timers_.find(name);
  ZINF_CHECK(it != timers_.end() && it->second.running, "timer '{}' stopped but not running", name);
  it->second.seconds += std::chrono::duration<double>(Clock::now() - it->second.started).count();
  it->second.count += 1;
  it->second.running = false;
}

double Timers::Elapsed(std::string_view name) const {
  std::lock_guard lock(mu_);
  auto it = timers_.find(name);
  if (it == timers_.end()) return 0;
  double seconds = it->second.seconds;
  if (it->second.running) {
    seconds += std::chrono::duration<double>(Clock::now() - it->second.started).count();
  }
  return seconds;
}

std::int64_t Timers::Count(std::string_view name) const {
  std::lock_guard lock(mu_);
  auto it = timers_.find(name);
  return it == timers_.end() ? 0 : it->second.count;
}

void Timers::Reset() {
  std::lock_guard lock(mu_);
  timers_.clear();
}

std::vector<std::string> Timers::Names() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> names;
  for (const auto& [name, timer] : timers_) names.push_back(name);
  return names;
}

Result<std::vector<TimerStats>> Timers::Reduce(const Communicator& comm) const {
  // Union of the names over ranks: gather every rank's '\n'-joined list.
  std::string mine;
  for (const std::string& name : Names()) mine += name + "\n";
  std::int64_t my_length = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(comm.size()));
  ZINF_RETURN_IF_ERROR(comm.Allgather<std::int64_t>(std::span(&my_length, 1), lengths));
  std::int64_t total = 0;
  for (std::int64_t l : lengths) total += l;
  std::string all(static_cast<std::size_t>(total), '\0');
  ZINF_RETURN_IF_ERROR(comm.Allgatherv<char>(mine, all, lengths));
  std::set<std::string> names;
  for (std::size_t begin = 0; begin < all.size();) {
    std::size_t end = all.find('\n', begin);
    names.insert(all.substr(begin, end - begin));
    begin = end + 1;
  }

  // Per name: min (+inf where unused), max (-inf where unused), sum, count, ranks.
  const std::size_t n = names.size();
  std::vector<double> mins(n), maxs(n), sums(n);
  std::vector<std::int64_t> counts(n), ranks(n);
  std::size_t i = 0;
  for (const std::string& name : names) {
    std::int64_t count = Count(name);
    bool used = count > 0 || Elapsed(name) > 0;
    double seconds = Elapsed(name);
    mins[i] = used ? seconds : std::numeric_limits<double>::infinity();
    maxs[i] = used ? seconds : -std::numeric_limits<double>::infinity();
    sums[i] = used ? seconds : 0;
    counts[i] = count;
    ranks[i] = used ? 1 : 0;
    ++i;
  }
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<double>(mins, ReduceOp::kMin));
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<double>(maxs, ReduceOp::kMax));
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<double>(sums, ReduceOp::kSum));
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<std::int64_t>(counts, ReduceOp::kSum));
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<std::int64_t>(ranks, ReduceOp::kSum));

  std::vector<TimerStats> stats;
  i = 0;
  for (const std::string& name : names) {
    TimerStats s;
    s.name = name;
    s.ranks = static_cast<int>(ranks[i]);
    s.count = counts[i];
    if (s.ranks > 0) {
      s.min_seconds = mins[i];
      s.max_seconds = maxs[i];
      s.mean_seconds = sums[i] / s.ranks;
    }
    stats.push_back(std::move(s));
    ++i;
  }
  return stats;
}

std::string Timers::FormatTable(const std::vector<TimerStats>& stats) {
  std::size_t width = 5;
  for (const TimerStats& s : stats) width = std::max(width, s.name.size());
  std::string out = fmt::format("{:<{}}  {:>10}  {:>10}  {:>10}  {:>8}  {:>5}\n", "timer", width,
                                "min(s)", "mean(s)", "max(s)", "count", "ranks");
  for (const TimerStats& s : stats) {
    out += fmt::format("{:<{}}  {:>10.4f}  {:>10.4f}  {:>10.4f}  {:>8}  {:>5}\n", s.name, width,
                       s.min_seconds, s.mean_seconds, s.max_seconds, s.count, s.ranks);
  }
  return out;
}

Status Timers::LogSummary(const Communicator& comm, std::string_view title) const {
  ZINF_ASSIGN_OR_RETURN(std::vector<TimerStats> stats, Reduce(comm));
  if (comm.rank() == 0 && !stats.empty()) {
    ZINF_LOG_INFO("{} over {} ranks:\n{}", title, comm.size(), FormatTable(stats));
  }
  return OkStatus();
}

}  // namespace zinf::comm
