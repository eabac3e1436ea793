#!/usr/bin/env bash
# README quick start, command 1: the main job on its embedded default.
#
# Installs what is missing, builds, then trains the built-in charlm (a character-level language
# model on the license texts every Debian machine has) on 2 ranks with launch/zinf-run, its Adam
# state swapped under ./zinf-demo/swap and checkpointed collectively into ./zinf-demo/checkpoints;
# then resumes from the latest checkpoint for more steps, and lists the checkpoint with zinf-ckpt.
#
#   launch/demo.sh                                # 2 ranks, 1000 steps, then 200 more after a resume
#   launch/demo.sh --ranks 3 --dir /mnt/nvme/demo --steps 400 --more 100
#
# --dir (default ./zinf-demo) is emptied and reused on every run, so it must be a directory
# demo.sh made (it holds .made-by-demo.sh), a new or an empty one: any other is refused (exit 2).
# --ranks (1-1024), --steps and --more are integers >= 1; a bad value exits 2 before anything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=lib/args.sh
source launch/lib/args.sh
args_script="demo.sh"

ranks=2 work=$PWD/zinf-demo steps=1000 more=200
while (($#)); do
  case $1 in
    --ranks) need_value "$@"; ranks=$2; shift 2 ;;
    --dir) need_value "$@"; work=$2; shift 2 ;;
    --steps) need_value "$@"; steps=$2; shift 2 ;;
    --more) need_value "$@"; more=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) usage_die "unknown argument '$1' (see --help)" ;;
  esac
done
# Checked before the demo directory is made or anything is installed or built.
check_count --ranks "$ranks" 1 1024
check_count --steps "$steps"
check_count --more "$more"
[[ -n $work ]] || usage_die "--dir needs a non-empty directory"
[[ $work = /* ]] || work=$PWD/$work

# A fresh demo directory each time: the swap store lives there during the run (removed at exit),
# the checkpoints and the per-step metrics stay. Only a directory demo.sh made is emptied.
# shellcheck source=lib/outdir.sh
source launch/lib/outdir.sh
empty_claimed_dir "$work" demo.sh || exit 2
mkdir -p "$work/swap"

bash launch/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target zinf-train zinf-ckpt >/dev/null

ckpt=$work/checkpoints
train=(--checkpoint-dir "$ckpt" --checkpoint-every 250 --metrics "$work/metrics.jsonl")

echo "== 1. train $steps steps on $ranks ranks (optimizer state swapped under $work/swap)"
launch/zinf-run -np "$ranks" --nvme "$work/swap" -- zinf-train --steps "$steps" "${train[@]}"
echo
echo "== 2. resume from $ckpt/latest ($(cat "$ckpt/latest")) and train to step $((steps + more))"
launch/zinf-run -np "$ranks" --nvme "$work/swap" -- \
  zinf-train --steps $((steps + more)) --resume latest "${train[@]}"
echo
echo "== 3. the checkpoint"
build/bin/zinf-ckpt ls "$ckpt"
cat <<EOF

Checkpoint: $ckpt/$(cat "$ckpt/latest") (latest: $ckpt/latest); per-step metrics: $work/metrics.jsonl
  build/bin/zinf-ckpt verify $ckpt                 # recompute every checksum
  build/bin/zinf-ckpt export $ckpt --out weights.safetensors --format safetensors
  launch/zinf-run -np 3 --nvme $work/swap -- zinf-train --resume latest --checkpoint-dir $ckpt --steps $((steps + more + 50))
EOF
