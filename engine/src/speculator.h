// Speculator: the engine's speculative step (engine.h, "Speculative step"). While the last
// micro-batch of a step is being reduced, each sub-group whose reduced gradient is final is
// stepped on this object's thread (OptimizerSwapper::Speculate) with the step's arguments as
// they would be without clipping and without an fp16 overflow; Step then commits what was
// speculated, or discards it and steps those sub-groups again.
//
//   Speculator spec(swapper, partition_grad, keep_weights);   // starts the thread
//   spec.Arm({.step = 7, .options = ...});    // the caller's thread: the last micro-batch began
//   spec.Complete(3);                         // any thread: sub-group 3's gradient is final
//   ... Step:  Status failed = spec.Stop();   // no more; waits for the sub-group in progress
//              if (usable) for each i: swapper->CommitSpeculated(i), spec.weights(i) to the sink
//              spec.Disarm();                 // forgets the plan and the weights
//
// Thread safety: Arm, Stop, Disarm and the accessors from the engine's caller; Complete from
// any thread (the gradient buckets' worker). While the thread speculates, the caller makes no
// swapper call but ReadState (OptimizerSwapper, "Speculation").
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::engine {

class Speculator {
 public:
  // What the speculation assumes: the step, and the swapper's StepOptions for it with the clip
  // coefficient 1 (`segments` owned here; options.segments points into it once armed).
  struct Plan {
    std::int64_t step = 0;
    swapper::StepOptions options;
    std::vector<swapper::AdamSegment> segments;
    // The squared sum of the reduced gradient (over all ranks) above which the step clips; this
    // rank's part of it is a lower bound, so once the sub-groups seen exceed it (or are not
    // finite: an fp16 overflow skips the step) nothing more is speculated. Infinity: no clipping.
    double clip_squared_sum = std::numeric_limits<double>::infinity();
  };

  // `gradient`: the partition gradient (in memory); `keep_weights`: per sub-group, whether Step's
  // sink needs its new weights (they are kept here until then).
  Speculator(swapper::OptimizerSwapper* swapper, std::span<const float> gradient,
             std::vector<bool> keep_weights);
  ~Speculator();  // stops and joins the thread
  Speculator(const Speculator&) = delete;
  Speculator& operator=(const Speculator&) = delete;

  // The last micro-batch of plan.step begins: sub-groups completed from now on are speculated.
  void Arm(Plan plan);
  bool armed() const { return plan_.has_value(); }
  // Sub-group `s`'s gradient is final for this micro-batch. Ignored unless armed.
  void Complete(std::size_t s);
  // No more sub-groups: drops those queued (Stop then waits for the one in progress).
  void Seal();
  // No more sub-groups: drops those queued, waits for the one in progress and its writes.
  // Returns the first error of the speculation (those speculated before it stay speculated).
  Status Stop();
  // Forgets the plan and the kept weights (after the swapper committed or discarded).
  void Disarm();
  // Whether the sub-groups seen since Arm prove that the step clips or skips (Plan).
  bool hopeless() const { return hopeless_; }

  const Plan* plan() const { return plan_ ? &*plan_ : nullptr; }
  // The new weights of speculated sub-group `s`; empty unless keep_weights[s].
  std::span<const float> weights(std::size_t s) const { return weights_.at(s); }

 private:
  void Work();

  swapper::OptimizerSwapper* const swapper_;
  const std::span<const float> gradient_;
  const std::vector<bool> keep_weights_;
  std::optional<Plan> plan_;  // written by the caller while the thread is idle
  std::vector<std::vector<float>> weights_;
  double seen_squared_sum_ = 0;  // the thread's (read by the caller after Stop)
  bool hopeless_ = false;        // likewise

  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::size_t> queue_;  // (mu_)
  bool accepting_ = false;         // (mu_) armed and not stopped
  bool busy_ = false;              // (mu_) the thread is speculating a sub-group
  bool quit_ = false;              // (mu_)
  std::optional<Error> error_;     // (mu_) the first failure since Arm
  std::thread thread_;
};

}  // namespace zinf::engine
