// zinf-bench adam: throughput of the fused CPU Adam against this machine's STREAM triad.
//
//   zinf-bench adam --numel 64M --threads 2 [--steps 10] [--simd auto|scalar|avx2|avx512]
//                   [--state-format fp32|q8] [--json]
//
// Adam bytes: 28 per element (reads param, grad, exp_avg, exp_avg_sq = 16; writes param,
// exp_avg, exp_avg_sq = 12); q8 (CpuAdam::StepQ8, 8-bit moments): 16 per element (reads param,
// grad = 8 and two codes; writes param and two codes; the per-block scales, 8 bytes per 2048
// elements, are not counted). Triad a[i] = b[i] + s * c[i] with STREAM's counting (24 bytes per
// element, write-allocate not counted), arrays of max(128 MiB, 4 x L3) each, the same thread
// count, best of several runs. roofline_fraction = adam gb_per_s / triad_gb_per_s. Both report
// the best repetition; page faults are taken before timing (every array is written once).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/swapper/cpu_adam.h"
#include "zinf/swapper/q8.h"

namespace zinf::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct AdamFlags {
  std::string numel = "64M";
  int threads = 0;
  int steps = 10;
  std::string simd = "auto";
  std::string state_format = "fp32";
  bool json = false;
  int triad_mib = 0;  // 0: max(128 MiB, 4 x L3)
  int triad_reps = 6;
};

// Page-aligned (2 MiB, for transparent huge pages) float array, freed with free().
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using HugeArray = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
HugeArray<T> AllocHuge(std::size_t count) {
  constexpr std::size_t kHuge = 2 * kMiB;
  const std::size_t bytes = std::max(kHuge, (count * sizeof(T) + kHuge - 1) / kHuge * kHuge);
  void* p = std::aligned_alloc(kHuge, bytes);
  if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
  return HugeArray<T>(static_cast<T*>(p));
}

// Runs fn(begin, end) over [0, n) split into `threads` contiguous slices, in parallel.
template <typename Fn>
void ParallelSlices(std::size_t n, int threads, Fn fn) {
  std::vector<std::thread> team;
  const std::size_t t_count = static_cast<std::size_t>(threads);
  for (std::size_t t = 1; t < t_count; ++t) {
    team.emplace_back([=] { fn(n * t / t_count, n * (t + 1) / t_count); });
  }
  fn(0, n / t_count);
  for (std::thread& t : team) t.join();
}

std::size_t L3Bytes() {
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<std::size_t>(l3);
  std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string text;
  if (in >> text) {
    if (auto bytes = ParseBytes(text)) return static_cast<std::size_t>(*bytes);
  }
  return 32 * kMiB;
}

// Compiled for the widest vectors available, like STREAM built with -O3 -march=native.
__attribute__((target_clones("avx512f", "avx2", "default"))) void TriadSlice(
    float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

struct TriadResult {
  double gb_per_s = 0;
  double seconds = 0;
  std::size_t array_bytes = 0;
};

// STREAM triad with a persistent team: each repetition starts and ends on a barrier.
TriadResult MeasureTriad(std::size_t array_bytes, int threads, int reps) {
  const std::size_t n = array_bytes / sizeof(float);
  HugeArray<float> a = AllocHuge<float>(n), b = AllocHuge<float>(n), c = AllocHuge<float>(n);
  if (!a || !b || !c) return {};
  const std::size_t t_count = static_cast<std::size_t>(threads);
  ParallelSlices(n, threads, [&](std::size_t lo, std::size_t hi) {
    std::fill(a.get() + lo, a.get() + hi, 0.0f);
    std::fill(b.get() + lo, b.get() + hi, 1.0f);
    std::fill(c.get() + lo, c.get() + hi, 2.0f);
  });
  std::barrier sync(threads);
  std::vector<double> seconds(static_cast<std::size_t>(reps));
  auto member = [&](std::size_t t) {
    const std::size_t lo = n * t / t_count, hi = n * (t + 1) / t_count;
    for (int r = 0; r < reps; ++r) {
      sync.arrive_and_wait();
      const auto start = Clock::now();
      TriadSlice(a.get(), b.get(), c.get(), 3.0f, lo, hi);
      sync.arrive_and_wait();
      if (t == 0) {
        seconds[static_cast<std::size_t>(r)] =
            std::chrono::duration<double>(Clock::now() - start).count();
      }
    }
  };
  std::vector<std::thread> team;
  for (std::size_t t = 1; t < t_count; ++t) team.emplace_back(member, t);
  member(0);
  for (std::thread& t : team) t.join();
  // The first repetition is a warm-up.
  const double best = *std::min_element(seconds.begin() + (reps > 1 ? 1 : 0), seconds.end());
  return {.gb_per_s = 24.0 * static_cast<double>(n) / best / 1e9,
          .seconds = best,
          .array_bytes = n * sizeof(float)};
}

int RunAdam(const AdamFlags& flags) {
  auto fail = [](const std::string& what, int code = 1) {
    std::fprintf(stderr, "zinf-bench adam: %s\n", what.c_str());
    return code;
  };
  Result<std::uint64_t> numel_or = ParseBytes(flags.numel);  // "64M" = 64 * 2^20 elements
  if (!numel_or) return fail("--numel: " + numel_or.error().message(), 2);
  Result<swapper::SimdPath> simd_or = swapper::ParseSimdPath(flags.simd);
  if (!simd_or) return fail("--simd: " + simd_or.error().message(), 2);
  if (flags.steps < 1 || flags.triad_reps < 1 || flags.triad_mib < 0) {
    return fail("--steps and --triad-reps must be >= 1, --triad-mib >= 0", 2);
  }
  const bool q8 = flags.state_format == "q8";
  const double bytes_per_element = q8 ? 16.0 : 28.0;
  const std::size_t n = static_cast<std::size_t>(*numel_or);

  Result<swapper::CpuAdam> adam_or =
      swapper::CpuAdam::Create({.threads = flags.threads, .simd = *simd_or});
  if (!adam_or) return fail(adam_or.error().ToString());
  swapper::CpuAdam& adam = *adam_or;
  const int threads = adam.threads();

  // q8: the moments' codes live in the first quarter of the exp_avg/exp_avg_sq arrays.
  const std::size_t blocks = swapper::q8::NumBlocks(n);
  HugeArray<float> param = AllocHuge<float>(n), grad = AllocHuge<float>(n),
                   exp_avg = AllocHuge<float>(q8 ? n / 4 + 1 : n),
                   exp_avg_sq = AllocHuge<float>(q8 ? n / 4 + 1 : n),
                   scales = AllocHuge<float>(2 * blocks + 1);
  if (!param || !grad || !exp_avg || !exp_avg_sq || !scales) {
    return fail("cannot allocate " + FormatBytes(16 * n) + " of optimizer state");
  }
  ParallelSlices(n, threads, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      param[i] = 0.01f * static_cast<float>(static_cast<int>(i % 2001) - 1000);
      grad[i] = 1e-4f * static_cast<float>(static_cast<int>(i % 977) - 488);
    }
    if (!q8) {
      std::fill(exp_avg.get() + lo, exp_avg.get() + hi, 0.0f);
      std::fill(exp_avg_sq.get() + lo, exp_avg_sq.get() + hi, 0.0f);
    }
  });
  const std::span<float> p(param.get(), n), m(exp_avg.get(), n), v(exp_avg_sq.get(), n);
  const std::span<const float> g(grad.get(), n);
  const swapper::Q8Moment qm = {{reinterpret_cast<std::uint8_t*>(exp_avg.get()), n},
                                {scales.get(), blocks}};
  const swapper::Q8Moment qv = {{reinterpret_cast<std::uint8_t*>(exp_avg_sq.get()), n},
                                {scales.get() + blocks, blocks}};
  if (q8) {
    using swapper::q8::MapKind;
    std::fill(qm.codes.begin(), qm.codes.end(), swapper::q8::ZeroCode(MapKind::kSigned));
    std::fill(qv.codes.begin(), qv.codes.end(), swapper::q8::ZeroCode(MapKind::kUnsigned));
    std::fill(scales.get(), scales.get() + 2 * blocks, 0.0f);
  }
  auto step_once = [&](int step) {
    return q8 ? adam.StepQ8(step, p, g, qm, qv) : adam.Step(step, p, g, m, v);
  };
  // Step 1 is a warm-up (page faults, thread wake-up).
  if (Status s = step_once(1); !s) return fail(s.error().ToString());
  double best = 1e300, total = 0;
  for (int step = 2; step < 2 + flags.steps; ++step) {
    const auto start = Clock::now();
    if (Status s = step_once(step); !s) return fail(s.error().ToString());
    const double sec = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::min(best, sec);
    total += sec;
  }
  param.reset();
  grad.reset();
  exp_avg.reset();
  exp_avg_sq.reset();
  scales.reset();

  std::size_t triad_bytes = std::max<std::size_t>(128 * kMiB, 4 * L3Bytes());
  if (flags.triad_mib > 0) triad_bytes = static_cast<std::size_t>(flags.triad_mib) * kMiB;
  const TriadResult triad = MeasureTriad(triad_bytes, threads, flags.triad_reps);
  if (triad.gb_per_s == 0)
    return fail("cannot allocate the triad arrays (3 x " + FormatBytes(triad_bytes) +
                "); try --triad-mib");

  const double elements_per_s = static_cast<double>(n) / best;
  const double gb_per_s = bytes_per_element * elements_per_s / 1e9;
  nlohmann::json out = {
      {"bench", "adam"},
      {"numel", n},
      {"threads", threads},
      {"simd", std::string(swapper::SimdPathName(adam.simd_path()))},
      {"state_format", flags.state_format},
      {"bytes_per_element", bytes_per_element},
      {"steps", flags.steps},
      {"seconds", best},
      {"seconds_mean", total / flags.steps},
      {"elements_per_s", elements_per_s},
      {"gb_per_s", gb_per_s},
      {"triad_gb_per_s", triad.gb_per_s},
      {"triad_array_bytes", triad.array_bytes},
      {"roofline_fraction", gb_per_s / triad.gb_per_s},
  };
  if (flags.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf(
        "adam: numel %zu, state %s, %d threads, simd %s: best step %.4f s (mean %.4f s), "
        "%.3g elements/s, %.2f GB/s (%.0f B/element)\n"
        "triad: 3 x %s, %d threads: %.2f GB/s (24 B/element)\n"
        "roofline fraction: %.2f\n",
        n, flags.state_format.c_str(), threads,
        std::string(swapper::SimdPathName(adam.simd_path())).c_str(), best, total / flags.steps,
        elements_per_s, gb_per_s, bytes_per_element, FormatBytes(triad.array_bytes).c_str(),
        threads, triad.gb_per_s, gb_per_s / triad.gb_per_s);
  }
  return 0;
}

const bool kRegistered = RegisterBenchCommand(
    "adam", "fused CPU Adam step throughput vs the STREAM triad of this machine",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<AdamFlags>();
      app.add_option("--numel", flags->numel,
                     "elements per step; K/M/G are binary multiples (64M = 67108864)")
          ->capture_default_str()
          ->check(SizeIn(1));
      app.add_option("--threads", flags->threads, "threads, 0 = all cores")
          ->capture_default_str()
          ->check(CLI::Range(0, 1024));
      app.add_option("--steps", flags->steps, "timed steps (after one warm-up)")
          ->capture_default_str();
      app.add_option("--simd", flags->simd, "auto, scalar, avx2 or avx512")->capture_default_str();
      app.add_option("--state-format", flags->state_format,
                     "fp32 or q8 (8-bit block-quantized moments, CpuAdam::StepQ8)")
          ->capture_default_str()
          ->check(OneOf(swapper::kStateFormatNames));
      app.add_flag("--json", flags->json, "print one JSON object");
      app.add_option("--triad-mib", flags->triad_mib, "MiB per triad array, 0 = max(128, 4 x L3)")
          ->capture_default_str()
          ->check(CLI::Range(0, 1 << 20));
      app.add_option("--triad-reps", flags->triad_reps, "triad repetitions (first is warm-up)")
          ->capture_default_str();
      return [flags] { return RunAdam(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
