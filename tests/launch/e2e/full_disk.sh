#!/usr/bin/env bash
# A full disk is a clean error on every rank, with nothing lost. On a 4 MiB tmpfs checkpoint
# directory the first checkpoint of a small charlm (hidden 256, 1 layer: 1.6 MB) fits and the
# second does not. On 1, 2 and 3 ranks zinf-train must exit 1 within 60 s with exactly one
# identical "zinf-train failed: ResourceExhausted: ..." line per rank naming the directory;
# `latest` must still name step-2.h5, which zinf-ckpt verifies; no .partial or temporary file is
# left; and no swap store remains. Then the metrics file on a 4 KiB tmpfs: the same kind of clean
# error once it is full, every rank, `latest` intact. Needs root to mount; skips (77) otherwise.
#
#   full_disk.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init full-disk

mounts=()
unmount_all() {
  local m
  for m in "${mounts[@]}"; do umount -l "$m" 2> /dev/null; done
  cd / && rm -rf "$work"
}
trap unmount_all EXIT
# tmpfs DIR SIZE: a fresh tmpfs of SIZE on DIR (skips the test when mounting is not allowed).
tmpfs() {
  mkdir -p "$1"
  mount -t tmpfs -o "size=$2" tmpfs "$1" 2> "$work/mount.err" || {
    echo "SKIP: cannot mount a tmpfs (needs root): $(cat "$work/mount.err")"
    exit 77
  }
  mounts+=("$1")
}

model=(--model charlm --hidden 256 --layers 1)
failures=0
# expect_clean_failure TAG NP LOG TEXT: mpirun's exit code was 1 (in $rc, after $secs s), every
# rank printed one identical "zinf-train failed: " line, which contains TEXT.
expect_clean_failure() {
  local tag=$1 np=$2 log=$3 text=$4 lines ranks messages
  if ((rc == 124 || rc == 137)); then
    echo "FAIL: $tag: still running after the timeout (a hang)" >&2
    return 1
  fi
  ((rc == 1)) || { echo "FAIL: $tag: exit code $rc, expected 1" >&2; tail -5 "$log" >&2; return 1; }
  awk -v s="$secs" 'BEGIN { exit !(s < 60) }' ||
    { echo "FAIL: $tag: took $secs s, more than 60" >&2; return 1; }
  lines=$(grep -F 'zinf-train failed: ' "$log")
  ranks=$(sed -nE 's/.*\[rank ([0-9]+)\/[0-9]+\].*zinf-train failed: .*/\1/p' <<< "$lines" |
    sort -n | tr '\n' ' ')
  [[ $ranks == "$(seq -s ' ' 0 $((np - 1))) " ]] ||
    { echo "FAIL: $tag: 'zinf-train failed: ' lines from ranks [$ranks]" >&2; return 1; }
  messages=$(sed -e 's/.*zinf-train failed: //' <<< "$lines" | sort -u)
  (($(wc -l <<< "$messages") == 1)) ||
    { echo "FAIL: $tag: the ranks' messages differ: $messages" >&2; return 1; }
  grep -qF -- "$text" <<< "$messages" ||
    { echo "FAIL: $tag: the error does not contain '$text': $messages" >&2; return 1; }
  echo "  every rank, after $secs s: $messages"
}

# expect_latest_intact TAG DIR STEP: DIR/latest names step-STEP.h5, which verifies, and DIR holds
# nothing else but checkpoints.
expect_latest_intact() {
  local tag=$1 dir=$2 step=$3 stray
  [[ $(cat "$dir/latest" 2> /dev/null) == "step-$step.h5" ]] ||
    { echo "FAIL: $tag: latest is '$(cat "$dir/latest" 2>&1)', not step-$step.h5" >&2; return 1; }
  timeout 60 "$zinf_ckpt" verify "$dir" > "$work/verify.log" 2>&1 ||
    { echo "FAIL: $tag: zinf-ckpt verify failed: $(tail -2 "$work/verify.log")" >&2; return 1; }
  stray=$(find "$dir" -mindepth 1 ! -name latest ! -name 'step-*.h5' -printf '%f ')
  [[ -z $stray ]] || { echo "FAIL: $tag: left behind in $dir: $stray" >&2; return 1; }
  echo "  latest: step-$step.h5, verified; nothing else left"
}

for np in 1 2 3; do
  check "$np rank(s): the second checkpoint does not fit a 4 MiB checkpoint directory"
  ckpt=$work/ckpt-np$np
  swap=$work/swap-np$np
  log=$work/ckpt-np$np.log
  tmpfs "$ckpt" 4m
  mkdir -p "$swap"
  t0=$(stamp)
  train "$np" 90 "${model[@]}" --steps 4 --checkpoint-dir "$ckpt" --checkpoint-every 2 \
    --nvme-path "$swap" > "$log" 2>&1
  rc=$?
  secs=$(elapsed "$t0")
  expect_clean_failure "np$np" "$np" "$log" "ResourceExhausted: checkpoint save step 4" &&
    expect_latest_intact "np$np" "$ckpt" 2 &&
    { [[ -z $(ls -A "$swap") ]] || { echo "FAIL: np$np: swap store left: $(ls -A "$swap")" >&2; false; }; } ||
    failures=$((failures + 1))
done

check "2 ranks: the metrics file fills its disk; the run stops cleanly, latest intact"
metrics_dir=$work/metrics
ckpt=$work/ckpt-metrics
log=$work/metrics.log
tmpfs "$metrics_dir" 4k
mkdir -p "$work/swap-metrics"
t0=$(stamp)
train 2 90 "${model[@]}" --steps 60 --checkpoint-dir "$ckpt" --checkpoint-every 5 \
  --nvme-path "$work/swap-metrics" --metrics "$metrics_dir/m.jsonl" > "$log" 2>&1
rc=$?
secs=$(elapsed "$t0")
last=$(ls "$ckpt" 2> /dev/null | sed -nE 's/^step-([0-9]+)\.h5$/\1/p' | sort -n | tail -1)
expect_clean_failure metrics 2 "$log" "write --metrics $metrics_dir/m.jsonl: No space left" &&
  expect_latest_intact metrics "$ckpt" "$last" || failures=$((failures + 1))

if ((failures > 0)); then
  echo "FAIL: $failures case(s) failed" >&2
  exit 1
fi
echo "PASS: a full checkpoint directory (1, 2, 3 ranks) and a full metrics disk each end every" \
  "rank with one identical error within 60 s, the last checkpoint intact"
