#!/usr/bin/env bash
# `zinf-ckpt import-deepspeed` (interop/deepspeed_import.h) on zinf's own exports:
#
#   deepspeed_import_test.sh roundtrip ZINF_TRAIN ZINF_CKPT MPIEXEC MAKE_CKPT
#       zinf checkpoints made on N ranks -> `export --format deepspeed --world-size W` ->
#       import-deepspeed -> the same weights, exp_avg and exp_avg_sq bitwise (`export --format
#       safetensors --moments` of both; a q8 checkpoint's moments decoded, as the export writes
#       them), the original's step, skipped steps, scheduler position, loss scaler, groups and
#       user state, and `verify` passes. Pairs (N -> W), every N and W in 1..4, fp32 and q8:
#         zinf-train fp32       1 -> 3, 1 -> 4
#         zinf-train q8         3 -> 1, 3 -> 2
#         zinf-train fp32, 2.4M elements in 2 params (several checkpoint chunks, params across
#         them, each param over the import's 1 Mi-element piece)                          2 -> 3
#         deepspeed_export_make_ckpt q8 (two interleaved groups, Adam with L2 decay, fp16 with a
#         dynamic loss scaler after a skipped step, a nested user state)  2 -> 4, 4 -> 1
#       and as DeepSpeed's universal layout (`--format deepspeed-universal`): zinf-train fp32
#       1 -> 2, the generator's q8 4 -> 3. The generator's fp32 checkpoint (synthetic state, a
#       negative exp_avg_sq) is refused on import.
#   deepspeed_import_test.sh resume ZINF_TRAIN ZINF_CKPT MPIEXEC
#       zinf-train (fp16 with a dynamic loss scale and skipped steps, a WarmupLR schedule) saves
#       step 4 on 2 ranks; exported for W = 3 and imported, it resumes on 3 ranks for 2 steps
#       exactly as the original file does: the next checkpoints hold the same weights, moments
#       and trainer state, bitwise.
#   deepspeed_import_test.sh torch ZINF_CKPT PYTHON
#       zinf.torch (PYTHONPATH holds the package): a small model trained 2 steps and saved,
#       exported (W = 2) and imported, continues in a new ZeroOptimizer(load=imported) exactly as
#       from the original (deepspeed_import_torch.py); 77 (skipped) without torch.
set -u
mode=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=/usr/bin/python3
# shellcheck disable=SC2054  # "self,vader,tcp" is one argument
mpiexec_flags=(--allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader,tcp
               --mca btl_tcp_if_include lo)
if [[ $mode == torch ]]; then
  zinf_ckpt=$(readlink -f "$2")
  python=$3
  if ! "$python" -c 'import torch, zinf.torch' > /dev/null 2>&1; then
    echo "SKIP: $python cannot import torch and zinf.torch (PYTHONPATH=${PYTHONPATH:-})"
    exit 77
  fi
else
  zinf_train=$(readlink -f "$2")
  zinf_ckpt=$(readlink -f "$3")
  mpiexec=$4
  make_ckpt=${5:+$(readlink -f "$5")}
fi

work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-dsimport-XXXXXX") ||
  { echo "FAIL: cannot make a scratch directory" >&2; exit 1; }
trap 'cd /; rm -rf "$work"' EXIT
cd "$work" || exit 1
export PYTHONDONTWRITEBYTECODE=1 ZINF_LOG_LEVEL=warn

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}

train() {  # train NAME NP CONFIG STATE STEPS [zinf-train flags...]
  local name=$1 np=$2 config=$3 state=$4 steps=$5
  shift 5
  mkdir -p "$work/swap-$name"
  timeout --kill-after=10 120 "$mpiexec" "${mpiexec_flags[@]}" -np "$np" "$zinf_train" \
    --config "$config" --steps "$steps" --nvme-path "$work/swap-$name" --optimizer-state "$state" \
    --checkpoint-dir "$work/$name" --checkpoint-every "$steps" "$@" > "$name.log" 2>&1 ||
    fail "zinf-train $name exited with $?"
}

import_ds() {  # import_ds SRC OUT_FILE W [universal]: export SRC for W ranks, import it, verify
  local src=$1 out=$2 w=$3 format=deepspeed kind=deepspeed
  [[ ${4:-} == universal ]] && format=deepspeed-universal kind="deepspeed universal,"
  timeout 120 "$zinf_ckpt" export "$src" --format "$format" --out "$out.ds" --world-size "$w" \
    > "$(basename "$out").export.log" 2>&1 || fail "export of $src ($format, W=$w) exited with $?"
  timeout 120 "$zinf_ckpt" import-deepspeed "$out.ds" --out "$out" \
    > "$(basename "$out").import.log" 2>&1 || fail "import of $out.ds exited with $?"
  grep -q "^wrote $out ($kind ZeRO stage 2, $w rank(s), step " "$(basename "$out").import.log" ||
    fail "import of $out.ds: no summary line: $(cat "$(basename "$out").import.log")"
  timeout 120 "$zinf_ckpt" verify "$out" > /dev/null 2>&1 || fail "verify $out: $("$zinf_ckpt" \
    verify "$out" 2>&1)"
}

if [[ $mode == roundtrip ]]; then
  for size in small big; do
    total=10007 params=5
    [[ $size == big ]] && total=2400007 params=2
    cat > "$size.json" << EOF
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
 "zinf": {"model": {"name": "synthetic", "total_params": $total, "num_params": $params}}}
EOF
  done
  train train-fp32 1 small.json fp32 3
  train train-q8 3 small.json q8 3
  train big-fp32 2 big.json fp32 2
  for spec in fp32:2 q8:2 q8:4; do
    state=${spec%:*} np=${spec#*:}
    mkdir -p "$work/swap-groups-$state-$np"
    timeout --kill-after=10 60 "$mpiexec" "${mpiexec_flags[@]}" -np "$np" "$make_ckpt" \
      "$work/groups-$state-$np" "$work/swap-groups-$state-$np" "$state" \
      > "groups-$state-$np.log" 2>&1 ||
      fail "deepspeed_export_make_ckpt $state on $np ranks exited with $?"
  done
  for pair in train-fp32:3 train-fp32:4 train-q8:1 train-q8:2 big-fp32:3 groups-q8-2:4 \
              groups-q8-4:1 train-fp32:2:universal groups-q8-4:3:universal; do
    IFS=: read -r ckpt w universal <<< "$pair"
    name=$ckpt-w$w${universal:+-universal}
    import_ds "$work/$ckpt" "$work/$name.h5" "$w" "$universal"
    "$python" "$here/deepspeed_import_check.py" roundtrip "$zinf_ckpt" "$work/$ckpt" \
      "$work/$name.h5" "$w" > "check-$name.log" 2>&1 ||
      fail "$ckpt -> W=$w $universal -> import: $(cat "check-$name.log")"
    echo "$ckpt -> deepspeed W=$w $universal -> zinf: $(cat "check-$name.log")"
  done
  # The generator's fp32 state is not Adam's: its exp_avg_sq holds negative values, which no
  # Adam step makes. Exported, it is refused on import, naming the value; nothing is written.
  timeout 120 "$zinf_ckpt" export "$work/groups-fp32-2" --format deepspeed --out "$work/neg.ds" \
    --world-size 3 > neg.export.log 2>&1 || fail "export of groups-fp32-2 exited with $?"
  timeout 120 "$zinf_ckpt" import-deepspeed "$work/neg.ds" --out "$work/neg.h5" > neg.log 2>&1
  rc=$?
  if [[ $rc != 1 ]] || ! grep -q "exp_avg_sq: element .* (a negative second moment)" neg.log; then
    fail "a negative exp_avg_sq: exit $rc, $(cat neg.log)"
  fi
  leftovers=$(find "$work" -maxdepth 1 \( -name 'neg.h5*' -o -name '.neg.h5*' \))
  [[ -z $leftovers ]] || fail "a refused import left $leftovers"
  echo "negative exp_avg_sq refused: $(tail -1 neg.log)"
  exit 0
fi

if [[ $mode == resume ]]; then
  # initial_scale_power 18: the first steps overflow in fp16 and are skipped, so the step, the
  # skipped steps, the scale and the schedule's position all matter to the next steps.
  cat > fp16.json << 'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
 "fp16": {"enabled": true, "initial_scale_power": 18, "hysteresis": 1, "loss_scale_window": 2},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                              "warmup_num_steps": 10, "warmup_type": "linear"}},
 "zinf": {"model": {"name": "synthetic", "total_params": 10007, "num_params": 5}}}
EOF
  train orig 2 fp16.json fp32 4
  "$zinf_ckpt" ls "$work/orig" | grep -q '"skipped_steps":[1-9]' ||
    fail "the original checkpoint skipped no step: $("$zinf_ckpt" ls "$work/orig" | grep trainer)"
  import_ds "$work/orig" "$work/imported.h5" 3
  train from-orig 3 fp16.json fp32 6 --resume "$work/orig/step-4.h5"
  train from-imported 3 fp16.json fp32 6 --resume "$work/imported.h5"
  "$python" "$here/deepspeed_import_check.py" same "$zinf_ckpt" "$work/from-orig" \
    "$work/from-imported" > check.log 2>&1 || fail "resumed runs differ: $(cat check.log)"
  [[ -f $work/from-imported/step-6.h5 ]] || fail "the resumed run saved no step 6"
  echo "saved on 2 ranks, deepspeed W=3, imported, resumed on 3 ranks to step 6: $(cat check.log)"
  exit 0
fi

if [[ $mode == torch ]]; then
  timeout 120 "$python" "$here/deepspeed_import_torch.py" save "$work" > save.log 2>&1 ||
    fail "zinf.torch save exited with $?"
  src=$(cat "$work/saved")
  timeout 120 "$zinf_ckpt" export "$src" --format deepspeed --out "$work/ds" --world-size 2 \
    > export.log 2>&1 || fail "export exited with $?"
  timeout 120 "$zinf_ckpt" import-deepspeed "$work/ds" --out "$work/imported.h5" \
    > import.log 2>&1 || fail "import exited with $?"
  for from in original imported; do
    file=$src
    [[ $from == imported ]] && file=$work/imported.h5
    timeout 120 "$python" "$here/deepspeed_import_torch.py" resume "$work" "$file" \
      "$work/$from.pt" > "resume-$from.log" 2>&1 || fail "zinf.torch resume from $from exited $?"
  done
  timeout 120 "$python" "$here/deepspeed_import_torch.py" compare "$work" "$work/original.pt" \
    "$work/imported.pt" > compare.log 2>&1 || fail "$(cat compare.log)"
  echo "zinf.torch: $(cat compare.log)"
  exit 0
fi
echo "usage: deepspeed_import_test.sh roundtrip|resume|torch ..." >&2
exit 2
