// zinf-comm-demo: a multi-rank walkthrough of the comm layer, run by launch/demo.sh until the
// training job exists. Every rank reports where it runs; the ranks reduce-scatter and all-gather a
// simulated gradient the way a ZeRO step does, check the result, agree on an error injected on
// one rank (--fail-rank), and rank 0 prints the reduced timers.
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "zinf/comm/collective_backend.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/comm/timers.h"
#include "zinf/core/log.h"
#include "zinf/core/units.h"

namespace {

zinf::Status Run(zinf::comm::Communicator& world, std::uint64_t numel_per_rank, int iterations,
                 int fail_rank) {
  using zinf::comm::ReduceOp;
  const zinf::comm::Topology& topo = world.topology();
  // Every rank says where it is: gather the lines so rank 0 prints them in order.
  std::string line = fmt::format("rank {}/{} on host {} (node {}/{}, local rank {}/{})",
                                 topo.world_rank, topo.world_size, topo.hostname, topo.node,
                                 topo.num_nodes, topo.local_rank, topo.local_size);
  line.resize(160, ' ');
  std::string all(160 * static_cast<std::size_t>(world.size()), ' ');
  ZINF_RETURN_IF_ERROR(world.Allgather<char>(line, all));
  for (int r = 0; r < world.size(); ++r) {
    std::string row = all.substr(160 * static_cast<std::size_t>(r), 160);
    row.erase(row.find_last_not_of(' ') + 1);
    ZINF_LOG_INFO("{}", row);
  }

  ZINF_ASSIGN_OR_RETURN(auto backend,
                        zinf::comm::CreateCollectiveBackend(world, zinf::comm::BackendKind::kAuto));
  zinf::comm::Timers timers;
  const std::size_t n = static_cast<std::size_t>(world.size());
  std::vector<float> grad(numel_per_rank * n);
  std::vector<float> part(numel_per_rank);
  std::vector<float> weights(numel_per_rank * n, 0.0f);
  for (int it = 0; it < iterations; ++it) {
    // Each rank's "gradient" of element i is rank + i % 7: the reduced value is known in closed form.
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(world.rank() + i % 7);
    timers.Start("reduce_scatter");
    ZINF_RETURN_IF_ERROR(backend->ReduceScatterSum(grad, part));
    timers.Stop("reduce_scatter");
    for (std::size_t i = 0; i < part.size(); ++i) {
      const std::size_t global = world.rank() * numel_per_rank + i;
      const float want = static_cast<float>(n * (n - 1) / 2 + n * (global % 7));
      if (part[i] != want) {
        return zinf::InternalError(fmt::format("reduce-scatter element {}: {} != {}", global, part[i], want));
      }
      part[i] = -0.01f * part[i] / static_cast<float>(n);  // a plain SGD update of this partition
    }
    timers.Start("allgather");
    ZINF_RETURN_IF_ERROR(backend->Allgather(part, grad));
    timers.Stop("allgather");
    for (std::size_t i = 0; i < weights.size(); ++i) weights[i] += grad[i];
  }
  double checksum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<double> sums(n);
  ZINF_RETURN_IF_ERROR(world.Allgather<double>(std::span(&checksum, 1), sums));
  for (double s : sums) {
    if (s != sums[0]) return zinf::InternalError("ranks disagree on the updated weights");
  }
  ZINF_LOG_INFO("{} ZeRO-style iterations of {} per rank ({} in all): every rank holds the same "
                "updated weights (sum {:.4f})",
                iterations, zinf::FormatBytes(numel_per_rank * sizeof(float)),
                zinf::FormatBytes(numel_per_rank * n * sizeof(float)), sums[0]);
  ZINF_RETURN_IF_ERROR(timers.LogSummary(world, "comm timers"));

  // Error agreement: one rank fails, all ranks learn the same error and nobody hangs.
  zinf::Status local = zinf::OkStatus();
  if (world.rank() == fail_rank) {
    local = zinf::ErrnoError(EIO, "simulated pwrite of swap file offset 1048576");
  }
  zinf::Status agreed = world.AgreeOnStatus(local);
  if (fail_rank >= 0) {
    if (agreed) return zinf::InternalError("an injected failure was not agreed on");
    ZINF_LOG_INFO("injected failure on rank {} -> every rank got: {}", fail_rank,
                  agreed.error().ToString());
  }
  return agreed;
}

}  // namespace

int main(int argc, char** argv) {
  auto session = zinf::comm::MpiSession::Init(&argc, &argv);
  if (!session) {
    std::fprintf(stderr, "zinf-comm-demo: %s\n", session.error().ToString().c_str());
    return 1;
  }
  CLI::App app{"zinf-comm-demo: the comm layer across ranks (run under mpirun)"};
  std::string size_text = "4M";
  int iterations = 5;
  int fail_rank = -1;
  app.add_option("--size-per-rank", size_text, "bytes of fp32 gradient per rank (e.g. 4M)");
  app.add_option("--iterations", iterations, "reduce-scatter/all-gather rounds")->check(CLI::PositiveNumber);
  app.add_option("--fail-rank", fail_rank, "inject an I/O error on this rank to show error agreement");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = session->world().rank() == 0 ? app.exit(e) : (e.get_exit_code() != 0 ? 1 : 0);
    (void)session->Finalize();
    return rc;
  }
  auto bytes = zinf::ParseBytes(size_text);
  zinf::Status status = bytes ? zinf::OkStatus() : zinf::Status(bytes.error());
  if (status && fail_rank >= session->world().size()) {
    status = zinf::InvalidArgumentError(fmt::format("--fail-rank {} but only {} ranks", fail_rank,
                                                    session->world().size()));
  }
  if (status) status = Run(session->world(), std::max<std::uint64_t>(1, *bytes / sizeof(float)), iterations, fail_rank);
  if (fail_rank >= 0 && !status && status.error().message().find("simulated") != std::string::npos) {
    status = zinf::OkStatus();  // the demonstrated failure is the expected outcome
  }
  if (!status) ZINF_LOG_ERROR("zinf-comm-demo failed: {}", status.error().ToString());
  (void)session->Finalize();
  return status ? 0 : 1;
}
