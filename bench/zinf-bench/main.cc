// zinf-bench: one binary, one subcommand per registered benchmark (see bench_command.h).
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench_command.h"
#include "zinf/core/check.h"
#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/storage/io_backend.h"

namespace zinf::bench {
namespace {

struct Command {
  std::string name;
  std::string description;
  SetupFn setup;
};

// A function-local static: registrations run during static initialization of other files.
std::vector<Command>& Registry() {
  static std::vector<Command> registry;
  return registry;
}

}  // namespace

bool RegisterBenchCommand(std::string name, std::string description, SetupFn setup) {
  for (const Command& command : Registry()) {
    ZINF_CHECK(command.name != name, "zinf-bench subcommand '{}' registered twice", name);
  }
  Registry().push_back(Command{std::move(name), std::move(description), std::move(setup)});
  return true;
}

CLI::Validator SizeIn(std::uint64_t min, std::uint64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        Result<std::uint64_t> value = ParseBytes(text);
        if (!value) return value.error().message();
        if (*value < min || *value > max) {
          return fmt::format("{} is out of range [{}, {}]", text, min, max);
        }
        return {};
      },
      fmt::format("SIZE in [{}, {}]", min, max));
}

void AddAioFlags(CLI::App& app, AioFlags& flags) {
  app.add_option("--engine", flags.backend, "uring, posix or auto")
      ->capture_default_str()
      ->check(OneOf(storage::kIoBackendNames));
  app.add_option("--block-size", flags.block_size, "aio.block_size, e.g. 1M")
      ->capture_default_str()
      ->check(SizeIn(1, std::uint64_t{1} << 30));
  app.add_option("--queue-depth", flags.queue_depth, "aio.queue_depth")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--intra-op-parallelism", flags.intra_op_parallelism,
                 "aio.intra_op_parallelism")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
}

}  // namespace zinf::bench

int main(int argc, char** argv) {
  CLI::App app{"zinf-bench: benchmarks of the zinf building blocks (one subcommand each)"};
  app.require_subcommand(1);
  std::map<CLI::App*, zinf::bench::RunFn> runners;
  for (const auto& command : zinf::bench::Registry()) {
    CLI::App* sub = app.add_subcommand(command.name, command.description);
    runners[sub] = command.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  for (CLI::App* sub : app.get_subcommands()) {
    auto it = runners.find(sub);
    if (it != runners.end()) return it->second();
  }
  std::fprintf(stderr, "zinf-bench: no subcommand chosen\n");
  return 2;
}
