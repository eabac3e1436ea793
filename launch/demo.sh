#!/usr/bin/env bash
# README quick start, command 1: the main job on its embedded default.
#
# Until zinf-train exists (issue 7), the most real thing zinf runs is its MPI comm layer: this
# script installs what is missing, builds, and runs zinf-comm-demo on 2 ranks under mpirun (ZeRO
# style reduce-scatter + all-gather of a simulated gradient, checked; reduced timers), then again
# with an I/O error injected on rank 1 to show every rank agreeing on the same error.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash launch/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target zinf-comm-demo >/dev/null

mpirun_flags=(-np "${ZINF_DEMO_RANKS:-2}" --oversubscribe --bind-to none)
[ "$(id -u)" -eq 0 ] && mpirun_flags+=(--allow-run-as-root)

echo "+ mpirun ${mpirun_flags[*]} build/bin/zinf-comm-demo --size-per-rank 16M --iterations 10"
mpirun "${mpirun_flags[@]}" build/bin/zinf-comm-demo --size-per-rank 16M --iterations 10
echo
echo "+ mpirun ${mpirun_flags[*]} build/bin/zinf-comm-demo --size-per-rank 1M --iterations 1 --fail-rank 1"
mpirun "${mpirun_flags[@]}" build/bin/zinf-comm-demo --size-per-rank 1M --iterations 1 --fail-rank 1
