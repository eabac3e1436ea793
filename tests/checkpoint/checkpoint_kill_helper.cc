// Helper of checkpoint_kill_test.sh (run under mpirun):
//   checkpoint_kill_helper save  CKPT_DIR STORE_DIR JOB FIRST_STEP   saves FIRST_STEP, +1, ...
//                                                                    until killed (or 10000 saves)
//   checkpoint_kill_helper check CKPT_DIR STORE_DIR JOB              restores `latest` and checks
//                                                                    it bit-exactly
// The state of step s is checkpoint_testing::StateValue(tensor, s, flat), so the checker knows
// what a checkpoint of any step must hold. Each rank writes its pid to CKPT_DIR/../pid.<rank>
// so that the script can kill one rank. Exit 0 on success, 1 on any error (printed).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "checkpoint_test_util.h"
#include "zinf/checkpoint/checkpoint.h"
#include "zinf/comm/mpi_session.h"

namespace {

using zinf::checkpoint::checkpoint_testing::CheckState;
using zinf::checkpoint::checkpoint_testing::FillState;
using zinf::checkpoint::checkpoint_testing::MakeSwapper;
using zinf::checkpoint::checkpoint_testing::SwapperSetup;
using zinf::checkpoint::checkpoint_testing::TestSwapper;

// 1.5 M elements: 18 MiB of state, so that a save takes long enough to be interrupted.
constexpr std::uint64_t kExtraNumel = 1'500'000;

int Run(int argc, char** argv, zinf::comm::Communicator& world) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s save|check CKPT_DIR STORE_DIR JOB [FIRST_STEP]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], ckpt = argv[2], store = argv[3], job = argv[4];
  {
    std::ofstream pid(ckpt + "/../pid." + std::to_string(world.rank()));
    pid << getpid() << "\n";
  }
  auto fail = [&](const zinf::Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), e.ToString().c_str());
    return 1;
  };
  SwapperSetup setup{.store_dir = store,
                     .job_id = job,
                     .world_size = world.size(),
                     .sub_group_size = 1 << 18,
                     .extra_numel = kExtraNumel};
  zinf::Result<TestSwapper> t = MakeSwapper(world, setup);
  if (!t) return fail(t.error());
  zinf::swapper::OptimizerSwapper& s = *t->swapper;
  if (mode == "save") {
    const long long first = argc > 5 ? std::atoll(argv[5]) : 1;
    for (long long step = first; step < first + 10000; ++step) {
      zinf::Status filled = world.AgreeOnStatus(FillState(s, step));
      if (!filled) return fail(filled.error());
      zinf::checkpoint::CheckpointSaveOptions options;
      options.dir = ckpt;
      options.keep_last = 2;
      options.chunk_numel = 100'000;
      options.progress = false;
      options.trainer = {{"step", step}};
      auto saved = zinf::checkpoint::SaveCheckpoint(s, step, options);
      if (!saved) return fail(saved.error());
      if (world.rank() == 0) std::printf("saved %lld\n", step);
      std::fflush(stdout);
      if (argc > 6) break;  // "once": the initial checkpoint
    }
  } else {
    zinf::checkpoint::CheckpointRestoreOptions options;
    options.progress = false;
    auto restored = zinf::checkpoint::RestoreCheckpoint(s, ckpt, options);
    if (!restored) return fail(restored.error());
    zinf::Status ok = world.AgreeOnStatus(CheckState(s, restored->step));
    if (!ok) return fail(ok.error());
    if (world.rank() == 0) {
      zinf::Status verified = zinf::checkpoint::VerifyCheckpoint(ckpt);
      if (!verified) return fail(verified.error());
      std::printf("restored step %lld from %s bit-exact on %d rank(s)\n",
                  static_cast<long long>(restored->step), restored->path.c_str(), world.size());
    }
  }
  zinf::Status closed = s.Close();
  if (!closed) return fail(closed.error());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto session = zinf::comm::MpiSession::Init(&argc, &argv);
  if (!session) {
    std::fprintf(stderr, "%s\n", session.error().ToString().c_str());
    return 1;
  }
  return Run(argc, argv, session->world());
}
