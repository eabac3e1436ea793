#!/usr/bin/env bash
# rank_fails_test.sh <ranks> <case> <regex>: runs rank_fails.py <case> on <ranks> ranks and
# passes when the job ends non-zero within 60 s with <regex> in its output (an ERROR line or an
# exception naming the failed rank), and a following run of the case `clean` on the same swap
# directory (a stale store reclaimed, nothing left after close) succeeds. Environment as
# checkpoint_test.sh.
set -uo pipefail
np=$1 case=$2 regex=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-py-fails.XXXXXX")
trap 'rm -rf "$work"' EXIT
read -r -a mpiexec <<< "$TEST_MPIEXEC"
start=$(date +%s)
timeout -k 5 60 "${mpiexec[@]}" -np "$np" "$TEST_PYTHON" "$here/rank_fails.py" "$case" "$work" \
  > "$work/out.txt" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
cat "$work/out.txt" "$work"/rank*.txt 2>/dev/null
if [ "$rc" -eq 0 ]; then echo "rank_fails: $case: the job succeeded"; exit 1; fi
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "rank_fails: $case: the job did not end within 60 s"; exit 1
fi
if ! grep -qE "$regex" "$work/out.txt" "$work"/rank*.txt 2>/dev/null; then
  echo "rank_fails: $case: no line matches '$regex'"; exit 1
fi
echo "rank_fails: $case: ended with exit $rc in ${took}s, naming it"
rm -f "$work"/rank*.txt
if ! timeout -k 5 60 "${mpiexec[@]}" -np "$np" "$TEST_PYTHON" "$here/rank_fails.py" clean "$work" \
    > "$work/clean.txt" 2>&1; then
  cat "$work/clean.txt"; echo "rank_fails: $case: the next run on the same swap directory failed"
  exit 1
fi
# (mpirun may join two ranks' lines into one)
[ "$(grep -oE 'rank [0-9]+: clean' "$work/clean.txt" | sort -u | wc -l)" = "$np" ] || {
  cat "$work/clean.txt"; echo "rank_fails: $case: not every rank of the next run was clean"; exit 1; }
echo "rank_fails: $case: the next run reclaimed the store and left nothing"
