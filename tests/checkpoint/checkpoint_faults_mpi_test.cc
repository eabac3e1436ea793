// The commit protocol under a failing file system: a fault injected into each file-system call a
// checkpoint save makes on rank 0 (every open, stat, mkdir, rename, unlink, fsync, fallocate,
// write, read, statfs, readdir and close of the save, one at a time, through storage::Env) fails
// the save on every rank alike or lets it commit, and either way `latest` names a complete
// checkpoint that verifies and restores: the last good one, or the new one.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "testing/test_env.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/storage/env.h"
#include "zinf/storage/fault_injection.h"

namespace zinf::checkpoint {
namespace {

using checkpoint_testing::CheckState;
using checkpoint_testing::FillState;
using checkpoint_testing::MakeSwapper;
using checkpoint_testing::TestSwapper;
using storage::FaultInjectingEnv;
using storage::FaultInjector;
using storage::FaultRule;
using storage::FaultSpec;
using storage::FsOp;
using testing::SharedScratchDir;
using testing::World;

CheckpointSaveOptions SaveOptions(const std::string& dir) {
  CheckpointSaveOptions o;
  o.dir = dir;
  o.keep_last = 2;  // retention runs too: readdir and unlink of older files
  o.chunk_numel = 1000;
  o.progress = false;
  return o;
}

// Rank 0's injector for one save: `op`'s nth call fails with `kind` (no rule: count only).
std::shared_ptr<FaultInjector> Injector(std::optional<FsOp> op, std::uint64_t nth,
                                        storage::FaultKind kind) {
  FaultSpec spec;
  if (op)
    spec.rules.push_back(
        FaultRule{.op = std::nullopt, .fs_op = op, .nth = nth, .and_later = false, .kind = kind});
  return std::make_shared<FaultInjector>(spec);
}

std::string ReadLatest(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(CheckpointCommitFaults, EverySyscallOfTheSaveFailsCleanlyOrCommits) {
  SharedScratchDir dir("ckpt-faults");
  const std::string ckpt = dir.Join("ckpt");
  ZINF_ASSERT_OK_AND_ASSIGN(TestSwapper t, MakeSwapper(World(), {.store_dir = dir.path(),
                                                                 .job_id = "faults",
                                                                 .world_size = World().size()}));
  OptimizerSwapper& s = *t.swapper;
  const bool root = World().rank() == 0;

  // One save counted: how many calls of each kind rank 0 makes.
  std::int64_t step = 1;
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, step)));
  std::shared_ptr<FaultInjector> counter = Injector(std::nullopt, 0, storage::FaultKind::kEio);
  {
    FaultInjectingEnv env(storage::Env::Posix(), counter);
    storage::ScopedDefaultEnv scope(env);
    ZINF_ASSERT_OK(SaveCheckpoint(s, step, SaveOptions(ckpt)));
  }
  std::int64_t good = step;
  int failed = 0, committed = 0, failed_after_latest = 0;
  for (int op = 0; op < storage::kNumFsOps; ++op) {
    const FsOp fs_op = static_cast<FsOp>(op);
    // Rank 0 knows the counts; every rank runs the same number of saves.
    std::uint64_t calls = counter->fs_calls(fs_op);
    ZINF_ASSERT_OK(World().Broadcast(std::span<std::uint64_t>(&calls, 1), 0));
    for (std::uint64_t nth = 1; nth <= calls; ++nth) {
      SCOPED_TRACE(fmt::format("{} #{} of {} fails on rank 0 (save of step {})",
                               storage::FsOpName(fs_op), nth, calls, step + 1));
      ++step;
      ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, step)));
      Result<SavedCheckpoint> saved = [&] {
        if (!root) return SaveCheckpoint(s, step, SaveOptions(ckpt));
        FaultInjectingEnv env(storage::Env::Posix(),
                              Injector(fs_op, nth, storage::FaultKind::kEio));
        storage::ScopedDefaultEnv scope(env);
        return SaveCheckpoint(s, step, SaveOptions(ckpt));
      }();
      // The same result on every rank.
      const std::int64_t ok = saved.has_value() ? 1 : 0;
      std::int64_t all_ok = ok;
      ZINF_ASSERT_OK(World().AllreduceInPlace<std::int64_t>(std::span<std::int64_t>(&all_ok, 1),
                                                            comm::ReduceOp::kMin));
      ASSERT_EQ(ok, all_ok) << (saved ? "" : saved.error().ToString());
      // `latest` names the new checkpoint after a save that succeeded; after one that failed,
      // the last good one, or the new one when only a durability point after the rename of
      // `latest` failed (the save reports it: the rename may not have reached the disk). What
      // `latest` names is complete, and after a failed save the last good one is still there.
      std::int64_t named = 0;
      if (root) {
        const std::string latest = ReadLatest(ckpt);
        named = ParseCheckpointFileName(latest).value_or(-1);
        ZINF_EXPECT_OK(VerifyCheckpoint(ckpt));
        if (saved) {
          EXPECT_EQ(named, step);  // keep_last may have removed the old one
        } else {
          EXPECT_TRUE(named == good || named == step) << "latest names " << latest;
          ZINF_EXPECT_OK(VerifyCheckpoint(ckpt + "/" + CheckpointFileName(good)));
        }
      }
      ZINF_ASSERT_OK(World().Broadcast(std::span<std::int64_t>(&named, 1), 0));
      if (root) {
        std::printf("  %s #%llu: %s\n", std::string(storage::FsOpName(fs_op)).c_str(),
                    static_cast<unsigned long long>(nth),
                    saved ? "committed" : saved.error().ToString().c_str());
      }
      if (saved) {
        ++committed;
      } else {
        ++failed;
        if (named == step) ++failed_after_latest;
      }
      good = named;
    }
  }
  // The last good checkpoint restores, with its values.
  ZINF_ASSERT_OK(World().AgreeOnStatus(FillState(s, 999)));
  CheckpointRestoreOptions restore;
  restore.progress = false;
  ZINF_ASSERT_OK_AND_ASSIGN(RestoredCheckpoint r, RestoreCheckpoint(s, ckpt, restore));
  EXPECT_EQ(r.step, good);
  ZINF_EXPECT_OK(World().AgreeOnStatus(CheckState(s, good)));
  EXPECT_GT(failed, 10);
  if (root) {
    std::printf(
        "commit faults: %d saves failed (%d of them after `latest` was replaced), %d committed "
        "past their fault\n",
        failed, failed_after_latest, committed);
  }
  ZINF_ASSERT_OK(s.Close());
}

}  // namespace
}  // namespace zinf::checkpoint
