#!/usr/bin/env bash
# The installed package, as a user meets it: installs this build tree into a temporary prefix
# (cmake --install), checks what was installed, then builds examples/cpp outside the zinf tree
# with nothing but CMAKE_PREFIX_PATH (and once more with pkg-config), and runs it under mpirun:
#   - 1, 2 and 3 ranks from scratch: exit 0, and the loss falls to below half of the first;
#   - a checkpoint saved on 2 ranks resumes on 3: steps continue from it, the loss stays low;
#   - mlp_stage3 (ZeRO stage 3, ds_stage3.json) on 1, 2 and 3 ranks: exit 0, the loss falls below
#     half and matches mlp's on as many ranks (the same model, data and steps), fc1.weight alone
#     is partitioned and its shards are read from NVMe.
#
#   example_test.sh BUILD_DIR SOURCE_DIR MPIEXEC
set -euo pipefail
build=$1 src=$2 mpiexec=$3
base=${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}
work=$(mktemp -d "$base/zinf-install-test-XXXXXX")
trap 'rm -rf -- "$work"' EXIT
prefix=$work/prefix
mpi=("$mpiexec" --allow-run-as-root --oversubscribe --bind-to none
     --mca btl self,vader,tcp --mca btl_tcp_if_include lo)

check() { printf '== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

check "cmake --install into a temporary prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log" || fail "install failed"
for f in bin/zinf-train bin/zinf-ckpt bin/zinf-run lib/cmake/zinf/zinfConfig.cmake \
         lib/cmake/zinf/zinfConfigVersion.cmake lib/cmake/zinf/zinfTargets.cmake \
         lib/pkgconfig/zinf.pc include/zinf/engine/engine.h lib/libzinf_engine.so; do
  [[ -e $prefix/$f ]] || fail "$f was not installed"
done
# No installed header but the opt-in mpi_native.h includes MPI, HDF5 or liburing.
if bad=$(grep -rlE '#include <(mpi|hdf5|H5[A-Za-z]*|liburing)\.h>' "$prefix/include" |
         grep -v 'zinf/comm/mpi_native.h'); then
  fail "installed headers include a foreign library's header: $bad"
fi
# The programs run from the prefix (their RPATH finds zinf's libraries there).
"$prefix/bin/zinf-ckpt" --help > /dev/null || fail "installed zinf-ckpt does not run"
"$prefix/bin/zinf-run" -np 2 --dry-run -- zinf-train 2> "$work/dry-run.txt" ||
  fail "installed zinf-run --dry-run failed"
grep -q "$prefix/bin/zinf-train" "$work/dry-run.txt" ||
  fail "installed zinf-run does not find zinf-train next to it: $(cat "$work/dry-run.txt")"

check "examples/cpp builds against the prefix with find_package(zinf)"
cp -r "$src/examples/cpp" "$work/example"
cmake -S "$work/example" -B "$work/example/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; fail "configure failed"; }
cmake --build "$work/example/build" > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; fail "build failed"; }
if grep -q -- "$src" "$work/example/build/build.ninja"; then
  fail "the example's build refers to the zinf source tree $src"
fi
mlp=$work/example/build/mlp
mlp_stage3=$work/example/build/mlp_stage3

check "examples/cpp builds with pkg-config zinf"
PKG_CONFIG_PATH=$prefix/lib/pkgconfig g++ -O1 -o "$work/mlp-pc" "$src/examples/cpp/mlp.cc" \
  $(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs zinf) ||
  fail "pkg-config build failed"
PKG_CONFIG_PATH=$prefix/lib/pkgconfig g++ -O1 -o "$work/mlp_stage3-pc" \
  "$src/examples/cpp/mlp_stage3.cc" \
  $(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs zinf) ||
  fail "pkg-config build of mlp_stage3 failed"

# run DIR NP LAST_STEP: the example in DIR (its ds.json, relative swap and checkpoint paths).
run() {
  local dir=$1 np=$2 last=$3
  mkdir -p "$dir"
  sed 's/"steps_per_print": 50/"steps_per_print": 20/' "$src/examples/cpp/ds.json" > "$dir/ds.json"
  (cd "$dir" && timeout --kill-after=10 120 "${mpi[@]}" -np "$np" "$mlp" ds.json "$last") \
    > "$dir/out.txt" 2> "$dir/err.txt" ||
    { rc=$?; tail -20 "$dir/err.txt"; fail "mlp on $np ranks to step $last exited with $rc"; }
  grep '^mlp: ' "$dir/out.txt" || fail "no summary line: $(cat "$dir/out.txt")"
}
# losses DIR: "first last" from the summary line.
losses() { sed -n 's/^mlp: .*loss \([0-9.e+-]*\) -> \([0-9.e+-]*\),.*/\1 \2/p' "$1/out.txt"; }
falls() {  # falls FIRST LAST: LAST < FIRST / 2
  awk -v a="$1" -v b="$2" 'BEGIN { exit !(b < a / 2) }'
}

for np in 1 2 3; do
  check "$np rank(s), 60 steps from scratch: the loss falls below half"
  run "$work/np$np" "$np" 60
  read -r first last < <(losses "$work/np$np")
  falls "$first" "$last" || fail "$np ranks: loss $first -> $last did not fall below half"
  "$prefix/bin/zinf-ckpt" verify "$work/np$np/mlp-checkpoints/step-60.h5" > /dev/null ||
    fail "$np ranks: checkpoint step-60 does not verify"
done

check "a checkpoint saved on 2 ranks resumes on 3"
run "$work/resume" 2 40
read -r first2 last2 < <(losses "$work/resume")
run "$work/resume" 3 80
grep -q '^mlp: steps 41-80 on 3 rank(s)' "$work/resume/out.txt" ||
  fail "the 3-rank run did not continue from step 40: $(cat "$work/resume/out.txt")"
grep -q 'resumed from .*step-40.h5 (step 40, saved on 2 ranks, now 3)' "$work/resume/err.txt" ||
  fail "no resume line in the 3-rank log"
read -r first3 last3 < <(losses "$work/resume")
awk -v a="$first2" -v b="$first3" 'BEGIN { exit !(b < a / 2) }' ||
  fail "resumed loss $first3 is not below half the fresh 2-rank start $first2 (was the state lost?)"
echo "  2 ranks: $first2 -> $last2; resumed on 3: $first3 -> $last3"

for np in 1 2 3; do
  check "mlp_stage3 on $np rank(s), 60 steps: the loss falls below half, as mlp's does"
  dir=$work/stage3-np$np
  mkdir -p "$dir"
  (cd "$dir" && timeout --kill-after=10 120 "${mpi[@]}" -np "$np" "$mlp_stage3" \
     "$src/examples/cpp/ds_stage3.json" 60) > "$dir/out.txt" 2> "$dir/err.txt" ||
    { rc=$?; tail -20 "$dir/err.txt"; fail "mlp_stage3 on $np ranks exited with $rc"; }
  cat "$dir/out.txt"
  read -r first last < <(sed -n 's/^mlp_stage3: .*loss \([0-9.e+-]*\) -> \([0-9.e+-]*\)$/\1 \2/p' \
                         "$dir/out.txt") || true
  [[ -n ${last:-} ]] || fail "mlp_stage3: no loss line"
  falls "$first" "$last" || fail "mlp_stage3 on $np ranks: loss $first -> $last did not fall"
  # Stage 3 changes where the weights live, not the arithmetic: mlp's losses, up to rounding.
  read -r mlp_first mlp_last < <(losses "$work/np$np")
  awk -v a="$first $last" -v b="$mlp_first $mlp_last" 'BEGIN {
        split(a, x); split(b, y)
        for (i = 1; i <= 2; ++i) if ((x[i] - y[i])^2 > (1e-3 * y[i])^2) exit 1 }' ||
    fail "mlp_stage3 on $np ranks: loss $first -> $last, mlp's $mlp_first -> $mlp_last"
  grep -Eq '^mlp_stage3: 1 of 4 parameter\(s\) partitioned; .* [1-9][0-9]* shard reads from NVMe' \
    "$dir/out.txt" || fail "mlp_stage3 on $np ranks: not 1 partitioned parameter read from NVMe"
done
echo "PASS"
