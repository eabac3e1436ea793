#!/usr/bin/env bash
# The launch/ scripts' command lines (launch/lib/args.sh): every script, given a count flag with
# no value, 0, -1 or a non-numeric value (and a few sizes that are 0 or too large for bash's
# arithmetic), exits 2 within seconds with a message naming the flag ("--rounds needs a value",
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
counts bench-adam-vs-torch.sh --steps
counts bench-adam-vs-torch.sh --threads
counts bench-checkpoint.sh --trials --dir "$w/ckpt"
counts bench-checkpoint.sh --ranks --dir "$w/ckpt"
refused "--state 0" "--state '0'" bench-checkpoint.sh --dir "$w/ckpt" --state 0
refused "--state huge" "--state '99999999999T'" bench-checkpoint.sh --dir "$w/ckpt" --state 99999999999T
counts bench-io-vs-fio.sh --trials --dir "$w"
refused "--size 0" "--size '0'" bench-io-vs-fio.sh --dir "$w" --size 0
counts bench-param-offload.sh --rounds --path "$w/param"
counts bench-param-offload.sh --hidden --path "$w/param"
refused "--layers 99999" "--layers '99999'" bench-param-offload.sh --path "$w/param" --layers 99999
counts bench-paths.sh --rounds --fast "$w" --slow "$w" --out "$w/paths"
refused "--state 2^64" "--state '16777216T'" bench-paths.sh --fast "$w" --slow "$w" --state 16777216T
counts bench-q8-quality.sh --steps --out "$w/q8q"
counts bench-q8-quality.sh --ranks --out "$w/q8q"
counts bench-q8-speed.sh --rounds --path "$w"
refused "--numel 0" "--numel '0'" bench-q8-speed.sh --path "$w" --numel 0
for flag in --d-model --layers --seq --batch --steps --rounds --np; do
  counts bench-stage3-lm.sh "$flag" --path "$w/s3lm"
done
refused "--d-model 158" "stage3_param_persistence_threshold" bench-stage3-lm.sh --path "$w/s3lm" \
  --d-model 158
refused "--batch 3 --np 2" "--batch 3 is not a multiple of --np 2" bench-stage3-lm.sh \
  --path "$w/s3lm" --batch 3
refused "--ram 0" "--ram '0'" bench-stage3-lm.sh --path "$w/s3lm" --ram 0
refused "--layers 4097" "--layers '4097'" bench-stage3-lm.sh --path "$w/s3lm" --layers 4097
refused "nothing to run" "leave nothing to run" bench-stage3-lm.sh --path "$w/s3lm" --no-table \
  --no-side-by-side
counts bench-step.sh --rounds --path "$w/step"
refused "--state 0" "--state '0'" bench-step.sh --path "$w/step" --state 0
refused "--sub-group-size huge" "--sub-group-size '9999999999999999T'" bench-step.sh \
  --path "$w/step" --sub-group-size 9999999999999999T
refused "--state-format" "--state-format 'fp64'" bench-step.sh --path "$w/step" --state-format fp64
counts bench-vs-deepspeed.sh --rounds --dir "$w/ds"
counts bench-vs-deepspeed.sh --steps --dir "$w/ds"
refused "--size 2^51" "--size '2048T'" bench-vs-deepspeed.sh --dir "$w/ds" --size 2048T
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
counts scaling.sh --steps --out "$w/scaling" --path "$w"
counts scaling.sh --repeat --out "$w/scaling" --path "$w"
refused "--ranks list" "--ranks 'x'" scaling.sh --out "$w/scaling" --ranks "1 x"
refused "--state-per-rank 2T" "--state-per-rank '2T'" scaling.sh --out "$w/scaling" \
  --state-per-rank 2T
refused "--hosts (missing)" "--hosts needs a list" scaling.sh --out "$w/scaling" --hosts

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
