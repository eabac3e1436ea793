#!/usr/bin/env bash
# ZeRO stage 3 of a PyTorch transformer LM (examples/torch/transformer_lm.py's TransformerLM:
# nn.Embedding, nn.TransformerEncoder of nn.TransformerEncoderLayer, nn.LayerNorm, a head tied to
# the embedding), built inside zinf.torch.init and trained by zinf.torch.ZeroOptimizer on --np
# ranks with a DeepSpeed config that sets no size (sub_group_size, buckets, the live window,
# max_in_cpu and the pool are DeepSpeed's defaults, chosen by the engine). Driver:
# launch/bench/stage3_lm.py.
#
#   launch/bench-stage3-lm.sh [--path DIR] [--d-model 256] [--layers 4] [--seq 64] [--batch 8]
#                             [--steps 3] [--rounds 2] [--np 2] [--ram SIZE]
#                             [--no-table] [--no-side-by-side]
#                             [--speculative-step auto|true|false]
#
# 1. Side by side (one mpirun; --no-side-by-side skips it): per round, in the order offload,
#    memory, io rotated by one each round, each mode runs 1 warm-up step and --steps timed ones:
#    - offload: stage 3, offload_param nvme and offload_optimizer nvme under DIR;
#    - memory:  the same model and batches in memory (offload_param none, offload_optimizer cpu);
#    - io:      the I/O alone: the swap bytes of the latest offload run's median step (round
#               0 runs offload first; StepInfo's swap_read_bytes / swap_write_bytes: all ranks,
#               from the end of the previous step to the end of this one, so forward and
#               backward reads from the store are in it) moved by `zinf-bench io` (O_DIRECT, a
#               fresh file under DIR, every rank its share at once, write then read). It
#               moves one size both ways, max(read, write) per rank rounded up to 1 MiB, and
#               the step's I/O time is write_seconds x write / size + read_seconds x read /
#               size, each op at the bandwidth it measured.
#    A mode's figure is the median over its timed steps of forward + backward + step on the
#    slowest rank. JSON lines: {"bench": "stage3-lm", "round", "mode", "step_seconds", ...} per
#    mode, {"bench": "stage3-lm-round", ..., "offload_over_max_memory_io"} per round, and
#    {"bench": "stage3-lm-summary", ...} (the medians over the rounds; the issue's goal <= 1.15).
# 2. Bytes per parameter (--no-table skips it): each setting (stages 1 and 2 with
#    offload_optimizer cpu and nvme; stage 3 with offload_param none and cpu under either
#    offload_optimizer, and nvme under nvme, which the engine requires) trains --steps steps in
#    an mpirun of its own, once with --layers and once with half as many (twice as many when
#    --layers is 1). {"bench": "stage3-lm-bytes", ...} per run:
#    - ram_added_bytes: each rank's peak RSS (ru_maxrss, before close) less its RSS before the
#      model was built; ram_bytes_per_parameter: their sum over the model's parameters;
#    - plan_bytes_per_rank: the engine's host memory plan (plan_bytes of the metrics; it counts
#      the process's RSS before the engine too); plan_bytes_per_parameter: x ranks / parameters;
#    - nvme_bytes: the allocated size (du -s -B1) of the setting's swap directory after the last
#      step, before close() removes the store (nvme_apparent_bytes: du -sb); per parameter.
#    Then per setting {"bench": "stage3-lm-fits", ...}: through its two runs, the node's RAM
#    (every rank's peak RSS, the interpreter and torch included) = fixed + per_parameter x
#    parameters; ram_largest_parameters = (R - fixed) / per_parameter for R = --ram (default the
#    machine's MemTotal); the same from the plan (plan_*). null where the two runs do not rise.
#    A setting that fails prints {"bench": "stage3-lm-bytes", ..., "error": ...}; the script
#    then goes on and exits 1 at the end.
#
# --d-model 159-65536 (below 159 no matrix has more than stage3_param_persistence_threshold,
# 1e5 elements, and nothing would be partitioned), heads d_model / 64 (at least 1, lowered until
# it divides d_model); --layers 1-4096; --seq 1-65536; --batch (sequences per step over all
# ranks, a multiple of --np) 1-1000000; --steps 1-1000; --rounds 1-100; --np 1-1024; --ram a size
# such as 64G. A bad value or a flag without one exits 2 before anything is made. Needs the build
# (build/python, build/bin/zinf-bench), about 48 bytes per parameter free in --path (default
# /tmp/zinf-bench-stage3-lm), where it works in a directory of its own, removed at the end, and
# for the memory mode and the in-memory settings about 20 bytes per parameter of RAM over the
# ranks (fp32 weights, gradient and Adam state) besides torch's own.
# JSON lines on stdout, logs on stderr.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
# shellcheck source=lib/args.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
args_script="bench-stage3-lm.sh"

path=/tmp/zinf-bench-stage3-lm
d_model=256
layers=4
seq=64
batch=8
steps=3
rounds=2
np=2
ram=""
table=1
speculative=auto
side_by_side=1
while (($#)); do
  case $1 in
    --path | --d-model | --layers | --seq | --batch | --steps | --rounds | --np | --ram)
      need_value "$@"
      case $1 in
        --path) path=$2 ;; --d-model) d_model=$2 ;; --layers) layers=$2 ;; --seq) seq=$2 ;;
        --batch) batch=$2 ;; --steps) steps=$2 ;; --rounds) rounds=$2 ;; --np) np=$2 ;;
        --ram) ram=$2 ;;
      esac
      shift 2 ;;
    --speculative-step)
      need_value "$@"
      case $2 in auto | true | false) speculative=$2 ;;
        *) usage_die "--speculative-step $2: auto, true or false" ;; esac
      shift 2 ;;
    --no-table) table=0; shift ;;
    --no-side-by-side) side_by_side=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage_die "unknown argument '$1' (see --help)" ;;
  esac
done
# Checked before anything is made or run.
check_count --d-model "$d_model" 1 65536
check_count --layers "$layers" 1 4096
check_count --seq "$seq" 1 65536
check_count --batch "$batch" 1 1000000
check_count --steps "$steps" 1 1000
check_count --rounds "$rounds" 1 100
check_count --np "$np" 1 1024
((4 * d_model * d_model > 100000)) || usage_die "--d-model $d_model: the largest matrix" \
  "(4 d_model^2 elements) is not above stage3_param_persistence_threshold (1e5, DeepSpeed's" \
  "default), so stage 3 would partition nothing; give at least 159"
((batch % np == 0)) || usage_die "--batch $batch is not a multiple of --np $np"
if [[ -n $ram ]]; then
  ram=$(check_size --ram "$ram") || exit 2
fi
[[ -n $path ]] || usage_die "--path needs a non-empty directory"
((table || side_by_side)) || usage_die "--no-table and --no-side-by-side leave nothing to run"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
cd "$OLDPWD"
[[ $path = /* ]] || path=$PWD/$path
python=/usr/bin/python3
bin=$repo/build/bin/zinf-bench
[[ -f $repo/build/python/zinf/__init__.py && -x $bin ]] || {
  echo "$args_script: build/python/zinf or build/bin/zinf-bench is missing: build first" \
    "(cmake --preset default && cmake --build --preset default)" >&2
  exit 1
}
if [[ -z $ram ]]; then
  ram=$(($(awk '/^MemTotal:/ { print $2 }' /proc/meminfo) * 1024))
fi
# examples/torch/transformer_lm.py's parameter_count.
params=$((layers * (12 * d_model * d_model + 13 * d_model) + (256 + seq) * d_model + 2 * d_model))
mkdir -p -- "$path"
avail=$(($(df --output=avail -k "$path" | tail -1) * 1024))
((avail >= 48 * params)) || {
  echo "$args_script: needs about $((48 * params)) bytes free in $path, $avail available" >&2
  exit 1
}
work=$(mktemp -d "$path/bench-stage3-lm.XXXXXX")
out=$(mktemp)
trap 'rm -rf -- "$work" "$out"' EXIT
mpi=(mpirun --oversubscribe -x PYTHONPATH -x OMPI_MCA_mpi_yield_when_idle)
[[ $(id -u) != 0 ]] || mpi+=(--allow-run-as-root)
export PYTHONPATH=$repo/build/python${PYTHONPATH:+:$PYTHONPATH} OMPI_MCA_mpi_yield_when_idle=1
driver=$repo/launch/bench/stage3_lm.py
model=(--d-model "$d_model" --seq "$seq" --batch "$batch" --steps "$steps"
  --speculative-step "$speculative")
echo "$args_script: $params parameters ($((4 * params)) bytes of fp32 weights) on $np ranks," \
  "work directory $work" >&2

failed=0
if ((side_by_side)); then
  "${mpi[@]}" -np "$np" "$python" "$driver" side-by-side --path "$work" --bin "$bin" \
    "${model[@]}" --layers "$layers" --rounds "$rounds" || failed=1
fi

if ((table)); then
  other=$((layers > 1 ? layers / 2 : 2))
  settings=("1 cpu none" "1 nvme none" "2 cpu none" "2 nvme none" "3 cpu none" "3 nvme none"
    "3 cpu cpu" "3 nvme cpu" "3 nvme nvme")
  for setting in "${settings[@]}"; do
    read -r stage optimizer param <<< "$setting"
    for n in "$other" "$layers"; do
      echo "$args_script: bytes per parameter: stage $stage, offload_optimizer $optimizer," \
        "offload_param $param, $n layers" >&2
      rc=0
      "${mpi[@]}" -np "$np" "$python" "$driver" bytes --path "$work" "${model[@]}" \
        --layers "$n" --stage "$stage" --offload-optimizer "$optimizer" \
        --offload-param "$param" > "$out" || rc=$?
      cat "$out"
      cat "$out" >> "$work/bytes.jsonl"
      if ((rc != 0)) || ! grep -q '"bench": "stage3-lm-bytes"' "$out"; then
        failed=1
        printf '{"bench": "stage3-lm-bytes", "stage": %d, "offload_optimizer": "%s", "offload_param": %s, "layers": %d, "error": "exit %d (stderr above)"}\n' \
          "$stage" "$optimizer" "$([[ $stage == 3 ]] && echo "\"$param\"" || echo null)" "$n" "$rc"
      fi
    done
  done
  "$python" "$driver" fit --ram "$ram" < "$work/bytes.jsonl" || failed=1
fi
((failed == 0)) || { echo "$args_script: some runs failed (above)" >&2; exit 1; }
