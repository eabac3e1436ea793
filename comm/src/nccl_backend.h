// Private: the NCCL collective backend (built with CUDA only).
#pragma once

#include <memory>

#include "zinf/comm/collective_backend.h"

namespace zinf::comm {

// Collective over `comm`: rank 0 makes an ncclUniqueId, broadcasts it over MPI, every rank binds
// the GPU local_rank % gpu_count and joins the NCCL communicator. Without CUDA: Unimplemented.
Result<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(const Communicator& comm);

}  // namespace zinf::comm
