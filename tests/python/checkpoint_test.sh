#!/usr/bin/env bash
# Save on 2 ranks, load on 2 (bitwise) and on 3 and continue (checkpoint.py), then `zinf-ckpt
# verify` the file. ZINF_TEST_OPTIMIZER_STATE=q8: the same with q8 optimizer state.
# Environment (tests/python/CMakeLists.txt): TEST_MPIEXEC, TEST_PYTHON, TEST_ZINF_CKPT, PYTHONPATH.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-py-ckpt.XXXXXX")
trap 'rm -rf "$work"' EXIT
read -r -a mpiexec <<< "$TEST_MPIEXEC"
"${mpiexec[@]}" -np 2 "$TEST_PYTHON" "$here/checkpoint.py" save "$work"
"${mpiexec[@]}" -np 2 "$TEST_PYTHON" "$here/checkpoint.py" load "$work"
"${mpiexec[@]}" -np 3 "$TEST_PYTHON" "$here/checkpoint.py" load "$work"
"$TEST_ZINF_CKPT" verify "$work/ckpt/latest"
echo "checkpoint_test: OK"
