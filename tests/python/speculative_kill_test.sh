#!/usr/bin/env bash
# speculative_kill_test.sh <ranks>: the speculative step is never seen by a crash or a checkpoint
# (speculative_kill.py), at stages 2 and 3, in the current directory:
#   1. the reference: STEPS steps uninterrupted;
#   2. the same run, checking every step bitwise against it, with checkpoints after steps whose
#      speculation was redone (clipping) and one between a backward pass and its step(); its
#      last rank kills itself (SIGKILL) while speculated sub-groups are written but not
#      committed: the job must end non-zero within 60 s;
#   3. a resume from the last checkpoint (the kill's `latest`) and one from the mid-step
#      checkpoint, each on the same ranks: every step bitwise equal to the reference;
#   and the swap directory holds no store afterwards (the killed run's reclaimed).
# Environment: TEST_MPIEXEC, TEST_PYTHON (tests/python/CMakeLists.txt).
set -uo pipefail
np=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
read -r -a mpiexec <<< "$TEST_MPIEXEC"
work=$(pwd)
rm -rf swap ckpt-* mid-* marker-*.txt out-*.txt reference-*.pt
mkdir -p swap

run() {  # run <label> <timeout> <args...>: the job's output in out-<label>.txt
  local label=$1 limit=$2
  shift 2
  timeout -k 5 "$limit" "${mpiexec[@]}" -np "$np" "$TEST_PYTHON" "$here/speculative_kill.py" \
    "$@" > "out-$label.txt" 2>&1
}

for stage in 2 3; do
  run "reference-$stage" 60 reference "$work" "$stage" ||
    { cat "out-reference-$stage.txt"; fail "stage $stage: the reference run failed"; }

  start=$(date +%s)
  run "killed-$stage" 90 killed "$work" "$stage"
  rc=$?
  took=$(( $(date +%s) - start ))
  [[ -e marker-$stage.txt ]] ||
    { cat "out-killed-$stage.txt"; fail "stage $stage: no rank killed itself"; }
  cat "marker-$stage.txt"
  echo "stage $stage: the killed job exited $rc after ${took}s"
  (( rc != 0 )) || fail "stage $stage: the killed job exited 0"
  (( rc != 124 && took <= 60 )) || fail "stage $stage: the killed job ran ${took}s"
  if grep -q "FAIL" "out-killed-$stage.txt"; then
    cat "out-killed-$stage.txt"; fail "stage $stage: the run before the kill failed a check"
  fi

  latest=$(cat "ckpt-$stage/latest" 2> /dev/null || readlink "ckpt-$stage/latest")
  [[ $latest == *step-8* ]] || fail "stage $stage: the last checkpoint is '$latest', not step 8's"
  for from in "ckpt-$stage" "mid-$stage"; do
    run "resume-$from" 60 resume "$work" "$stage" "$work/$from" ||
      { cat "out-resume-$from.txt"; fail "stage $stage: the resume from $from failed"; }
    grep -hE "resume stage" "out-resume-$from.txt" | sed 's/^.*\] //' | head -n 1
  done
done
left=$(find swap -mindepth 1 -maxdepth 1 2> /dev/null | wc -l)
(( left == 0 )) || { ls -laR swap; fail "$left entries left in the swap directory"; }
echo "speculative_kill_test: OK (resumed bitwise after a kill with speculated sub-groups on disk)"
