// Timers: named wall-clock timers, the C++ counterpart of DeepSpeed's SynchronizedWallClockTimer
// as the optimizer swapper uses it ("swap_in_param", "swap_out_param", ...).
//
//   Timers timers;
//   timers.Start("swap_in_param");  ...  timers.Stop("swap_in_param");
//   ZINF_RETURN_IF_ERROR(timers.LogSummary(world));   // rank 0 prints one aligned table
//
// A timer accumulates the time of every Start/Stop interval and counts them. Reduce() is
// collective over `comm` and tolerates ranks that used different timer names (a name a rank never
// used does not count in that name's min/mean/max).
//
// Thread safety: Start/Stop/Elapsed may be called from several threads (a mutex guards the map).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::comm {

struct TimerStats {
  std::string name;
  double min_seconds = 0;   // over the ranks that used the timer
  double mean_seconds = 0;
  double max_seconds = 0;
  std::int64_t count = 0;   // Start/Stop intervals, summed over ranks
  int ranks = 0;            // ranks that used the timer
};

class Timers {
 public:
  // Starting a running timer or stopping a stopped one is a programmer error (checked).
  void Start(std::string_view name);
  void Stop(std::string_view name);
  // Accumulated seconds (including the running interval, if any); 0 for an unknown name.
  double Elapsed(std::string_view name) const;
  std::int64_t Count(std::string_view name) const;
  void Reset();
  std::vector<std::string> Names() const;

  // Collective over `comm`: min/mean/max of every timer name used by any rank, sorted by name.
  Result<std::vector<TimerStats>> Reduce(const Communicator& comm) const;

  // Collective over `comm`: Reduce(), then rank 0 logs the table at INFO, e.g.
  //   timer            min(s)   mean(s)    max(s)  count ranks
  //   swap_in_param    0.812     0.844     0.901     40     4
  Status LogSummary(const Communicator& comm, std::string_view title = "timers") const;

  // Renders a table like the one above (exposed for tests and tools).
  static std::string FormatTable(const std::vector<TimerStats>& stats);

 private:
  struct Timer {
    double seconds = 0;
    std::int64_t count = 0;
    bool running = false;
    std::chrono::steady_clock::time_point started;
  };
  mutable std::mutex mu_;
  std::map<std::string, Timer, std::less<>> timers_;
};

// Starts a timer on construction and stops it on destruction.
class ScopedTimer {
 public:
  ScopedTimer(Timers& timers, std::string_view name) : timers_(timers), name_(name) {
    timers_.Start(name_);
  }
  ~ScopedTimer() { timers_.Stop(name_); }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  Timers& timers_;
  std::string name_;
};

}  // namespace zinf::comm
