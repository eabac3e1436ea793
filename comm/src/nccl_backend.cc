#include "nccl_backend.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#if defined(ZINF_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include "zinf/core/log.h"

namespace zinf::comm {

#if !defined(ZINF_WITH_CUDA)

Result<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(const Communicator&) {
  return UnimplementedError("NCCL backend: zinf was built without CUDA");
}

#else

namespace {

Status CudaStatus(cudaError_t rc, std::string_view what) {
  if (rc == cudaSuccess) return OkStatus();
  return InternalError(fmt::format("{}: {} (cudaError {})", what, cudaGetErrorString(rc),
                                   static_cast<int>(rc)));
}

Status NcclStatus(ncclResult_t rc, std::string_view what) {
  if (rc == ncclSuccess) return OkStatus();
  ErrorCode code = rc == ncclInvalidArgument || rc == ncclInvalidUsage ? ErrorCode::kInvalidArgument
                                                                        : ErrorCode::kInternal;
  return Error(code, fmt::format("{}: {} (ncclResult {})", what, ncclGetErrorString(rc),
                                 static_cast<int>(rc)));
}

class NcclBackend final : public CollectiveBackend {
 public:
  NcclBackend(const Communicator& comm, ncclComm_t nccl, cudaStream_t stream)
      : comm_(comm), nccl_(nccl), stream_(stream) {}
  ~NcclBackend() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (nccl_ != nullptr) ncclCommDestroy(nccl_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  std::string_view name() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  Status AllreduceSum(std::span<float> data) override {
    return Agree(NcclStatus(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, ncclSum,
                                          nccl_, stream_),
                            "ncclAllReduce"));
  }
  Status ReduceScatterSum(std::span<const float> in, std::span<float> out) override {
    Status check = in.size() == out.size() * static_cast<std::size_t>(comm_.size())
                       ? OkStatus()
                       : Status(InvalidArgumentError(fmt::format(
                             "ReduceScatterSum: in has {} floats, expected {}", in.size(),
                             out.size() * static_cast<std::size_t>(comm_.size()))));
    ZINF_RETURN_IF_ERROR(comm_.AgreeOnStatus(check));
    return Agree(NcclStatus(ncclReduceScatter(in.data(), out.data(), out.size(), ncclFloat, ncclSum,
                                              nccl_, stream_),
                            "ncclReduceScatter"));
  }
  // NCCL has no reduce-scatter with counts: one ncclReduce per rank to that rank, grouped.
  Status ReduceScatterVSum(std::span<const float> in, std::span<const std::int64_t> counts,
                           std::span<float> out) override {
    Status check = OkStatus();
    std::uint64_t total = 0;
    if (counts.size() != static_cast<std::size_t>(comm_.size())) {
      check = InvalidArgumentError(
          fmt::format("ReduceScatterVSum: {} counts for {} ranks", counts.size(), comm_.size()));
    } else {
      for (std::int64_t c : counts) {
        if (c < 0) check = InvalidArgumentError(fmt::format("ReduceScatterVSum: count {}", c));
        total += static_cast<std::uint64_t>(std::max<std::int64_t>(c, 0));
      }
      if (check &&
          (in.size() != total || out.size() != static_cast<std::uint64_t>(counts[comm_.rank()]))) {
        check = InvalidArgumentError(fmt::format(
            "ReduceScatterVSum: in has {} floats (counts sum to {}), out {} (expected {})",
            in.size(), total, out.size(), counts[comm_.rank()]));
      }
    }
    ZINF_RETURN_IF_ERROR(comm_.AgreeOnStatus(check));
    Status issued = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    std::uint64_t offset = 0;
    for (int r = 0; r < comm_.size() && issued; ++r) {
      const auto n = static_cast<std::size_t>(counts[r]);
      if (n > 0) {
        issued = NcclStatus(ncclReduce(in.data() + offset, r == comm_.rank() ? out.data() : nullptr,
                                       n, ncclFloat, ncclSum, r, nccl_, stream_),
                            "ncclReduce");
      }
      offset += n;
    }
    Status ended = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    return Agree(issued ? ended : issued);
  }
  Status Allgather(std::span<const float> in, std::span<float> out) override {
    Status check = out.size() == in.size() * static_cast<std::size_t>(comm_.size())
                       ? OkStatus()
                       : Status(InvalidArgumentError(
                             fmt::format("Allgather: out has {} floats, expected {}", out.size(),
                                         in.size() * static_cast<std::size_t>(comm_.size()))));
    ZINF_RETURN_IF_ERROR(comm_.AgreeOnStatus(check));
    return Agree(NcclStatus(
        ncclAllGather(in.data(), out.data(), in.size(), ncclFloat, nccl_, stream_), "ncclAllGather"));
  }
  Status Broadcast(std::span<float> data, int root) override {
    Status check = root >= 0 && root < comm_.size()
                       ? OkStatus()
                       : Status(InvalidArgumentError(fmt::format("Broadcast: bad root {}", root)));
    ZINF_RETURN_IF_ERROR(comm_.AgreeOnStatus(check));
    return Agree(NcclStatus(
        ncclBroadcast(data.data(), data.data(), data.size(), ncclFloat, root, nccl_, stream_),
        "ncclBroadcast"));
  }
  Status Synchronize() override {
    return Agree(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  }

 private:
  Status Agree(const Status& local) { return comm_.AgreeOnStatus(local); }
  const Communicator& comm_;
  ncclComm_t nccl_;
  cudaStream_t stream_;
};

}  // namespace

Result<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(const Communicator& comm) {
  int gpus = 0;
  Status local = CudaStatus(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  if (local && gpus == 0) local = FailedPreconditionError("no GPU visible");
  if (local) {
    local = CudaStatus(cudaSetDevice(comm.topology().local_rank % gpus), "cudaSetDevice");
  }
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(local));

  ncclUniqueId id{};
  Status made = OkStatus();
  if (comm.rank() == 0) made = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
  ZINF_RETURN_IF_ERROR(comm.AgreeOnStatus(made));
  ZINF_RETURN_IF_ERROR(comm.Broadcast(
      std::span<std::byte>(reinterpret_cast<std::byte*>(&id), sizeof id), 0));

  cudaStream_t stream = nullptr;
  ncclComm_t nccl = nullptr;
  local = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (local) local = NcclStatus(ncclCommInitRank(&nccl, comm.size(), id, comm.rank()), "ncclCommInitRank");
  Status agreed = comm.AgreeOnStatus(local);
  if (!agreed) {
    if (nccl != nullptr) ncclCommDestroy(nccl);
    if (stream != nullptr) cudaStreamDestroy(stream);
    return agreed.error();
  }
  return std::unique_ptr<CollectiveBackend>(std::make_unique<NcclBackend>(comm, nccl, stream));
}

#endif  // ZINF_WITH_CUDA

}  // namespace zinf::comm
