// zinf-bench checksum: what verify_swap and checkpoint checksums cost next to the disk.
//
//   zinf-bench checksum --size 256M [--path DIR] [--reps 5] [--json]
//
// Times XXH3-64 (the checksum of swap units and checkpoint chunks) over an in-memory buffer (best
// of --reps) and, with --path, an O_DIRECT read of the same number of bytes through the io_uring
// backend in the same run; prints {"bench":"checksum", ..., "checksum_gb_per_s", "read_gb_per_s",
// "cost_fraction"} where cost_fraction = checksum seconds / read seconds: the share of one core's
// time per byte read, i.e. what verifying a read costs if it is not overlapped with the I/O.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_command.h"
#include "zinf/core/units.h"
#include "zinf/storage/aligned_buffer.h"
#include "zinf/storage/checksum.h"
#include "zinf/storage/file.h"
#include "zinf/storage/io_backend.h"

namespace zinf::bench {
namespace {

struct ChecksumFlags {
  std::string size = "256M";
  std::string path;
  int reps = 5;
  bool json = false;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Writes `buffer` to a fresh file in `dir`, then times reading it back with O_DIRECT. The file
// is created exclusively (never a file, link or device that was there) and removed after.
Result<double> TimeDirectRead(const std::string& dir, storage::AlignedBuffer& buffer) {
  const std::string path = fmt::format("{}/zinf-bench-checksum-{}.tmp", dir, ::getpid());
  ZINF_ASSIGN_OR_RETURN(storage::File file,
                        storage::File::Open(path, {.mode = storage::OpenMode::kCreate}));
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove{path};
  ZINF_ASSIGN_OR_RETURN(auto backend,
                        storage::CreateIoBackend(storage::IoBackendKind::kAuto, {}, dir));
  ZINF_RETURN_IF_ERROR(backend->Submit({storage::IoOp::kWrite, &file, 0, buffer.span()}));
  ZINF_RETURN_IF_ERROR(backend->WaitAll());
  ZINF_RETURN_IF_ERROR(file.Sync());
  auto start = std::chrono::steady_clock::now();
  ZINF_RETURN_IF_ERROR(backend->Submit({storage::IoOp::kRead, &file, 0, buffer.span()}));
  ZINF_RETURN_IF_ERROR(backend->WaitAll());
  return Seconds(start);
}

int RunChecksum(const ChecksumFlags& flags) {
  auto size = ParseBytes(flags.size);
  if (!size || *size == 0) {
    std::fprintf(stderr, "zinf-bench checksum: --size: %s\n",
                 size ? "must be > 0" : size.error().message().c_str());
    return 2;
  }
  auto buffer = storage::AlignedBuffer::Allocate(*size, {.alignment = 4096});
  if (!buffer) {
    std::fprintf(stderr, "zinf-bench checksum: %s\n", buffer.error().ToString().c_str());
    return 1;
  }
  auto words = buffer->as<std::uint64_t>();
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = i * 0x9e3779b97f4a7c15ull;

  double best = 1e30;
  std::uint64_t digest = 0;
  for (int rep = 0; rep < flags.reps; ++rep) {
    auto start = std::chrono::steady_clock::now();
    digest ^= storage::Checksum64(buffer->span());
    best = std::min(best, Seconds(start));
  }
  const double bytes = static_cast<double>(buffer->size());
  nlohmann::json out = {{"bench", "checksum"},
                        {"algorithm", std::string(storage::kChecksumAlgorithm)},
                        {"size_bytes", buffer->size()},
                        {"checksum_seconds", best},
                        {"checksum_gb_per_s", bytes / best / 1e9},
                        {"digest_xor", digest}};
  if (!flags.path.empty()) {
    auto read_seconds = TimeDirectRead(flags.path, *buffer);
    if (!read_seconds) {
      std::fprintf(stderr, "zinf-bench checksum: %s\n", read_seconds.error().ToString().c_str());
      return 1;
    }
    out["read_seconds"] = *read_seconds;
    out["read_gb_per_s"] = bytes / *read_seconds / 1e9;
    out["cost_fraction"] = best / *read_seconds;
  }
  if (flags.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("checksum %s over %s: %.2f GB/s", std::string(storage::kChecksumAlgorithm).c_str(),
                FormatBytes(buffer->size()).c_str(), bytes / best / 1e9);
    if (out.contains("read_gb_per_s")) {
      std::printf("; O_DIRECT read %.2f GB/s; verifying costs %.0f%% of the read time",
                  out["read_gb_per_s"].get<double>(), 100 * out["cost_fraction"].get<double>());
    }
    std::printf("\n");
  }
  return 0;
}

const bool kRegistered = RegisterBenchCommand(
    "checksum", "XXH3 checksum throughput, and its cost next to an O_DIRECT read (--path)",
    [](CLI::App& app) -> RunFn {
      auto flags = std::make_shared<ChecksumFlags>();
      app.add_option("--size", flags->size, "bytes to checksum (and read), e.g. 256M")
          ->capture_default_str()
          ->check(SizeIn(1));
      app.add_option("--path", flags->path, "directory for the read comparison (file removed)");
      app.add_option("--reps", flags->reps, "checksum repetitions (best is reported)")
          ->check(CLI::PositiveNumber)
          ->capture_default_str();
      app.add_flag("--json", flags->json, "print one JSON object");
      return [flags] { return RunChecksum(*flags); };
    });

}  // namespace
}  // namespace zinf::bench
