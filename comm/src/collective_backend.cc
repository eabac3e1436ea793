#include "zinf/comm/collective_backend.h"

#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "nccl_backend.h"
#include "zinf/core/log.h"

#if defined(ZINF_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace zinf::comm {
namespace {

class MpiBackend final : public CollectiveBackend {
 public:
  explicit MpiBackend(const Communicator& comm) : comm_(comm) {}
  std::string_view name() const override { return "mpi"; }
  bool device_buffers() const override { return false; }

  Status AllreduceSum(std::span<float> data) override {
    return comm_.AllreduceInPlace<float>(data, ReduceOp::kSum);
  }
  Status ReduceScatterSum(std::span<const float> in, std::span<float> out) override {
    return comm_.ReduceScatterBlock<float>(in, out, ReduceOp::kSum);
  }
  Status ReduceScatterVSum(std::span<const float> in, std::span<const std::int64_t> counts,
                           std::span<float> out) override {
    // Kept from call to call (Communicator::ReduceScatterSum): MPI_Reduce_scatter's own
    // temporaries were faulted in afresh on every call, which took 4x the transfer's time.
    const auto me = static_cast<std::size_t>(comm_.rank());
    if (comm_.size() > 1 && counts.size() == static_cast<std::size_t>(comm_.size()) &&
        counts[me] >= 0 && static_cast<std::uint64_t>(counts[me]) <= in.size()) {
      const auto need = static_cast<std::size_t>(counts[me]);
      if (scratch_.size() < need) scratch_.resize(need);
    }
    return comm_.ReduceScatterSum<float>(in, out, counts, scratch_);
  }
  Status Allgather(std::span<const float> in, std::span<float> out) override {
    return comm_.Allgather<float>(in, out);
  }
  Status Broadcast(std::span<float> data, int root) override {
    return comm_.Broadcast<float>(data, root);
  }
  Status Synchronize() override { return OkStatus(); }

 private:
  const Communicator& comm_;
  std::vector<float> scratch_;  // ReduceScatterVSum's, the largest asked for so far
};

}  // namespace

bool BuiltWithCuda() {
#if defined(ZINF_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int VisibleGpuCount(std::string* why) {
#if defined(ZINF_WITH_CUDA)
  int count = 0;  // cudaGetDeviceCount leaves it untouched when there is no driver
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    if (why != nullptr) {
      *why = fmt::format("cudaGetDeviceCount: {} ({})", cudaGetErrorString(rc), static_cast<int>(rc));
    }
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA runtime sees no GPU";
  return count;
#else
  if (why != nullptr) *why = "zinf was built without CUDA (ZINF_WITH_CUDA=OFF)";
  return 0;
#endif
}

Result<std::unique_ptr<CollectiveBackend>> CreateCollectiveBackend(const Communicator& comm,
                                                                   BackendKind kind) {
  std::string why;
  // Every rank must choose the same backend: agree on whether all of them see a GPU.
  std::int32_t has_gpu = VisibleGpuCount(&why) > 0 ? 1 : 0;
  ZINF_RETURN_IF_ERROR(comm.AllreduceInPlace<std::int32_t>(std::span(&has_gpu, 1), ReduceOp::kMin));
  if (kind == BackendKind::kNccl && !BuiltWithCuda()) {
    return UnimplementedError("NCCL backend requested but " + why);
  }
  if (kind == BackendKind::kNccl && has_gpu == 0) {
    return FailedPreconditionError(
        fmt::format("NCCL backend requested but not every rank sees a GPU ({})",
                    why.empty() ? "another rank has none" : why));
  }
  if (kind == BackendKind::kMpi || has_gpu == 0) {
    if (kind == BackendKind::kAuto) {
      ZINF_LOG_INFO("collectives: MPI on host memory ({})", why.empty() ? "no GPU on some rank" : why);
    }
    return std::unique_ptr<CollectiveBackend>(std::make_unique<MpiBackend>(comm));
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<CollectiveBackend> nccl, CreateNcclBackend(comm));
  ZINF_LOG_INFO("collectives: NCCL on device memory");
  return nccl;
}

}  // namespace zinf::comm
