// MpiSession adopting an MPI that the host program initialized: the session must not finalize it.
// This binary has its own main (the host program's role), so it does not use the MPI test main.
#include <mpi.h>

#include <cstdio>

#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "zinf/comm/mpi_session.h"

namespace zinf::comm {
namespace {

TEST(MpiSession, AdoptsAnInitializedMpiAndLeavesItInitialized) {
  auto session = MpiSession::Init(nullptr, nullptr, ThreadLevel::kSingle);
  ZINF_ASSERT_OK(session);
  EXPECT_FALSE(session->owns_mpi());
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT_EQ(session->world().size(), world_size);
  ZINF_EXPECT_OK(session->world().Barrier());
  ZINF_EXPECT_OK(session->Finalize());
  ZINF_EXPECT_OK(session->Finalize());  // idempotent
  int finalized = 1;
  MPI_Finalized(&finalized);
  EXPECT_EQ(finalized, 0) << "the session finalized an MPI it did not initialize";
}

TEST(MpiSession, RefusesAThreadLevelMpiDidNotProvide) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided >= MPI_THREAD_MULTIPLE) GTEST_SKIP() << "MPI already provides MPI_THREAD_MULTIPLE";
  EXPECT_THAT(MpiSession::Init(nullptr, nullptr, ThreadLevel::kMultiple),
              testing::StatusIs(ErrorCode::kFailedPrecondition,
                                ::testing::HasSubstr("MPI_THREAD_MULTIPLE")));
}

}  // namespace
}  // namespace zinf::comm

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // the host program's MPI
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
