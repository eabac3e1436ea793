// zinf-bench subcommands. Each bench/<name>_bench.cc registers itself at static-initialization
// time; main.cc turns every registration into a CLI11 subcommand:
//
//   namespace {
//   const bool kRegistered = zinf::bench::RegisterBenchCommand(
//       "io", "O_DIRECT write/read throughput of the I/O backends",
//       [](CLI::App& app) -> zinf::bench::RunFn {
//         auto opts = std::make_shared<IoFlags>();
//         app.add_option("--path", opts->path)->required();
//         return [opts] { return RunIo(*opts); };
//       });
//   }  // namespace
//
// The setup function adds its flags to `app` and returns what runs when the subcommand is
// chosen; the run function returns the process exit code (0 success, 1 failure, 2 bad usage).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

namespace zinf::bench {

using RunFn = std::function<int()>;
using SetupFn = std::function<RunFn(CLI::App& app)>;

// The largest byte size (and element count) a size flag takes: 1 PiB, far beyond any machine the
// benchmarks run on, and small enough that the arithmetic on it (x 12 bytes of state, x 4 bytes
// per element, aligned up) never overflows 64 bits.
inline constexpr std::uint64_t kMaxSizeFlag = std::uint64_t{1} << 50;

// A CLI11 check for a size flag written as a byte size or element count ("4G", "32M", 4096:
// zinf::ParseBytes, binary multiples) in [min, max]: zero, a negative, a malformed or a huge
// value is a usage error (exit 2) naming the flag, before the subcommand does any work.
CLI::Validator SizeIn(std::uint64_t min, std::uint64_t max = kMaxSizeFlag);

// A CLI11 check that a flag is one of a library's name tables (storage::kIoBackendNames,
// swapper::kStateFormatNames), so that a bench accepts exactly what the config accepts.
template <std::size_t N>
CLI::IsMember OneOf(const std::array<std::string_view, N>& names) {
  return CLI::IsMember(std::vector<std::string>(names.begin(), names.end()));
}

// The I/O flags of the benches that move state through a backend, named after the config keys
// they stand for (aio.*): --engine, --block-size, --queue-depth, --intra-op-parallelism. Each
// bench keeps its own defaults in the struct.
struct AioFlags {
  std::string backend;     // --engine: uring, posix or auto
  std::string block_size;  // --block-size: a byte size, 1 .. 1 GiB
  int queue_depth = 0;     // --queue-depth: 1 .. 4096
  int intra_op_parallelism = 0;  // --intra-op-parallelism: 1 .. 64
};
void AddAioFlags(CLI::App& app, AioFlags& flags);

// Returns true (for a static initializer). A duplicate name aborts at startup.
bool RegisterBenchCommand(std::string name, std::string description, SetupFn setup);

}  // namespace zinf::bench
