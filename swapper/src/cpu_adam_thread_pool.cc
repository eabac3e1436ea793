#include "cpu_adam_thread_pool.h"

#include <memory>
#include <system_error>

namespace zinf::swapper::internal {

Result<std::unique_ptr<AdamThreadPool>> AdamThreadPool::Create(int threads) {
  if (threads < 1) return InvalidArgumentError("thread pool needs threads >= 1");
  std::unique_ptr<AdamThreadPool> pool(new AdamThreadPool());
  pool->workers_.reserve(static_cast<std::size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) {
    try {
      pool->workers_.emplace_back([p = pool.get()] { p->WorkerLoop(); });
    } catch (const std::system_error& e) {
      return ResourceExhaustedError("cannot start CPU Adam worker thread " + std::to_string(t) +
                                    " of " + std::to_string(threads) + ": " + e.what());
    }  // the destructor of `pool` joins the ones already running
  }
  return pool;
}

AdamThreadPool::~AdamThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void AdamThreadPool::DrainTasks() {
  for (;;) {
    const std::size_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    fn_(ctx_, task);
  }
}

void AdamThreadPool::WorkerLoop() {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    DrainTasks();
    {
      std::lock_guard lock(mu_);
      --busy_workers_;
    }
    done_cv_.notify_one();
  }
}

void AdamThreadPool::RunImpl(std::size_t num_tasks, TaskFn fn, void* ctx) {
  std::lock_guard run_lock(run_mu_);
  if (workers_.empty() || num_tasks <= 1) {
    for (std::size_t task = 0; task < num_tasks; ++task) fn(ctx, task);
    return;
  }
  {
    std::lock_guard lock(mu_);
    fn_ = fn;
    ctx_ = ctx;
    num_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  DrainTasks();
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return busy_workers_ == 0; });
}

}  // namespace zinf::swapper::internal
