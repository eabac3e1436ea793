// For multi-rank tests (linked with zinf_mpi_main): the world communicator of the test process
// and a scratch directory shared by all ranks.
#pragma once

#include <string>

#include "zinf/comm/communicator.h"

namespace zinf::testing {

// The MpiSession's world communicator (valid for the whole test run).
comm::Communicator& World();

// A directory that every rank of World() sees: rank 0 creates it under TestTmpBase() and
// broadcasts the path; rank 0 removes it (after a barrier) when the object dies. Collective.
class SharedScratchDir {
 public:
  explicit SharedScratchDir(const std::string& tag = "mpi");
  ~SharedScratchDir();
  SharedScratchDir(const SharedScratchDir&) = delete;
  SharedScratchDir& operator=(const SharedScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace zinf::testing
