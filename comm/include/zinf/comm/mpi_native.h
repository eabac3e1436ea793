// The MPI view of a Communicator, for code that must call MPI (or an MPI-aware library such as
// HDF5's MPI-IO driver) directly. Include only where that is needed; everything else uses
// communicator.h.
#pragma once

#include <mpi.h>

#include <source_location>
#include <string_view>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::comm {

// The communicator's MPI_Comm (owned by it; never free it).
MPI_Comm NativeComm(const Communicator& comm);

// OK for MPI_SUCCESS; otherwise an Error naming `what` with MPI_Error_string's text and the MPI
// error class. MPI_ERR_ARG/COUNT/ROOT/RANK/TYPE/OP/BUFFER map to InvalidArgument, MPI_ERR_NO_MEM
// to ResourceExhausted, MPI_ERR_IO/FILE to DataLoss, the rest to Internal.
Status MpiStatus(int mpi_result, std::string_view what,
                 std::source_location loc = std::source_location::current());

// A Communicator owning a dup of `comm` (with MPI_ERRORS_RETURN). Collective over `comm`.
Result<Communicator> DupNative(MPI_Comm comm);

}  // namespace zinf::comm
