#include "zinf/partition/layout.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "partition/reference.h"
#include "testing/status_matchers.h"

namespace zinf::partition {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using zinf::testing::IsOk;
using zinf::testing::StatusIs;

ParamLayout MakeLayout(std::vector<ParamSpec> specs, DType dtype = DType::kFloat32) {
  auto layout = ParamLayout::Create(std::move(specs), dtype);
  EXPECT_TRUE(layout.has_value()) << layout.error().ToString();
  return std::move(*layout);
}

TEST(ParamLayout, ComputesFlatOffsetsInOrder) {
  ParamLayout layout =
      MakeLayout({{"embed.weight", {10, 4}}, {"ln.bias", {4}}, {"scale", {}}}, DType::kBFloat16);
  ASSERT_EQ(layout.num_params(), 3u);
  EXPECT_EQ(layout.param(0).numel, 40u);
  EXPECT_EQ(layout.param(0).flat_offset, 0u);
  EXPECT_EQ(layout.param(1).flat_offset, 40u);
  EXPECT_EQ(layout.param(2).numel, 1u) << "a scalar has one element";
  EXPECT_EQ(layout.param(2).flat_offset, 44u);
  EXPECT_EQ(layout.total_numel(), 45u);
  EXPECT_EQ(layout.max_param_numel(), 40u);
  EXPECT_EQ(layout.dtype(), DType::kBFloat16);
}

TEST(ParamLayout, FindsParametersByNameAndFlatOffset) {
  ParamLayout layout = MakeLayout({{"z", {3}}, {"a", {2}}, {"m", {5}}});
  EXPECT_EQ(layout.FindParam("a"), 1u);
  EXPECT_EQ(layout.FindParam("m"), 2u);
  EXPECT_EQ(layout.FindParam("q"), std::nullopt);
  const std::size_t expected[] = {0, 0, 0, 1, 1, 2, 2, 2, 2, 2};
  for (std::uint64_t flat = 0; flat < layout.total_numel(); ++flat) {
    EXPECT_EQ(layout.ParamAtFlatOffset(flat), expected[flat]) << flat;
  }
}

TEST(ParamLayout, TotalNumelIsSixtyFourBit) {
  ParamLayout layout = MakeLayout({{"a", {65536, 65536}}, {"b", {65536, 65536}}, {"c", {3}}});
  EXPECT_EQ(layout.total_numel(), (std::uint64_t{1} << 33) + 3);
  EXPECT_EQ(layout.param(2).flat_offset, std::uint64_t{1} << 33);
  EXPECT_EQ(layout.ParamAtFlatOffset((std::uint64_t{1} << 32) + 5), 1u);
}

TEST(ParamLayout, AcceptsTheWholeNameAlphabet) {
  EXPECT_THAT(ParamLayout::Create({{"model.layers.0/attn:q_proj-weight", {2}},
                                   {"a..b", {1}},
                                   {"./x/.", {1}},
                                   {"ABCxyz0123456789", {1}}}),
              IsOk());
}

TEST(ParamLayout, RejectsAnEmptyLayout) {
  EXPECT_THAT(ParamLayout::Create({}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("at least one parameter")));
}

TEST(ParamLayout, RejectsBadNames) {
  EXPECT_THAT(ParamLayout::Create({{"a", {1}}, {"", {2}}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("parameter 1: empty name")));
  EXPECT_THAT(ParamLayout::Create({{"w", {1}}, {"b", {1}}, {"w", {2}}}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("parameter 2 'w': duplicate name (also parameter 0)")));
  EXPECT_THAT(ParamLayout::Create({{"has space", {1}}}),
              StatusIs(ErrorCode::kInvalidArgument,
                       AllOf(HasSubstr("parameter 0 'has space'"), HasSubstr("character ' '"))));
  EXPECT_THAT(ParamLayout::Create({{"new\nline", {1}}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'new\\x0aline'")));
  EXPECT_THAT(ParamLayout::Create({{"caf\xc3\xa9", {1}}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("character '\\xc3'")));
  for (const char* name : {"a*", "a\\b", "x'y", "a,b", "w[0]"}) {
    EXPECT_THAT(ParamLayout::Create({{name, {1}}}),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("is not allowed")))
        << name;
  }
  for (const char* name : {"..", "../w", "a/../w", "a/..", "a//../b"}) {
    EXPECT_THAT(ParamLayout::Create({{"ok", {1}}, {name, {1}}}),
                StatusIs(ErrorCode::kInvalidArgument,
                         AllOf(HasSubstr("parameter 1 '"), HasSubstr("'..' path segment"))))
        << name;
  }
}

TEST(ParamLayout, RejectsBadShapes) {
  EXPECT_THAT(ParamLayout::Create({{"a", {1}}, {"w", {4, 0}}}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("parameter 1 'w': dimension 1 is 0 in shape [4, 0]")));
  EXPECT_THAT(ParamLayout::Create({{"w", {-3}}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'w': dimension 0 is -3")));
}

TEST(ParamLayout, RejectsNumelOverflow) {
  const std::int64_t two_32 = std::int64_t{1} << 32;
  EXPECT_THAT(ParamLayout::Create({{"w", {two_32, two_32}}}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("'w': numel of shape [4294967296, 4294967296] exceeds")));
  EXPECT_THAT(ParamLayout::Create({{"w", {two_32, two_32 / 2}}}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("exceeds 2^63 - 1")));
  const std::int64_t two_62 = std::int64_t{1} << 62;
  EXPECT_THAT(ParamLayout::Create({{"a", {two_62}}, {"b", {two_62 - 1}}}), IsOk());
  EXPECT_THAT(ParamLayout::Create({{"a", {two_62}}, {"b", {two_62}}}),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("parameter 1 'b': total numel of the layout exceeds")));
}

TEST(ParamLayout, DTypeNamesRoundTrip) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    EXPECT_EQ(ParseDType(DTypeName(dtype)).value(), dtype);
  }
  EXPECT_EQ(ParseDType("bfloat16").value(), DType::kBFloat16);
  EXPECT_EQ(DTypeSizeBytes(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSizeBytes(DType::kFloat16), 2u);
  EXPECT_THAT(ParseDType("fp8"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'fp8'")));
  EXPECT_THAT(ParamLayout::Create({{"a", {1}}}, static_cast<DType>(7)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("dtype")));
}

TEST(ParamLayout, JsonRoundTripsRandomLayouts) {
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 300; ++i) {
    const ParamLayout layout = testing::RandomLayout(rng);
    ZINF_ASSERT_OK_AND_ASSIGN(ParamLayout parsed,
                              ParamLayout::FromJsonString(layout.ToJsonString()));
    ASSERT_EQ(parsed, layout);
    ASSERT_EQ(parsed.total_numel(), layout.total_numel());
    ZINF_ASSERT_OK(CompareLayouts(layout, parsed));
  }
}

TEST(ParamLayout, JsonIsCompact) {
  ParamLayout layout = MakeLayout({{"w", {2, 3}}, {"s", {}}}, DType::kFloat16);
  EXPECT_EQ(layout.ToJsonString(),
            R"({"dtype":"fp16","params":[{"name":"w","shape":[2,3]},{"name":"s","shape":[]}],)"
            R"("total_numel":7,"version":1})");
}

TEST(ParamLayout, JsonErrorsAreInvalidArgument) {
  auto parse = [](const char* text) { return ParamLayout::FromJsonString(text); };
  EXPECT_THAT(parse("{not json"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("JSON syntax error")));
  // Read bounded: nesting beyond ParseJson's limit is refused before anything recurses on it.
  EXPECT_THAT(parse((std::string(R"({"version":1,"dtype":"fp32","params":[{"name":"a","shape":)") +
                     std::string(100000, '[') + std::string(100000, ']') + "}]}")
                        .c_str()),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("nesting deeper")));
  EXPECT_THAT(parse("[]"), StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not an object")));
  EXPECT_THAT(parse(R"({"dtype":"fp32","params":[]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'version'")));
  EXPECT_THAT(parse(R"({"version":2,"dtype":"fp32","params":[]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("unsupported version 2")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"int8","params":[]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("unknown dtype 'int8'")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32"})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'params'")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32","params":[{"name":"a"}]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("params[0] has no array 'shape'")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32","params":[{"name":"a","shape":[1.5]}]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("non-integer dimension 1.5")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32",
                        "params":[{"name":"a","shape":[18446744073709551615]}]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("exceeds 2^63 - 1")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32","params":[{"name":"a/../b","shape":[2]}]})"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("parameter 0 'a/../b'")));
  EXPECT_THAT(parse(R"({"version":1,"dtype":"fp32","total_numel":5,
                        "params":[{"name":"a","shape":[2]}]})"),
              StatusIs(ErrorCode::kInvalidArgument,
                       HasSubstr("'total_numel' is 5 but the shapes add up to 2")));
}

TEST(CompareLayouts, EqualLayoutsAreOk) {
  ParamLayout a = MakeLayout({{"w", {2, 3}}, {"b", {3}}});
  ParamLayout b = MakeLayout({{"w", {2, 3}}, {"b", {3}}});
  EXPECT_THAT(CompareLayouts(a, b), IsOk());
}

TEST(CompareLayouts, NamesTheFirstMismatch) {
  ParamLayout expected = MakeLayout({{"w", {2, 3}}, {"b", {3}}, {"s", {}}});
  EXPECT_THAT(CompareLayouts(expected, MakeLayout({{"w", {2, 3}}, {"b", {4}}, {"s", {}}})),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr("parameter 'b' (index 1): shape [3] expected, [4] actual")));
  EXPECT_THAT(CompareLayouts(expected, MakeLayout({{"w", {3, 2}}, {"b", {4}}, {"s", {}}})),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("'w' (index 0): shape [2, 3]")));
  EXPECT_THAT(CompareLayouts(expected, MakeLayout({{"b", {3}}, {"w", {2, 3}}, {"s", {}}})),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr("parameter order differs at index 0: 'w' expected, 'b' actual")));
  EXPECT_THAT(CompareLayouts(expected, MakeLayout({{"w", {2, 3}}, {"s", {}}})),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr("parameter 'b' (index 1) expected but missing")));
  EXPECT_THAT(
      CompareLayouts(expected, MakeLayout({{"w", {2, 3}}, {"x", {3}}, {"b", {3}}, {"s", {}}})),
      StatusIs(ErrorCode::kFailedPrecondition,
               HasSubstr("unexpected parameter 'x' at index 1 (expected 'b')")));
  EXPECT_THAT(CompareLayouts(expected, MakeLayout({{"w", {2, 3}}, {"b", {3}}})),
              StatusIs(ErrorCode::kFailedPrecondition,
                       HasSubstr("parameter 's' (index 2) expected but missing (3 parameters "
                                 "expected, 2 actual)")));
  EXPECT_THAT(
      CompareLayouts(expected, MakeLayout({{"w", {2, 3}}, {"b", {3}}, {"s", {}}, {"extra", {1}}})),
      StatusIs(ErrorCode::kFailedPrecondition,
               HasSubstr("unexpected parameter 'extra' at index 3")));
}

TEST(CompareLayouts, DTypeIsComparedUnlessDisabled) {
  ParamLayout fp32 = MakeLayout({{"w", {2}}}, DType::kFloat32);
  ParamLayout bf16 = MakeLayout({{"w", {2}}}, DType::kBFloat16);
  EXPECT_THAT(CompareLayouts(fp32, bf16),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("dtype fp32 expected, bf16")));
  EXPECT_THAT(CompareLayouts(fp32, bf16, /*compare_dtype=*/false), IsOk());
  // A structural mismatch is reported before the dtype.
  EXPECT_THAT(CompareLayouts(fp32, MakeLayout({{"w", {3}}}, DType::kBFloat16)),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("shape [2] expected, [3]")));
}

}  // namespace
}  // namespace zinf::partition
