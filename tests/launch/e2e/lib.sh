# Helpers shared by the end-to-end tests of zinf-train (sourced, not run). Every test script is
#
#   <test>.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
#
# and calls e2e_init NAME first: a fresh scratch directory $work under
# ${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}, removed on exit, which is also the working directory (so
# the built-in default swap directory ./zinf-swap can never land in the source tree).
set -u
# Absolute paths: the tests run inside their scratch directory.
zinf_train=$(readlink -f "$1")
zinf_ckpt=$(readlink -f "$2")
mpiexec=$3
# shellcheck disable=SC2054  # "self,vader,tcp" is one argument
mpiexec_flags=(--allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader,tcp
               --mca btl_tcp_if_include lo)
# The step lines and the summary are INFO lines; a fault spec from the caller's environment would
# break every test but the one that sets its own.
export ZINF_LOG_LEVEL=info
unset ZINF_FAULT_INJECT

e2e_init() {
  [[ -x $zinf_train ]] || { echo "FAIL: zinf-train not executable: $zinf_train" >&2; exit 1; }
  [[ -x $zinf_ckpt ]] || { echo "FAIL: zinf-ckpt not executable: $zinf_ckpt" >&2; exit 1; }
  work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-e2e-$1-XXXXXX") ||
    { echo "FAIL: cannot make a scratch directory" >&2; exit 1; }
  trap 'cd /; rm -rf "$work"' EXIT
  cd "$work" || exit 1
  echo "scratch directory $work"
  echo "optimizer state: ${ZINF_E2E_OPTIMIZER_STATE:-fp32 (the default)}"
}

# fail MESSAGE: one FAIL line, then the tail of every log of this test, then exit 1.
fail() {
  echo "FAIL: $*" >&2
  local f
  for f in "$work"/*.log; do
    [[ -f $f ]] && { echo "--- tail of $f" >&2; tail -25 "$f" >&2; }
  done
  exit 1
}

check() {  # check MESSAGE: prints what is being checked
  echo "check: $*"
}

# train NP TIMEOUT_S ARGS...: zinf-train on NP ranks under mpirun, killed after TIMEOUT_S.
# ZINF_E2E_OPTIMIZER_STATE (fp32, q8): every run with that --optimizer-state (the q8 variants).
train() {
  local np=$1 limit=$2
  shift 2
  local state=()
  [[ -n ${ZINF_E2E_OPTIMIZER_STATE:-} ]] && state=(--optimizer-state "$ZINF_E2E_OPTIMIZER_STATE")
  timeout --kill-after=10 "$limit" "$mpiexec" "${mpiexec_flags[@]}" -np "$np" "$zinf_train" \
    "${state[@]}" "$@"
}

# metric, metric_after, metrics_problem, median, parse_size (tests/testing/metrics.sh).
# shellcheck source=../../testing/metrics.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../testing/metrics.sh"

# mean_over FILE KEY FIRST LAST: mean of KEY over steps FIRST..LAST (exactly one line per step).
mean_over() {
  metric "$1" "$2" | awk -v a="$3" -v b="$4" '
    $1 >= a && $1 <= b { s += $2; ++n }
    END { if (n != b - a + 1) { print "count " n; exit 1 } printf "%.6f\n", s / n }'
}

# stamp: seconds since the epoch with milliseconds.
stamp() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(stamp)" 'BEGIN { printf "%.1f", b - a }'; }

# within A B TOL: |B - A| <= TOL * |A|.
within() {
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = b - a; m = a; if (d < 0) d = -d; if (m < 0) m = -m
                                             exit !(d <= t * m) }'
}
