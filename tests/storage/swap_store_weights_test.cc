// The swap store over paths of unequal weight: placement by the stripe map, file sizes and the
// preflight by share, the manifest's weights on resume, corrupt weights, the bandwidth probe.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/fault_injection.h"
#include "zinf/storage/io_backend.h"
#include "zinf/storage/stripe_map.h"
#include "zinf/storage/swap_store.h"

namespace zinf::storage {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::TmpfsMount;

namespace fs = std::filesystem;

constexpr std::uint64_t kUnit = 4096;

SwapStoreOptions WeightedOptions(std::vector<std::string> paths, const std::string& tag,
                                 std::vector<std::uint32_t> weights) {
  SwapStoreOptions options;
  options.paths = std::move(paths);
  options.job_id = fmt::format("{}-{}", tag, ::getpid());
  options.world_rank = 1;
  options.stripe_unit_bytes = kUnit;
  options.path_weights = std::move(weights);
  return options;
}

std::vector<std::byte> Pattern(const std::string& name, std::uint64_t size_bytes) {
  std::uint64_t state = std::hash<std::string>{}(name) | 1;
  std::vector<std::byte> out(size_bytes);
  for (std::byte& b : out) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    b = static_cast<std::byte>(state >> 56);
  }
  return out;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

std::vector<std::byte> RawRead(const std::string& path, std::uint64_t offset_bytes,
                               std::uint64_t length_bytes) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset_bytes));
  std::vector<std::byte> out(length_bytes);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(length_bytes));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(length_bytes)) << path;
  return out;
}

const std::vector<TensorSpec> kTensors = {
    {"sg0/fp32", 8 * kUnit},      {"sg0/exp_avg", 5 * kUnit + 17}, {"sg0/exp_avg_sq", 1},
    {"sg1/fp32", 13 * kUnit - 1}, {"sg1/exp_avg", 3 * kUnit},
};

TEST(SwapStoreWeights, OneToThreeRoundTripsWithEachFileHoldingItsShare) {
  ScratchDir a("weights-a"), b("weights-b");
  ZINF_ASSERT_OK_AND_ASSIGN(auto store,
                            SwapStore::Open(WeightedOptions({a.path(), b.path()}, "w13", {1, 3})));
  EXPECT_THAT(store->stripe_map().weights(), ElementsAre(1, 3));
  EXPECT_THAT(store->options().path_weights, ElementsAre(1, 3));
  ZINF_ASSERT_OK(store->Reserve(kTensors));
  const std::uint64_t total = store->total_units();  // 8 + 6 + 1 + 13 + 3 = 31
  ASSERT_EQ(total, 31u);
  // 7 whole cycles of 4 (7 + 21 units) and slots 1, 0, 1 of the eighth.
  EXPECT_EQ(fs::file_size(store->file(0).path()), 8 * kUnit);
  EXPECT_EQ(fs::file_size(store->file(1).path()), 23 * kUnit);
  EXPECT_THAT(ReadText(store->directory(0) + "/manifest"), HasSubstr("\npath_weights 1 3\n"));

  BufferOptions buffer_options;
  buffer_options.alignment = std::bit_ceil(std::max<std::uint64_t>(store->alignment(), 4096));
  buffer_options.register_cuda = false;
  AioOptions aio;
  aio.block_size = kUnit;
  ZINF_ASSERT_OK_AND_ASSIGN(auto backend, CreateIoBackend(IoBackendKind::kAuto, aio, a.path()));
  std::vector<AlignedBuffer> buffers;
  for (const TensorSpec& spec : kTensors) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer,
                              AlignedBuffer::Allocate(extent.io_size_bytes, buffer_options));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    std::memcpy(buffer.data(), data.data(), data.size());
    ZINF_ASSERT_OK_AND_ASSIGN(std::vector<std::uint64_t> ids,
                              store->SubmitWrite(spec.name, buffer.span(), *backend));
    if (spec.name == "sg0/fp32") {
      // Units 0-7: paths 1 0 1 1 | 1 0 1 1: runs of path 1 that meet in its file are merged
      // (units 2, 3, 4 are one request), 5 requests instead of 8.
      EXPECT_EQ(ids.size(), 5u);
    }
    buffers.push_back(std::move(buffer));
  }
  ZINF_ASSERT_OK(backend->WaitAll());
  ZINF_ASSERT_OK(store->Sync());
  // Every unit sits where the stripe map says, and reads back through Read().
  for (const TensorSpec& spec : kTensors) {
    ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent(spec.name));
    const std::vector<std::byte> data = Pattern(spec.name, spec.size_bytes);
    for (std::uint64_t i = 0; i < extent.num_units; ++i) {
      const StripeMap::Location at = store->stripe_map().Locate(extent.first_unit + i);
      const std::uint64_t length = std::min(kUnit, spec.size_bytes - i * kUnit);
      const std::vector<std::byte> raw =
          RawRead(store->file(at.path).path(), at.unit * kUnit, length);
      EXPECT_TRUE(std::equal(raw.begin(), raw.end(), data.begin() + i * kUnit))
          << spec.name << " unit " << i;
    }
    std::vector<std::byte> out(spec.size_bytes);
    ZINF_ASSERT_OK(store->Read(spec.name, out));
    EXPECT_EQ(out, data) << spec.name;
  }
  ZINF_ASSERT_OK(store->Close());
}

TEST(SwapStoreWeights, PlanSpaceAndPreflightFollowTheShares) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "plan", {1, 3});
  const std::vector<TensorSpec> specs = {{"x", 8 * kUnit}};
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<PathSpace> plan, SwapStore::PlanSpace(options, specs));
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].needed_bytes, 2 * kUnit);
  EXPECT_EQ(plan[1].needed_bytes, 6 * kUnit);
  // Probed weights are known only to an open store: plan with its options().
  SwapStoreOptions probed = options;
  probed.path_weights.clear();
  probed.probe_path_weights = true;
  EXPECT_THAT(SwapStore::PlanSpace(probed, specs),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("store.options()")));

  // A path that cannot hold its share is refused before anything is allocated, even where equal
  // shares would fit: 3 MiB at 1:3 puts 2.25 MiB on a 2 MiB tmpfs (equal shares: 1.5 MiB).
  ScratchDir small("weights-tmpfs");
  TmpfsMount mount(small.path(), "2m");
  if (!mount.mounted()) ZINF_SKIP_MISSING("tmpfs", "cannot mount a tmpfs here: " << mount.error());
  const std::vector<TensorSpec> big = {{"big", 3 * kMiB}};
  SwapStoreOptions equal = WeightedOptions({a.path(), small.path()}, "full-equal", {});
  ZINF_ASSERT_OK_AND_ASSIGN(auto fits, SwapStore::Open(equal));
  ZINF_ASSERT_OK(fits->Reserve(big));
  ZINF_ASSERT_OK(fits->Close());
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto store, SwapStore::Open(WeightedOptions({a.path(), small.path()}, "full", {1, 3})));
  EXPECT_THAT(store->Reserve(big),
              StatusIs(ErrorCode::kResourceExhausted,
                       AllOf(HasSubstr(small.path()), HasSubstr(FormatBytes(3 * kMiB / 4 * 3)),
                             HasSubstr("available"), Not(HasSubstr(a.path() + " needs")))));
  EXPECT_EQ(fs::file_size(store->file(1).path()), 0u);
  ZINF_ASSERT_OK(store->Close());
  EXPECT_TRUE(fs::is_empty(small.path()));
}

// Every tensor of kTensors reads back as the pattern WriteKeptStore wrote.
void ExpectPatterns(SwapStore& store) {
  for (const TensorSpec& spec : kTensors) {
    std::vector<std::byte> out(spec.size_bytes);
    ZINF_ASSERT_OK(store.Read(spec.name, out));
    EXPECT_EQ(out, Pattern(spec.name, spec.size_bytes)) << spec.name;
  }
}

// Writes kTensors into a kept store of `options` and closes it.
void WriteKeptStore(SwapStoreOptions options) {
  options.keep = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  ZINF_ASSERT_OK(store->Reserve(kTensors));
  for (const TensorSpec& spec : kTensors) {
    ZINF_ASSERT_OK(store->Write(spec.name, Pattern(spec.name, spec.size_bytes)));
  }
  ZINF_ASSERT_OK(store->Close());
}

TEST(SwapStoreWeights, ResumeUsesTheManifestsWeights) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "resume", {1, 3});
  WriteKeptStore(options);
  options.resume = true;
  options.keep = true;
  for (const std::vector<std::uint32_t>& now :
       {std::vector<std::uint32_t>{}, std::vector<std::uint32_t>{2, 1}}) {
    options.path_weights = now;
    ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
    EXPECT_TRUE(store->resumed());
    EXPECT_THAT(store->stripe_map().weights(), ElementsAre(1, 3));
    EXPECT_THAT(store->options().path_weights, ElementsAre(1, 3));
    ZINF_ASSERT_OK(store->Reserve(kTensors));
    ExpectPatterns(*store);
    ZINF_ASSERT_OK(store->Close());
  }
  // Each file must hold its share: path 1 cut to what equal shares would give it (15 of the 31
  // units) is truncated.
  const std::string file_b = b.path() + "/zinf-" + options.job_id + "/rank1/swap.bin";
  fs::resize_file(file_b, 15 * kUnit);
  options.keep = false;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  EXPECT_THAT(store->Reserve(kTensors),
              StatusIs(ErrorCode::kDataLoss, AllOf(HasSubstr(file_b), HasSubstr("truncated"))));
  ZINF_ASSERT_OK(store->Close());
  EXPECT_TRUE(fs::is_empty(b.path()));
}

TEST(SwapStoreWeights, ManifestOfVersionOneIsEqualShares) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "v1", {});
  WriteKeptStore(options);
  const std::string manifest = a.path() + "/zinf-" + options.job_id + "/rank1/manifest";
  std::string text = ReadText(manifest);
  ASSERT_THAT(text, HasSubstr("zinf-swap-store 3\n"));
  ASSERT_THAT(text, HasSubstr("path_weights 1 1\n"));
  // What the zinf of version 1 wrote: no path_weights line, no checksum line.
  text.replace(text.find("zinf-swap-store 3"), 17, "zinf-swap-store 1");
  text.erase(text.find("path_weights 1 1\n"), 17);
  text.erase(text.find("checksum "));
  WriteText(manifest, text);
  options.resume = true;
  options.path_weights = {1, 3};  // the manifest's layout wins
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  EXPECT_TRUE(store->stripe_map().equal_shares());
  ZINF_ASSERT_OK(store->Reserve(kTensors));
  ExpectPatterns(*store);
  ZINF_ASSERT_OK(store->Close());
}

TEST(SwapStoreWeights, BadWeightsInTheManifestAreDataLoss) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "badmanifest", {1, 3});
  WriteKeptStore(options);
  const std::string manifest = a.path() + "/zinf-" + options.job_id + "/rank1/manifest";
  const std::string good = ReadText(manifest);
  const std::size_t at = good.find("path_weights 1 3\n");
  ASSERT_NE(at, std::string::npos);
  options.resume = true;
  options.keep = true;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"path_weights 0 3", "weight 1 of path 0 is 0"},
      {"path_weights -1 3", "'-1' is not an integer"},
      {"path_weights 1 x", "'x' is not an integer"},
      {"path_weights 1.5 3", "'1.5' is not an integer"},
      {"path_weights 99999999999 1", "'99999999999' is not an integer"},
      {"path_weights 1", "1 path weights for 2 paths"},
      {"path_weights 1 3 1", "3 path weights for 2 paths"},
      {"path_weights 1 64", "a cycle of 65 stripe units"},
      {"path_weight 1 3", "expected path_weights"},
      {"", "expected path_weights"},
  };
  for (const auto& [line, why] : cases) {
    SCOPED_TRACE(line);
    std::string text = good;
    text.replace(at, 16, line);
    WriteText(manifest, text);
    EXPECT_THAT(SwapStore::Open(options),
                StatusIs(ErrorCode::kDataLoss,
                         AllOf(HasSubstr(manifest), HasSubstr("corrupt"), HasSubstr(why))));
  }
  // Cut after the paths line.
  WriteText(manifest, good.substr(0, at));
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("no path_weights line")));
  // The store itself is untouched by the refusals.
  WriteText(manifest, good);
  options.keep = false;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  ZINF_ASSERT_OK(store->Reserve(kTensors));
  std::vector<std::byte> out(kTensors[3].size_bytes);
  ZINF_ASSERT_OK(store->Read(kTensors[3].name, out));
  EXPECT_EQ(out, Pattern(kTensors[3].name, kTensors[3].size_bytes));
  ZINF_ASSERT_OK(store->Close());
}

TEST(SwapStoreWeights, BadWeightOptionsAreRefused) {
  ScratchDir a("weights-a"), b("weights-b");
  EXPECT_THAT(SwapStore::Open(WeightedOptions({a.path(), b.path()}, "bad", {1})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("1 path weights for 2 paths")));
  EXPECT_THAT(SwapStore::Open(WeightedOptions({a.path(), b.path()}, "bad", {0, 1})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("weight 1 of path 0 is 0")));
  EXPECT_THAT(SwapStore::Open(WeightedOptions({a.path(), b.path()}, "bad", {1, 70})),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("at most 64")));
  SwapStoreOptions both = WeightedOptions({a.path(), b.path()}, "bad", {1, 2});
  both.probe_path_weights = true;
  EXPECT_THAT(SwapStore::Open(both),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("probe_path_weights")));
  EXPECT_TRUE(fs::is_empty(a.path()));
  EXPECT_TRUE(fs::is_empty(b.path()));
}

TEST(SwapStoreWeights, ProbeMeasuresEveryPathAndRecordsTheWeights) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "probe", {});
  options.probe_path_weights = true;
  options.probe_bytes = 1 * kMiB;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  const std::vector<std::uint32_t> weights = store->stripe_map().weights();
  ASSERT_EQ(weights.size(), 2u);
  EXPECT_LE(store->stripe_map().cycle_units(), StripeMap::kMaxCycleUnits);
  EXPECT_EQ(store->options().path_weights, weights);
  EXPECT_FALSE(store->options().probe_path_weights);
  EXPECT_THAT(ReadText(store->directory(0) + "/manifest"),
              HasSubstr(fmt::format("\npath_weights {} {}\n", weights[0], weights[1])));
  // The probe's files are gone; the store plans and reserves by the probed shares.
  EXPECT_FALSE(fs::exists(store->directory(0) + "/probe.tmp"));
  EXPECT_FALSE(fs::exists(store->directory(1) + "/probe.tmp"));
  const std::vector<TensorSpec> specs = {{"x", 64 * kUnit}};
  ZINF_ASSERT_OK_AND_ASSIGN(std::vector<PathSpace> plan,
                            SwapStore::PlanSpace(store->options(), specs));
  ZINF_ASSERT_OK(store->Reserve(specs));
  for (std::size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(fs::file_size(store->file(p).path()), plan[p].needed_bytes);
    EXPECT_EQ(plan[p].needed_bytes, store->stripe_map().UnitsOnPath(p, 64) * kUnit);
  }
  ZINF_ASSERT_OK(store->Write("x", Pattern("x", 64 * kUnit)));
  std::vector<std::byte> out(64 * kUnit);
  ZINF_ASSERT_OK(store->Read("x", out));
  EXPECT_EQ(out, Pattern("x", 64 * kUnit));
  ZINF_ASSERT_OK(store->Close());
}

// A disk that fills up under a striped write (ENOSPC on every block) is ResourceExhausted naming
// the file, with every request reaped; a path whose store disappears while the store is kept
// makes the resume FailedPrecondition naming it.
TEST(SwapStoreWeights, FullOrVanishedPathIsACleanError) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "faults", {1, 3});
  options.keep = true;
  ZINF_ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(options));
  ZINF_ASSERT_OK(store->Reserve(kTensors));
  AioOptions aio;
  aio.block_size = kUnit;
  ZINF_ASSERT_OK_AND_ASSIGN(auto inner, CreateIoBackend(IoBackendKind::kPosix, aio, a.path()));
  ZINF_ASSERT_OK_AND_ASSIGN(FaultSpec spec, ParseFaultSpec("write:1+:enospc"));
  ZINF_ASSERT_OK_AND_ASSIGN(
      auto backend,
      FaultInjectingBackend::Wrap(std::move(inner), std::make_shared<FaultInjector>(spec)));
  BufferOptions buffer_options;
  buffer_options.alignment = std::bit_ceil(std::max<std::uint64_t>(store->alignment(), 4096));
  ZINF_ASSERT_OK_AND_ASSIGN(TensorExtent extent, store->Extent("sg1/fp32"));
  ZINF_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer,
                            AlignedBuffer::Allocate(extent.io_size_bytes, buffer_options));
  ZINF_ASSERT_OK(store->SubmitWrite("sg1/fp32", buffer.span(), *backend));
  EXPECT_THAT(backend->WaitAll(),
              StatusIs(ErrorCode::kResourceExhausted, HasSubstr("/rank1/swap.bin")));
  EXPECT_EQ(backend->pending(), 0u);
  ZINF_ASSERT_OK(store->Close());

  fs::remove_all(b.path() + "/zinf-" + options.job_id + "/rank1");
  options.resume = true;
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kFailedPrecondition,
                       AllOf(HasSubstr("exists on 1 of 2 paths"), HasSubstr(b.path()))));
}

// A fault in the probe's I/O (ZINF_FAULT_INJECT reaches its backend) fails Open with the error
// and the path it happened on, and leaves nothing behind.
TEST(SwapStoreWeights, ProbeIoErrorNamesThePath) {
  ScratchDir a("weights-a"), b("weights-b");
  SwapStoreOptions options = WeightedOptions({a.path(), b.path()}, "probefault", {});
  options.probe_path_weights = true;
  options.probe_bytes = 256 * kKiB;
  ::setenv("ZINF_FAULT_INJECT", "write:1+:eio", 1);
  Result<std::unique_ptr<SwapStore>> store = SwapStore::Open(options);
  ::unsetenv("ZINF_FAULT_INJECT");
  EXPECT_THAT(
      store, StatusIs(ErrorCode::kDataLoss, AllOf(HasSubstr("probing the bandwidth of " + a.path()),
                                                  HasSubstr("probe.tmp"))));
  EXPECT_TRUE(fs::is_empty(a.path()));
  EXPECT_TRUE(fs::is_empty(b.path()));
}

// A path too full for the probe's file is a clean ResourceExhausted naming it.
TEST(SwapStoreWeights, ProbeOnAFullPathNamesIt) {
  ScratchDir a("weights-a"), small("weights-tmpfs");
  TmpfsMount mount(small.path(), "1m");
  if (!mount.mounted()) ZINF_SKIP_MISSING("tmpfs", "cannot mount a tmpfs here: " << mount.error());
  SwapStoreOptions options = WeightedOptions({a.path(), small.path()}, "probefull", {});
  options.probe_path_weights = true;
  options.probe_bytes = 4 * kMiB;
  EXPECT_THAT(SwapStore::Open(options),
              StatusIs(ErrorCode::kResourceExhausted,
                       HasSubstr("probing the bandwidth of " + small.path())));
  EXPECT_TRUE(fs::is_empty(small.path()));
  EXPECT_TRUE(fs::is_empty(a.path()));
}

}  // namespace
}  // namespace zinf::storage
