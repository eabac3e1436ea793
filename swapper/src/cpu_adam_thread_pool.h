// Private: the persistent worker pool of one CpuAdam. std::thread rather than OpenMP: the pool
// belongs to the optimizer object (its size is AdamOptions::threads, independent of any
// OMP_NUM_THREADS the training process sets for other libraries) and needs no extra runtime.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::swapper::internal {

class AdamThreadPool {
 public:
  // Starts `threads - 1` workers (threads >= 1). Errors: ResourceExhausted if a thread cannot be
  // started (the ones already started are joined).
  static Result<std::unique_ptr<AdamThreadPool>> Create(int threads);
  ~AdamThreadPool();
  AdamThreadPool(const AdamThreadPool&) = delete;
  AdamThreadPool& operator=(const AdamThreadPool&) = delete;

  // Calls fn(task) once for every task in [0, num_tasks), on the workers and the calling thread,
  // and returns when all calls have returned. Calls from several threads are serialized.
  template <typename Fn>
  void Run(std::size_t num_tasks, Fn&& fn) {
    RunImpl(
        num_tasks, [](void* ctx, std::size_t task) { (*static_cast<Fn*>(ctx))(task); },
        static_cast<void*>(&fn));
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  using TaskFn = void (*)(void* ctx, std::size_t task);

  AdamThreadPool() = default;
  void RunImpl(std::size_t num_tasks, TaskFn fn, void* ctx);
  void WorkerLoop();
  void DrainTasks();

  std::mutex run_mu_;  // one Run at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // Guarded by mu_.
  std::uint64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stop_ = false;
  // The current job; written under mu_ before generation_ changes.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::size_t num_tasks_ = 0;
  std::atomic<std::size_t> next_task_{0};

  std::vector<std::thread> workers_;
};

}  // namespace zinf::swapper::internal
