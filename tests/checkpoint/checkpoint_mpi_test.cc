// Multi-rank tests of checkpoint save/restore (run under mpirun with 1-4 ranks): round trips are
// bit-exact, N -> M restores every element, the commit protocol leaves only complete files, and
// corrupted or mismatched files fail with a clear error on every rank, leaving the store as it was.
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/h5/h5_file.h"
#include "zinf/swapper/q8.h"

namespace zinf::checkpoint {
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

// Every state tensor of every sub-group, as bytes (q8: the weights, the moments' codes and
// scales). Local.
Result<std::vector<std::vector<std::byte>>> StateBytesOf(OptimizerSwapper& s) {
  std::vector<std::vector<std::byte>> all;
  auto add = [&all](const void* data, std::size_t bytes) {
    const auto* b = static_cast<const std::byte*>(data);
    all.emplace_back(b, b + bytes);
  };
  for (std::size_t i = 0; i < s.num_sub_groups(); ++i) {
    std::vector<float> values(s.swap_info(i).sub_group.numel);
    const bool q8 = s.state_format() == StateFormat::kQ8;
    for (StateTensor which : {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      if (q8 && which != StateTensor::kFp32) continue;
      ZINF_RETURN_IF_ERROR(s.ReadState(i, which, 0, values));
      add(values.data(), values.size() * sizeof(float));
    }
    if (!q8) continue;
    ZINF_RETURN_IF_ERROR(s.ReadQ8Moments(i, [&](const Q8Moments& m) {
      for (const Q8Moment* moment : {&m.exp_avg, &m.exp_avg_sq}) {
        add(moment->codes.data(), moment->codes.size());
        add(moment->scales.data(), moment->scales.size() * sizeof(float));
      }
      return OkStatus();
    }));
  }
  return all;
}

// The host memory tier (zinf.host_cache_bytes: every sub-group resident here) with flat (ZeRO
// 1/2) and per-parameter (ZeRO 3) plans: the checkpoint reads each run of a resident sub-group
// from its element offset in host memory, and holds what the untiered swapper's holds: restored
// into the untiered swapper, its state is the untiered state, byte for byte, fp32 and q8. Runs
// at a nonzero offset exist in resident sub-groups (per-parameter plans: a sub-group's second
// parameter starts after the first's padding).
TEST(Checkpoint, HostTierSubGroupsSaveTheRightValuesAtEveryOffset) {
  SharedScratchDir dir("ckpt-tier");
  for (bool per_param : {false, true}) {
    for (StateFormat format : {StateFormat::kFp32, StateFormat::kQ8}) {
      const std::string name =
          fmt::format("{}-{}", per_param ? "stage3" : "stage2", swapper::StateFormatName(format));
      SCOPED_TRACE(name);
      SwapperSetup setup = {.store_dir = dir.path(),
                            .job_id = "tiered-" + name,
                            .world_size = World().size(),
                            .per_param = per_param,
                            .state_format = format,
                            .host_cache_bytes = std::uint64_t{1} << 30};
      ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper tiered, MakeSwapper(World(), setup));
      setup.job_id = "untiered-" + name;
      setup.host_cache_bytes = 0;
      ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper untiered, MakeSwapper(World(), setup));
      OptimizerSwapper& t = *tiered.swapper;
      OptimizerSwapper& u = *untiered.swapper;
      ASSERT_EQ(t.num_resident(), t.num_sub_groups());
      ASSERT_EQ(u.num_resident(), 0u);
      std::int64_t offset_runs = 0;
      for (std::size_t i = 0; i < t.num_sub_groups(); ++i) {
        for (const partition::SubGroupFragment& f : t.swap_info(i).sub_group.fragments) {
          offset_runs += f.sub_group_offset > 0 ? 1 : 0;
        }
      }
      ZINF_ASSERT_OK(World().AllreduceInPlace<std::int64_t>(std::span(&offset_runs, 1),
                                                            comm::ReduceOp::kSum));
      if (per_param) {
        EXPECT_GT(offset_runs, 0) << "no run at a nonzero offset: the test is moot";
      }
      ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(t, 3)));
      ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(u, 3)));
      ZINF_ASSERT_OK_AND_ASSIGN(const auto want, StateBytesOf(u));
      ZINF_ASSERT_OK_AND_ASSIGN(const auto tiered_state, StateBytesOf(t));
      EXPECT_TRUE(tiered_state == want) << "the tier changed the state itself";
      ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpoint saved,
                                SaveCheckpoint(t, 3, SaveOptions(dir.Join("ckpt-" + name))));
      ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(u, 4)));
      ZINF_ASSERT_OK(RestoreCheckpoint(u, saved.path, RestoreOptions()));
      ZINF_ASSERT_OK_AND_ASSIGN(const auto got, StateBytesOf(u));
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t k = 0; k < want.size(); ++k) {
        EXPECT_TRUE(got[k] == want[k]) << "rank " << World().rank() << ": state tensor " << k
                                       << " of the tiered checkpoint differs from the untiered";
      }
      if (format == StateFormat::kFp32) {
        ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(u, 3)));
      }
      ZINF_ASSERT_OK(t.Close());
      ZINF_ASSERT_OK(u.Close());
    }
  }
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
  ZINF_ASSIGN_OR_RETURN(h5::H5File f, h5::H5File::OpenSerial(path, false));
  float v = 0;
  ZINF_RETURN_IF_ERROR(f.ReadSlab(dataset, element, std::span(&v, 1)));
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits ^= 1u << 7;
  std::memcpy(&v, &bits, 4);
  ZINF_RETURN_IF_ERROR(f.WriteSlab(dataset, element, std::span<const float>(&v, 1)));
  return f.Close();
}

// ---- q8 state ----

// The q8 tests' state: StateValue, with exp_avg_sq made non-negative (it is a second moment).
float Q8Value(StateTensor which, std::int64_t step, std::uint64_t flat) {
  const float v = StateValue(which, step, flat);
  return which == StateTensor::kExpAvgSq ? std::fabs(v) : v;
}

// Largest gap between neighbouring values of a map: a quantization is off by at most half of it
// times the block's scale, and every scale here is at most 1 (|Q8Value| <= 1).
float LargestGap(q8::MapKind kind) {
  const std::array<float, 256>& map = q8::MapValues(kind);
  float gap = 0;
  for (std::size_t c = 1; c < map.size(); ++c) gap = std::max(gap, map[c] - map[c - 1]);
  return gap;
}

// Local: weights bitwise, moments within `quantizations` times half the largest gap of Q8Value.
Status CheckQ8Near(OptimizerSwapper& swapper, std::int64_t step, int quantizations) {
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    const partition::SubGroup& sg = swapper.swap_info(i).sub_group;
    std::vector<float> got(sg.numel);
    for (StateTensor which : {StateTensor::kFp32, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      ZINF_RETURN_IF_ERROR(swapper.ReadState(i, which, 0, got));
      const float tolerance =
          which == StateTensor::kFp32
              ? 0.0f
              : quantizations * 0.5f *
                    LargestGap(which == StateTensor::kExpAvg ? q8::MapKind::kSigned
                                                             : q8::MapKind::kUnsigned);
      for (const partition::SubGroupFragment& f : sg.fragments) {
        for (std::uint64_t k = 0; k < f.numel; ++k) {
          const float want = Q8Value(which, step, f.flat_offset + k);
          if (!(std::fabs(got[f.sub_group_offset + k] - want) <= tolerance)) {
            return DataLossError(fmt::format("sub-group {} {} flat {}: got {}, want {} +- {}", i,
                                             StateTensorName(which), f.flat_offset + k,
                                             got[f.sub_group_offset + k], want, tolerance));
          }
        }
      }
    }
  }
  return OkStatus();
}

// Every sub-group's exact q8 moments (codes, then scales, as bytes).
Result<std::vector<std::vector<std::uint8_t>>> ExactMoments(OptimizerSwapper& swapper) {
  std::vector<std::vector<std::uint8_t>> all;
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    ZINF_RETURN_IF_ERROR(swapper.ReadQ8Moments(i, [&](const Q8Moments& m) {
      std::vector<std::uint8_t> bytes;
      for (const Q8Moment* moment : {&m.exp_avg, &m.exp_avg_sq}) {
        bytes.insert(bytes.end(), moment->codes.begin(), moment->codes.end());
        const auto* scales = reinterpret_cast<const std::uint8_t*>(moment->scales.data());
        bytes.insert(bytes.end(), scales, scales + moment->scales.size_bytes());
      }
      all.push_back(std::move(bytes));
      return OkStatus();
    }));
  }
  return all;
}

// A q8 checkpoint restores exactly (bitwise codes and scales) on the same world size and
// sub-group size; into other sub-groups, per-parameter plans, an fp32 run, and from an fp32
// checkpoint within the stated tolerance; a damaged block table is caught.
TEST(CheckpointQ8, ExactOnTheSameBlocksWithinToleranceElsewhere) {
  SharedScratchDir dir("ckpt");
  const std::string q8_ckpt = dir.Join("q8");
  const std::string fp32_ckpt = dir.Join("fp32");
  std::vector<std::vector<std::uint8_t>> saved;
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t,
                              MakeSwapper(World(), {.store_dir = dir.path(),
                                                    .job_id = "q8save",
                                                    .world_size = World().size(),
                                                    .state_format = StateFormat::kQ8}));
    OptimizerSwapper& s = *t.swapper;
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 7, Q8Value)));
    ZINF_ASSERT_OK(World().AgreeOnStatus(CheckQ8Near(s, 7, 1)));
    ZINF_ASSERT_OK_AND_ASSIGN(saved, ExactMoments(s));
    ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpoint ck, SaveCheckpoint(s, 7, SaveOptions(q8_ckpt)));
    // 4 bytes of weights and 2 of codes per element.
    EXPECT_EQ(ck.state_bytes, 6 * t.plan->layout().total_numel());
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 8, Q8Value)));
    ZINF_ASSERT_OK(RestoreCheckpoint(s, q8_ckpt, RestoreOptions()));
    ZINF_ASSERT_OK_AND_ASSIGN(std::vector<std::vector<std::uint8_t>> restored, ExactMoments(s));
    EXPECT_EQ(restored, saved) << "same blocks: the quantized state comes back bit for bit";
    ZINF_EXPECT_OK(World().AgreeOnStatus(CheckQ8Near(s, 7, 1)));
    ZINF_ASSERT_OK(s.Close());
  }
  if (World().rank() == 0) {
    ZINF_EXPECT_OK(VerifyCheckpoint(q8_ckpt));
    ZINF_ASSERT_OK_AND_ASSIGN(CheckpointInfo info, ReadCheckpointInfo(q8_ckpt));
    EXPECT_EQ(info.state_format, StateFormat::kQ8);
    EXPECT_EQ(info.format_version, kCheckpointFormatVersionQ8);
    EXPECT_GE(info.num_blocks, q8::NumBlocks(info.total_numel));
  }
  // Other blocks (sub-group size, per-parameter plan), fp32 runs, fp32 checkpoints.
  struct Case {
    const char* name;
    bool per_param;
    std::uint64_t sub_group_size;
    StateFormat format;
    int quantizations;  // of the moments on the way
  };
  for (const Case& c : {Case{"q8 sub-groups of 1500", false, 1500, StateFormat::kQ8, 2},
                        Case{"q8 per-parameter", true, 1024, StateFormat::kQ8, 2},
                        Case{"fp32 run", false, 2000, StateFormat::kFp32, 1}}) {
    SCOPED_TRACE(c.name);
    ZINF_ASSERT_OK_AND_ASSIGN(
        TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                             .job_id = fmt::format("q8r{}", c.sub_group_size),
                                             .world_size = World().size(),
                                             .per_param = c.per_param,
                                             .sub_group_size = c.sub_group_size,
                                             .state_format = c.format}));
    ZINF_ASSERT_OK(RestoreCheckpoint(*t.swapper, q8_ckpt, RestoreOptions()));
    ZINF_EXPECT_OK(World().AgreeOnStatus(CheckQ8Near(*t.swapper, 7, c.quantizations)));
    if (c.format == StateFormat::kFp32) {
      // An fp32 checkpoint of the decoded state, into a q8 run: one more quantization.
      ZINF_ASSERT_OK(SaveCheckpoint(*t.swapper, 7, SaveOptions(fp32_ckpt)));
    }
    ZINF_ASSERT_OK(t.swapper->Close());
  }
  {
    ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t,
                              MakeSwapper(World(), {.store_dir = dir.path(),
                                                    .job_id = "q8fromfp32",
                                                    .world_size = World().size(),
                                                    .sub_group_size = 1500,
                                                    .state_format = StateFormat::kQ8}));
    ZINF_ASSERT_OK(RestoreCheckpoint(*t.swapper, fp32_ckpt, RestoreOptions()));
    ZINF_EXPECT_OK(World().AgreeOnStatus(CheckQ8Near(*t.swapper, 7, 2)));
    // A damaged scale table: verify and restore name it, the store keeps its state.
    ZINF_ASSERT_OK(World().Barrier());
    if (World().rank() == 0) {
      ZINF_ASSERT_OK(FlipBit(q8_ckpt + "/step-7.h5", "/q8/exp_avg_scales", 1));
      EXPECT_THAT(VerifyCheckpoint(q8_ckpt),
                  StatusIs(ErrorCode::kDataLoss, HasSubstr("/q8/exp_avg_scales")));
    }
    ZINF_ASSERT_OK(World().Barrier());
    EXPECT_THAT(RestoreCheckpoint(*t.swapper, q8_ckpt, RestoreOptions()),
                StatusIs(ErrorCode::kDataLoss, HasSubstr("/q8/exp_avg_scales")));
    ZINF_EXPECT_OK(World().AgreeOnStatus(CheckQ8Near(*t.swapper, 7, 2)));
    ZINF_ASSERT_OK(t.swapper->Close());
  }
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
    auto f = h5::H5File::OpenSerial(copy, false);
    ZINF_ASSERT_OK(f);
    ZINF_ASSERT_OK(f->WriteInt64Attribute("/", "format_version", 3));
    ZINF_ASSERT_OK(f->Close());
  }
  ZINF_ASSERT_OK(World().Barrier());
  ExpectRestoreFails(copy, ErrorCode::kFailedPrecondition,
                     HasSubstr("unsupported format_version 3"));
}

TEST_F(CheckpointErrors, MissingDatasetIsDataLoss) {
  // A checkpoint whose writer stopped before /state/exp_avg: copy everything else by hand.
  const std::string copy = dir_->Join("missing.h5");
  if (World().rank() == 0) {
    auto src = h5::H5File::OpenSerial(file_, true);
    ZINF_ASSERT_OK(src);
    auto dst = h5::H5File::CreateSerial(copy);
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
    const std::uint64_t num_params = checkpoint_testing::TestLayout().num_params();
    for (const char* ds : {"/layout/flat_offset", "/layout/numel"}) {
      std::vector<std::uint64_t> values(num_params);
      ZINF_ASSERT_OK(src->ReadSlab(ds, 0, std::span(values)));
      ZINF_ASSERT_OK(dst->CreateDataset1D(ds, num_params, num_params, h5::H5DataType::kUInt64));
      ZINF_ASSERT_OK(dst->WriteSlab(ds, 0, std::span<const std::uint64_t>(values)));
    }
    const std::uint64_t total = checkpoint_testing::TestLayout().total_numel();
    std::vector<float> fp32(total);
    ZINF_ASSERT_OK(src->ReadSlab("/state/fp32", 0, std::span(fp32)));
    ZINF_ASSERT_OK(dst->CreateDataset1D("/state/fp32", total, kChunk, h5::H5DataType::kFloat32));
    ZINF_ASSERT_OK(dst->WriteSlab("/state/fp32", 0, std::span<const float>(fp32)));
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
    ZINF_SKIP_MISSING("h5dump", "h5dump not installed (hdf5-tools)");
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
  auto f = h5::H5File::OpenSerial(h5, true);
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

// Lists the entries of `dir` (names only).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A full checkpoint file system: the save fails on every rank (no hang in HDF5's collective
// close), nothing partial is left, and `latest` still names the last good checkpoint, which
// verifies and restores; the process goes on and saves elsewhere (HDF5 is still sane).
TEST(CheckpointFullDisk, FailsOnEveryRankAndKeepsTheLastGoodCheckpoint) {
  SharedScratchDir dir("ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "full",
                                                                 .world_size = World().size()}));
  OptimizerSwapper& s = *t.swapper;
  // The size of one checkpoint, saved where there is room.
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 1)));
  ZINF_ASSERT_OK_AND_ASSIGN(SavedCheckpoint probe,
                            SaveCheckpoint(s, 1, SaveOptions(dir.Join("roomy"))));
  const std::uint64_t file_bytes = std::filesystem::file_size(probe.path);
  // Room for the first save's estimate, not for a second checkpoint beside the first.
  const std::uint64_t estimate = EstimateCheckpointBytes(s, SaveOptions(dir.Join("tiny")));
  ASSERT_LT(file_bytes, estimate);
  const std::string tiny = dir.Join("tiny");
  std::optional<testing::TmpfsMount> mount;
  Status mounted = OkStatus();
  if (World().rank() == 0) {
    mount.emplace(tiny, fmt::format("{}k", (estimate + file_bytes / 2) / 1024));
    if (!mount->mounted()) mounted = UnavailableError(mount->error());
  }
  if (!World().AgreeOnStatus(mounted)) ZINF_SKIP_MISSING("tmpfs", "needs root to mount a tmpfs");

  ZINF_ASSERT_OK(SaveCheckpoint(s, 1, SaveOptions(tiny)));
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 2)));
  // The first save's reservation was given back: only its file occupies the file system.
  if (World().rank() == 0) {
    struct statvfs vfs {};
    ASSERT_EQ(::statvfs(tiny.c_str(), &vfs), 0);
    EXPECT_LT((vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize, file_bytes + 64 * 1024);
  }
  Result<SavedCheckpoint> failed = SaveCheckpoint(s, 2, SaveOptions(tiny));
  ASSERT_FALSE(failed.has_value());
  EXPECT_THAT(failed, StatusIs(ErrorCode::kResourceExhausted,
                               HasSubstr("checkpoint save step 2: rank 0: checkpoint step 2 needs "
                                         "about")));
  if (World().rank() == 0) {
    EXPECT_THAT(Entries(tiny), ::testing::ElementsAre("latest", "step-1.h5"));
    EXPECT_EQ(ReadAll(tiny + "/latest"), "step-1.h5\n");
    ZINF_EXPECT_OK(VerifyCheckpoint(tiny));
  }
  // Every rank got the same error.
  const std::string message = failed.error().message();
  std::vector<std::uint64_t> lengths(static_cast<std::size_t>(World().size()));
  const std::uint64_t mine = message.size();
  ZINF_ASSERT_OK(World().Allgather<std::uint64_t>(std::span(&mine, 1), std::span(lengths)));
  for (std::uint64_t n : lengths) EXPECT_EQ(n, mine);
  // The last good checkpoint restores, and saving elsewhere still works.
  ZINF_ASSERT_OK(RestoreCheckpoint(s, tiny, RestoreOptions()));
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(s, 1)));
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 3)));
  ZINF_ASSERT_OK(SaveCheckpoint(s, 3, SaveOptions(dir.Join("roomy"))));
  ZINF_ASSERT_OK(s.Close());
  ZINF_ASSERT_OK(World().Barrier());
}

// A device node, FIFO or directory planted under a name a save replaces (the partial file, the
// step file, `latest`) is refused before anything is written, and left as it was.
TEST(Checkpoint, PlantedSpecialFilesAreNeverReplaced) {
  SharedScratchDir dir("ckpt-special");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "special",
                                                                 .world_size = World().size()}));
  OptimizerSwapper& s = *t.swapper;
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 4)));
  int n = 0;
  for (const char* name : {"step-4.h5.partial", "step-4.h5", "latest"}) {
    for (const char* kind : {"device", "fifo", "dir"}) {
      const std::string ckpt = dir.Join(fmt::format("ckpt{}", n++));
      const std::string planted = ckpt + "/" + name;
      if (World().rank() == 0) {
        std::filesystem::create_directories(ckpt);
        const std::string_view k = kind;
        const int rc = k == "device" ? ::mknod(planted.c_str(), S_IFCHR | 0600, makedev(1, 3))
                       : k == "fifo" ? ::mkfifo(planted.c_str(), 0600)
                                     : ::mkdir(planted.c_str(), 0700);
        ASSERT_EQ(rc, 0) << planted << ": " << std::strerror(errno);
      }
      ZINF_ASSERT_OK(World().Barrier());
      EXPECT_THAT(SaveCheckpoint(s, 4, SaveOptions(ckpt)),
                  StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("not a regular file")))
          << name << " " << kind;
      if (World().rank() == 0) {
        const auto type = std::filesystem::symlink_status(planted).type();
        EXPECT_EQ(type, std::string_view(kind) == "device" ? std::filesystem::file_type::character
                        : std::string_view(kind) == "fifo" ? std::filesystem::file_type::fifo
                                                           : std::filesystem::file_type::directory)
            << planted;
        EXPECT_THAT(Entries(ckpt), ::testing::ElementsAre(name)) << planted;
      }
      ZINF_ASSERT_OK(World().Barrier());
    }
  }
  ZINF_ASSERT_OK(s.Close());
}

// Links planted in the checkpoint directory are never written through: the partial file and
// `latest.tmp` are created exclusively after removing whatever was there, a link named like the
// final file is replaced, and retention removes links without touching their targets.
TEST(Checkpoint, PlantedLinksAreNeverFollowed) {
  SharedScratchDir dir("ckpt");
  const std::string ckpt = dir.Join("ckpt");
  const std::string victim = dir.Join("victim");
  if (World().rank() == 0) {
    std::filesystem::create_directories(ckpt);
    std::ofstream(victim) << "precious";
    for (const char* name : {"step-7.h5.partial", "latest.tmp", "step-8.h5", "step-1.h5"}) {
      std::filesystem::create_symlink(victim, ckpt + "/" + name);
    }
  }
  ZINF_ASSERT_OK(World().Barrier());
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "links",
                                                                 .world_size = World().size()}));
  OptimizerSwapper& s = *t.swapper;
  for (std::int64_t step : {7, 8}) {
    ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, step)));
    ZINF_ASSERT_OK(SaveCheckpoint(s, step, SaveOptions(ckpt, /*keep_last=*/2)));
  }
  if (World().rank() == 0) {
    EXPECT_EQ(ReadAll(victim), "precious");
    // keep_last 2 removed the link step-1.h5 (an older step), not its target.
    EXPECT_THAT(Entries(ckpt), ::testing::ElementsAre("latest", "step-7.h5", "step-8.h5"));
    for (const char* name : {"latest", "step-7.h5", "step-8.h5"}) {
      EXPECT_TRUE(
          std::filesystem::is_regular_file(std::filesystem::symlink_status(ckpt + "/" + name)))
          << name;
    }
    ZINF_EXPECT_OK(VerifyCheckpoint(ckpt));
  }
  ZINF_ASSERT_OK(World().Barrier());
  // `latest` must be a regular file naming a step-<N>.h5 regular file of its directory.
  auto plant_latest = [&](const std::function<void()>& plant) {
    if (World().rank() == 0) {
      std::filesystem::remove(ckpt + "/latest");
      plant();
    }
    return World().Barrier();
  };
  ZINF_ASSERT_OK(
      plant_latest([&] { std::filesystem::create_symlink("step-8.h5", ckpt + "/latest"); }));
  EXPECT_THAT(RestoreCheckpoint(s, ckpt, RestoreOptions()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  ZINF_ASSERT_OK(plant_latest([&] { std::ofstream(ckpt + "/latest") << "../victim\n"; }));
  EXPECT_THAT(RestoreCheckpoint(s, ckpt, RestoreOptions()),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("not a step-<N>.h5 file")));
  ZINF_ASSERT_OK(
      plant_latest([&] { std::ofstream(ckpt + "/latest") << "step-99999999999999999999.h5\n"; }));
  EXPECT_THAT(RestoreCheckpoint(s, ckpt, RestoreOptions()), StatusIs(ErrorCode::kDataLoss));
  ZINF_ASSERT_OK(plant_latest([&] {
    std::filesystem::create_symlink(ckpt + "/step-8.h5", ckpt + "/step-9.h5");
    std::ofstream(ckpt + "/latest") << "step-9.h5\n";
  }));
  EXPECT_THAT(RestoreCheckpoint(s, ckpt, RestoreOptions()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("symbolic link")));
  ZINF_ASSERT_OK(plant_latest([&] { ::mkfifo((ckpt + "/latest").c_str(), 0600); }));
  EXPECT_THAT(RestoreCheckpoint(s, ckpt, RestoreOptions()),
              StatusIs(ErrorCode::kFailedPrecondition, HasSubstr("FIFO")));
  ZINF_ASSERT_OK(plant_latest([&] { std::ofstream(ckpt + "/latest") << "step-8.h5\n"; }));
  ZINF_ASSERT_OK(RestoreCheckpoint(s, ckpt, RestoreOptions()));
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(s, 8)));
  ZINF_ASSERT_OK(s.Close());
}

TEST(CheckpointFileName, ParsesOnlyCanonicalNames) {
  EXPECT_EQ(ParseCheckpointFileName("step-0.h5"), 0);
  EXPECT_EQ(ParseCheckpointFileName("step-123.h5"), 123);
  EXPECT_EQ(ParseCheckpointFileName("step-123.h5.partial", ".partial"), 123);
  EXPECT_EQ(ParseCheckpointFileName(CheckpointFileName(kMaxCheckpointStep)), kMaxCheckpointStep);
  for (const char* bad : {"step-99999999999999999999.h5", "step-9007199254740992.h5", "step-007.h5",
                          "step--1.h5", "step-+1.h5", "step-.h5", "step-1.h5.bak", "step-1.h",
                          "xstep-1.h5", "step-1x.h5", "step-1.h5.partial", ""}) {
    EXPECT_EQ(ParseCheckpointFileName(bad), std::nullopt) << bad;
  }
}

TEST_F(CheckpointErrors, ExportNeverReplacesItsInputAndFailsWithoutATrace) {
  if (World().rank() != 0) GTEST_SKIP() << "rank 0 exports";
  const std::string before = ReadAll(file_);
  for (const std::string& out : {file_, ckpt_ + "/latest", ckpt_ + "/step-6.h5",
                                 ckpt_ + "/step-6.h5.partial", ckpt_ + "/latest.tmp"}) {
    for (ExportFormat format : {ExportFormat::kHdf5, ExportFormat::kSafetensors}) {
      EXPECT_THAT(ExportCheckpoint(ckpt_, out, format),
                  StatusIs(ErrorCode::kInvalidArgument, HasSubstr("refusing to write")))
          << out;
    }
  }
  // A link elsewhere that resolves to the checkpoint is refused too.
  const std::string link = dir_->Join("alias.h5");
  std::filesystem::create_symlink(file_, link);
  EXPECT_THAT(ExportCheckpoint(file_, link, ExportFormat::kSafetensors),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("the checkpoint being read")));
  EXPECT_EQ(ReadAll(file_), before);
  EXPECT_EQ(ReadAll(ckpt_ + "/latest"), "step-5.h5\n");
  // A failed export (a corrupted chunk) leaves the previous output as it was, and no temporary;
  // without Overwrite::kRegularFile (--force) it is not even replaced by a good one.
  const std::string out = dir_->Join("weights.safetensors");
  ZINF_ASSERT_OK(ExportCheckpoint(file_, out, ExportFormat::kSafetensors));
  const std::string good = ReadAll(out);
  EXPECT_THAT(ExportCheckpoint(file_, out, ExportFormat::kSafetensors),
              StatusIs(ErrorCode::kAlreadyExists, HasSubstr("exists")));
  const std::string bad = dir_->Join("bad.h5");
  std::filesystem::copy_file(file_, bad);
  ZINF_ASSERT_OK(FlipBit(bad, "/state/fp32", 3));
  EXPECT_THAT(ExportCheckpoint(bad, out, ExportFormat::kSafetensors, {}, /*moments=*/false,
                               storage::Overwrite::kRegularFile),
              StatusIs(ErrorCode::kDataLoss, HasSubstr("checksum mismatch")));
  EXPECT_EQ(ReadAll(out), good);
  for (const std::string& name : Entries(dir_->path())) {
    EXPECT_THAT(name, ::testing::Not(HasSubstr("zinf-tmp"))) << name;
  }
}

}  // namespace
}  // namespace zinf::checkpoint
