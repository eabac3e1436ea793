#!/usr/bin/env bash
# Compares `zinf-bench io` with fio on the same directory, file size and I/O shape
# (io_uring, O_DIRECT, 1 MiB blocks, queue depth 8, one job), alternating the two tools so that
# slow drifts of the disk hit both alike. Prints one JSON line per trial and op, then one summary
# line per op with the median ratio zinf/fio, then a human summary on stderr.
#
#   launch/bench-io-vs-fio.sh [--dir DIR] [--size 1G] [--trials 3] [--bench PATH] [--target 0.95]
#
# --size is a multiple of 1 MiB (such as 1G), --trials an integer 1-1000, --target a positive
# number: a bad value (or a flag without one) exits 2 before anything runs.
# Exit status: 0 when both median ratios reach the target, 1 when not, 2 on usage/tool errors.
set -euo pipefail

DIR=/tmp
SIZE=1G
TRIALS=3
TARGET=0.95
BENCH=""
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# shellcheck source=lib/args.sh
source "$here/lib/args.sh"
args_script="bench-io-vs-fio"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) need_value "$@"; DIR="$2"; shift 2 ;;
    --size) need_value "$@"; SIZE="$2"; shift 2 ;;
    --trials) need_value "$@"; TRIALS="$2"; shift 2 ;;
    --bench) need_value "$@"; BENCH="$2"; shift 2 ;;
    --target) need_value "$@"; TARGET="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) usage_die "unknown argument '$1'" ;;
  esac
done
# Every flag checked before a directory is made or a tool runs. fio and zinf-bench move whole
# 1 MiB blocks.
size_bytes=$(check_size --size "$SIZE" $((1 << 20))) || exit 2
((size_bytes % (1 << 20) == 0)) || usage_die "--size '$SIZE': not a multiple of the 1 MiB block"
check_count --trials "$TRIALS" 1 1000
check_number --target "$TARGET"

if [[ -z "$BENCH" ]]; then
  for candidate in "$here/../build/bin/zinf-bench" "$here"/../build*/bin/zinf-bench; do
    if [[ -x "$candidate" ]]; then BENCH="$candidate"; break; fi
  done
fi
[[ -n "$BENCH" && -x "$BENCH" ]] || { echo "bench-io-vs-fio: zinf-bench not found; pass --bench" >&2; exit 2; }
command -v fio >/dev/null || { echo "bench-io-vs-fio: fio is not installed" >&2; exit 2; }
command -v python3 >/dev/null || { echo "bench-io-vs-fio: python3 is not installed" >&2; exit 2; }
[[ -d "$DIR" ]] || { echo "bench-io-vs-fio: $DIR is not a directory" >&2; exit 2; }

# fio's file lives in a directory made for this run (removed at the end): nothing else in DIR is
# written or removed. zinf-bench io makes (and removes) its own fresh file in DIR.
fio_dir=$(mktemp -d "$DIR/zinf-vs-fio.XXXXXX")
fio_file=$fio_dir/fio.dat
trap 'rm -rf "$fio_dir"' EXIT

# MiB/s of one fio run ($1 = write|read).
run_fio() {
  fio --name=zinf-vs-fio --filename="$fio_file" --ioengine=io_uring --direct=1 --bs=1M \
      --iodepth=8 --numjobs=1 --rw="$1" --size="$SIZE" --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(j[sys.argv[1]]["bw_bytes"]/1048576)' "$1"
}

# "write_mib read_mib" of one zinf-bench run (write, then read, of a fresh file).
run_zinf() {
  "$BENCH" io --path "$DIR" --size "$SIZE" --block-size 1M --queue-depth 8 \
      --intra-op-parallelism 1 --engine uring --op both --json 2>/dev/null |
    python3 -c '
import json, sys
r = {}
for line in sys.stdin:
    line = line.strip()
    if line.startswith("{"):
        o = json.loads(line); r[o["op"]] = o["mib_per_s"]
print(r["write"], r["read"])'
}

results=()
for ((t = 1; t <= TRIALS; t++)); do
  # Alternate which tool goes first.
  if (( t % 2 == 1 )); then order="fio zinf"; else order="zinf fio"; fi
  for tool in $order; do
    if [[ $tool == fio ]]; then
      rm -f "$fio_file"
      fio_write=$(run_fio write)
      fio_read=$(run_fio read)
      rm -f "$fio_file"
    else
      read -r zinf_write zinf_read < <(run_zinf)
    fi
  done
  for op in write read; do
    if [[ $op == write ]]; then f=$fio_write; z=$zinf_write; else f=$fio_read; z=$zinf_read; fi
    line=$(python3 -c 'import json,sys; t,op,f,z=sys.argv[1:]; f=float(f); z=float(z); print(json.dumps({"trial":int(t),"op":op,"fio_mib_per_s":round(f,1),"zinf_mib_per_s":round(z,1),"ratio":round(z/f,3)}))' "$t" "$op" "$f" "$z")
    echo "$line"
    results+=("$line")
  done
done

printf '%s\n' "${results[@]}" | python3 -c '
import json, statistics, sys
target = float(sys.argv[1]); size = sys.argv[2]
rows = [json.loads(l) for l in sys.stdin if l.strip()]
ok = True
human = []
for op in ("write", "read"):
    r = [x for x in rows if x["op"] == op]
    med = statistics.median(x["ratio"] for x in r)
    passed = med >= target
    ok = ok and passed
    print(json.dumps({"summary": True, "op": op, "trials": len(r), "size": size,
                      "median_ratio": round(med, 3), "target": target, "pass": passed,
                      "fio_median_mib_per_s": round(statistics.median(x["fio_mib_per_s"] for x in r), 1),
                      "zinf_median_mib_per_s": round(statistics.median(x["zinf_mib_per_s"] for x in r), 1)}))
    ratios = ", ".join("%.3f" % x["ratio"] for x in r)
    verdict = "meets" if passed else "below"
    human.append("%-5s: ratios %s; median %.3f (%s %s)" % (op, ratios, med, verdict, target))
print("zinf-bench io vs fio (io_uring, O_DIRECT, bs 1M, qd 8, size " + size + "):", file=sys.stderr)
for h in human: print("  " + h, file=sys.stderr)
sys.exit(0 if ok else 1)' "$TARGET" "$SIZE"
