// GradientBuckets: how the user's gradients reach this rank's partition (ZeroEngine's
// AccumulateGradients, GradientReady and Step).
//
// The parameters are cut, in registration order, into buckets of whole parameters of at least
// zero_optimization.reduce_bucket_size elements (the last one smaller). A bucket is reduced by
// one reduce-scatter with counts (comm::CollectiveBackend::ReduceScatterVSum): each rank sends
// every rank's pieces of the bucket (partition order) and receives the sum of its own, which land
// in its partition gradient (in memory: micro-batch 0 overwrites, later ones add) or in a staging
// partition from which each sub-group goes to the gradient swapper as soon as all of its elements
// of the micro-batch have arrived. The user's gradients of a reduced bucket are zeroed.
//
// Two ways the gradients arrive. Registered: every parameter's buffer is known at Create and read
// when its bucket is reduced. Lent (Create without buffers): Ready gets the gradient and copies
// it into its bucket's send buffer at once, so the caller's buffer is free when Ready returns; a
// bucket's send buffer exists from its first parameter handed until it is reduced, so the
// memory is the buckets in flight, not the model (a parameter never handed sends zeros).
//
// Order: the buckets of a micro-batch are always reduced last bucket first, and bucket k only
// after every bucket above it: the same sequence of collectives on every rank whatever order the
// parameters were handed in, so ranks that hand gradients differently (or not at all: Finish
// reduces what is left) still meet in the same collectives. A backward pass produces the last
// parameters first, which is the order that overlaps best.
//
// Overlap: with `background`, a worker thread reduces the complete buckets while the caller's
// thread goes on with its backward pass; the engine's MPI calls then come from two threads, one
// at a time (MPI_THREAD_SERIALIZED), and the caller must not call MPI itself until Finish unless
// MPI provides MPI_THREAD_MULTIPLE. Without it Ready reduces the complete buckets itself.
//
// Errors: a failed collective is the same on every rank (the backend agrees on it) and stops the
// micro-batch's remaining collectives everywhere; a failed swap-out or a bad Ready call is local
// and recorded, the collectives go on, and Finish returns it (the engine agrees on it).
//
// Thread safety: Ready and Finish from one thread (the engine's caller).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "zinf/comm/collective_backend.h"
#include "zinf/comm/timers.h"
#include "zinf/core/status.h"
#include "zinf/partition/plan.h"
#include "zinf/partition/sub_group.h"
#include "zinf/swapper/gradient_swapper.h"

namespace zinf::engine {

class GradientBuckets {
 public:
  // Where this rank's reduced gradient goes: `accumulated` (partition-sized) without a gradient
  // swapper; else `staging` (partition-sized, in memory of its own, e.g. a storage::AlignedBuffer
  // allocated without zeroing: each sub-group's whole pages are given back to the kernel once
  // it is handed to `gradients`, so the staging costs host memory only for the sub-groups in
  // flight) and `gradients`.
  struct Target {
    std::span<float> accumulated;
    std::span<float> staging;
    swapper::GradientSwapper* gradients = nullptr;
    std::vector<partition::SubGroup> sub_groups;  // this rank's, in partition order
    // Called (on the thread that reduced it) with each sub-group whose elements of the
    // micro-batch have all arrived, after they landed; may be empty.
    std::function<void(std::size_t sub_group, int micro_batch)> complete;
  };

  // `grads`: every parameter's gradient buffer, in layout order; empty: the gradients are lent
  // (Ready with a span). InvalidArgument when a bucket exceeds what one MPI collective moves
  // (2^31 - 1 elements).
  static Result<std::unique_ptr<GradientBuckets>> Create(
      const partition::PartitionPlan& plan, int rank, std::vector<std::span<float>> grads,
      std::uint64_t bucket_elems, comm::CollectiveBackend* backend, Target target,
      comm::Timers* timers, bool background);
  // The host memory Create allocates for these arguments, without building (the engine's memory
  // plan): the send buffer of the largest bucket (lent gradients: two, one being filled while
  // the one before is reduced; more only when the reduction falls behind the backward pass),
  // the receive buffer of this rank's share of it and, with more than one rank, the backend's
  // receive scratch as large (kept from bucket to bucket: collective_backend.h); with
  // a gradient swapper, the staging's working set (the sub-groups in flight: this rank's share
  // of a bucket and the partially filled sub-groups on either side of it, at most the
  // partition). Local; allocates nothing.
  struct HostPlan {
    std::uint64_t bucket_bytes = 0;   // send + receive buffers, the backend's receive scratch
    std::uint64_t staging_bytes = 0;  // with a gradient swapper; `max_sub_group_numel` > 0
    std::uint64_t max_bucket_elems = 0;
  };
  static HostPlan PlanHostMemory(const partition::PartitionPlan& plan, int rank,
                                 std::uint64_t bucket_elems, bool lent,
                                 std::uint64_t max_sub_group_numel);
  ~GradientBuckets();  // lets the worker finish what it was given, then joins it
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  std::size_t num_buckets() const { return buckets_.size(); }
  std::uint64_t max_bucket_elems() const { return max_bucket_elems_; }
  bool background() const { return background_; }
  bool lent() const { return grads_.empty(); }
  // Whether a micro-batch has begun (a parameter was handed) and not finished. Local.
  bool in_micro_batch() const { return active_; }

  // Parameter `param`'s gradient of micro-batch `micro_batch` is complete in its buffer. Local.
  // Errors (also recorded for Finish): InvalidArgument (no such parameter), FailedPrecondition
  // (handed twice in the micro-batch).
  Status Ready(std::size_t param, int micro_batch);
  // Lent gradients: the same, with the gradient (the parameter's numel elements), copied before
  // the call returns. Errors also InvalidArgument (a wrong size). The first gradient of a bucket
  // waits, with a worker, until the worker has taken every complete bucket: the send buffers
  // alive are then the buckets being filled and the one being reduced, whatever the backward
  // pass's lead over the reductions (the memory plan counts two).
  Status Ready(std::size_t param, int micro_batch, std::span<const float> grad);
  // Lent gradients: the most send buffers alive at once so far (tests). Local.
  std::size_t peak_send_buffers() const { return peak_send_buffers_; }
  // Collective over the backend: reduces every bucket of micro-batch `micro_batch` not reduced
  // yet and ends the micro-batch. Returns the collective error (the same everywhere) or this
  // rank's recorded local error.
  Status Finish(int micro_batch);
  // Waits until the worker has reduced every bucket it was given (local; no MPI). After it no
  // thread of this object calls MPI until the next Ready, so the engine may run collectives of
  // its own in the middle of a micro-batch.
  void WaitIdle();

 private:
  struct Piece {
    std::size_t param;
    std::uint64_t in_param, numel;
    std::uint64_t partition_offset;  // in the owning rank's partition
    std::uint64_t send_at = 0;       // in the bucket's send buffer
  };
  struct Bucket {
    std::size_t first_param = 0, end_param = 0;
    std::vector<std::int64_t> counts;  // per rank
    std::vector<Piece> send;           // every rank's pieces, rank-major, partition order
    std::vector<Piece> mine;           // this rank's, in the order it receives them
    std::vector<std::pair<std::size_t, std::uint64_t>> sub_group_elems;  // (sub-group, count)
    std::uint64_t total = 0;                                             // elements sent, all ranks
  };

  GradientBuckets() = default;
  Status Build(const partition::PartitionPlan& plan, int rank, std::uint64_t bucket_elems);
  void Begin(int micro_batch);
  // Ready's checks (a failure is also recorded for Finish); begins the micro-batch.
  Status Accept(std::size_t param, int micro_batch);
  // Marks `param` handed and reduces (or has the worker reduce) the buckets now complete.
  void Handed(std::size_t param);
  // Reduces the k-th bucket of the micro-batch's order (bucket num_buckets - 1 - k).
  void Reduce(std::size_t k);
  void Unpack(const Bucket& bucket);
  // Hands sub-group `s` of the staging to the gradient swapper and releases its pages.
  void SwapOut(std::size_t s);
  void RecordLocal(Status status);  // keeps the first local error (both threads)
  bool HasLocalError();
  void Work();

  std::vector<std::span<float>> grads_;
  comm::CollectiveBackend* backend_ = nullptr;
  Target target_;
  comm::Timers* timers_ = nullptr;
  bool background_ = false;
  int rank_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;          // per parameter
  std::vector<std::uint64_t> sizes_;            // per parameter, elements
  std::vector<std::uint64_t> sub_group_total_;  // parameter elements per sub-group
  std::vector<float> send_, recv_;
  std::uint64_t max_bucket_elems_ = 0;  // all ranks' elements of the largest bucket
  // Lent: per parameter its pieces (indices into its bucket's `send`); per bucket its send
  // buffer, allocated by the first Ready of a micro-batch and freed once reduced.
  std::vector<std::vector<std::size_t>> pieces_of_;
  std::vector<std::vector<float>> lent_send_;
  std::atomic<std::size_t> send_buffers_{0};  // of lent_send_, allocated now
  std::size_t peak_send_buffers_ = 0;         // the caller's thread

  // Per micro-batch (the caller's thread, and the worker under mu_ as noted).
  bool active_ = false;
  int micro_batch_ = 0;
  std::vector<bool> ready_;                // per parameter
  std::vector<std::size_t> missing_;       // per bucket: parameters not handed yet
  std::vector<std::uint64_t> pending_;     // per sub-group: elements still to arrive (worker)
  std::optional<Error> collective_error_;  // written by whoever reduces; read after a wait
  std::mutex error_mu_;
  std::optional<Error> local_error_;  // (error_mu_)

  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::size_t complete_ = 0;  // buckets of the order, from the first, that are complete (mu_)
  std::size_t reduced_ = 0;   // buckets of the order reduced or being reduced by now (mu_)
  bool busy_ = false;         // the worker is reducing (mu_)
  bool stop_ = false;         // (mu_)
  std::thread worker_;
};

}  // namespace zinf::engine
