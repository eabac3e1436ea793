#include "zinf/core/env.h"

#include <cstdlib>
#include <cstring>

#include "zinf/core/check.h"

extern char** environ;

namespace zinf {
namespace {

// The one list of ZINF_* variables. README.md's table mirrors it (tests/core/env_test.cc checks).
constexpr EnvVarInfo kKnown[] = {
    {"ZINF_LOG_LEVEL", "trace|debug|info|warn|error|off: the lowest level printed (default info)"},
    {"ZINF_LOG_ALL_RANKS", "1: every rank prints INFO/DEBUG lines, not only rank 0"},
    {"ZINF_FAULT_INJECT",
     "fault injection rules for the I/O backends and file-system calls (docs/reliability.md, Fault "
     "injection)"},
    {"ZINF_IO_ENGINE", "uring|posix|auto: overrides zinf.io_engine"},
    {"ZINF_SIMD",
     "scalar|avx2|avx512: the widest CPU Adam kernel used, as if the CPU had no wider"},
    {"ZINF_TEST_TMPDIR", "tests: directory for scratch files (default: TMPDIR, else /tmp)"},
    {"ZINF_REQUIRE",
     "tests: capabilities (uring, odirect, tmpfs, h5dump) whose absence fails a test, not skips "
     "it"},
    {"ZINF_MPIRUN", "launch/zinf-run: the mpirun to run (default: mpirun on PATH)"},
    {"ZINF_TEST_QUICK", "tests/run.sh: 1 runs the default preset only (no sanitizer builds)"},
};

}  // namespace

std::span<const EnvVarInfo> KnownEnvVars() { return kKnown; }

std::optional<std::string> GetEnv(std::string_view name) {
  bool known = false;
  for (const EnvVarInfo& info : kKnown) known = known || info.name == name;
  ZINF_CHECK(known, "GetEnv({}): not in the table of known ZINF_* variables in env.cc", name);
  const char* value = std::getenv(std::string(name).c_str());
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::string UnknownZinfEnvVars() {
  std::string unknown;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view kv = *entry;
    if (!kv.starts_with("ZINF_")) continue;
    std::string_view name = kv.substr(0, kv.find('='));
    bool known = false;
    for (const EnvVarInfo& info : kKnown) known = known || info.name == name;
    if (!known) {
      if (!unknown.empty()) unknown += ", ";
      unknown += name;
    }
  }
  return unknown;
}

}  // namespace zinf
