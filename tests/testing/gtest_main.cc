// GoogleTest main for single-process tests: a program whose every test skipped exits 77, which
// CTest reports as Skipped (SKIP_RETURN_CODE), not as Passed.
#include <gtest/gtest.h>

#include "testing/test_env.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return zinf::testing::ExitCode(RUN_ALL_TESTS());
}
