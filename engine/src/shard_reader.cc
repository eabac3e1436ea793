#include "shard_reader.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <utility>

#include <fmt/format.h>

namespace zinf::engine {

ShardReader::ShardReader(ReadFn read, std::size_t max_shards, std::uint64_t max_elems)
    : read_(std::move(read)),
      max_shards_(max_shards),
      max_elems_(max_elems),
      thread_([this] { Run(); }) {}

ShardReader::~ShardReader() {
  Cancel();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::size_t ShardReader::Find(std::size_t param) const {
  const auto it =
      std::find_if(items_.begin(), items_.end(),
                   [param](const std::unique_ptr<Item>& i) { return i->param == param; });
  return static_cast<std::size_t>(it - items_.begin());
}

std::uint64_t ShardReader::PlanBytes(std::size_t max_shards, std::uint64_t max_elems,
                                     std::uint64_t max_shard_numel) {
  // Queue admits a shard only while both bounds hold, so at most this many elements are held.
  const std::uint64_t by_count = max_shard_numel > std::numeric_limits<std::uint64_t>::max() /
                                                       std::max<std::uint64_t>(max_shards, 1)
                                     ? std::numeric_limits<std::uint64_t>::max()
                                     : max_shards * max_shard_numel;
  const std::uint64_t elems = std::min(max_elems, by_count);
  return elems > std::numeric_limits<std::uint64_t>::max() / sizeof(float)
             ? std::numeric_limits<std::uint64_t>::max()
             : elems * sizeof(float);
}

bool ShardReader::Queue(std::size_t param, std::uint64_t numel) {
  {
    std::lock_guard lock(mu_);
    if (Find(param) < items_.size() || items_.size() >= max_shards_ ||
        elems_ + numel > max_elems_) {
      return false;
    }
    auto item = std::make_unique<Item>();
    item->param = param;
    item->numel = numel;
    items_.push_back(std::move(item));
    elems_ += numel;
  }
  cv_.notify_all();
  return true;
}

bool ShardReader::queued(std::size_t param) const {
  std::lock_guard lock(mu_);
  return Find(param) < items_.size();
}

std::optional<Result<std::vector<float>>> ShardReader::Take(std::size_t param, bool& waited) {
  std::unique_lock lock(mu_);
  const std::size_t at = Find(param);
  if (at == items_.size()) return std::nullopt;
  Item* item = items_[at].get();
  waited = !item->done;
  // A later item may be ahead of this one only if this one is started: the reader takes them
  // in order, so waiting is enough.
  cv_.wait(lock, [item] { return item->done; });
  std::unique_ptr<Item> taken = std::move(items_[at]);
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(at));
  elems_ -= taken->numel;
  if (!taken->status) return Result<std::vector<float>>(std::move(taken->status).error());
  return Result<std::vector<float>>(std::move(taken->shard));
}

void ShardReader::Cancel() {
  std::unique_lock lock(mu_);
  // Items not started go at once; the one in flight is waited for.
  std::erase_if(items_, [](const std::unique_ptr<Item>& i) { return !i->started; });
  cv_.wait(lock, [this] {
    return std::all_of(items_.begin(), items_.end(),
                       [](const std::unique_ptr<Item>& i) { return i->done; });
  });
  items_.clear();
  elems_ = 0;
}

void ShardReader::Run() {
  std::unique_lock lock(mu_);
  while (true) {
    Item* next = nullptr;
    cv_.wait(lock, [&] {
      const auto it = std::find_if(items_.begin(), items_.end(),
                                   [](const std::unique_ptr<Item>& i) { return !i->started; });
      next = it == items_.end() ? nullptr : it->get();
      return stop_ || next != nullptr;
    });
    if (stop_) return;
    next->started = true;
    lock.unlock();
    // The item stays in items_ while it is not done (see items_), so `next` lives.
    Status status = OkStatus();
    std::vector<float> shard;
    try {
      shard.assign(next->numel, 0.0f);
      status = read_(next->param, shard);
    } catch (const std::bad_alloc&) {
      status = ResourceExhaustedError(
          fmt::format("engine: no host memory for a shard of {} elements read ahead of its "
                      "Gather (lower offload_param.buffer_count or stage3_prefetch_bucket_size)",
                      next->numel));
    }
    lock.lock();
    next->status = std::move(status);
    next->shard = std::move(shard);
    next->done = true;
    cv_.notify_all();
  }
}

}  // namespace zinf::engine
