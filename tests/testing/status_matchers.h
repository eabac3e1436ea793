// GoogleTest helpers for zinf::Status and zinf::Result<T>.
//
//   ZINF_ASSERT_OK(store.Open());
//   ZINF_ASSERT_OK_AND_ASSIGN(auto fd, OpenFile(path));
//   EXPECT_THAT(Parse("x"), StatusIs(zinf::ErrorCode::kInvalidArgument, HasSubstr("'x'")));
#pragma once

#include <ostream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "zinf/core/status.h"

namespace zinf {

inline void PrintTo(const Error& e, std::ostream* os) { *os << e.ToString(); }
template <typename T>
void PrintTo(const Result<T>& r, std::ostream* os) {
  if (r.has_value()) {
    *os << "OK";
  } else {
    *os << r.error().ToString();
  }
}

namespace testing {

template <typename T>
std::string Describe(const Result<T>& r) {
  return r.has_value() ? std::string("OK") : r.error().ToString();
}

MATCHER_P2(StatusIs, code, message_matcher,
           std::string("is an error with code ") + std::string(ErrorCodeName(code))) {
  if (arg.has_value()) {
    *result_listener << "which is OK";
    return false;
  }
  *result_listener << "which is " << arg.error().ToString();
  return arg.error().code() == code &&
         ::testing::ExplainMatchResult(message_matcher, arg.error().message(), result_listener);
}

MATCHER_P(StatusIs, code, std::string("is an error with code ") + std::string(ErrorCodeName(code))) {
  if (arg.has_value()) {
    *result_listener << "which is OK";
    return false;
  }
  *result_listener << "which is " << arg.error().ToString();
  return arg.error().code() == code;
}

MATCHER(IsOk, "is OK") {
  if (arg.has_value()) return true;
  *result_listener << "which is " << arg.error().ToString();
  return false;
}

}  // namespace testing
}  // namespace zinf

#define ZINF_ASSERT_OK(expr)                                                \
  do {                                                                      \
    auto&& zinf_t_ = (expr);                                                \
    ASSERT_TRUE(zinf_t_.has_value()) << #expr << ": " << zinf_t_.error().ToString(); \
  } while (false)

#define ZINF_EXPECT_OK(expr)                                                \
  do {                                                                      \
    auto&& zinf_t_ = (expr);                                                \
    EXPECT_TRUE(zinf_t_.has_value()) << #expr << ": " << zinf_t_.error().ToString(); \
  } while (false)

#define ZINF_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ZINF_ASSERT_OK_AND_ASSIGN_IMPL_(ZINF_STATUS_CONCAT_(zinf_t_result_, __COUNTER__), lhs, expr)
#define ZINF_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)                     \
  auto tmp = (expr);                                                        \
  ASSERT_TRUE(tmp.has_value()) << #expr << ": " << tmp.error().ToString();  \
  lhs = std::move(*tmp)
