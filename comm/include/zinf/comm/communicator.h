// Communicator: a private dup of an MPI communicator with MPI_ERRORS_RETURN set, so that every MPI
// failure comes back as a Status (with MPI_Error_string's text) instead of aborting the job.
//
// Collectives. Every collective method below is "Collective over this communicator": all ranks
// must call it, in the same order, with matching arguments, and every rank returns the same
// Status. Each one first agrees on the validity of the local arguments (so that one rank with a
// bad argument fails everywhere instead of leaving the others blocked in MPI), then runs the MPI
// operation, then agrees on its result (AgreeOnStatus). The error a rank gets names the first
// failing rank ("rank 2: ...").
//
// Buffers are host memory, typed with std::span. Supported element types: std::int32_t,
// std::int64_t, std::uint64_t, float, double (and std::byte / char for Broadcast/Allgather(v)).
//
// Thread safety: a Communicator may be used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <source_location>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::comm {

enum class ReduceOp { kSum, kMin, kMax };

// Where a rank sits: filled when a world communicator is built (MpiSession).
struct Topology {
  int world_rank = 0;
  int world_size = 1;
  int local_rank = 0;   // rank among the processes of this node
  int local_size = 1;   // processes on this node
  int node = 0;         // index of this node, 0..num_nodes-1, in order of the lowest world rank
  int num_nodes = 1;
  std::string hostname;
};

class Communicator {
 public:
  ~Communicator();
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Meaningful on communicators built by MpiSession (world) and their Dup(); for others only
  // rank/size are filled in.
  const Topology& topology() const { return topology_; }

  // A dup of this communicator (same ranks, own context). Collective.
  Result<Communicator> Dup() const;
  // MPI_Comm_split: ranks with the same color form a communicator, ordered by key. Collective.
  Result<Communicator> Split(int color, int key) const;
  // The ranks of this communicator that share a node (MPI_COMM_TYPE_SHARED). Collective.
  Result<Communicator> SplitNode() const;

  // ---- Collectives (see top of file). ----
  Status Barrier() const;

  // Root's `data` is copied into every rank's `data`; all ranks pass the same size.
  template <typename T>
  Status Broadcast(std::span<T> data, int root) const;
  // Broadcast of a string whose length only the root knows.
  Status BroadcastString(std::string* text, int root) const;

  // out[i] = op over ranks of in[i]. in and out have the same size on every rank; in may alias
  // out exactly (in-place).
  template <typename T>
  Status Allreduce(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                   ReduceOp op) const;
  template <typename T>
  Status AllreduceInPlace(std::span<T> data, ReduceOp op) const {
    return Allreduce<T>(std::span<const T>(data.data(), data.size()), data, op);
  }

  // out = concatenation of every rank's `in` (all the same size); out.size() == size() * in.size().
  template <typename T>
  Status Allgather(std::span<const std::type_identity_t<T>> in, std::span<T> out) const;

  // Like Allgather with a different count per rank. `counts` (size() entries, the same on every
  // rank) gives each rank's count; out.size() == sum(counts).
  template <typename T>
  Status Allgatherv(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                    std::span<const std::int64_t> counts) const;

  // MPI_Reduce_scatter_block: in has size() * out.size() elements; rank r receives op over ranks
  // of block r.
  template <typename T>
  Status ReduceScatterBlock(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                            ReduceOp op) const;
  // MPI_Reduce_scatter: `counts` (size() entries, the same on every rank) cuts `in` (sum(counts)
  // elements, rank-major) into one block per rank; rank r receives op over ranks of block r in
  // `out` (counts[r] elements; a count may be 0).
  template <typename T>
  Status ReduceScatter(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                       std::span<const std::int64_t> counts, ReduceOp op) const;

  // Collective. Every rank passes its local status and every rank returns the same status: OK if
  // all were OK; otherwise the most severe ErrorCode over all ranks, and the message (prefixed
  // "rank <r>: ") and errno of the lowest failing rank, plus "(and <k> more ranks failed)" when
  // several did. If the agreement itself fails at the MPI level, returns that error (Internal).
  // `loc` becomes the location of the agreed Error on the ranks that did not fail themselves.
  Status AgreeOnStatus(const Status& local,
                       std::source_location loc = std::source_location::current()) const;

  // The underlying MPI_Comm, as an opaque handle for modules that must hand it to MPI-aware
  // libraries (the HDF5 MPI-IO driver). Only zinf/comm/mpi_native.h turns it into MPI_Comm.
  void* native_handle() const { return handle_; }

 private:
  friend class MpiSession;
  friend struct CommunicatorAccess;
  Communicator() = default;
  Status Free();
  // Agrees on `local_check` (argument validation), then runs `mpi_call` (returning an MPI error
  // code) and agrees on its result.
  template <typename F>
  Status Collective(const Status& local_check, const char* what, F&& mpi_call) const;

  void* handle_ = nullptr;  // MPI_Comm*, owned; never MPI_COMM_WORLD itself
  int rank_ = 0;
  int size_ = 0;
  Topology topology_;
};

}  // namespace zinf::comm
