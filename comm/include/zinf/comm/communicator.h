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
// Bounded waits. The agreement that opens every collective is the only place a rank waits for
// ranks that may never come (one raised, was interrupted, or destroyed its engine): the MPI
// operation after it starts only once every rank has entered the same collective. So the
// agreement runs non-blocking and is polled, and a rank ends the job (an ERROR line naming the
// collective, then MPI_Abort: its communicators cannot be used again) when
//   - another rank of the same failure domain left it (Leave(): an engine destroyed without its
//     collective Close) before entering this agreement: within milliseconds; or
//   - it waited longer than the domain's wait timeout (SetWaitTimeout; default
//     kDefaultWaitTimeout) for the others: a rank stopped, hangs in its own code, or left
//     without a word. The ERROR names the ranks that did not arrive: a rank that has waited half
//     the timeout in an agreement tells the others so (a few bytes per rank, on the domain's
//     control communicator; a completed agreement sends nothing), and whoever said nothing by
//     the timeout is named.
// A failure domain is a communicator and every Dup() of it; DupDomain() starts a new one (an
// engine's private communicator and the ones its parts dup from it). The ranks' agreements in a
// domain are counted, so a rank that left after its last agreement never fails a slower rank
// still finishing that same agreement.
//
// Calls. AgreeOnCall tags the agreement with the name of the API call a rank is in; when ranks
// are in different calls (rank 1 in Close while rank 0 is in Step), every rank gets the same
// FailedPrecondition naming them instead of matching unrelated collectives. Their sequences of
// collectives have then diverged for good: every later agreement of the failure domain returns
// that error at once, without MPI (diverged()); its owner can only be closed locally.
//
// Buffers are host memory, typed with std::span. Supported element types: std::int32_t,
// std::int64_t, std::uint64_t, float, double (and std::byte / char for Broadcast/Allgather(v)).
//
// Thread safety: a Communicator may be used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::comm {

enum class ReduceOp { kSum, kMin, kMax };

// How long an agreement waits for the other ranks unless SetWaitTimeout says otherwise.
inline constexpr std::chrono::seconds kDefaultWaitTimeout{600};

struct FailureDomain;  // communicator.cc

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

  // A dup of this communicator (same ranks, own context), in the same failure domain. Collective.
  Result<Communicator> Dup() const;
  // A dup that starts a failure domain of its own (see the top of the file), with this one's
  // wait timeout. Collective.
  Result<Communicator> DupDomain() const;
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
  // ReduceScatter with op kSum through `scratch` (at least counts[rank()] elements when
  // size() > 1), which the caller keeps from call to call: in round k = 1 .. size() - 1 this rank
  // sends its block for rank + k and receives rank - k's block for it into `scratch`, which it
  // adds to `out` (its own block first, then the rank before it, and so on around the ring: one
  // order, whichever thread calls). MPI_Reduce_scatter allocates temporaries as large as `in`
  // on every call (Open MPI's: two), which glibc gives back to the kernel in between when they
  // are mapped or top its main heap, so that every call faults them in afresh; a kept scratch is
  // faulted in once. `out` must not overlap `in` or `scratch`. Errors: InvalidArgument (sizes),
  // Internal (MPI).
  template <typename T>
  Status ReduceScatterSum(std::span<const std::type_identity_t<T>> in, std::span<T> out,
                          std::span<const std::int64_t> counts, std::span<T> scratch) const;

  // Collective. Every rank passes its local status and every rank returns the same status: OK if
  // all were OK; otherwise the most severe ErrorCode over all ranks, and the message (prefixed
  // "rank <r>: ") and errno of the lowest failing rank, plus "(and <k> more ranks failed)" when
  // several did. If the agreement itself fails at the MPI level, returns that error (Internal).
  // `loc` becomes the location of the agreed Error on the ranks that did not fail themselves.
  Status AgreeOnStatus(const Status& local,
                       std::source_location loc = std::source_location::current()) const;
  // Collective. AgreeOnStatus that also checks that every rank is in the API call `call` (a
  // short name, e.g. "Step"): if some rank is in another call, or in a plain AgreeOnStatus, every
  // rank returns FailedPrecondition "ranks are in different calls: rank 0 in Step, rank 1 in
  // Close ...". Opens each collective call of an API whose callers may diverge.
  Status AgreeOnCall(std::string_view call, const Status& local = OkStatus(),
                     std::source_location loc = std::source_location::current()) const;

  // Local. This rank leaves the failure domain (its owner is destroyed without its collective
  // close): every other rank of the domain waiting in an agreement this rank will not enter ends
  // the job with `reason`, instead of waiting for the timeout. With `rejoin`, the rank still
  // makes that one call (an AgreeOnCall of that name, e.g. the Close at exit), and the others
  // wait for it there. Sends one short message per rank, waiting at most a second for them to
  // go out.
  void Leave(std::string_view reason, std::string_view rejoin = {}) const;

  // Local: an agreement of this failure domain found the ranks in different calls (alike on
  // every rank); every agreement of the domain now fails at once.
  bool diverged() const;

  // Local: the longest an agreement of this failure domain waits for the other ranks before it
  // ends the job. Every rank sets the same value (e.g. from the agreed config).
  void SetWaitTimeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds wait_timeout() const;

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
  // AgreeOnStatus and AgreeOnCall: `tag` 0 for a plain agreement; `label` names it on a mismatch.
  Status Agree(const Status& local, int tag, std::string_view label,
               std::source_location loc) const;
  Status CallMismatch(std::string_view label, std::source_location loc) const;
  // Polls `request` (an MPI_Request*) until it completes; ends the job when a rank of the domain
  // left before this agreement or the wait timeout passes.
  Status WaitForRanks(void* request, std::string_view what) const;

  void* handle_ = nullptr;  // MPI_Comm*, owned; never MPI_COMM_WORLD itself
  std::shared_ptr<FailureDomain> domain_;  // shared with the Dup()s of this communicator
  int rank_ = 0;
  int size_ = 0;
  Topology topology_;
};

}  // namespace zinf::comm
