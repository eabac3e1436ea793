#include "zinf/comm/mpi_session.h"

#include <mpi.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "mpi_util.h"
#include "zinf/comm/mpi_native.h"
#include "zinf/core/check.h"
#include "zinf/core/log.h"

namespace zinf::comm {
namespace {

int ToMpi(ThreadLevel level) {
  switch (level) {
    case ThreadLevel::kSingle:
      return MPI_THREAD_SINGLE;
    case ThreadLevel::kFunneled:
      return MPI_THREAD_FUNNELED;
    case ThreadLevel::kSerialized:
      return MPI_THREAD_SERIALIZED;
    case ThreadLevel::kMultiple:
      return MPI_THREAD_MULTIPLE;
  }
  return MPI_THREAD_SINGLE;
}

ThreadLevel FromMpi(int level) {
  if (level >= MPI_THREAD_MULTIPLE) return ThreadLevel::kMultiple;
  if (level >= MPI_THREAD_SERIALIZED) return ThreadLevel::kSerialized;
  if (level >= MPI_THREAD_FUNNELED) return ThreadLevel::kFunneled;
  return ThreadLevel::kSingle;
}

const char* Name(ThreadLevel level) {
  switch (level) {
    case ThreadLevel::kSingle:
      return "MPI_THREAD_SINGLE";
    case ThreadLevel::kFunneled:
      return "MPI_THREAD_FUNNELED";
    case ThreadLevel::kSerialized:
      return "MPI_THREAD_SERIALIZED";
    case ThreadLevel::kMultiple:
      return "MPI_THREAD_MULTIPLE";
  }
  return "?";
}

// Fills local rank/size, node index and count, and the hostname. Collective over `world`.
Status FillTopology(Communicator& world) {
  Topology& topo = CommunicatorAccess::topology(world);
  ZINF_ASSIGN_OR_RETURN(Communicator node, world.SplitNode());
  topo.local_rank = node.rank();
  topo.local_size = node.size();

  // Nodes are numbered by their lowest world rank: each node's local rank 0 is its leader.
  std::vector<std::int32_t> leaders(static_cast<std::size_t>(world.size()));
  std::int32_t is_leader = node.rank() == 0 ? 1 : 0;
  ZINF_RETURN_IF_ERROR(world.Allgather<std::int32_t>(std::span(&is_leader, 1), leaders));
  std::int32_t node_index = 0;
  for (int r = 0; r < world.rank(); ++r) node_index += leaders[static_cast<std::size_t>(r)];
  ZINF_RETURN_IF_ERROR(node.Broadcast(std::span(&node_index, 1), 0));
  topo.node = node_index;
  topo.num_nodes = 0;
  for (std::int32_t l : leaders) topo.num_nodes += l;

  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "unknown");
  topo.hostname = host;
  return OkStatus();
}

}  // namespace

Result<MpiSession> MpiSession::Init(int* argc, char*** argv, ThreadLevel required) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return FailedPreconditionError("MpiSession::Init: MPI was already finalized");

  MpiSession session;
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    int rc = MPI_Init_thread(argc, argv, ToMpi(required), &provided);
    if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Init_thread").error();
    session.owns_mpi_ = true;
  } else {
    ZINF_RETURN_IF_ERROR(MpiStatus(MPI_Query_thread(&provided), "MPI_Query_thread"));
  }
  if (provided < ToMpi(required)) {
    Error error = FailedPreconditionError(fmt::format(
        "MPI provides thread level {} but zinf needs {}; use an MPI built with thread support",
        Name(FromMpi(provided)), Name(required)));
    (void)session.Finalize();
    return error;
  }

  ZINF_ASSIGN_OR_RETURN(Communicator world, DupNative(MPI_COMM_WORLD));
  session.world_ = std::make_unique<Communicator>(std::move(world));
  SetProcessRank(session.world_->rank(), session.world_->size());
  ZINF_RETURN_IF_ERROR(Annotate(FillTopology(*session.world_), "MpiSession::Init: topology: "));
  return session;
}

MpiSession::MpiSession(MpiSession&& other) noexcept
    : world_(std::move(other.world_)),
      owns_mpi_(other.owns_mpi_),
      finalized_(std::exchange(other.finalized_, true)) {}

MpiSession& MpiSession::operator=(MpiSession&& other) noexcept {
  if (this != &other) {
    (void)Finalize();
    world_ = std::move(other.world_);
    owns_mpi_ = other.owns_mpi_;
    finalized_ = std::exchange(other.finalized_, true);
  }
  return *this;
}

MpiSession::~MpiSession() { (void)Finalize(); }

void MpiSession::AbortJob(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

Status MpiSession::Finalize() {
  if (finalized_) return OkStatus();
  finalized_ = true;
  world_.reset();
  if (!owns_mpi_) return OkStatus();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return OkStatus();
  return MpiStatus(MPI_Finalize(), "MPI_Finalize");
}

ThreadLevel ProvidedThreadLevel() {
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || !initialized) return ThreadLevel::kSingle;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return ThreadLevel::kSingle;
  int provided = MPI_THREAD_SINGLE;
  if (MPI_Query_thread(&provided) != MPI_SUCCESS) return ThreadLevel::kSingle;
  return FromMpi(provided);
}

}  // namespace zinf::comm
