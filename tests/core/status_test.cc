#include "zinf/core/status.h"

#include <cerrno>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::IsOk;
using testing::StatusIs;

TEST(Status, OkStatusHasNoError) {
  Status s = OkStatus();
  EXPECT_TRUE(s.has_value());
  EXPECT_THAT(s, IsOk());
}

TEST(Status, ErrorCarriesCodeMessageErrnoAndLocation) {
  Error e = ErrnoError(EIO, "pread /data/x offset 4096 length 512");
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(e.sys_errno(), EIO);
  EXPECT_THAT(e.message(), HasSubstr("pread /data/x offset 4096 length 512: "));
  EXPECT_THAT(e.message(), HasSubstr("(errno 5)"));
  EXPECT_THAT(std::string(e.location().file_name()), HasSubstr("status_test.cc"));
  EXPECT_EQ(e.location().line(), static_cast<unsigned>(__LINE__ - 6));
  EXPECT_THAT(e.ToString(), StartsWith("DataLoss: pread"));
  EXPECT_THAT(e.ToString(), HasSubstr("[status_test.cc:"));
}

TEST(Status, FactoriesSetTheirCode) {
  EXPECT_EQ(UnavailableError("x").code(), ErrorCode::kUnavailable);
  EXPECT_EQ(NotFoundError("x").code(), ErrorCode::kNotFound);
  EXPECT_EQ(AlreadyExistsError("x").code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(InvalidArgumentError("x").code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(FailedPreconditionError("x").code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(ResourceExhaustedError("x").code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(UnimplementedError("x").code(), ErrorCode::kUnimplemented);
  EXPECT_EQ(AbortedError("x").code(), ErrorCode::kAborted);
  EXPECT_EQ(DataLossError("x").code(), ErrorCode::kDataLoss);
  EXPECT_EQ(InternalError("x").code(), ErrorCode::kInternal);
}

TEST(Status, AnErrorIsNeverOk) {
  Error e(ErrorCode::kOk, "confused caller");
  EXPECT_EQ(e.code(), ErrorCode::kInternal);
}

TEST(Status, CodeNamesAreDistinct) {
  for (int a = 0; a <= static_cast<int>(ErrorCode::kInternal); ++a) {
    for (int b = a + 1; b <= static_cast<int>(ErrorCode::kInternal); ++b) {
      EXPECT_NE(ErrorCodeName(static_cast<ErrorCode>(a)), ErrorCodeName(static_cast<ErrorCode>(b)));
    }
  }
  EXPECT_EQ(ErrorCodeName(ErrorCode::kResourceExhausted), "ResourceExhausted");
}

struct ErrnoCase {
  int err;
  ErrorCode code;
};

class ErrnoMapping : public ::testing::TestWithParam<ErrnoCase> {};

TEST_P(ErrnoMapping, MapsToCode) {
  EXPECT_EQ(ErrorCodeFromErrno(GetParam().err), GetParam().code) << "errno " << GetParam().err;
}

INSTANTIATE_TEST_SUITE_P(
    AllClasses, ErrnoMapping,
    ::testing::Values(ErrnoCase{0, ErrorCode::kOk}, ErrnoCase{EAGAIN, ErrorCode::kUnavailable},
                      ErrnoCase{EINTR, ErrorCode::kUnavailable},
                      ErrnoCase{ENOENT, ErrorCode::kNotFound},
                      ErrnoCase{EEXIST, ErrorCode::kAlreadyExists},
                      ErrnoCase{EINVAL, ErrorCode::kInvalidArgument},
                      ErrnoCase{EACCES, ErrorCode::kFailedPrecondition},
                      ErrnoCase{ELOOP, ErrorCode::kFailedPrecondition},
                      ErrnoCase{ENOSPC, ErrorCode::kResourceExhausted},
                      ErrnoCase{EDQUOT, ErrorCode::kResourceExhausted},
                      ErrnoCase{ENOMEM, ErrorCode::kResourceExhausted},
                      ErrnoCase{ENOSYS, ErrorCode::kUnimplemented},
                      ErrnoCase{EOPNOTSUPP, ErrorCode::kUnimplemented},
                      ErrnoCase{ECANCELED, ErrorCode::kAborted},
                      ErrnoCase{EIO, ErrorCode::kDataLoss},
                      ErrnoCase{EBADF, ErrorCode::kInternal},
                      ErrnoCase{123456, ErrorCode::kInternal}));

TEST(Status, WithContextPrefixesAndKeepsTheRest) {
  Error e = ErrnoError(ENOSPC, "pwrite");
  Error c = e.WithContext("swap-out sub-group 3 of rank 1: ");
  EXPECT_EQ(c.code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(c.sys_errno(), ENOSPC);
  EXPECT_THAT(c.message(), StartsWith("swap-out sub-group 3 of rank 1: pwrite: "));
  EXPECT_EQ(c.location().line(), e.location().line());
}

Status Fails(ErrorCode code) { return Error(code, "inner failure"); }
Status Succeeds() { return OkStatus(); }
Result<int> Value(int v) { return v; }
Result<int> NoValue() { return NotFoundError("no value"); }
Result<std::unique_ptr<int>> MoveOnly() { return std::make_unique<int>(7); }

Status Chain(bool fail_first, bool fail_second, int* reached) {
  ZINF_RETURN_IF_ERROR(fail_first ? Fails(ErrorCode::kDataLoss) : Succeeds());
  *reached = 1;
  ZINF_RETURN_IF_ERROR(fail_second ? Result<int>(NoValue()) : Value(3));
  *reached = 2;
  return OkStatus();
}

TEST(Status, ReturnIfErrorStopsAtTheFirstFailure) {
  int reached = 0;
  EXPECT_THAT(Chain(true, false, &reached), StatusIs(ErrorCode::kDataLoss, HasSubstr("inner")));
  EXPECT_EQ(reached, 0);
  EXPECT_THAT(Chain(false, true, &reached), StatusIs(ErrorCode::kNotFound));
  EXPECT_EQ(reached, 1);
  EXPECT_THAT(Chain(false, false, &reached), IsOk());
  EXPECT_EQ(reached, 2);
}

Result<int> Sum(bool fail) {
  ZINF_ASSIGN_OR_RETURN(int a, Value(2));
  int b = 0;
  ZINF_ASSIGN_OR_RETURN(b, fail ? NoValue() : Value(40));
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MoveOnly());
  return a + b + *p - 7;
}

TEST(Status, AssignOrReturnAssignsOrPropagates) {
  Result<int> ok = Sum(false);
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(*ok, 42);
  EXPECT_THAT(Sum(true), StatusIs(ErrorCode::kNotFound, HasSubstr("no value")));
}

TEST(Status, AnnotateAddsContextOnlyOnFailure) {
  Result<int> ok = Annotate(Value(5), "ctx: ");
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(*ok, 5);
  EXPECT_THAT(Annotate(NoValue(), "restore rank 2: "),
              StatusIs(ErrorCode::kNotFound, StartsWith("restore rank 2: no value")));
  EXPECT_THAT(Annotate(Succeeds(), "x"), IsOk());
}

}  // namespace
}  // namespace zinf
