// zinf_probe_capabilities [DIR]: prints, comma-separated, the capabilities this machine has for
// the tests (testing/test_env.h, ZINF_REQUIRE), probed without zinf's own code so that a bug in
// zinf's probes cannot make CI skip what the machine could run:
//   uring    io_uring_queue_init and a NOP round trip work (liburing directly)
//   odirect  a file in DIR (default: ZINF_TEST_TMPDIR, else TMPDIR, else /tmp) opens O_DIRECT
//   tmpfs    a tmpfs mounts on a directory under DIR (root)
// tests/run.sh sets ZINF_REQUIRE to this list (and adds h5dump when hdf5-tools is installed).
#include <fcntl.h>
#include <liburing.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "testing/test_env.h"

namespace {

bool UringWorks() {
  io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) != 0) return false;
  bool ok = false;
  if (io_uring_sqe* sqe = io_uring_get_sqe(&ring)) {
    io_uring_prep_nop(sqe);
    io_uring_cqe* cqe = nullptr;
    ok = io_uring_submit(&ring) == 1 && io_uring_wait_cqe(&ring, &cqe) == 0 && cqe->res == 0;
    if (cqe != nullptr) io_uring_cqe_seen(&ring, cqe);
  }
  io_uring_queue_exit(&ring);
  return ok;
}

bool DirectWorks(const std::string& dir) {
  const std::string path = dir + "/probe-odirect";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(path.c_str());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  zinf::testing::ScratchDir scratch("probe");
  const std::string dir = argc > 1 ? argv[1] : scratch.path();
  std::vector<std::string> have;
  if (UringWorks()) have.push_back("uring");
  if (DirectWorks(dir)) have.push_back("odirect");
  if (zinf::testing::TmpfsMount(scratch.Join("tmpfs"), "1m").mounted()) have.push_back("tmpfs");
  std::string list;
  for (const std::string& c : have) list += (list.empty() ? "" : ",") + c;
  std::printf("%s\n", list.c_str());
  return 0;
}
