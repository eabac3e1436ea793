#!/usr/bin/env bash
# A DeepSpeed user's config as it is, with fp16 dynamic loss scaling, on 2 ranks: the config
# carries DeepSpeed's GPU hints (overlap_comm, contiguous_gradients), a tensorboard block,
# stage3_gather_16bit_weights_on_model_save and offload_param.pin_memory, which load with the one
# INFO line naming them and no warning, and the stage 3 keys and the rest of offload_param on the
# CPU, which are read (zinf-train at stage 3 partitions its parameters above
# stage3_param_persistence_threshold, shards in host memory, and gathers them a layer at a time).
# fp16 starts at a loss scale of 2^24, so the first steps overflow (zinf-train rounds each
# micro-batch's scaled gradient to fp16, as an fp16 backward pass would) and are skipped while the
# scale halves; the loss then falls. A checkpoint of step 20 resumes (same ranks) with the same
# loss scale, skipped-step count and losses as the uninterrupted run.
#
#   deepspeed_fp16.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init deepspeed-fp16

cat > "$work/ds.json" <<JSON
{
  "train_micro_batch_size_per_gpu": 16,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "wall_clock_breakdown": false,
  "fp16": {"enabled": true, "auto_cast": false, "loss_scale": 0, "initial_scale_power": 24,
           "loss_scale_window": 10, "hysteresis": 2, "consecutive_hysteresis": false,
           "min_loss_scale": 1},
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                            "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5,
                           "total_num_steps": 400}},
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": 1e7,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_optimizer": {"device": "nvme", "nvme_path": "$work/nvme", "pin_memory": false},
    "offload_param": {"device": "cpu", "pin_memory": true}
  },
  "tensorboard": {"enabled": true, "output_path": "tb", "job_name": "fp16"}
}
JSON
mkdir -p "$work/nvme"

check "40 steps with the DeepSpeed config on 2 ranks exit 0"
train 2 120 --config "$work/ds.json" --steps 40 --checkpoint-dir "$work/ckpt" \
  --checkpoint-every 20 --metrics "$work/metrics.jsonl" > "$work/train.log" 2>&1 ||
  fail "zinf-train exited with $?"

check "one INFO line names the ignored keys, on rank 0 only; no warning"
lines=$(grep -c 'ignored, no effect in zinf: ' "$work/train.log")
[[ $lines == 1 ]] || fail "$lines 'ignored, no effect in zinf' lines, want 1"
# The keys the line names, one per line.
ignored=$(grep 'ignored, no effect in zinf: ' "$work/train.log" |
  sed -E 's/.*ignored, no effect in zinf: //; s/ \(docs\/.*//' | tr ',' '\n' | sed 's/^ *//')
for key in tensorboard zero_optimization.overlap_comm zero_optimization.contiguous_gradients \
  zero_optimization.stage3_gather_16bit_weights_on_model_save fp16.auto_cast \
  zero_optimization.offload_param.pin_memory; do
  grep -qx "$key" <<< "$ignored" || fail "the ignored-keys line does not name $key"
done
# offload_param's other keys and stage3_prefetch_bucket_size are read (pin_memory has no effect).
if grep -E '^zero_optimization\.(offload_param|stage3_prefetch_bucket_size$)' <<< "$ignored" |
    grep -vqx zero_optimization.offload_param.pin_memory; then
  fail "the ignored-keys line names a key zinf implements: $(tr '\n' ' ' <<< "$ignored")"
fi
# (The harness's own ZINF_E2E_OPTIMIZER_STATE is an unknown ZINF_* variable to zinf-train.)
warned=$(grep -E '\[(warn|warning|error)\]' "$work/train.log" | grep -v 'unknown ZINF_' | head -3)
[[ -z $warned ]] || fail "a warning or error line in the run: $warned"

check "metrics: steps 1..40; the first steps overflowed and were skipped; the scale came down"
problem=$(metrics_problem "$work/metrics.jsonl" 1 40 2) || fail "$problem"
skipped=$(metric "$work/metrics.jsonl" skipped_steps | awk '$1 == 40 { print $2 }')
first_scale=$(metric "$work/metrics.jsonl" loss_scale | awk '$1 == 1 { print $2 }')
last_scale=$(metric "$work/metrics.jsonl" loss_scale | awk '$1 == 40 { print $2 }')
echo "  skipped steps $skipped, loss scale $first_scale at step 1, $last_scale at step 40"
[[ $skipped -ge 2 && $skipped -le 30 ]] || fail "skipped steps $skipped, want 2..30"
awk -v a="$first_scale" -v b="$last_scale" 'BEGIN { exit !(a == 16777216 && b < a) }' ||
  fail "loss scale $first_scale -> $last_scale: want 2^24 falling"
grep -q 'fp16 overflow, step skipped (loss scale 16777216 -> ' "$work/train.log" ||
  fail "no 'fp16 overflow, step skipped' line"

check "the loss falls: the mean of steps 36..40 is below that of steps 1..5 by 0.8"
head5=$(mean_over "$work/metrics.jsonl" loss 1 5) || fail "steps 1..5 missing"
tail5=$(mean_over "$work/metrics.jsonl" loss 36 40) || fail "steps 36..40 missing"
echo "  loss $head5 -> $tail5"
awk -v h="$head5" -v t="$tail5" 'BEGIN { exit !(t < h - 0.8) }' ||
  fail "loss did not fall: $head5 -> $tail5"

check "resuming step 20 repeats steps 21..40: the same losses, loss scales and skipped steps"
train 2 120 --config "$work/ds.json" --steps 40 --checkpoint-dir "$work/ckpt2" \
  --resume "$work/ckpt/step-20.h5" --metrics "$work/resumed.jsonl" > "$work/resume.log" 2>&1 ||
  fail "the resumed run exited with $?"
for key in loss loss_scale skipped_steps; do
  want=$(metric "$work/metrics.jsonl" "$key" | awk '$1 > 20')
  got=$(metric "$work/resumed.jsonl" "$key" | awk '$1 > 20')
  [[ -n $got && $got == "$want" ]] || fail "$key after the resume differs:" \
    "$(diff <(echo "$want") <(echo "$got") | head -5)"
done

echo "PASS: $skipped steps skipped, scale $first_scale -> $last_scale, loss $head5 -> $tail5"
