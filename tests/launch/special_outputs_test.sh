#!/usr/bin/env bash
# No zinf tool writes over a file it did not create, nor touches a non-regular file as an output
# (issue 23). The outputs of zinf-ckpt export (--out, with and without --force), zinf-train
# (--metrics), zinf-bench io (--file, --csv) and ckpt (--dir), the plotter (bench/run.py plot
# --out) and the output directories of the bench harness (bench/harness/common.py claim_dir) are
# pointed at device nodes like /dev/null and /dev/full (made with mknod in the scratch directory,
# never the real /dev; left out with a note where mknod is not allowed), a FIFO, a socket, a
# directory, a link to a device, a dangling link and an existing regular file. Every case must end
# with its documented exit status and a message naming the path's type, every entry still what it
# was (type, size, modification time, the regular file's bytes) and nothing else in the directory
# changed. Then the writes that are allowed: export --force over a regular file, a claimed
# benchmark directory.
# About 10-15 s on the 2-core CI machine.
#
#   special_outputs_test.sh ZINF_TRAIN ZINF_CKPT MPIEXEC ZINF_BENCH
# shellcheck source-path=SCRIPTDIR source=e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/e2e/lib.sh"
zinf_bench=$(readlink -f "$4")
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=/usr/bin/python3
[[ -x $zinf_bench ]] || { echo "FAIL: zinf-bench not executable: $4" >&2; exit 1; }
e2e_init special-outputs

failures=0
cases=0
bad() {  # bad WHAT: one failed check; the test goes on and fails at the end
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# The targets, all in $t, and the words the tools use for each one's type.
t=$work/targets
mkdir "$t"
declare -A type=([fifo]="a FIFO" [sock]="a socket" [subdir]="a directory"
                 [dangling]="a symbolic link")
if mknod "$t/null" c 1 3 && mknod "$t/full" c 1 7; then
  type[null]="a character device"
  type[full]="a character device"
  ln -s null "$t/link-to-null"
  type[link-to-null]="a symbolic link"
else
  rm -f "$t/null"
  echo "note: mknod not allowed here: device nodes not tested"
fi
mkfifo "$t/fifo"
"$python" -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$t/sock" ||
  fail "cannot make a socket"
mkdir "$t/subdir"
ln -s missing "$t/dangling"
echo precious > "$t/precious"
mapfile -t specials < <(printf '%s\n' "${!type[@]}" | sort)

# state: one line per entry of $t (name, type, size, modification time), then the bytes of the
# regular file.
state() {
  find "$t" -mindepth 1 -printf '%f %y %s %T@\n' | sort
  cat "$t/precious"
}
before=$(state)
unchanged() {  # unchanged LABEL: $t is as it was
  local now
  now=$(state)
  [[ $now == "$before" ]] ||
    bad "$1: $t changed: $(diff <(echo "$before") <(echo "$now") | grep '^[<>]' | tr '\n' ' ')"
}

# verdict LABEL WANT_RC TEXT RC OUTPUT: a command that exited RC, having written OUTPUT (a file),
# exits WANT_RC and says TEXT.
verdict() {
  local label=$1 want=$2 text=$3 rc=$4 output=$5
  cases=$((cases + 1))
  if ((rc != want)); then
    bad "$label: exit status $rc, expected $want: $(tail -2 "$output")"
  elif ! grep -qF -- "$text" "$output"; then
    bad "$label: the output lacks '$text': $(tail -2 "$output")"
  else
    echo "  ok $label (exit $rc)"
  fi
}

# expect LABEL WANT_RC TEXT COMMAND...: COMMAND (30 s at most) exits WANT_RC, its output contains
# TEXT, and $t is unchanged.
expect() {
  local label=$1 want=$2 text=$3
  shift 3
  timeout --kill-after=5 30 "$@" > "$work/out.txt" 2>&1
  verdict "$label" "$want" "$text" $? "$work/out.txt"
  unchanged "$label"
}

mkdir "$work/swap"
t0=$(stamp)
check "zinf-train --metrics: every special file refused (exit 1), a link by what it leads to"
# The runs side by side (each is mostly MPI start-up), with the one that makes the checkpoint
# export reads below; each in its own swap directory.
declare -A pid=()
timeout 60 "$zinf_train" --steps 1 --checkpoint-dir "$work/ckpt" --checkpoint-every 1 \
  --nvme-path "$work/swap" > "$work/train.log" 2>&1 &
ckpt_pid=$!
for name in "${specials[@]}"; do
  mkdir "$work/swap-$name"
  timeout --kill-after=5 30 "$zinf_train" --steps 1 --nvme-path "$work/swap-$name" \
    --metrics "$t/$name" > "$work/metrics-$name.txt" 2>&1 &
  pid[$name]=$!
done
for name in "${specials[@]}"; do
  wait "${pid[$name]}"
  rc=$?
  want="${type[$name]}, not a regular file"
  [[ $name == link-to-null ]] && want="a character device, not a regular file"
  [[ $name == dangling ]] && want="is a symbolic link"
  verdict "--metrics $name" 1 "$want" "$rc" "$work/metrics-$name.txt"
done
unchanged "--metrics"
wait "$ckpt_pid" || fail "the 1-step run that makes a checkpoint failed"

check "zinf-ckpt export --out: every special file refused (exit 1), --force or not"
for name in "${specials[@]}"; do
  for force in "" --force; do
    expect "export --out $name $force" 1 "$t/$name: ${type[$name]}, not a regular file" \
      "$zinf_ckpt" export "$work/ckpt" --out "$t/$name" ${force:+"$force"}
  done
done
expect "export --out an existing file" 1 "$t/precious: exists; not replaced" \
  "$zinf_ckpt" export "$work/ckpt" --out "$t/precious"
grep -qF -- "--force replaces" "$work/out.txt" || bad "export: the refusal does not mention --force"

check "zinf-bench: --file, --csv and ckpt --dir refused before anything runs (exit 1)"
mkdir "$work/bench"
bench_io=("$zinf_bench" io --path "$work/bench" --size 1M --engine posix)
for name in "${specials[@]}" precious; do
  want="${type[$name]:-}, not a regular file"
  [[ $name == link-to-null || $name == dangling ]] && want="is a symbolic link"
  [[ $name == precious ]] && want="writes only into a file it creates"
  expect "bench io --file $name" 1 "$want" "${bench_io[@]}" --file "$t/$name"
  [[ $name == precious ]] && continue
  expect "bench io --csv $name" 1 "$t/$name: ${type[$name]}, not a regular file" \
    "${bench_io[@]}" --sweep --csv "$t/$name"
done
[[ -z $(ls -A "$work/bench") ]] || bad "zinf-bench io left files in --path: $(ls -A "$work/bench")"
expect "bench ckpt --dir (not empty)" 1 "--dir $t is not empty" \
  "$zinf_bench" ckpt --path "$work/swap" --dir "$t" --state-bytes 12M

check "bench/run.py plot --out: every special file refused (exit 2)"
printf '1 2.5\n2 2.0\n' > "$work/series.tsv"
for name in "${specials[@]}"; do
  expect "plot --out $name" 2 "$t/$name: ${type[$name]}, not a regular file" \
    "$python" "$repo/bench/run.py" plot --out "$t/$name" "loss=$work/series.tsv"
done

check "bench/harness/common.py claim_dir: a benchmark writes only in a directory it made"
# claim DIR [fresh]: common.claim_dir(DIR, "test"), or common.fresh_dir with "fresh"; a refusal
# (common.UsageError) is one line and exit 2, as bench/run.py reports it.
claim=("$python" -c '
import sys
sys.path.insert(0, sys.argv[1])
from harness import common
try:
    (common.fresh_dir if sys.argv[3:] == ["fresh"] else common.claim_dir)(sys.argv[2], "test")
except common.UsageError as e:
    print(f"claim: {e}")
    sys.exit(2)' "$repo/bench")
expect "claim_dir of a directory with files" 2 "already holds files" "${claim[@]}" "$t"
expect "fresh_dir of a directory with files" 2 "already holds files" "${claim[@]}" "$t" fresh
for name in "${specials[@]}" precious; do
  [[ $name == subdir ]] && continue  # an empty directory is claimed: below
  expect "claim_dir of $name" 2 "$t/$name exists and is not a directory" "${claim[@]}" "$t/$name"
done
cases=$((cases + 1))
if "${claim[@]}" "$work/new" && [[ -f $work/new/.made-by-test ]] &&
   echo old > "$work/new/old" && mkdir "$work/new/sub" && "${claim[@]}" "$work/new" fresh &&
   [[ $(ls -A "$work/new") == .made-by-test ]] && mkdir "$work/empty" &&
   "${claim[@]}" "$work/empty" && [[ -f $work/empty/.made-by-test ]]; then
  echo "  ok claim_dir: new, made earlier and empty directories are claimed; fresh_dir empties"
else
  bad "claim_dir / fresh_dir on a new, a marked or an empty directory: $(ls -A "$work/new")"
fi

check "what is allowed: export --force replaces a regular file, atomically"
cases=$((cases + 1))
if ! timeout 30 "$zinf_ckpt" export "$work/ckpt" --out "$t/precious" --force > "$work/out.txt" 2>&1; then
  bad "export --force over a regular file failed: $(tail -2 "$work/out.txt")"
elif [[ $(head -c 4 "$t/precious" | od -An -c | tr -d ' ') != '211HDF' ]]; then
  bad "export --force did not write an HDF5 file over $t/precious"
else
  echo "  ok export --force over a regular file"
fi

echo "special_outputs: $cases cases in $(elapsed "$t0") s"
((failures == 0)) || { echo "FAIL: $failures of $cases cases" >&2; exit 1; }
echo "PASS"
