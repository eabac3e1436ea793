#!/usr/bin/env bash
# Training quality of the q8 optimizer state (Adam moments as 8-bit block-wise codes) against
# fp32: trains the built-in charlm twice from the same seed for the same number of steps, once
# with --optimizer-state fp32 and once with --optimizer-state q8, and compares the final held-out
# loss (the last step's) of the two runs.
#
#   launch/bench-q8-quality.sh [--steps 1000] [--ranks 2] [--seed 1234] [--out /tmp/zinf-q8-quality]
#                              [--bin build/bin/zinf-train]
#
# Each run is launch/zinf-run -np RANKS -- zinf-train --steps STEPS --seed SEED (1234: the
# built-in default's)
# --optimizer-state F --nvme-path OUT/swap-F --metrics OUT/metrics-F.jsonl, its log (stdout and
# stderr) in OUT/log-F.txt; the swap directory and metrics file are made afresh for every run.
# OUT must be new, empty or made by an earlier run of this script (it holds
# .made-by-bench-q8-quality.sh): any other directory is refused (exit 2), as the script replaces
# and removes files in it.
# From them the script writes, for F in fp32 and q8:
#   OUT/heldout-F.tsv  "step value" lines: the held-out loss zinf-train logs every 25 steps
#   OUT/train-F.tsv    "step value" lines: the training loss of every step (--metrics)
# and OUT/q8-vs-fp32.png (launch/plot_loss.py) with both held-out curves. It prints one JSON line
# on stdout:
#   {"bench":"q8_quality","steps":S,"ranks":N,"seed":SEED,"fp32_heldout":X,"q8_heldout":Y,
#    "ratio":Y/X,"ratio_last4":R,"within_2pct":true|false,"fp32_bytes_per_element":B,
#    "q8_bytes_per_element":B,"png":PATH}
# X and Y are the held-out losses at the last step; ratio_last4 is the ratio of the means of the
# last four evaluations (the last 100 steps). One evaluation moves by 2-3% from the next in both
# runs, so the last point alone is noise-dominated: within_2pct judges ratio_last4 <= 1.02 (q8 at
# most 2% worse; lower is better, so a q8 run that ends below fp32 passes). *_bytes_per_element is the last step's
# read_bytes_per_element (swap bytes read per parameter per step; as many are written).
# Progress goes to stderr. A run takes 20-40 s at 1000 steps on the 2-core CI machine.
#
# Exit status: 0 when both runs succeeded (whatever the ratio), 1 when a run failed or its output
# is incomplete, 2 for a bad command line.
set -euo pipefail

repo=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd)
# metric, metrics_problem.
# shellcheck source=lib/metrics.sh
source "$repo/launch/lib/metrics.sh"
# claim_dir.
# shellcheck source=lib/outdir.sh
source "$repo/launch/lib/outdir.sh"
steps=1000
ranks=2
seed=1234
out=/tmp/zinf-q8-quality
bin=$repo/build/bin/zinf-train

# shellcheck source=lib/args.sh
source "$repo/launch/lib/args.sh"
args_script="bench-q8-quality"
die() { usage_die "$@"; }
fail() {
  echo "bench-q8-quality: $*" >&2
  exit 1
}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($# > 0)); do
  case $1 in
    --steps | --ranks | --seed | --out | --bin)
      need_value "$@"
      case $1 in
        --steps) steps=$2 ;;
        --seed) seed=$2 ;;
        --ranks) ranks=$2 ;;
        --out) out=$2 ;;
        --bin) bin=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
check_count --steps "$steps"
check_count --ranks "$ranks" 1 1024
check_count --seed "$seed" 0
[[ -n $out ]] || die "--out needs a non-empty directory"
[[ -x $bin ]] || die "--bin '$bin' is not an executable (build zinf-train first)"
claim_dir "$out" bench-q8-quality.sh || exit 2
out=$(cd -- "$out" && pwd)

# run F: one training run with optimizer state F; writes OUT/log-F.txt, OUT/heldout-F.tsv and
# OUT/train-F.tsv, or fails with the end of the log.
run() {
  local f=$1 log=$out/log-$1.txt metrics=$out/metrics-$1.jsonl problem last
  rm -rf -- "$out/swap-$f"
  mkdir -p -- "$out/swap-$f"
  rm -f -- "$metrics"  # zinf-train appends to an existing metrics file
  echo "bench-q8-quality: $f: $steps steps on $ranks rank(s), log in $log" >&2
  if ! "$repo/launch/zinf-run" -np "$ranks" -- "$bin" --steps "$steps" --seed "$seed" \
      --optimizer-state "$f" --nvme-path "$out/swap-$f" --metrics "$metrics" >"$log" 2>&1; then
    tail -n 20 -- "$log" >&2
    fail "$f: the training run failed (log: $log)"
  fi
  # Rank 0's "[rank 0/N] step 25: held-out loss 3.2976" lines.
  sed -n 's/.*\[rank 0\/[0-9]*\] step \([0-9][0-9]*\): held-out loss \([-+.0-9eEnaif]*\)$/\1 \2/p' \
    -- "$log" >"$out/heldout-$f.tsv"
  last=$(tail -n 1 -- "$out/heldout-$f.tsv" | awk '{ print $1 }')
  [[ $last == "$steps" ]] ||
    fail "$f: no held-out loss at step $steps in $log (last: '${last:-none}')"
  if problem=$(metrics_problem "$metrics" 1 "$steps" "$ranks"); then :; else
    fail "$f: $metrics: $problem"
  fi
  metric "$metrics" loss >"$out/train-$f.tsv"
}

run fp32
run q8

png=$out/q8-vs-fp32.png
python3 "$repo/launch/plot_loss.py" --out "$png" \
  --title "charlm, Adam state fp32 vs q8: $ranks rank(s), seed $seed" \
  --xlabel step --ylabel "held-out loss" \
  "fp32=$out/heldout-fp32.tsv" "q8=$out/heldout-q8.tsv" ||
  fail "plot_loss.py failed"

# The summary line: final held-out losses, their ratio, and the swap bytes per element.
python3 - "$steps" "$ranks" "$seed" "$out" "$png" <<'EOF'
import json, sys

steps, ranks, seed, out, png = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                sys.argv[4], sys.argv[5])


def lines(path):
    with open(path) as f:
        return [line for line in f if line.strip()]


curves = {f: [float(line.split()[1]) for line in lines(f"{out}/heldout-{f}.tsv")]
          for f in ("fp32", "q8")}
heldout = {f: curves[f][-1] for f in curves}
last4 = {f: sum(curves[f][-4:]) / len(curves[f][-4:]) for f in curves}
bpe = {f: json.loads(lines(f"{out}/metrics-{f}.jsonl")[-1])["read_bytes_per_element"]
       for f in ("fp32", "q8")}
ratio = heldout["q8"] / heldout["fp32"]
ratio_last4 = last4["q8"] / last4["fp32"]
print(json.dumps({
    "bench": "q8_quality", "steps": steps, "ranks": ranks, "seed": seed,
    "fp32_heldout": heldout["fp32"], "q8_heldout": heldout["q8"], "ratio": round(ratio, 6),
    "ratio_last4": round(ratio_last4, 6),
    "within_2pct": ratio_last4 <= 1.02,
    "fp32_bytes_per_element": round(bpe["fp32"], 4), "q8_bytes_per_element": round(bpe["q8"], 4),
    "png": png}, separators=(",", ":")))
EOF
