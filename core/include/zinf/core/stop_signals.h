// Stop signals: SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 turned into a flag a training loop polls
// between steps, so that it can stop with a final checkpoint instead of dying mid-step.
//
//   std::optional<zinf::StopSignals> stop;
//   stop.emplace();                                  // handlers installed, flag cleared
//   ... each step: if (zinf::ReceivedStopSignal() != 0) save a checkpoint and stop;
//   stop.reset();                                    // the previous handlers are back
//
// SIGINT/SIGTERM for a process run directly; under Open MPI's mpirun those become SIGTERM then
// SIGKILL a second later, while SIGUSR1/SIGUSR2 sent to mpirun reach the ranks unchanged and the
// job waits for them: the way to stop a job with a final checkpoint.
//
// Thread safety: ReceivedStopSignal from any thread (an atomic). Install one StopSignals at a
// time per process (the handlers and the flag are process-wide); construct and destroy it on one
// thread.
#pragma once

#include <csignal>

#include <array>

namespace zinf {

// The number of the last stop signal delivered while a StopSignals was installed, since the
// latest one was constructed; 0: none.
int ReceivedStopSignal();

// Installs the stop handlers for its lifetime (clearing the flag) and restores the previous
// ones when destroyed. The handlers only record the signal: the process goes on.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

 private:
  std::array<struct sigaction, kSignals.size()> old_{};
};

}  // namespace zinf
