#include "zinf/core/log.h"

#include <unistd.h>

#include <cstdio>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "zinf/core/check.h"

namespace zinf {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

TEST(Log, ParsesLevels) {
  LogLevel level;
  ASSERT_TRUE(ParseLogLevel("DEBUG", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  ASSERT_TRUE(ParseLogLevel("warning", &level));
  EXPECT_EQ(level, LogLevel::kWarn);
  ASSERT_TRUE(ParseLogLevel("off", &level));
  EXPECT_EQ(level, LogLevel::kOff);
  EXPECT_FALSE(ParseLogLevel("verbose", &level));
}

TEST(Log, InfoOnlyOnRankZeroWarnEverywhere) {
  SetLogLevel(LogLevel::kInfo);
  SetLogAllRanks(false);
  SetProcessRank(0, 4);
  EXPECT_TRUE(LogEnabled(LogLevel::kInfo));
  EXPECT_FALSE(LogEnabled(LogLevel::kDebug));
  SetProcessRank(2, 4);
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo));
  EXPECT_TRUE(LogEnabled(LogLevel::kWarn));
  EXPECT_TRUE(LogEnabled(LogLevel::kError));
  SetLogAllRanks(true);
  EXPECT_TRUE(LogEnabled(LogLevel::kInfo));
  SetLogAllRanks(false);
  SetLogLevel(LogLevel::kError);
  EXPECT_FALSE(LogEnabled(LogLevel::kWarn));
  SetLogLevel(LogLevel::kOff);
  EXPECT_FALSE(LogEnabled(LogLevel::kError));
  SetLogLevel(LogLevel::kInfo);
}

TEST(Log, LineCarriesTimeLevelAndRank) {
  SetLogLevel(LogLevel::kInfo);
  SetProcessRank(1, 3);
  ::testing::internal::CaptureStderr();
  ZINF_LOG_WARN("disk {} is {}% full", "/nvme0", 93);
  std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out, MatchesRegex("\\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8}\\.[0-9]{3}\\] \\[warn\\] "
                                "\\[rank 1/3\\] disk /nvme0 is 93% full\n"));
  ::testing::internal::CaptureStderr();
  ZINF_LOG_INFO("not on rank 1");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  SetProcessRank(0, 1);
}

TEST(Log, ControlCharactersNeverReachTheTerminal) {
  SetLogLevel(LogLevel::kInfo);
  SetProcessRank(0, 1);
  ::testing::internal::CaptureStderr();
  // ESC, CR, BEL, DEL, C1 CSI (U+009B), an invalid byte; newline and tab and UTF-8 text stay.
  ZINF_LOG_WARN("name '{}'", "a\x1b[2J\r\x07\x7f\xc2\x9b[2J\xff\tcaf\xc3\xa9\nnext");
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(out,
              HasSubstr("name 'a\\x1b[2J\\x0d\\x07\\x7f\\xc2\\x9b[2J\\xff\tcaf\xc3\xa9\nnext'"));
  for (const char c : out) {
    const auto b = static_cast<unsigned char>(c);
    EXPECT_FALSE((b < 0x20 && b != '\n' && b != '\t') || b == 0x7f) << static_cast<int>(b);
  }
}

}  // namespace
}  // namespace zinf
