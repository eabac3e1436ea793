#!/usr/bin/env bash
# Resume after a checkpoint gives bitwise the same losses and weights as an uninterrupted run on
# the same ranks. Run A: 20 steps on 2 ranks, checkpoint at step 20. Run B: 10 steps on 2 ranks
# with a checkpoint every 10, then `--resume latest --steps 20` on 2 ranks (metrics appended).
# Checks: both runs exit 0; B's metrics hold steps 1..20 once each; losses, lr and grad_norm of
# steps 11..20 (and the losses of 1..10) are the same JSON text in A and B; B's directory has
# step-10.h5 and step-20.h5 and `latest` names step-20.h5; both step-20.h5 verify with zinf-ckpt;
# their safetensors exports (the consolidated fp32 weights and both moments) are byte-identical.
#
#   resume_bitwise.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
e2e_init resume-bitwise
mkdir -p "$work/a/swap" "$work/b/swap"

t0=$(stamp)
check "run A: 20 steps on 2 ranks, checkpoint at step 20"
train 2 90 --steps 20 --nvme-path "$work/a/swap" --checkpoint-dir "$work/a/ckpt" \
  --checkpoint-every 20 --metrics "$work/a.jsonl" > "$work/a.log" 2>&1 ||
  fail "run A exited with $?"
check "run B: 10 steps on 2 ranks, checkpoint every 10"
train 2 60 --steps 10 --nvme-path "$work/b/swap" --checkpoint-dir "$work/b/ckpt" \
  --checkpoint-every 10 --metrics "$work/b.jsonl" > "$work/b1.log" 2>&1 ||
  fail "run B (steps 1..10) exited with $?"
[[ $(cat "$work/b/ckpt/latest" 2> /dev/null) == step-10.h5 ]] ||
  fail "after run B's first part, latest is '$(cat "$work/b/ckpt/latest" 2>&1)', not step-10.h5"
check "run B: --resume latest --steps 20 on 2 ranks"
train 2 60 --steps 20 --nvme-path "$work/b/swap" --checkpoint-dir "$work/b/ckpt" \
  --checkpoint-every 10 --resume latest --metrics "$work/b.jsonl" > "$work/b2.log" 2>&1 ||
  fail "run B (resume, steps 11..20) exited with $?"
echo "  three runs took $(elapsed "$t0") s"

check "metrics: A has steps 1..20, B has steps 1..20 (10 lines, then 10 appended)"
want="$(seq -s ' ' 1 20) "
got_a=$(metric "$work/a.jsonl" step | awk '{ printf "%s ", $1 }')
got_b=$(metric "$work/b.jsonl" step | awk '{ printf "%s ", $1 }')
[[ $got_a == "$want" ]] || fail "run A's metrics steps: $got_a"
[[ $got_b == "$want" ]] || fail "run B's metrics steps (resume must append steps 11..20): $got_b"

check "losses of steps 1..20 and lr, grad_norm of steps 11..20: the same text in A and B"
for key in loss lr grad_norm; do
  from=11
  [[ $key == loss ]] && from=1
  diff <(metric "$work/a.jsonl" "$key" | awk -v f=$from '$1 >= f') \
       <(metric "$work/b.jsonl" "$key" | awk -v f=$from '$1 >= f') > "$work/diff-$key.txt" ||
    fail "$key differs between the uninterrupted and the resumed run (step value):
$(cat "$work/diff-$key.txt")"
done
echo "  losses of steps 11..20: $(metric "$work/b.jsonl" loss | awk '$1 > 10 { printf "%s ", $2 }')"

check "checkpoint files: A has step-20.h5, B has step-10.h5 and step-20.h5, latest -> step-20.h5"
for f in a/ckpt/step-20.h5 b/ckpt/step-10.h5 b/ckpt/step-20.h5; do
  [[ -f $work/$f ]] || fail "missing $f (have: $(ls "$work"/?/ckpt 2>&1 | tr '\n' ' '))"
done
for run in a b; do
  [[ $(cat "$work/$run/ckpt/latest") == step-20.h5 ]] ||
    fail "$run/ckpt/latest is '$(cat "$work/$run/ckpt/latest")'"
done

# zinf-ckpt is serial and initializes no MPI: verify and export run with MPI's environment absent
# (env -i: no OMPI_*, PMIX_* or PMI_* variables, no mpirun around it).
check "zinf-ckpt verify of both step-20.h5, without MPI's environment"
for run in a b; do
  timeout 60 env -i PATH=/usr/bin:/bin "$zinf_ckpt" verify "$work/$run/ckpt/step-20.h5" \
    > "$work/verify-$run.log" 2>&1 ||
    fail "zinf-ckpt verify $run/ckpt/step-20.h5 exited with $?"
done

# The export's header records the path it was given ("source"), so both are exported from inside
# their run's directory under the same relative path: then the files are equal byte for byte
# exactly when the weights are.
check "the weights and moments (zinf-ckpt export --format safetensors --moments) are byte-identical"
for run in a b; do
  (cd "$work/$run" && timeout 60 env -i PATH=/usr/bin:/bin "$zinf_ckpt" export ckpt/step-20.h5 \
    --out weights.safetensors --format safetensors --moments) > "$work/export-$run.log" 2>&1 ||
    fail "zinf-ckpt export in $run exited with $?"
  [[ -s $work/$run/weights.safetensors ]] || fail "export of $run is empty"
done
cmp "$work/a/weights.safetensors" "$work/b/weights.safetensors" ||
  fail "the weights or moments after 20 steps differ between the uninterrupted and the resumed run"

echo "PASS: steps 11..20 after a resume match the uninterrupted run bitwise (losses, and" \
  "weights and moments: $(stat -c %s "$work/a/weights.safetensors") bytes)"
