// MpiSession: owns MPI initialization for the process.
//
//   auto session = zinf::comm::MpiSession::Init(&argc, &argv);
//   if (!session) { ... }            // e.g. the thread level MPI gave is too low
//   zinf::comm::Communicator& world = session->world();
//
// Init initializes MPI unless the host program already did (then it adopts it and will not
// finalize it). It checks the thread level MPI provides against the one asked for, sets the
// process rank for logs and checks (zinf::SetProcessRank), and builds the world communicator (a
// dup of MPI_COMM_WORLD with MPI_ERRORS_RETURN) and its topology. The destructor finalizes MPI only
// if this session initialized it; Finalize() does so explicitly and reports errors.
//
// Thread safety: create one session per process, from the main thread.
#pragma once

#include <memory>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::comm {

enum class ThreadLevel { kSingle, kFunneled, kSerialized, kMultiple };

class MpiSession {
 public:
  // Errors: FailedPrecondition if MPI was already finalized or the provided thread level is below
  // `required`; Internal for MPI failures.
  static Result<MpiSession> Init(int* argc, char*** argv,
                                 ThreadLevel required = ThreadLevel::kFunneled);

  MpiSession(MpiSession&& other) noexcept;
  MpiSession& operator=(MpiSession&& other) noexcept;
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession();

  // The world communicator (dup of MPI_COMM_WORLD, errors returned, topology known).
  Communicator& world() { return *world_; }
  const Communicator& world() const { return *world_; }

  // True if this session called MPI_Init_thread (and so will finalize).
  bool owns_mpi() const { return owns_mpi_; }

  // Frees the world communicator and, if this session initialized MPI, finalizes it. Idempotent.
  // Not collective in the zinf sense (MPI_Finalize is collective over MPI itself).
  Status Finalize();

  // Ends every process of the job with `exit_code` (MPI_Abort on MPI_COMM_WORLD; plain exit when
  // MPI is not running): the last resort for a failure one rank cannot report collectively, such
  // as an unexpected exception, so that no other rank waits for it in a collective forever.
  [[noreturn]] static void AbortJob(int exit_code);

 private:
  MpiSession() = default;
  std::unique_ptr<Communicator> world_;
  bool owns_mpi_ = false;
  bool finalized_ = false;
};

// The thread level MPI provides to this process (MPI_Query_thread), for code that was handed a
// Communicator rather than the session. kSingle when MPI is not initialized (or finalized).
ThreadLevel ProvidedThreadLevel();

}  // namespace zinf::comm
