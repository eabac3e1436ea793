#!/usr/bin/env bash
# Two swap paths of unequal speed: does striping weighted by bandwidth add them up?
# (zinf.nvme_path_weights, DESIGN.md "Swap store"). In one run, for --rounds rounds, in an order
# rotated every round:
#   alone A, alone B   `zinf-bench io` on each path by itself (write, then read, --size bytes);
#   equal              `zinf-bench step` striped over both paths with equal shares (the default);
#   given              the same with --path-weights set to the ratio of the latest alone figures;
#   probe              the same with --path-weights probe (the store measures at open).
# One JSON line per measurement on stdout, then one summary line per weighting with the median
# over rounds of the step's I/O throughput (bytes read + written per step / step time) over the
# sum of the two paths alone (each path's latest alone figure: bytes read + written / time), and of the
# engine-alone pass through the striped store (io_only) over that sum; a human summary on stderr.
#
#   launch/bench-paths.sh [--fast /dev/shm] [--slow /var/tmp] [--state 2G] [--size 1G]
#                         [--sub-group-size 16M] [--rounds 3] [--mode pipeline|sync]
#                         [--weightings equal,given,probe] [--bin build/bin/zinf-bench]
#                         [--out DIR] [--target 0.85]
#
# --fast and --slow are directories in which the script makes (and removes) one fresh directory
# each; both must take O_DIRECT (tmpfs does since Linux 6.6). --out keeps the logs of every run
# (a new or empty directory, or one this script made before). Needs free space for --state on
# each path (and --size). Exit status: 0 when the given weights reach --target, 1 when not, 2 on
# usage or tool errors.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib/outdir.sh
source "$here/lib/outdir.sh"
# shellcheck source=lib/args.sh
source "$here/lib/args.sh"
args_script="bench-paths"

fast=/dev/shm
slow=/var/tmp
state=2G
size=1G
sub_group=16M
rounds=3
mode=pipeline
bin=""
out=""
target=0.85
weightings=equal,given,probe
block_size=1M
queue_depth=16
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { usage_die "$@"; }
while (($# > 0)); do
  case $1 in
    --fast | --slow | --state | --size | --sub-group-size | --rounds | --mode | --bin | --out | \
      --target | --weightings)
      need_value "$@"
      case $1 in
        --fast) fast=$2 ;;
        --slow) slow=$2 ;;
        --state) state=$2 ;;
        --size) size=$2 ;;
        --sub-group-size) sub_group=$2 ;;
        --rounds) rounds=$2 ;;
        --mode) mode=$2 ;;
        --bin) bin=$2 ;;
        --out) out=$2 ;;
        --target) target=$2 ;;
        --weightings) weightings=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# The flags first, then the tools: a bad command line exits 2 before anything is made or run.
[[ $mode == pipeline || $mode == sync ]] ||
  die "--mode is pipeline or sync, not '$mode'"
check_count --rounds "$rounds" 1 1000
check_size --state "$state" 12 > /dev/null || exit 2
check_size --size "$size" > /dev/null || exit 2
check_size --sub-group-size "$sub_group" > /dev/null || exit 2
check_number --target "$target"
for weighting in ${weightings//,/ }; do
  [[ $weighting =~ ^(equal|given|probe)$ ]] ||
    die "--weightings takes equal, given, probe, not '$weighting'"
done
if [[ -z $bin ]]; then
  for candidate in "$here/../build/bin/zinf-bench" "$here"/../build*/bin/zinf-bench; do
    if [[ -x $candidate ]]; then bin=$candidate; break; fi
  done
fi
[[ -n $bin && -x $bin ]] || die "zinf-bench not found; pass --bin"
command -v python3 >/dev/null || die "python3 is not installed"
for dir in "$fast" "$slow"; do
  [[ -d $dir ]] || die "$dir is not a directory"
done

# The runs' files live in directories made for this run (removed at the end): nothing else in
# --fast or --slow is written or removed.
fast_dir=$(mktemp -d "$fast/zinf-bench-paths.XXXXXX")
slow_dir=$(mktemp -d "$slow/zinf-bench-paths.XXXXXX") || { rm -rf "$fast_dir"; exit 2; }
trap 'rm -rf "$fast_dir" "$slow_dir"' EXIT
if [[ -n $out ]]; then
  empty_claimed_dir "$out" bench-paths || exit 2
  logs=$out
else
  logs=$(mktemp -d "${TMPDIR:-/tmp}/zinf-bench-paths-logs.XXXXXX")
  trap 'rm -rf "$fast_dir" "$slow_dir" "$logs"' EXIT
fi

# run_logged NAME CMD...: CMD's stdout to $logs/NAME.json, stderr to $logs/NAME.log; on failure
# the log's tail goes to stderr and the script stops (status 2).
run_logged() {
  local name=$1
  shift
  if ! "$@" > "$logs/$name.json" 2> "$logs/$name.log"; then
    echo "bench-paths: $name failed: $*" >&2
    tail -5 "$logs/$name.log" >&2
    exit 2
  fi
}

declare -A alone_mib  # path label -> MiB/s of the latest alone run (read + write)
results="$logs/results.jsonl"
: > "$results"

# alone LABEL DIR ROUND: zinf-bench io on DIR; one JSON line.
alone() {
  local label=$1 dir=$2 round=$3 name="r$3-alone-$1"
  run_logged "$name" "$bin" io --path "$dir" --size "$size" --block-size "$block_size" \
    --queue-depth "$queue_depth" --engine auto --op both --json
  local line
  line=$(python3 - "$logs/$name.json" "$label" "$dir" "$round" <<'PY'
import json, sys
path, label, directory, round_ = sys.argv[1:]
ops = {}
for text in open(path):
    text = text.strip()
    if text.startswith("{"):
        o = json.loads(text)
        ops[o["op"]] = o
w, r = ops["write"], ops["read"]
# Read and written, as a step does: the same bytes both ways over the time of both.
both = (w["size_bytes"] + r["size_bytes"]) / 1048576 / (w["seconds"] + r["seconds"])
print(json.dumps({"bench": "paths", "round": int(round_), "run": "alone", "path": label,
                  "dir": directory, "write_mib_per_s": round(w["mib_per_s"], 1),
                  "read_mib_per_s": round(r["mib_per_s"], 1), "mib_per_s": round(both, 1)}))
PY
)
  echo "$line" | tee -a "$results"
  alone_mib[$label]=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["mib_per_s"])' \
    "$line")
}

# step WEIGHTING ROUND: zinf-bench step striped over both paths; one JSON line.
step() {
  local weighting=$1 round=$2 name="r$2-step-$1" weights_flag=()
  case $weighting in
    equal) ;;
    given) weights_flag=(--path-weights "${alone_mib[fast]},${alone_mib[slow]}") ;;
    probe) weights_flag=(--path-weights probe) ;;
  esac
  run_logged "$name" "$bin" step --path "$fast_dir,$slow_dir" "${weights_flag[@]}" \
    --state-bytes "$state" --sub-group-size "$sub_group" --"$mode" --steps 2 --warmup 1 \
    --block-size "$block_size" --queue-depth "$queue_depth" --json
  python3 - "$logs/$name.json" "$weighting" "$round" "${alone_mib[fast]}" "${alone_mib[slow]}" \
    <<'PY' | tee -a "$results"
import json, sys
path, weighting, round_, fast, slow = sys.argv[1:]
runs = [json.loads(t) for t in open(path) if t.strip().startswith("{")]
o = runs[-1]
moved = (o["read_bytes"] + o["write_bytes"]) / 1048576
alone_sum = float(fast) + float(slow)
step_mib = moved / o["seconds_per_step"]
io_mib = moved / o["io_only_seconds"]
print(json.dumps({"bench": "paths", "round": int(round_), "run": "step", "weights": weighting,
                  "mode": o["mode"], "path_weights": o["path_weights"],
                  "seconds_per_step": round(o["seconds_per_step"], 4),
                  "step_mib_per_s": round(step_mib, 1), "io_only_mib_per_s": round(io_mib, 1),
                  "alone_sum_mib_per_s": round(alone_sum, 1),
                  "step_over_alone_sum": round(step_mib / alone_sum, 3),
                  "io_only_over_alone_sum": round(io_mib / alone_sum, 3)}))
PY
}

# Calibration (round 0): the first figures for "given", so that every rotation has them.
alone fast "$fast_dir" 0
alone slow "$slow_dir" 0
items=("alone fast" "alone slow")
for weighting in ${weightings//,/ }; do items+=("step $weighting"); done
for ((r = 1; r <= rounds; r++)); do
  for ((k = 0; k < ${#items[@]}; k++)); do
    read -r kind what <<< "${items[(k + r - 1) % ${#items[@]}]}"
    if [[ $kind == step ]]; then
      step "$what" "$r"
    elif [[ $what == fast ]]; then
      alone fast "$fast_dir" "$r"
    else
      alone slow "$slow_dir" "$r"
    fi
  done
done

python3 - "$results" "$target" "$state" "$mode" <<'PY'
import json, statistics, sys
path, target, state, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = [json.loads(t) for t in open(path) if t.strip()]
steps = [r for r in rows if r["run"] == "step"]
passed = True
human = []
for weighting in ("equal", "given", "probe"):
    mine = [r for r in steps if r["weights"] == weighting]
    if not mine:
        continue
    step_ratio = statistics.median(r["step_over_alone_sum"] for r in mine)
    io_ratio = statistics.median(r["io_only_over_alone_sum"] for r in mine)
    summary = {"summary": True, "weights": weighting, "rounds": len(mine), "mode": mode,
               "state": state, "path_weights": mine[-1]["path_weights"],
               "median_step_over_alone_sum": round(step_ratio, 3),
               "median_io_only_over_alone_sum": round(io_ratio, 3), "target": target}
    if weighting == "given":
        summary["pass"] = step_ratio >= target
        passed = summary["pass"]
    print(json.dumps(summary))
    human.append("%-5s weights %-8s step %.3f, engine through the store %.3f of the sum alone" %
                 (weighting, ":".join(map(str, mine[-1]["path_weights"])), step_ratio, io_ratio))
alone = [r for r in rows if r["run"] == "alone" and r["round"] > 0]
for label in ("fast", "slow"):
    mib = [r["mib_per_s"] for r in alone if r["path"] == label]
    if mib:
        human.append("%s alone: median %.0f MiB/s read + written" % (label, statistics.median(mib)))
print("bench-paths (%s step, state %s; target for given weights: %.2f):" % (mode, state, target),
      file=sys.stderr)
for h in human:
    print("  " + h, file=sys.stderr)
sys.exit(0 if passed else 1)
PY
