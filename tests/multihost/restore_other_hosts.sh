#!/usr/bin/env bash
# A checkpoint written by 2 hosts x 2 ranks (node-local swap stores, one shared HDF5 file)
# restores on 3 hosts x 1 rank and on 1 host x 3 ranks, to the same state, and training continues.
#
# zinf-train saves nothing when resumed with nothing to do, so the restored state is compared one
# step later: both resumes run on 3 ranks (the same world size, so the same batches) from the same
# step-20.h5 to step 22 with a checkpoint every step. Restores that produced the same state element
# by element give bitwise-equal losses and gradient norms (the step-21 loss is computed from the
# restored weights before any update) and bitwise-equal optimizer states in step-21.h5 and
# step-22.h5 (h5diff of /state/fp32, /state/exp_avg, /state/exp_avg_sq; the Adam update of a
# different restored state would differ). The 1 x 3 run is the single-host reference; the 3 x 1
# run reads its partitions across hosts. A restore that lost the weights starts near ln(256) =
# 5.55, so the first loss after the restore is also checked against the 2 x 2 run's last loss.
#
# The two resumes run 1 rank per host and 3 ranks on one host: zinf.compute_threads pins the BLAS
# threads to 1 in both, since the losses are compared bitwise (an sgemm split over 2 threads can
# differ in the last bits from 1 thread on some CPUs' kernels, e.g. AMD Zen 3).
#
# Checks: every run exits 0; step-20.h5 verifies; the resumes' metrics hold steps 21..22 with
# world_size 3 and finite losses; their losses and grad norms are identical; their step-21.h5 and
# step-22.h5 state datasets are identical (h5diff) and verify; the step-21 loss is within 10% of
# the 2 x 2 run's step-20 loss.
#
#   restore_other_hosts.sh ZINF_TRAIN ZINF_CKPT [MPIEXEC]
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mh_binaries "$@"
mh_init restore-other-hosts 3 3
set -- $MH_HOSTS
host1=$1 host2=$2 host3=$3
mh_hostfile "$MH_DIR/hosts-2x2" "$host1:2" "$host2:2"
mh_hostfile "$MH_DIR/hosts-3x1" "$host1:1" "$host2:1" "$host3:1"
mh_hostfile "$MH_DIR/hosts-1x3" "$host3:3"
command -v h5diff > /dev/null || mh_skip "h5diff (hdf5-tools) is not installed"

cat > "$MH_DIR/shared/config.json" << EOF
{"train_micro_batch_size_per_gpu": 16,
 "zero_optimization": {"stage": 1, "sub_group_size": 16384,
                       "offload_optimizer": {"device": "nvme", "pipeline_read": true,
                                             "pipeline_write": true}},
 "zinf": {"model": {"name": "charlm", "hidden": 128, "layers": 1}, "seed": 11,
          "compute_threads": 1}}
EOF
common=(--config "$MH_DIR/shared/config.json" --nvme-path "$MH_NVME")

check "2 hosts x 2 ranks: 20 steps, checkpoint at 20 in the shared folder"
t0=$(stamp)
MH_HOSTFILE=$MH_DIR/hosts-2x2 mh_mpirun 120 -np 4 "$zinf_train" "${common[@]}" --steps 20 \
  --checkpoint-dir "$MH_DIR/shared/ckpt" --checkpoint-every 20 \
  --metrics "$MH_DIR/shared/m-2x2.jsonl" > "$MH_DIR/train-2x2.log" 2>&1 ||
  fail "the 2 x 2 run exited with $?"
echo "  took $(elapsed "$t0") s"
saved=$MH_DIR/shared/ckpt/step-20.h5
[[ $(cat "$MH_DIR/shared/ckpt/latest" 2> /dev/null) == step-20.h5 ]] ||
  fail "latest is '$(cat "$MH_DIR/shared/ckpt/latest" 2>&1)', not step-20.h5"
timeout 60 "$zinf_ckpt" verify "$saved" > "$MH_DIR/verify-20.log" 2>&1 ||
  fail "zinf-ckpt verify step-20.h5 exited with $?"

for shape in 3x1 1x3; do
  check "$shape: resume step-20.h5 (saved on 2 x 2) to step 22, a checkpoint every step"
  t0=$(stamp)
  MH_HOSTFILE=$MH_DIR/hosts-$shape mh_mpirun 120 -np 3 "$zinf_train" "${common[@]}" --steps 22 \
    --resume "$saved" --checkpoint-dir "$MH_DIR/shared/ckpt-$shape" --checkpoint-every 1 \
    --metrics "$MH_DIR/shared/m-$shape.jsonl" > "$MH_DIR/train-$shape.log" 2>&1 ||
    fail "the $shape resume exited with $?"
  echo "  took $(elapsed "$t0") s"
  grep -q "node 0 (" "$MH_DIR/train-$shape.log" || fail "$shape: no per-node table"
  nodes=$(grep -c "^  node [0-9]* (" "$MH_DIR/train-$shape.log")
  [[ $shape == 3x1 && $nodes == 3 || $shape == 1x3 && $nodes == 1 ]] ||
    fail "$shape: rank 0's per-node table lists $nodes node(s)"

  check "$shape: metrics of steps 21..22, world_size 3, finite losses"
  problem=$(metrics_problem "$MH_DIR/shared/m-$shape.jsonl" 21 22 3) || fail "$shape: $problem"
done

check "3 x 1 and 1 x 3: identical losses and gradient norms at steps 21 and 22"
for key in loss grad_norm; do
  a=$(metric "$MH_DIR/shared/m-3x1.jsonl" "$key" | tr '\n' ' ')
  b=$(metric "$MH_DIR/shared/m-1x3.jsonl" "$key" | tr '\n' ' ')
  echo "  $key: 3x1 [$a] 1x3 [$b]"
  [[ $a == "$b" ]] || fail "the resumes' ${key}s differ: 3x1 [$a], 1x3 [$b]"
done

check "3 x 1 and 1 x 3: step-21.h5 and step-22.h5 hold identical optimizer states, and verify"
for step in 21 22; do
  a=$MH_DIR/shared/ckpt-3x1/step-$step.h5
  b=$MH_DIR/shared/ckpt-1x3/step-$step.h5
  for state in fp32 exp_avg exp_avg_sq; do
    h5diff "$a" "$b" "/state/$state" > "$MH_DIR/h5diff.log" 2>&1 ||
      fail "step $step /state/$state differs between 3x1 and 1x3: $(head -5 "$MH_DIR/h5diff.log")"
  done
  for f in "$a" "$b"; do
    timeout 60 "$zinf_ckpt" verify "$f" > "$MH_DIR/verify.log" 2>&1 ||
      fail "zinf-ckpt verify $f exited with $?"
  done
done
numel=$(h5ls "$MH_DIR/shared/ckpt-3x1/step-21.h5/state/fp32" 2> /dev/null | sed -n 's/.*{\([0-9]*\)}.*/\1/p')
echo "  3 x $numel elements equal at each step"

check "the first loss after the restore is within 10% of the 2 x 2 run's step-20 loss"
l20=$(metric "$MH_DIR/shared/m-2x2.jsonl" loss | awk '$1 == 20 { print $2 }')
l21=$(metric "$MH_DIR/shared/m-3x1.jsonl" loss | awk '$1 == 21 { print $2 }')
first=$(metric "$MH_DIR/shared/m-2x2.jsonl" loss | awk '$1 == 1 { print $2 }')
echo "  step 1 (fresh): $first, step 20 (2 x 2): $l20, step 21 (3 ranks, restored): $l21"
awk -v a="$l20" -v b="$l21" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(d <= 0.1 * a) }' ||
  fail "the restored loss $l21 is not within 10% of $l20"

echo "PASS: a 2 x 2 checkpoint restores on 3 x 1 and 1 x 3 to identical states; training continues"
