#include "zinf/core/check.h"

#include <gtest/gtest.h>

namespace zinf {
namespace {

TEST(CheckDeathTest, FailedCheckAbortsWithRankConditionAndMessage) {
  SetProcessRank(3, 4);
  EXPECT_DEATH(ZINF_CHECK(1 + 1 == 3, "math is {}", "broken"),
               "rank 3: CHECK failed at .*check_test.cc:[0-9]+: 1 \\+ 1 == 3: math is broken");
}

TEST(CheckDeathTest, ComparisonCheckPrintsBothValues) {
  SetProcessRank(0, 1);
  int a = 4096, b = 512;
  EXPECT_DEATH(ZINF_CHECK_EQ(a, b), "CHECK failed at .*: a == b: 4096 vs 512");
}

TEST(Check, PassingChecksDoNothing) {
  ZINF_CHECK(true);
  ZINF_CHECK(2 > 1, "never printed {}", 1);
  ZINF_CHECK_LE(1, 2);
  ZINF_CHECK_NE(1, 2);
  SUCCEED();
}

TEST(Check, ProcessRankFallsBackToTheLauncherEnvironment) {
  SetProcessRank(5, 8);
  EXPECT_EQ(ProcessRank(), 5);
  EXPECT_EQ(ProcessWorldSize(), 8);
}

}  // namespace
}  // namespace zinf
