// ShardReader: stage 3 with offload_param nvme (engine.h, "Stage 3"). Reads this rank's shards of
// partitioned parameters from the swap store on a thread of its own, ahead of the Gather that
// needs them, so that the loop's compute between two Gathers hides the reads instead of waiting
// for them.
//
// The engine queues the shards that the previous step's order says come next (Queue) and a Gather
// takes each shard it needs (Take), waiting only for a read still in flight. Reads run one at a
// time, in queue order. What a queued read returns is the committed fp32 master at the time of the
// read: the engine cancels everything (Cancel) before the optimizer step changes it.
//
// Bounds: at most `max_shards` shards and `max_elems` elements are queued, in flight or read and
// not yet taken: the host memory the read-ahead costs (offload_param.buffer_count and
// stage3_prefetch_bucket_size).
//
// Errors: a failed read (the read function's Status, or ResourceExhausted when its buffer cannot
// be allocated) is returned by the Take of that shard; the other shards are unaffected.
//
// Thread safety: every method from one thread (the engine's caller); `read` runs on the reader's
// own thread, one call at a time.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::engine {

class ShardReader {
 public:
  // Reads the shard of parameter `param` into `out` (the shard's size). Runs on the reader's
  // thread.
  using ReadFn = std::function<Status(std::size_t param, std::span<float> out)>;

  ShardReader(ReadFn read, std::size_t max_shards, std::uint64_t max_elems);
  // The host memory the read-ahead holds at most with these bounds, shards of at most
  // `max_shard_numel` elements (the engine's memory plan). Allocates nothing.
  static std::uint64_t PlanBytes(std::size_t max_shards, std::uint64_t max_elems,
                                 std::uint64_t max_shard_numel);

  // Cancels and joins the thread.
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  // Queues a read of the `numel`-element shard of `param`. False (nothing queued) when it is
  // queued already or the bounds leave no room for it.
  bool Queue(std::size_t param, std::uint64_t numel);
  bool queued(std::size_t param) const;

  // The shard of a queued parameter once read, no longer queued; `waited` says whether its read
  // was still pending (queued or in flight). nullopt when `param` is not queued.
  std::optional<Result<std::vector<float>>> Take(std::size_t param, bool& waited);

  // Drops every queued or read shard, after waiting for the read in flight.
  void Cancel();

 private:
  struct Item {
    std::size_t param = 0;
    std::uint64_t numel = 0;
    bool started = false;
    bool done = false;
    Status status = OkStatus();
    std::vector<float> shard;
  };

  void Run();
  // items_' index of `param`, or items_.size(). Under mu_.
  std::size_t Find(std::size_t param) const;

  const ReadFn read_;
  const std::size_t max_shards_;
  const std::uint64_t max_elems_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // an item queued or done, or stop_
  // In queue order. Only the reader changes an item from started to done, only the caller's
  // thread erases items, and never a started one that is not done.
  std::vector<std::unique_ptr<Item>> items_;
  std::uint64_t elems_ = 0;  // of items_
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is
};

}  // namespace zinf::engine
