// zinf-bench subcommands. Each bench/<name>_bench.cc registers itself at static-initialization
// time; main.cc turns every registration into a CLI11 subcommand:
//
//   namespace {
//   const bool kRegistered = zinf::bench::RegisterBenchCommand(
//       "io", "O_DIRECT write/read throughput of the I/O engines",
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

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

namespace zinf::bench {

using RunFn = std::function<int()>;
using SetupFn = std::function<RunFn(CLI::App& app)>;

// Returns true (for a static initializer). A duplicate name aborts at startup.
bool RegisterBenchCommand(std::string name, std::string description, SetupFn setup);

}  // namespace zinf::bench
