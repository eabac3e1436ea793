#!/usr/bin/env bash
# THE test command (README quick start, .ci/run): installs missing dependencies, builds the
# default preset (warnings as errors) and runs the whole CTest suite (labels unit, mpi, ...), then
# runs the unit tests again under ASan+UBSan and the I/O backend tests under ThreadSanitizer.
#
#   tests/run.sh            everything
#   ZINF_TEST_QUICK=1 tests/run.sh   default preset only (no sanitizer builds)
#
# Time on a 2-core machine: the suite waits on MPI start-ups, process deaths and timeouts more
# than it computes, so it runs two tests per core; the presets compile with line tables only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash launch/install-deps.sh

# mpirun refuses root without these; tests pass the flags too, these cover scripts and tools.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Ranks waiting in MPI yield their core instead of spinning against another test's ranks.
export OMPI_MCA_mpi_yield_when_idle=1
jobs=$(nproc)
ctest_jobs=$((2 * jobs))  # CTest slots; a test takes as many as it has ranks
start=$(date +%s)

step() { printf '\n==== %s (%ds)\n' "$*" $(( $(date +%s) - start )); }

step "configure + build: default preset"
cmake --preset default >/dev/null
cmake --build --preset default -j "$jobs"

# What this machine can run: a test that finds one of these missing fails instead of skipping
# (tests/testing/test_env.h), so a green run means the io_uring, O_DIRECT, tmpfs and h5dump
# tests ran. Probed without zinf's own code (tests/testing/probe_capabilities.cc).
step "probe: the capabilities the tests must find (ZINF_REQUIRE)"
require=$(build/bin/zinf_probe_capabilities)
if command -v h5dump > /dev/null; then require=${require:+$require,}h5dump; fi
export ZINF_REQUIRE=${ZINF_REQUIRE-$require}
echo "ZINF_REQUIRE=$ZINF_REQUIRE"

step "ctest: whole suite (default preset)"
# The time-boxed fuzzers (label fuzz) run once, under ASan below, unless that is skipped.
skip_fuzz=()
if [ "${ZINF_TEST_QUICK:-0}" != "1" ]; then skip_fuzz=(-LE fuzz); fi
ctest --preset default -j "$ctest_jobs" --no-tests=error "${skip_fuzz[@]}"

if [ "${ZINF_TEST_QUICK:-0}" != "1" ]; then
  step "configure + build: asan preset (ASan+UBSan), the unit tests' programs only"
  cmake --preset asan > /dev/null
  # Only the programs the unit tests run (target zinf_unit_tests): the whole tree under ASan
  # would take about as long again and run no more tests.
  cmake --build --preset asan -j "$jobs" --target zinf_unit_tests
  step "ctest: unit tests under ASan+UBSan"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j "$jobs" -L unit --no-tests=error

  step "configure + build: tsan preset (ThreadSanitizer)"
  cmake --preset tsan > /dev/null
  cmake --build --preset tsan -j "$jobs"
  step "ctest: I/O backend tests under ThreadSanitizer"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --preset tsan -j "$jobs" -L '^io$'
fi

step "all tests passed"
