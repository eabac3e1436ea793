#!/usr/bin/env bash
# zinf-train at ZeRO stage 3 (issue 42): the synthetic model partitioned, its shards read from the
# swap store (offload_param nvme, max_in_cpu 0), trains on 2 ranks (the loss falls), and its
# checkpoints resume across stages and world sizes. A stage 3 checkpoint holds the same
# parameters as a stage 1/2 one:
#   A: stage 3 on 2 ranks, 8 steps, a checkpoint at 4; B: stage 2 on 3 ranks resumes A's step 4.
#   C: stage 2 on 3 ranks, 8 steps, a checkpoint at 4; D: stage 3 on 2 ranks resumes C's step 4.
# The synthetic pseudo-loss (0.5 mean w^2) depends on the weights only, and a step's loss is that
# of the weights before its update, so the resumed run's first loss (step 5) is the loss of the
# restored weights: it must equal the uninterrupted run's step 5 up to the order of float sums
# (1e-5 relative). A restore that lost or scrambled the weights moves it by far more.
#
#   stage3_resume.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init stage3-resume
mkdir -p "$work/swap"

tolerance=0.00001

# config STAGE: the run's config; stage 3 with the parameters' shards on NVMe (also in a
# directory of their own, as DeepSpeed configs give it: accepted, nothing written there).
config() {
  local param=""
  if (($1 == 3)); then
    param=', "stage3_param_persistence_threshold": 0,
             "offload_param": {"device": "nvme", "max_in_cpu": 0,
                               "nvme_path": "'"$work"'/param-dir"}'
  fi
  cat << EOF
{"train_micro_batch_size_per_gpu": 2,
 "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
 "zero_optimization": {"stage": $1, "sub_group_size": 4096,
                       "offload_optimizer": {"device": "nvme", "nvme_path": "$work/swap"}$param},
 "zinf": {"model": {"name": "synthetic", "total_params": 40000, "num_params": 5}, "seed": 7}}
EOF
}
config 2 > "$work/stage2.json"
config 3 > "$work/stage3.json"

t0=$(stamp)
check "A: stage 3 on 2 ranks, 8 steps, checkpoint at 4"
train 2 100 --config "$work/stage3.json" --steps 8 --metrics "$work/a.jsonl" \
  --checkpoint-dir "$work/ckpt-a" --checkpoint-every 4 > "$work/a.log" 2>&1 ||
  fail "run A exited with $?"
grep -q "stage 3: the parameters are partitioned" "$work/a.log" ||
  fail "run A does not say that its parameters are partitioned"
grep -q 'offload_param.nvme_path ".*param-dir" not used' "$work/a.log" ||
  fail "run A does not name the unused offload_param.nvme_path in an INFO line"
[[ ! -e $work/param-dir ]] || fail "something was written to offload_param.nvme_path"
check "B: stage 2 on 3 ranks resumes A's step 4"
train 3 100 --config "$work/stage2.json" --steps 8 --metrics "$work/b.jsonl" \
  --checkpoint-dir "$work/ckpt-b" --resume "$work/ckpt-a/step-4.h5" > "$work/b.log" 2>&1 ||
  fail "run B exited with $?"
check "C: stage 2 on 3 ranks, 8 steps, checkpoint at 4"
train 3 100 --config "$work/stage2.json" --steps 8 --metrics "$work/c.jsonl" \
  --checkpoint-dir "$work/ckpt-c" --checkpoint-every 4 > "$work/c.log" 2>&1 ||
  fail "run C exited with $?"
check "D: stage 3 on 2 ranks resumes C's step 4"
train 2 100 --config "$work/stage3.json" --steps 8 --metrics "$work/d.jsonl" \
  --checkpoint-dir "$work/ckpt-d" --resume "$work/ckpt-c/step-4.h5" > "$work/d.log" 2>&1 ||
  fail "run D exited with $?"
echo "  four runs took $(elapsed "$t0") s"

check "A's loss falls"
a1=$(mean_over "$work/a.jsonl" loss 1 1) || fail "run A lacks step 1"
a8=$(mean_over "$work/a.jsonl" loss 8 8) || fail "run A lacks step 8"
echo "  A: step 1 $a1, step 8 $a8"
awk -v a="$a1" -v b="$a8" 'BEGIN { exit !(b < 0.9 * a) }' ||
  fail "run A's loss did not fall: $a1 -> $a8"

for pair in "a b" "c d"; do
  read -r from to <<< "$pair"
  # The losses as written (mean_over rounds to 6 decimals, too coarse here).
  x=$(metric "$work/$from.jsonl" loss | awk '$1 == 5 { print $2 }')
  y=$(metric "$work/$to.jsonl" loss | awk '$1 == 5 { print $2 }')
  [[ -n $x && -n $y ]] || fail "run ${from^^} or ${to^^} lacks step 5"
  first=$(metric "$work/$to.jsonl" step | awk 'NR == 1 { print $1 }')
  [[ $first == 5 ]] || fail "run ${to^^} began at step '$first', not 5"
  check "${to^^}'s first loss (restored weights) within $tolerance of ${from^^}'s step 5"
  echo "  ${from^^} $x, ${to^^} $y"
  within "$x" "$y" "$tolerance" ||
    fail "run ${to^^} resumed ${from^^}'s step 4 to a step-5 loss of $y, not $x"
done
echo "PASS: stage 3 trains; stage 3 <-> stage 2 checkpoints resume across 2 and 3 ranks"
