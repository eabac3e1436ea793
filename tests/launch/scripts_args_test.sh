#!/usr/bin/env bash
# The launch/ scripts' command lines (launch/lib/args.sh; the benchmarks' are bench/run.py's,
# tests/bench/harness_args_test.py): demo.sh and demo-larger-than-memory.sh, given a count flag
# with no value, 0, -1 or a non-numeric value (and a few sizes that are 0 or too large for bash's
# arithmetic), each exit 2 within seconds with a message naming the flag ("--rounds needs a value",
# "--rounds '0': expected an integer ..."), before it makes a directory, installs, builds or runs
# anything: the scratch directory it is pointed at (and TMPDIR) stays as it was.
#
#   scripts_args_test.sh LAUNCH_DIR
set -u
launch=$(readlink -f "${1:?usage: scripts_args_test.sh LAUNCH_DIR}")
top=$(mktemp -d "${TMPDIR:-/tmp}/zinf-scripts-args-XXXXXX") || exit 1
trap 'rm -rf "$top"' EXIT
work=$top/scratch  # what the scripts are pointed at; must stay as it is
mkdir -p "$work/tmp" "$work/cwd"
failures=0
cases=0

listing() { (cd "$work" && find . | LC_ALL=C sort); }

# refused NAME TEXT SCRIPT ARGS...: SCRIPT ARGS exits 2 within 20 s, stderr contains TEXT, and
# nothing under $work changed.
refused() {
  local name=$1 text=$2 script=$3 rc before after
  shift 3
  cases=$((cases + 1))
  before=$(listing)
  (cd "$work/cwd" && TMPDIR=$work/tmp timeout --kill-after=5 20 \
    bash "$launch/$script" "$@" < /dev/null > "$top/out" 2> "$top/err")
  rc=$?
  local err
  err=$(cat "$top/err")
  after=$(listing)
  if ((rc != 2)); then
    echo "FAIL: $script $name: exit $rc, expected 2; stderr: $(tail -3 <<< "$err")" >&2
  elif [[ $err != *"$text"* ]]; then
    echo "FAIL: $script $name: stderr does not contain '$text': $err" >&2
  elif [[ $before != "$after" ]]; then
    echo "FAIL: $script $name: left files behind: $(diff <(echo "$before") <(echo "$after") |
      grep '^>' | head -3 | tr '\n' ' ')" >&2
  else
    echo "  ok $script $name: $(head -1 <<< "$err")"
    return 0
  fi
  failures=$((failures + 1))
}

# counts SCRIPT FLAG ARGS...: FLAG with nothing after it, followed by another option, and with
# 0, -1 and "x": each refused.
counts() {
  local script=$1 flag=$2
  shift 2
  refused "$flag (missing)" "$flag needs a value" "$script" "$@" "$flag"
  refused "$flag --help" "$flag needs a value (got the option '--help')" "$script" "$@" "$flag" --help
  local v
  for v in 0 -1 x; do
    refused "$flag $v" "$flag '$v'" "$script" "$@" "$flag" "$v"
  done
}

w=$work
counts demo.sh --ranks --dir "$w/demo"
counts demo.sh --steps --dir "$w/demo"
counts demo-larger-than-memory.sh --steps --dir "$w/ltm"
counts demo-larger-than-memory.sh --layers --dir "$w/ltm"
counts demo-larger-than-memory.sh --np --dir "$w/ltm"
refused "--batch 3 --np 2" "--batch 3 is not a multiple of --np 2" demo-larger-than-memory.sh \
  --dir "$w/ltm" --batch 3
refused "--limit 0" "--limit '0'" demo-larger-than-memory.sh --dir "$w/ltm" --limit 0
refused "--limit above 2/3" "would not be larger than the memory" demo-larger-than-memory.sh \
  --dir "$w/ltm" --limit 8G

# Every script that takes flags sources the shared checks.
for script in "$launch"/*.sh; do
  name=${script##*/}
  [[ $name == install-deps.sh ]] && continue
  cases=$((cases + 1))
  if ! grep -q 'lib/args.sh' "$script"; then
    echo "FAIL: $name does not source lib/args.sh" >&2
    failures=$((failures + 1))
  fi
done

if ((failures > 0)); then
  echo "FAIL: $failures of $cases cases" >&2
  exit 1
fi
echo "PASS: $cases cases"
