#!/usr/bin/env bash
# Optimizer step with the Adam state on disk: synchronous vs pipelined swapper against the I/O
# engine alone (zinf-bench step), and optionally the memory run: state 1.5x the machine's RAM,
# peak RSS must stay within pool + 256 MiB.
#
#   launch/bench-step.sh [--path DIR] [--bin build/bin/zinf-bench] [--state 4G] [--memory-run]
#                        [--state-format fp32|q8|fp32,q8] [--rounds N] [--sub-group-size 16M]
# (fp32,q8 with --rounds 3: both state formats on the same parameters, alternating.)
#
# Writes JSON lines to stdout; logs and timer tables go to stderr. Needs free space for the state
# plus one spare sub-group (and, for --memory-run, 1.5x RAM plus one sub-group: check df first).
# A bad command line (a flag without its value, a zero or non-numeric count or size) exits 2
# before anything is made or run.
set -euo pipefail

# shellcheck source=lib/args.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
args_script="bench-step.sh"

path=/tmp/zinf-bench-step
bin=build/bin/zinf-bench
state=4G
sub_group=16M
memory_run=0
formats=fp32
rounds=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --path) need_value "$@"; path=$2; shift 2 ;;
    --bin) need_value "$@"; bin=$2; shift 2 ;;
    --state) need_value "$@"; state=$2; shift 2 ;;
    --sub-group-size) need_value "$@"; sub_group=$2; shift 2 ;;
    --memory-run) memory_run=1; shift ;;
    --state-format) need_value "$@"; formats=$2; shift 2 ;;
    --rounds) need_value "$@"; rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) usage_die "unknown argument $1" ;;
  esac
done
# Every flag checked before the directory is made or the benchmark runs.
check_size --state "$state" 12 > /dev/null || exit 2
check_size --sub-group-size "$sub_group" > /dev/null || exit 2
check_count --rounds "$rounds" 1 1000
[[ $formats =~ ^(fp32|q8)(,(fp32|q8))*$ ]] ||
  usage_die "--state-format '$formats': expected fp32, q8 or fp32,q8"
[[ -n $path ]] || usage_die "--path needs a non-empty directory"
[[ -x $bin ]] || usage_die "--bin '$bin' is not an executable (build zinf-bench first)"
mkdir -p "$path"

# 1. Both modes on the same state size; the JSON has seconds_per_step, io_only_seconds and
#    step_over_io (target: pipelined <= 1.10, and pipelined faster than sync).
"$bin" step --path "$path" --state-bytes "$state" --sub-group-size "$sub_group" --steps 3 \
  --state-format "$formats" --rounds "$rounds" --json

if [[ $memory_run == 1 ]]; then
  # 2. State of 1.5x RAM, pipelined, one timed step: peak_rss_bytes vs pool_bytes.
  ram_kib=$(awk '/MemTotal/ {print $2}' /proc/meminfo)
  big=$(( ram_kib * 1024 * 3 / 2 ))
  need=$(( big + big / 8 ))
  avail=$(( $(df --output=avail -k "$path" | tail -1) * 1024 ))
  if (( avail < need )); then
    echo "memory run: needs about $need bytes free in $path, $avail available" >&2
    exit 1
  fi
  "$bin" step --path "$path" --state-bytes "$big" --sub-group-size "$sub_group" --pipeline \
    --steps 1 --warmup 0 --json
fi
