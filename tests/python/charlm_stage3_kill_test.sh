#!/usr/bin/env bash
# charlm_stage3_kill_test.sh <source dir>: a stage-3 run whose rank dies mid-training loses
# nothing that was committed. examples/torch/train_charlm.py --stage3 (offload_param nvme) on 2
# ranks, in the current directory, checkpoints every 5 steps; once the first checkpoint exists,
# rank 1 is killed with SIGKILL: mpirun must end within 60 s. Then --resume on 3 ranks: the job
# resumes from the latest checkpoint, trains on to at least step 35 and exits 0, and the swap
# directory holds no store afterwards (the killed run's stale ones reclaimed).
# Environment: TEST_MPIEXEC, TEST_PYTHON (tests/python/CMakeLists.txt).
set -uo pipefail
src=$1
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
work=$(pwd)
rm -rf zinf-torch-demo killed.txt resumed.txt
read -r -a mpiexec <<< "$TEST_MPIEXEC"
args=(--stage3 --offload-param nvme --batch 4 --print-every 5 --checkpoint-every 5)
latest=zinf-torch-demo/checkpoints/latest

timeout -k 5 150 "${mpiexec[@]}" -np 2 "$TEST_PYTHON" "$src/examples/torch/train_charlm.py" \
  "${args[@]}" --steps 400 > killed.txt 2>&1 &
job=$!
trap 'kill "$job" 2> /dev/null' EXIT
for ((i = 0; i < 900; ++i)); do
  [[ -e $latest ]] && break
  kill -0 "$job" 2> /dev/null || break
  sleep 0.1
done
[[ -e $latest ]] || { wait "$job"; cat killed.txt; fail "no checkpoint within 90 s"; }
# Rank 1: a python process of this run (its working directory is ours) with world rank 1.
pid=""
for ((i = 0; i < 50; ++i)); do
  for p in $(pgrep -f train_charlm.py); do
    [[ $(readlink "/proc/$p/cwd" 2> /dev/null) == "$work" ]] || continue
    if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null |
      grep -qxE "(OMPI_COMM_WORLD_RANK|PMI_RANK)=1"; then
      pid=$p
      break
    fi
  done
  [[ -n $pid ]] && break
  sleep 0.1
done
[[ -n $pid ]] || { kill "$job"; wait "$job"; fail "cannot find rank 1's process"; }
saved=$(readlink "$latest" 2> /dev/null || cat "$latest")
start=$(date +%s)
kill -9 "$pid"
wait "$job"
rc=$?
took=$(( $(date +%s) - start ))
echo "killed rank 1 (pid $pid) after $saved: mpirun exited $rc after ${took}s"
(( rc != 0 )) || { cat killed.txt; fail "the killed job exited 0"; }
(( took <= 60 )) || { cat killed.txt; fail "mpirun still ran ${took}s after the kill"; }

# 10 steps past the checkpoint seen (a later one may have landed before the kill), and at least
# 35: the example's schedule warms up over 30. No checkpoints and few evaluations this time.
step=$(grep -oE '[0-9]+' <<< "$saved" | tail -n 1)
[[ -n $step ]] || fail "cannot read the step of $saved"
last=$(( step + 10 > 35 ? step + 10 : 35 ))
timeout -k 5 200 "${mpiexec[@]}" -np 3 "$TEST_PYTHON" "$src/examples/torch/train_charlm.py" \
  --stage3 --offload-param nvme --batch 4 --print-every 10 --checkpoint-every 1000 --resume \
  --steps "$last" > resumed.txt 2>&1
rc=$?
cat resumed.txt
(( rc == 0 )) || fail "the resumed run on 3 ranks exited $rc"
grep -q "resumed at step" resumed.txt || fail "the run did not resume from $latest"
grep -qE "done: steps [0-9]+\.\.$last " resumed.txt || fail "no 'done' line up to step $last"
left=$(find zinf-torch-demo/swap -mindepth 1 -maxdepth 1 2> /dev/null | wc -l)
(( left == 0 )) || { ls -la zinf-torch-demo/swap; fail "$left entries left in the swap dir"; }
echo "charlm_stage3_kill_test: OK (resumed on 3 ranks from the checkpoint the killed run left)"
