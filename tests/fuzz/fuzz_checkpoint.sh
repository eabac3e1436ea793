#!/usr/bin/env bash
# Fuzzes the checkpoint reader for SECONDS with SEED: the crafted-checkpoint generator writes a
# valid checkpoint (and its hostile variants) into a scratch directory, and zinf_fuzz mutates the
# valid ones (fp32 and q8 state, the one with the engine's trainer state and loss scaler, the
# edges of the q8 scale and loss scale ranges, and the variant with control characters)
# byte-wise and through the HDF5 API.
#
#   fuzz_checkpoint.sh CRAFT_CHECKPOINTS ZINF_FUZZ SECONDS SEED
set -u
craft=$1 fuzz=$2 seconds=$3 seed=$4
work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-fuzz-ckpt-XXXXXX") ||
  { echo "FAIL: cannot make a scratch directory" >&2; exit 1; }
trap 'rm -rf "$work"' EXIT
"$craft" "$work/seeds" > "$work/craft.log" 2>&1 ||
  { echo "FAIL: the generator failed: $(tail -3 "$work/craft.log")" >&2; exit 1; }
seeds=(--seed-file "$work/seeds/good.h5" --seed-file "$work/seeds/good_q8.h5")
for extra in "$work"/seeds/*created*.h5 "$work"/seeds/good_engine.h5 "$work"/seeds/loss_scale_cap.h5 \
  "$work"/seeds/q8_scale_sq_float_max.h5 "$work"/seeds/loss_scaler_static.h5; do
  [[ -f $extra ]] && seeds+=(--seed-file "$extra")
done
mkdir -p "$work/run"
"$fuzz" checkpoint "${seeds[@]}" --workdir "$work/run" --seconds "$seconds" --seed "$seed"
rc=$?
if ((rc != 0)); then
  echo "FAIL: zinf_fuzz checkpoint exited with $rc; the input was $work/run/last-input.h5" >&2
  cp "$work/run/last-input.h5" "${TMPDIR:-/tmp}/zinf-fuzz-failing-input.h5" 2> /dev/null &&
    echo "  kept as ${TMPDIR:-/tmp}/zinf-fuzz-failing-input.h5" >&2
fi
exit "$rc"
