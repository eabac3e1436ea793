#!/usr/bin/env bash
# charlm_stage3_test.sh <ranks> <source dir>: examples/torch/train_charlm.py --stage3 (the
# model built inside zinf.torch.init, offload_param nvme, its default) trains 40 short steps on
# <ranks> ranks in the current directory: the job exits 0, the engine says the weight shards
# are read from the swap store, the run ends with its "done" line, and the loss falls from
# step 10 to step 40. Environment: TEST_MPIEXEC, TEST_PYTHON (tests/python/CMakeLists.txt).
set -uo pipefail
np=$1 src=$2
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
rm -rf zinf-torch-demo out.txt
read -r -a mpiexec <<< "$TEST_MPIEXEC"
# 40 steps: the example's WarmupCosineLR warms up over 30.
"${mpiexec[@]}" -np "$np" "$TEST_PYTHON" "$src/examples/torch/train_charlm.py" --stage3 \
  --offload-param nvme --steps 40 --batch 4 --print-every 10 --checkpoint-every 1000 \
  > out.txt 2>&1
rc=$?
cat out.txt
[[ $rc -eq 0 ]] || fail "train_charlm.py --stage3 on $np ranks exited $rc"
grep -q "parameters (stage 3)" out.txt || fail "no stage 3 model line"
grep -q "partitioned (shards read from the swap store when gathered)" out.txt ||
  fail "the engine did not say offload_param nvme"
grep -q "done: steps 1..40 " out.txt || fail "no 'done: steps 1..40' line"
first=$(grep -oE 'step 10/40 loss [0-9.]+' out.txt | head -n 1 | awk '{print $4}')
last=$(grep -oE 'step 40/40 loss [0-9.]+' out.txt | head -n 1 | awk '{print $4}')
[[ -n $first && -n $last ]] || fail "no loss lines for steps 10 and 40"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
  fail "the loss did not fall: step 10 $first, step 40 $last"
echo "charlm_stage3_test: OK on $np ranks (loss $first at step 10, $last at step 40)"
