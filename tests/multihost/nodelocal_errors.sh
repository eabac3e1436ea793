#!/usr/bin/env bash
# One host's node-local folder is missing, or full: 2 hosts x 2 ranks, the same --nvme-path on
# both hosts, which on the second host
#   missing: does not exist (an unmounted drive must not become a folder on the root file system);
#   full:    is a 1 MiB tmpfs (mounted in that host's namespace only) while each host's two ranks
#            need 12 MiB for their stores (a 1M-parameter synthetic model: fp32, exp_avg,
#            exp_avg_sq, and a spare slot per sub-group).
# Checks, per case: exit 1 within 60 s; every rank 0..3 prints exactly one "zinf-train failed: "
# line and the messages are identical; the message has the expected code (NotFound /
# ResourceExhausted), names the failing rank (2, the lowest on that host), the path, and the host
# (full: also the bytes needed and available); no swap store is left in the healthy host's folder.
# Both cases run even when the first fails.
#
#   nodelocal_errors.sh ZINF_TRAIN ZINF_CKPT [MPIEXEC]
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mh_binaries "$@"
mh_init nodelocal-errors 2 2
set -- $MH_HOSTS
host1=$1 host2=$2

failures=0
# case_failed CASE MESSAGE...: a FAIL line and the tail of the case's log; the next case still runs.
case_failed() {
  echo "FAIL: $1: ${*:2}" >&2
  [[ -f $MH_DIR/$1.log ]] && { echo "--- tail of $MH_DIR/$1.log" >&2; tail -8 "$MH_DIR/$1.log" >&2; }
  failures=$((failures + 1))
}

# run_case CASE CODE ARGS...: runs zinf-train on 2 x 2 with ARGS, then the checks.
run_case() {
  local tag=$1 code=$2 log=$MH_DIR/$1.log rc secs failed ranks messages t0
  shift 2
  check "$tag: 2 hosts x 2 ranks exit 1 within 60 s"
  t0=$(stamp)
  mh_mpirun 90 -np 4 "$zinf_train" --steps 2 --nvme-path "$MH_NVME" "$@" > "$log" 2>&1
  rc=$?
  secs=$(elapsed "$t0")
  echo "  exit $rc after $secs s"
  ((rc == 1)) || { case_failed "$tag" "exit status $rc, expected 1"; return; }
  awk -v s="$secs" 'BEGIN { exit !(s < 60) }' || { case_failed "$tag" "took $secs s"; return; }

  check "$tag: every rank prints one identical 'zinf-train failed: ' line"
  failed=$(grep -F 'zinf-train failed: ' "$log")
  ranks=$(sed -nE 's/.*\[rank ([0-9]+)\/4\].*zinf-train failed: .*/\1/p' <<< "$failed" | sort -n | tr '\n' ' ')
  [[ $ranks == "0 1 2 3 " ]] || { case_failed "$tag" "failure lines from ranks [$ranks]"; return; }
  messages=$(sed -e 's/.*zinf-train failed: //' <<< "$failed" | sort -u)
  (($(wc -l <<< "$messages") == 1)) || { case_failed "$tag" "the ranks' messages differ:
$messages"; return; }
  echo "  every rank: $messages"

  check "$tag: the message says $code, rank 2, the path $MH_NVME and the host $host2"
  [[ $messages == "$code: rank 2: "* ]] || case_failed "$tag" "does not start with '$code: rank 2: '"
  [[ $messages == *"$MH_NVME"* ]] || case_failed "$tag" "does not name the path"
  [[ $messages == *"$host2"* ]] || case_failed "$tag" "does not name the host $host2"
  [[ $tag != full || $messages == *needs*bytes*available* ]] ||
    case_failed "$tag" "does not say the bytes needed and available"

  check "$tag: no swap store is left in $host1's folder"
  left=$(ls -A "$MH_DIR/nodes/$host1/nvme")
  [[ -z $left ]] || case_failed "$tag" "$host1's folder holds: $left"
}

rmdir "$MH_DIR/nodes/$host2/nvme"
run_case missing NotFound --hidden 128

mkdir "$MH_DIR/nodes/$host2/nvme"
mh_set_tmpfs "$host2" 1M
cat > "$MH_DIR/shared/synthetic.json" << EOF
{"train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 1, "sub_group_size": 262144,
                       "offload_optimizer": {"device": "nvme", "pipeline_read": false,
                                             "pipeline_write": false}},
 "zinf": {"model": {"name": "synthetic", "total_params": 1000000, "num_params": 4}}}
EOF
run_case full ResourceExhausted --config "$MH_DIR/shared/synthetic.json"

((failures == 0)) || { echo "FAIL: $failures check(s) failed" >&2; exit 1; }
echo "PASS: a missing and a full node-local folder on $host2 fail every rank alike, naming it"
