// Scratch directories for tests: a fresh directory under ZINF_TEST_TMPDIR (else TMPDIR, else
// /tmp), removed with everything in it when the object dies.
#pragma once

#include <string>
#include <string_view>

#include <gtest/gtest.h>

namespace zinf::testing {

class ScratchDir {
 public:
  // `tag` becomes part of the name, to tell leftovers apart.
  explicit ScratchDir(const std::string& tag = "test");
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The base directory for scratch files.
std::string TestTmpBase();

}  // namespace zinf::testing

namespace zinf::testing {

// Mounts a tmpfs of `size` (e.g. "4m") on `dir` (created if missing) for the lifetime of the
// object, for tests of a full file system. Needs root (CAP_SYS_ADMIN): when the mount fails,
// mounted() is false and error() says why, for a GTEST_SKIP.
class TmpfsMount {
 public:
  TmpfsMount(const std::string& dir, const std::string& size);
  ~TmpfsMount();
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;

  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string error_;
};

}  // namespace zinf::testing

namespace zinf::testing {

// Capabilities a test may lack on some machines ("uring": io_uring works here; "odirect": the
// scratch directory takes O_DIRECT; "tmpfs": root can mount one; "h5dump": hdf5-tools is
// installed). ZINF_REQUIRE lists those that
// must be there (comma-separated; .ci/run sets it after probing the machine): a test that finds
// one missing then fails instead of skipping, so a green CI means the tests ran.
bool Required(std::string_view capability);

// The exit code of a test program: `rc` (RUN_ALL_TESTS), but 77 when nothing failed, nothing
// passed and something was skipped, so that CTest (SKIP_RETURN_CODE 77) shows the test as
// Skipped, not Passed.
int ExitCode(int rc);

}  // namespace zinf::testing

// Skips the test for a missing `capability` (above), or fails it when ZINF_REQUIRE names it.
#define ZINF_SKIP_MISSING(capability, reason)                                      \
  do {                                                                             \
    if (::zinf::testing::Required(capability)) {                                   \
      FAIL() << (capability) << " is required here (ZINF_REQUIRE) but " << reason; \
    }                                                                              \
    GTEST_SKIP() << reason;                                                        \
  } while (0)
