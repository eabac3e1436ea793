// CheckpointStateReader (checkpoint.h): any range of any state of a checkpoint saved on N ranks,
// read serially, equals the saved state bitwise (fp32 files) or its decoded moments (q8 files:
// what ExportCheckpoint --moments writes); ranges past the end are refused; a flipped bit is
// DataLoss naming the dataset.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/h5/h5_file.h"

namespace zinf::checkpoint {
namespace {

using checkpoint_testing::FillState;
using checkpoint_testing::MakeSwapper;
using checkpoint_testing::StateValue;
using checkpoint_testing::TestSwapper;
using ::testing::HasSubstr;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

constexpr std::uint64_t kChunk = 1000;

CheckpointSaveOptions Save(const std::string& dir) {
  CheckpointSaveOptions o;
  o.dir = dir;
  o.chunk_numel = kChunk;
  o.progress = false;
  return o;
}

// Ranges that start and end inside chunks, straddle chunk borders, cover one element, a whole
// chunk, or everything.
std::vector<std::pair<std::uint64_t, std::uint64_t>> Ranges(std::uint64_t total) {
  return {{0, total},   {0, 1},       {total - 1, 1},       {999, 2},
          {1000, 1000}, {1234, 5678}, {total - 1500, 1500}, {17, 0}};
}

TEST(CheckpointStateReader, ReadsEveryRangeBitwise) {
  SharedScratchDir dir("reader");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "reader",
                                                                 .world_size = World().size()}));
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(*t.swapper, 5)));
  ZINF_ASSERT_OK(SaveCheckpoint(*t.swapper, 5, Save(dir.Join("ckpt"))));
  ZINF_ASSERT_OK(t.swapper->Close());
  if (World().rank() == 0) {
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader reader,
                              CheckpointStateReader::Open(dir.Join("ckpt")));
    const std::uint64_t total = reader.info().total_numel;
    ASSERT_EQ(total, checkpoint_testing::TestLayout().total_numel());
    ASSERT_EQ(reader.info().step, 5);
    // Moved: the readers inside keep working.
    CheckpointStateReader moved = std::move(reader);
    for (StateTensor which : {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      for (auto [offset, numel] : Ranges(total)) {
        SCOPED_TRACE(fmt::format("{} [{}, +{})", StateTensorName(which), offset, numel));
        std::vector<float> got(numel, -7.0f);
        ZINF_ASSERT_OK(moved.Read(which, offset, got));
        for (std::uint64_t k = 0; k < numel; ++k) {
          const float want = StateValue(which, 5, offset + k);
          ASSERT_EQ(std::memcmp(&got[k], &want, 4), 0) << "element " << offset + k;
        }
      }
    }
    std::vector<float> two(2);
    EXPECT_THAT(moved.Read(StateTensor::kExpAvg, total - 1, two),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("past")));
    EXPECT_THAT(moved.Read(StateTensor::kFp32, ~std::uint64_t{0}, two),
                StatusIs(ErrorCode::kInvalidArgument));
    ZINF_ASSERT_OK(moved.Close());

    // One flipped bit in the last chunk of exp_avg_sq: reads of that chunk are DataLoss, the
    // other chunks still read.
    const std::string copy = dir.Join("flipped.h5");
    std::filesystem::copy_file(dir.Join("ckpt/step-5.h5"), copy);
    {
      ZINF_ASSERT_OK_AND_ASSIGN(h5::H5File f, h5::H5File::OpenSerial(copy, false));
      float v = 0;
      ZINF_ASSERT_OK(f.ReadSlab("/state/exp_avg_sq", total - 3, std::span(&v, 1)));
      std::uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits ^= 1u << 7;
      std::memcpy(&v, &bits, 4);
      ZINF_ASSERT_OK(f.WriteSlab("/state/exp_avg_sq", total - 3, std::span<const float>(&v, 1)));
      ZINF_ASSERT_OK(f.Close());
    }
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader bad, CheckpointStateReader::Open(copy));
    std::vector<float> one(1);
    ZINF_EXPECT_OK(bad.Read(StateTensor::kExpAvgSq, 0, one));
    EXPECT_THAT(bad.Read(StateTensor::kExpAvgSq, total - 1, one),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("/state/exp_avg_sq")));
    ZINF_EXPECT_OK(bad.Read(StateTensor::kExpAvg, total - 1, one));
  }
  ZINF_ASSERT_OK(World().Barrier());
}

TEST(CheckpointStateReader, DecodesQ8MomentsAsExportDoes) {
  SharedScratchDir dir("reader_q8");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t,
                            MakeSwapper(World(), {.store_dir = dir.path(),
                                                  .job_id = "reader_q8",
                                                  .world_size = World().size(),
                                                  .state_format = StateFormat::kQ8}));
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(*t.swapper, 3)));
  ZINF_ASSERT_OK(SaveCheckpoint(*t.swapper, 3, Save(dir.Join("ckpt"))));
  ZINF_ASSERT_OK(t.swapper->Close());
  if (World().rank() == 0) {
    // The reference: the HDF5 export with moments (a q8 file's decoded moments).
    const std::string out = dir.Join("export.h5");
    ZINF_ASSERT_OK(ExportCheckpoint(dir.Join("ckpt"), out, ExportFormat::kHdf5, {}, true));
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader reader,
                              CheckpointStateReader::Open(dir.Join("ckpt")));
    ASSERT_EQ(reader.info().state_format, StateFormat::kQ8);
    ZINF_ASSERT_OK_AND_ASSIGN(h5::H5File ref, h5::H5File::OpenSerial(out, true));
    for (const partition::ParamInfo& p : reader.info().layout->params()) {
      for (StateTensor which : {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
        SCOPED_TRACE(fmt::format("{} {}", StateTensorName(which), p.name));
        const std::string name = which == StateTensor::kFp32
                                     ? p.name
                                     : fmt::format("{}/{}", StateTensorName(which), p.name);
        std::vector<float> want(p.numel), got(p.numel);
        ZINF_ASSERT_OK(ref.ReadSlab(name, 0, std::span(want)));
        ZINF_ASSERT_OK(reader.Read(which, p.flat_offset, got));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), 4 * p.numel), 0);
      }
    }
    ZINF_ASSERT_OK(ref.Close());
  }
  ZINF_ASSERT_OK(World().Barrier());
}

}  // namespace
}  // namespace zinf::checkpoint
