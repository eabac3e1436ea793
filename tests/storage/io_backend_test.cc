#include "zinf/storage/io_backend.h"

#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/core/check.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/fault_injection.h"
#include "zinf/storage/file.h"

namespace zinf::storage {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::TmpfsMount;

void Fill(std::span<std::byte> data, std::uint64_t seed) {
  for (std::size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<std::byte>(((i + seed) * 2654435761u >> 13) & 0xff);
  }
}

bool Same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

AlignedBuffer Buffer(std::uint64_t size, std::uint64_t alignment = 4096) {
  BufferOptions options;
  options.alignment = std::max<std::uint64_t>(alignment, 4096);
  options.register_cuda = false;
  auto buffer = AlignedBuffer::Allocate(size, options);
  ZINF_CHECK(buffer.has_value(), "{}", buffer.error().ToString());
  return std::move(*buffer);
}

struct BackendParam {
  IoBackendKind kind;
  bool single_submit;
  bool overlap_events;
};

std::string ParamName(const ::testing::TestParamInfo<BackendParam>& info) {
  return fmt::format("{}{}{}", IoBackendKindName(info.param.kind),
                     info.param.single_submit ? "_single" : "",
                     info.param.overlap_events ? "" : "_waves");
}

class IoBackendTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    ::unsetenv("ZINF_IO_ENGINE");
    ::unsetenv("ZINF_FAULT_INJECT");
  }

  AioOptions Options(std::uint64_t block_size = 64 * kKiB, int queue_depth = 4,
                     int parallelism = 2) const {
    AioOptions options;
    options.block_size = block_size;
    options.queue_depth = queue_depth;
    options.intra_op_parallelism = parallelism;
    options.single_submit = GetParam().single_submit;
    options.overlap_events = GetParam().overlap_events;
    return options;
  }

  // The backend under test, or null after GTEST_SKIP when io_uring is not available here.
  std::unique_ptr<IoBackend> Make(const AioOptions& options) {
    auto backend = CreateIoBackend(GetParam().kind, options, dir_.path());
    if (!backend && backend.error().code() == ErrorCode::kUnimplemented) {
      skip_reason_ = backend.error().message();
      return nullptr;
    }
    ZINF_CHECK(backend.has_value(), "{}", backend.error().ToString());
    EXPECT_EQ((*backend)->name(), IoBackendKindName(GetParam().kind));
    return std::move(*backend);
  }

  std::unique_ptr<IoBackend> MakeFaulty(const AioOptions& options, std::string_view spec,
                                       std::shared_ptr<FaultInjector>* injector = nullptr) {
    std::unique_ptr<IoBackend> backend = Make(options);
    if (backend == nullptr) return nullptr;
    auto parsed = ParseFaultSpec(spec);
    ZINF_CHECK(parsed.has_value(), "{}", parsed.error().ToString());
    auto shared = std::make_shared<FaultInjector>(*parsed);
    if (injector != nullptr) *injector = shared;
    auto wrapped = FaultInjectingBackend::Wrap(std::move(backend), shared);
    ZINF_CHECK(wrapped.has_value(), "{}", wrapped.error().ToString());
    return std::move(*wrapped);
  }

  File Open(const std::string& name, bool direct, OpenMode mode = OpenMode::kCreateOrOpen) {
    OpenOptions options;
    options.mode = mode;
    options.direct = direct;
    auto file = File::Open(dir_.Join(name), options);
    ZINF_CHECK(file.has_value(), "{}", file.error().ToString());
    return std::move(*file);
  }

  static Status Run(IoBackend& backend, IoOp op, const File& file, std::uint64_t offset,
                    std::span<std::byte> data) {
    ZINF_RETURN_IF_ERROR(backend.Submit(IoRequest{op, &file, offset, data}));
    return backend.WaitAll();
  }

  ScratchDir dir_{"backend"};
  std::string skip_reason_;
};

#define MAKE_OR_SKIP(var, expr) \
  auto var = (expr);            \
  if (var == nullptr) ZINF_SKIP_MISSING("uring", skip_reason_)

TEST_P(IoBackendTest, BufferedRoundTripAtUnalignedLengthsAndOffsets) {
  MAKE_OR_SKIP(backend, Make(Options(8 * kKiB, 3, 2)));
  File file = Open("buffered", /*direct=*/false);
  for (std::uint64_t offset : {0ull, 1ull, 4095ull, 8191ull, 8192ull + 511}) {
    for (std::uint64_t length : {1ull, 511ull, 4097ull, 8192ull * 3 + 17, 100'003ull}) {
      SCOPED_TRACE(fmt::format("offset {} length {}", offset, length));
      std::vector<std::byte> out(length), in(length);
      Fill(out, offset + length);
      ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, offset, out));
      ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, offset, in));
      ASSERT_TRUE(Same(out, in));
    }
  }
}

TEST_P(IoBackendTest, DirectRoundTripNearBlockBoundaries) {
  const std::uint64_t block = 64 * kKiB;
  MAKE_OR_SKIP(backend, Make(Options(block, 4, 2)));
  File file = Open("direct", /*direct=*/true);
  if (!file.direct()) ZINF_SKIP_MISSING("odirect", "no O_DIRECT in " << dir_.path());
  const std::uint64_t a = file.alignment();
  for (std::uint64_t offset : {std::uint64_t{0}, a, block - a, block, 3 * block - a}) {
    for (std::uint64_t length : {a, block - a, block, block + a, 5 * block + a}) {
      SCOPED_TRACE(fmt::format("offset {} length {} alignment {}", offset, length, a));
      AlignedBuffer out_buffer = Buffer(length, a), in_buffer = Buffer(length, a);
      std::span<std::byte> out = out_buffer.span().subspan(0, length);
      std::span<std::byte> in = in_buffer.span().subspan(0, length);
      Fill(out, offset * 7 + length);
      ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, offset, out));
      ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, offset, in));
      ASSERT_TRUE(Same(out, in));
    }
  }
}

TEST_P(IoBackendTest, RequestLargerThanAllRingsTogether) {
  const AioOptions options = Options(16 * kKiB, 2, 2);
  MAKE_OR_SKIP(backend, Make(options));
  File file = Open("large", /*direct=*/true);
  const std::uint64_t length =
      options.block_size * options.queue_depth * options.intra_op_parallelism * 7 +
      file.alignment();
  AlignedBuffer out_buffer = Buffer(length, file.alignment());
  AlignedBuffer in_buffer = Buffer(length, file.alignment());
  std::span<std::byte> out = out_buffer.span().subspan(0, length);
  std::span<std::byte> in = in_buffer.span().subspan(0, length);
  Fill(out, 5);
  ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t id,
                            backend->Submit(IoRequest{IoOp::kWrite, &file, 0, out}));
  EXPECT_EQ(id, 1u);  // ids start at 1, whatever the probe did
  std::vector<IoCompletion> done;
  ZINF_ASSERT_OK(backend->Wait(1, &done));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, id);
  EXPECT_EQ(done[0].bytes, length);
  ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, 0, in));
  EXPECT_TRUE(Same(out, in));
}

TEST_P(IoBackendTest, HundredsOfConcurrentRequests) {
  MAKE_OR_SKIP(backend, Make(Options(8 * kKiB, 4, 2)));
  File file = Open("many", /*direct=*/true);
  constexpr int kRequests = 300;
  const std::uint64_t size = 12 * kKiB;  // 1.5 blocks: every request has a partial block
  AlignedBuffer out = Buffer(size * kRequests), in = Buffer(size * kRequests);
  Fill(out.span(), 11);
  std::set<std::uint64_t> ids;
  std::uint64_t last_id = 0;
  for (int i = 0; i < kRequests; ++i) {
    ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t id,
                              backend->Submit(IoRequest{IoOp::kWrite, &file, i * size,
                                                       out.span().subspan(i * size, size)}));
    EXPECT_GT(id, last_id);
    last_id = id;
    ids.insert(id);
  }
  std::vector<IoCompletion> done;
  while (backend->pending() > 0) ZINF_ASSERT_OK(backend->Wait(1, &done));
  ASSERT_EQ(done.size(), static_cast<std::size_t>(kRequests));
  for (const IoCompletion& c : done) {
    EXPECT_EQ(ids.erase(c.id), 1u) << c.id;
    EXPECT_EQ(c.bytes, size);
  }
  // Read back in reverse order, all at once.
  for (int i = kRequests - 1; i >= 0; --i) {
    ZINF_ASSERT_OK(
        backend->Submit(IoRequest{IoOp::kRead, &file, i * size, in.span().subspan(i * size, size)}));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  EXPECT_TRUE(Same(out.span(), in.span()));
}

TEST_P(IoBackendTest, WaitReturnsAtLeastMinRequests) {
  MAKE_OR_SKIP(backend, Make(Options()));
  File file = Open("wait", /*direct=*/true);
  const std::uint64_t size = 64 * kKiB;
  AlignedBuffer data = Buffer(size * 10);
  std::vector<IoCompletion> done;
  // Nothing pending: returns at once, whatever the minimum.
  ZINF_ASSERT_OK(backend->Wait(5, &done));
  EXPECT_TRUE(done.empty());
  for (int i = 0; i < 10; ++i) {
    ZINF_ASSERT_OK(backend->Submit(
        IoRequest{IoOp::kWrite, &file, i * size, data.span().subspan(i * size, size)}));
  }
  EXPECT_EQ(backend->pending(), 10u);
  ZINF_ASSERT_OK(backend->Wait(3, &done));
  EXPECT_GE(done.size(), 3u);
  EXPECT_EQ(backend->pending(), 10u - done.size());
  // Wait(0) never blocks.
  ZINF_ASSERT_OK(backend->Wait(0, &done));
  // A minimum above what is pending returns when nothing is left.
  ZINF_ASSERT_OK(backend->Wait(100, &done));
  EXPECT_EQ(done.size(), 10u);
  EXPECT_EQ(backend->pending(), 0u);
  // A zero-length request completes with 0 bytes.
  ZINF_ASSERT_OK_AND_ASSIGN(std::uint64_t id,
                            backend->Submit(IoRequest{IoOp::kWrite, &file, 0, {}}));
  done.clear();
  ZINF_ASSERT_OK(backend->Wait(1, &done));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, id);
  EXPECT_EQ(done[0].bytes, 0u);
}

TEST_P(IoBackendTest, MisalignedDirectRequestIsInvalidArgumentAtSubmit) {
  MAKE_OR_SKIP(backend, Make(Options()));
  File file = Open("misaligned", /*direct=*/true);
  if (!file.direct()) ZINF_SKIP_MISSING("odirect", "no O_DIRECT in " << dir_.path());
  AlignedBuffer data = Buffer(64 * kKiB);
  EXPECT_THAT(backend->Submit(IoRequest{IoOp::kWrite, &file, 100, data.span().subspan(0, 4096)}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("offset 100")));
  EXPECT_THAT(backend->Submit(IoRequest{IoOp::kRead, &file, 0, data.span().subspan(0, 100)}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("length 100")));
  EXPECT_THAT(backend->Submit(IoRequest{IoOp::kRead, &file, 0, data.span().subspan(8, 4096)}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr(file.path())));
  EXPECT_EQ(backend->pending(), 0u);
}

TEST_P(IoBackendTest, BadRequestsAreInvalidArgument) {
  MAKE_OR_SKIP(backend, Make(Options()));
  File file = Open("ro", /*direct=*/true);
  ZINF_ASSERT_OK(file.Close());
  File read_only = Open("ro", /*direct=*/true, OpenMode::kRead);
  AlignedBuffer data = Buffer(4096);
  EXPECT_THAT(backend->Submit(IoRequest{IoOp::kWrite, &read_only, 0, data.span()}),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("read-only")));
  EXPECT_THAT(backend->Submit(IoRequest{IoOp::kRead, nullptr, 0, data.span()}),
              StatusIs(ErrorCode::kInvalidArgument));
  AioOptions bad = Options();
  bad.queue_depth = 0;
  EXPECT_THAT(CreateIoBackend(GetParam().kind, bad, dir_.path()),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("queue_depth")));
}

TEST_P(IoBackendTest, ShortReadsAndWritesAreResubmitted) {
  std::shared_ptr<FaultInjector> injector;
  // Every completion reports half of what it moved, down to one alignment unit.
  MAKE_OR_SKIP(backend,
               MakeFaulty(Options(64 * kKiB, 2, 2), "write:1+:short,read:1+:short", &injector));
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct" : "buffered");
    File file = Open(direct ? "short-d" : "short-b", direct);
    const std::uint64_t length = 3 * 64 * kKiB + (direct ? file.alignment() : 1001);
    AlignedBuffer out_buffer = Buffer(length), in_buffer = Buffer(length);
    std::span<std::byte> out = out_buffer.span().subspan(0, length);
    std::span<std::byte> in = in_buffer.span().subspan(0, length);
    Fill(out, 3);
    const std::uint64_t before = injector->injected();
    ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, out));
    EXPECT_GT(injector->injected(), before + 4);
    ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, 0, in));
    EXPECT_TRUE(Same(out, in));
  }
}

TEST_P(IoBackendTest, EagainAndEintrAreRetried) {
  std::shared_ptr<FaultInjector> injector;
  MAKE_OR_SKIP(backend,
               MakeFaulty(Options(), "write:1:eagain,write:2:eintr,read:2:eagain", &injector));
  File file = Open("eagain", /*direct=*/true);
  AlignedBuffer out = Buffer(256 * kKiB), in = Buffer(256 * kKiB);
  Fill(out.span(), 9);
  ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, out.span()));
  ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, 0, in.span()));
  EXPECT_TRUE(Same(out.span(), in.span()));
  EXPECT_EQ(injector->injected(), 3u);
}

TEST_P(IoBackendTest, EndlessEagainFailsAfterBoundedRetries) {
  MAKE_OR_SKIP(backend, MakeFaulty(Options(), "read:1+:eagain"));
  File file = Open("endless", /*direct=*/true);
  AlignedBuffer data = Buffer(4096);
  ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, data.span()));
  EXPECT_THAT(Run(*backend, IoOp::kRead, file, 0, data.span()),
              StatusIs(ErrorCode::kUnavailable, HasSubstr("retries")));
}

TEST_P(IoBackendTest, EioSurfacesAsDataLossWithPathAndOffset) {
  const std::uint64_t block = 64 * kKiB;
  // One ring/thread and one block in flight: the 3rd write completion is the 3rd block.
  MAKE_OR_SKIP(backend, MakeFaulty(Options(block, 1, 1), "write:3:eio"));
  File file = Open("eio", /*direct=*/true);
  AlignedBuffer data = Buffer(4 * block);
  auto status = Run(*backend, IoOp::kWrite, file, 0, data.span());
  EXPECT_THAT(status, StatusIs(ErrorCode::kDataLoss,
                               ::testing::AllOf(HasSubstr("write"), HasSubstr(file.path()),
                                                HasSubstr(fmt::format("offset {}", 2 * block)),
                                                HasSubstr(fmt::format("length {}", block)))));
  ASSERT_FALSE(status.has_value());
  EXPECT_EQ(status.error().sys_errno(), EIO);
  EXPECT_EQ(backend->pending(), 0u);
  // The backend goes on after a failure.
  ZINF_EXPECT_OK(Run(*backend, IoOp::kWrite, file, 0, data.span()));
}

TEST_P(IoBackendTest, EnospcSurfacesAsResourceExhausted) {
  MAKE_OR_SKIP(backend, MakeFaulty(Options(), "write:1:enospc"));
  File file = Open("enospc", /*direct=*/true);
  AlignedBuffer data = Buffer(4096);
  auto status = Run(*backend, IoOp::kWrite, file, 8192, data.span());
  EXPECT_THAT(status, StatusIs(ErrorCode::kResourceExhausted,
                               ::testing::AllOf(HasSubstr(file.path()), HasSubstr("offset 8192"))));
  ASSERT_FALSE(status.has_value());
  EXPECT_EQ(status.error().sys_errno(), ENOSPC);
}

TEST_P(IoBackendTest, FailedRequestDoesNotHideSuccessfulOnes) {
  // Request 2's only block is the 2nd write completion.
  MAKE_OR_SKIP(backend, MakeFaulty(Options(64 * kKiB, 1, 1), "write:2:eio"));
  File file = Open("mixed", /*direct=*/true);
  AlignedBuffer data = Buffer(3 * 4096);
  for (int i = 0; i < 3; ++i) {
    ZINF_ASSERT_OK(backend->Submit(
        IoRequest{IoOp::kWrite, &file, i * 4096ull, data.span().subspan(i * 4096, 4096)}));
  }
  std::vector<IoCompletion> done;
  EXPECT_THAT(backend->Wait(3, &done), StatusIs(ErrorCode::kDataLoss));
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].id + done[1].id, 1u + 3u);
}

TEST_P(IoBackendTest, ReadPastEndOfFileIsDataLoss) {
  MAKE_OR_SKIP(backend, Make(Options()));
  {
    File file = Open("eof-b", /*direct=*/false);
    std::vector<std::byte> data(1000);
    ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, data));
    std::vector<std::byte> more(4096);
    EXPECT_THAT(Run(*backend, IoOp::kRead, file, 0, more),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("short read at EOF")));
  }
  {
    File file = Open("eof-d", /*direct=*/true);
    AlignedBuffer data = Buffer(8192);
    ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, data.span().subspan(0, 4096)));
    EXPECT_THAT(Run(*backend, IoOp::kRead, file, 0, data.span()),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("offset 4096")));
    // A size that is not a multiple of the alignment: the direct read stops mid-sector.
    ZINF_ASSERT_OK(file.Truncate(5000));
    EXPECT_THAT(Run(*backend, IoOp::kRead, file, 0, data.span()),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("short read at EOF")));
  }
}

TEST_P(IoBackendTest, DestroyWithOpsInFlightIsSafe) {
  File file = Open("inflight", /*direct=*/true);
  AlignedBuffer data = Buffer(200 * 64 * kKiB);
  Fill(data.span(), 1);
  for (int round = 0; round < 3; ++round) {
    MAKE_OR_SKIP(backend, Make(Options(16 * kKiB, 4, 2)));
    for (int i = 0; i < 200; ++i) {
      const std::uint64_t offset = i * 64 * kKiB;
      ZINF_ASSERT_OK(backend->Submit(IoRequest{round == 1 ? IoOp::kRead : IoOp::kWrite, &file,
                                              offset, data.span().subspan(offset, 64 * kKiB)}));
    }
    if (round == 2) {
      std::vector<IoCompletion> done;
      ZINF_ASSERT_OK(backend->Wait(1, &done));
    }
    backend.reset();  // must drain, not crash or leave the kernel writing into `data`
  }
}

TEST_P(IoBackendTest, RegisteredBuffersRoundTrip) {
  MAKE_OR_SKIP(backend, Make(Options(64 * kKiB, 4, 2)));
  File file = Open("fixed", /*direct=*/true);
  AlignedBuffer pool = Buffer(1 * kMiB), other = Buffer(256 * kKiB);
  std::span<std::byte> pools[] = {pool.span()};
  ZINF_ASSERT_OK(backend->RegisterBuffers(pools));
  Fill(pool.span(), 21);
  Fill(other.span(), 22);
  ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 0, pool.span()));
  ZINF_ASSERT_OK(Run(*backend, IoOp::kWrite, file, 1 * kMiB, other.span()));
  AlignedBuffer check = Buffer(1 * kMiB + 256 * kKiB);
  ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, 0, check.span()));
  EXPECT_TRUE(Same(check.span().subspan(0, 1 * kMiB), pool.span()));
  EXPECT_TRUE(Same(check.span().subspan(1 * kMiB), other.span()));
  // Read into the registered buffer at an offset inside it.
  ZINF_ASSERT_OK(Run(*backend, IoOp::kRead, file, 1 * kMiB, pool.span().subspan(4096, 256 * kKiB)));
  EXPECT_TRUE(Same(pool.span().subspan(4096, 256 * kKiB), other.span()));
  ZINF_ASSERT_OK(backend->Submit(IoRequest{IoOp::kRead, &file, 0, pool.span()}));
  EXPECT_THAT(backend->RegisterBuffers(pools), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(backend->RegisterBuffers({}));
}

// A real ENOSPC: a 4 MiB tmpfs mounted for the test.
TEST_P(IoBackendTest, RealEnospcOnSmallFileSystemIsResourceExhausted) {
  MAKE_OR_SKIP(backend, Make(Options(256 * kKiB, 4, 2)));
  TmpfsMount mount(dir_.Join("tmpfs"), "4m");
  if (!mount.mounted()) {
    ZINF_SKIP_MISSING("tmpfs", "cannot mount a tmpfs (needs root): " << mount.error());
  }
  OpenOptions options;
  options.mode = OpenMode::kCreate;
  ZINF_ASSERT_OK_AND_ASSIGN(File file, File::Open(dir_.Join("tmpfs/full"), options));
  AlignedBuffer data = Buffer(8 * kMiB);
  auto status = Run(*backend, IoOp::kWrite, file, 0, data.span());
  EXPECT_THAT(status, StatusIs(ErrorCode::kResourceExhausted, HasSubstr(file.path())));
  ZINF_EXPECT_OK(file.Close());
}

INSTANTIATE_TEST_SUITE_P(Backends, IoBackendTest,
                         ::testing::Values(BackendParam{IoBackendKind::kUring, false, true},
                                           BackendParam{IoBackendKind::kUring, true, false},
                                           BackendParam{IoBackendKind::kPosix, false, true}),
                         ParamName);

class CreateIoBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("ZINF_IO_ENGINE");
    ::unsetenv("ZINF_FAULT_INJECT");
  }
  void TearDown() override { SetUp(); }
  ScratchDir dir_{"create"};
};

TEST_F(CreateIoBackendTest, AutoPicksABackendAfterProbing) {
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kAuto, {}, dir_.path()));
  EXPECT_THAT(std::string(backend->name()), ::testing::AnyOf("uring", "posix"));
  // The probe leaves nothing behind.
  EXPECT_EQ(::rmdir(dir_.path().c_str()), 0) << std::strerror(errno);
  ::mkdir(dir_.path().c_str(), 0700);
}

TEST_F(CreateIoBackendTest, EnvironmentOverridesTheKind) {
  ::setenv("ZINF_IO_ENGINE", "posix", 1);
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kUring, {}, dir_.path()));
  EXPECT_EQ(backend->name(), "posix");
  ::setenv("ZINF_IO_ENGINE", "spdk", 1);
  EXPECT_THAT(CreateIoBackend(IoBackendKind::kAuto, {}, dir_.path()),
              StatusIs(ErrorCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("ZINF_IO_ENGINE"), HasSubstr("spdk"))));
}

TEST_F(CreateIoBackendTest, ProbeFailureIsReported) {
  // A missing probe directory fails the io_uring round trip: uring is refused, auto falls back.
  const std::string missing = dir_.Join("missing");
  auto uring = CreateIoBackend(IoBackendKind::kUring, {}, dir_.path());
  if (!uring) ZINF_SKIP_MISSING("uring", "io_uring unavailable: " << uring.error().message());
  EXPECT_THAT(CreateIoBackend(IoBackendKind::kUring, {}, missing),
              StatusIs(ErrorCode::kUnimplemented, HasSubstr(missing)));
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kAuto, {}, missing));
  EXPECT_EQ(backend->name(), "posix");
}

TEST(IoBackendKindTest, NamesRoundTrip) {
  for (IoBackendKind kind : {IoBackendKind::kAuto, IoBackendKind::kUring, IoBackendKind::kPosix}) {
    ZINF_ASSERT_OK_AND_ASSIGN(IoBackendKind parsed, ParseIoBackendKind(IoBackendKindName(kind)));
    EXPECT_EQ(parsed, kind);
  }
  EXPECT_THAT(ParseIoBackendKind("libaio"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("libaio")));
  EXPECT_EQ(IoOpName(IoOp::kRead), "read");
  EXPECT_EQ(IoOpName(IoOp::kWrite), "write");
}

}  // namespace
}  // namespace zinf::storage
