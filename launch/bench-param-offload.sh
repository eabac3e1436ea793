#!/usr/bin/env bash
# ZeRO stage 3 with offload_param nvme (zinf-bench offload-param), on 2 ranks:
#   1. side by side on one model, the order rotated each round: the offload run against the same
#      model in memory and against the I/O alone; each round prints offload / max(memory, io);
#   2. the memory run (root; launch/lib/cgroup.sh, cgroup v1 or v2): both ranks inside a memory
#      cgroup whose limit is half the model's fp32 weights train it with everything on NVMe; it
#      must complete with the loss falling, and the group's peak usage is reported (v1
#      memory.max_usage_in_bytes, v2 memory.peak).
#
#   launch/bench-param-offload.sh [--path DIR] [--bin build/bin/zinf-bench] [--layers 64]
#                                 [--hidden 2048] [--rounds 2] [--steps 3] [--np 2]
#                                 [--no-memory-run] [--no-side-by-side]
#
# --layers 1-4096, --hidden 1-65536, --rounds 1-100, --steps 1-1000, --np 1-1024 (integers; a bad
# value or a flag without one exits 2 before anything is made).
# JSON lines on stdout (zinf-bench's, then one {"bench": "offload-param-memory-run", ...});
# logs on stderr. Needs free space in --path for about 20 bytes per parameter (state, gradient,
# spare sub-groups) and, for the side-by-side memory mode, about 16 bytes per parameter of RAM.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
# shellcheck source=lib/args.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
args_script="bench-param-offload.sh"
die() { usage_die "$@"; }

path=/tmp/zinf-bench-param
bin=build/bin/zinf-bench
layers=64
hidden=2048
rounds=2
steps=3
np=2
memory_run=1
side_by_side=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --path|--bin|--layers|--hidden|--rounds|--steps|--np)
      need_value "$@"
      case "$1" in
        --path) path=$2 ;; --bin) bin=$2 ;; --layers) layers=$2 ;; --hidden) hidden=$2 ;;
        --rounds) rounds=$2 ;; --steps) steps=$2 ;; --np) np=$2 ;;
      esac
      shift 2 ;;
    --no-memory-run) memory_run=0; shift ;;
    --no-side-by-side) side_by_side=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument $1" ;;
  esac
done
# zinf-bench offload-param's own limits, checked here before anything is made or run (and so
# that the size arithmetic below stays far inside 64 bits).
check_count --layers "$layers" 1 4096
check_count --hidden "$hidden" 1 65536
check_count --rounds "$rounds" 1 100
check_count --steps "$steps" 1 1000
check_count --np "$np" 1 1024
[[ -n $path ]] || die "--path needs a non-empty directory"
[[ -x $bin ]] || die "$bin is not an executable (build first: cmake --build --preset default)"
mkdir -p "$path"
mpi=(mpirun --oversubscribe)
[[ $(id -u) == 0 ]] && mpi+=(--allow-run-as-root)

params=$(( layers * (hidden * hidden + hidden) ))
weights=$(( params * 4 ))
need=$(( params * 20 ))
avail=$(( $(df --output=avail -k "$path" | tail -1) * 1024 ))
(( avail >= need )) || die "needs about $need bytes free in $path, $avail available"
echo "bench-param-offload: $params parameters ($weights bytes of fp32 weights) on $np ranks" >&2

if [[ $side_by_side == 1 ]]; then
  "${mpi[@]}" -np "$np" "$bin" offload-param --path "$path" --layers "$layers" --hidden "$hidden" \
    --steps "$steps" --rounds "$rounds" --json
fi

if [[ $memory_run == 1 ]]; then
  # shellcheck source=lib/cgroup.sh
  source "$(dirname "${BASH_SOURCE[0]}")/lib/cgroup.sh"
  limit=$(( weights / 2 ))
  group=$(memory_group_make "zinf-bench-param-$$" "$limit") ||
    die "the memory run needs root and a memory cgroup controller (above; or pass --no-memory-run)"
  trap 'memory_group_remove "$group"' EXIT
  echo "memory run: $weights bytes of weights, group limit $limit bytes" >&2
  out=$(mktemp)
  rc=0
  # The subshell joins the group, then becomes mpirun: every rank is born inside it.
  ( memory_group_join "$group"
    exec "${mpi[@]}" -np "$np" "$bin" offload-param --path "$path" --layers "$layers" \
      --hidden "$hidden" --steps "$steps" --modes offload --json ) > "$out" || rc=$?
  peak=$(memory_group_peak "$group")
  failcnt=$(cat "$group/memory.failcnt" 2> /dev/null || echo null)  # cgroup v1 only
  ooms=$(memory_group_ooms "$group")
  cat "$out"
  loss=$(grep '"mode":"offload"' "$out" | tail -1 || true)
  rm -f "$out"
  first=$(sed -n 's/.*"loss_first":\([^,}]*\).*/\1/p' <<< "$loss")
  last=$(sed -n 's/.*"loss_last":\([^,}]*\).*/\1/p' <<< "$loss")
  falls=false
  [[ -n $first && -n $last ]] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' && falls=true
  printf '{"bench": "offload-param-memory-run", "ranks": %d, "weights_bytes": %d, "limit_bytes": %d, "group_peak_bytes": %s, "failcnt": %s, "oom_kills": %d, "exit": %d, "loss_falls": %s}\n' \
    "$np" "$weights" "$limit" "${peak:-null}" "$failcnt" "${ooms:-0}" "$rc" "$falls"
  [[ $rc == 0 && $falls == true ]] || { echo "memory run failed (exit $rc, loss falls: $falls)" >&2; exit 1; }
fi
