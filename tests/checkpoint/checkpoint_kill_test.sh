#!/usr/bin/env bash
# kill -9 of one rank at a random point while 2 ranks save checkpoints in a loop, TRIALS times.
# After each kill: `latest` must name a complete step-<N>.h5 (never a .partial file), and that
# checkpoint must restore bit-exactly (on 1, 2 or 3 ranks, picked at random) and verify.
#
#   checkpoint_kill_test.sh HELPER MPIEXEC [TRIALS=20]
set -u
helper=$1
mpiexec=$2
trials=${3:-20}
flags=(--allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader,tcp
       --mca btl_tcp_if_include lo)
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-ckpt-kill-XXXXXX")
trap 'rm -rf "$work"' EXIT
ckpt=$work/ckpt
mkdir -p "$ckpt" "$work/store"

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}
run() {
  local np=$1
  shift
  timeout 120 "$mpiexec" "${flags[@]}" -np "$np" "$helper" "$@"
}

run 2 save "$ckpt" "$work/store" init 1 once > "$work/init.log" 2>&1 || fail "initial save"
killed_mid_save=0
for ((trial = 1; trial <= trials; ++trial)); do
  rm -f "$work"/pid.*
  run 2 save "$ckpt" "$work/store" "kill$trial" $((trial * 1000)) > "$work/save.log" 2>&1 &
  mpirun_pid=$!
  for ((i = 0; i < 400; ++i)); do
    [[ -s $work/pid.0 && -s $work/pid.1 ]] && break
    sleep 0.05
  done
  [[ -s $work/pid.0 && -s $work/pid.1 ]] || fail "trial $trial: ranks did not start"
  # 0.2 .. 1.7 s after start-up: past the swapper creation, into the save loop.
  sleep "$(printf '0.%03d' $((RANDOM % 1000)))"
  sleep "0.$((2 + RANDOM % 6))"
  victim=$((RANDOM % 2))
  kill -9 "$(cat "$work/pid.$victim")" 2> /dev/null
  wait "$mpirun_pid" 2> /dev/null
  saves=$(grep -c '^saved' "$work/save.log")
  partials=$(ls "$ckpt" | grep -c '\.partial$')
  ((partials > 0)) && killed_mid_save=$((killed_mid_save + 1))
  name=$(cat "$ckpt/latest") || fail "trial $trial: no latest"
  [[ $name == *.partial ]] && fail "trial $trial: latest names a partial file ($name)"
  [[ -f $ckpt/$name ]] || fail "trial $trial: latest names $name, which does not exist"
  m=$((1 + RANDOM % 3))
  out=$(run "$m" check "$ckpt" "$work/store" "check$trial" 2> "$work/check.log") ||
    fail "trial $trial: restore of $name on $m rank(s) (rank $victim killed after $saves saves)"
  echo "trial $trial: killed rank $victim after $saves save(s), partial files: $partials; $out"
  rm -rf "$work"/store/zinf-*
done
echo "PASS: $trials trials, $killed_mid_save left a partial file behind (killed mid-save)"
