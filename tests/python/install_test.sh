#!/usr/bin/env bash
# The Python package as a user installs it: `cmake --install BUILD --component python` staged
# under a temporary DESTDIR, then, with only the staged site directory on PYTHONPATH and the
# build tree out of reach, examples/torch/train_charlm.py trains on 2 ranks, checkpoints,
# resumes on 3 ranks, and its loss falls.
#
#   install_test.sh BUILD_DIR SOURCE_DIR     (environment: TEST_MPIEXEC, TEST_PYTHON)
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-py-install.XXXXXX")
trap 'rm -rf -- "$work"' EXIT
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

DESTDIR=$work/stage cmake --install "$build" --component python > "$work/install.log" ||
  fail "install failed: $(cat "$work/install.log")"
site=$(find "$work/stage" -type d -name zinf -path '*-packages/zinf' | head -n 1)
[[ -n $site ]] || fail "no zinf package under $work/stage: $(cat "$work/install.log")"
site=$(dirname "$site")
# Every file of the package's source (zinf.torch is a subpackage: its folder too).
sources=$(cd "$src/python" && find zinf -name '*.py' | sort)
[[ $sources == *zinf/torch/__init__.py* ]] || fail "no zinf/torch/__init__.py under $src/python"
for f in $sources zinf/libzinf_engine.so; do
  [[ -e $site/$f ]] || fail "$f was not installed"
done
ext=$(find "$site/zinf" -name '_zinf*.so' | head -n 1)
[[ -n $ext ]] || fail "the extension _zinf was not installed"
# The extension finds zinf's libraries beside it, not in the build tree.
ldd "$ext" | grep libzinf_ | grep -v "$site/zinf/" && fail "the extension loads zinf from elsewhere"
echo "installed into $site"

export PYTHONPATH=$site
unset PYTHONDONTWRITEBYTECODE
read -r -a mpiexec <<< "$TEST_MPIEXEC"
cd "$work"
run() {
  "${mpiexec[@]}" -np "$1" "$TEST_PYTHON" "$src/examples/torch/train_charlm.py" \
    --steps "$2" --batch 8 --print-every 10 --checkpoint-every 20 "${@:3}" 2>&1 | tee -a out.txt
}
run 2 40 > /dev/null
run 3 50 --resume > /dev/null
grep -q "resumed at step 40 from .*step-40.h5" out.txt || fail "no resume on 3 ranks: $(tail out.txt)"
first=$(grep -oE 'step 10/40 loss [0-9.]+' out.txt | head -n 1 | awk '{print $4}')
last=$(grep -oE 'step 50/50 loss [0-9.]+' out.txt | head -n 1 | awk '{print $4}')
[[ -n $first && -n $last ]] || fail "no loss lines: $(tail -n 20 out.txt)"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
  fail "the loss did not fall: step 10 $first, step 50 $last"
echo "install_test: OK (loss $first at step 10 on 2 ranks, $last at step 50 on 3 ranks)"
