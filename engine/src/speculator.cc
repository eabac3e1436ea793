// Speculator (speculator.h): the thread that steps sub-groups ahead of Step.

#include "speculator.h"

#include <cmath>
#include <utility>

namespace zinf::engine {

Speculator::Speculator(swapper::OptimizerSwapper* swapper, std::span<const float> gradient,
                       std::vector<bool> keep_weights)
    : swapper_(swapper),
      gradient_(gradient),
      keep_weights_(std::move(keep_weights)),
      weights_(keep_weights_.size()) {
  thread_ = std::thread([this] { Work(); });
}

Speculator::~Speculator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
    queue_.clear();
  }
  work_cv_.notify_all();
  thread_.join();
  (void)swapper_->FinishSpeculation();
}

void Speculator::Arm(Plan plan) {
  plan_ = std::move(plan);
  plan_->options.segments = plan_->segments;
  seen_squared_sum_ = 0;
  hopeless_ = false;
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = true;
  error_.reset();
}

void Speculator::Complete(std::size_t s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_ || error_) return;
    queue_.push_back(s);
  }
  work_cv_.notify_one();
}

void Speculator::Seal() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
  queue_.clear();
}

Status Speculator::Stop() {
  Seal();
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return !busy_; });
  // The thread is idle and gets nothing new: the writes in flight are this thread's to wait for.
  Status finished = swapper_->FinishSpeculation();
  if (!error_ && !finished) error_ = std::move(finished).error();
  if (error_) return *error_;
  return OkStatus();
}

void Speculator::Disarm() {
  (void)Stop();
  plan_.reset();
  for (std::vector<float>& w : weights_) std::vector<float>().swap(w);
  std::lock_guard<std::mutex> lock(mu_);
  error_.reset();
}

void Speculator::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return quit_ || !queue_.empty(); });
    if (quit_) return;
    const std::size_t s = queue_.front();
    queue_.pop_front();
    // Read ahead while this one is stepped.
    const std::optional<std::size_t> next =
        queue_.empty() ? std::nullopt : std::optional<std::size_t>(queue_.front());
    busy_ = true;
    lock.unlock();
    // plan_ and weights_[s] are the caller's only while this thread is idle (Stop waits).
    const partition::SubGroup& sg = swapper_->swap_info(s).sub_group;
    Status done = OkStatus();
    const std::span<const float> grad = gradient_.subspan(sg.partition_offset, sg.numel);
    if (!hopeless_) {
      seen_squared_sum_ += swapper_->adam().SquaredL2Norm(grad);
      hopeless_ = !std::isfinite(seen_squared_sum_) ||
                  !(seen_squared_sum_ <= plan_->clip_squared_sum);
    }
    if (!hopeless_ && swapper_->speculable(s) && !swapper_->speculated(s) &&
        swapper_->last_step(s) < plan_->step) {
      if (keep_weights_[s]) weights_[s].resize(sg.numel);
      done = swapper_->Speculate(plan_->step, s, grad, plan_->options, weights_[s], next);
    }
    lock.lock();
    busy_ = false;
    if (!done && !error_) {
      error_ = std::move(done).error();
      queue_.clear();
    }
    idle_cv_.notify_all();
  }
}

}  // namespace zinf::engine
