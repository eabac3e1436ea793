#!/usr/bin/env bash
# An injected I/O fault (ZINF_FAULT_INJECT, docs/reliability.md "Fault injection") on one rank makes all ranks
# exit non-zero with the same message within 60 s. The built-in charlm trains on 2 or 3 ranks with
# a checkpoint every step or two until the fault on rank 1 hits: an EIO on a swap write and on a
# swap read (2 and 3 ranks each), an ENOSPC on a swap write, an EIO on a read of a checkpoint
# save (3 ranks). Checks: mpirun
# exits 1 within 60 s; rank 1 announced the armed fault; every rank printed exactly one
# "zinf-train failed: " line and the messages after it are identical; `latest` names a complete
# checkpoint (never a .partial file) that zinf-ckpt verifies, and no .partial file is left; the
# message names the failing rank first, the operation and the errno.
#
# Where the Nth block of an operation falls (which step, swap or checkpoint) depends on the model,
# the sub-groups and the swapper, so the test does not hard-code it: it moves N until the fault
# lands after the first checkpoint (or, for the checkpoint case, inside a checkpoint save).
#
#   fault_injection.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init fault-injection

failures=0
# case_failed TAG MESSAGE...: one failed case, with the tail of its log; the others still run.
case_failed() {
  echo "FAIL: $1: ${*:2}" >&2
  if [[ -f $log ]]; then
    echo "--- last warn/error lines of $log" >&2
    grep -E '\[(warn|error)\]' "$log" | tail -8 >&2
  fi
  failures=$((failures + 1))
  return 1
}

# run_fault NP SPEC EVERY: one training run with ZINF_FAULT_INJECT=SPEC on NP ranks, a checkpoint
# every EVERY steps, at most 40 steps. Sets tag, log, ckpt, rc, secs, steps_done.
run_fault() {
  local np=$1 spec=$2 every=$3 t0
  tag="np$np-${spec%%,*}"
  tag=${tag//:/-}
  log=$work/$tag.log
  ckpt=$work/ckpt-$tag
  rm -rf "$ckpt" "$work/swap-$tag" "$work/$tag.jsonl"
  mkdir -p "$work/swap-$tag"
  t0=$(stamp)
  ZINF_FAULT_INJECT=$spec train "$np" 90 --steps 40 --nvme-path "$work/swap-$tag" \
    --checkpoint-dir "$ckpt" --checkpoint-every "$every" --metrics "$work/$tag.jsonl" \
    > "$log" 2>&1
  rc=$?
  secs=$(elapsed "$t0")
  steps_done=$(wc -l < "$work/$tag.jsonl" 2> /dev/null || echo 0)
  echo "  $spec: exit $rc after $secs s, $steps_done step(s) done"
}

# check_case NP OP ERRNO_TEXT: the checks of the last run_fault.
check_case() {
  local np=$1 op=$2 errno_text=$3
  check "$tag: all ranks fail alike within 60 s"
  ((rc == 124 || rc == 137)) && { case_failed "$tag" "still running after 90 s (a hang)"; return; }
  ((rc != 0)) || { case_failed "$tag" "mpirun exited 0 despite the fault"; return; }
  ((rc == 1)) || { case_failed "$tag" "exit code $rc, expected 1 (an I/O error)"; return; }
  awk -v s="$secs" 'BEGIN { exit !(s < 60) }' ||
    { case_failed "$tag" "took $secs s, more than 60"; return; }
  grep -q "\[rank 1/$np\].*injecting I/O faults" "$log" ||
    { case_failed "$tag" "rank 1 has no 'injecting I/O faults' WARN line (not armed?)"; return; }

  local failed ranks messages first_rank
  failed=$(grep -F 'zinf-train failed: ' "$log")
  ranks=$(sed -nE 's/.*\[rank ([0-9]+)\/[0-9]+\].*zinf-train failed: .*/\1/p' <<< "$failed" |
    sort -n | tr '\n' ' ')
  [[ $ranks == "$(seq -s ' ' 0 $((np - 1))) " ]] || {
    case_failed "$tag" "'zinf-train failed: ' lines from ranks [$ranks]," \
      "expected 0..$((np - 1)) once each"
    return
  }
  messages=$(sed -e 's/.*zinf-train failed: //' <<< "$failed" | sort -u)
  (($(wc -l <<< "$messages") == 1)) || { case_failed "$tag" "the ranks' messages differ:
$messages"; return; }
  echo "  every rank: $messages"

  check "$tag: latest names a complete checkpoint, which verifies; no .partial file is left"
  local name partials
  [[ -f $ckpt/latest ]] ||
    { case_failed "$tag" "no checkpoint before the fault ($steps_done steps)"; return; }
  name=$(cat "$ckpt/latest")
  [[ $name == step-*.h5 && $name != *.partial ]] ||
    { case_failed "$tag" "latest names '$name'"; return; }
  [[ -f $ckpt/$name ]] || { case_failed "$tag" "latest names $name, which does not exist"; return; }
  timeout 60 "$zinf_ckpt" verify "$ckpt/$name" > "$work/verify-$tag.txt" 2>&1 ||
    { case_failed "$tag" "zinf-ckpt verify $name exited with $?"; return; }
  partials=$(find "$ckpt" -name '*.partial' -printf '%f ')
  [[ -z $partials ]] ||
    { case_failed "$tag" "partial checkpoint files left after a clean failure: $partials"; return; }
  echo "  latest: $name; in the directory: $(find "$ckpt" -mindepth 1 -printf '%f\n' | sort -V |
    tr '\n' ' ')"

  check "$tag: the message names the failing rank first, the operation ($op) and the error"
  grep -q "$op " <<< "$messages" ||
    { case_failed "$tag" "the message does not name '$op'"; return; }
  grep -qF "$errno_text" <<< "$messages" ||
    { case_failed "$tag" "the message does not name the error ($errno_text)"; return; }
  # After the error code, the message starts with the rank that failed ("rank 1: ..."). A status
  # agreed twice names the lowest rank that holds the already-agreed error first ("rank 0: rank
  # 1: ... (and 2 more ranks failed)"), which blames rank 0 for rank 1's fault.
  first_rank=$(grep -oE 'rank [0-9]+:' <<< "$messages" | head -1)
  [[ $first_rank == "rank 1:" ]] ||
    { case_failed "$tag" "the message names '$first_rank' first, not the failing rank 1"; return; }
  ! grep -qE 'and [0-9]+ more ranks? failed' <<< "$messages" ||
    { case_failed "$tag" "the message says more ranks failed; only rank 1 had a fault"; return; }
}

# after_checkpoint NP OP KIND ERRNO_TEXT: OP:N:KIND on rank 1, N doubled from 24 until the fault
# lands after the first checkpoint (every 2 steps), then the checks.
after_checkpoint() {
  local np=$1 op=$2 kind=$3 errno_text=$4 n
  check "$np ranks, an $kind on rank 1's Nth $op, after the first checkpoint"
  for n in 24 48 96 192 384; do
    run_fault "$np" "$op:$n:$kind,rank=1" 2
    ((rc == 0)) && { case_failed "$tag" "the fault never hit in 40 steps"; return; }
    ((rc != 1)) && break  # a hang or a crash: check_case says which
    [[ -f $ckpt/latest ]] && break
  done
  check_case "$np" "$op" "$errno_text"
}

# in_checkpoint_save NP: a read EIO on rank 1 inside a checkpoint save (every step), N moved
# by 2 from 30 until the message says so.
in_checkpoint_save() {
  local np=$1 n
  check "$np ranks, an EIO on a read of rank 1 inside a checkpoint save"
  for ((n = 30; n < 60; n += 2)); do
    run_fault "$np" "read:$n:eio,rank=1" 1
    ((rc == 0)) && { case_failed "$tag" "the fault never hit in 40 steps"; return; }
    ((rc != 1)) && break  # a hang or a crash: check_case says which
    grep -q 'zinf-train failed: .*checkpoint save' "$log" && break
  done
  ((rc != 1)) || grep -q 'zinf-train failed: .*checkpoint save' "$log" ||
    { case_failed "$tag" "no read fault from 30 to 58 landed in a checkpoint save"; return; }
  check_case "$np" read 'Input/output error (errno 5)'
}

after_checkpoint 2 write eio 'Input/output error (errno 5)'
after_checkpoint 3 write eio 'Input/output error (errno 5)'
after_checkpoint 2 read eio 'Input/output error (errno 5)'
after_checkpoint 3 read eio 'Input/output error (errno 5)'
after_checkpoint 2 write enospc 'No space left on device (errno 28)'
in_checkpoint_save 3

if ((failures > 0)); then
  echo "FAIL: $failures of 6 fault cases failed (see the FAIL lines above)" >&2
  exit 1
fi
echo "PASS: 6 injected faults, each failed every rank with one identical message in < 60 s"
