#include "zinf/core/stop_signals.h"

#include <atomic>
#include <cstddef>

namespace zinf {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void OnStopSignal(int sig) { g_stop_signal.store(sig, std::memory_order_relaxed); }

}  // namespace

int ReceivedStopSignal() { return g_stop_signal.load(); }

StopSignals::StopSignals() {
  g_stop_signal.store(0);
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &action, &old_[i]);
}

StopSignals::~StopSignals() {
  for (std::size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], &old_[i], nullptr);
}

}  // namespace zinf
