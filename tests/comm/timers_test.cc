#include "zinf/comm/timers.h"

#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace zinf::comm {
namespace {

using ::testing::HasSubstr;

TEST(Timers, AccumulatesIntervalsAndCounts) {
  Timers timers;
  EXPECT_EQ(timers.Elapsed("swap_in_param"), 0);
  for (int i = 0; i < 3; ++i) {
    ScopedTimer t(timers, "swap_in_param");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(timers.Count("swap_in_param"), 3);
  EXPECT_GE(timers.Elapsed("swap_in_param"), 0.006);
  timers.Start("swap_out_param");
  EXPECT_EQ(timers.Count("swap_out_param"), 0);
  EXPECT_GE(timers.Elapsed("swap_out_param"), 0.0);  // running interval counts
  timers.Stop("swap_out_param");
  EXPECT_THAT(timers.Names(), ::testing::ElementsAre("swap_in_param", "swap_out_param"));
  timers.Reset();
  EXPECT_TRUE(timers.Names().empty());
}

TEST(TimersDeathTest, StopWithoutStartIsAProgrammerError) {
  Timers timers;
  EXPECT_DEATH(timers.Stop("never_started"), "not running");
  timers.Start("x");
  EXPECT_DEATH(timers.Start("x"), "started twice");
}

TEST(Timers, FormatTableAlignsColumns) {
  std::vector<TimerStats> stats = {{"swap_in_param", 0.5, 0.75, 1.0, 8, 4},
                                   {"x", 0, 0, 0, 1, 1}};
  std::string table = Timers::FormatTable(stats);
  EXPECT_THAT(table, HasSubstr("timer"));
  EXPECT_THAT(table, HasSubstr("swap_in_param      0.5000      0.7500      1.0000         8      4"));
  EXPECT_THAT(table, HasSubstr("\nx                  0.0000"));
}

}  // namespace
}  // namespace zinf::comm
