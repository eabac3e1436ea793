// CheckpointWriter (checkpoint.h): a file written serially on rank 0, in pieces of any size with
// the states interleaved, verifies, reads back bitwise and restores on 1-3 ranks exactly like a
// saved one; nothing is at the output until Commit succeeds (an incomplete state, a failing
// check, a writer dropped, an existing output).
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

namespace zinf::checkpoint {
namespace {

using checkpoint_testing::CheckState;
using checkpoint_testing::MakeSwapper;
using checkpoint_testing::StateValue;
using checkpoint_testing::TestLayout;
using checkpoint_testing::TestSwapper;
using ::testing::HasSubstr;
using testing::SharedScratchDir;
using testing::StatusIs;
using testing::World;

constexpr std::uint64_t kChunk = 1000;
constexpr StateTensor kAll[] = {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq};

CheckpointWriterOptions Options(std::int64_t step) {
  CheckpointWriterOptions o;
  o.step = step;
  o.world_size = 3;
  o.sub_group_size = 2000;
  o.chunk_numel = kChunk;
  o.optimizer = {{"type", "AdamW"},
                 {"params",
                  {{"lr", 1e-2},
                   {"betas", {0.9, 0.999}},
                   {"eps", 1e-8},
                   {"weight_decay", 0.01},
                   {"adam_w_mode", true}}}};
  o.config = {{"train_batch_size", 3}};
  o.trainer = {{"step", step}, {"user", {{"seed", 7}}}};
  return o;
}

// The values StateValue gives for step `step`, from `first` on, `numel` of them.
std::vector<float> Values(StateTensor which, std::int64_t step, std::uint64_t first,
                          std::uint64_t numel) {
  std::vector<float> v(numel);
  for (std::uint64_t k = 0; k < numel; ++k) v[k] = StateValue(which, step, first + k);
  return v;
}

// Writes every state in pieces of 1, 999, 1001, 4096, ... elements, the states interleaved.
Status WriteAll(CheckpointWriter& w, std::int64_t step, std::uint64_t total) {
  const std::uint64_t pieces[] = {1, 999, 1001, 4096, 0, 7, 2000, 12345};
  std::uint64_t at = 0;
  for (std::size_t i = 0; at < total; ++i) {
    const std::uint64_t n = std::min(pieces[i % std::size(pieces)], total - at);
    for (StateTensor which : kAll) {
      ZINF_RETURN_IF_ERROR(w.Append(which, Values(which, step, at, n)));
    }
    at += n;
  }
  return OkStatus();
}

TEST(CheckpointWriter, WritesAFileThatRestoresOnAnyWorldSize) {
  SharedScratchDir dir("writer");
  const std::string path = dir.Join("imported.h5");
  const partition::ParamLayout layout = TestLayout();
  Status written = OkStatus();
  if (World().rank() == 0) {
    written = [&]() -> Status {
      ZINF_ASSIGN_OR_RETURN(CheckpointWriter w, CheckpointWriter::Create(path, layout, Options(9)));
      CheckpointWriter moved = std::move(w);
      ZINF_RETURN_IF_ERROR(WriteAll(moved, 9, layout.total_numel()));
      return moved.Commit();
    }();
  }
  ZINF_ASSERT_OK(World().AgreeOnStatus(written));

  if (World().rank() == 0) {
    ZINF_ASSERT_OK(VerifyCheckpoint(path));
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointInfo info, ReadCheckpointInfo(path));
    EXPECT_EQ(info.step, 9);
    EXPECT_EQ(info.world_size, 3);
    EXPECT_EQ(info.sub_group_size, 2000);
    EXPECT_EQ(info.chunk_numel, kChunk);
    EXPECT_EQ(info.state_format, StateFormat::kFp32);
    EXPECT_EQ(info.optimizer["type"], "AdamW");
    EXPECT_EQ(info.config["train_batch_size"], 3);
    EXPECT_EQ(info.trainer["user"]["seed"], 7);
    ASSERT_TRUE(info.layout.has_value());
    EXPECT_TRUE(*info.layout == layout);
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointStateReader reader, CheckpointStateReader::Open(path));
    for (StateTensor which : kAll) {
      std::vector<float> got(layout.total_numel());
      ZINF_ASSERT_OK(reader.Read(which, 0, got));
      const std::vector<float> want = Values(which, 9, 0, got.size());
      ASSERT_EQ(std::memcmp(got.data(), want.data(), 4 * got.size()), 0)
          << StateTensorName(which);
    }
  }
  ZINF_ASSERT_OK(World().Barrier());

  // Restored like a saved checkpoint: every rank's state bitwise.
  ZINF_ASSERT_OK_AND_ASSIGN(
      TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                           .job_id = "writer",
                                           .world_size = World().size()}));
  CheckpointRestoreOptions restore;
  restore.progress = false;
  ZINF_ASSERT_OK_AND_ASSIGN(RestoredCheckpoint restored,
                            RestoreCheckpoint(*t.swapper, path, restore));
  EXPECT_EQ(restored.step, 9);
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(*t.swapper, 9)));
  ZINF_ASSERT_OK(t.swapper->Close());
}

// Every failure leaves nothing at the output and no temporary beside it.
TEST(CheckpointWriter, NothingIsWrittenUnlessCommitSucceeds) {
  if (World().rank() != 0) GTEST_SKIP() << "serial: rank 0 only";
  const testing::ScratchDir scratch("writer_fail");
  const std::filesystem::path dir = scratch.path();
  const std::string out = (dir / "out.h5").string();
  const partition::ParamLayout layout = TestLayout();
  const std::uint64_t total = layout.total_numel();
  auto only_out_or_nothing = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      names.push_back(e.path().filename().string());
    }
    return names;
  };

  {  // A state left incomplete.
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointWriter w, CheckpointWriter::Create(out, layout, Options(1)));
    ZINF_ASSERT_OK(w.Append(StateTensor::kFp32, Values(StateTensor::kFp32, 1, 0, total)));
    ZINF_ASSERT_OK(w.Append(StateTensor::kExpAvg, Values(StateTensor::kExpAvg, 1, 0, total)));
    ZINF_ASSERT_OK(
        w.Append(StateTensor::kExpAvgSq, Values(StateTensor::kExpAvgSq, 1, 0, total - 1)));
    EXPECT_THAT(w.Commit(), StatusIs(ErrorCode::kFailedPrecondition,
                                     HasSubstr(fmt::format("{} of its {}", total - 1, total))));
    // Past the end: refused, nothing taken.
    EXPECT_THAT(w.Append(StateTensor::kExpAvgSq, std::vector<float>(2)),
                StatusIs(ErrorCode::kInvalidArgument, HasSubstr("past")));
  }
  EXPECT_THAT(only_out_or_nothing(), ::testing::IsEmpty());

  {  // The check fails on the complete file.
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointWriter w, CheckpointWriter::Create(out, layout, Options(1)));
    ZINF_ASSERT_OK(WriteAll(w, 1, total));
    std::string checked;
    EXPECT_THAT(w.Commit([&](const std::string& temp) {
      checked = temp;
      if (!VerifyCheckpoint(temp)) return InternalError("the complete file did not verify");
      return DataLossError("refused by the check");
    }),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("refused by the check")));
    EXPECT_NE(checked, out);
  }
  EXPECT_THAT(only_out_or_nothing(), ::testing::IsEmpty());

  {  // Dropped half-way.
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointWriter w, CheckpointWriter::Create(out, layout, Options(1)));
    ZINF_ASSERT_OK(w.Append(StateTensor::kFp32, Values(StateTensor::kFp32, 1, 0, 5000)));
  }
  EXPECT_THAT(only_out_or_nothing(), ::testing::IsEmpty());

  // Options out of range: refused before anything is made.
  CheckpointWriterOptions bad = Options(1);
  bad.optimizer = {{"type", "SGD"}};
  EXPECT_THAT(CheckpointWriter::Create(out, layout, bad),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("Adam")));
  bad = Options(-1);
  EXPECT_THAT(CheckpointWriter::Create(out, layout, bad), StatusIs(ErrorCode::kInvalidArgument));
  bad = Options(1);
  bad.world_size = 0;
  EXPECT_THAT(CheckpointWriter::Create(out, layout, bad), StatusIs(ErrorCode::kInvalidArgument));
  bad = Options(1);
  bad.trainer = nlohmann::json::array();
  EXPECT_THAT(CheckpointWriter::Create(out, layout, bad), StatusIs(ErrorCode::kInvalidArgument));
  EXPECT_THAT(only_out_or_nothing(), ::testing::IsEmpty());

  // A committed file is not replaced without Overwrite::kRegularFile; with it, it is.
  {
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointWriter w, CheckpointWriter::Create(out, layout, Options(1)));
    ZINF_ASSERT_OK(WriteAll(w, 1, total));
    ZINF_ASSERT_OK(w.Commit());
    EXPECT_THAT(w.Commit(), StatusIs(ErrorCode::kFailedPrecondition));
  }
  EXPECT_THAT(CheckpointWriter::Create(out, layout, Options(2)),
              StatusIs(ErrorCode::kAlreadyExists));
  {
    ZINF_ASSERT_OK_AND_ASSIGN(
        CheckpointWriter w,
        CheckpointWriter::Create(out, layout, Options(2), storage::Overwrite::kRegularFile));
    ZINF_ASSERT_OK(WriteAll(w, 2, total));
    ZINF_ASSERT_OK(w.Commit());
  }
  ZINF_ASSERT_OK_AND_ASSIGN(CheckpointInfo info, ReadCheckpointInfo(out));
  EXPECT_EQ(info.step, 2);
  EXPECT_THAT(only_out_or_nothing(), ::testing::ElementsAre("out.h5"));
}

}  // namespace
}  // namespace zinf::checkpoint
