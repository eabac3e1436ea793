#!/usr/bin/env bash
# zinf beside DeepSpeed itself, in one run on the same disk: DeepSpeed's own ops (its aio op and
# its optimizer swappers, built from its source by ../shared/bench/deepspeed/build_ds_ops.py;
# called by path through the scripts there, never copied here) against zinf-bench, rounds
# rotating the order of the tools so that slow drifts of the disk hit all alike.
#
#   launch/bench-vs-deepspeed.sh [--dir /tmp/zinf-vs-deepspeed] [--deepspeed DIR] [--ds-build DIR]
#                                [--ds-src DIR] [--bench PATH] [--python PATH] [--rounds 3]
#                                [--size 2G] [--elements 128M] [--sub-group 32M] [--steps 3]
#                                [--threads N]
#
# Engine I/O (O_DIRECT, 1 MiB blocks, queue depth 8, one request stream): DeepSpeed's aio op
# (ds_aio_bench.py: one sync_pwrite / sync_pread of a --size pinned buffer), `zinf-bench io`
# (its default request size and requests in flight) and fio (io_uring), writing then reading
# --size bytes. Fairness: every write goes into a fresh file at the same path, preallocated and
# never written before (zinf-bench io creates and fallocates its own, as it only writes into a
# file it creates; DeepSpeed's and fio's are made by fallocate(1) just before they run, since
# DeepSpeed writes over an existing file), the allocation untimed in all three; every read reads
# one file written once (by fio) before the first round.
# Swapped step (fp32 Adam state on disk, --elements elements in sub-groups of --sub-group, one
# untimed step then --steps timed ones, aio block 1 MiB and queue depth 8, --threads Adam threads
# each): DeepSpeed's PartitionedOptimizerSwapper (4 buffers) and PipelinedOptimizerSwapper (9
# buffers, the fewest it runs with), driven as stage3.py drives them (ds_swapper_step.py), against
# `zinf-bench step --sync` with a budget of 4 buffers and `--pipeline` with the bytes of 10 (a
# buffer: one sub-group of fp32, 128 MiB by default): DeepSpeed keeps the gradients outside its 9
# buffers, in a partition-sized fp32 buffer (4 bytes per element); zinf's 10th buffer holds one
# sub-group's gradient instead, so zinf still takes less memory. The mode zinf ran (its JSON
# "mode") is reported. zinf runs with --no-io-only: its engine-alone pass after each step would
# double zinf's disk traffic, which DeepSpeed's runs do not have.
#
# Output: one JSON line per measurement on stdout ({"part":"io",...} and {"part":"step",...}),
# then one {"summary":...} line per comparison: ratios zinf/DeepSpeed of speed for I/O (> 1: zinf
# faster) and of median time per step (< 1: zinf faster), from the medians over all rounds; a
# human summary on stderr. DIR (new, empty or made by an earlier run of this script: it holds
# .made-by-bench-vs-deepspeed.sh; any other directory is refused) keeps results.jsonl and each
# run's stderr in logs/; the data files (--size x 2, and the step's 12 bytes per element plus a
# sub-group) are removed at the end. The defaults take minutes; nothing else should run meanwhile.
#
# Exit status: 0 when every run gave its figures, whoever is faster (this reports, it does not
# judge); 1 when a run failed (the end of its log on stderr); 2 for a bad command line or a
# missing tool, among them DeepSpeed's ops not built (see README.md beside ds_aio_bench.py).
set -euo pipefail

repo=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd)
# claim_dir.
# shellcheck source=lib/outdir.sh
source "$repo/launch/lib/outdir.sh"
# need_value, check_count, check_size.
# shellcheck source=lib/args.sh
source "$repo/launch/lib/args.sh"
script="bench-vs-deepspeed.sh"
args_script="bench-vs-deepspeed"
dir=/tmp/zinf-vs-deepspeed
ds_dir=$repo/../shared/bench/deepspeed
ds_build=/tmp/ds/build
ds_src=/tmp/ds/src
bench=$repo/build/bin/zinf-bench
py=/usr/bin/python3
rounds=3
size=2G
elements=128M
sub_group=32M
steps=3
threads=$(nproc)
readonly queue_depth=8 block_size=$((1 << 20))

die() { usage_die "$@"; }
fail() {
  echo "bench-vs-deepspeed: $*" >&2
  exit 1
}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($# > 0)); do
  case $1 in
    --dir | --deepspeed | --ds-build | --ds-src | --bench | --python | --rounds | --size | \
      --elements | --sub-group | --steps | --threads)
      need_value "$@"
      case $1 in
        --dir) dir=$2 ;;
        --deepspeed) ds_dir=$2 ;;
        --ds-build) ds_build=$2 ;;
        --ds-src) ds_src=$2 ;;
        --bench) bench=$2 ;;
        --python) py=$2 ;;
        --rounds) rounds=$2 ;;
        --size) size=$2 ;;
        --elements) elements=$2 ;;
        --sub-group) sub_group=$2 ;;
        --steps) steps=$2 ;;
        --threads) threads=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# Sizes and element counts with an optional K, M, G or T (binary multiples), checked against
# overflow (lib/args.sh); counts as integers.
size_bytes=$(check_size --size "$size") || exit 2
numel=$(check_size --elements "$elements") || exit 2
sub_numel=$(check_size --sub-group "$sub_group") || exit 2
check_count --rounds "$rounds" 1 1000
check_count --steps "$steps" 1 1000
check_count --threads "$threads" 1 1024
((size_bytes % block_size == 0)) || die "--size $size: not a multiple of the 1 MiB block"
((sub_numel <= numel)) || die "--sub-group $sub_group is larger than --elements $elements"

# The tools, each checked before anything runs.
[[ -x $bench ]] || die "--bench '$bench' is not an executable (build zinf-bench first)"
command -v fio >/dev/null || die "fio is not installed"
command -v fallocate >/dev/null || die "fallocate (util-linux) is not installed"
if [[ ! -x $py ]] || ! "$py" -c 'import torch' 2>/dev/null; then
  die "--python '$py' cannot import torch (DeepSpeed's ops need the python they were built with)"
fi
for f in ds_aio_bench.py ds_swapper_step.py; do
  [[ -f $ds_dir/$f ]] || die "no $ds_dir/$f: give DeepSpeed's bench directory with --deepspeed"
done
ds_dir=$(cd -- "$ds_dir" && pwd)
for op in async_io cpu_adam pin_memory; do
  [[ -f $ds_build/$op/$op.so ]] ||
    die "DeepSpeed's ops are not built: no $ds_build/$op/$op.so (build them as $ds_dir/README.md" \
      "says, or give their directory with --ds-build)"
done
[[ -f $ds_src/deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py ]] ||
  die "no DeepSpeed source in $ds_src (unpack it as $ds_dir/README.md says, or give --ds-src)"

claim_dir "$dir" "$script" || exit 2
dir=$(cd -- "$dir" && pwd)
rm -rf -- "$dir/logs" "$dir/data"
mkdir -p -- "$dir/logs" "$dir/data"
trap 'rm -rf -- "$dir/data"' EXIT
results=$dir/results.jsonl
: >"$results"
write_file=$dir/data/write.dat
read_file=$dir/data/read.dat
swap=$dir/data/swap
buffer_bytes=$((4 * sub_numel))

# emit JSON: one result line, on stdout and in results.jsonl.
emit() {
  echo "$1"
  echo "$1" >>"$results"
}

# run LOG CMD...: CMD's stdout; its stderr in LOG. A failure ends the script with the log's end.
run() {
  local log=$1
  shift
  if ! "$@" 2>"$log"; then
    tail -n 15 -- "$log" >&2
    fail "failed: $* (log: $log)"
  fi
}

# field KEY: KEY of the last JSON object on stdin (as JSON: a list stays a list).
field() {
  "$py" -c '
import json, sys
objs = [json.loads(l) for l in sys.stdin if l.lstrip().startswith("{")]
if not objs or sys.argv[1] not in objs[-1]:
    sys.exit("no JSON object with \"%s\" in the output" % sys.argv[1])
print(json.dumps(objs[-1][sys.argv[1]]))' "$1"
}

# io_run TOOL OP ROUND: one measurement, emitted as a JSON line.
io_run() {
  local tool=$1 op=$2 r=$3 log=$dir/logs/io-$1-$2-r$3.err out gbs
  local file=$read_file
  if [[ $op == write ]]; then
    file=$write_file
    rm -f -- "$file"
    [[ $tool == zinf ]] || run "$log" fallocate -l "$size_bytes" "$file"
  fi
  case $tool in
    deepspeed)
      out=$(run "$log" env TORCH_EXTENSIONS_DIR="$ds_build" "$py" "$ds_dir/ds_aio_bench.py" \
        --op "$op" --file "$file" --size "$size_bytes" --block-size "$block_size" \
        --queue-depth "$queue_depth" --intra-op-parallelism 1)
      gbs=$(field gb_per_s <<<"$out") ;;
    zinf)
      out=$(run "$log" "$bench" io --path "$dir/data" --file "$file" --op "$op" \
        --size "$size_bytes" --block-size "$block_size" --queue-depth "$queue_depth" --json)
      gbs=$("$py" -c 'import sys; print(float(sys.argv[1]) * 1048576 / 1e9)' \
        "$(field mib_per_s <<<"$out")") ;;
    fio)
      out=$(run "$log" fio --name=vs-deepspeed --filename="$file" --rw="$op" --bs="$block_size" \
        --iodepth="$queue_depth" --ioengine=io_uring --direct=1 --numjobs=1 \
        --size="$size_bytes" --output-format=json)
      gbs=$("$py" -c 'import json, sys; print(json.load(sys.stdin)["jobs"][0][sys.argv[1]]["bw_bytes"] / 1e9)' \
        "$op" <<<"$out") ;;
  esac
  if [[ $op == write ]]; then rm -f -- "$file"; fi
  emit "{\"part\":\"io\",\"round\":$r,\"op\":\"$op\",\"tool\":\"$tool\",\"size_bytes\":$size_bytes,\"gb_per_s\":$gbs}"
}

# step_run TOOL MODE ROUND: one run of --steps timed steps (MODE sync or pipelined).
step_run() {
  local tool=$1 mode=$2 r=$3 log=$dir/logs/step-$1-$2-r$3.err out seconds ran buffers=4
  # DeepSpeed's pipeline runs with 9 buffers and the gradients outside its pool (a partition-sized
  # fp32 buffer); zinf's takes 10: its 10th buffer holds the sub-group's gradient instead.
  if [[ $mode == pipelined ]]; then buffers=$([[ $tool == deepspeed ]] && echo 9 || echo 10); fi
  rm -rf -- "$swap"
  mkdir -p -- "$swap"
  if [[ $tool == deepspeed ]]; then
    local extra=()
    if [[ $mode == pipelined ]]; then extra=(--pipelined); fi
    out=$(run "$log" env TORCH_EXTENSIONS_DIR="$ds_build" DS_SRC="$ds_src" \
      OMP_NUM_THREADS="$threads" "$py" "$ds_dir/ds_swapper_step.py" --dir "$swap/ds" \
      --elements "$numel" --sub-group "$sub_numel" --steps "$steps" \
      --queue-depth "$queue_depth" "${extra[@]}")
    seconds=$("$py" -c 'import json, sys; print(json.dumps([json.loads(l)["seconds"] for l in sys.stdin if l.startswith("{")]))' <<<"$out")
    ran=$(field mode <<<"$out")
  else
    local flag=--sync
    if [[ $mode == pipelined ]]; then flag=--pipeline; fi
    out=$(run "$log" "$bench" step --path "$swap" --state-bytes $((12 * numel)) \
      --state-format fp32 --sub-group-size "$sub_numel" "$flag" --steps "$steps" \
      --threads "$threads" --queue-depth "$queue_depth" --block-size "$block_size" \
      --budget $((buffers * buffer_bytes)) --no-io-only --json)
    seconds=$(field step_seconds <<<"$out")
    ran=$(field mode <<<"$out")
  fi
  rm -rf -- "$swap"
  emit "{\"part\":\"step\",\"round\":$r,\"tool\":\"$tool\",\"mode\":\"$mode\",\"ran\":$ran,\"budget_bytes\":$((buffers * buffer_bytes)),\"elements\":$numel,\"sub_group\":$sub_numel,\"step_seconds\":$seconds}"
}

echo "bench-vs-deepspeed: $rounds round(s); I/O $size_bytes bytes; step $numel elements in" \
  "sub-groups of $sub_numel, $steps timed steps, $threads Adam threads; logs in $dir/logs" >&2
run "$dir/logs/prepare-read-file.err" fio --name=prepare --filename="$read_file" --rw=write \
  --bs="$block_size" --iodepth="$queue_depth" --ioengine=io_uring --direct=1 \
  --size="$size_bytes" >/dev/null
io_tools=(deepspeed zinf fio)
step_runs=("deepspeed sync" "deepspeed pipelined" "zinf sync" "zinf pipelined")
for ((r = 1; r <= rounds; ++r)); do
  for op in write read; do
    for ((i = 0; i < ${#io_tools[@]}; ++i)); do
      io_run "${io_tools[(i + r - 1) % ${#io_tools[@]}]}" "$op" "$r"
    done
  done
  for ((i = 0; i < ${#step_runs[@]}; ++i)); do
    # shellcheck disable=SC2086  # "TOOL MODE"
    step_run ${step_runs[(i + r - 1) % ${#step_runs[@]}]} "$r"
  done
done

summary=$("$py" - "$results" <<'EOF'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
human = []
for op in ("write", "read"):
    med = {t: statistics.median(r["gb_per_s"] for r in rows
                                if r["part"] == "io" and r["op"] == op and r["tool"] == t)
           for t in ("deepspeed", "zinf", "fio")}
    ratio = med["zinf"] / med["deepspeed"]
    print(json.dumps({"summary": "io", "op": op, "median_gb_per_s": med,
                      "zinf_over_deepspeed_speed": round(ratio, 3),
                      "fio_over_deepspeed_speed": round(med["fio"] / med["deepspeed"], 3)}))
    human.append("engine %-5s  DeepSpeed %.2f GB/s, zinf %.2f, fio %.2f: zinf/DeepSpeed speed %.2fx"
                 % (op, med["deepspeed"], med["zinf"], med["fio"], ratio))
for mode in ("sync", "pipelined"):
    runs = {t: [r for r in rows if r["part"] == "step" and r["tool"] == t and r["mode"] == mode]
            for t in ("deepspeed", "zinf")}
    med = {t: statistics.median(s for r in runs[t] for s in r["step_seconds"]) for t in runs}
    ran = sorted({r["ran"] for r in runs["zinf"]})
    ratio = med["zinf"] / med["deepspeed"]
    print(json.dumps({"summary": "step", "mode": mode, "median_seconds": med,
                      "zinf_ran": ran, "zinf_over_deepspeed_time": round(ratio, 3)}))
    human.append("step %-9s DeepSpeed %.3f s, zinf %.3f s (ran %s): zinf/DeepSpeed time %.2fx"
                 % (mode, med["deepspeed"], med["zinf"], "/".join(ran), ratio))
print("zinf vs DeepSpeed (I/O: > 1 is zinf faster; steps: < 1 is zinf faster):", file=sys.stderr)
for h in human:
    print("  " + h, file=sys.stderr)
EOF
)
while read -r line; do emit "$line"; done <<<"$summary"
