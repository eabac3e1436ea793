#include "zinf/core/units.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

TEST(Units, AlignUpAndDown) {
  EXPECT_EQ(AlignUp(0, 4096), 0u);
  EXPECT_EQ(AlignUp(1, 4096), 4096u);
  EXPECT_EQ(AlignUp(4096, 4096), 4096u);
  EXPECT_EQ(AlignUp(4097, 512), 4608u);
  EXPECT_EQ(AlignUp(10, 3), 12u);
  EXPECT_EQ(AlignDown(4097, 512), 4096u);
  EXPECT_TRUE(IsAligned(8192, 4096));
  EXPECT_FALSE(IsAligned(8193, 4096));
}

TEST(UnitsDeathTest, AlignUpOverflowIsAProgrammerError) {
  EXPECT_DEATH((void)AlignUp(~0ull, 4096), "overflows");
}

TEST(Units, ParseBytesAcceptsUnits) {
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_EQ(*ParseBytes("64K"), 64 * kKiB);
  EXPECT_EQ(*ParseBytes("1M"), kMiB);
  EXPECT_EQ(*ParseBytes("1MiB"), kMiB);
  EXPECT_EQ(*ParseBytes("2GB"), 2 * kGiB);
  EXPECT_EQ(*ParseBytes("2GiB"), 2 * kGiB);
  EXPECT_EQ(*ParseBytes("1.5G"), 3 * kGiB / 2);
  EXPECT_EQ(*ParseBytes("8k"), 8 * kKiB);
}

TEST(Units, ParseBytesRejectsNonsense) {
  EXPECT_THAT(ParseBytes(""), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseBytes("abc"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'abc'")));
  EXPECT_THAT(ParseBytes("12Q"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("unit 'Q'")));
  EXPECT_THAT(ParseBytes("99999999999999999999"), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseBytes("20000000000G"), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseBytes("0.3"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("whole")));
  // Strict: no spaces, signs, exponents, repeated units or bare points.
  for (const char* text : {"2 G B", "2 GB", " 2G", "2G ", "2GG", "-1G", "+1G", "1e99G", "1e3",
                           ".5G", "1.G", "1.5.G"}) {
    EXPECT_THAT(ParseBytes(text), StatusIs(ErrorCode::kInvalidArgument)) << text;
  }
}

TEST(Units, FormatBytes) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(4096), "4.00 KiB");
  EXPECT_EQ(FormatBytes(3 * kGiB / 2), "1.50 GiB");
}

TEST(Units, CheckedArithmetic) {
  std::uint64_t out;
  EXPECT_TRUE(CheckedMul(1ull << 31, 1ull << 31, &out));
  EXPECT_EQ(out, 1ull << 62);
  EXPECT_FALSE(CheckedMul(1ull << 40, 1ull << 40, &out));
  EXPECT_FALSE(CheckedAdd(~0ull, 1, &out));
}

}  // namespace
}  // namespace zinf
