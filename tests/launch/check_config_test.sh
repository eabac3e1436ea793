#!/usr/bin/env bash
# zinf-train --check-config refuses what a run refuses at configuration time, the same way: for
# each bad config (a device "none", a 5000-character job_id, a pinned budget of "3" bytes, a NUL
# byte in nvme_path / checkpoint dir / data path, integers beyond their range, a config file that
# is missing or a FIFO), `zinf-train --check-config --config F` exits 2 with exactly one
# "zinf-train failed: " line holding the expected text, and the run itself (`--steps 1`, no
# --check-config) exits with the same code and the same message, before it writes anything; a
# good config exits 0. One rank, an MPI singleton.
#
#   check_config_test.sh ZINF_TRAIN BAD_CONFIG_DIR
set -u
zinf_train=$(readlink -f "${1:?usage: check_config_test.sh ZINF_TRAIN BAD_CONFIG_DIR}")
corpus=$(readlink -f "${2:?usage: check_config_test.sh ZINF_TRAIN BAD_CONFIG_DIR}")
work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-check-config-XXXXXX") || exit 1
trap 'cd /; rm -rf "$work"' EXIT
cd "$work" || exit 1
unset ZINF_FAULT_INJECT ZINF_IO_ENGINE
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# run NAME ARGS...: zinf-train ARGS; sets rc and line (its one "zinf-train failed: " message,
# without the log prefix; "" when none, "MANY" when several).
run() {
  local name=$1
  shift
  timeout --kill-after=5 60 "$zinf_train" "$@" > "$work/$name.out" 2> "$work/$name.err"
  rc=$?
  local lines
  lines=$(grep -F 'zinf-train failed: ' "$work/$name.err")
  if [[ -z $lines ]]; then
    line=""
  elif (($(grep -c . <<< "$lines") > 1)); then
    line=MANY
  else
    line=${lines#*zinf-train failed: }
  fi
}

# refused NAME TEXT ARGS...: --check-config and the run both exit 2 with the same one message,
# which contains TEXT.
refused() {
  local name=$1 text=$2 check_line
  shift 2
  run "$name-check" --check-config "$@"
  check_line=$line
  if ((rc != 2)); then
    fail "$name: --check-config exited $rc, expected 2: $(tail -2 "$work/$name-check.err")"
    return
  fi
  if [[ $check_line == MANY || $check_line != *"$text"* ]]; then
    fail "$name: --check-config's error is not one line holding '$text': $check_line"
    return
  fi
  local steps=(--steps 1) arg
  for arg in "$@"; do [[ $arg == --steps ]] && steps=(); done
  run "$name-run" "${steps[@]}" "$@"
  if ((rc != 2)) || [[ $line != "$check_line" ]]; then
    fail "$name: the run exited $rc with '$line'; --check-config exited 2 with '$check_line'"
    return
  fi
  echo "  ok $name (exit 2 for both): $check_line"
}

mkdir -p swap
for name in 99-offload-device-none 100-job-id-5000-characters 101-pinned-budget-string-3 \
            103-nvme-path-nul-byte 104-nvme-path-list-nul-byte 105-checkpoint-dir-nul-byte \
            106-data-path-nul-byte 107-sub-group-size-2-to-63 \
            108-host-cache-size-string-beyond-int64 109-steps-per-print-float-beyond-int64; do
  [[ -f $corpus/$name.json && -f $corpus/$name.expect ]] || { fail "no $corpus/$name.json/.expect"; continue; }
  flags=()
  grep -q '"offload_optimizer"' "$corpus/$name.json" || flags+=(--nvme-path "$work/swap")
  refused "$name" "$(head -1 "$corpus/$name.expect")" --config "$corpus/$name.json" "${flags[@]}"
done
# A config file that cannot be read is a bad config too (2), not "any other failure" (1).
refused config-missing "$work/no-such.json" --config "$work/no-such.json"
mkfifo "$work/fifo"
refused config-fifo 'a FIFO, not a regular file' --config "$work/fifo"
# A flag's bad value is a bad key.
refused steps-zero 'zinf.steps: 0 is out of range [1, 9007199254740991]' --steps 0 \
  --nvme-path "$work/swap"

# Nothing was created by the refused runs: no swap store, no checkpoint directory.
left=$(find "$work/swap" -mindepth 1 | head -3)
[[ -z $left ]] || fail "refused runs left files in the swap directory: $left"
[[ -e $work/zinf-swap ]] && fail "a refused run made ./zinf-swap"

# A good config: --check-config exits 0 and prints the effective config.
echo '{"train_micro_batch_size_per_gpu": 4}' > good.json
run good-check --check-config --config good.json --nvme-path "$work/swap"
if ((rc != 0)) || ! grep -q '"offload_optimizer"' "$work/good-check.err" "$work/good-check.out"; then
  fail "a good config: --check-config exited $rc (expected 0 and the effective config):" \
    "$(tail -3 "$work/good-check.err")"
else
  echo "  ok a good config: exit 0"
fi

if ((failures > 0)); then
  echo "FAIL: $failures case(s)" >&2
  exit 1
fi
echo "PASS"
