// CollectiveBackend: the data-parallel collectives of a training step (allreduce, reduce-scatter,
// allgather, broadcast of float buffers) behind one interface, so the trainer does not care
// whether they run over MPI on host memory or over NCCL on GPU memory.
//
// MpiBackend works on host buffers through a Communicator. NcclBackend (built with CUDA) works
// on device buffers on its own CUDA stream; its ncclUniqueId is broadcast over MPI. Create()
// picks NCCL only when zinf was built with CUDA and this process sees a GPU; otherwise MPI, and
// says which at INFO.
//
// Every method is collective over the backend's ranks and returns the same Status on every rank.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::comm {

enum class BackendKind { kAuto, kMpi, kNccl };

class CollectiveBackend {
 public:
  virtual ~CollectiveBackend() = default;
  virtual std::string_view name() const = 0;
  // True when buffers must be device memory (NCCL); false for host memory (MPI).
  virtual bool device_buffers() const = 0;

  virtual Status AllreduceSum(std::span<float> data) = 0;
  // in has size * out.size() floats; out receives the sum of block `rank`.
  virtual Status ReduceScatterSum(std::span<const float> in, std::span<float> out) = 0;
  // `counts` (one per rank, the same everywhere) cuts `in` (sum(counts) floats, rank-major) into
  // blocks; out (counts[rank] floats) receives the sum of block `rank`. MpiBackend receives
  // through a scratch it keeps for the next call (counts[rank] floats with more than one rank,
  // the largest asked for so far; Communicator::ReduceScatterSum), so that a call allocates and
  // faults in nothing once the size has been seen.
  virtual Status ReduceScatterVSum(std::span<const float> in, std::span<const std::int64_t> counts,
                                   std::span<float> out) = 0;
  // out has size * in.size() floats.
  virtual Status Allgather(std::span<const float> in, std::span<float> out) = 0;
  virtual Status Broadcast(std::span<float> data, int root) = 0;
  // Waits until every operation issued so far has finished (a no-op for MPI).
  virtual Status Synchronize() = 0;
};

// Collective over `comm`. kAuto: NCCL when built with CUDA and a GPU is visible, else MPI.
// kNccl without CUDA support or without a GPU: Unimplemented / FailedPrecondition with the reason.
// The backend keeps a reference to `comm`, which must outlive it.
Result<std::unique_ptr<CollectiveBackend>> CreateCollectiveBackend(const Communicator& comm,
                                                                   BackendKind kind);

// Whether this build has the CUDA/NCCL paths, and how many GPUs the CUDA runtime sees (0 when the
// build has no CUDA or there is no driver; the reason is in *why when non-null).
bool BuiltWithCuda();
int VisibleGpuCount(std::string* why = nullptr);

}  // namespace zinf::comm
