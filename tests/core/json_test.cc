// ParseJson (core/json.h): nesting, duplicate keys, numbers out of range and size are clean
// errors, never an exception or a stack overflow.
#include "zinf/core/json.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "zinf/core/log.h"

namespace zinf {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::StatusIs;

TEST(ParseJson, ParsesDocumentsOfBothJsonTypes) {
  ZINF_ASSERT_OK_AND_ASSIGN(nlohmann::json j,
                            ParseJson(R"({"a": [1, 2.5, "x", null, true], "b": {"c": -3}})"));
  EXPECT_EQ(j["a"][1].get<double>(), 2.5);
  EXPECT_EQ(j["b"]["c"].get<int>(), -3);
  ZINF_ASSERT_OK_AND_ASSIGN(nlohmann::ordered_json o,
                            ParseJson<nlohmann::ordered_json>(R"({"z": 1, "a": 2})"));
  EXPECT_EQ(o.begin().key(), "z");
  ZINF_ASSERT_OK_AND_ASSIGN(nlohmann::json scalar, ParseJson("  7 "));
  EXPECT_EQ(scalar.get<int>(), 7);
}

TEST(ParseJson, SyntaxErrorsCarryTheLine) {
  EXPECT_THAT(ParseJson("{\n\"a\": ,}"),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("JSON syntax error: parse error at line 2, column 6")));
  EXPECT_THAT(ParseJson(""), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseJson("{} {}"), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseJson("\"\xff\""), StatusIs(ErrorCode::kInvalidArgument));
}

TEST(ParseJson, NumbersOutOfRangeAreErrorsNotExceptions) {
  EXPECT_THAT(ParseJson(R"({"lr": 1e400})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("1e400")));
  EXPECT_THAT(ParseJson(R"({"lr": -1e400})"), StatusIs(ErrorCode::kInvalidArgument));
  // Integers beyond 64 bits become doubles, which is fine.
  ZINF_ASSERT_OK_AND_ASSIGN(nlohmann::json big, ParseJson("123456789012345678901234567890"));
  EXPECT_TRUE(big.is_number_float());
}

TEST(ParseJson, DeepNestingIsRefusedWithoutRecursion) {
  // 400k levels: nlohmann would accept it and later overflow the stack printing it.
  const std::string deep = std::string(400'000, '[') + std::string(400'000, ']');
  EXPECT_THAT(ParseJson(deep),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("nesting deeper than 64 levels")));
  std::string objects;
  for (int i = 0; i < 100; ++i) objects += "{\"k\":";
  objects += "1" + std::string(100, '}');
  EXPECT_THAT(ParseJson(objects), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("k.k.k")));
  ZINF_EXPECT_OK(ParseJson(objects, {.max_depth = 100}));
  EXPECT_THAT(ParseJson("[[[1]]]", {.max_depth = 2}), StatusIs(ErrorCode::kInvalidArgument));
  ZINF_EXPECT_OK(ParseJson("[[[1]]]", {.max_depth = 3}));
}

TEST(ParseJson, DuplicateKeysAreErrors) {
  EXPECT_THAT(ParseJson(R"({"zero": {"stage": 1, "stage": 3}})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("duplicate key 'stage' in zero")));
  EXPECT_THAT(ParseJson(R"({"a": 1, "a": 1})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("in the top level")));
  // The same key in sibling objects is fine.
  ZINF_EXPECT_OK(ParseJson(R"([{"a": 1}, {"a": 2}])"));
  ZINF_EXPECT_OK(ParseJson(R"({"a": 1, "a": 2})", {.reject_duplicate_keys = false}));
}

TEST(ParseJson, LongTextIsRefusedBeforeParsing) {
  EXPECT_THAT(ParseJson(std::string(100, ' ') + "1", {.max_bytes = 10}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("larger than 10 bytes")));
}

TEST(DumpJsonForDisplay, EscapesInvalidUtf8AndControls) {
  nlohmann::json j = {{"name", std::string("a\x1b[2J\xff")}};
  const std::string shown = DumpJsonForDisplay(j);
  EXPECT_EQ(shown.find('\x1b'), std::string::npos);
  EXPECT_THAT(shown, HasSubstr("\\u001b"));
}

TEST(EscapeForTerminal, EscapesEverythingButPrintableAscii) {
  EXPECT_EQ(EscapeForTerminal("ab c"), "ab c");
  EXPECT_EQ(EscapeForTerminal("a\x1b[2Jb"), "a\\x1b[2Jb");
  EXPECT_EQ(EscapeForTerminal("a\\b"), "a\\\\b");
  EXPECT_EQ(EscapeForTerminal("l1\nl2\t"), "l1\\x0al2\\x09");
  EXPECT_EQ(EscapeForTerminal("l1\nl2\t", /*keep_newlines=*/true), "l1\nl2\t");
  EXPECT_EQ(EscapeForTerminal("\xc3\xa9"), "\\xc3\\xa9");
}

}  // namespace
}  // namespace zinf
