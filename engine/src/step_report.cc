// The step's report: its figures over the ranks (FinishStep), rank 0's log line, live line on a
// terminal and metrics record (Report), and the end-of-run summary (LogSummary, LogPerNode).
#include "engine_impl.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "zinf/comm/timers.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/units.h"

namespace zinf::engine {

namespace {

using Json = nlohmann::json;
using comm::ReduceOp;

}  // namespace

// The end of Step, applied or skipped: the per-step figures (peak RSS and the slowest rank's
// times; swap bytes as the store counted them, summed over the ranks, over the whole step and
// within the optimizer step), the report, and the marks for the next step.
Result<StepInfo> ZeroEngine::Impl::FinishStep(
    StepInfo info, bool skipped, const storage::SwapStore::IoCounters& io_start,
    const storage::SwapStore::IoCounters& io_optimizer_start,
    const storage::SwapStore::IoCounters& io_optimizer_end, double optimizer_seconds) {
  State& s = *state_;
  const swapper::OptimizerSwapper& io = *s.swapper;
  if (skipped) {
    step_ = info.step;
    ++skipped_steps_;
    info.skipped = true;
  }
  info.skipped_steps = skipped_steps_;
  info.next_loss_scale = s.scaler->scale();
  const config::CheckpointConfig& cadence = config_.zinf.checkpoint;
  info.checkpoint_due =
      !cadence.dir.empty() &&
      (info.step % cadence.every == 0 || info.step == options_.total_steps || info.stop_requested);
  const double now = MonotonicSeconds();
  const double step_seconds = now - s.last_step_end;
  const storage::SwapStore::IoCounters io_end = io.io_counters();
  std::array<double, 3> maxima = {static_cast<double>(PeakRssBytes()), step_seconds,
                                  optimizer_seconds};
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<double>(maxima, ReduceOp::kMax));
  std::array<std::uint64_t, 8> bytes = {
      io_end.read_bytes - io_start.read_bytes,
      io_end.write_bytes - io_start.write_bytes,
      io_optimizer_end.read_bytes - io_optimizer_start.read_bytes,
      io_optimizer_end.write_bytes - io_optimizer_start.write_bytes,
      info.speculated,
      info.speculation_committed,
      info.speculation_redone,
      info.speculation_discarded};
  s.swap_bytes += bytes[2] + bytes[3];
  ZINF_RETURN_IF_ERROR(s.comm->AllreduceInPlace<std::uint64_t>(bytes, ReduceOp::kSum));
  info.speculated = bytes[4];
  info.speculation_committed = bytes[5];
  info.speculation_redone = bytes[6];
  info.speculation_discarded = bytes[7];
  info.peak_rss_bytes = static_cast<std::uint64_t>(maxima[0]);
  info.plan_bytes = s.plan_bytes;
  info.budget_bytes = s.budget_bytes;
  info.step_seconds = maxima[1];
  info.optimizer_seconds = maxima[2];
  info.swap_read_bytes = bytes[0];
  info.swap_write_bytes = bytes[1];
  info.optimizer_swap_read_bytes = bytes[2];
  info.optimizer_swap_write_bytes = bytes[3];
  const double numel = static_cast<double>(std::max<std::uint64_t>(s.total_numel, 1));
  info.read_bytes_per_element = static_cast<double>(bytes[2]) / numel;
  info.write_bytes_per_element = static_cast<double>(bytes[3]) / numel;
  ZINF_RETURN_IF_ERROR(Report(info));
  s.last_step_end = MonotonicSeconds();
  s.io_mark = io.io_counters();
  s.ReadAhead();  // the next step's first shards, while the loop loads its next batch
  return info;
}

// Rank 0: the log line every steps_per_print steps (and at total_steps), the live line on a
// terminal, and the metrics record. Collective only in agreeing on the metrics write.
Status ZeroEngine::Impl::Report(const StepInfo& info) {
  State& s = *state_;
  auto gbps = [&](std::uint64_t b) {
    return static_cast<double>(b) / std::max(info.optimizer_seconds, 1e-9) / 1e9;
  };
  const std::string total =
      options_.total_steps > 0 ? fmt::format("/{}", options_.total_steps) : std::string();
  const bool print =
      options_.progress && (info.step % config_.steps_per_print == 0 ||
                            info.step == options_.total_steps || info.stop_requested);
  if (s.tty) {
    const double now = MonotonicSeconds();
    if (print || now - s.last_tty_line >= 0.2) {
      s.last_tty_line = now;
      std::string eta;
      if (options_.total_steps > info.step && info.step >= s.first_step) {
        const double per_step =
            (now - s.loop_start) / static_cast<double>(info.step - s.first_step + 1);
        eta = fmt::format(", ETA {:.0f} s",
                          per_step * static_cast<double>(options_.total_steps - info.step));
      }
      std::fprintf(stderr, "\r[step %lld%s] loss %.4f, %.2f GB/s swap%s\033[K",
                   static_cast<long long>(info.step), total.c_str(), info.loss,
                   gbps(info.optimizer_swap_read_bytes + info.optimizer_swap_write_bytes),
                   eta.c_str());
      if (print) std::fprintf(stderr, "\r\033[K");
      std::fflush(stderr);
    }
  }
  if (info.skipped && options_.progress) {
    ZINF_LOG_INFO("step {}{}: fp16 overflow, step skipped (loss scale {} -> {}, {} skipped)",
                  info.step, total, info.loss_scale, info.next_loss_scale, info.skipped_steps);
  } else if (print) {
    std::string fp16;
    if (config_.fp16.enabled) {
      fp16 = fmt::format(" loss scale {} skipped {}", info.loss_scale, info.skipped_steps);
    }
    ZINF_LOG_INFO(
        "step {}{} loss {:.6f} lr {:.2e} time {:.3f} s swap read {:.2f} GB/s write "
        "{:.2f} GB/s ({:.2f} + {:.2f} B/element) peak RSS {} (plan {}){}{}",
        info.step, total, info.loss, info.lr, info.step_seconds,
        gbps(info.optimizer_swap_read_bytes), gbps(info.optimizer_swap_write_bytes),
        info.read_bytes_per_element, info.write_bytes_per_element, FormatBytes(info.peak_rss_bytes),
        FormatBytes(s.plan_bytes), fp16,
        info.clipped ? fmt::format(" (clipped, norm {:.3g})", info.grad_norm) : "");
  }
  if (config_.wall_clock_breakdown && print) {
    ZINF_RETURN_IF_ERROR(s.timers.LogSummary(*s.comm, "engine timers"));
  }
  Status written = OkStatus();
  if (s.metrics) {
    Json record = StepInfoJson(info);
    record["world_size"] = world_.size();
    written = storage::WriteAll(s.metrics.get(), record.dump() + "\n",
                                fmt::format("--metrics {}", options_.metrics_path));
  }
  return comm().AgreeOnStatus(written);
}

Status ZeroEngine::Impl::LogSummary() {
  State& s = *state_;
  if (closed_) return FailedPreconditionError("engine: LogSummary after Close");
  s.buckets->WaitIdle();
  ZINF_RETURN_IF_ERROR(comm().AgreeOnCall("LogSummary"));
  ZINF_RETURN_IF_ERROR(s.timers.LogSummary(*s.comm, "engine timers"));
  ZINF_RETURN_IF_ERROR(s.swapper->LogTimers());
  return LogPerNode();
}

// Rank 0 logs the swap bandwidth of every node (its ranks' bytes over their slowest optimizer
// time): on several hosts, the node with the slow disk stands out.
Status ZeroEngine::Impl::LogPerNode() {
  State& s = *state_;
  constexpr std::size_t kHostChars = 64;
  const comm::Topology& topo = world_.topology();
  std::string host = topo.hostname.substr(0, kHostChars - 1);
  host.resize(kHostChars, '\0');
  std::string hosts(kHostChars * static_cast<std::size_t>(world_.size()), '\0');
  ZINF_RETURN_IF_ERROR(s.comm->Allgather<char>(host, hosts));
  const std::array<double, 3> mine = {static_cast<double>(topo.node),
                                      static_cast<double>(s.swap_bytes), s.swap_seconds};
  std::vector<double> all(3 * static_cast<std::size_t>(world_.size()));
  ZINF_RETURN_IF_ERROR(s.comm->Allgather<double>(mine, all));
  if (world_.rank() != 0) return OkStatus();
  struct Node {
    std::string host;
    int ranks = 0;
    double bytes = 0, seconds = 0;
  };
  std::vector<Node> nodes(static_cast<std::size_t>(topo.num_nodes));
  for (int r = 0; r < world_.size(); ++r) {
    const auto ri = static_cast<std::size_t>(r);
    Node& n = nodes.at(static_cast<std::size_t>(all[3 * ri]));
    n.host = hosts.substr(kHostChars * ri, kHostChars).c_str();
    ++n.ranks;
    n.bytes += all[3 * ri + 1];
    n.seconds = std::max(n.seconds, all[3 * ri + 2]);
  }
  std::string table;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    table += fmt::format("\n  node {} ({}): {} rank(s), {} swapped in {:.2f} s: {:.2f} GB/s", i,
                         n.host, n.ranks, FormatBytes(static_cast<std::uint64_t>(n.bytes)),
                         n.seconds, n.bytes / std::max(n.seconds, 1e-9) / 1e9);
  }
  ZINF_LOG_INFO("swap read + write per node (over the optimizer steps):{}", table);
  return OkStatus();
}

}  // namespace zinf::engine
