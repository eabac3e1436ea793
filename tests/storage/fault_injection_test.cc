#include "zinf/storage/fault_injection.h"

#include <fcntl.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/core/check.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fs.h"

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

TEST(ParseFaultSpecTest, ParsesEnvCalls) {
  ZINF_ASSERT_OK_AND_ASSIGN(
      FaultSpec spec, ParseFaultSpec("rename:1:eio,fsync:2+:eintr,fwrite:1:short,readdir:3:enospc,"
                                     "open:1:eagain,stat:1:eio,mkdir:1:eio,unlink:1:eio,"
                                     "fallocate:1:enospc,fread:1:eio,statfs:1:eio,close:1:eio"));
  ASSERT_EQ(spec.rules.size(), 12u);
  EXPECT_EQ(spec.rules[0].fs_op, FsOp::kRename);
  EXPECT_FALSE(spec.rules[0].op.has_value());
  EXPECT_EQ(spec.rules[1].fs_op, FsOp::kFsync);
  EXPECT_TRUE(spec.rules[1].and_later);
  EXPECT_EQ(spec.rules[2].fs_op, FsOp::kWrite);
  EXPECT_EQ(spec.rules[2].kind, FaultKind::kShort);
  EXPECT_EQ(FormatFaultSpec(spec),
            "rename:1:eio,fsync:2+:eintr,fwrite:1:short,readdir:3:enospc,open:1:eagain,"
            "stat:1:eio,mkdir:1:eio,unlink:1:eio,fallocate:1:enospc,fread:1:eio,statfs:1:eio,"
            "close:1:eio");
  EXPECT_THAT(ParseFaultSpec("rename:1:short"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'short' applies to")));
}

// Every Env call has a name the spec parser takes back.
TEST(ParseFaultSpecTest, EveryEnvCallHasAName) {
  for (int i = 0; i < kNumFsOps; ++i) {
    const FsOp op = static_cast<FsOp>(i);
    const std::string text = fmt::format("{}:2+:enospc", FsOpName(op));
    ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec(text));
    ASSERT_EQ(spec.rules.size(), 1u);
    EXPECT_EQ(spec.rules[0].fs_op, op) << text;
    EXPECT_EQ(FormatFaultSpec(spec), text);
  }
  EXPECT_TRUE(ParseFaultSpec("pwrite:1:short").has_value());
  EXPECT_THAT(ParseFaultSpec("pread:1:short"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("'short' applies to")));
}

// An Env rule fails the nth call of its op and nothing else; backend ops leave Env calls alone.
TEST(FaultInjectingEnvTest, FailsTheNthCallOfItsOp) {
  ScratchDir dir("env");
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("rename:2:eio,write:1+:eio"));
  auto injector = std::make_shared<FaultInjector>(spec);
  FaultInjectingEnv env(Env::Posix(), injector);
  ScopedDefaultEnv scope(env);
  EXPECT_TRUE(injector->has_fs_rules());
  ZINF_ASSERT_OK(WriteFileAtomic(dir.Join("latest"), "step-1.h5\n"));  // rename #1
  EXPECT_THAT(WriteFileAtomic(dir.Join("latest"), "step-2.h5\n"),      // rename #2 fails
              StatusIs(ErrorCode::kDataLoss, HasSubstr("rename")));
  ZINF_ASSERT_OK_AND_ASSIGN(std::string latest, ReadSmallFile(dir.Join("latest"), 64));
  EXPECT_EQ(latest, "step-1.h5\n");  // the old file, and no temporary left
  EXPECT_FALSE(std::ifstream(dir.Join("latest.tmp")).good());
  ZINF_ASSERT_OK(WriteFileAtomic(dir.Join("latest"), "step-3.h5\n"));  // rename #3
  EXPECT_EQ(injector->fs_calls(FsOp::kRename), 3u);
  EXPECT_EQ(injector->injected(), 1u);
}

TEST(FaultInjectingEnvTest, ShortWritesAreContinuedAndCloseStillCloses) {
  ScratchDir dir("env");
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("fwrite:1:short,close:1:eio"));
  FaultInjectingEnv env(Env::Posix(), std::make_shared<FaultInjector>(spec));
  ScopedDefaultEnv scope(env);
  ZINF_ASSERT_OK_AND_ASSIGN(UniqueFd fd,
                            OpenFile(dir.Join("f"), FileAccess::kCreateNew, Follow::kNo));
  ZINF_ASSERT_OK(WriteAll(fd.get(), std::string_view("0123456789"), "f"));
  const int raw = fd.get();
  EXPECT_THAT(fd.Close("f"), StatusIs(ErrorCode::kDataLoss, HasSubstr("close f")));
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed all the same
  ZINF_ASSERT_OK_AND_ASSIGN(std::string text, ReadSmallFile(dir.Join("f"), 64));
  EXPECT_EQ(text, "0123456789");
}

TEST(CreateDirectoriesTest, MakesParentsAndRefusesAFileInTheWay) {
  ScratchDir dir("mkdirs");
  ZINF_ASSERT_OK(CreateDirectories(dir.Join("a/b//c/")));
  ZINF_ASSERT_OK(CreateDirectories(dir.Join("a/b/c")));  // exists: fine
  ZINF_ASSERT_OK(WriteFileAtomic(dir.Join("a/file"), "x"));
  EXPECT_THAT(CreateDirectories(dir.Join("a/file/d")),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a directory")));
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("mkdir:1+:enospc"));
  FaultInjectingEnv env(Env::Posix(), std::make_shared<FaultInjector>(spec));
  ScopedDefaultEnv scope(env);
  EXPECT_THAT(CreateDirectories(dir.Join("new")),
              StatusIs(ErrorCode::kResourceExhausted, HasSubstr("mkdir")));
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

TEST_F(FaultEnvTest, CreateIoBackendWrapsWhenTheVariableIsSet) {
  ::setenv("ZINF_FAULT_INJECT", "write:1:enospc", 1);
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kPosix, {}, dir_.path()));
  EXPECT_EQ(backend->name(), "posix+faults");
  OpenOptions options;
  options.mode = OpenMode::kCreate;
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir_.Join("f"), options));
  alignas(4096) static std::byte data[4096];
  ZINF_ASSERT_OK(backend->Submit(IoRequest{IoOp::kWrite, &file, 0, data}));
  EXPECT_THAT(backend->WaitAll(), StatusIs(ErrorCode::kResourceExhausted, HasSubstr(file.path())));
}

TEST_F(FaultEnvTest, MalformedVariableIsInvalidArgument) {
  ::setenv("ZINF_FAULT_INJECT", "write:3:eio,bogus", 1);
  EXPECT_THAT(CreateIoBackend(IoBackendKind::kPosix, {}, dir_.path()),
              StatusIs(ErrorCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("ZINF_FAULT_INJECT"), HasSubstr("'bogus'"))));
}

TEST_F(FaultEnvTest, OtherRankIsNotWrapped) {
  ::setenv("ZINF_FAULT_INJECT", "write:1:eio,rank=4321", 1);
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kPosix, {}, dir_.path()));
  EXPECT_EQ(backend->name(), "posix");
}

TEST(FaultInjectingBackendTest, RefusesForeignBackends) {
  class Foreign final : public IoBackend {
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
  EXPECT_THAT(FaultInjectingBackend::Wrap(std::make_unique<Foreign>(), injector),
              StatusIs(ErrorCode::kUnimplemented, HasSubstr("foreign")));
}

}  // namespace
}  // namespace zinf::storage
