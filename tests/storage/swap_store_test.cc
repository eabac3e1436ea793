#include "zinf/storage/swap_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <fstream>

#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fault_injection.h"
#include "zinf/storage/io_backend.h"

namespace zinf::storage {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::zinf::testing::IsOk;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::TmpfsMount;

namespace fs = std::filesystem;

std::string UniqueJob(const std::string& tag) { return fmt::format("{}-{}", tag, ::getpid()); }

SwapStoreOptions MakeOptions(std::vector<std::string> paths, const std::string& job,
                             std::uint64_t stripe_unit_bytes = 64 * kKiB) {
  SwapStoreOptions options;
  options.paths = std::move(paths);
  options.job_id = job;
  options.world_rank = 3;
  options.stripe_unit_bytes = stripe_unit_bytes;
  return options;
}

// Deterministic bytes that differ per tensor and per position.
std::vector<std::byte> Pattern(const std::string& name, std::uint64_t size_bytes) {
  std::uint64_t state = std::hash<std::string>{}(name) | 1;
  std::vector<std::byte> out(size_bytes);
  for (std::uint64_t i = 0; i < size_bytes; ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    out[i] = static_cast<std::byte>(state >> 56);
  }
  return out;
}

std::vector<std::byte> RawRead(const std::string& path, std::uint64_t offset_bytes,
                               std::uint64_t length_bytes) {
  std::vector<std::byte> out(length_bytes);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
  if (fd < 0) return out;
  const ssize_t n = ::pread(fd, out.data(), length_bytes, static_cast<off_t>(offset_bytes));
  EXPECT_EQ(n, static_cast<ssize_t>(length_bytes)) << path;
  ::close(fd);
  return out;
}

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

std::string ReadFileText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

Result<AlignedBuffer> IoBuffer(const SwapStore& store, std::uint64_t size_bytes) {
  BufferOptions options;
  options.alignment = std::bit_ceil(std::max<std::uint64_t>(store.alignment(), 4096));
  options.register_cuda = false;
  return AlignedBuffer::Allocate(std::max<std::uint64_t>(size_bytes, 1), options);
}

Result<std::unique_ptr<IoBackend>> MakeIoBackend(const std::string& dir) {
  AioOptions aio;
  aio.block_size = 64 * kKiB;
  aio.queue_depth = 8;
  return CreateIoBackend(IoBackendKind::kAuto, aio, dir);
}

const std::vector<TensorSpec> kOddTensors = {
    {"sg0/fp32", 1},
    {"sg0/exp_avg", 4095},
    {"sg0/exp_avg_sq", 4097},
    {"sg0/grad", 100'003},
    {"sg1/fp32", 3 * 64 * 1024 + 17},
    {"sg1/exp_avg", 64 * 1024},
    {"sg1/exp_avg_sq", 12345},
    {"sg1/grad", 2 * 64 * 1024 - 1},
};

class SwapStoreBackendTest : public ::testing::TestWithParam<IoBackendKind> {};

TEST_P(SwapStoreBackendTest, OddSizedTensorsRoundTrip) {
  ScratchDir dir("swap");
  ZINF_ASSERT_OK_AND_ASSIGN(auto store,
                            SwapStore::Open(MakeOptions({dir.path()}, UniqueJob("roundtrip"))));
  ZINF_ASSERT_OK(store->Reserve(kOddTensors));
  AioOptions aio;
  aio.block_size = 64 * kKiB;
  auto backend_or = CreateIoBackend(GetParam(), aio, dir.path());
  if (!backend_or && backend_or.error().code() == ErrorCode::kUnimplemented) {
    ZINF_SKIP_MISSING("uring", "backend unavailable: " << backend_or.error().ToString());
  }
  ZINF_ASSERT_OK(backend_or);
  std::unique_ptr<IoBackend> backend = std::move(*backend_or);

  std::vector<AlignedBuffer> buffers;
  std::uint64_t io_bytes = 0;  // what one pass over every tensor asks of the disk
  for (const TensorSpec& spec : kOddTensors) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    EXPECT_EQ(extent.size_bytes, spec.size_bytes);
    EXPECT_EQ(extent.io_size_bytes, AlignUp(spec.size_bytes, store->alignment()));
    io_bytes += extent.io_size_bytes;
    ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    std::memcpy(buffer.data(), data.data(), data.size());
    ZINF_ASSERT_OK(store->SubmitWrite(spec.name, buffer.span(), *backend));
    buffers.push_back(std::move(buffer));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(store->Sync());
  EXPECT_EQ(store->io_counters().write_bytes, io_bytes);
  EXPECT_EQ(store->io_counters().read_bytes, 0u);

  for (std::size_t i = 0; i < kOddTensors.size(); ++i) {
    std::memset(buffers[i].data(), 0xee, buffers[i].size());
    ZINF_ASSERT_OK(store->SubmitRead(kOddTensors[i].name, buffers[i].span(), *backend));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  EXPECT_EQ(store->io_counters().read_bytes, io_bytes);
  for (std::size_t i = 0; i < kOddTensors.size(); ++i) {
    const TensorSpec& spec = kOddTensors[i];
    const std::vector<std::byte> expected = Pattern(spec.name, spec.size_bytes);
    EXPECT_EQ(std::memcmp(buffers[i].data(), expected.data(), expected.size()), 0) << spec.name;
    // The synchronous path reads the same bytes.
    std::vector<std::byte> out(spec.size_bytes);
    ZINF_ASSERT_OK(store->Read(spec.name, out));
    EXPECT_EQ(out, expected) << spec.name;
  }
  EXPECT_EQ(store->io_counters().read_bytes, 2 * io_bytes);
  EXPECT_EQ(store->io_counters().write_bytes, io_bytes);
  ZINF_EXPECT_OK(store->Close());
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapStoreBackendTest,
                         ::testing::Values(IoBackendKind::kPosix, IoBackendKind::kUring),
                         [](const ::testing::TestParamInfo<IoBackendKind>& param_info) {
                           return std::string(IoBackendKindName(param_info.param));
                         });

TEST(SwapStore, SynchronousWriteThenAsynchronousRead) {
  ScratchDir dir("swap");
  ZINF_ASSERT_OK_AND_ASSIGN(auto store,
                            SwapStore::Open(MakeOptions({dir.path()}, UniqueJob("sync"))));
  ZINF_ASSERT_OK(store->Reserve(kOddTensors));
  for (const TensorSpec& spec : kOddTensors) {
    ZINF_ASSERT_OK(store->Write(spec.name, Pattern(spec.name, spec.size_bytes)));
  }
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(dir.path()));
  for (const TensorSpec& spec : kOddTensors) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
    ZINF_ASSERT_OK(store->SubmitRead(spec.name, buffer.span(), *backend));
    ZINF_ASSERT_OK(backend->WaitAll());
    const std::vector<std::byte> expected = Pattern(spec.name, spec.size_bytes);
    EXPECT_EQ(std::memcmp(buffer.data(), expected.data(), expected.size()), 0) << spec.name;
  }
}

// Every file-system call the store makes goes through the Env: a clean run counts them, then each
// one fails in turn. Each failure is an error naming its call, or (an advisory call) no error at
// all; either way what was written reads back intact or not at all, and nothing hangs or crashes.
TEST(SwapStore, EveryFileSystemCallFailsCleanly) {
  ScratchDir dir("swap-faults");
  const std::vector<TensorSpec> tensors = {{"a", 4097}, {"b", 3 * 64 * 1024 + 5}};
  int run = 0;
  // Open, reserve, write and read back, close; the first error is returned.
  auto round_trip = [&]() -> Status {
    ZINF_ASSIGN_OR_RETURN(
        auto store,
        SwapStore::Open(MakeOptions({dir.path()}, UniqueJob(fmt::format("faults{}", run++)))));
    Status status = store->Reserve(tensors);
    for (const TensorSpec& spec : tensors) {
      if (!status.has_value()) break;
      status = store->Write(spec.name, Pattern(spec.name, spec.size_bytes));
    }
    for (const TensorSpec& spec : tensors) {
      if (!status.has_value()) break;
      std::vector<std::byte> out(spec.size_bytes);
      status = store->Read(spec.name, out);
      if (status.has_value() && out != Pattern(spec.name, spec.size_bytes)) {
        status = DataLossError("read back differs: " + spec.name);
      }
    }
    const Status closed = store->Close();
    return status.has_value() ? closed : status;
  };
  auto counter = std::make_shared<FaultInjector>(FaultSpec{});
  {
    FaultInjectingEnv env(Env::Posix(), counter);
    ScopedDefaultEnv scope(env);
    ZINF_ASSERT_OK(round_trip());
  }
  // The calls this test exists for, each made at least once.
  for (FsOp op : {FsOp::kPWrite, FsOp::kPRead, FsOp::kFlock, FsOp::kChmod, FsOp::kOpen,
                  FsOp::kFallocate, FsOp::kMkdir, FsOp::kFcntl}) {
    EXPECT_GT(counter->fs_calls(op), 0u) << FsOpName(op);
  }
  int failed = 0, injected = 0;
  for (int i = 0; i < kNumFsOps; ++i) {
    const FsOp op = static_cast<FsOp>(i);
    for (std::uint64_t nth = 1; nth <= counter->fs_calls(op); ++nth) {
      FaultSpec spec;
      spec.rules.push_back({.op = std::nullopt, .fs_op = op, .nth = nth, .kind = FaultKind::kEio});
      FaultInjectingEnv env(Env::Posix(), std::make_shared<FaultInjector>(spec));
      ScopedDefaultEnv scope(env);
      const Status status = round_trip();
      ++injected;
      if (status.has_value()) continue;  // advisory, or retried
      SCOPED_TRACE(fmt::format("{} #{}: {}", FsOpName(op), nth, status.error().ToString()));
      ++failed;
      // The message names the call, in the words the store uses for it.
      const std::string_view name = FsOpName(op);
      const std::string_view word = name == "open"          ? "create"
                                    : name == "unlink"      ? "remove"
                                    : name == "statfs"      ? "statvfs"
                                    : name.starts_with('f') ? name.substr(1)  // fwrite: "write"
                                                            : name;
      const std::string& message = status.error().message();
      EXPECT_TRUE(message.find(name) != std::string::npos ||
                  message.find(word) != std::string::npos)
          << message;
    }
  }
  std::printf("%d injected failures, %d reported as errors\n", injected, failed);
  EXPECT_GT(failed, 0);
}

TEST(SwapStore, StripesUnitsRoundRobinAcrossThreePaths) {
  ScratchDir a("swap-a"), b("swap-b"), c("swap-c");
  constexpr std::uint64_t kUnit = 4096;
  const std::string job = UniqueJob("stripe");
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto store, SwapStore::Open(MakeOptions({a.path(), b.path(), c.path()}, job, kUnit)));
  const std::vector<TensorSpec> specs = {
      {"t0", 5 * kUnit + 100}, {"t1", 2 * kUnit}, {"t2", 1}, {"t3", 4 * kUnit - 7}};
  ZINF_ASSERT_OK(store->Reserve(specs));
  EXPECT_EQ(store->total_units(), 6u + 2u + 1u + 4u);
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(a.path()));
  std::vector<AlignedBuffer> buffers;
  for (const TensorSpec& spec : specs) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    std::memcpy(buffer.data(), data.data(), data.size());
    ZINF_ASSERT_OK_AND_ASSIGN(std::vector<std::uint64_t> ids,
                              store->SubmitWrite(spec.name, buffer.span(), *backend));
    // One request per stripe unit: consecutive units never sit side by side in one file.
    EXPECT_EQ(ids.size(), extent.num_units) << spec.name;
    buffers.push_back(std::move(buffer));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(store->Sync());

  const std::vector<std::string> files = {a.path() + "/zinf-" + job + "/rank3/swap.bin",
                                          b.path() + "/zinf-" + job + "/rank3/swap.bin",
                                          c.path() + "/zinf-" + job + "/rank3/swap.bin"};
  // 13 units: paths 0, 1, 2 hold 5, 4, 4 units.
  EXPECT_EQ(fs::file_size(files[0]), 5 * kUnit);
  EXPECT_EQ(fs::file_size(files[1]), 4 * kUnit);
  EXPECT_EQ(fs::file_size(files[2]), 4 * kUnit);
  for (const TensorSpec& spec : specs) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    for (std::uint64_t i = 0; i < extent.num_units; ++i) {
      const std::uint64_t g = extent.first_unit + i;
      const std::uint64_t length = std::min(kUnit, spec.size_bytes - i * kUnit);
      const std::vector<std::byte> raw = RawRead(files[g % 3], (g / 3) * kUnit, length);
      EXPECT_TRUE(std::equal(raw.begin(), raw.end(), data.begin() + i * kUnit))
          << spec.name << " unit " << i << " (global " << g << ") in " << files[g % 3];
    }
  }
}

TEST(SwapStore, DirectoriesAre0700AndFiles0600WhateverTheUmask) {
  ScratchDir dir("swap");
  const std::string job = UniqueJob("modes");
  const std::string job_dir = dir.path() + "/zinf-" + job;
  // A job directory left too open (e.g. by another rank's older run) is tightened.
  ASSERT_EQ(::mkdir(job_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(job_dir.c_str(), 0777), 0);
  const mode_t old_umask = ::umask(0);
  auto store = SwapStore::Open(MakeOptions({dir.path()}, job));
  ::umask(old_umask);
  ZINF_ASSERT_OK(store);
  ZINF_ASSERT_OK((*store)->Reserve({{"x", 5000}}));
  EXPECT_EQ(ModeOf(job_dir), 0700u);
  EXPECT_EQ(ModeOf(job_dir + "/rank3"), 0700u);
  EXPECT_EQ(ModeOf(job_dir + "/rank3/swap.bin"), 0600u);
  EXPECT_EQ(ModeOf(job_dir + "/rank3/manifest"), 0600u);
  EXPECT_EQ((*store)->directory(0), job_dir + "/rank3");
}

TEST(SwapStore, RefusesSymlinkedPath) {
  ScratchDir dir("swap");
  ASSERT_EQ(::mkdir(dir.Join("real").c_str(), 0700), 0);
  ASSERT_EQ(::symlink(dir.Join("real").c_str(), dir.Join("link").c_str()), 0);
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.Join("link")}, UniqueJob("symlink"))),
              StatusIs(ErrorCode::kFailedPrecondition,
                       AllOf(HasSubstr(dir.Join("link")), HasSubstr("symbolic link"))));
  // A trailing slash must not sneak past O_NOFOLLOW.
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.Join("link") + "/"}, UniqueJob("symlink"))),
              StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_TRUE(fs::is_empty(dir.Join("real")));
}

TEST(SwapStore, RefusesSymlinkedJobAndRankDirectories) {
  ScratchDir dir("swap"), elsewhere("swap-elsewhere");
  const std::string job = UniqueJob("symlink2");
  const std::string job_dir = dir.path() + "/zinf-" + job;
  ASSERT_EQ(::symlink(elsewhere.path().c_str(), job_dir.c_str()), 0);
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.path()}, job)),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr(job_dir)));
  EXPECT_TRUE(fs::is_empty(elsewhere.path()));

  ASSERT_EQ(::unlink(job_dir.c_str()), 0);
  ASSERT_EQ(::mkdir(job_dir.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(elsewhere.path().c_str(), (job_dir + "/rank3").c_str()), 0);
  SwapStoreOptions options = MakeOptions({dir.path()}, job);
  options.resume = true;
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kFailedPrecondition,
                       AllOf(HasSubstr(job_dir + "/rank3"), HasSubstr("symbolic link"))));
  EXPECT_TRUE(fs::is_empty(elsewhere.path()));
  // The failed open removed nothing it did not create.
  EXPECT_TRUE(fs::is_symlink(job_dir + "/rank3"));
}

TEST(SwapStore, RefusesStoreOwnedByAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to another uid";
  ScratchDir dir("swap");
  SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("owner"));
  options.keep = true;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    ZINF_ASSERT_OK(store->Close());
  }
  const std::string rank_dir = dir.path() + "/zinf-" + options.job_id + "/rank3";
  ASSERT_EQ(::chown(rank_dir.c_str(), 65534, 65534), 0) << std::strerror(errno);
  options.resume = true;
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kFailedPrecondition,
                       AllOf(HasSubstr(rank_dir), HasSubstr("owned by uid 65534"))));
  options.resume = false;
  EXPECT_THAT(SwapStore::Open(options), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_TRUE(fs::exists(rank_dir + "/swap.bin"));
}

TEST(SwapStore, ExistingStoreWithoutResumeIsAlreadyExists) {
  ScratchDir dir("swap");
  const SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("exists"));
  ZINF_ASSERT_OK_AND_ASSIGN(auto first, SwapStore::Open(options));
  ZINF_ASSERT_OK(first->Reserve({{"x", 100}}));
  ZINF_ASSERT_OK(first->Write("x", Pattern("x", 100)));
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kAlreadyExists,
                       AllOf(HasSubstr(first->directory(0)), HasSubstr(options.job_id),
                             HasSubstr("another running instance"))));
  // The refused instance left the running one alone.
  std::vector<std::byte> out(100);
  ZINF_ASSERT_OK(first->Read("x", out));
  EXPECT_EQ(out, Pattern("x", 100));
  // Another job on the same path gets its own store.
  ZINF_ASSERT_OK_AND_ASSIGN(auto other,
                            SwapStore::Open(MakeOptions({dir.path()}, UniqueJob("exists2"))));
  EXPECT_NE(other->directory(0), first->directory(0));
}

TEST(SwapStore, ResumeReopensAndDataSurvives) {
  ScratchDir a("swap-a"), b("swap-b");
  SwapStoreOptions options = MakeOptions({a.path(), b.path()}, UniqueJob("resume"), 4096);
  options.keep = true;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    EXPECT_FALSE(store->resumed());
    ZINF_ASSERT_OK(store->Reserve(kOddTensors));
    for (const TensorSpec& spec : kOddTensors) {
      ZINF_ASSERT_OK(store->Write(spec.name, Pattern(spec.name, spec.size_bytes)));
    }
    ZINF_ASSERT_OK(store->Close());
  }
  options.resume = true;
  {
    // A different layout is refused, and nothing of it is reserved.
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    EXPECT_TRUE(store->resumed());
    std::vector<TensorSpec> changed = kOddTensors;
    changed[2].size_bytes += 1;
    EXPECT_THAT(store->Reserve(changed),
                StatusIs(ErrorCode::kFailedPrecondition,
                         AllOf(HasSubstr(kOddTensors[2].name), HasSubstr("layout changed"))));
    EXPECT_THAT(store->Extent(kOddTensors[0].name), StatusIs(ErrorCode::kNotFound));
    ZINF_ASSERT_OK(store->Close());  // keep: the store stays
  }
  {
    // A different stripe unit is refused at Open.
    SwapStoreOptions other_unit = options;
    other_unit.stripe_unit_bytes = 8192;
    EXPECT_THAT(SwapStore::Open(other_unit),
                StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("stripe_unit_bytes 4096")));
  }
  options.keep = false;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    EXPECT_TRUE(store->resumed());
    ZINF_ASSERT_OK(store->Reserve(kOddTensors));
    for (const TensorSpec& spec : kOddTensors) {
      std::vector<std::byte> out(spec.size_bytes);
      ZINF_ASSERT_OK(store->Read(spec.name, out));
      EXPECT_EQ(out, Pattern(spec.name, spec.size_bytes)) << spec.name;
    }
    // New tensors after the resumed ones extend the store.
    ZINF_ASSERT_OK(store->Reserve({{"extra", 10'000}}));
    ZINF_ASSERT_OK(store->Write("extra", Pattern("extra", 10'000)));
    std::vector<std::byte> out(10'000);
    ZINF_ASSERT_OK(store->Read("extra", out));
    EXPECT_EQ(out, Pattern("extra", 10'000));
    ZINF_ASSERT_OK(store->Close());
  }
  EXPECT_FALSE(fs::exists(a.path() + "/zinf-" + options.job_id));
  EXPECT_FALSE(fs::exists(b.path() + "/zinf-" + options.job_id));
}

TEST(SwapStore, ResumeOfTruncatedStoreIsDataLoss) {
  ScratchDir dir("swap");
  SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("truncated"), 4096);
  options.keep = true;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    ZINF_ASSERT_OK(store->Reserve({{"x", 3 * 4096}}));
    ZINF_ASSERT_OK(store->Close());
  }
  const std::string file = dir.path() + "/zinf-" + options.job_id + "/rank3/swap.bin";
  fs::resize_file(file, 4096);
  options.resume = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  EXPECT_THAT(store->Reserve({{"x", 3 * 4096}}),
              StatusIs(ErrorCode::kDataLoss, AllOf(HasSubstr(file), HasSubstr("truncated"))));
}

TEST(SwapStore, PreflightRefusesMoreThanAvailableWithoutAllocating) {
  ScratchDir a("swap-a"), b("swap-b");
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(a.path().c_str(), &vfs), 0);
  const std::uint64_t available = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  const std::uint64_t unit = 1 * kMiB;
  SwapStoreOptions options = MakeOptions({a.path(), b.path()}, UniqueJob("preflight"), unit);
  // Two paths on one file system: each needs ~60% of the free space, together 120%.
  const std::uint64_t half = AlignUp(available * 6 / 10, 2 * unit);
  const std::vector<TensorSpec> specs = {{"big", 2 * half}};

  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<PathSpace> plan, SwapStore::PlanSpace(options, specs));
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].device_id, plan[1].device_id);
  EXPECT_EQ(plan[0].needed_bytes, half);
  EXPECT_EQ(plan[1].needed_bytes, half);
  EXPECT_EQ(plan[0].fs_needed_bytes, 2 * half);
  EXPECT_THAT(SwapStore::CheckSpace(plan),
              StatusIs(ErrorCode::kResourceExhausted,
                       AllOf(HasSubstr(a.path()), HasSubstr(b.path()),
                             HasSubstr(FormatBytes(2 * half)), HasSubstr("available"))));

  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  EXPECT_THAT(store->Reserve(specs),
              StatusIs(ErrorCode::kResourceExhausted,
                       AllOf(HasSubstr(a.path()), HasSubstr(FormatBytes(half)),
                             HasSubstr(FormatBytes(2 * half)), HasSubstr("available"))));
  EXPECT_EQ(fs::file_size(store->file(0).path()), 0u);
  EXPECT_EQ(fs::file_size(store->file(1).path()), 0u);
  EXPECT_THAT(store->Extent("big"), StatusIs(ErrorCode::kNotFound));
  // A small reservation still works afterwards.
  ZINF_EXPECT_OK(store->Reserve({{"small", 3 * unit}}));
  EXPECT_EQ(fs::file_size(store->file(0).path()), 2 * unit);
  EXPECT_EQ(fs::file_size(store->file(1).path()), 1 * unit);
}

TEST(SwapStore, VerifySwapCatchesACorruptedByte) {
  ScratchDir a("swap-a"), b("swap-b");
  SwapStoreOptions options = MakeOptions({a.path(), b.path()}, UniqueJob("verify"), 4096);
  options.verify_swap = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  const std::uint64_t size = 5 * 4096 + 123;
  ZINF_ASSERT_OK(store->Reserve({{"pad", 100}, {"sg0/exp_avg", size}}));
  const std::vector<std::byte> data = Pattern("sg0/exp_avg", size);
  ZINF_ASSERT_OK(store->Write("sg0/exp_avg", data));
  std::vector<std::byte> out(size);
  ZINF_ASSERT_OK(store->Read("sg0/exp_avg", out));
  ZINF_ASSERT_OK(store->Sync());

  // Unit 2 of the tensor is global unit 1 + 2 = 3: path 1, file offset 4096.
  ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent("sg0/exp_avg"));
  ASSERT_EQ(extent.first_unit, 1u);
  const std::string file = store->file(1).path();
  {
    const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    const std::byte flipped = data[2 * 4096 + 77] ^ std::byte{0x40};
    ASSERT_EQ(::pwrite(fd, &flipped, 1, 4096 + 77), 1);
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
  EXPECT_THAT(store->Read("sg0/exp_avg", out),
              StatusIs(ErrorCode::kDataLoss,
                       AllOf(HasSubstr("sg0/exp_avg"), HasSubstr(file), HasSubstr("offset 4096"),
                             HasSubstr("checksum mismatch"))));

  // The asynchronous path: read, then VerifyRead.
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(a.path()));
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
  ZINF_ASSERT_OK(store->SubmitRead("sg0/exp_avg", buffer.span(), *backend));
  ZINF_ASSERT_OK(backend->WaitAll());
  const auto bytes = std::span<const std::byte>(buffer.span()).first(size);
  EXPECT_THAT(store->VerifyRead("sg0/exp_avg", bytes), StatusIs(ErrorCode::kDataLoss));
  // Units not covered by the corruption verify fine on their own.
  ZINF_EXPECT_OK(store->VerifyRead("sg0/exp_avg", bytes.first(2 * 4096)));
  // Rewriting the tensor records fresh checksums.
  ZINF_ASSERT_OK(store->Write("sg0/exp_avg", data));
  ZINF_EXPECT_OK(store->Read("sg0/exp_avg", out));
  EXPECT_EQ(out, data);
}

TEST(SwapStore, RangeWritesStreamChunksAndMisalignedRangesAreRefused) {
  ScratchDir dir("swap");
  SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("range"), 64 * kKiB);
  options.verify_swap = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  const std::uint64_t size = 5 * 64 * kKiB + 999;
  ZINF_ASSERT_OK(store->Reserve({{"t", size}}));
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(dir.path()));
  const std::vector<std::byte> data = Pattern("t", size);
  const std::uint64_t chunk = 2 * 64 * kKiB;
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, chunk));
  for (std::uint64_t offset = 0; offset < size; offset += chunk) {
    const std::uint64_t length = std::min(chunk, size - offset);
    std::memcpy(buffer.data(), data.data() + offset, length);
    ZINF_ASSERT_OK(store->SubmitWriteRange("t", offset, length, buffer.span(), *backend));
    ZINF_ASSERT_OK(backend->WaitAll());
  }
  std::vector<std::byte> out(size);
  ZINF_ASSERT_OK(store->Read("t", out));  // checksums recorded per chunk match
  EXPECT_EQ(out, data);

  // Read a middle chunk back asynchronously.
  ZINF_ASSERT_OK(store->SubmitReadRange("t", chunk, chunk, buffer.span(), *backend));
  ZINF_ASSERT_OK(backend->WaitAll());
  EXPECT_EQ(std::memcmp(buffer.data(), data.data() + chunk, chunk), 0);
  ZINF_EXPECT_OK(
      store->VerifyRead("t", std::span<const std::byte>(buffer.span()).first(chunk), chunk));

  EXPECT_THAT(store->SubmitReadRange("t", size, 1, buffer.span(), *backend),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(store->SubmitRead("t", buffer.span(), *backend),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("buffer of")));
  if (store->alignment() > 1) {
    EXPECT_THAT(store->SubmitReadRange("t", 1, 4096, buffer.span(), *backend),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not aligned")));
    EXPECT_THAT(store->SubmitReadRange("t", 0, store->alignment() + 1, buffer.span(), *backend),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not aligned")));
    EXPECT_THAT(store->SubmitReadRange("t", 0, 4096, buffer.span().subspan(1), *backend),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not aligned")));
  }
  EXPECT_EQ(backend->pending(), 0u);
}

TEST(SwapStore, CloseRemovesTheStoreUnlessKeep) {
  ScratchDir dir("swap");
  const SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("cleanup"));
  const std::string job_dir = dir.path() + "/zinf-" + options.job_id;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    ZINF_ASSERT_OK(store->Reserve({{"x", 1000}}));
    EXPECT_TRUE(fs::exists(job_dir + "/rank3/swap.bin"));
    ZINF_ASSERT_OK(store->Close());
    ZINF_EXPECT_OK(store->Close());  // idempotent
    EXPECT_FALSE(fs::exists(job_dir));
  }
  {
    // The destructor cleans up too; the job directory stays while another rank uses it.
    ASSERT_EQ(::mkdir(job_dir.c_str(), 0700), 0);
    ASSERT_EQ(::mkdir((job_dir + "/rank0").c_str(), 0700), 0);
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    store.reset();
    EXPECT_FALSE(fs::exists(job_dir + "/rank3"));
    EXPECT_TRUE(fs::exists(job_dir + "/rank0"));
    fs::remove_all(job_dir);
  }
  {
    SwapStoreOptions keep = options;
    keep.keep = true;
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(keep));
    ZINF_ASSERT_OK(store->Reserve({{"x", 1000}}));
    ZINF_ASSERT_OK(store->Close());
    EXPECT_TRUE(fs::exists(job_dir + "/rank3/swap.bin"));
  }
}

TEST(SwapStore, InvalidOptionsAreRefused) {
  ScratchDir dir("swap");
  for (const char* job : {"", "../x", "a/b", "a..b", "..", "job id", "x\n"}) {
    EXPECT_THAT(SwapStore::Open(MakeOptions({dir.path()}, job)),
                StatusIs(ErrorCode::kInvalidArgument))
        << "'" << job << "'";
  }
  EXPECT_THAT(SwapStore::Open(MakeOptions({}, "j")), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.path(), dir.path() + "/"}, "j")),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("twice")));
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.Join("missing")}, "j")),
              StatusIs(ErrorCode::kNotFound, HasSubstr(dir.Join("missing"))));
  EXPECT_THAT(SwapStore::Open(MakeOptions({dir.path()}, "j", 0)),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_TRUE(fs::is_empty(dir.path()));

  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(MakeOptions({dir.path()}, "j")));
  const std::uint64_t alignment = store->alignment();
  EXPECT_THAT(store->Reserve({{"a b", 10}}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(store->Reserve({{"", 10}}), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(store->Reserve({{"x", 10}, {"x", 20}}), StatusIs(ErrorCode::kAlreadyExists));
  ZINF_ASSERT_OK(store->Reserve({{"x", 10}}));
  EXPECT_THAT(store->Reserve({{"x", 10}}), StatusIs(ErrorCode::kAlreadyExists));
  EXPECT_THAT(store->Write("x", Pattern("x", 11)), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(store->Write("y", Pattern("y", 10)), StatusIs(ErrorCode::kNotFound));
  ZINF_ASSERT_OK(store->Close());

  if (alignment > 1) {
    EXPECT_THAT(SwapStore::Open(MakeOptions({dir.path()}, "j2", alignment + alignment / 2)),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("alignment")));
    EXPECT_FALSE(fs::exists(dir.Join("zinf-j2")));
  }
}

TEST(SwapStore, TinyTmpfsRoundTripsAndPreflightCatchesEnospc) {
  ScratchDir dir("swap-tmpfs");
  TmpfsMount mount(dir.path(), "2m");
  if (!mount.mounted()) ZINF_SKIP_MISSING("tmpfs", "cannot mount a tmpfs here: " << mount.error());
  SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("tmpfs"), 64 * kKiB);
  options.verify_swap = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  // Older kernels have no O_DIRECT on tmpfs (the files fall back to buffered I/O); since Linux
  // 6.6 tmpfs accepts it. Either way the store works; BufferedStoreWorks covers the fallback.
  RecordProperty("tmpfs_direct", store->direct() ? "yes" : "no");
  ZINF_ASSERT_OK(store->Reserve({{"a", 300'001}}));
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(dir.path()));
  ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent("a"));
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
  const std::vector<std::byte> data = Pattern("a", 300'001);
  std::memcpy(buffer.data(), data.data(), data.size());
  ZINF_ASSERT_OK(store->SubmitWrite("a", buffer.span(), *backend));
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(store->Sync());
  std::vector<std::byte> out(data.size());
  ZINF_ASSERT_OK(store->Read("a", out));
  EXPECT_EQ(out, data);

  // 4 MiB more cannot fit in 2 MiB: refused before fallocate could hit ENOSPC.
  EXPECT_THAT(store->Reserve({{"b", 4 * kMiB}}),
              StatusIs(ErrorCode::kResourceExhausted,
                       AllOf(HasSubstr(dir.path()), HasSubstr(FormatBytes(4 * kMiB)),
                             HasSubstr("available"))));
  EXPECT_EQ(fs::file_size(store->file(0).path()), extent.padded_size_bytes);
  ZINF_ASSERT_OK(store->Close());
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SwapStore, BufferedStoreWorks) {
  // direct = false forces what File does where O_DIRECT is unsupported: buffered I/O with
  // alignment 1, made durable by Sync().
  ScratchDir a("swap-a"), b("swap-b");
  SwapStoreOptions options = MakeOptions({a.path(), b.path()}, UniqueJob("buffered"), 4096);
  options.direct = false;
  options.verify_swap = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  EXPECT_FALSE(store->direct());
  EXPECT_EQ(store->alignment(), 1u);
  ZINF_ASSERT_OK(store->Reserve(kOddTensors));
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, MakeIoBackend(a.path()));
  std::vector<AlignedBuffer> buffers;
  for (const TensorSpec& spec : kOddTensors) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    EXPECT_EQ(extent.io_size_bytes, spec.size_bytes);
    ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, extent.io_size_bytes));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    std::memcpy(buffer.data(), data.data(), data.size());
    ZINF_ASSERT_OK(store->SubmitWrite(spec.name, buffer.span(), *backend));
    buffers.push_back(std::move(buffer));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(store->Sync());
  for (const TensorSpec& spec : kOddTensors) {
    std::vector<std::byte> out(spec.size_bytes);
    ZINF_ASSERT_OK(store->Read(spec.name, out));
    EXPECT_EQ(out, Pattern(spec.name, spec.size_bytes)) << spec.name;
  }
  // An unaligned middle range is fine without O_DIRECT.
  ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent("sg0/grad"));
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, IoBuffer(*store, 1000));
  ZINF_ASSERT_OK(store->SubmitReadRange("sg0/grad", 4097, 1000, buffer.span(), *backend));
  ZINF_ASSERT_OK(backend->WaitAll());
  const std::vector<std::byte> expected = Pattern("sg0/grad", extent.size_bytes);
  EXPECT_EQ(std::memcmp(buffer.data(), expected.data() + 4097, 1000), 0);
}

// ---- Stale stores: what killed processes leave behind, and ReclaimStale ----

// Runs `body` in a forked child that then ends with _exit: no destructor, no Close(), exactly
// what a process killed with SIGKILL leaves behind (the kernel drops its flocks). Returns true
// when the child got through `body` (exit status 0).
bool RunAndDie(const std::function<bool()>& body) {
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) ::_exit(body() ? 0 : 1);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// A store of `options` with one tensor written, opened in a child that dies without cleaning up.
bool LeaveStaleStore(const SwapStoreOptions& options, std::uint64_t size_bytes = 100'000) {
  return RunAndDie([&] {
    auto store = SwapStore::Open(options);
    if (!store) return false;
    if (!(*store)->Reserve({{"x", size_bytes}})) return false;
    if (!(*store)->Write("x", Pattern("x", size_bytes))) return false;
    (void)store->release();  // never closed
    return true;
  });
}

// A child that holds a store of `options` open until Release(), then dies without cleanup.
class LiveChild {
 public:
  explicit LiveChild(const SwapStoreOptions& options) {
    int ready[2], release[2];
    if (::pipe(ready) != 0 || ::pipe(release) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ready[0]);
      ::close(release[1]);
      auto store = SwapStore::Open(options);
      const char ok = store && (*store)->Reserve({{"x", 4096}}) ? 'y' : 'n';
      (void)!::write(ready[1], &ok, 1);
      char byte;
      (void)!::read(release[0], &byte, 1);  // EOF when the parent releases
      ::_exit(0);
    }
    ::close(ready[1]);
    ::close(release[0]);
    release_fd_ = release[1];
    char ok = 'n';
    opened_ = pid_ > 0 && ::read(ready[0], &ok, 1) == 1 && ok == 'y';
    ::close(ready[0]);
  }
  ~LiveChild() { Release(); }
  bool opened() const { return opened_; }
  // Lets the child die (without cleanup) and waits for it.
  void Release() {
    if (release_fd_ >= 0) ::close(release_fd_);
    release_fd_ = -1;
    if (pid_ > 0) {
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int release_fd_ = -1;
  bool opened_ = false;
};

// ReclaimStale with stderr captured into *log.
Result<std::vector<StaleStore>> ReclaimCapturing(const SwapStoreOptions& options,
                                                 std::string* log) {
  ::testing::internal::CaptureStderr();
  Result<std::vector<StaleStore>> found = SwapStore::ReclaimStale(options);
  *log = ::testing::internal::GetCapturedStderr();
  return found;
}

TEST(SwapStore, ReclaimStaleReusesOnlyADeadInstancesStore) {
  ScratchDir dir("swap");
  SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("stale"));
  options.reclaim_stale = true;
  std::string rank_dir;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto live, SwapStore::Open(options));
    rank_dir = live->directory(0);
    ZINF_ASSERT_OK(live->Reserve({{"x", 100}}));
    // A live instance holds its store: reclaim_stale must not take it.
    EXPECT_THAT(SwapStore::Open(options),
                StatusIs(ErrorCode::kAlreadyExists, HasSubstr("another running instance")));
    std::vector<std::byte> out(100);
    ZINF_ASSERT_OK(live->Read("x", out));
  }
  // A killed instance: its files stay behind, nobody holds the lock.
  ASSERT_TRUE(LeaveStaleStore(options));
  ASSERT_TRUE(fs::exists(rank_dir + "/manifest"));
  options.reclaim_stale = false;
  EXPECT_THAT(SwapStore::Open(options), StatusIs(ErrorCode::kAlreadyExists, HasSubstr("resume")));
  options.reclaim_stale = true;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    EXPECT_FALSE(store->resumed());
    ZINF_ASSERT_OK(store->Reserve({{"y", 64}}));
    ZINF_ASSERT_OK(store->Write("y", Pattern("y", 64)));
    EXPECT_THAT(ReadFileText(rank_dir + "/manifest"),
                AllOf(HasSubstr("tensor 64 y\n"), Not(HasSubstr(" x\n"))));
    ZINF_ASSERT_OK(store->Close());
  }
  EXPECT_FALSE(fs::exists(rank_dir));
}

TEST(SwapStoreReclaim, KilledProcesssStoreIsRemovedByAnotherJob) {
  ScratchDir a("swap-a"), b("swap-b");
  const SwapStoreOptions killed = MakeOptions({a.path(), b.path()}, UniqueJob("killed"), 4096);
  ASSERT_TRUE(LeaveStaleStore(killed, 100'000));
  const std::string job_a = a.path() + "/zinf-" + killed.job_id;
  ASSERT_TRUE(fs::exists(job_a + "/rank3/swap.bin"));
  ASSERT_TRUE(fs::exists(job_a + "/rank3/manifest"));
  ASSERT_TRUE(fs::exists(b.path() + "/zinf-" + killed.job_id + "/rank3/swap.bin"));
  // Every path's rank directory carries the manifest that proves it a store.
  EXPECT_EQ(ReadFileText(b.path() + "/zinf-" + killed.job_id + "/rank3/manifest"),
            ReadFileText(job_a + "/rank3/manifest"));
  EXPECT_FALSE(fs::exists(job_a + "/rank3/kept"));

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(
      std::vector<StaleStore> found,
      ReclaimCapturing(MakeOptions({a.path(), b.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].directory, job_a + "/rank3");
  EXPECT_EQ(found[0].job_id, killed.job_id);
  EXPECT_EQ(found[0].world_rank, 3);
  EXPECT_EQ(found[0].action, StaleAction::kRemoved);
  EXPECT_EQ(found[1].action, StaleAction::kRemoved);
  // The tensor's 25 units of 4 KiB, striped over both paths, plus the manifest.
  EXPECT_GE(found[0].size_bytes + found[1].size_bytes, 25u * 4096);
  EXPECT_THAT(log,
              AllOf(HasSubstr("[warn"), HasSubstr("removed the swap store " + job_a + "/rank3"),
                    HasSubstr(FormatBytes(found[0].size_bytes)),
                    HasSubstr("a killed run of job '" + killed.job_id + "'")));
  EXPECT_TRUE(fs::is_empty(a.path()));
  EXPECT_TRUE(fs::is_empty(b.path()));
  // Nothing left: a second scan finds nothing.
  ZINF_ASSERT_OK_AND_ASSIGN(found, SwapStore::ReclaimStale(MakeOptions({a.path()}, "next")));
  EXPECT_TRUE(found.empty());
}

TEST(SwapStoreReclaim, KeptStoreIsReportedWithItsSizeAndLeft) {
  ScratchDir dir("swap");
  SwapStoreOptions kept = MakeOptions({dir.path()}, UniqueJob("kept"));
  kept.keep = true;
  ASSERT_TRUE(LeaveStaleStore(kept, 64 * 1024));
  const std::string rank_dir = dir.path() + "/zinf-" + kept.job_id + "/rank3";
  ASSERT_TRUE(fs::is_regular_file(rank_dir + "/kept"));  // marked at Open, before any Close
  EXPECT_EQ(ModeOf(rank_dir + "/kept"), 0600u);
  // One closed cleanly with keep is marked the same way.
  SwapStoreOptions closed = MakeOptions({dir.path()}, UniqueJob("kept-closed"));
  closed.keep = true;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(closed));
    ZINF_ASSERT_OK(store->Reserve({{"x", 1000}}));
    ZINF_ASSERT_OK(store->Close());
  }

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({dir.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 2u);
  for (const StaleStore& stale : found) {
    EXPECT_EQ(stale.action, StaleAction::kKept) << stale.directory;
    EXPECT_TRUE(fs::exists(stale.directory + "/swap.bin")) << stale.directory;
    EXPECT_THAT(log, AllOf(HasSubstr(stale.directory + " (" + FormatBytes(stale.size_bytes)),
                           HasSubstr("rm -rf " + stale.directory)));
  }
  EXPECT_THAT(log, AllOf(HasSubstr("[warn"), HasSubstr("keep_swap")));
  EXPECT_TRUE(fs::exists(rank_dir + "/swap.bin"));

  // Resumed without keep, the store is no longer kept: a later kill leaves a removable one.
  kept.resume = true;
  kept.keep = false;
  ASSERT_TRUE(RunAndDie([&] {
    auto store = SwapStore::Open(kept);
    const bool ok = store && !fs::exists(rank_dir + "/kept");
    if (store) (void)store->release();
    return ok;
  }));
  ZINF_ASSERT_OK_AND_ASSIGN(found,
                            SwapStore::ReclaimStale(MakeOptions({dir.path()}, UniqueJob("next"))));
  ASSERT_EQ(found.size(), 2u);
  const auto it = std::find_if(found.begin(), found.end(),
                               [&](const StaleStore& s) { return s.directory == rank_dir; });
  ASSERT_NE(it, found.end());
  EXPECT_EQ(it->action, StaleAction::kRemoved);
  EXPECT_FALSE(fs::exists(dir.path() + "/zinf-" + kept.job_id));
}

TEST(SwapStoreReclaim, LiveStoresAreUntouched) {
  ScratchDir dir("swap");
  const SwapStoreOptions here = MakeOptions({dir.path()}, UniqueJob("live-here"));
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(here));
  ZINF_ASSERT_OK(store->Reserve({{"x", 100}}));
  ZINF_ASSERT_OK(store->Write("x", Pattern("x", 100)));
  SwapStoreOptions there = MakeOptions({dir.path()}, UniqueJob("live-child"));
  there.world_rank = 0;
  LiveChild child(there);
  ASSERT_TRUE(child.opened());
  const std::string child_dir = dir.path() + "/zinf-" + there.job_id + "/rank0";

  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            SwapStore::ReclaimStale(MakeOptions({dir.path()}, UniqueJob("next"))));
  EXPECT_TRUE(found.empty());
  EXPECT_TRUE(fs::exists(store->directory(0) + "/swap.bin"));
  EXPECT_TRUE(fs::exists(child_dir + "/swap.bin"));
  std::vector<std::byte> out(100);
  ZINF_ASSERT_OK(store->Read("x", out));
  EXPECT_EQ(out, Pattern("x", 100));

  // Once the child is gone (killed), its store is stale; ours is still live.
  child.Release();
  ZINF_ASSERT_OK_AND_ASSIGN(found,
                            SwapStore::ReclaimStale(MakeOptions({dir.path()}, UniqueJob("next"))));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].directory, child_dir);
  EXPECT_EQ(found[0].action, StaleAction::kRemoved);
  EXPECT_TRUE(fs::exists(store->directory(0) + "/swap.bin"));
  ZINF_ASSERT_OK(store->Close());
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SwapStoreReclaim, OurJobsStaleRankOfAnotherNumberIsRemoved) {
  ScratchDir dir("swap");
  const SwapStoreOptions ours = MakeOptions({dir.path()}, UniqueJob("ours"));
  SwapStoreOptions other_rank = ours;
  other_rank.world_rank = 5;  // e.g. a killed run of the same job_id on more ranks
  ASSERT_TRUE(LeaveStaleStore(other_rank));
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(ours));
  ZINF_ASSERT_OK(store->Reserve({{"x", 100}}));
  const std::string job_dir = dir.path() + "/zinf-" + ours.job_id;

  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found, SwapStore::ReclaimStale(ours));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].directory, job_dir + "/rank5");
  EXPECT_EQ(found[0].world_rank, 5);
  EXPECT_EQ(found[0].action, StaleAction::kRemoved);
  EXPECT_FALSE(fs::exists(job_dir + "/rank5"));
  EXPECT_TRUE(fs::exists(store->directory(0) + "/swap.bin"));  // ours is live: untouched
  ZINF_ASSERT_OK(store->Close());
  EXPECT_FALSE(fs::exists(job_dir));
}

TEST(SwapStoreReclaim, PlantedSymlinksAreNeverFollowed) {
  ScratchDir dir("swap"), elsewhere("swap-elsewhere");
  // Something that looks like a stale store, outside the swap path.
  ASSERT_TRUE(fs::create_directories(elsewhere.Join("rank0")));
  { std::ofstream(elsewhere.Join("rank0/swap.bin")) << "precious"; }
  { std::ofstream(elsewhere.Join("swap.bin")) << "precious"; }
  // A job directory that is a link; a rank directory that is a link; a store file that is a
  // link (only the link goes); the swap path itself given as a link.
  ASSERT_EQ(::symlink(elsewhere.path().c_str(), dir.Join("zinf-planted").c_str()), 0);
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-real/rank2")));
  ASSERT_EQ(::symlink(elsewhere.Join("rank0").c_str(), dir.Join("zinf-real/rank1").c_str()), 0);
  ASSERT_EQ(
      ::symlink(elsewhere.Join("swap.bin").c_str(), dir.Join("zinf-real/rank2/swap.bin").c_str()),
      0);
  ASSERT_EQ(::mkfifo(dir.Join("zinf-real/rank2/manifest").c_str(), 0600), 0);  // never opened
  ASSERT_EQ(::symlink(dir.path().c_str(), elsewhere.Join("swap-link").c_str()), 0);

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(
      std::vector<StaleStore> found,
      ReclaimCapturing(MakeOptions({elsewhere.Join("swap-link")}, UniqueJob("next")), &log));
  EXPECT_TRUE(found.empty());
  EXPECT_THAT(log, HasSubstr("symbolic link"));
  EXPECT_TRUE(fs::exists(dir.Join("zinf-real/rank2/manifest")));

  // A rank directory whose store names are a link and a FIFO is no store: left as it is.
  ZINF_ASSERT_OK_AND_ASSIGN(found,
                            SwapStore::ReclaimStale(MakeOptions({dir.path()}, UniqueJob("next"))));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].directory, dir.Join("zinf-real/rank2"));
  EXPECT_EQ(found[0].action, StaleAction::kLeft);
  EXPECT_TRUE(fs::is_symlink(dir.Join("zinf-real/rank2/swap.bin")));
  EXPECT_TRUE(fs::is_fifo(dir.Join("zinf-real/rank2/manifest")));
  // The links stay, their targets are untouched.
  EXPECT_TRUE(fs::is_symlink(dir.Join("zinf-planted")));
  EXPECT_TRUE(fs::is_symlink(dir.Join("zinf-real/rank1")));
  EXPECT_EQ(ReadFileText(elsewhere.Join("rank0/swap.bin")), "precious");
  EXPECT_EQ(ReadFileText(elsewhere.Join("swap.bin")), "precious");
}

TEST(SwapStoreReclaim, ForeignEntriesAndHugeDirectoriesAreLeftWithAWarning) {
  ScratchDir dir("swap");
  // A stale store with a file a store never has: left as it is.
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-odd/rank0")));
  { std::ofstream(dir.Join("zinf-odd/rank0/swap.bin")) << "x"; }
  { std::ofstream(dir.Join("zinf-odd/rank0/notes.txt")) << "mine"; }
  // A rank directory with more entries than a scan examines.
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-huge/rank0")));
  for (std::size_t i = 0; i < SwapStore::kMaxScanEntries + 3; ++i) {
    const std::string name = dir.Join(fmt::format("zinf-huge/rank0/f{}", i));
    const int fd = ::open(name.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << name;
    ::close(fd);
  }
  // Names that are not stores at all are skipped.
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-../rank0")));
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-x/rank-1")));
  ASSERT_TRUE(fs::create_directories(dir.Join("other/rank0")));

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({dir.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 2u);
  for (const StaleStore& stale : found) {
    EXPECT_EQ(stale.action, StaleAction::kLeft) << stale.directory;
    EXPECT_THAT(log, HasSubstr("rm -rf " + stale.directory));
  }
  EXPECT_THAT(log, HasSubstr(fmt::format("more than {}", SwapStore::kMaxScanEntries)));
  EXPECT_TRUE(fs::exists(dir.Join("zinf-odd/rank0/swap.bin")));
  EXPECT_TRUE(fs::exists(dir.Join("zinf-odd/rank0/notes.txt")));
  EXPECT_TRUE(fs::exists(dir.Join("zinf-x/rank-1")));
  EXPECT_TRUE(fs::exists(dir.Join("other/rank0")));
}

// ---- Only what is provably a store that zinf made is ever removed ----

// Replaces `from` by `to` in the text of the file `path` (once; the test fails without it).
void EditFile(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = ReadFileText(path);
  const std::size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << path << " has no '" << from << "' in:\n" << text;
  text.replace(at, from.size(), to);
  std::ofstream(path, std::ios::trunc) << text;
}

// Opens `options` with reclaim_stale, stderr captured into *log.
Result<std::unique_ptr<SwapStore>> OpenCapturing(SwapStoreOptions options, std::string* log) {
  options.reclaim_stale = true;
  ::testing::internal::CaptureStderr();
  Result<std::unique_ptr<SwapStore>> store = SwapStore::Open(options);
  *log = ::testing::internal::GetCapturedStderr();
  return store;
}

// Issue 41: <nvme_path>/zinf-mynotes/rank0/manifest holding "my notes" was removed as a swap
// store that a killed run of job 'mynotes' left behind.
TEST(SwapStoreReclaim, AUsersDirectoryThatLooksLikeAStoreIsNeverRemoved) {
  ScratchDir dir("swap");
  const std::string job = UniqueJob("mynotes");
  const std::string rank_dir = dir.Join("zinf-" + job + "/rank0");
  ASSERT_TRUE(fs::create_directories(rank_dir));
  { std::ofstream(rank_dir + "/manifest") << "my notes"; }

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({dir.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].directory, rank_dir);
  EXPECT_EQ(found[0].action, StaleAction::kLeft);
  EXPECT_THAT(log, AllOf(HasSubstr("[warn"),
                         HasSubstr(rank_dir + " (8 B) is not provably a swap "
                                              "store that zinf made"),
                         HasSubstr("bad first line"), HasSubstr("rm -rf " + rank_dir)));
  EXPECT_THAT(log, Not(HasSubstr("removed the swap store")));
  EXPECT_EQ(ReadFileText(rank_dir + "/manifest"), "my notes");

  // The same job and rank with reclaim_stale: a clear error, nothing emptied.
  SwapStoreOptions same = MakeOptions({dir.path()}, job);
  same.world_rank = 0;
  EXPECT_THAT(OpenCapturing(same, &log),
              StatusIs(ErrorCode::kAlreadyExists,
                       AllOf(HasSubstr(rank_dir), HasSubstr("not provably a swap store"),
                             HasSubstr("bad first line"), HasSubstr("rm -rf " + rank_dir))));
  EXPECT_THAT(log, Not(HasSubstr("removing")));
  EXPECT_EQ(ReadFileText(rank_dir + "/manifest"), "my notes");
  EXPECT_EQ(std::distance(fs::directory_iterator(rank_dir), fs::directory_iterator()), 1);
}

TEST(SwapStoreReclaim, AManifestWithAWrongChecksumIsNoProof) {
  ScratchDir dir("swap");
  SwapStoreOptions killed = MakeOptions({dir.path()}, UniqueJob("checksum"));
  ASSERT_TRUE(LeaveStaleStore(killed, 4096));
  const std::string rank_dir = dir.Join("zinf-" + killed.job_id + "/rank3");
  // Same length, one digit changed: only the checksum tells.
  EditFile(rank_dir + "/manifest", "tensor 4096 x", "tensor 4097 x");

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({dir.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].action, StaleAction::kLeft);
  EXPECT_THAT(log, AllOf(HasSubstr("checksum mismatch"), HasSubstr("rm -rf " + rank_dir)));
  EXPECT_TRUE(fs::exists(rank_dir + "/swap.bin"));

  EXPECT_THAT(OpenCapturing(killed, &log),
              StatusIs(ErrorCode::kAlreadyExists,
                       AllOf(HasSubstr(rank_dir), HasSubstr("checksum mismatch"))));
  EXPECT_TRUE(fs::exists(rank_dir + "/swap.bin"));
  // Resuming it is DataLoss.
  killed.resume = true;
  EXPECT_THAT(SwapStore::Open(killed),
              StatusIs(ErrorCode::kDataLoss, AllOf(HasSubstr(rank_dir + "/manifest is corrupt"),
                                                   HasSubstr("checksum mismatch"))));
}

// A store of an older zinf (manifest version 2, no checksum) is left with a WARN; resumed, it
// gets a manifest of this version and is removable from then on.
TEST(SwapStoreReclaim, AnOlderVersionsStoreIsLeftUntilResumed) {
  ScratchDir a("swap-a"), b("swap-b");
  SwapStoreOptions old = MakeOptions({a.path(), b.path()}, UniqueJob("v2"), 4096);
  ASSERT_TRUE(LeaveStaleStore(old, 4096));
  const std::string rank_a = a.Join("zinf-" + old.job_id + "/rank3");
  const std::string rank_b = b.Join("zinf-" + old.job_id + "/rank3");
  // What the zinf of version 2 wrote: no checksum line, and a manifest on the first path only.
  std::string text = ReadFileText(rank_a + "/manifest");
  ASSERT_THAT(text, HasSubstr("zinf-swap-store 3\n"));
  text.replace(text.find("zinf-swap-store 3"), 17, "zinf-swap-store 2");
  text.erase(text.find("checksum "));
  std::ofstream(rank_a + "/manifest", std::ios::trunc) << text;
  ASSERT_EQ(::unlink((rank_b + "/manifest").c_str()), 0);

  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({a.path(), b.path()}, "next"), &log));
  ASSERT_EQ(found.size(), 2u);
  for (const StaleStore& stale : found) EXPECT_EQ(stale.action, StaleAction::kLeft);
  EXPECT_THAT(log, AllOf(HasSubstr("[warn"), HasSubstr("version 2"), HasSubstr("rm -rf " + rank_a),
                         HasSubstr("no manifest"), HasSubstr("rm -rf " + rank_b)));
  EXPECT_TRUE(fs::exists(rank_a + "/swap.bin"));
  EXPECT_TRUE(fs::exists(rank_b + "/swap.bin"));

  // Resumed (and killed again): now it proves itself on both paths.
  old.resume = true;
  ASSERT_TRUE(RunAndDie([&] {
    auto store = SwapStore::Open(old);
    if (!store) return false;
    (void)store->release();
    return true;
  }));
  EXPECT_THAT(ReadFileText(rank_a + "/manifest"),
              AllOf(HasSubstr("zinf-swap-store 3\n"), HasSubstr("tensor 4096 x\n"),
                    HasSubstr("\nchecksum 0x")));
  EXPECT_EQ(ReadFileText(rank_b + "/manifest"), ReadFileText(rank_a + "/manifest"));
  ZINF_ASSERT_OK_AND_ASSIGN(found, SwapStore::ReclaimStale(MakeOptions({a.path(), b.path()}, "n")));
  ASSERT_EQ(found.size(), 2u);
  for (const StaleStore& stale : found) EXPECT_EQ(stale.action, StaleAction::kRemoved);
  EXPECT_TRUE(fs::is_empty(a.path()));
  EXPECT_TRUE(fs::is_empty(b.path()));
}

// A directory without a manifest (a creation killed before it wrote one looks the same) stays.
TEST(SwapStoreReclaim, ARankDirectoryWithoutAManifestIsLeft) {
  ScratchDir dir("swap");
  const std::string rank_dir = dir.Join("zinf-early/rank0");
  ASSERT_TRUE(fs::create_directories(rank_dir));
  { std::ofstream(rank_dir + "/swap.bin") << ""; }
  std::string log;
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            ReclaimCapturing(MakeOptions({dir.path()}, UniqueJob("next")), &log));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].action, StaleAction::kLeft);
  EXPECT_THAT(log, AllOf(HasSubstr("no manifest"), HasSubstr("rm -rf " + rank_dir)));
  EXPECT_TRUE(fs::exists(rank_dir + "/swap.bin"));
}

// A store's manifest exists from the moment its rank directory does (Open writes it at once).
TEST(SwapStoreReclaim, AnOpenStoreHasItsManifestBeforeAnyReserve) {
  ScratchDir a("swap-a"), b("swap-b");
  ZINF_ASSERT_OK_AND_ASSIGN(auto store,
                            SwapStore::Open(MakeOptions({a.path(), b.path()}, UniqueJob("m"))));
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_THAT(ReadFileText(store->directory(i) + "/manifest"),
                AllOf(HasSubstr("zinf-swap-store 3\n"), HasSubstr("tensors 0\nchecksum 0x")));
  }
  ZINF_ASSERT_OK(store->Close());
}

// Job directories are removed only when the scan emptied them of proven stores.
TEST(SwapStoreReclaim, AJobDirectoryWithoutAStoreStays) {
  ScratchDir dir("swap");
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-x")));
  ASSERT_TRUE(fs::create_directories(dir.Join("zinf-y/notes")));
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<StaleStore> found,
                            SwapStore::ReclaimStale(MakeOptions({dir.path()}, UniqueJob("next"))));
  EXPECT_TRUE(found.empty());
  EXPECT_TRUE(fs::is_directory(dir.Join("zinf-x")));
  EXPECT_TRUE(fs::is_directory(dir.Join("zinf-y/notes")));
}

TEST(SwapStoreReclaim, OpenWaitsForAReclaimerAndSurvivesItRemovingTheJobDirectory) {
  ScratchDir dir("swap");
  const SwapStoreOptions options = MakeOptions({dir.path()}, UniqueJob("race"));
  const std::string job_dir = dir.path() + "/zinf-" + options.job_id;
  // A reclaimer holds the (empty) job directory exclusively, then removes it.
  ASSERT_EQ(::mkdir(job_dir.c_str(), 0700), 0);
  const int reclaimer = ::open(job_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(reclaimer, 0);
  ASSERT_EQ(::flock(reclaimer, LOCK_EX | LOCK_NB), 0);
  Result<std::unique_ptr<SwapStore>> opened = InternalError("not run");
  std::thread opener([&] { opened = SwapStore::Open(options); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::rmdir(job_dir.c_str()), 0);
  ::close(reclaimer);
  opener.join();
  ZINF_ASSERT_OK(opened);
  // The store lives in a job directory that is linked at its name.
  EXPECT_TRUE(fs::exists((*opened)->directory(0) + "/swap.bin"));
  ZINF_ASSERT_OK((*opened)->Reserve({{"x", 100}}));
  // While it is open, nobody can lock its job directory exclusively.
  const int probe = ::open(job_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(probe, 0);
  EXPECT_NE(::flock(probe, LOCK_EX | LOCK_NB), 0);
  ::close(probe);
  ZINF_ASSERT_OK((*opened)->Close());
  EXPECT_FALSE(fs::exists(job_dir));
}

TEST(SwapStoreReclaim, InvalidOptionsAreRefused) {
  EXPECT_THAT(SwapStore::ReclaimStale(MakeOptions({}, "j")), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(SwapStore::ReclaimStale(MakeOptions({"/tmp"}, "../x")),
              StatusIs(ErrorCode::kInvalidArgument));
}

}  // namespace
}  // namespace zinf::storage
