// GoogleTest main for multi-rank tests: initializes MPI through MpiSession, lets rank 0 print the
// usual output and other ranks print only their failures (prefixed with the rank), and makes every
// rank exit with the combined result, so that mpirun's exit code fails when any rank failed.
#include <stdlib.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/test_env.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/check.h"

namespace zinf::testing {
namespace {

comm::Communicator* g_world = nullptr;

// Prints failed assertions of a non-zero rank, one line each.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // The name is taken here: asking UnitTest for the current test inside OnTestPartResult would
  // take gtest's mutex a second time and deadlock.
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_name_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_name_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
  std::string test_name_ = "?";
};

}  // namespace

comm::Communicator& World() {
  ZINF_CHECK(g_world != nullptr, "World() called outside the MPI test main");
  return *g_world;
}

SharedScratchDir::SharedScratchDir(const std::string& tag) {
  if (World().rank() == 0) {
    std::string pattern = TestTmpBase() + "/zinf-" + tag + "-XXXXXX";
    ZINF_CHECK(mkdtemp(pattern.data()) != nullptr, "mkdtemp({}) failed", pattern);
    path_ = pattern;
  }
  Status s = World().BroadcastString(&path_, 0);
  ZINF_CHECK(s.has_value(), "SharedScratchDir: {}", s.error().ToString());
}

SharedScratchDir::~SharedScratchDir() {
  (void)World().Barrier();
  if (World().rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
}

}  // namespace zinf::testing

// --mpi-thread-level=serialized|multiple (the first argument, taken out before gtest sees it):
// the thread level to ask MPI for; funneled otherwise (MpiSession's default).
static zinf::comm::ThreadLevel TakeThreadLevel(int* argc, char** argv) {
  constexpr std::string_view kFlag = "--mpi-thread-level=";
  if (*argc < 2 || !std::string_view(argv[1]).starts_with(kFlag)) {
    return zinf::comm::ThreadLevel::kFunneled;
  }
  const std::string_view value = std::string_view(argv[1]).substr(kFlag.size());
  for (int i = 1; i + 1 < *argc; ++i) argv[i] = argv[i + 1];
  --*argc;
  if (value == "serialized") return zinf::comm::ThreadLevel::kSerialized;
  if (value == "multiple") return zinf::comm::ThreadLevel::kMultiple;
  std::fprintf(stderr, "MPI test main: unknown thread level '%.*s'\n",
               static_cast<int>(value.size()), value.data());
  std::exit(2);
}

int main(int argc, char** argv) {
  const zinf::comm::ThreadLevel level = TakeThreadLevel(&argc, argv);
  auto session = zinf::comm::MpiSession::Init(&argc, &argv, level);
  if (!session) {
    std::fprintf(stderr, "MPI test main: %s\n", session.error().ToString().c_str());
    return 1;
  }
  zinf::comm::Communicator& world = session->world();
  zinf::testing::g_world = &world;
  ::testing::InitGoogleTest(&argc, argv);
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new zinf::testing::FailurePrinter(world.rank()));
  }
  // {failed on some rank, skipped everything on every rank}: exit 77 (CTest's Skipped) only
  // when no rank ran a test.
  const int rc = zinf::testing::ExitCode(RUN_ALL_TESTS());
  std::array<std::int32_t, 2> result = {rc != 0 && rc != 77 ? 1 : 0, rc == 77 ? 0 : 1};
  zinf::Status agreed = world.AllreduceInPlace<std::int32_t>(result, zinf::comm::ReduceOp::kMax);
  if (!agreed) {
    std::fprintf(stderr, "MPI test main: combining results: %s\n",
                 agreed.error().ToString().c_str());
    result = {1, 1};
  }
  if (world.rank() == 0 && result[0] != 0) std::fprintf(stderr, "some rank had failures\n");
  zinf::testing::g_world = nullptr;
  (void)session->Finalize();
  return result[0] != 0 ? 1 : result[1] == 0 ? 77 : 0;
}
