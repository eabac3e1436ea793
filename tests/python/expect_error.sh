#!/usr/bin/env bash
# expect_error.sh <ranks> <exception class> <message regex> <case>: runs bad_input.py <case> on
# <ranks> ranks and passes when the job exits non-zero within 60 s and every rank printed
# "rank R: raised <class>: ...<message regex>..." (bad_input.py). Environment as
# checkpoint_test.sh.
set -uo pipefail
np=$1 class=$2 regex=$3 case=$4
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-py-bad.XXXXXX")
trap 'rm -rf "$work"' EXIT
read -r -a mpiexec <<< "$TEST_MPIEXEC"
start=$(date +%s)
timeout 60 "${mpiexec[@]}" -np "$np" "$TEST_PYTHON" "$here/bad_input.py" "$case" "$work" \
  > "$work/out.txt" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
cat "$work/out.txt"
if [ "$rc" -eq 0 ]; then echo "expect_error: $case: the job succeeded"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "expect_error: $case: no exit within 60 s"; exit 1; fi
got=$(cat "$work"/rank*.txt 2>/dev/null | grep -cE "^rank [0-9]+: raised $class: .*$regex")
if [ "$got" -ne "$np" ]; then
  echo "expect_error: $case: $got of $np ranks raised $class matching '$regex'"
  exit 1
fi
echo "expect_error: $case: $class on all $np ranks, exit $rc, in ${took}s"
