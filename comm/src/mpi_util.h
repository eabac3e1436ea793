// Private helpers of the comm module: MPI datatypes for zinf's element types.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zinf/comm/communicator.h"

namespace zinf::comm {

template <typename T>
MPI_Datatype MpiType() {
  if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return MPI_UINT64_T;
  else if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::byte>) return MPI_BYTE;
  else if constexpr (std::is_same_v<T, char>) return MPI_CHAR;
  else static_assert(sizeof(T) == 0, "unsupported element type for zinf collectives");
}

inline MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// Access to the private parts of Communicator for the comm module's own code.
struct CommunicatorAccess {
  static Communicator Make(MPI_Comm* owned) {
    Communicator c;
    c.handle_ = owned;
    MPI_Comm_rank(*owned, &c.rank_);
    MPI_Comm_size(*owned, &c.size_);
    c.topology_.world_rank = c.rank_;
    c.topology_.world_size = c.size_;
    return c;
  }
  static Topology& topology(Communicator& c) { return c.topology_; }
  static std::shared_ptr<FailureDomain>& domain(Communicator& c) { return c.domain_; }
};

}  // namespace zinf::comm
