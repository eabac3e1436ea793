#!/usr/bin/env bash
# The host memory tier and offload_optimizer.device "cpu" train exactly as the swapped run, and
# their checkpoints restore across tiers and world sizes. Run A: 20 steps on 2 ranks, every
# sub-group swapped. Run B: 10 steps on 2 ranks with zinf.host_cache_bytes holding 2 of the
# ranks' sub-groups (checkpoint at 10). Run C: B's step 10 resumed on 2 ranks, untiered, to 20.
# Run D: B's step 10 resumed on 3 ranks with device "cpu" (no swap path at all) to 15, then run E
# back on 2 ranks with the tier, to 20.
# Checks: every run exits 0; B's losses of steps 1..10 are A's exactly (the tier changes where
# the state lives, not one bit of it); C's losses 11..20 are A's exactly (a tiered checkpoint
# restores untiered); D resumed at step 11 and E at 16 with world sizes 3 and 2; the step-20
# checkpoints of C and E verify; B, D and E say how many sub-groups they keep in memory.
#
#   tiered_resume.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init tiered-resume
mkdir -p "$work/swap-a" "$work/swap-b" "$work/swap-c" "$work/swap-e"

# charlm hidden 256, layers 2: 8 sub-groups of 16384 elements per rank on 2 ranks. 2 sub-groups
# of fp32 state are 2 x 16384 x 12 bytes = 384 KiB; of q8 state, 3 fit.
config() {  # config FILE DEVICE CACHE_BYTES
  cat > "$1" << JSON
{"train_micro_batch_size_per_gpu": 32,
 "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003,
                                              "warmup_num_steps": 20, "warmup_type": "linear"}},
 "zero_optimization": {"stage": 1, "sub_group_size": 16384,
                       "offload_optimizer": {"device": "$2", "pipeline_read": true,
                                             "pipeline_write": true}},
 "zinf": {"model": {"name": "charlm", "hidden": 256, "layers": 2}, "seed": 1234,
          "host_cache_bytes": $3}}
JSON
}
config "$work/swapped.json" nvme 0
config "$work/tiered.json" nvme 393216
config "$work/cpu.json" cpu 0

t0=$(stamp)
check "run A: 20 steps on 2 ranks, all swapped"
train 2 100 --config "$work/swapped.json" --nvme-path "$work/swap-a" --steps 20 \
  --metrics "$work/a.jsonl" > "$work/a.log" 2>&1 || fail "run A exited with $?"
check "run B: 10 steps on 2 ranks with the host tier, checkpoint at 10"
train 2 60 --config "$work/tiered.json" --nvme-path "$work/swap-b" --steps 10 \
  --metrics "$work/b.jsonl" --checkpoint-dir "$work/ckpt-b" --checkpoint-every 10 \
  > "$work/b.log" 2>&1 || fail "run B exited with $?"
# "8 sub-groups of <= 16384 elements per rank, 2 resident in host memory": some, not all.
read -r total resident < <(sed -n 's/.* \([0-9]*\) sub-groups of <= [0-9]* elements per rank, \([0-9]*\) resident.*/\1 \2/p' "$work/b.log" | head -1)
(( ${resident:-0} > 0 && resident < total )) ||
  fail "run B keeps ${resident:-?} of ${total:-?} sub-groups in memory, not some: $(grep -m1 'optimizer swapper' "$work/b.log")"
echo "  run B keeps $resident of $total sub-groups per rank in memory"
check "run C: B's step 10 resumed untiered on 2 ranks, to 20"
train 2 60 --config "$work/swapped.json" --nvme-path "$work/swap-c" --steps 20 \
  --metrics "$work/c.jsonl" --checkpoint-dir "$work/ckpt-b" --checkpoint-every 10 \
  --resume latest > "$work/c.log" 2>&1 || fail "run C exited with $?"
check "run D: B's step 10 resumed with device cpu on 3 ranks, to 15"
train 3 60 --config "$work/cpu.json" --steps 15 --metrics "$work/d.jsonl" \
  --checkpoint-dir "$work/ckpt-d" --checkpoint-every 15 --resume "$work/ckpt-b/step-10.h5" \
  > "$work/d.log" 2>&1 || fail "run D exited with $?"
grep -q 'no swap store (offload_optimizer.device "cpu")' "$work/d.log" ||
  fail "run D does not say it has no swap store: $(grep -m1 'optimizer swapper' "$work/d.log")"
check "run E: D's step 15 resumed with the host tier on 2 ranks, to 20"
train 2 60 --config "$work/tiered.json" --nvme-path "$work/swap-e" --steps 20 \
  --metrics "$work/d.jsonl" --checkpoint-dir "$work/ckpt-d" --checkpoint-every 20 \
  --resume latest > "$work/e.log" 2>&1 || fail "run E exited with $?"
echo "  five runs took $(elapsed "$t0") s"

check "B's losses of steps 1..10 are A's exactly"
diff <(metric "$work/a.jsonl" loss | awk '$1 <= 10') <(metric "$work/b.jsonl" loss) \
  > "$work/diff-b.txt" || fail "tiered steps differ from swapped ones:
$(cat "$work/diff-b.txt")"
check "C's losses of steps 11..20 are A's exactly"
diff <(metric "$work/a.jsonl" loss | awk '$1 > 10') <(metric "$work/c.jsonl" loss) \
  > "$work/diff-c.txt" || fail "the untiered resume of a tiered checkpoint differs:
$(cat "$work/diff-c.txt")"
check "D and E: steps 11..20, world size 3 for 11..15, 2 for 16..20"
got=$(metric "$work/d.jsonl" step | awk '{ printf "%s ", $1 }')
[[ $got == "$(seq -s ' ' 11 20) " ]] || fail "runs D and E's metrics steps: $got"
ws=$(metric "$work/d.jsonl" world_size | awk '{ printf "%s ", $2 }')
[[ $ws == "$(printf '3 %.0s' {11..15})$(printf '2 %.0s' {16..20})" ]] ||
  fail "runs D and E's world sizes: $ws"
for ckpt in "$work/ckpt-b/step-20.h5" "$work/ckpt-d/step-20.h5"; do
  check "$ckpt verifies"
  timeout 60 "$zinf_ckpt" verify "$ckpt" > "$work/verify.log" 2>&1 ||
    fail "zinf-ckpt verify $ckpt exited with $?"
done
echo "PASS: tiered and device-cpu runs equal the swapped run; checkpoints cross tiers and sizes"
