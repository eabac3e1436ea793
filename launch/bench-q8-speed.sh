#!/usr/bin/env bash
# q8 against fp32 on every SIMD path this CPU has, the two measurements behind the q8 speed goals:
# - the kernel: zinf-bench adam, fp32 and q8 alternating (the order rotated each round), q8's
#   elements/s over fp32's and over the STREAM triad measured in the same run;
# - the step: zinf-bench step --pipeline --state-format fp32,q8 in each --path (a disk and, for
#   storage faster than the kernel, a tmpfs), q8's median step over fp32's, per round.
#
#   launch/bench-q8-speed.sh [--bin build/bin/zinf-bench] [--path DIR]... [--state 4G]
#                            [--numel 64M] [--threads 2] [--rounds 3] [--simd avx512,avx2]
#
# --rounds 1-99 and --threads 0-1024 (0: all cores) are integers, --state and --numel sizes; a bad
# value (or a flag without one) exits 2 before anything runs.
# JSON lines on stdout: one per kernel pair and per step round, then one summary per measurement,
# path and SIMD path (min, median and max of q8/fp32); the benchmarks' own logs go to stderr.
# Each step run works in a fresh directory under its --path, removed afterwards: it needs the
# state's bytes free there plus a sub-group. Run it with nothing else running.
set -euo pipefail

bin=build/bin/zinf-bench
paths=()
state=4G
numel=64M
threads=2
rounds=3
simd=""
# shellcheck source=lib/args.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
args_script="bench-q8-speed"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) need_value "$@"; bin=$2; shift 2 ;;
    --path) need_value "$@"; paths+=("$2"); shift 2 ;;
    --state) need_value "$@"; state=$2; shift 2 ;;
    --numel) need_value "$@"; numel=$2; shift 2 ;;
    --threads) need_value "$@"; threads=$2; shift 2 ;;
    --rounds) need_value "$@"; rounds=$2; shift 2 ;;
    --simd) need_value "$@"; simd=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) usage_die "unknown argument $1 (--help lists them)" ;;
  esac
done
# The flags first, then the tools: a bad command line exits 2 before anything runs.
check_count --rounds "$rounds" 1 99
check_count --threads "$threads" 0 1024
check_size --state "$state" 12 > /dev/null || exit 2
check_size --numel "$numel" > /dev/null || exit 2
[[ -x $bin ]] || usage_die "$bin is not an executable (build first)"
if [[ ${#paths[@]} == 0 ]]; then paths=(/tmp); fi
for p in "${paths[@]}"; do
  [[ -d $p && ! -L $p ]] || { echo "bench-q8-speed: --path $p is not a directory" >&2; exit 2; }
done
if [[ -z $simd ]]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  has() { [[ " $flags " == *" $1 "* ]]; }
  if has avx512f && has avx512bw && has avx512vl && has avx512dq; then simd=avx512,; fi
  if has avx2; then simd+=avx2; fi
  simd=${simd%,}
  [[ -n $simd ]] || { echo "bench-q8-speed: this CPU has neither AVX-512 nor AVX2" >&2; exit 2; }
fi
IFS=, read -r -a simds <<< "$simd"

work=""
results=$(mktemp)
trap '[[ -n $work ]] && rm -rf -- "$work"; rm -f -- "$results"' EXIT

for ((round = 1; round <= rounds; round++)); do
  for s in "${simds[@]}"; do
    # The kernel: fp32 first in odd rounds, q8 first in even ones.
    order=(fp32 q8)
    ((round % 2 == 0)) && order=(q8 fp32)
    declare -A kernel=()
    for f in "${order[@]}"; do
      kernel[$f]=$("$bin" adam --numel "$numel" --threads "$threads" --simd "$s" \
        --state-format "$f" --json)
    done
    python3 - "$round" "$s" "${kernel[fp32]}" "${kernel[q8]}" <<'EOF' | tee -a "$results"
import json, sys
round_, simd, fp32, q8 = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
print(json.dumps({"bench": "q8-kernel", "simd": simd, "round": int(round_),
                  "fp32_elements_per_s": fp32["elements_per_s"],
                  "q8_elements_per_s": q8["elements_per_s"],
                  "q8_over_fp32": q8["elements_per_s"] / fp32["elements_per_s"],
                  "q8_triad_fraction": q8["roofline_fraction"],
                  "triad_gb_per_s": q8["triad_gb_per_s"]}))
EOF
    for p in "${paths[@]}"; do
      work=$(mktemp -d "$p/zinf-q8-speed.XXXXXX")
      ZINF_SIMD=$s "$bin" step --path "$work" --pipeline --state-bytes "$state" \
        --state-format fp32,q8 --threads "$threads" --json |
        python3 -c '
import json, sys
rows = {}
for line in sys.stdin:
    d = json.loads(line)
    rows[d["state_format"]] = d
f, q = rows["fp32"], rows["q8"]
print(json.dumps({"bench": "q8-step", "simd": sys.argv[1], "path": sys.argv[2],
                  "round": int(sys.argv[3]), "fp32_seconds": f["seconds_per_step"],
                  "q8_seconds": q["seconds_per_step"],
                  "q8_over_fp32": q["seconds_per_step"] / f["seconds_per_step"],
                  "fp32_io_only_seconds": f["io_only_seconds"],
                  "q8_io_only_seconds": q["io_only_seconds"]}))
' "$s" "$p" "$round" | tee -a "$results"
      rm -rf -- "$work"
      work=""
    done
  done
done

python3 - "$results" <<'EOF'
import json, statistics, sys
groups = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    groups.setdefault((d["bench"], d["simd"], d.get("path")), []).append(d)
for (bench, simd, path), rows in groups.items():
    summary = {"bench": bench + "-summary", "simd": simd, "rounds": len(rows)}
    if path is not None:
        summary["path"] = path
    for field in ("q8_over_fp32", "q8_triad_fraction"):
        values = [r[field] for r in rows if field in r]
        if values:
            summary[field + "_min"] = min(values)
            summary[field + "_median"] = statistics.median(values)
            summary[field + "_max"] = max(values)
    print(json.dumps(summary))
EOF
