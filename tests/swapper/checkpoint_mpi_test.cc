// Multi-rank tests of checkpoint save/restore (run under mpirun with 1-4 ranks): round trips are
// bit-exact, N -> M restores every element, the commit protocol leaves only complete files, and
// corrupted or mismatched files fail with a clear error on every rank, leaving the store as it was.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "zinf/storage/hdf5.h"
#include "zinf/swapper/checkpoint.h"

namespace zinf::swapper {
namespace {

using checkpoint_testing::CheckState;
using checkpoint_testing::FillState;
using checkpoint_testing::MakeSwapper;
using checkpoint_testing::StateValue;
using checkpoint_testing::SwapperSetup;
using checkpoint_testing::TestSwapper;
using ::testing::HasSubstr;
using testing::IsOk;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

// Small chunks: many chunks per partition, and chunks that straddle ranks and sub-groups.
constexpr std::uint64_t kChunk = 1000;

CheckpointSaveOptions SaveOptions(const std::string& dir, int keep_last = 0) {
  CheckpointSaveOptions o;
  o.dir = dir;
  o.keep_last = keep_last;
  o.chunk_numel = kChunk;
  o.config = {{"train_batch_size", 8}};
  o.trainer = {{"step", 1}, {"data_position", 12345}, {"rng", "abc"}};
  o.progress = false;
  return o;
}

CheckpointRestoreOptions RestoreOptions() {
  CheckpointRestoreOptions o;
  o.progress = false;
  return o;
}

TEST(Checkpoint, RoundTripIsBitExactAndCommitsAtomically) {
  SharedScratchDir dir("ckpt");
  const std::string ckpt = dir.Join("ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "rt",
                                                                 .world_size = World().size()}));
  OptimizerSwapper& s = *t.swapper;
  for (std::int64_t step = 1; step <= 3; ++step) {
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, step)));
    ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpoint saved, SaveCheckpoint(s, step, SaveOptions(ckpt, 2)));
    EXPECT_EQ(saved.path, ckpt + "/" + CheckpointFileName(step));
  }
  // keep_last 2: steps 2 and 3 remain, `latest` names step 3, no partial or temporary file.
  if (World().rank() == 0) {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
      names.push_back(e.path().filename().string());
    }
    EXPECT_THAT(names, ::testing::UnorderedElementsAre("step-2.h5", "step-3.h5", "latest"));
    std::ifstream latest(ckpt + "/latest");
    std::string line;
    std::getline(latest, line);
    EXPECT_EQ(line, "step-3.h5");
  }
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 99)));
  ZINF_ASSERT_OK_AND_ASSIGN(RestoredCheckpoint r, RestoreCheckpoint(s, ckpt, RestoreOptions()));
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.world_size, World().size());
  EXPECT_EQ(r.trainer["data_position"], 12345);
  EXPECT_EQ(r.config["train_batch_size"], 8);
  EXPECT_EQ(r.optimizer["type"], "AdamW");
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(s, 3)));
  for (std::size_t i = 0; i < s.num_sub_groups(); ++i) EXPECT_EQ(s.last_step(i), 3);
  // An explicit file restores too (the older one).
  ZINF_ASSERT_OK(RestoreCheckpoint(s, ckpt + "/step-2.h5", RestoreOptions()));
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(s, 2)));
  // Serial tools agree.
  if (World().rank() == 0) {
    ZINF_EXPECT_OK(VerifyCheckpoint(ckpt));
    auto info = ReadCheckpointInfo(ckpt);
    ZINF_ASSERT_OK(info);
    EXPECT_EQ(info->step, 3);
    EXPECT_EQ(info->chunk_numel, kChunk);
    EXPECT_EQ(info->world_size, World().size());
    EXPECT_EQ(info->layout->num_params(), 6u);
  }
  ZINF_ASSERT_OK(s.Close());
}

// N -> M for every pair in 1..4 (flat plans), plus per-parameter (ZeRO-3) plans on restore.
TEST(Checkpoint, RestoresOnAnyWorldSize) {
  if (World().size() != 4) GTEST_SKIP() << "needs 4 ranks (runs every N, M in 1..4)";
  SharedScratchDir dir("ckpt");
  const int rank = World().rank();
  for (int n = 1; n <= 4; ++n) {
    ZINF_ASSERT_OK_AND_ASSIGN(comm::Communicator save_comm, World().Split(rank < n ? 0 : 1, rank));
    if (rank < n) {
      ZINF_ASSERT_OK_AND_ASSIGN(
          TestSwapper t,
          MakeSwapper(save_comm, {.store_dir = dir.path(),
                                  .job_id = fmt::format("save{}", n),
                                  .world_size = n,
                                  .sub_group_size = static_cast<std::uint64_t>(1500 + 200 * n)}));
      ZINF_ASSERT_OK(save_comm.AgreeOnStatus(FillState(*t.swapper, 10 + n)));
      ZINF_ASSERT_OK(
          SaveCheckpoint(*t.swapper, 10 + n, SaveOptions(dir.Join(fmt::format("n{}", n)))));
      ZINF_ASSERT_OK(t.swapper->Close());
    }
    ZINF_ASSERT_OK(World().Barrier());
  }
  for (int n = 1; n <= 4; ++n) {
    for (int m = 1; m <= 4; ++m) {
      for (bool per_param : {false, true}) {
        SCOPED_TRACE(fmt::format("N={} M={} per_param={}", n, m, per_param));
        ZINF_ASSERT_OK_AND_ASSIGN(comm::Communicator c, World().Split(rank < m ? 0 : 1, rank));
        Status ok = OkStatus();
        if (rank < m) {
          ZINF_ASSERT_OK_AND_ASSIGN(
              TestSwapper t,
              MakeSwapper(c, {.store_dir = dir.path(),
                              .job_id = fmt::format("r{}{}{}", n, m, per_param ? "p" : "f"),
                              .world_size = m,
                              .per_param = per_param,
                              .sub_group_size = 1024}));
          ZINF_ASSERT_OK(
              RestoreCheckpoint(*t.swapper, dir.Join(fmt::format("n{}", n)), RestoreOptions()));
          ok = CheckState(*t.swapper, 10 + n);
          ZINF_ASSERT_OK(t.swapper->Close());
        }
        ZINF_EXPECT_OK(World().AgreeOnStatus(ok));
      }
    }
  }
}

// Rewrites one float of a dataset in place with one bit flipped (serial, rank 0).
Status FlipBit(const std::string& path, const std::string& dataset, std::uint64_t element) {
  ZINF_ASSIGN_OR_RETURN(storage::H5File f, storage::H5File::OpenSerial(path, false));
  float v = 0;
  ZINF_RETURN_IF_ERROR(f.ReadSlab(dataset, element, std::span(&v, 1)));
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits ^= 1u << 7;
  std::memcpy(&v, &bits, 4);
  ZINF_RETURN_IF_ERROR(f.WriteSlab(dataset, element, std::span<const float>(&v, 1)));
  return f.Close();
}

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<SharedScratchDir>("ckpt");
    ckpt_ = dir_->Join("ckpt");
    auto t = MakeSwapper(
        World(), {.store_dir = dir_->path(), .job_id = "err", .world_size = World().size()});
    ZINF_ASSERT_OK(t);
    t_ = std::move(*t);
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(*t_.swapper, 5)));
    ZINF_ASSERT_OK(SaveCheckpoint(*t_.swapper, 5, SaveOptions(ckpt_)));
    file_ = ckpt_ + "/step-5.h5";
    // The live state differs from the file: a failed restore must leave it at step 6.
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(*t_.swapper, 6)));
  }
  void TearDown() override {
    if (t_.swapper) ZINF_EXPECT_OK(t_.swapper->Close());
    t_ = {};
    dir_.reset();
  }
  // Restore fails with `code` on every rank and leaves the store at step 6.
  template <typename M>
  void ExpectRestoreFails(const std::string& path, ErrorCode code, M matcher) {
    EXPECT_THAT(RestoreCheckpoint(*t_.swapper, path, RestoreOptions()), StatusIs(code, matcher));
    ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(*t_.swapper, 6)));
  }

  std::unique_ptr<SharedScratchDir> dir_;
  std::string ckpt_, file_;
  TestSwapper t_;
};

TEST_F(CheckpointErrors, BitFlipIsCaughtByVerifyAndRestore) {
  const std::uint64_t total = checkpoint_testing::TestLayout().total_numel();
  for (const char* ds : {"/state/fp32", "/state/exp_avg", "/state/exp_avg_sq"}) {
    SCOPED_TRACE(ds);
    const std::string copy = fmt::format("{}/flip{}.h5", dir_->path(), std::string(ds).substr(7));
    const std::uint64_t element = total - 3;  // the last chunk, owned by the last rank
    if (World().rank() == 0) {
      std::filesystem::copy_file(file_, copy);
      ZINF_ASSERT_OK(FlipBit(copy, ds, element));
      const std::uint64_t chunk = element / kChunk;
      EXPECT_THAT(VerifyCheckpoint(copy),
                  StatusIs(ErrorCode::kDataLoss,
                           HasSubstr(fmt::format("dataset {} chunk {} elements [{}, {})", ds, chunk,
                                                 chunk * kChunk, total))));
    }
    ZINF_ASSERT_OK(World().Barrier());
    ExpectRestoreFails(copy, ErrorCode::kDataLoss, HasSubstr("checksum mismatch"));
  }
}

TEST_F(CheckpointErrors, TruncatedFileIsDataLoss) {
  const std::string copy = dir_->Join("trunc.h5");
  if (World().rank() == 0) {
    std::filesystem::copy_file(file_, copy);
    std::filesystem::resize_file(copy, std::filesystem::file_size(copy) / 2);
    EXPECT_THAT(VerifyCheckpoint(copy), StatusIs(ErrorCode::kDataLoss));
  }
  ZINF_ASSERT_OK(World().Barrier());
  ExpectRestoreFails(copy, ErrorCode::kDataLoss, ::testing::_);
}

TEST_F(CheckpointErrors, WrongFormatVersionIsFailedPrecondition) {
  const std::string copy = dir_->Join("v2.h5");
  if (World().rank() == 0) {
    std::filesystem::copy_file(file_, copy);
    auto f = storage::H5File::OpenSerial(copy, false);
    ZINF_ASSERT_OK(f);
    ZINF_ASSERT_OK(f->WriteInt64Attribute("/", "format_version", 2));
    ZINF_ASSERT_OK(f->Close());
  }
  ZINF_ASSERT_OK(World().Barrier());
  ExpectRestoreFails(copy, ErrorCode::kFailedPrecondition,
                     HasSubstr("unsupported format_version 2"));
}

TEST_F(CheckpointErrors, MissingDatasetIsDataLoss) {
  // A checkpoint whose writer stopped before /state/exp_avg: copy everything else by hand.
  const std::string copy = dir_->Join("missing.h5");
  if (World().rank() == 0) {
    auto src = storage::H5File::OpenSerial(file_, true);
    ZINF_ASSERT_OK(src);
    auto dst = storage::H5File::CreateSerial(copy);
    ZINF_ASSERT_OK(dst);
    for (const char* a : {"format", "optimizer", "config", "created"}) {
      auto v = src->ReadStringAttribute("/", a);
      ZINF_ASSERT_OK(v);
      ZINF_ASSERT_OK(dst->WriteStringAttribute("/", a, *v));
    }
    for (const char* a :
         {"format_version", "step", "world_size", "total_numel", "sub_group_size", "chunk_numel"}) {
      auto v = src->ReadInt64Attribute("/", a);
      ZINF_ASSERT_OK(v);
      ZINF_ASSERT_OK(dst->WriteInt64Attribute("/", a, *v));
    }
    auto layout = src->ReadStringAttribute("/layout", "json");
    ZINF_ASSERT_OK(layout);
    ZINF_ASSERT_OK(dst->CreateGroup("/layout"));
    ZINF_ASSERT_OK(dst->WriteStringAttribute("/layout", "json", *layout));
    const std::uint64_t total = checkpoint_testing::TestLayout().total_numel();
    ZINF_ASSERT_OK(
        dst->CreateDataset1D("/state/fp32", total, kChunk, storage::H5DataType::kFloat32));
    ZINF_ASSERT_OK(dst->Close());
    EXPECT_THAT(VerifyCheckpoint(copy),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("missing dataset /checksum/fp32")));
  }
  ZINF_ASSERT_OK(World().Barrier());
  ExpectRestoreFails(copy, ErrorCode::kDataLoss, HasSubstr("missing dataset"));
}

TEST_F(CheckpointErrors, MissingFileAndLatestAreNotFound) {
  ExpectRestoreFails(dir_->Join("nope.h5"), ErrorCode::kNotFound, HasSubstr("nope.h5"));
  ExpectRestoreFails(dir_->path(), ErrorCode::kNotFound, HasSubstr("no 'latest'"));
}

TEST_F(CheckpointErrors, LayoutMismatchNamesTheParameter) {
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper other, MakeSwapper(World(), {.store_dir = dir_->path(),
                                                                     .job_id = "other",
                                                                     .world_size = World().size(),
                                                                     .other_layout = true}));
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(*other.swapper, 6)));
  EXPECT_THAT(RestoreCheckpoint(*other.swapper, ckpt_, RestoreOptions()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("'w1'")));
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(*other.swapper, 6)));
  ZINF_EXPECT_OK(other.swapper->Close());
}

TEST_F(CheckpointErrors, OptimizerMismatchIsFailedPrecondition) {
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper adam, MakeSwapper(World(), {.store_dir = dir_->path(),
                                                                    .job_id = "adam",
                                                                    .world_size = World().size(),
                                                                    .adamw = false}));
  EXPECT_THAT(RestoreCheckpoint(*adam.swapper, ckpt_, RestoreOptions()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("optimizer mismatch")));
  ZINF_EXPECT_OK(adam.swapper->Close());
}

TEST_F(CheckpointErrors, H5dumpReadsACheckpoint) {
  if (World().rank() != 0) GTEST_SKIP() << "rank 0 runs h5dump";
  if (std::system("command -v h5dump > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "h5dump not installed (hdf5-tools)";
  }
  const std::string out = dir_->Join("dump.txt");
  // The header (every attribute and dataset), then the data of one dataset.
  EXPECT_EQ(
      std::system(
          fmt::format(
              "h5dump -H {0} > {1} 2>&1 && h5dump -a /format -d /checksum/fp32 {0} >> {1} 2>&1",
              file_, out)
              .c_str()),
      0);
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"zinf\""));
  EXPECT_THAT(text, HasSubstr("DATASET \"exp_avg_sq\""));
  EXPECT_THAT(text, HasSubstr("DATASET \"/checksum/fp32\""));
  EXPECT_THAT(text, HasSubstr("DATA {"));
}

TEST_F(CheckpointErrors, ExportWritesPerParameterWeights) {
  if (World().rank() != 0) GTEST_SKIP() << "rank 0 exports";
  const partition::ParamLayout layout = checkpoint_testing::TestLayout();
  // HDF5: one dataset per parameter with its shape.
  const std::string h5 = dir_->Join("weights.h5");
  ZINF_ASSERT_OK(ExportCheckpoint(file_, h5, ExportFormat::kHdf5));
  auto f = storage::H5File::OpenSerial(h5, true);
  ZINF_ASSERT_OK(f);
  for (const partition::ParamInfo& p : layout.params()) {
    std::vector<float> got(p.numel);
    ZINF_ASSERT_OK(f->ReadSlab(p.name, 0, std::span(got)));
    for (std::uint64_t k = 0; k < p.numel; ++k) {
      ASSERT_EQ(got[k], StateValue(StateTensor::kFp32, 5, p.flat_offset + k)) << p.name << k;
    }
    EXPECT_THAT(f->ReadStringAttribute(p.name, "shape"),
                ::testing::Optional(partition::FormatShape(p.shape)));
  }
  ZINF_ASSERT_OK(f->Close());
  // safetensors: header size, JSON header, data at the offsets it gives.
  const std::string st = dir_->Join("weights.safetensors");
  ZINF_ASSERT_OK(ExportCheckpoint(file_, st, ExportFormat::kSafetensors));
  std::ifstream in(st, std::ios::binary);
  std::uint64_t header_size = 0;
  in.read(reinterpret_cast<char*>(&header_size), 8);
  ASSERT_EQ(header_size % 8, 0u);
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  const nlohmann::json header = nlohmann::json::parse(text);
  for (const partition::ParamInfo& p : layout.params()) {
    const nlohmann::json& e = header.at(p.name);
    EXPECT_EQ(e.at("dtype"), "F32");
    EXPECT_EQ(e.at("shape").get<std::vector<std::int64_t>>(), p.shape);
    const auto begin = e.at("data_offsets")[0].get<std::uint64_t>();
    EXPECT_EQ(e.at("data_offsets")[1].get<std::uint64_t>() - begin, p.numel * 4);
    std::vector<float> got(p.numel);
    in.seekg(static_cast<std::streamoff>(8 + header_size + begin));
    in.read(reinterpret_cast<char*>(got.data()), static_cast<std::streamsize>(p.numel * 4));
    for (std::uint64_t k = 0; k < p.numel; ++k) {
      ASSERT_EQ(got[k], StateValue(StateTensor::kFp32, 5, p.flat_offset + k)) << p.name << k;
    }
  }
}

}  // namespace
}  // namespace zinf::swapper
