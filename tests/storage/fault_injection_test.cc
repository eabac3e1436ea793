#include "zinf/storage/fault_injection.h"

#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/core/check.h"

namespace zinf::storage {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

TEST(ParseFaultSpecTest, ParsesRulesAndRank) {
  ZINF_ASSERT_OK_AND_ASSIGN(
      FaultSpec spec, ParseFaultSpec(" write:3:eio, read:1:short,read:2:eagain ,any:5+:enospc,"
                                     "read:7:eintr,rank=1"));
  ASSERT_EQ(spec.rules.size(), 5u);
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.rules[0].op, IoOp::kWrite);
  EXPECT_EQ(spec.rules[0].nth, 3u);
  EXPECT_FALSE(spec.rules[0].and_later);
  EXPECT_EQ(spec.rules[0].kind, FaultKind::kEio);
  EXPECT_EQ(spec.rules[1].kind, FaultKind::kShort);
  EXPECT_EQ(spec.rules[2].kind, FaultKind::kEagain);
  EXPECT_FALSE(spec.rules[3].op.has_value());
  EXPECT_TRUE(spec.rules[3].and_later);
  EXPECT_EQ(spec.rules[3].kind, FaultKind::kEnospc);
  EXPECT_EQ(spec.rules[4].kind, FaultKind::kEintr);
  EXPECT_EQ(FormatFaultSpec(spec),
            "write:3:eio,read:1:short,read:2:eagain,any:5+:enospc,read:7:eintr,rank=1");
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec again, ParseFaultSpec(FormatFaultSpec(spec)));
  EXPECT_EQ(FormatFaultSpec(again), FormatFaultSpec(spec));
}

TEST(ParseFaultSpecTest, BadSpecsNameTheBadToken) {
  const std::pair<const char*, const char*> cases[] = {
      {"wrte:3:eio", "'wrte:3:eio'"},   {"write:0:eio", "'write:0:eio'"},
      {"write:x:eio", "'write:x:eio'"}, {"write:3:boom", "unknown kind 'boom'"},
      {"write:3", "'write:3'"},         {"write:3:eio:1", "'write:3:eio:1'"},
      {"read:1:eio,,", "''"},           {"rank=a", "'rank=a'"},
      {"rank=1,rank=2", "twice"},       {"write:-1:eio", "'write:-1:eio'"},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_THAT(ParseFaultSpec(text), StatusIs(ErrorCode::kInvalidArgument, HasSubstr(expected)))
        << text;
  }
  EXPECT_THAT(ParseFaultSpec(""), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(ParseFaultSpec("rank=0"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("no rule")));
}

TEST(FaultInjectorTest, RewritesOnlyTheNthCompletionOfItsOp) {
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("write:2:eio,read:3+:eagain"));
  FaultInjector injector(spec);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 4096, 512), 4096);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 4096, 512), 4096);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 4096, 512), -EIO);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 4096, 512), 4096);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 4096, 512), 4096);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 4096, 512), -EAGAIN);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 4096, 512), -EAGAIN);
  EXPECT_EQ(injector.injected(), 3u);
}

TEST(FaultInjectorTest, ShortTransfersKeepAlignment) {
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("any:1+:short"));
  FaultInjector injector(spec);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 65536, 512), 32768);
  EXPECT_EQ(injector.Apply(IoOp::kRead, 3 * 512, 512), 512);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 512, 512), 512);  // cannot be shortened
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 1001, 1), 500);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, -EIO, 1), -EIO);  // errors pass through
}

TEST(FaultInjectorTest, RankFilter) {
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("write:1:eio,rank=12345"));
  FaultInjector injector(spec);
  EXPECT_EQ(injector.Apply(IoOp::kWrite, 4096, 512), 4096);
}

class FaultEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("ZINF_IO_ENGINE");
    ::unsetenv("ZINF_FAULT_INJECT");
  }
  void TearDown() override { SetUp(); }
  ScratchDir dir_{"faultenv"};
};

TEST_F(FaultEnvTest, CreateIoEngineWrapsWhenTheVariableIsSet) {
  ::setenv("ZINF_FAULT_INJECT", "write:1:enospc", 1);
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, CreateIoEngine(EngineKind::kPosix, {}, dir_.path()));
  EXPECT_EQ(engine->name(), "posix+faults");
  OpenOptions options;
  options.mode = OpenMode::kCreate;
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir_.Join("f"), options));
  alignas(4096) static std::byte data[4096];
  ZINF_ASSERT_OK(engine->Submit(IoRequest{IoOp::kWrite, &file, 0, data}));
  EXPECT_THAT(engine->WaitAll(), StatusIs(ErrorCode::kResourceExhausted, HasSubstr(file.path())));
}

TEST_F(FaultEnvTest, MalformedVariableIsInvalidArgument) {
  ::setenv("ZINF_FAULT_INJECT", "write:3:eio,bogus", 1);
  EXPECT_THAT(CreateIoEngine(EngineKind::kPosix, {}, dir_.path()),
              StatusIs(ErrorCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("ZINF_FAULT_INJECT"), HasSubstr("'bogus'"))));
}

TEST_F(FaultEnvTest, OtherRankIsNotWrapped) {
  ::setenv("ZINF_FAULT_INJECT", "write:1:eio,rank=4321", 1);
  ZINF_ASSERT_OK_AND_ASSIGN(auto engine, CreateIoEngine(EngineKind::kPosix, {}, dir_.path()));
  EXPECT_EQ(engine->name(), "posix");
}

TEST(FaultInjectingEngineTest, RefusesForeignEngines) {
  class Foreign final : public IoEngine {
   public:
    std::string_view name() const override { return "foreign"; }
    const AioOptions& options() const override { return options_; }
    Result<std::uint64_t> Submit(const IoRequest&) override { return 1; }
    Status Wait(std::size_t, std::vector<IoCompletion>*) override { return OkStatus(); }
    std::size_t pending() const override { return 0; }

   private:
    AioOptions options_;
  };
  auto injector = std::make_shared<FaultInjector>(FaultSpec{});
  EXPECT_THAT(FaultInjectingEngine::Wrap(std::make_unique<Foreign>(), injector),
              StatusIs(ErrorCode::kUnimplemented, HasSubstr("foreign")));
}

}  // namespace
}  // namespace zinf::storage
