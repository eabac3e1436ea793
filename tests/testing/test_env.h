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
