// The reduce-scatter of the gradient buckets (Communicator::ReduceScatterSum and MpiBackend's
// ReduceScatterVSum over it); run under mpirun with 1-4 ranks (tests/mpi/CMakeLists.txt). A
// binary of its own: the page-fault test changes glibc's mmap threshold for the whole process.
#include <malloc.h>
#include <sys/resource.h>

#include <cstdint>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/comm/collective_backend.h"

namespace zinf::comm {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;
using testing::World;

// Rank r's value at element i of block q: distinct per rank and position, exact in float.
float Value(int r, int q, std::size_t i) {
  return static_cast<float>(r * 1000 + q * 100) + static_cast<float>(i % 7) * 0.25f;
}

// Uneven blocks, one of them empty: rank q gets 3 * q + 1 elements, but the last rank none.
std::vector<std::int64_t> UnevenCounts(int n) {
  std::vector<std::int64_t> counts;
  for (int q = 0; q < n; ++q) counts.push_back(n > 1 && q == n - 1 ? 0 : 3 * q + 1);
  return counts;
}

std::vector<float> Input(const std::vector<std::int64_t>& counts, int rank) {
  std::vector<float> in;
  for (std::size_t q = 0; q < counts.size(); ++q) {
    for (std::int64_t i = 0; i < counts[q]; ++i) {
      in.push_back(Value(rank, static_cast<int>(q), static_cast<std::size_t>(i)));
    }
  }
  return in;
}

TEST(ReduceScatterSum, EachRankGetsTheSumOfItsBlockInTheRingsOrder) {
  const Communicator& world = World();
  const int n = world.size(), me = world.rank();
  const std::vector<std::int64_t> counts = UnevenCounts(n);
  const std::vector<float> in = Input(counts, me);
  const auto mine = static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]);
  std::vector<float> out(mine, -1.0f), scratch(n > 1 ? mine : 0);
  ZINF_ASSERT_OK(world.ReduceScatterSum<float>(in, out, counts, scratch));
  for (std::size_t i = 0; i < mine; ++i) {
    float want = Value(me, me, i);  // its own, then the rank before it, and so on
    for (int k = 1; k < n; ++k) want += Value((me + n - k) % n, me, i);
    EXPECT_EQ(out[i], want) << "element " << i;  // bitwise: the order is fixed
  }
  // The same as MPI_Reduce_scatter where the sum is exact (integers).
  std::vector<std::int64_t> ints(in.size()), by_mpi(mine), ours(mine);
  for (std::size_t i = 0; i < in.size(); ++i) ints[i] = static_cast<std::int64_t>(in[i] * 4);
  std::vector<std::int64_t> int_scratch(scratch.size());  // exact: any order gives MPI's sum
  ZINF_ASSERT_OK(world.ReduceScatter<std::int64_t>(ints, by_mpi, counts, ReduceOp::kSum));
  ZINF_ASSERT_OK(world.ReduceScatterSum<std::int64_t>(ints, ours, counts, int_scratch));
  EXPECT_EQ(ours, by_mpi);
}

TEST(ReduceScatterSum, OneRankWithAShortScratchFailsOnEveryRank) {
  const Communicator& world = World();
  const int n = world.size(), me = world.rank();
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), 2);
  const std::vector<float> in(2 * static_cast<std::size_t>(n), 1.0f);
  std::vector<float> out(2);
  // The last rank's scratch is one element short (with one rank: it needs none, so its
  // out is one short instead).
  const bool bad = me == n - 1;
  std::vector<float> scratch(n > 1 ? (bad ? 1 : 2) : 0);
  if (bad && n == 1) out.resize(1);
  const Status status = world.ReduceScatterSum<float>(in, out, counts, scratch);
  EXPECT_THAT(status, StatusIs(ErrorCode::kInvalidArgument,
                               HasSubstr(n > 1 ? "scratch has 1 elements, needs 2"
                                               : "out has 1 elements")));
  // The communicator is still usable, in step on every rank.
  std::vector<float> scratch_ok(n > 1 ? 2 : 0);
  out.assign(2, 0.0f);
  ZINF_ASSERT_OK(world.ReduceScatterSum<float>(in, out, counts, scratch_ok));
  EXPECT_THAT(out, ::testing::Each(static_cast<float>(n)));
}

TEST(CollectiveBackend, OneRankWithWrongCountsFailsOnEveryRank) {
  const Communicator& world = World();
  const int n = world.size(), me = world.rank();
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateCollectiveBackend(world, BackendKind::kMpi));
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), 2);
  if (me == n - 1) counts.push_back(2);  // one count too many
  const std::vector<float> in(2 * static_cast<std::size_t>(n), 1.0f);
  std::vector<float> out(2);
  EXPECT_THAT(backend->ReduceScatterVSum(in, counts, out),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("counts for")));
}

long ThreadMinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

// The cause of the slow gradient reduction at step(): MPI_Reduce_scatter allocated temporaries
// as large as the bucket on every call, which glibc gave back to the kernel in between (always
// once the mmap threshold is fixed, as the engine does when host memory is tight; on the main
// thread's heap also without), so that each call faulted in ~8,000 fresh pages for a 16 MiB
// bucket. Once a size has been seen, a reduction faults in (almost) nothing, on any thread.
TEST(CollectiveBackend, ReduceScatterVSumFaultsInNoPagesOnceTheSizeWasSeen) {
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 1 << 20), 1);
  const Communicator& world = World();
  const int n = world.size(), me = world.rank();
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateCollectiveBackend(world, BackendKind::kMpi));
  constexpr std::int64_t kBucket = 4 << 20;  // floats: 16 MiB, as reduce_bucket_size 4 Mi
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), kBucket / n);
  counts.back() += kBucket % n;
  const std::vector<float> in(static_cast<std::size_t>(kBucket), 1.0f);
  std::vector<float> out(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]));
  ZINF_ASSERT_OK(backend->ReduceScatterVSum(in, counts, out));  // the first sees the size
  constexpr int kCalls = 4;
  auto reduce = [&](long* faults) {
    for (int c = 0; c < kCalls; ++c) {
      const long before = ThreadMinorFaults();
      const Status status = backend->ReduceScatterVSum(in, counts, out);
      *faults += ThreadMinorFaults() - before;
      if (!status) ADD_FAILURE() << status.error().message();
    }
  };
  long main_faults = 0, worker_faults = 0;
  reduce(&main_faults);
  std::thread([&] { reduce(&worker_faults); }).join();
  EXPECT_THAT(out, ::testing::Each(static_cast<float>(n)));
  // A 16 MiB bucket is 4096 pages; a few pages of MPI's own bookkeeping are allowed.
  constexpr long kAllowed = 64 * kCalls;
  EXPECT_LE(main_faults, kAllowed) << "pages faulted in by " << kCalls << " calls";
  EXPECT_LE(worker_faults, kAllowed) << "pages faulted in by " << kCalls << " calls";
}

}  // namespace
}  // namespace zinf::comm
