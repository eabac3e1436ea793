#!/usr/bin/env bash
# THE test command (README quick start, .ci/run): installs missing dependencies, builds the
# default preset (warnings as errors) and runs the whole CTest suite (labels unit, mpi, ...), then
# runs the unit tests again under ASan+UBSan and the I/O engine tests under ThreadSanitizer.
#
#   tests/run.sh            everything
#   ZINF_TEST_QUICK=1 tests/run.sh   default preset only (no sanitizer builds)
#
# Time on a 2-core machine: the suite waits on MPI start-ups, process deaths and timeouts more
# than it computes, so it runs two tests per core, and the sanitizer builds run meanwhile at the
# lowest CPU priority (nice 19): they take only the cycles the suite leaves idle.
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
quick=${ZINF_TEST_QUICK:-0}

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

if [ "$quick" != "1" ]; then
  # ASan+UBSan: only the programs the unit tests run (target zinf_unit_tests); TSan: core, comm
  # and storage (the preset's ZINF_SKIP_MODULES). Output in build/sanitizer-builds.log.
  step "background: asan and tsan builds at nice 19"
  sanitizer_log=build/sanitizer-builds.log
  # In a process group of its own (setsid), so that a failed suite stops the whole build.
  setsid nice -n 19 bash -c '
    cmake --preset asan > /dev/null &&
      cmake --build --preset asan -j "$1" --target zinf_unit_tests &&
      cmake --preset tsan > /dev/null &&
      cmake --build --preset tsan -j "$1"' sanitizer-builds "$jobs" > "$sanitizer_log" 2>&1 &
  sanitizer_pid=$!
  trap 'kill -- -"$sanitizer_pid" 2> /dev/null || true' EXIT
fi

step "ctest: whole suite (default preset)"
ctest --preset default -j "$ctest_jobs" --no-tests=error

if [ "$quick" != "1" ]; then
  step "wait: asan and tsan builds"
  if ! wait "$sanitizer_pid"; then
    tail -n 60 "$sanitizer_log"
    echo "the sanitizer builds failed (whole output: $sanitizer_log)" >&2
    exit 1
  fi
  trap - EXIT
  step "ctest: unit tests under ASan+UBSan"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j "$jobs" -L unit --no-tests=error
  step "ctest: I/O engine tests under ThreadSanitizer"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --preset tsan -j "$jobs" -L engine
fi

step "all tests passed"
