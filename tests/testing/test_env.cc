#include "testing/test_env.h"

#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

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

TmpfsMount::TmpfsMount(const std::string& dir, const std::string& size) : dir_(dir) {
  ::mkdir(dir.c_str(), 0700);
  const std::string data = "size=" + size + ",mode=0755";
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, data.c_str()) == 0) {
    mounted_ = true;
  } else {
    error_ = "mount -t tmpfs -o " + data + " " + dir + ": " + std::strerror(errno);
  }
}

TmpfsMount::~TmpfsMount() {
  if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
}

}  // namespace zinf::testing

namespace zinf::testing {

bool Required(std::string_view capability) {
  const std::optional<std::string> list = GetEnv("ZINF_REQUIRE");
  if (!list) return false;
  std::string_view rest = *list;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    if (rest.substr(0, comma) == capability) return true;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return false;
}

int ExitCode(int rc) {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (rc == 0 && unit.failed_test_count() == 0 && unit.successful_test_count() == 0 &&
      unit.skipped_test_count() > 0) {
    return 77;
  }
  return rc;
}

}  // namespace zinf::testing
