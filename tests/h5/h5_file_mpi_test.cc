// Collective HDF5 files on 1-4 ranks (run under mpirun by CTest; main is
// tests/testing/mpi_main.cc).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/comm/communicator.h"
#include "zinf/h5/h5_file.h"
#include "zinf/storage/checksum.h"

namespace zinf::h5 {
namespace {

using storage::Checksum64;
using storage::VerifyChecksum;

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::SharedScratchDir;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

// The value stored at global element i, so that any rank can check any range.
float ValueAt(std::uint64_t i) { return static_cast<float>(i) * 0.25f + 1.0f; }

std::vector<float> Values(std::uint64_t offset, std::uint64_t count) {
  std::vector<float> v(count);
  for (std::uint64_t i = 0; i < count; ++i) v[i] = ValueAt(offset + i);
  return v;
}

// Rank r writes r*7+3 elements, except rank 1 (when there is one), which writes nothing.
std::uint64_t WriteCount(int rank, int size) {
  if (size > 1 && rank == 1) return 0;
  return static_cast<std::uint64_t>(rank) * 7 + 3;
}

struct Slice {
  std::uint64_t offset = 0;
  std::uint64_t count = 0;
};

Slice WriteSlice(int rank, int size) {
  Slice s;
  for (int r = 0; r < rank; ++r) s.offset += WriteCount(r, size);
  s.count = WriteCount(rank, size);
  return s;
}

std::uint64_t TotalNumel(int size) {
  std::uint64_t total = 0;
  for (int r = 0; r < size; ++r) total += WriteCount(r, size);
  return total;
}

// A different partition for reading back: equal slices (the last one shorter), handed out in
// reverse rank order, as a restore on a different layout would.
Slice ReadSlice(int rank, int size, std::uint64_t total) {
  const int slot = size - 1 - rank;
  const std::uint64_t per = (total + size - 1) / size;
  Slice s;
  s.offset = std::min<std::uint64_t>(per * slot, total);
  s.count = std::min<std::uint64_t>(per, total - s.offset);
  return s;
}

constexpr std::uint64_t kChunkNumel = 5;

TEST(H5FileCollective, UnevenWritesReadBackOnAnotherPartitionAfterReopen) {
  comm::Communicator& world = World();
  const int rank = world.rank();
  const int size = world.size();
  SharedScratchDir dir("hdf5-mpi");
  const std::string path = dir.Join("step-1.h5");
  const std::uint64_t total = TotalNumel(size);
  const Slice mine = WriteSlice(rank, size);
  const std::vector<float> values = Values(mine.offset, mine.count);

  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateCollective(world, path));
    EXPECT_TRUE(file.is_collective());
    ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", total, kChunkNumel, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.CreateDataset1D("/checksum/fp32", size, 1, H5DataType::kUInt64));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", mine.offset, std::span(values)));
    if (mine.count > 0) {
      // The write must really have been collective MPI-IO, not a silent fallback.
      EXPECT_THAT(file.last_transfer_mode(),
                  AnyOf(H5TransferMode::kChunkCollective, H5TransferMode::kContiguousCollective,
                        H5TransferMode::kChunkMixed))
          << H5TransferModeName(file.last_transfer_mode());
    }
    if (rank == 0) {
      std::printf("rank 0 of %d: slab write was %s\n", size,
                  std::string(H5TransferModeName(file.last_transfer_mode())).c_str());
    }
    // One checksum per rank, each rank writing its own element.
    const std::vector<std::uint64_t> sum = {Checksum64(std::as_bytes(std::span(values)))};
    ZINF_ASSERT_OK(file.WriteSlab("/checksum/fp32", rank, std::span(sum)));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "format", "zinf"));
    ZINF_ASSERT_OK(file.WriteInt64Attribute("/", "world_size", size));
    ZINF_ASSERT_OK(file.WriteDoubleAttribute("/state/fp32", "scale", 0.25));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "optimizer", R"({"type":"AdamW"})"));
    ZINF_ASSERT_OK(file.Flush());
    ZINF_ASSERT_OK(file.Close());
  }

  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::OpenCollective(world, path, /*read_only=*/true));
  EXPECT_THAT(file.DatasetNumel("/state/fp32"), ::testing::Optional(total));
  EXPECT_THAT(file.DatasetType("/checksum/fp32"), ::testing::Optional(H5DataType::kUInt64));
  EXPECT_THAT(file.ReadStringAttribute("/", "format"), ::testing::Optional(std::string("zinf")));
  EXPECT_THAT(file.ReadInt64Attribute("/", "world_size"), ::testing::Optional(size));
  EXPECT_THAT(file.ReadDoubleAttribute("/state/fp32", "scale"), ::testing::Optional(0.25));
  EXPECT_THAT(file.ReadStringAttribute("/", "optimizer"),
              ::testing::Optional(std::string(R"({"type":"AdamW"})")));
  EXPECT_THAT(file.HasAttribute("/", "step"), ::testing::Optional(false));

  const Slice theirs = ReadSlice(rank, size, total);
  std::vector<float> back(theirs.count, -1.0f);
  ZINF_ASSERT_OK(file.ReadSlab("/state/fp32", theirs.offset, std::span(back)));
  EXPECT_EQ(back, Values(theirs.offset, theirs.count));

  // Every rank checks every rank's checksum against the data it reads for that rank's slice.
  std::vector<std::uint64_t> sums(size);
  ZINF_ASSERT_OK(file.ReadSlab("/checksum/fp32", 0, std::span(sums)));
  for (int r = 0; r < size; ++r) {
    const Slice s = WriteSlice(r, size);
    std::vector<float> slice(s.count);
    ZINF_ASSERT_OK(file.ReadSlab("/state/fp32", s.offset, std::span(slice)));
    ZINF_EXPECT_OK(VerifyChecksum(std::as_bytes(std::span(slice)), sums[r],
                                  "rank " + std::to_string(r) + " slice"));
  }
  ZINF_ASSERT_OK(file.Close());
}

TEST(H5FileCollective, H5dumpReadsTheFile) {
  const std::string h5dump = ZINF_H5DUMP;
  // Every rank sees the same file system, so every rank skips alike.
  if (!std::filesystem::exists(h5dump))
    ZINF_SKIP_MISSING("h5dump", "h5dump not installed (hdf5-tools)");
  comm::Communicator& world = World();
  SharedScratchDir dir("hdf5-dump");
  const std::string path = dir.Join("dump.h5");
  const std::uint64_t total = TotalNumel(world.size());
  const Slice mine = WriteSlice(world.rank(), world.size());
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateCollective(world, path));
    ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", total, kChunkNumel, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", mine.offset,
                                  std::span<const float>(Values(mine.offset, mine.count))));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "format", "zinf"));
    ZINF_ASSERT_OK(file.Close());
  }
  Status dumped = OkStatus();
  if (world.rank() == 0) {
    const std::string out = dir.Join("dump.txt");
    const std::string command = h5dump + " " + path + " > " + out + " 2>&1";
    const int rc = std::system(command.c_str());
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (rc != 0) {
      dumped = InternalError(command + " exited with " + std::to_string(rc) + ":\n" + text);
    } else if (text.find("DATASET \"fp32\"") == std::string::npos ||
               text.find("1, 1.25, 1.5") == std::string::npos) {
      dumped = InternalError("unexpected h5dump output:\n" + text);
    }
  }
  EXPECT_THAT(world.AgreeOnStatus(dumped), IsOk());
}

TEST(H5FileCollective, OneRankWithAnOffsetBeyondTheDatasetFailsEveryRank) {
  comm::Communicator& world = World();
  const int rank = world.rank();
  const int size = world.size();
  const int bad_rank = size - 1;
  SharedScratchDir dir("hdf5-bad");
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateCollective(world, dir.Join("bad.h5")));
  const std::uint64_t total = static_cast<std::uint64_t>(size) * 4;
  ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", total, 3, H5DataType::kFloat32));
  const std::vector<float> four(4, 2.0f);

  const std::uint64_t offset =
      rank == bad_rank ? total + 100 : static_cast<std::uint64_t>(rank) * 4;
  const Status write = file.WriteSlab("/state/fp32", offset, std::span(four));
  EXPECT_THAT(write, StatusIs(ErrorCode::kInvalidArgument,
                              AllOf(HasSubstr("rank " + std::to_string(bad_rank)),
                                    HasSubstr("outside the dataset"))));

  std::vector<float> into(4);
  const Status read = file.ReadSlab("/state/fp32", offset, std::span(into));
  EXPECT_THAT(read,
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("rank " + std::to_string(bad_rank))));

  // A wrong element type on one rank.
  const std::vector<std::uint64_t> ints(4);
  const Status typed =
      rank == bad_rank
          ? file.WriteSlab("/state/fp32", 0, std::span(ints))
          : file.WriteSlab("/state/fp32", static_cast<std::uint64_t>(rank) * 4, std::span(four));
  EXPECT_THAT(typed, StatusIs(ErrorCode::kInvalidArgument, HasSubstr("buffer uint64")));

  // A name that only one rank gets wrong, on a read-side metadata lookup.
  EXPECT_THAT(file.DatasetNumel(rank == bad_rank ? "/state/typo" : "/state/fp32"),
              StatusIs(ErrorCode::kNotFound, HasSubstr("/state/typo")));

  // Nothing is left hanging: the file still works collectively afterwards.
  ZINF_ASSERT_OK(
      file.WriteSlab("/state/fp32", static_cast<std::uint64_t>(rank) * 4, std::span(four)));
  ZINF_ASSERT_OK(
      file.ReadSlab("/state/fp32", static_cast<std::uint64_t>(bad_rank) * 4, std::span(into)));
  EXPECT_EQ(into, four);
  ZINF_ASSERT_OK(file.Close());
}

TEST(H5FileCollective, FileErrorsAreTheSameOnEveryRank) {
  comm::Communicator& world = World();
  SharedScratchDir dir("hdf5-errors");
  const std::string path = dir.Join("x.h5");
  EXPECT_THAT(H5File::OpenCollective(world, path, true), StatusIs(ErrorCode::kNotFound));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateCollective(world, path));
    ZINF_ASSERT_OK(file.Close());
  }
  EXPECT_THAT(H5File::CreateCollective(world, path), StatusIs(ErrorCode::kAlreadyExists));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file,
                              H5File::CreateCollective(world, path, H5CreateMode::kTruncate));
    ZINF_ASSERT_OK(file.Close());
  }

  const std::string text = dir.Join("text.h5");
  if (world.rank() == 0) std::ofstream(text) << "not hdf5\n";
  ZINF_ASSERT_OK(world.Barrier());
  EXPECT_THAT(H5File::OpenCollective(world, text, true),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("HDF5 error stack")));
}

}  // namespace
}  // namespace zinf::h5
