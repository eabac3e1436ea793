// Scratch directories for tests: a fresh directory under ZINF_TEST_TMPDIR (else TMPDIR, else
// /tmp), removed with everything in it when the object dies.
#pragma once

#include <string>

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
