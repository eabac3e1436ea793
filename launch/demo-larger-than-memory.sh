#!/usr/bin/env bash
# A model larger than the memory of the job, trained (docs/tools.md, "Demo: a PyTorch
# transformer larger than the job's memory"). Makes a memory cgroup whose limit
# is at most 2/3 of the model's fp32 weights, starts 2 ranks inside it (mpirun and every rank),
# trains examples/torch/transformer_lm.py (nn.TransformerEncoderLayer LM with a tied head, each
# layer under torch.utils.checkpoint, ZeRO stage 3, weight shards and Adam state on NVMe,
# DeepSpeed's defaults for the stage-3 sizes) on the license texts of the machine, checks that
# the loss fell, and prints the limit, the engine's host memory plan and the measured peaks (the
# group's and each rank's) side by side.
#
#   launch/demo-larger-than-memory.sh                 # 2.25 GiB of weights in a 1.5 GiB group
#   launch/demo-larger-than-memory.sh --dir /mnt/nvme/ltm --layers 16 --steps 6
#
# --dir DIR      work directory (default ./zinf-demo-ltm): the swap store (removed at the end),
#                the config and the per-rank peaks; emptied on every run, so it must be one this
#                script made (it holds .made-by-demo-larger-than-memory.sh), a new or an empty one
# --np N         ranks (default 2)          --steps N   optimizer steps (default 3)
# --d-model N    width (default 1024)       --layers N  encoder layers (default 48)
# --heads N      (default 16)               --seq N     sequence length (default 32)
# --batch N      sequences per step over all ranks, a multiple of --np (default 4)
# --limit SIZE   the group's memory limit (default: the fp32 weights / 1.5); a limit above that
#                is refused (the run would not be larger than memory)
# --explicit-sizes  small explicit stage-3 sizes in the config instead of DeepSpeed's defaults
#
# Needs root and a memory cgroup controller (cgroup v1 /sys/fs/cgroup/memory, or v2
# /sys/fs/cgroup with the memory controller): without them it says why and exits 1; nothing runs
# outside a group. Needs the build (build/python) and about 24 bytes per parameter free in --dir.
# Bad flags exit 2 before anything is made. The group is removed at exit. Prints the example's
# JSON line and one {"demo": "larger-than-memory", ...} JSON line on stdout, logs on stderr.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=lib/args.sh
source launch/lib/args.sh
args_script="demo-larger-than-memory.sh"
# shellcheck source=lib/cgroup.sh
source launch/lib/cgroup.sh

work=$PWD/zinf-demo-ltm np=2 steps=3 d_model=1024 layers=48 heads=16 seq=32 batch=4 limit=""
explicit=()
while (($#)); do
  case $1 in
    --dir | --np | --steps | --d-model | --layers | --heads | --seq | --batch | --limit)
      need_value "$@"
      case $1 in
        --dir) work=$2 ;; --np) np=$2 ;; --steps) steps=$2 ;; --d-model) d_model=$2 ;;
        --layers) layers=$2 ;; --heads) heads=$2 ;; --seq) seq=$2 ;; --batch) batch=$2 ;;
        --limit) limit=$2 ;;
      esac
      shift 2 ;;
    --explicit-sizes) explicit=(--explicit-sizes); shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage_die "unknown argument '$1' (see --help)" ;;
  esac
done
# Checked before anything is made or run.
check_count --np "$np" 1 64
check_count --steps "$steps" 1 1000
check_count --d-model "$d_model" 1 65536
check_count --layers "$layers" 1 4096
check_count --heads "$heads" 1 1024
check_count --seq "$seq" 1 65536
check_count --batch "$batch" 1 1000000
((d_model % heads == 0)) || usage_die "--d-model $d_model is not a multiple of --heads $heads"
((batch % np == 0)) || usage_die "--batch $batch is not a multiple of --np $np"
[[ -n $work ]] || usage_die "--dir needs a non-empty directory"
[[ $work = /* ]] || work=$PWD/$work
# examples/torch/transformer_lm.py's parameter_count.
params=$((layers * (12 * d_model * d_model + 13 * d_model) + (256 + seq) * d_model + 2 * d_model))
weights=$((4 * params))
most=$((weights * 2 / 3))  # weights >= 1.5 x limit
if [[ -z $limit ]]; then
  limit=$((most / (1 << 20) * (1 << 20)))
else
  limit=$(check_size --limit "$limit" $((16 << 20))) || exit 2
  ((limit <= most)) || usage_die "--limit $limit bytes is more than 2/3 of the model's" \
    "$weights bytes of fp32 weights: the model would not be larger than the memory"
fi
((limit >= 16 << 20)) || usage_die "the model ($weights bytes) is too small for a limit of at" \
  "least 16 MiB at 1.5x; raise --d-model or --layers"

python=/usr/bin/python3
[[ -f build/python/zinf/__init__.py ]] || {
  echo "$args_script: build/python/zinf is missing: build first (cmake --preset default &&" \
    "cmake --build --preset default)" >&2
  exit 1
}
# The group first: without one there is no demonstration, and nothing else is made.
group=$(memory_group_make "zinf-demo-ltm-$$" "$limit") || {
  echo "$args_script: cannot make a memory cgroup for the job (above). The demo needs root and" \
    "a writable memory cgroup controller (cgroup v1 /sys/fs/cgroup/memory or cgroup v2" \
    "/sys/fs/cgroup); it does not run the model without a limit." >&2
  exit 1
}
out=""
cleanup() {
  memory_group_remove "$group"
  [[ -z $out ]] || rm -f "$out"
}
trap cleanup EXIT

# shellcheck source=lib/outdir.sh
source launch/lib/outdir.sh
empty_claimed_dir "$work" "$args_script" || exit 2
avail=$(($(df --output=avail -k "$work" | tail -1) * 1024))
((avail >= 24 * params)) || {
  echo "$args_script: needs about $((24 * params)) bytes free in $work, $avail available" >&2
  exit 1
}
mpi=(mpirun --oversubscribe -x PYTHONPATH -x OMPI_MCA_mpi_yield_when_idle)
[[ $(id -u) != 0 ]] || mpi+=(--allow-run-as-root)
export PYTHONPATH=$PWD/build/python${PYTHONPATH:+:$PYTHONPATH} OMPI_MCA_mpi_yield_when_idle=1

mib() { echo $((($1 + (1 << 19)) >> 20)); }  # rounded, as the summary below
echo "== $params parameters ($(mib "$weights") MiB of fp32 weights) on $np ranks, all inside" \
  "the memory cgroup $group with a limit of $(mib "$limit") MiB (the weights are" \
  "$(awk -v w="$weights" -v l="$limit" 'BEGIN { printf "%.2f", w / l }')x the limit)" >&2
out=$(mktemp)
rc=0
# The subshell joins the group, then becomes mpirun: every rank is born inside it.
(memory_group_join "$group" &&
  exec "${mpi[@]}" -np "$np" "$python" examples/torch/transformer_lm.py \
    --nvme-path "$work/swap" --d-model "$d_model" --layers "$layers" --heads "$heads" \
    --seq "$seq" --batch "$batch" --steps "$steps" --checkpoint-activations \
    "${explicit[@]}") > "$out" || rc=$?
group_peak=$(memory_group_peak "$group")
ooms=$(memory_group_ooms "$group")
cat "$out"
"$python" - "$out" "$rc" "$limit" "${group_peak:-null}" "$ooms" "$group" "$weights" <<'EOF'
import json
import sys

path, rc, limit, group_peak, ooms, group, weights = sys.argv[1:]
rc, limit, weights = int(rc), int(limit), int(weights)
group_peak = None if group_peak == "null" else int(group_peak)
lines = [line for line in open(path) if line.startswith('{"example": "transformer_lm"')]
run = json.loads(lines[-1]) if lines else None
falls = run is not None and run["loss_last"] < run["loss_first"]
mib = lambda b: "-" if b is None else f"{b / 2**20:.0f} MiB"
summary = {"demo": "larger-than-memory", "exit": rc, "weights_bytes": weights,
           "limit_bytes": limit, "group": group, "group_peak_bytes": group_peak,
           "oom_kills": int(ooms or 0), "loss_falls": falls}
if run is not None:
    summary.update({k: run[k] for k in ("ranks", "steps", "loss_first", "loss_last",
                                        "plan_bytes", "budget_bytes", "peak_rss_bytes")})
print(json.dumps(summary))
err = sys.stderr
print(f"\n  fp32 weights of the model    {mib(weights)} ({weights / limit:.2f}x the limit)",
      file=err)
print(f"  memory limit of the job      {mib(limit)} (cgroup {group})", file=err)
print(f"  peak of the whole job        {mib(group_peak)} (the group's peak usage)", file=err)
if run is not None:
    ranks = run["ranks"]
    print(f"  engine's plan per rank       {mib(run['plan_bytes'])} (x {ranks} ranks = "
          f"{mib(run['plan_bytes'] * ranks)})", file=err)
    print(f"  budget per rank              {mib(run['budget_bytes'])} (the limit over {ranks} "
          "ranks)", file=err)
    print("  peak RSS per rank            " + ", ".join(mib(p) for p in run["peak_rss_bytes"]),
          file=err)
    print(f"  loss                         {run['loss_first']:.4f} -> {run['loss_last']:.4f} in "
          f"{run['steps']} steps ({'fell' if falls else 'did NOT fall'})", file=err)
if rc != 0 or not falls:
    why = (f"the job exited {rc}" + (f", {ooms} process(es) of the group killed by the OOM killer"
                                     if int(ooms or 0) else "")) if rc else "the loss did not fall"
    print(f"demo-larger-than-memory.sh: FAILED: {why}", file=err)
    sys.exit(1)
print("  => trained a model larger than the job's memory", file=err)
EOF
