#!/usr/bin/env bash
# Resume on 3 ranks from a 2-rank checkpoint runs and keeps the loss within the uninterrupted
# run's tolerance. Run A: 30 steps on 2 ranks. Run B: 15 steps on 2 ranks (checkpoint at 15),
# then --resume latest --steps 30 on 3 ranks. The config gives only
# train_micro_batch_size_per_gpu, so the batch arithmetic holds on any world size (the global
# batch grows by 3/2 on 3 ranks, and the batches differ, so the losses are not identical).
# Checks: all runs exit 0; B's losses of steps 1..15 equal A's exactly (same ranks); B's metrics
# hold steps 1..30 with world_size 2, then 3 from step 16; B's loss at step 16 and its mean loss
# over steps 26..30 are within TOLERANCE (relative) of A's; B's step-30.h5 says it was saved on 3
# ranks and verifies.
#
#   resume_other_ranks.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init resume-other-ranks
mkdir -p "$work/swap-a" "$work/swap-b"

# Relative tolerance of the loss comparisons; see the comment at the checks for why 10%.
tolerance=0.10

# A small charlm with the built-in default's optimizer and schedule, written out so that the
# tolerance below stays tied to the numbers it was chosen from; the per-rank micro-batch is the
# only batch key. --nvme-path sets the swap directory (and device nvme) per run.
cat > "$work/config.json" << EOF
{"train_micro_batch_size_per_gpu": 32,
 "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003,
                                              "warmup_num_steps": 20, "warmup_type": "linear"}},
 "zero_optimization": {"stage": 1, "sub_group_size": 65536,
                       "offload_optimizer": {"pipeline_read": true, "pipeline_write": true}},
 "zinf": {"model": {"name": "charlm", "hidden": 256, "layers": 2}, "seed": 1234}}
EOF

t0=$(stamp)
check "run A: 30 steps on 2 ranks"
train 2 100 --config "$work/config.json" --nvme-path "$work/swap-a" --steps 30 \
  --metrics "$work/a.jsonl" > "$work/a.log" 2>&1 || fail "run A exited with $?"
check "run B: 15 steps on 2 ranks, checkpoint at 15"
train 2 60 --config "$work/config.json" --nvme-path "$work/swap-b" --steps 15 \
  --metrics "$work/b.jsonl" --checkpoint-dir "$work/ckpt" --checkpoint-every 15 \
  > "$work/b1.log" 2>&1 || fail "run B (steps 1..15, 2 ranks) exited with $?"
[[ $(cat "$work/ckpt/latest" 2> /dev/null) == step-15.h5 ]] ||
  fail "after run B's first part, latest is '$(cat "$work/ckpt/latest" 2>&1)', not step-15.h5"
check "run B: --resume latest --steps 30 on 3 ranks"
train 3 100 --config "$work/config.json" --nvme-path "$work/swap-b" --steps 30 \
  --metrics "$work/b.jsonl" --checkpoint-dir "$work/ckpt" --checkpoint-every 15 --resume latest \
  > "$work/b2.log" 2>&1 || fail "run B (resume from the 2-rank step 15 on 3 ranks) exited with $?"
echo "  three runs took $(elapsed "$t0") s"

check "B's metrics: steps 1..30; world_size 2 for 1..15, 3 for 16..30"
got=$(metric "$work/b.jsonl" step | awk '{ printf "%s ", $1 }')
[[ $got == "$(seq -s ' ' 1 30) " ]] || fail "run B's metrics steps: $got"
ws=$(metric "$work/b.jsonl" world_size | awk '{ printf "%s ", $2 }')
[[ $ws == "$(printf '2 %.0s' {1..15})$(printf '3 %.0s' {16..30})" ]] ||
  fail "run B's world sizes: $ws"

check "B's losses of steps 1..15 (2 ranks) are A's exactly"
diff <(metric "$work/a.jsonl" loss | awk '$1 <= 15') \
     <(metric "$work/b.jsonl" loss | awk '$1 <= 15') > "$work/diff.txt" ||
  fail "steps 1..15 differ between runs on the same 2 ranks:
$(cat "$work/diff.txt")"

show() { metric "$1" loss | awk '$1 > 15 { printf "%d:%.4f ", $1, $2 }'; }
echo "  A (2 ranks):         $(show "$work/a.jsonl")"
echo "  B (3 ranks from 16): $(show "$work/b.jsonl")"
a16=$(mean_over "$work/a.jsonl" loss 16 16) || fail "run A lacks step 16"
b16=$(mean_over "$work/b.jsonl" loss 16 16) || fail "run B lacks step 16"
a_mean=$(mean_over "$work/a.jsonl" loss 26 30) || fail "run A lacks steps 26..30"
b_mean=$(mean_over "$work/b.jsonl" loss 26 30) || fail "run B lacks steps 26..30"
echo "  loss at step 16: A $a16, B $b16; mean of steps 26..30: A $a_mean, B $b_mean"

# The tolerance. Batches differ per world size (3 ranks draw other windows, and 3/2 as many), so
# the losses differ and only their level can be compared. Observed (2-core CI machine, built-in
# settings) for |B - A| / A, at step 16 and for the mean of steps 26..30:
#   seed 1234: 1.2%, 3.6%;  seeds 1..5: 1.6% 1.6% 0.2% 0.2% 2.6%, and 2.7% 6.0% 0.5% 0.8% 0.6%.
# Single steps scatter by +-0.3 around 3.3..3.8, so a 5-step mean moves by up to ~6%; 10% keeps a
# margin over that. A resume that lost the weights starts step 16 at ln(256) = 5.55, 40..60%
# above A's 3.4..4.2, and the step-16 loss depends only on the restored weights (it is computed
# before the update), so that check catches a broken restore that the later mean could hide.
check "B's loss at step 16 (the first on 3 ranks: restored weights) within $tolerance of A's"
within "$a16" "$b16" "$tolerance" ||
  fail "the 3-rank resume's first loss $b16 is not within $tolerance of the uninterrupted $a16"
check "B's mean loss over steps 26..30 within $tolerance of A's"
within "$a_mean" "$b_mean" "$tolerance" ||
  fail "the 3-rank resume's mean loss $b_mean is not within $tolerance of the uninterrupted $a_mean"

check "B's step-30.h5 was saved on 3 ranks and verifies"
[[ $(cat "$work/ckpt/latest") == step-30.h5 ]] || fail "latest is '$(cat "$work/ckpt/latest")'"
timeout 60 "$zinf_ckpt" ls "$work/ckpt/step-30.h5" > "$work/ls.log" 2>&1 ||
  fail "zinf-ckpt ls step-30.h5 exited with $?"
grep -q 'step 30, saved on 3 rank' "$work/ls.log" ||
  fail "zinf-ckpt ls does not say step 30, saved on 3 ranks: $(grep -m1 step "$work/ls.log")"
timeout 60 "$zinf_ckpt" verify "$work/ckpt/step-30.h5" > "$work/verify.log" 2>&1 ||
  fail "zinf-ckpt verify step-30.h5 exited with $?"

echo "PASS: 2 -> 3 rank resume, mean loss of steps 26..30 $b_mean vs uninterrupted $a_mean"
