#include "testing/test_env.h"

#include <stdlib.h>

#include <filesystem>
#include <system_error>

#include "zinf/core/check.h"
#include "zinf/core/env.h"

namespace zinf::testing {

std::string TestTmpBase() {
  if (auto dir = GetEnv("ZINF_TEST_TMPDIR")) return *dir;
  if (const char* tmp = std::getenv("TMPDIR"); tmp != nullptr && *tmp != '\0') return tmp;
  return "/tmp";
}

ScratchDir::ScratchDir(const std::string& tag) {
  std::string pattern = TestTmpBase() + "/zinf-" + tag + "-XXXXXX";
  ZINF_CHECK(mkdtemp(pattern.data()) != nullptr, "mkdtemp({}) failed", pattern);
  path_ = pattern;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace zinf::testing
