// zinf-bench offload-param: a synthetic model trained through ZeroEngine at ZeRO stage 3 (run it
// under mpirun), in three modes measured side by side, their order rotated each round:
//   offload  stage 3, parameters registered without weights, offload_param and offload_optimizer
//            nvme on --path, the gradient on disk too (zinf.swap_gradients, read-add-write):
//            nothing of the model stays in memory;
//   memory   the same model and loop with offload_param and offload_optimizer "cpu": the
//            compute, the gathers and Adam with no disk;
//   io       the offload mode without the compute (no sgemm, a constant gradient): the disk
//            and the collectives alone, moving the same bytes.
// The model: --layers layers of x <- tanh(x W + b), W [hidden, hidden] row-major, on a fixed
// batch of --batch rows per rank, loss 0.5 * mean over the batch of |x - target|^2, AdamW at lr
// 2e-5 (Adam moves each of a layer's hidden inputs by about lr per step, so a larger lr moves
// the pre-activations by hidden x lr and the loss diverges). The loop
// gathers each layer around its forward and again around its backward (W for the input's
// gradient) and hands each gradient as soon as it has it, last layer first.
// Reported per mode and round (JSON with --json): the median step time and its parts (time in
// Gather calls, in the loop's compute, in the optimizer step), the shards read from disk, the
// loss of the first and the last step, and the peak RSS (largest rank). Per round:
// offload / max(memory, io), the issue's ratio.
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#if __has_include(<cblas.h>)
#include <cblas.h>
#define ZINF_BENCH_HAVE_CBLAS 1
#else
#define ZINF_BENCH_HAVE_CBLAS 0
#endif

#include "bench_command.h"
#include "zinf/comm/mpi_session.h"
#include "zinf/core/log.h"
#include "zinf/core/process_stats.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/config/config.h"
#include "zinf/engine/engine.h"

namespace zinf::bench {
namespace {

using engine::Gathered;
using engine::ZeroEngine;

struct ParamFlags {
  std::string path;
  int layers = 16;
  int hidden = 2048;
  int batch = 8;
  int steps = 3;
  int rounds = 1;
  std::string sub_group_size = "2M";
  std::vector<std::string> modes = {"offload", "memory", "io"};
  bool json = false;
};

// C = A * B (or with A / B transposed) + beta * C, row-major.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, const float* a, const float* b,
          float beta, float* c) {
  const int lda = trans_a ? m : k, ldb = trans_b ? k : n;
#if ZINF_BENCH_HAVE_CBLAS
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, n);
#else
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float sum = 0;
      for (int p = 0; p < k; ++p) {
        sum += (trans_a ? a[std::size_t(p) * lda + i] : a[std::size_t(i) * lda + p]) *
               (trans_b ? b[std::size_t(j) * ldb + p] : b[std::size_t(p) * ldb + j]);
      }
      c[std::size_t(i) * n + j] = sum + beta * c[std::size_t(i) * n + j];
    }
  }
#endif
}

// Deterministic values in [-1, 1) from (seed, k).
float Uniform(std::uint64_t seed, std::uint64_t k) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + k + 0x632be59bd9b4e5d4ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

std::string ConfigText(const ParamFlags& f, const std::string& mode, const std::string& swap,
                       int world, std::uint64_t sub_group) {
  const std::uint64_t layer = std::uint64_t(f.hidden) * f.hidden;
  const bool disk = mode != "memory";
  const std::string offload = disk ? fmt::format(R"({{"device": "nvme", "nvme_path": "{}"}})", swap)
                                   : R"({"device": "cpu"})";
  return fmt::format(
      R"({{
    "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000000,
    "optimizer": {{"type": "AdamW", "params": {{"lr": 2e-5}}}},
    "zero_optimization": {{
      "stage": 3, "sub_group_size": {}, "reduce_bucket_size": {}, "allgather_bucket_size": {},
      "offload_optimizer": {},
      "offload_param": {},
      "stage3_prefetch_bucket_size": {}, "stage3_max_live_parameters": {},
      "stage3_param_persistence_threshold": {}}},
    "zinf": {{"swap_gradients": {}, "job_id": "offload-param-{}-{}"}}
  }})",
      sub_group, layer, layer, offload,
      disk ? fmt::format(R"({{"device": "nvme", "nvme_path": "{}", "max_in_cpu": 0}})", swap)
           : R"({"device": "cpu"})",
      2 * layer, 4 * (layer + f.hidden), f.hidden, disk ? "true" : "false", mode, world);
}

struct ModeResult {
  std::vector<double> step, gather, compute, optimizer;
  double loss_first = 0, loss_last = 0;
  // Gather's counters over the timed steps (after the warm-up).
  std::uint64_t disk_reads = 0, read_ahead = 0, disk_waits = 0, prefetched = 0, peak_rss = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

Result<ModeResult> RunMode(const comm::Communicator& world, const ParamFlags& f,
                           const std::string& mode) {
  ZINF_ASSIGN_OR_RETURN(std::uint64_t sub_group, ParseBytes(f.sub_group_size));
  ZINF_ASSIGN_OR_RETURN(
      config::Config config,
      config::ParseConfig(ConfigText(f, mode, f.path, world.size(), sub_group / sizeof(float)),
                          config::ContextOf(world)));
  const int h = f.hidden, b = f.batch, layers = f.layers;
  const std::size_t hh = std::size_t(h) * h;
  std::vector<engine::Param> params;
  for (int l = 0; l < layers; ++l) {
    const float bound = std::sqrt(3.0f / static_cast<float>(h));
    params.push_back({.name = fmt::format("layer{}.weight", l),
                      .shape = {h, h},
                      .init = [l, bound](std::uint64_t offset, std::span<float> out) {
                        for (std::size_t k = 0; k < out.size(); ++k) {
                          out[k] = bound * Uniform(std::uint64_t(l) + 1, offset + k);
                        }
                        return OkStatus();
                      }});
    params.push_back({.name = fmt::format("layer{}.bias", l),
                      .shape = {h},
                      .init = [](std::uint64_t, std::span<float> out) {
                        std::fill(out.begin(), out.end(), 0.0f);
                        return OkStatus();
                      }});
  }
  ResetPeakRss();
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<ZeroEngine> engine,
                        ZeroEngine::Create(world, config, std::move(params),
                                           {.progress = false,
                                            .stop_signals = false,
                                            .create_nvme_paths = true,
                                            .gradient_memory_limit_bytes = 0}));
  // The loop's memory: activations of every layer, one layer's gradient.
  std::vector<std::vector<float>> x(std::size_t(layers) + 1,
                                    std::vector<float>(std::size_t(b) * h));
  std::vector<float> target(std::size_t(b) * h), d(std::size_t(b) * h), dz(std::size_t(b) * h),
      dw(hh), db(static_cast<std::size_t>(h));
  for (std::size_t k = 0; k < x[0].size(); ++k) {
    x[0][k] = Uniform(1000 + world.rank(), k);
    target[k] = 0.5f * Uniform(2000 + world.rank(), k);
  }
  const bool compute = mode != "io";
  ModeResult result;
  engine::GatherCounters warm;
  for (int step = 0; step <= f.steps; ++step) {  // step 0: warm-up (records the order)
    double gather = 0, work = 0;
    const double start = MonotonicSeconds();
    auto timed_gather = [&](std::vector<std::size_t> which) -> Result<Gathered> {
      const double t = MonotonicSeconds();
      Result<Gathered> g = engine->GatherByIndex(which);
      gather += MonotonicSeconds() - t;
      return g;
    };
    for (int l = 0; l < layers; ++l) {
      ZINF_ASSIGN_OR_RETURN(Gathered layer,
                            timed_gather({std::size_t(2 * l), std::size_t(2 * l + 1)}));
      const double t = MonotonicSeconds();
      if (compute) {
        for (int r = 0; r < b; ++r)
          std::copy_n(layer[1].data(), h, x[l + 1].data() + std::size_t(r) * h);
        Gemm(false, false, b, h, h, x[l].data(), layer[0].data(), 1.0f, x[l + 1].data());
        for (float& v : x[l + 1]) v = std::tanh(v);
      }
      work += MonotonicSeconds() - t;
    }
    double loss = 0;
    for (std::size_t k = 0; k < d.size(); ++k) {
      const double diff = double(x[layers][k]) - target[k];
      loss += 0.5 * diff * diff / b;
      d[k] = static_cast<float>(diff / b);
    }
    for (int l = layers - 1; l >= 0; --l) {
      const double t = MonotonicSeconds();
      if (compute) {
        for (std::size_t k = 0; k < dz.size(); ++k) dz[k] = d[k] * (1 - x[l + 1][k] * x[l + 1][k]);
        Gemm(true, false, h, h, b, x[l].data(), dz.data(), 0.0f, dw.data());
        std::fill(db.begin(), db.end(), 0.0f);
        for (int r = 0; r < b; ++r) {
          for (int j = 0; j < h; ++j) db[j] += dz[std::size_t(r) * h + j];
        }
      } else {
        std::fill(dw.begin(), dw.end(), 1e-3f);
        std::fill(db.begin(), db.end(), 1e-3f);
      }
      work += MonotonicSeconds() - t;
      if (l > 0) {
        ZINF_ASSIGN_OR_RETURN(Gathered layer, timed_gather({std::size_t(2 * l)}));
        const double t2 = MonotonicSeconds();
        if (compute) Gemm(false, true, b, h, h, dz.data(), layer[0].data(), 0.0f, d.data());
        work += MonotonicSeconds() - t2;
      }
      ZINF_RETURN_IF_ERROR(engine->GradientReady(std::size_t(2 * l), dw));
      ZINF_RETURN_IF_ERROR(engine->GradientReady(std::size_t(2 * l + 1), db));
    }
    ZINF_ASSIGN_OR_RETURN(engine::StepInfo info, engine->Step(loss));
    if (step == 0) {
      warm = engine->gather_counters();
      continue;
    }
    result.step.push_back(MonotonicSeconds() - start);
    result.gather.push_back(gather);
    result.compute.push_back(work);
    result.optimizer.push_back(info.optimizer_seconds);
    if (step == 1) result.loss_first = info.loss;
    result.loss_last = info.loss;
    result.peak_rss = info.peak_rss_bytes;
  }
  const engine::GatherCounters& c = engine->gather_counters();
  result.disk_reads = c.disk_reads - warm.disk_reads;
  result.read_ahead = c.read_ahead - warm.read_ahead;
  result.disk_waits = c.disk_waits - warm.disk_waits;
  result.prefetched = c.prefetched - warm.prefetched;
  ZINF_RETURN_IF_ERROR(engine->Close());
  return result;
}

int RunParam(const ParamFlags& f) {
  // As a training loop does (examples/cpp): the gradient buckets reduce on the engine's worker
  // thread, overlapping the backward pass.
  Result<comm::MpiSession> session =
      comm::MpiSession::Init(nullptr, nullptr, comm::ThreadLevel::kSerialized);
  if (!session) {
    std::fprintf(stderr, "zinf-bench offload-param: %s\n", session.error().ToString().c_str());
    return 1;
  }
  const comm::Communicator& world = session->world();
  const std::uint64_t numel =
      std::uint64_t(f.layers) * (std::uint64_t(f.hidden) * f.hidden + f.hidden);
  ZINF_LOG_INFO(
      "offload-param: {} layers of {} x {}: {} parameters ({} of fp32 weights) on {} rank(s)",
      f.layers, f.hidden, f.hidden, numel, FormatBytes(numel * 4), world.size());
  for (int round = 0; round < f.rounds; ++round) {
    std::map<std::string, double> medians;
    for (std::size_t i = 0; i < f.modes.size(); ++i) {
      const std::string& mode = f.modes[(i + round) % f.modes.size()];
      Result<ModeResult> r = RunMode(world, f, mode);
      // Give the mode's freed memory back, so that the next one's peak RSS starts from the
      // process alone.
      malloc_trim(0);
      if (!r) {
        ZINF_LOG_ERROR("offload-param: mode {}: {}", mode, r.error().ToString());
        return 1;
      }
      const double step = Median(r->step);
      medians[mode] = step;
      const nlohmann::json out = {{"bench", "offload-param"},
                                  {"mode", mode},
                                  {"round", round},
                                  {"ranks", world.size()},
                                  {"layers", f.layers},
                                  {"hidden", f.hidden},
                                  {"batch", f.batch},
                                  {"params", numel},
                                  {"weights_bytes", numel * 4},
                                  {"step_seconds", step},
                                  {"gather_seconds", Median(r->gather)},
                                  {"compute_seconds", Median(r->compute)},
                                  {"optimizer_seconds", Median(r->optimizer)},
                                  {"disk_reads", r->disk_reads},
                                  {"read_ahead", r->read_ahead},
                                  {"disk_waits", r->disk_waits},
                                  {"prefetched", r->prefetched},
                                  {"loss_first", r->loss_first},
                                  {"loss_last", r->loss_last},
                                  {"peak_rss_bytes", r->peak_rss}};
      if (world.rank() == 0) {
        if (f.json) {
          fmt::print("{}\n", out.dump());
        } else {
          fmt::print(
              "round {} {:8s} step {:.3f} s (gather {:.3f}, compute {:.3f}, optimizer "
              "{:.3f}); loss {:.5f} -> {:.5f}; peak RSS {}; shard reads {} (read ahead {}, "
              "waited for {})\n",
              round, mode, step, Median(r->gather), Median(r->compute), Median(r->optimizer),
              r->loss_first, r->loss_last, FormatBytes(r->peak_rss), r->disk_reads, r->read_ahead,
              r->disk_waits);
        }
        std::fflush(stdout);
      }
    }
    if (world.rank() == 0 && medians.count("offload") && medians.count("memory") &&
        medians.count("io")) {
      const double ratio = medians["offload"] / std::max(medians["memory"], medians["io"]);
      if (f.json) {
        fmt::print("{}\n", nlohmann::json({{"bench", "offload-param"},
                                           {"round", round},
                                           {"offload_over_max_memory_io", ratio}})
                               .dump());
      } else {
        fmt::print("round {}: offload / max(memory, io) = {:.2f}\n", round, ratio);
      }
    }
  }
  return 0;
}

const bool kRegistered = RegisterBenchCommand(
    "offload-param",
    "stage 3 with offload_param nvme against the same model in memory and the I/O alone (mpirun)",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<ParamFlags>();
      app.add_option("--path", flags->path, "swap directory (created)")->required();
      app.add_option("--layers", flags->layers, "layers")->check(CLI::Range(1, 4096));
      app.add_option("--hidden", flags->hidden, "width of each layer")->check(CLI::Range(1, 65536));
      app.add_option("--batch", flags->batch, "rows per rank")->check(CLI::Range(1, 65536));
      app.add_option("--steps", flags->steps, "timed steps per mode (after one warm-up)")
          ->check(CLI::Range(1, 1000));
      app.add_option("--rounds", flags->rounds, "rounds, the mode order rotated each")
          ->check(CLI::Range(1, 100));
      app.add_option("--sub-group-size", flags->sub_group_size, "bytes of fp32 per sub-group")
          ->check(SizeIn(sizeof(float)));
      app.add_option("--modes", flags->modes, "offload, memory, io")
          ->delimiter(',')
          ->check(CLI::IsMember({"offload", "memory", "io"}));
      app.add_flag("--json", flags->json, "one JSON object per mode and round on stdout");
      return [flags] { return RunParam(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
