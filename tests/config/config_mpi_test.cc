// CheckSameConfigOnAllRanks: every rank must get the same status, naming the rank whose config
// differs. Runs under mpirun with 1, 2 and 3 ranks.
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "testing/mpi_env.h"
#include "testing/status_matchers.h"
#include "train/train_config.h"
#include "zinf/config/config.h"

namespace zinf::train {
namespace {

using ::testing::HasSubstr;
using ::zinf::testing::IsOk;
using ::zinf::testing::StatusIs;
using ::zinf::testing::World;

constexpr const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {
      "device": "nvme", "nvme_path": ["/tmp/zinf-a{local_rank}", "/tmp/zinf-b{node}"]}}
})";

using config::CheckSameConfigOnAllRanks;
using config::ContextOf;

TEST(CheckSameConfigOnAllRanks, SameFileAgreesWhateverTheLocalRank) {
  const comm::Communicator& world = World();
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, ParseTrainConfig(kConfig, ContextOf(world)));
  EXPECT_EQ(config.train_batch_size, 2 * world.size());
  EXPECT_THAT(CheckSameConfigOnAllRanks(world, config), IsOk());
}

TEST(CheckSameConfigOnAllRanks, OneRankWithAnotherConfigFailsOnEveryRank) {
  const comm::Communicator& world = World();
  if (world.size() < 2) GTEST_SKIP() << "needs at least 2 ranks for one of them to differ";
  const int odd_rank = world.size() - 1;
  std::string text = kConfig;
  if (world.rank() == odd_rank) text.replace(text.find("1e-3"), 4, "2e-3");
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, ParseTrainConfig(text, ContextOf(world)));
  EXPECT_THAT(CheckSameConfigOnAllRanks(world, config),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("rank " + std::to_string(odd_rank) +
                                                              " loaded a different config")));
  // The communicator is still usable afterwards (no rank was left behind in a collective).
  EXPECT_THAT(world.Barrier(), IsOk());
}

TEST(CheckSameConfigOnAllRanks, RankZeroDifferingIsReportedAsRankOne) {
  const comm::Communicator& world = World();
  if (world.size() < 2) GTEST_SKIP() << "needs at least 2 ranks for one of them to differ";
  std::string text = kConfig;
  if (world.rank() == 0) text.replace(text.find("\"stage\": 2"), 10, "\"stage\": 3");
  ZINF_ASSERT_OK_AND_ASSIGN(TrainConfig config, ParseTrainConfig(text, ContextOf(world)));
  // Rank 0 is the reference: the first rank that disagrees with it is named.
  EXPECT_THAT(CheckSameConfigOnAllRanks(world, config),
              StatusIs(ErrorCode::kInvalidArgument, HasSubstr("rank 1 loaded a different config")));
}

}  // namespace
}  // namespace zinf::train
