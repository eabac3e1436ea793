#!/usr/bin/env bash
# `zinf-ckpt export --format deepspeed` (interop/deepspeed_export.h) on checkpoints of real runs:
#   A  zinf-train, 2 ranks, 3 steps, a synthetic model of 10007 elements in 5 tensors (fp32 state)
#   B  the same with --optimizer-state q8 (moments exported decoded)
#   C  deepspeed_export_make_ckpt on 2 ranks: two interleaved parameter groups, Adam with L2
#      decay, fp16 with a dynamic loss scaler after a skipped step (fp32 state)
#   D  C with q8 state
# Each is exported for W = 1, 2, 3, 4 and ZeRO stage 1 and 2, with `--format deepspeed-universal`
# for W = 1 and 3, and beside them with `--format safetensors --moments` (the reference: zinf's
# fp32 weights and moments). The model files hold the trainer state's user keys (zinf-train's
# seed, samples_seen, data, loss; the generator's deepspeed_export_testing.h GroupsUser).
#
#   deepspeed_export_test.sh structure ZINF_TRAIN ZINF_CKPT MPIEXEC MAKE_CKPT
#       torch.load reads every file, the structure is the documented one, and the weights
#       reassembled by zero_to_fp32's rule and the moments equal the reference bitwise; the
#       universal exports' per-parameter files equal it too (deepspeed_export_check.py
#       structure); zinf-ckpt's errors: --world-size 0 and 4097 (exit 2), a non-empty --out, a
#       truncated checkpoint (exit 1), nothing written; 77 when /usr/bin/python3 has no torch.
#   deepspeed_export_test.sh tools ZINF_TRAIN ZINF_CKPT MPIEXEC MAKE_CKPT
#       DeepSpeed's own zero_to_fp32 and ds_to_universal (deepspeed_export_check.py tools) on
#       exports of A-D: weights and moments bitwise; for W = 1 and 3, ds_to_universal's output
#       folder equals zinf's --format deepspeed-universal export file by file. The DeepSpeed
#       source tree is
#       $ZINF_DEEPSPEED_SRC (a directory holding deepspeed/), else the tarball
#       ../shared/bench/deepspeed/deepspeed-src.tar.xz beside the repository, unpacked to the
#       scratch directory; 77 (skipped) when there is neither, or no torch.
set -u
mode=$1
zinf_train=$(readlink -f "$2")
zinf_ckpt=$(readlink -f "$3")
mpiexec=$4
make_ckpt=$(readlink -f "$5")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=/usr/bin/python3
# shellcheck disable=SC2054  # "self,vader,tcp" is one argument
mpiexec_flags=(--allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader,tcp
               --mca btl_tcp_if_include lo)

if ! "$python" -c 'import torch' > /dev/null 2>&1; then
  echo "SKIP: $python cannot import torch"
  exit 77
fi
tree=
if [[ $mode == tools ]]; then
  tarball=$repo/../shared/bench/deepspeed/deepspeed-src.tar.xz
  if [[ -n ${ZINF_DEEPSPEED_SRC:-} ]]; then
    tree=$ZINF_DEEPSPEED_SRC
    [[ -f $tree/deepspeed/utils/zero_to_fp32.py ]] ||
      { echo "FAIL: ZINF_DEEPSPEED_SRC=$tree has no deepspeed/utils/zero_to_fp32.py" >&2; exit 1; }
  elif [[ ! -f $tarball ]]; then
    echo "SKIP: no DeepSpeed source tree (set ZINF_DEEPSPEED_SRC, or put DeepSpeed's source" \
      "tarball at $tarball)"
    exit 77
  fi
fi

work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-dsexport-XXXXXX") ||
  { echo "FAIL: cannot make a scratch directory" >&2; exit 1; }
trap 'cd /; rm -rf "$work"' EXIT
cd "$work" || exit 1
export PYTHONDONTWRITEBYTECODE=1 ZINF_LOG_LEVEL=warn

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}

if [[ $mode == tools && -z $tree ]]; then
  mkdir -p "$work/ds" || fail "cannot make $work/ds"
  tar -xJf "$tarball" -C "$work/ds" deepspeed || fail "cannot unpack $tarball"
  tree=$work/ds
fi

# The checkpoints.
cat > synthetic.json << 'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
 "zinf": {"model": {"name": "synthetic", "total_params": 10007, "num_params": 5}}}
EOF
mkdir -p swap
for state in fp32 q8; do
  timeout --kill-after=10 60 "$mpiexec" "${mpiexec_flags[@]}" -np 2 "$zinf_train" \
    --config synthetic.json --steps 3 --nvme-path "$work/swap" --optimizer-state $state \
    --checkpoint-dir "$work/train-$state" --checkpoint-every 3 > "train-$state.log" 2>&1 ||
    fail "zinf-train ($state) exited with $?"
  # tools: the 0-dim parameter as shape [1] (ds_to_universal cannot merge a 0-dim parameter,
  # DeepSpeed's own ones included); structure: as it is.
  scalar=()
  [[ $mode == tools ]] && scalar=(no-scalar)
  timeout --kill-after=10 60 "$mpiexec" "${mpiexec_flags[@]}" -np 2 "$make_ckpt" \
    "$work/groups-$state" "$work/swap" $state "${scalar[@]}" > "make-$state.log" 2>&1 ||
    fail "deepspeed_export_make_ckpt ($state) exited with $?"
done
# zinf-train's user state (tools/train/trainer.cc UserState: its loss is not known here), and
# the generator's (deepspeed_export_testing.h GroupsUser).
one='{"step": 3, "skipped": 0, "groups": null, "dynamic": false, "adam_w_mode": true,
      "user_keys": ["data", "loss", "samples_seen", "seed"],
      "user": {"seed": 1234, "samples_seen": 12,
               "data": "batches are a pure function of (seed, step, micro_batch, rank, world)"}}'
two='{"step": 5, "skipped": 1, "groups": [["b1", "scale", "head"], ["embed", "w1", "w2"]],
      "dynamic": true, "adam_w_mode": false,
      "user_keys": ["big", "data", "done", "epoch", "loss", "name", "none", "seed"],
      "user": {"epoch": 3, "seed": -42, "loss": 0.125, "name": "run-\u00e9", "done": false,
               "none": null, "big": 9223372036854775807,
               "data": {"position": 1234567890123, "files": ["a.bin", "b.bin"],
                        "nested": [[1, 2.5], {"k": [], "d": {}}]}}}'
declare -A expect=([train-fp32]=$one [train-q8]=$one [groups-fp32]=$two [groups-q8]=$two)

export_ds() {  # export_ds CKPT OUT W STAGE [FORMAT]
  timeout 60 "$zinf_ckpt" export "$work/$1" --format "${5:-deepspeed}" --out "$2" \
    --world-size "$3" --stage "$4" > "$2.log" 2>&1 ||
    fail "export of $1 to $2 (${5:-deepspeed}, W=$3, stage $4) exited with $?"
}

for ckpt in train-fp32 train-q8 groups-fp32 groups-q8; do
  timeout 60 "$zinf_ckpt" export "$work/$ckpt" --format safetensors --moments \
    --out "$work/$ckpt.safetensors" > /dev/null 2>&1 || fail "safetensors export of $ckpt"
  if [[ $mode == structure ]]; then
    specs=()
    for w in 1 2 3 4; do
      for stage in 1 2; do
        export_ds "$ckpt" "$work/ds-$ckpt-$w-$stage" $w $stage
        specs+=("$work/ds-$ckpt-$w-$stage:$w:$stage")
      done
    done
    for w in 1 3; do
      stage=$(( w == 1 ? 2 : 1 ))
      export_ds "$ckpt" "$work/uni-$ckpt-$w" $w $stage deepspeed-universal
      specs+=("$work/uni-$ckpt-$w:$w:$stage:universal")
    done
    "$python" "$here/deepspeed_export_check.py" structure "$work/$ckpt.safetensors" \
      "${expect[$ckpt]}" "${specs[@]}" > "check-$ckpt.log" 2>&1 ||
      fail "$ckpt: $(cat "check-$ckpt.log")"
    echo "ok $ckpt: W = 1..4, stages 1 and 2, universal W = 1 and 3: structure, user keys," \
      "weights and moments bitwise"
  else
    for w in 1 2 3 4; do
      export_ds "$ckpt" "$work/ds-$ckpt-$w" $w 2
      mkdir -p "$work/tools-$ckpt-$w"
      universal=()
      if (( w == 1 || w == 3 )); then
        export_ds "$ckpt" "$work/uni-$ckpt-$w" $w 2 deepspeed-universal
        universal=("$work/uni-$ckpt-$w")
      fi
      timeout 120 "$python" "$here/deepspeed_export_check.py" tools "$tree" \
        "$work/$ckpt.safetensors" "${expect[$ckpt]}" "$work/ds-$ckpt-$w" "$work/tools-$ckpt-$w" \
        "${universal[@]}" > "tools-$ckpt-$w.log" 2>&1 ||
        fail "$ckpt W=$w: $(tail -30 "tools-$ckpt-$w.log")"
      echo "ok $ckpt W=$w: $(grep -h '^zero_to_fp32:\|^ds_to_universal:\|^universal:' \
        "tools-$ckpt-$w.log" | tr '\n' ' ')"
    done
  fi
done
[[ $mode == tools ]] && exit 0

# Errors: usage (exit 2) and refused outputs or inputs (exit 1), nothing written.
expect_exit() {  # expect_exit CODE TEXT ARGS...
  local code=$1 text=$2
  shift 2
  timeout 60 "$zinf_ckpt" "$@" > err.log 2>&1
  local got=$?
  [[ $got == "$code" ]] || fail "zinf-ckpt $* exited with $got, expected $code: $(cat err.log)"
  grep -q -- "$text" err.log || fail "zinf-ckpt $*: no '$text' in: $(cat err.log)"
}
for w in 0 4097 -1; do
  expect_exit 2 "world-size" export train-fp32 --format deepspeed --out bad --world-size "$w"
done
expect_exit 2 "stage" export train-fp32 --format deepspeed --out bad --stage 3
expect_exit 2 "only to --format deepspeed" export train-fp32 --out bad.h5 --world-size 2
expect_exit 2 "do not apply" export train-fp32 --format deepspeed --out bad --moments
expect_exit 2 "do not apply" export train-fp32 --format deepspeed-universal --out bad --force
[[ -e bad || -e bad.h5 ]] && fail "a refused command line wrote its output"
mkdir full && touch full/keep
expect_exit 1 "not empty" export train-fp32 --format deepspeed --out full
expect_exit 1 "not empty" export train-fp32 --format deepspeed-universal --out full
[[ $(ls full) == keep ]] || fail "the non-empty --out was changed: $(ls full)"
cp train-fp32/step-3.h5 truncated.h5 && truncate -s 5000 truncated.h5
mkdir empty
expect_exit 1 "truncated.h5" export truncated.h5 --format deepspeed --out empty
[[ -z $(ls -A empty) ]] || fail "a failed export left files in its --out: $(ls -A empty)"
expect_exit 1 "tag" export train-fp32 --format deepspeed --out bad --tag ../up
leftovers=$(find "$work" -maxdepth 1 -name '.*deepspeed-tmp*')
[[ -z $leftovers ]] || fail "temporary directories left behind: $leftovers"
echo "ok errors: bad --world-size/--stage/flags exit 2; non-empty --out, truncated checkpoint," \
  "bad --tag exit 1; nothing written"
