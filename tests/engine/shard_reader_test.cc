// ShardReader (engine/src/shard_reader.h): the stage-3 read-ahead thread. Its bounds, the values
// and errors a Take returns, and Cancel with a read in flight, against a read function the test
// controls (a gate the reads wait at).
#include "shard_reader.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "testing/status_matchers.h"

namespace zinf::engine {
namespace {

// Reads shard p as the values p + 1000 g, p + 1000 g + 1, ... (g: the store's generation, as
// an optimizer step changes the master); a read waits while the gate is closed; parameter 13
// fails.
class FakeStore {
 public:
  ShardReader::ReadFn Reader() {
    return [this](std::size_t p, std::span<float> out) -> Status {
      std::unique_lock lock(mu_);
      started_.push_back(p);
      cv_.notify_all();
      cv_.wait(lock, [this] { return open_; });
      ++done_;
      cv_.notify_all();
      if (p == 13) return DataLossError("shard 13: checksum mismatch");
      for (std::size_t k = 0; k < out.size(); ++k)
        out[k] = static_cast<float>(p + k + 1000 * generation_);
      return OkStatus();
    };
  }
  void Open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Waits until `n` reads have started.
  void WaitStarted(std::size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return started_.size() >= n; });
  }
  // Waits until `n` reads have returned (or are about to).
  void WaitDone(std::size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ >= n; });
  }
  void NextGeneration() {
    std::lock_guard lock(mu_);
    ++generation_;
  }
  std::vector<std::size_t> started() {
    std::lock_guard lock(mu_);
    return started_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::size_t done_ = 0;
  std::size_t generation_ = 0;
  std::vector<std::size_t> started_;
};

TEST(ShardReader, TakeReturnsTheShardOnceInQueueOrder) {
  FakeStore store;
  store.Open();
  ShardReader reader(store.Reader(), 4, 1000);
  EXPECT_TRUE(reader.Queue(5, 3));
  EXPECT_TRUE(reader.Queue(2, 4));
  EXPECT_TRUE(reader.queued(5));
  bool waited = false;
  std::optional<Result<std::vector<float>>> two = reader.Take(2, waited);
  ASSERT_TRUE(two.has_value());
  ZINF_ASSERT_OK(*two);
  EXPECT_EQ(**two, (std::vector<float>{2, 3, 4, 5}));
  std::optional<Result<std::vector<float>>> five = reader.Take(5, waited);
  ASSERT_TRUE(five.has_value());
  ZINF_ASSERT_OK(*five);
  EXPECT_EQ(**five, (std::vector<float>{5, 6, 7}));
  EXPECT_EQ(store.started(), (std::vector<std::size_t>{5, 2}));
  // Taken: no longer queued.
  EXPECT_FALSE(reader.queued(5));
  EXPECT_FALSE(reader.Take(5, waited).has_value());
}

TEST(ShardReader, BoundsShardsAndElements) {
  FakeStore store;
  ShardReader reader(store.Reader(), 2, 10);
  EXPECT_TRUE(reader.Queue(0, 6));
  EXPECT_FALSE(reader.Queue(0, 1)) << "queued twice";
  EXPECT_FALSE(reader.Queue(1, 5)) << "11 elements > 10";
  EXPECT_TRUE(reader.Queue(1, 4));
  EXPECT_FALSE(reader.Queue(2, 0)) << "3 shards > 2";
  store.Open();
  bool waited = false;
  ASSERT_TRUE(reader.Take(0, waited).has_value());
  // Taking frees its room.
  EXPECT_TRUE(reader.Queue(2, 6));
  ASSERT_TRUE(reader.Take(1, waited).has_value());
  ASSERT_TRUE(reader.Take(2, waited).has_value());
}

TEST(ShardReader, TakeSaysWhetherItWaited) {
  FakeStore store;
  ShardReader reader(store.Reader(), 4, 100);
  ASSERT_TRUE(reader.Queue(1, 8));
  store.WaitStarted(1);
  // The read in flight cannot end before the gate opens, 100 ms after this thread's Take began
  // (unless this thread sleeps as long in between).
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    store.Open();
  });
  bool waited = false;
  std::optional<Result<std::vector<float>>> shard = reader.Take(1, waited);
  opener.join();
  ASSERT_TRUE(shard.has_value());
  ZINF_EXPECT_OK(*shard);
  EXPECT_TRUE(waited);
}

TEST(ShardReader, AFailedReadIsItsTakesErrorOnly) {
  FakeStore store;
  store.Open();
  ShardReader reader(store.Reader(), 4, 100);
  ASSERT_TRUE(reader.Queue(13, 2));
  ASSERT_TRUE(reader.Queue(14, 2));
  bool waited = false;
  std::optional<Result<std::vector<float>>> bad = reader.Take(13, waited);
  ASSERT_TRUE(bad.has_value());
  ASSERT_FALSE(bad->has_value());
  EXPECT_EQ(bad->error().code(), ErrorCode::kDataLoss);
  EXPECT_NE(bad->error().message().find("shard 13"), std::string::npos);
  std::optional<Result<std::vector<float>>> good = reader.Take(14, waited);
  ASSERT_TRUE(good.has_value());
  ZINF_EXPECT_OK(*good);
}

TEST(ShardReader, CancelWaitsForTheReadInFlightAndDropsTheRest) {
  FakeStore store;
  ShardReader reader(store.Reader(), 4, 100);
  ASSERT_TRUE(reader.Queue(1, 4));
  ASSERT_TRUE(reader.Queue(2, 4));
  ASSERT_TRUE(reader.Queue(3, 4));
  store.WaitStarted(1);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    store.Open();
  });
  reader.Cancel();  // returns only after the read of 1 ended
  opener.join();
  EXPECT_FALSE(reader.queued(1));
  EXPECT_FALSE(reader.queued(2));
  EXPECT_FALSE(reader.queued(3));
  EXPECT_EQ(store.started(), (std::vector<std::size_t>{1}));
  // The reader goes on after a cancel.
  ASSERT_TRUE(reader.Queue(4, 4));
  bool waited = false;
  std::optional<Result<std::vector<float>>> four = reader.Take(4, waited);
  ASSERT_TRUE(four.has_value());
  ZINF_ASSERT_OK(*four);
  EXPECT_EQ((**four)[0], 4.0f);
}

// A shard read before a Cancel (the engine cancels before every optimizer step and Load) is
// never taken after it, even once its read has ended: a new Queue reads the new values.
TEST(ShardReader, AShardReadBeforeACancelIsNeverTakenAfterIt) {
  FakeStore store;
  store.Open();
  ShardReader reader(store.Reader(), 4, 100);
  ASSERT_TRUE(reader.Queue(1, 4));
  ASSERT_TRUE(reader.Queue(2, 4));
  store.WaitDone(2);
  reader.Cancel();
  store.NextGeneration();
  EXPECT_FALSE(reader.queued(1));
  EXPECT_FALSE(reader.queued(2));
  bool waited = false;
  EXPECT_FALSE(reader.Take(2, waited).has_value());
  // Its room is free again, and the shard is read anew.
  ASSERT_TRUE(reader.Queue(1, 100));
  std::optional<Result<std::vector<float>>> one = reader.Take(1, waited);
  ASSERT_TRUE(one.has_value());
  ZINF_ASSERT_OK(*one);
  EXPECT_EQ((**one)[0], 1001.0f);
  EXPECT_EQ(store.started(), (std::vector<std::size_t>{1, 2, 1}));
}

TEST(ShardReader, DestroyedWithReadsQueued) {
  FakeStore store;
  auto reader = std::make_unique<ShardReader>(store.Reader(), 4, 100);
  ASSERT_TRUE(reader->Queue(1, 4));
  ASSERT_TRUE(reader->Queue(2, 4));
  store.WaitStarted(1);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    store.Open();
  });
  reader.reset();
  opener.join();
  EXPECT_EQ(store.started(), (std::vector<std::size_t>{1}));
}

}  // namespace
}  // namespace zinf::engine
