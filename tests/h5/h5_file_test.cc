#include "zinf/h5/h5_file.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "handles.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"

namespace zinf::h5 {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::ScratchDir;
using ::zinf::testing::StatusIs;

std::vector<float> Iota(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

class H5FileSerialTest : public ::testing::Test {
 protected:
  ScratchDir dir_{"hdf5"};
  std::string path_ = dir_.Join("ckpt.h5");
};

TEST_F(H5FileSerialTest, DatasetsRoundTripThroughCloseAndReopen) {
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
    EXPECT_FALSE(file.is_collective());
    ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", 1000, 128, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.CreateDataset1D("checksum/fp32", 8, 8, H5DataType::kUInt64));
    ZINF_ASSERT_OK(file.CreateDataset1D("/trainer/counters", 3, 1 << 20, H5DataType::kInt64));
    // Uneven pieces, written out of order, one of them empty.
    const std::vector<float> all = Iota(1000, 0.5f);
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", 700, std::span(all).subspan(700)));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", 0, std::span(all).first(333)));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", 333, std::span(all).subspan(333, 367)));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", 1000, std::span<const float>()));
    const std::vector<std::uint64_t> sums = {0, 1, 2, 3, 0xffffffffffffffffULL, 5, 6, 7};
    ZINF_ASSERT_OK(file.WriteSlab("/checksum/fp32", 0, std::span(sums)));
    const std::vector<std::int64_t> counters = {-1, 0, 1LL << 40};
    ZINF_ASSERT_OK(file.WriteSlab("/trainer/counters", 0, std::span(counters)));
    ZINF_ASSERT_OK(file.Flush());
    EXPECT_EQ(file.last_transfer_mode(), H5TransferMode::kNotCollective);
    ZINF_ASSERT_OK(file.Close());
    EXPECT_FALSE(file.is_open());
    ZINF_EXPECT_OK(file.Close());  // idempotent
  }
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::OpenSerial(path_, /*read_only=*/true));
  EXPECT_TRUE(file.read_only());
  EXPECT_THAT(file.DatasetNumel("/state/fp32"), ::testing::Optional(1000u));
  EXPECT_THAT(file.DatasetType("state/fp32"), ::testing::Optional(H5DataType::kFloat32));
  EXPECT_THAT(file.DatasetType("/checksum/fp32"), ::testing::Optional(H5DataType::kUInt64));
  EXPECT_THAT(file.DatasetType("/trainer/counters"), ::testing::Optional(H5DataType::kInt64));
  EXPECT_THAT(file.HasDataset("/state/fp32"), ::testing::Optional(true));
  EXPECT_THAT(file.HasDataset("/state"), ::testing::Optional(false));  // a group
  EXPECT_THAT(file.HasDataset("/nothing/here"), ::testing::Optional(false));

  std::vector<float> back(250);
  ZINF_ASSERT_OK(file.ReadSlab("/state/fp32", 300, std::span(back)));
  EXPECT_EQ(back, Iota(250, 300.5f));
  std::vector<std::uint64_t> sums(2);
  ZINF_ASSERT_OK(file.ReadSlab("/checksum/fp32", 3, std::span(sums)));
  EXPECT_THAT(sums, ElementsAre(3u, 0xffffffffffffffffULL));
  std::vector<std::int64_t> counters(3);
  ZINF_ASSERT_OK(file.ReadSlab("/trainer/counters", 0, std::span(counters)));
  EXPECT_THAT(counters, ElementsAre(-1, 0, 1LL << 40));
  ZINF_EXPECT_OK(file.ReadSlab("/state/fp32", 17, std::span<float>()));
  ZINF_ASSERT_OK(file.Close());
}

TEST_F(H5FileSerialTest, AttributesRoundTripOnRootGroupAndDataset) {
  const std::string json = R"({"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999]}})";
  const std::string big(100 * 1024, 'x');  // above the 64 KiB compact-attribute limit
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
    ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", 10, 4, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.CreateGroup("/trainer"));
    ZINF_ASSERT_OK(file.CreateGroup("/trainer"));  // exists: OK
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "format", "zinf"));
    ZINF_ASSERT_OK(file.WriteInt64Attribute("/", "step", 41));
    ZINF_ASSERT_OK(file.WriteInt64Attribute("/", "step", 42));  // replaced
    ZINF_ASSERT_OK(file.WriteDoubleAttribute("/trainer", "lr", 1.5e-4));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "optimizer", json));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "empty", ""));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "config", big));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/state/fp32", "checksum_algorithm", "xxh3-64"));
    ZINF_ASSERT_OK(file.WriteInt64Attribute("/state/fp32", "kind", -7));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/state/fp32", "kind", "now a string"));
    ZINF_ASSERT_OK(file.Close());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::OpenSerial(path_, /*read_only=*/true));
  EXPECT_THAT(file.ReadStringAttribute("/", "format"), ::testing::Optional(std::string("zinf")));
  EXPECT_THAT(file.ReadInt64Attribute("/", "step"), ::testing::Optional(42));
  EXPECT_THAT(file.ReadDoubleAttribute("trainer", "lr"), ::testing::Optional(1.5e-4));
  EXPECT_THAT(file.ReadStringAttribute("/", "optimizer"), ::testing::Optional(json));
  EXPECT_THAT(file.ReadStringAttribute("/", "empty"), ::testing::Optional(std::string()));
  EXPECT_THAT(file.ReadStringAttribute("/", "config"), ::testing::Optional(big));
  EXPECT_THAT(file.ReadStringAttribute("/state/fp32", "checksum_algorithm"),
              ::testing::Optional(std::string("xxh3-64")));
  EXPECT_THAT(file.ReadStringAttribute("/state/fp32", "kind"),
              ::testing::Optional(std::string("now a string")));
  EXPECT_THAT(file.HasAttribute("/", "step"), ::testing::Optional(true));
  EXPECT_THAT(file.HasAttribute("/", "nope"), ::testing::Optional(false));

  EXPECT_THAT(file.ReadInt64Attribute("/", "nope"),
              StatusIs(ErrorCode::kNotFound, HasSubstr("attribute nope of /")));
  EXPECT_THAT(file.ReadInt64Attribute("/missing", "step"), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(file.HasAttribute("/missing", "step"), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(file.ReadInt64Attribute("/", "format"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("is a string, not an integer")));
  EXPECT_THAT(file.ReadStringAttribute("/", "step"),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("not a string")));
  EXPECT_THAT(file.ReadDoubleAttribute("/", "step"), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(file.WriteInt64Attribute("/", "step", 1), StatusIs(ErrorCode::kFailedPrecondition));
}

TEST_F(H5FileSerialTest, CreateRefusesAnExistingFileUnlessTruncating) {
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
    ZINF_ASSERT_OK(file.CreateDataset1D("/a", 4, 4, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.Close());
  }
  EXPECT_THAT(H5File::CreateSerial(path_), StatusIs(ErrorCode::kAlreadyExists, HasSubstr(path_)));
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_, H5CreateMode::kTruncate));
  EXPECT_THAT(file.HasDataset("/a"), ::testing::Optional(false));
  ZINF_ASSERT_OK(file.Close());
}

TEST_F(H5FileSerialTest, CreateInMissingDirectoryIsNotFound) {
  EXPECT_THAT(H5File::CreateSerial(dir_.Join("no/such/dir/x.h5")), StatusIs(ErrorCode::kNotFound));
}

TEST_F(H5FileSerialTest, OpenMissingFileIsNotFound) {
  EXPECT_THAT(H5File::OpenSerial(path_, true), StatusIs(ErrorCode::kNotFound, HasSubstr(path_)));
}

TEST_F(H5FileSerialTest, OpenNonHdf5FileIsDataLossWithTheHdf5ErrorStack) {
  {
    std::ofstream out(path_);
    out << "this is not an HDF5 file, just some text long enough to have no superblock\n";
  }
  const Result<H5File> file = H5File::OpenSerial(path_, true);
  ASSERT_FALSE(file.has_value());
  EXPECT_THAT(file, StatusIs(ErrorCode::kDataLoss,
                             AllOf(HasSubstr("H5Fopen " + path_), HasSubstr("HDF5 error stack"),
                                   HasSubstr("H5Fopen: unable to open file"),
                                   HasSubstr("file signature not found"))));
  // The stack was copied and cleared, not left behind for the next call.
  EXPECT_EQ(handles::ErrorStackText(), "(HDF5 error stack empty)");
}

TEST_F(H5FileSerialTest, MissingDatasetIsNotFound) {
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
  ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", 4, 4, H5DataType::kFloat32));
  std::vector<float> buffer(2);
  EXPECT_THAT(file.DatasetNumel("/state/exp_avg"),
              StatusIs(ErrorCode::kNotFound, HasSubstr("/state/exp_avg")));
  EXPECT_THAT(file.DatasetNumel("/nogroup/fp32"), StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(file.ReadSlab("/state/exp_avg", 0, std::span(buffer)),
              StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(file.WriteSlab("/state/fp32/below_a_dataset", 0, std::span<const float>(buffer)),
              StatusIs(ErrorCode::kNotFound));
  EXPECT_THAT(file.DatasetNumel("/state"), StatusIs(ErrorCode::kInvalidArgument));
}

TEST_F(H5FileSerialTest, BadArgumentsAreInvalidArgument) {
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
  ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", 10, 4, H5DataType::kFloat32));
  std::vector<float> four(4);
  EXPECT_THAT(file.WriteSlab("/state/fp32", 7, std::span<const float>(four)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("elements [7, 11)")));
  EXPECT_THAT(file.ReadSlab("/state/fp32", std::uint64_t{1} << 63, std::span(four)),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(file.ReadSlab("/state/fp32", ~std::uint64_t{0}, std::span(four)),
              StatusIs(ErrorCode::kInvalidArgument));  // offset + count overflows
  std::vector<std::uint64_t> wrong_type(2);
  EXPECT_THAT(file.WriteSlab("/state/fp32", 0, std::span<const std::uint64_t>(wrong_type)),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("holds float32, the buffer uint64")));
  EXPECT_THAT(file.CreateDataset1D("/state/fp32", 10, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kAlreadyExists));
  EXPECT_THAT(file.CreateDataset1D("/x", 10, 0, H5DataType::kFloat32),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("chunk_numel")));
  EXPECT_THAT(file.CreateDataset1D("/y", std::uint64_t{1} << 40, std::uint64_t{1} << 31,
                                   H5DataType::kFloat32),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("4 GiB")));
  EXPECT_THAT(file.CreateDataset1D("", 10, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(file.CreateDataset1D("/", 10, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(file.CreateDataset1D("/a//b", 10, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kInvalidArgument));
}

TEST_F(H5FileSerialTest, EmptyDatasetAndChunkLargerThanDataset) {
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
  ZINF_ASSERT_OK(file.CreateDataset1D("/empty", 0, 0, H5DataType::kFloat32));
  ZINF_ASSERT_OK(file.CreateDataset1D("/small", 3, 1 << 20, H5DataType::kFloat32));
  EXPECT_THAT(file.DatasetNumel("/empty"), ::testing::Optional(0u));
  ZINF_EXPECT_OK(file.WriteSlab("/empty", 0, std::span<const float>()));
  const std::vector<float> three = {1, 2, 3};
  ZINF_EXPECT_OK(file.WriteSlab("/small", 0, std::span(three)));
  ZINF_ASSERT_OK(file.Close());
}

TEST_F(H5FileSerialTest, ReadOnlyFileRefusesWrites) {
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
    ZINF_ASSERT_OK(file.CreateDataset1D("/a", 4, 4, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.Close());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::OpenSerial(path_, true));
  const std::vector<float> data(4);
  EXPECT_THAT(file.WriteSlab("/a", 0, std::span(data)),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("read-only")));
  EXPECT_THAT(file.CreateDataset1D("/b", 4, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(file.CreateGroup("/g"), StatusIs(ErrorCode::kFailedPrecondition));
}

TEST_F(H5FileSerialTest, MovedFromAndClosedFilesRefuseWork) {
  ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
  H5File other = std::move(file);
  EXPECT_FALSE(file.is_open());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(other.is_open());
  EXPECT_THAT(file.HasDataset("/a"), StatusIs(ErrorCode::kFailedPrecondition));
  ZINF_EXPECT_OK(file.Close());
  ZINF_ASSERT_OK(other.Close());
  EXPECT_THAT(other.CreateDataset1D("/a", 4, 4, H5DataType::kFloat32),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("closed")));
  EXPECT_THAT(other.Flush(), StatusIs(ErrorCode::kFailedPrecondition));
  EXPECT_THAT(other.WriteStringAttribute("/", "a", "b"), StatusIs(ErrorCode::kFailedPrecondition));
}

TEST_F(H5FileSerialTest, H5dumpReadsTheFile) {
  const std::string h5dump = ZINF_H5DUMP;
  if (!std::filesystem::exists(h5dump))
    ZINF_SKIP_MISSING("h5dump", "h5dump not installed (hdf5-tools)");
  {
    ZINF_ASSERT_OK_AND_ASSIGN(H5File file, H5File::CreateSerial(path_));
    ZINF_ASSERT_OK(file.CreateDataset1D("/state/fp32", 5, 2, H5DataType::kFloat32));
    ZINF_ASSERT_OK(file.WriteSlab("/state/fp32", 0, std::span<const float>(Iota(5, 1))));
    ZINF_ASSERT_OK(file.WriteStringAttribute("/", "format", "zinf"));
    ZINF_ASSERT_OK(file.Close());
  }
  const std::string out = dir_.Join("dump.txt");
  const std::string command = h5dump + " " + path_ + " > " + out + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, AllOf(HasSubstr("DATASET \"fp32\""), HasSubstr("1, 2, 3, 4, 5"),
                          HasSubstr("\"zinf\"")));
}

// ---- The private handle wrappers ----

TEST(H5Handle, MovedFromIsEmptyAndTheOwnerCloses) {
  handles::InitHdf5();
  hid_t id = H5Screate(H5S_SCALAR);
  ASSERT_GE(id, 0);
  {
    handles::DataspaceHandle a(id);
    EXPECT_GT(H5Iis_valid(id), 0);
    handles::DataspaceHandle b(std::move(a));
    EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(b.get(), id);
    handles::DataspaceHandle c;
    c = std::move(b);
    EXPECT_GT(H5Iis_valid(id), 0);
  }
  EXPECT_EQ(H5Iis_valid(id), 0);  // closed exactly once, by the last owner
}

TEST(H5Handle, CloseReportsFailureWithTheStack) {
  handles::InitHdf5();
  hid_t id = H5Screate(H5S_SCALAR);
  ASSERT_GE(id, 0);
  ASSERT_GE(H5Sclose(id), 0);
  handles::DataspaceHandle stale(id);  // already closed behind its back
  EXPECT_THAT(stale.Close("closing a stale dataspace"),
              StatusIs(ErrorCode::kInternal,
                       AllOf(HasSubstr("closing a stale dataspace"), HasSubstr("H5Sclose"))));
  EXPECT_FALSE(stale.valid());
  ZINF_EXPECT_OK(stale.Close("again"));
}

TEST(H5Handle, CheckTurnsNegativeIdsIntoErrors) {
  handles::InitHdf5();
  const Result<handles::FileHandle> file = handles::Check<handles::FileHandle>(
      H5Fopen("/nonexistent/zinf.h5", H5F_ACC_RDONLY, H5P_DEFAULT), ErrorCode::kNotFound,
      "open it");
  EXPECT_THAT(file,
              StatusIs(ErrorCode::kNotFound, AllOf(HasSubstr("open it: HDF5 error stack: H5Fopen"),
                                                   HasSubstr("unable to open file"))));
}

}  // namespace
}  // namespace zinf::h5
