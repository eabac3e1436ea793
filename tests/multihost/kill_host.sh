#!/usr/bin/env bash
# Losing a whole host during a checkpoint: 2 hosts x 1 rank train a synthetic model (40M
# parameters, 480 MB of optimizer state, so a save takes about a second here) with a checkpoint
# every step; while step N's file is being written (step-N.h5.partial exists, N >= 2) every process
# on the second host (its orted and its rank) gets SIGKILL, by pid, as in a power loss.
# Checks: the job ends on the surviving host too, non-zero, within 60 s of the kill, with an error
# naming the lost host; `latest` names a complete checkpoint of an earlier step, not the partial
# file, and `zinf-ckpt verify` accepts it; a resume from it on both hosts (the lost one "rebooted":
# a fresh orted, its stale swap store reclaimed) exits 0 and reproduces the killed run's step-N
# loss and gradient norm bitwise (the killed run logged step N's metrics before its save began;
# same ranks and config give bitwise-identical steps, so this holds only if the restored state is
# the saved one, element by element); the resume's step-N.h5 verifies and latest names it.
#
#   kill_host.sh ZINF_TRAIN ZINF_CKPT [MPIEXEC]
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mh_binaries "$@"
mh_init kill-host 2 1
set -- $MH_HOSTS
host1=$1 host2=$2
ckpt=$MH_DIR/shared/ckpt
metrics=$MH_DIR/shared/metrics.jsonl

cat > "$MH_DIR/shared/config.json" << EOF
{"train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 1, "sub_group_size": 2097152,
                       "offload_optimizer": {"device": "nvme", "pipeline_read": true,
                                             "pipeline_write": true}},
 "zinf": {"pinned_budget_bytes": "64M", "job_id": "mhkill",
          "model": {"name": "synthetic", "total_params": 40000000, "num_params": 4}}}
EOF
train_args=(--config "$MH_DIR/shared/config.json" --nvme-path "$MH_NVME" --checkpoint-dir "$ckpt"
            --checkpoint-every 1 --metrics "$metrics")

check "2 hosts x 1 rank train with a checkpoint every step; wait for a save of step >= 2"
mh_mpirun_bg 150 -np 2 "$zinf_train" "${train_args[@]}" --steps 8 > "$MH_DIR/train.log" 2>&1
job=$mh_job_pid
partial=
for _ in $(seq 1 1200); do  # 60 s
  for f in "$ckpt"/step-*.h5.partial; do
    [[ -e $f && -e $ckpt/latest ]] || continue
    n=${f##*/step-}
    n=${n%.h5.partial}
    ((n >= 2)) && { partial=$f; break 2; }
  done
  kill -0 "$job" 2> /dev/null || fail "training ended (status $(wait "$job"; echo $?)) before a save of step >= 2 was seen"
  sleep 0.05
done
[[ -n $partial ]] || fail "no checkpoint save of step >= 2 started within 60 s"
step=$n

check "SIGKILL to every process on $host2 while $(basename "$partial") is being written"
pids=$(mh_host_pids "$host2")
[[ -n $pids ]] || fail "no process runs on $host2"
for p in $pids; do echo "  $host2: pid $p $(cat "/proc/$p/comm" 2> /dev/null)"; done
mh_host_pids "$host2" zinf-train | grep -q . || fail "no zinf-train process on $host2"
t0=$(stamp)
# shellcheck disable=SC2086  # a list of pids
kill -9 $pids
[[ -e $partial ]] || echo "  (the save finished before the kill landed; the test still holds)"

check "the job ends on all hosts, non-zero, within 60 s, naming the lost host"
mh_wait
rc=$?
secs=$(elapsed "$t0")
echo "  mpirun exited with $rc, $secs s after the kill"
((rc == 124 || rc == 137)) && fail "the job still ran 150 s after its start (a hang after the kill)"
((rc != 0)) || fail "mpirun exited 0 although $host2 was killed"
awk -v s="$secs" 'BEGIN { exit !(s < 60) }' || fail "the job took $secs s to end after the kill"
# mpirun may return while the surviving host's orted is still stopping its rank (SIGTERM, then
# SIGKILL after a grace period): the job has ended when that rank is gone too.
while [[ -n $(mh_host_pids "$host1" zinf-train) ]] && awk -v s="$(elapsed "$t0")" 'BEGIN { exit !(s < 60) }'; do
  sleep 0.1
done
left=$(mh_host_pids "$host1" zinf-train)
[[ -z $left ]] || fail "zinf-train still runs on $host1 60 s after the kill: $left"
echo "  the last rank on $host1 was gone $(elapsed "$t0") s after the kill"
grep -q "$host2" "$MH_DIR/train.log" || fail "no error line names $host2"
echo "  $(grep -m1 -B1 "$host2" "$MH_DIR/train.log" | tr -s ' ' | tr '\n' ' ')"

check "latest names a complete earlier checkpoint, which verifies"
name=$(cat "$ckpt/latest" 2> /dev/null)
echo "  latest: $name; files: $(cd "$ckpt" && ls | tr '\n' ' ')"
[[ $name =~ ^step-([0-9]+)\.h5$ ]] || fail "latest names '$name'"
saved=${BASH_REMATCH[1]}
((saved == step - 1 || saved == step)) || fail "latest is step $saved, the kill hit the save of step $step"
[[ -f $ckpt/$name ]] || fail "latest names $name, which does not exist"
timeout 60 "$zinf_ckpt" verify "$ckpt/$name" > "$MH_DIR/verify.log" 2>&1 ||
  fail "zinf-ckpt verify $name exited with $?"
killed_line=$(metric "$metrics" loss | awk -v s=$((saved + 1)) '$1 == s')
killed_norm=$(metric "$metrics" grad_norm | awk -v s=$((saved + 1)) '$1 == s')

check "resume from latest (step $saved) on both hosts to step $((saved + 1)) exits 0"
t0=$(stamp)
mh_mpirun 120 -np 2 "$zinf_train" "${train_args[@]}" --resume latest --steps $((saved + 1)) \
  > "$MH_DIR/resume.log" 2>&1 || fail "the resume exited with $?"
echo "  took $(elapsed "$t0") s"
grep -m2 -i "reclaim" "$MH_DIR/resume.log" | sed 's/^/  /'

check "the resumed step $((saved + 1)) equals the killed run's bitwise (loss, grad norm)"
resumed_line=$(metric "$metrics" loss | awk -v s=$((saved + 1)) '$1 == s' | tail -1)
resumed_norm=$(metric "$metrics" grad_norm | awk -v s=$((saved + 1)) '$1 == s' | tail -1)
echo "  killed run: loss $killed_line, grad_norm $killed_norm"
echo "  resumed:    loss $resumed_line, grad_norm $resumed_norm"
[[ -n $killed_line ]] || fail "the killed run logged no step $((saved + 1))"
[[ $resumed_line == "$killed_line" && $resumed_norm == "$killed_norm" ]] ||
  fail "the resumed step differs from the killed run's"

check "latest names the resume's step-$((saved + 1)).h5, which verifies"
[[ $(cat "$ckpt/latest") == step-$((saved + 1)).h5 ]] || fail "latest is '$(cat "$ckpt/latest")'"
timeout 60 "$zinf_ckpt" verify "$ckpt/step-$((saved + 1)).h5" > "$MH_DIR/verify2.log" 2>&1 ||
  fail "zinf-ckpt verify step-$((saved + 1)).h5 exited with $?"
echo "  files now: $(cd "$ckpt" && ls | tr '\n' ' ')"

echo "PASS: $host2 killed during the save of step $step: all hosts ended in $secs s; step $saved restored bitwise"
