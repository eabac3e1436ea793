// zinf-bench step: timed optimizer steps of one rank whose Adam state lives on disk, through the
// synchronous and/or the pipelined swapper, each timed step followed by the I/O backend alone
// moving the same bytes (read and written back, group by group through the pool's buffers);
// step_over_io is the median of the per-pair ratios. --state-bytes sets the parameter count (that
// many bytes of fp32 state: 12 per element); --state-format fp32,q8 runs both formats on the same
// parameters, alternating, for
// --rounds rounds. One JSON line per mode, format and round on stdout with --json. --path a,b
// stripes the store over several directories, --path-weights "1,3" or "probe" weights them
// (zinf.nvme_path_weights). --host-cache 0,0.25,0.5,0.75 keeps those fractions of the sub-groups
// in host memory (zinf.host_cache_bytes), one run each, and "cpu" all of them with no disk
// (offload_optimizer.device "cpu"); the JSON has the bytes each step moved.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "bench_state.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/partition/plan.h"
#include "zinf/storage/io_backend.h"
#include "zinf/storage/stripe_map.h"
#include "zinf/swapper/optimizer_swapper.h"

namespace zinf::bench {
namespace {

using swapper::OptimizerSwapper;
using swapper::StateFormat;

struct StepFlags {
  std::string state_bytes = "4G";
  std::string sub_group_size = "32M";
  std::vector<std::string> paths;  // striped, in order
  std::string path_weights;        // "": equal shares; "probe"; or ratios "1,3"
  std::string budget;              // pinned budget; empty: the mode's minimum
  bool pin_memory = false;         // mlock the pool (offload_optimizer.pin_memory)
  bool io_only = true;             // a backend-alone pass after each timed step
  bool pipeline = false;
  bool sync = false;
  bool json = false;
  int steps = 3;
  int warmup = 1;
  int threads = 0;
  AioFlags aio{.backend = "auto", .block_size = "1M", .queue_depth = 16,
               .intra_op_parallelism = 1};
  std::string stripe_unit = "1M";
  std::vector<std::string> state_formats = {"fp32"};
  // Host memory tier: fractions of the sub-groups kept resident (zinf.host_cache_bytes), each
  // run in turn; or "cpu": offload_optimizer.device "cpu", everything resident, no disk.
  std::vector<std::string> host_cache = {"0"};
  int rounds = 1;
};

// The backend alone: reads the slot tensors of every sub-group into all pool buffers and writes
// the same bytes back, group by group, through `backend` (registered with the pool). The state is
// unchanged, so the passes can alternate with the steps. Returns (read, write) seconds.
Result<std::pair<double, double>> IoOnly(OptimizerSwapper& swapper, storage::IoBackend& backend) {
  ZINF_ASSIGN_OR_RETURN(swapper::PoolLease lease, swapper.pool().AllocateAll(1));
  struct Item {
    std::string name;
    std::uint64_t bytes;
  };
  std::vector<Item> items;
  for (std::size_t i = 0; i < swapper.num_sub_groups(); ++i) {
    if (swapper.resident(i)) continue;  // the host tier: never on disk
    for (std::size_t t = 0; t < swapper.num_slot_tensors(); ++t) {
      items.push_back(
          {swapper.SlotTensorName(swapper.slot_of(i), t), swapper.SlotTensorIoBytes(i, t)});
    }
  }
  double seconds[2] = {0, 0};
  for (std::size_t first = 0; first < items.size(); first += lease.size()) {
    const std::size_t n = std::min(lease.size(), items.size() - first);
    for (int phase = 0; phase < 2; ++phase) {
      const double start = MonotonicSeconds();
      for (std::size_t k = 0; k < n; ++k) {
        const Item& item = items[first + k];
        std::span<std::byte> buffer = lease.bytes(k).first(item.bytes);
        Result<std::vector<std::uint64_t>> ids =
            phase == 0 ? swapper.store().SubmitReadRange(item.name, 0, item.bytes, buffer, backend)
                       : swapper.store().SubmitWriteRange(
                             item.name, 0, item.bytes,
                             std::span<const std::byte>(buffer.data(), buffer.size()), backend);
        if (!ids) {
          (void)backend.WaitAll();
          return std::move(ids).error();
        }
      }
      ZINF_RETURN_IF_ERROR(backend.WaitAll());
      seconds[phase] += MonotonicSeconds() - start;
    }
  }
  return std::make_pair(seconds[0], seconds[1]);
}

// --path-weights: "probe", or one relative bandwidth per path ("1,3"), as the store's weights.
Status SetPathWeights(const std::string& text, storage::SwapStoreOptions& store) {
  if (text.empty()) return OkStatus();
  if (text == "probe") {
    store.probe_path_weights = true;
    return OkStatus();
  }
  std::vector<double> ratios;
  for (std::size_t start = 0; start <= text.size();) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string word = text.substr(start, comma - start);
    double ratio = 0;
    const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), ratio);
    if (ec != std::errc() || end != word.data() + word.size()) {
      return InvalidArgumentError(fmt::format(
          "--path-weights: '{}' is not a number (give \"probe\" or e.g. \"1,3\")", word));
    }
    ratios.push_back(ratio);
    start = comma + 1;
  }
  if (ratios.size() != store.paths.size()) {
    return InvalidArgumentError(
        fmt::format("--path-weights: {} weights for {} paths", ratios.size(), store.paths.size()));
  }
  ZINF_ASSIGN_OR_RETURN(storage::StripeMap map,
                        Annotate(storage::StripeMap::FromRatios(ratios), "--path-weights: "));
  store.path_weights = map.weights();
  return OkStatus();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

// zinf.host_cache_bytes holding round(fraction x sub-groups) whole sub-groups of `numel`
// elements (their slot tensors 4 KiB-aligned: at least what the swapper counts).
std::uint64_t HostCacheBytes(double fraction, std::uint64_t numel, std::uint64_t sub_group_numel,
                             StateFormat format) {
  const std::uint64_t sub_groups = (numel + sub_group_numel - 1) / sub_group_numel;
  const auto resident =
      static_cast<std::uint64_t>(fraction * static_cast<double>(sub_groups) + 0.5);
  return resident * swapper::SubGroupStateBytes(sub_group_numel, format, 4096);
}

// --host-cache's fraction, or "cpu" (nullopt).
Result<std::optional<double>> ParseTier(const std::string& tier) {
  if (tier == "cpu") return std::optional<double>();
  double fraction = 0;
  const char* end = tier.data() + tier.size();
  if (std::from_chars(tier.data(), end, fraction).ptr != end || !(fraction >= 0) || fraction > 1) {
    return InvalidArgumentError(
        fmt::format("--host-cache '{}': expected fractions in [0, 1] or cpu", tier));
  }
  return std::optional<double>(fraction);
}

Result<nlohmann::json> RunMode(const comm::Communicator& world, const StepFlags& flags,
                               bool pipelined, StateFormat format, const std::string& tier) {
  ZINF_ASSIGN_OR_RETURN(std::uint64_t state_bytes, ParseBytes(flags.state_bytes));
  ZINF_ASSIGN_OR_RETURN(std::uint64_t sub_group_numel, ParseBytes(flags.sub_group_size));
  ZINF_ASSIGN_OR_RETURN(storage::IoBackendKind kind, storage::ParseIoBackendKind(flags.aio.backend));
  ZINF_ASSIGN_OR_RETURN(partition::PartitionPlan plan, FlatStatePlan(state_bytes, 1));
  const std::uint64_t numel = plan.layout().total_numel();
  swapper::SwapperOptions options;
  options.store.paths = flags.paths;
  ZINF_RETURN_IF_ERROR(SetPathWeights(flags.path_weights, options.store));
  options.store.job_id = fmt::format("bench-step-{}-{}-{}", getpid(), pipelined ? "pipe" : "sync",
                                     swapper::StateFormatName(format));
  options.state_format = format;
  ZINF_ASSIGN_OR_RETURN(options.store.stripe_unit_bytes, ParseBytes(flags.stripe_unit));
  ZINF_ASSIGN_OR_RETURN(options.aio.block_size, ParseBytes(flags.aio.block_size));
  options.aio.queue_depth = flags.aio.queue_depth;
  options.aio.intra_op_parallelism = flags.aio.intra_op_parallelism;
  options.backend = kind;
  options.sub_group_size = sub_group_numel;
  options.pipeline_read = pipelined;
  options.pipeline_write = pipelined;
  options.adam.threads = flags.threads;
  options.pin_memory = flags.pin_memory;
  if (!flags.budget.empty()) {
    ZINF_ASSIGN_OR_RETURN(options.pinned_budget_bytes, ParseBytes(flags.budget));
  }
  ZINF_ASSIGN_OR_RETURN(const std::optional<double> host_fraction, ParseTier(tier));
  if (!host_fraction) {
    options.all_resident = true;
  } else {
    options.host_cache_bytes = HostCacheBytes(*host_fraction, numel, sub_group_numel, format);
  }
  // The previous mode's pool is freed by now: without the reset, a q8 run after an fp32 run
  // (whose pool is a third larger) would report the fp32 run's peak as its own.
  const bool peak_rss_of_mode = ResetPeakRss();
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerSwapper> swapper,
                        swapper::CreateOptimizerSwapper(world, plan, options));
  const double init_start = MonotonicSeconds();
  ZINF_RETURN_IF_ERROR(swapper->Initialize([](std::uint64_t, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.01f);
    return OkStatus();
  }));
  const double init_seconds = MonotonicSeconds() - init_start;
  // The gradient is lent to the step as the backend lends its in-memory partition gradient (a
  // view, no copy): one sub-group's worth of it serves every sub-group.
  const std::vector<float> gradient(swapper->sub_groups().max_sub_group_numel(), 1e-3f);
  const swapper::GradientSource source = swapper::GradientSource::FromView(
      [&gradient](const partition::SubGroup& sg) -> Result<std::span<const float>> {
        return std::span<const float>(gradient).first(sg.numel);
      });
  const swapper::ParamSink sink = [](const partition::SubGroup&, std::span<const float>,
                                     std::span<const std::uint16_t>) { return OkStatus(); };
  // The backend alone moves what the step moves: nothing without swapped sub-groups.
  const bool io_only = flags.io_only && swapper->StateIoBytesPerStep() > 0;
  std::unique_ptr<storage::IoBackend> backend;
  if (io_only) {
    ZINF_ASSIGN_OR_RETURN(backend, storage::CreateIoBackend(kind, options.aio, flags.paths.front()));
    ZINF_RETURN_IF_ERROR(backend->RegisterBuffers(swapper->pool().AllBuffers()));
  }
  std::int64_t step = 0;
  for (int w = 0; w < flags.warmup; ++w) ZINF_RETURN_IF_ERROR(swapper->Step(++step, source, sink));
  swapper->timers().Reset();
  // Each timed step is followed by the backend alone moving the same bytes: the ratio of each
  // pair compares the two under the same disk conditions (the disk drifts by 15-30%).
  std::vector<double> step_seconds, io_seconds, read_seconds, write_seconds, ratios;
  std::uint64_t peak_rss = 0;
  for (int s = 0; s < flags.steps; ++s) {
    const double start = MonotonicSeconds();
    ZINF_RETURN_IF_ERROR(swapper->Step(++step, source, sink));
    step_seconds.push_back(MonotonicSeconds() - start);
    peak_rss = std::max(peak_rss, PeakRssBytes());  // before the I/O-only pass, same pool
    if (!io_only) continue;
    ZINF_ASSIGN_OR_RETURN(auto io, IoOnly(*swapper, *backend));
    read_seconds.push_back(io.first);
    write_seconds.push_back(io.second);
    io_seconds.push_back(io.first + io.second);
    ratios.push_back(step_seconds.back() / io_seconds.back());
  }
  const double seconds_per_step = Median(step_seconds);
  ZINF_RETURN_IF_ERROR(swapper->LogTimers(fmt::format("step bench ({})", swapper->mode_name())));
  const std::uint64_t io_bytes = swapper->StateIoBytesPerStep();
  nlohmann::json out = {
      {"bench", "step"},
      {"mode", std::string(swapper->mode_name())},
      {"state_format", std::string(swapper::StateFormatName(format))},
      {"bytes_per_element", swapper->StateIoBytesPerElement()},
      {"state_bytes", numel * kStateBytesPerElement},
      {"numel", numel},
      {"sub_group_numel", swapper->sub_groups().max_sub_group_numel()},
      {"sub_groups", swapper->num_sub_groups()},
      {"pool_bytes", swapper->pool().total_bytes()},
      {"pool_buffers", swapper->pool().buffer_count()},
      {"steps", flags.steps},
      {"seconds_per_step", seconds_per_step},
      {"step_seconds", step_seconds},
      {"io_only_pass_seconds", io_seconds},
      {"read_bytes", io_bytes},
      {"write_bytes", io_bytes},
      {"io_only_seconds", Median(io_seconds)},
      {"io_only_read_seconds", Median(read_seconds)},
      {"io_only_write_seconds", Median(write_seconds)},
      {"step_over_io", Median(ratios)},
      {"initialize_seconds", init_seconds},
      {"adam_seconds_per_step", swapper->timers().Elapsed("optimizer_step") / flags.steps},
      {"peak_rss_bytes", peak_rss},
      {"peak_rss_scope", peak_rss_of_mode ? "mode" : "process"},
      // The gradient is the caller's memory (the backend's partition gradient), not the swapper's.
      {"gradient_bytes", gradient.size() * sizeof(float)},
      {"peak_rss_minus_pool_bytes", static_cast<std::int64_t>(peak_rss) -
                                        static_cast<std::int64_t>(swapper->pool().total_bytes() +
                                                                  gradient.size() * sizeof(float))},
      {"host_cache", tier},
      {"host_cache_bytes", options.host_cache_bytes},
      {"resident_sub_groups", swapper->num_resident()},
      {"bytes_moved_per_step", 2 * io_bytes},
  };
  if (swapper->has_store()) {
    out["direct"] = swapper->store().direct();
    out["paths"] = swapper->store().options().paths;
    out["path_weights"] = swapper->store().stripe_map().weights();
  }
  ZINF_RETURN_IF_ERROR(swapper->Close());
  return out;
}

int RunStep(const StepFlags& flags) {
  // A bad --host-cache is a usage error before anything runs (the sizes are CLI checks).
  for (const std::string& tier : flags.host_cache) {
    if (Result<std::optional<double>> parsed = ParseTier(tier); !parsed) {
      std::fprintf(stderr, "zinf-bench step: %s\n", parsed.error().message().c_str());
      return 2;
    }
  }
  // MPI singleton init: the swapper's collectives work on one rank without mpirun.
  Result<comm::MpiSession> session = comm::MpiSession::Init(nullptr, nullptr);
  if (!session) {
    std::fprintf(stderr, "zinf-bench step: %s\n", session.error().ToString().c_str());
    return 1;
  }
  std::vector<bool> modes;
  if (flags.sync || !flags.pipeline) modes.push_back(false);
  if (flags.pipeline || !flags.sync) modes.push_back(true);
  std::vector<StateFormat> formats;
  for (const std::string& name : flags.state_formats) {
    formats.push_back(name == "q8" ? StateFormat::kQ8 : StateFormat::kFp32);
  }
  int rc = 0;
  for (int round = 1; round <= flags.rounds; ++round) {
    for (bool pipelined : modes) {
      for (StateFormat format : formats) {
        for (const std::string& tier : flags.host_cache) {
          Result<nlohmann::json> result = RunMode(session->world(), flags, pipelined, format, tier);
          if (!result) {
            std::fprintf(stderr, "zinf-bench step (%s, %s, host cache %s): %s\n",
                         pipelined ? "pipelined" : "sync",
                         std::string(swapper::StateFormatName(format)).c_str(), tier.c_str(),
                         result.error().ToString().c_str());
            rc = 1;
            continue;
          }
          (*result)["round"] = round;
          if (flags.json) {
            std::printf("%s\n", result->dump().c_str());
          } else {
            std::printf(
                "%s %s: %.3f s/step (I/O alone %.3f s: %.2fx), %s read + written per step (%.2f "
                "bytes per element each way), peak RSS %s (pool %s)\n",
                (*result)["mode"].get<std::string>().c_str(),
                (*result)["state_format"].get<std::string>().c_str(),
                (*result)["seconds_per_step"].get<double>(),
                (*result)["io_only_seconds"].get<double>(), (*result)["step_over_io"].get<double>(),
                FormatBytes((*result)["read_bytes"].get<std::uint64_t>()).c_str(),
                (*result)["bytes_per_element"].get<double>(),
                FormatBytes((*result)["peak_rss_bytes"].get<std::uint64_t>()).c_str(),
                FormatBytes((*result)["pool_bytes"].get<std::uint64_t>()).c_str());
          }
          std::fflush(stdout);
        }
      }
    }
  }
  Status finalized = session->Finalize();
  if (!finalized) rc = 1;
  return rc;
}

const bool kRegistered = RegisterBenchCommand(
    "step", "timed optimizer steps with the state on disk (sync and pipelined swapper)",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<StepFlags>();
      app.add_option("--host-cache", flags->host_cache,
                     "host memory tier: fractions of the sub-groups kept resident "
                     "(zinf.host_cache_bytes), e.g. 0,0.25,0.5,0.75, run in turn; or cpu "
                     "(offload_optimizer.device \"cpu\": all resident, no disk)")
          ->delimiter(',')
          ->capture_default_str();
      app.add_option("--path", flags->paths,
                     "swap directory (node-local NVMe), or several separated by commas (striped)")
          ->delimiter(',')
          ->required();
      app.add_option("--path-weights", flags->path_weights,
                     "zinf.nvme_path_weights: each path's relative bandwidth (\"1,3\"), or "
                     "\"probe\" (measured at open); default: equal shares");
      app.add_option("--state-bytes", flags->state_bytes,
                     "the parameter count, as bytes of fp32 state (12 per element), e.g. 4G")
          ->capture_default_str()
          ->check(SizeIn(kStateBytesPerElement));
      app.add_option("--state-format", flags->state_formats,
                     "fp32, q8, or both (fp32,q8: alternating on the same parameters)")
          ->delimiter(',')
          ->capture_default_str()
          ->check(OneOf(swapper::kStateFormatNames));
      app.add_option("--rounds", flags->rounds, "repeat the modes and formats this many times")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000));
      app.add_option("--sub-group-size", flags->sub_group_size,
                     "elements per sub-group, e.g. 32M (binary multiples)")
          ->capture_default_str()
          ->check(SizeIn(1));
      app.add_option("--budget", flags->budget,
                     "zinf.pinned_budget_bytes (default: 4 buffers sync, 10 pipelined; q8: 3, 7)")
          ->check(SizeIn(1));
      app.add_flag("!--no-io-only", flags->io_only,
                   "skip the backend-alone pass after each timed step (it doubles the disk "
                   "traffic: for comparisons with tools that do not run one)");
      app.add_flag("--pin-memory", flags->pin_memory,
                   "mlock the pool (offload_optimizer.pin_memory, as DeepSpeed's swappers do)");
      app.add_flag("--pipeline", flags->pipeline, "run the pipelined swapper");
      app.add_flag("--sync", flags->sync, "run the synchronous swapper (neither flag: both)");
      app.add_flag("--json", flags->json, "one JSON object per mode on stdout");
      app.add_option("--steps", flags->steps,
                     "timed steps, each followed by a backend-alone pass over the same bytes")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000));
      app.add_option("--warmup", flags->warmup, "untimed steps first")
          ->capture_default_str()
          ->check(CLI::Range(0, 1000));
      app.add_option("--threads", flags->threads, "CPU Adam threads (0: all cores)")
          ->capture_default_str()
          ->check(CLI::Range(0, 1024));
      AddAioFlags(app, flags->aio);
      app.add_option("--stripe-unit", flags->stripe_unit, "swap store stripe unit")
          ->capture_default_str()
          ->check(SizeIn(1));
      return [flags] { return RunStep(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
