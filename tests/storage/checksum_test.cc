#include "zinf/storage/checksum.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace zinf::storage {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::StatusIs;

std::span<const std::byte> Bytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

// The byte pattern of the long known-answer test: byte i is (i * 131 + 7) mod 256.
std::vector<std::byte> Pattern(std::size_t size_bytes) {
  std::vector<std::byte> data(size_bytes);
  for (std::size_t i = 0; i < size_bytes; ++i) {
    data[i] = static_cast<std::byte>((i * 131 + 7) % 256);
  }
  return data;
}

// Reference values printed by `xxhsum -H3` (xxhash 0.8.1), e.g.
//   printf abc | xxhsum -H3
//   perl -e 'print chr(($_*131+7)%256) for 0..1048574' | xxhsum -H3
constexpr std::uint64_t kEmpty = 0x2d06800538d394c2ULL;
constexpr std::uint64_t kAbc = 0x78af5f94892f3950ULL;
constexpr std::uint64_t kZinfCheckpoint = 0xddc0440cc675ca08ULL;
constexpr std::size_t kPatternSize = 1048575;  // 1 MiB - 1: exercises the long-input path
constexpr std::uint64_t kPattern = 0x336bb556da6e55cbULL;

TEST(Checksum, AlgorithmNameIsXxh3) { EXPECT_EQ(kChecksumAlgorithm, "xxh3-64"); }

TEST(Checksum, OneShotMatchesXxhsumReferenceValues) {
  EXPECT_EQ(Checksum64({}), kEmpty);
  EXPECT_EQ(Checksum64(Bytes("abc")), kAbc);
  EXPECT_EQ(Checksum64(Bytes("zinf checkpoint")), kZinfCheckpoint);
  EXPECT_EQ(Checksum64(Pattern(kPatternSize)), kPattern);
}

TEST(Checksum, HexIsZeroPaddedLowerCase) {
  EXPECT_EQ(ChecksumToHex(kEmpty), "0x2d06800538d394c2");
  EXPECT_EQ(ChecksumToHex(0xab), "0x00000000000000ab");
}

TEST(ChecksumBuilder, EmptyBuilderDigestsToEmptyChecksum) {
  ChecksumBuilder builder;
  EXPECT_EQ(builder.Digest(), kEmpty);
  EXPECT_EQ(builder.size_bytes(), 0u);
}

TEST(ChecksumBuilder, OddChunkSizesMatchOneShot) {
  const std::vector<std::byte> data = Pattern(kPatternSize);
  for (std::size_t chunk : {1u, 3u, 63u, 64u, 65u, 239u, 241u, 1023u, 4097u, 65535u}) {
    ChecksumBuilder builder;
    for (std::size_t offset = 0; offset < data.size(); offset += chunk) {
      builder.Update(std::span(data).subspan(offset, std::min(chunk, data.size() - offset)));
    }
    EXPECT_EQ(builder.Digest(), kPattern) << "chunk " << chunk;
    EXPECT_EQ(builder.size_bytes(), data.size());
  }
}

TEST(ChecksumBuilder, EmptyUpdatesChangeNothing) {
  ChecksumBuilder builder;
  builder.Update({});
  builder.Update(Bytes("ab"));
  builder.Update({});
  builder.Update(Bytes("c"));
  EXPECT_EQ(builder.Digest(), kAbc);
}

TEST(ChecksumBuilder, DigestDoesNotEndTheStream) {
  ChecksumBuilder builder;
  builder.Update(Bytes("zinf "));
  EXPECT_EQ(builder.Digest(), Checksum64(Bytes("zinf ")));
  builder.Update(Bytes("checkpoint"));
  EXPECT_EQ(builder.Digest(), kZinfCheckpoint);
}

TEST(ChecksumBuilder, ResetStartsOver) {
  ChecksumBuilder builder;
  builder.Update(Bytes("garbage"));
  builder.Reset();
  EXPECT_EQ(builder.size_bytes(), 0u);
  builder.Update(Bytes("abc"));
  EXPECT_EQ(builder.Digest(), kAbc);
}

TEST(ChecksumBuilder, MoveTransfersStateAndResetRevivesMovedFrom) {
  ChecksumBuilder a;
  a.Update(Bytes("ab"));
  ChecksumBuilder b(std::move(a));
  b.Update(Bytes("c"));
  EXPECT_EQ(b.Digest(), kAbc);
  EXPECT_EQ(b.size_bytes(), 3u);

  ChecksumBuilder c;
  c = std::move(b);
  EXPECT_EQ(c.Digest(), kAbc);

  a.Reset();  // NOLINT(bugprone-use-after-move): Reset makes a moved-from builder usable
  a.Update(Bytes("abc"));
  EXPECT_EQ(a.Digest(), kAbc);
}

TEST(ChecksumBuilderDeathTest, UpdateAfterMoveAborts) {
  ChecksumBuilder a;
  ChecksumBuilder b(std::move(a));
  EXPECT_DEATH(a.Update(Bytes("x")), "used after move");  // NOLINT(bugprone-use-after-move)
}

TEST(Checksum, EverySingleBitFlipIsDetected) {
  const std::vector<std::byte> original = Pattern(4096 + 17);
  const std::uint64_t sum = Checksum64(original);
  std::vector<std::byte> data = original;
  int undetected = 0;
  for (std::size_t byte = 0; byte < data.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= static_cast<std::byte>(1u << bit);
      if (Checksum64(data) == sum) ++undetected;
      data[byte] ^= static_cast<std::byte>(1u << bit);
    }
  }
  EXPECT_EQ(undetected, 0);
  EXPECT_EQ(Checksum64(data), sum);
}

TEST(Checksum, TruncationAndExtensionAreDetected) {
  const std::vector<std::byte> data = Pattern(1000);
  const std::uint64_t sum = Checksum64(data);
  EXPECT_NE(Checksum64(std::span(data).first(999)), sum);
  std::vector<std::byte> longer = data;
  longer.push_back(std::byte{0});
  EXPECT_NE(Checksum64(longer), sum);
}

TEST(VerifyChecksum, MatchingChecksumIsOk) {
  EXPECT_THAT(VerifyChecksum(Bytes("abc"), kAbc, "x"), IsOk());
}

TEST(VerifyChecksum, MismatchIsDataLossNamingWhatAndBothValues) {
  const Status status =
      VerifyChecksum(Bytes("abd"), kAbc, "dataset /state/fp32 chunk 12 elements [49152, 53248)");
  EXPECT_THAT(status,
              StatusIs(ErrorCode::kDataLoss,
                       AllOf(HasSubstr("dataset /state/fp32 chunk 12 elements [49152, 53248)"),
                             HasSubstr("stored 0x78af5f94892f3950"),
                             HasSubstr("computed " + ChecksumToHex(Checksum64(Bytes("abd")))),
                             HasSubstr("xxh3-64 over 3 bytes"))));
}

// Not a benchmark (the lead wires those into zinf-bench): one pass over 256 MiB, logged so that
// the cost of checksumming can be compared with the disk (~1 GB/s here). It also checks that the
// one-shot and streaming paths agree on a large buffer.
TEST(Checksum, ThroughputOn256MiB) {
  constexpr std::size_t kSizeBytes = std::size_t{256} << 20;
  std::vector<std::byte> data = Pattern(kSizeBytes);
  (void)Checksum64(std::span(data).first(1 << 20));  // warm up caches and the page tables
  const auto start = std::chrono::steady_clock::now();
  const std::uint64_t one_shot = Checksum64(data);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  ChecksumBuilder builder;
  for (std::size_t offset = 0; offset < kSizeBytes; offset += 8 << 20) {
    builder.Update(std::span(data).subspan(offset, 8 << 20));
  }
  EXPECT_EQ(builder.Digest(), one_shot);
  const double gb_per_s = static_cast<double>(kSizeBytes) / seconds / 1e9;
  RecordProperty("xxh3_64_gb_per_s", std::to_string(gb_per_s));
  std::printf("xxh3-64 one-shot over 256 MiB: %.3f s, %.2f GB/s\n", seconds, gb_per_s);
}

}  // namespace
}  // namespace zinf::storage
