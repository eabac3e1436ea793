#!/usr/bin/env bash
# A killed run's swap store is reclaimed by the next run on the same path, whatever its flags
# (docs/tools.md "Swap store"). The built-in charlm on 2 ranks, swap under $work/swap:
#   run 1: --steps 200 --checkpoint-every 5; once the first checkpoint exists, rank 1 is killed
#          with SIGKILL. mpirun must exit non-zero within 60 s and leave a stale zinf-<id> store.
#   run 2: --resume latest with other flags (--steps, --checkpoint-every 3): the same job id (it
#          depends only on checkpoint dir, model, data, seed and world size), so the ranks reuse
#          the stores their killed predecessors left (WARN line); exit 0, $work/swap empty.
#   run 3: another checkpoint dir (another job id) with --keep-last 2, killed like run 1.
#   run 4: run 1's job again (--resume latest --keep-last 1 --steps ...): it removes run 3's store
#          of the other job id (WARN "removed the swap store ... that a killed run of job ...");
#          exit 0, nothing left in $work/swap.
#
#   killed_rank.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init killed-rank
mkdir -p "$work/swap"

# The pid of the zinf-train process of world rank RANK among this test's processes, or nothing.
rank_pid() {
  local p
  for p in $(pgrep -f -- "$work/swap"); do
    [[ $(readlink "/proc/$p/exe" 2> /dev/null) == "$zinf_train" ]] || continue
    if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null |
      grep -qxE "(OMPI_COMM_WORLD_RANK|PMI_RANK)=$1"; then
      echo "$p"
      return
    fi
  done
}

# run_killed TAG CKPT ARGS...: zinf-train on 2 ranks with ARGS, rank 1 SIGKILLed as soon as
# CKPT/latest exists. Sets rc (mpirun's exit status) and secs (from the kill to mpirun's exit).
run_killed() {
  local tag=$1 ckpt=$2 job pid="" t0 i
  shift 2
  train 2 90 --nvme-path "$work/swap" --checkpoint-dir "$ckpt" "$@" > "$work/$tag.log" 2>&1 &
  job=$!
  for ((i = 0; i < 600; ++i)); do
    [[ -f $ckpt/latest ]] && break
    kill -0 "$job" 2> /dev/null || break
    sleep 0.1
  done
  [[ -f $ckpt/latest ]] || { wait "$job"; fail "$tag: no checkpoint within 60 s (exit $?)"; }
  for ((i = 0; i < 50; ++i)); do
    pid=$(rank_pid 1)
    [[ -n $pid ]] && break
    sleep 0.1
  done
  [[ -n $pid ]] || { kill "$job"; wait "$job"; fail "$tag: cannot find rank 1's process"; }
  t0=$(stamp)
  kill -9 "$pid"
  wait "$job"
  rc=$?
  secs=$(elapsed "$t0")
  echo "  $tag: killed rank 1 (pid $pid) after $(cat "$ckpt/latest"); mpirun exited $rc after" \
    "$secs s"
  # 137 is also mpirun's own status for a rank killed by signal 9: only the time tells a hang.
  ((rc != 124)) || fail "$tag: mpirun still running 90 s after the kill (a hang)"
  awk -v s="$secs" 'BEGIN { exit !(s < 60) }' || fail "$tag: mpirun took $secs s to end (a hang)"
  ((rc != 0)) || fail "$tag: mpirun exited 0 although rank 1 was killed"
}

job_id_of() {  # job_id_of LOG: the job id rank 0's engine printed when it opened the swap store
  sed -nE 's/.*\[rank 0\/[0-9]+\] engine: job id ([A-Za-z0-9_.-]+)$/\1/p' "$1" |
    head -1
}

# Steps of the checkpoint CKPT/latest names.
latest_step() { sed -nE 's/^step-([0-9]+)\.h5$/\1/p' "$1/latest"; }

nothing_left() {  # nothing_left TAG: $work/swap is empty
  local left
  left=$(find "$work/swap" -mindepth 1 | head -5)
  [[ -z $left ]] || fail "$1: the swap path is not empty afterwards (leaked): $left"
}

t_all=$(stamp)
check "run 1: rank 1 killed after the first checkpoint; mpirun ends non-zero; a stale store stays"
run_killed run1 "$work/ckpt" --steps 200 --checkpoint-every 5
id1=$(job_id_of "$work/run1.log")
[[ -n $id1 ]] || fail "run 1 printed no job id"
stale=$(find "$work/swap" -mindepth 2 -maxdepth 2 -path "$work/swap/zinf-*/rank*")
[[ -n $stale ]] || fail "run 1 left no stale store under $work/swap (was rank 1 killed?)"
[[ $stale == *"/zinf-$id1/rank1"* ]] || fail "the stale store is not zinf-$id1/rank1: $stale"
echo "  job id $id1; left behind: $(tr '\n' ' ' <<< "$stale")"

check "run 2: --resume latest --steps +10 --checkpoint-every 3: the same job id, the stale store"\
  "is reused, exit 0, nothing left"
step=$(latest_step "$work/ckpt")
train 2 90 --nvme-path "$work/swap" --checkpoint-dir "$work/ckpt" --resume latest \
  --steps $((step + 10)) --checkpoint-every 3 > "$work/run2.log" 2>&1 ||
  fail "run 2 (resume) exited with $?"
id2=$(job_id_of "$work/run2.log")
[[ $id2 == "$id1" ]] || fail "run 2 has job id '$id2', run 1 had '$id1' (flags changed the id)"
grep -F '[warn]' "$work/run2.log" |
  grep -qF "zinf-$id1/rank1: removing the store a killed instance of job '$id1' left behind" ||
  fail "run 2 has no WARN line about reusing zinf-$id1/rank1"
grep -E "\[warn\].*(removing the store|removed the swap store)" "$work/run2.log" | head -2
nothing_left run2

check "run 3: another job id (other checkpoint dir, --keep-last 2), rank 1 killed again"
run_killed run3 "$work/ckpt3" --steps 200 --checkpoint-every 5 --keep-last 2
id3=$(job_id_of "$work/run3.log")
[[ -n $id3 && $id3 != "$id1" ]] || fail "run 3's job id '$id3' is not another one than '$id1'"
[[ -d $work/swap/zinf-$id3/rank1 ]] || fail "run 3 left no store zinf-$id3/rank1"

check "run 4: run 1's job with --resume latest --keep-last 1 --steps +5 removes run 3's store"
step=$(latest_step "$work/ckpt")
train 2 90 --nvme-path "$work/swap" --checkpoint-dir "$work/ckpt" --resume latest \
  --steps $((step + 5)) --keep-last 1 > "$work/run4.log" 2>&1 || fail "run 4 exited with $?"
grep -F '[warn]' "$work/run4.log" | grep -F "removed the swap store $work/swap/zinf-$id3/rank1 (" |
  grep -qF "that a killed run of job '$id3' left behind" ||
  fail "run 4 has no WARN line about removing zinf-$id3/rank1"
grep -E "\[warn\].*removed the swap store" "$work/run4.log" | head -2
nothing_left run4

echo "PASS: killed runs' stores were reclaimed by the next runs (same job id and another);" \
  "nothing leaked ($(elapsed "$t_all") s)"
