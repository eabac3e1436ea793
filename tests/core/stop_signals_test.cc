#include "zinf/core/stop_signals.h"

#include <csignal>

#include <atomic>
#include <optional>

#include <gtest/gtest.h>

namespace zinf {
namespace {

std::atomic<int> g_previous_handler_saw{0};

extern "C" void PreviousHandler(int sig) { g_previous_handler_saw.store(sig); }

TEST(StopSignals, EachSignalSetsTheFlagAndTheProcessGoesOn) {
  for (int sig : StopSignals::kSignals) {
    StopSignals stop;
    EXPECT_EQ(ReceivedStopSignal(), 0) << "a fresh StopSignals clears the flag";
    ASSERT_EQ(std::raise(sig), 0);
    EXPECT_EQ(ReceivedStopSignal(), sig);
  }
}

TEST(StopSignals, ConstructionClearsAnEarlierSignal) {
  {
    StopSignals stop;
    ASSERT_EQ(std::raise(SIGUSR1), 0);
    ASSERT_EQ(ReceivedStopSignal(), SIGUSR1);
  }
  StopSignals again;
  EXPECT_EQ(ReceivedStopSignal(), 0);
}

TEST(StopSignals, DestructionRestoresThePreviousHandlers) {
  struct sigaction mine {};
  mine.sa_handler = PreviousHandler;
  sigemptyset(&mine.sa_mask);
  struct sigaction saved {};
  ASSERT_EQ(sigaction(SIGUSR2, &mine, &saved), 0);
  {
    StopSignals stop;
    ASSERT_EQ(std::raise(SIGUSR2), 0);
    EXPECT_EQ(ReceivedStopSignal(), SIGUSR2);
    EXPECT_EQ(g_previous_handler_saw.load(), 0) << "the stop handler replaces the previous one";
  }
  ASSERT_EQ(std::raise(SIGUSR2), 0);
  EXPECT_EQ(g_previous_handler_saw.load(), SIGUSR2);
  ASSERT_EQ(sigaction(SIGUSR2, &saved, nullptr), 0);
}

}  // namespace
}  // namespace zinf
