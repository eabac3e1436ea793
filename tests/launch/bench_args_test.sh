#!/usr/bin/env bash
# zinf-bench's numeric flags: zero, negative, malformed and huge values are usage errors (exit 2,
# a message naming the flag) before the subcommand does any work: no crash (step's
# --sub-group-size 0 used to end in SIGFPE), no run on a silently adjusted value, nothing written.
# So is io --plot: zinf-bench draws no pictures (bench/run.py io-sweep does).
#
#   bench_args_test.sh ZINF_BENCH
set -u
bench=$(readlink -f "${1:?usage: bench_args_test.sh ZINF_BENCH}")
work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-bench-args-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
mkdir "$work/path"
failures=0
cases=0

# usage_error FLAG ARGS...: zinf-bench ARGS exits 2 within 30 s, its stderr names FLAG, and
# nothing appears in $work/path.
usage_error() {
  local flag=$1 rc
  shift
  cases=$((cases + 1))
  timeout --kill-after=5 30 "$bench" "$@" > "$work/out" 2> "$work/err"
  rc=$?
  if ((rc != 2)); then
    echo "FAIL: zinf-bench $*: exit $rc, expected 2: $(grep -v '^\[' "$work/err" | tail -3)" >&2
    failures=$((failures + 1))
  elif ! grep -qF -- "$flag" "$work/err"; then
    echo "FAIL: zinf-bench $*: the error does not name $flag: $(head -3 "$work/err")" >&2
    failures=$((failures + 1))
  elif [[ -n $(ls -A "$work/path") ]]; then
    echo "FAIL: zinf-bench $*: wrote $(ls -A "$work/path")" >&2
    failures=$((failures + 1))
  else
    echo "  ok zinf-bench $*: $(head -1 "$work/err")"
  fi
}

p=(--path "$work/path")
for v in 0 -1 x 2^3 99999999999T 2P; do
  usage_error --sub-group-size step "${p[@]}" --state-bytes 1M --steps 1 --sub-group-size "$v"
done
usage_error --state-bytes step "${p[@]}" --state-bytes 0
usage_error --state-bytes step "${p[@]}" --state-bytes 11
usage_error --budget step "${p[@]}" --state-bytes 1M --budget 0
usage_error --warmup step "${p[@]}" --state-bytes 1M --warmup -1
usage_error --threads step "${p[@]}" --state-bytes 1M --threads -1
usage_error --queue-depth step "${p[@]}" --state-bytes 1M --queue-depth 0
usage_error --intra-op-parallelism step "${p[@]}" --state-bytes 1M --intra-op-parallelism 0
usage_error --block-size step "${p[@]}" --state-bytes 1M --block-size 0
usage_error --stripe-unit step "${p[@]}" --state-bytes 1M --stripe-unit 0
usage_error --steps step "${p[@]}" --state-bytes 1M --steps 0
usage_error --rounds step "${p[@]}" --state-bytes 1M --rounds 0
usage_error --host-cache step "${p[@]}" --state-bytes 1M --host-cache 2
usage_error --sub-group-size ckpt "${p[@]}" --dir "$work/path/ckpt" --sub-group-size 0
usage_error --state-bytes ckpt "${p[@]}" --dir "$work/path/ckpt" --state-bytes -5
usage_error --chunk-numel ckpt "${p[@]}" --dir "$work/path/ckpt" --chunk-numel 0
usage_error --trials ckpt "${p[@]}" --dir "$work/path/ckpt" --trials 0
usage_error --numel adam --numel 0
usage_error --numel adam --numel 99999999999T
usage_error --threads adam --threads -1
usage_error --steps adam --steps 0
usage_error --triad-mib adam --triad-mib 99999999
usage_error --size checksum --size 0
usage_error --reps checksum --reps 0
usage_error --size io "${p[@]}" --size 0
usage_error --block-size io "${p[@]}" --block-size 0
usage_error --chunk io "${p[@]}" --chunk 0
usage_error --queue-depth io "${p[@]}" --queue-depth 0
# zinf-bench writes CSV and JSON only (the harness draws: bench/run.py io-sweep): --plot is gone,
# an unknown flag, refused before the sweep writes its file.
usage_error --plot io "${p[@]}" --size 1M --sweep --plot "$work/path/sweep.png"
usage_error --sub-group-size offload-param "${p[@]}" --sub-group-size 3
usage_error --layers offload-param "${p[@]}" --layers 0

if ((failures > 0)); then
  echo "FAIL: $failures of $cases cases" >&2
  exit 1
fi
echo "PASS: $cases bad flags, each a usage error"
