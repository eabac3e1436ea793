// Writes the two-group fp16 checkpoint of deepspeed_export_testing.h, for
// deepspeed_export_test.sh (zinf-train makes one group only).
//
//   mpirun -np N deepspeed_export_make_ckpt CKPT_DIR STORE_DIR fp32|q8 [no-scalar]
// no-scalar: the 0-dim parameter has shape [1] (for ds_to_universal, which cannot merge 0-dim).
#include <cstdio>
#include <string>

#include "deepspeed_export_testing.h"
#include "zinf/comm/mpi_session.h"

int main(int argc, char** argv) {
  auto session = zinf::comm::MpiSession::Init(&argc, &argv);
  if (!session) {
    std::fprintf(stderr, "%s\n", session.error().ToString().c_str());
    return 1;
  }
  const std::string state = argc == 4 || argc == 5 ? argv[3] : "";
  const bool scalar = argc != 5 || std::string(argv[4]) != "no-scalar";
  if ((state != "fp32" && state != "q8") || (argc == 5 && scalar)) {
    std::fprintf(stderr, "usage: %s CKPT_DIR STORE_DIR fp32|q8 [no-scalar]\n", argv[0]);
    return 2;
  }
  auto saved = zinf::interop::deepspeed_testing::SaveGroupsCheckpoint(
      session->world(), argv[2], argv[1], state == "q8", nullptr, scalar);
  if (!saved) {
    std::fprintf(stderr, "rank %d: %s\n", session->world().rank(),
                 saved.error().ToString().c_str());
    return 1;
  }
  if (session->world().rank() == 0) std::printf("%s\n", saved->c_str());
  return 0;
}
