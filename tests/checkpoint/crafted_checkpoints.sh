#!/usr/bin/env bash
# Hostile checkpoint files against the tools that read them. GENERATOR (checkpoint_craft)
# writes a corpus: good.h5, one file per defect and cases.tsv (name, the exit status `zinf-ckpt
# verify` must have, a substring of its output naming the defect, the exit status `zinf-ckpt
# export` must have). For every file, `zinf-ckpt
# ls`, `zinf-ckpt verify` and `zinf-ckpt export --format safetensors --moments` each run under a 20 s
# timeout and must
#   - exit 0 or 1: never a signal (crash, abort), never the timeout (hang);
#   - print no byte that drives a terminal (ESC, other C0 controls but tab and newline, DEL, C1
#     controls in UTF-8): strings from a file are escaped;
#   - verify: exit as cases.tsv says, its output containing the substring, a failure reported
#     with one of the codes checkpoint.h documents for a bad file (NotFound, DataLoss,
#     FailedPrecondition);
#   - ls: exit 0 where verify does; a failure names the same defect (ls validates what verify
#     validates first);
#   - export: exit as cases.tsv says (as verify, but for the defects of the trainer state, which
#     export does not read); a failure names the defect and leaves nothing in its output
#     directory: no output, no `zinf-tmp` temporary.
# Then paths and checkpoint directories made here: a FIFO, /dev/zero, escape bytes in a file
# name, and directories whose `latest` is a symlink, names ../good.h5, is 10 MB, is a FIFO,
# names a FIFO step-3.h5, and so on (each exit 1 naming the problem, no hang), and a directory
# with an entry step-99999999999999999999.h5 (ls exits 0 and lists only the valid ones). Then
# verify and restore must accept exactly the same files: RESUMER (checkpoint_resume_crafted) resumes
# from every path checked above, crafted files and directories alike (ZeroEngine::Create with
# the path to load, a model of good.h5's parameters, the config the files were saved with, one
# step), and each outcome must be verify's: verify OK and the resume refused (or its step left a
# weight non-finite) fails, and so does verify refusing a file the resume takes. A resume whose
# config has a larger fp16.min_loss_scale than the file's refuses what verify accepts (the one
# check that depends on the resuming config). Last, zinf-train resumes (1 rank, built-in model)
# from a few crafted files: exit 1 within 30 s with exactly one `zinf-train failed: ` line
# naming the file's defect (ReadInfo validates the file before the layout is compared with the
# model's). The files are checked by two workers side by side and the resumes run together:
# 30-60 s on the 2-core CI machine.
#
#   crafted_checkpoints.sh ZINF_TRAIN ZINF_CKPT MPIEXEC GENERATOR RESUMER
# shellcheck source=SCRIPTDIR/../launch/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch/e2e/lib.sh"
generator=$(readlink -f "$4")
[[ -x $generator ]] || { echo "FAIL: generator not executable: $4" >&2; exit 1; }
resumer=$(readlink -f "$5")
[[ -x $resumer ]] || { echo "FAIL: resumer not executable: $5" >&2; exit 1; }
e2e_init crafted-checkpoints
t0=$(stamp)

# bad WHAT: one failed check; the test goes on and fails at the end. Failures are counted in a
# file, as the crafted files are checked by two workers side by side; $failed says whether the
# current case (of this worker) failed.
failures=$work/failures.txt
: > "$failures"
bad() {
  echo "FAIL: $*" >&2
  echo "${*//$'\n'/ }" >> "$failures"
  failed=1
}

corpus=$work/corpus
"$generator" "$corpus" > "$work/generator.log" 2>&1 || fail "the generator exited with $?"
[[ -s $corpus/cases.tsv ]] || fail "the generator wrote no cases.tsv"

# terminal_bytes FILE: describes the first byte of FILE that would drive a terminal, if any.
terminal_bytes() {
  if LC_ALL=C grep -q $'\x1b' "$1"; then
    echo "a raw ESC byte"
  elif LC_ALL=C grep -aqP '[\x00-\x08\x0b-\x1f\x7f]' "$1"; then
    echo "a raw control byte 0x$(LC_ALL=C grep -aoP '[\x00-\x08\x0b-\x1f\x7f]' "$1" |
      head -c 1 | od -An -tx1 | tr -d ' \n')"
  elif LC_ALL=C grep -aqP '\xc2[\x80-\x9f]' "$1"; then
    echo "a raw C1 control (UTF-8 C2 80..C2 9F)"
  fi
}

# tool LABEL ARGS...: zinf-ckpt ARGS under a 20 s timeout, output in $out (a file; one per
# worker); sets $rc.
# Records a failure when it was killed or hung, or printed terminal control bytes.
tool() {
  local label=$1 what
  shift
  timeout --kill-after=5 20 "$zinf_ckpt" "$@" > "$out" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then
    bad "$label: timed out after 20 s (a hang): $(tail -2 "$out")"
  elif ((rc > 1)); then
    bad "$label: exit status $rc (signal $((rc > 128 ? rc - 128 : 0))), not 0 or 1:" \
      "$(tail -2 "$out" | cut -c1-300)"
  fi
  what=$(terminal_bytes "$out")
  [[ -z $what ]] || bad "$label: the output holds $what: $(cat -v "$out" | cut -c1-300)"
}

# contains LABEL TEXT: $out contains TEXT.
contains() {
  grep -qF -- "$2" "$out" ||
    bad "$1: the output lacks '$2'; it is: $(tail -2 "$out" | cut -c1-400)"
}

# check_path LABEL PATH WANT_RC TEXT [EXPORT_RC]: ls, verify and export of PATH (see the
# header); export must exit with EXPORT_RC (default WANT_RC). Appends LABEL, verify's exit status
# and PATH to $verified (one file per worker) for the resumes.
check_path() {
  local label=$1 path=$2 want=$3 text=$4 export_want=${5:-$3} dest line
  tool "$label: ls" ls "$path"
  local ls_rc=$rc
  if ((ls_rc == 1)); then
    contains "$label: ls" "$text"
  elif ((ls_rc == 0 && want == 1)) && grep -qF 'zinf-ckpt: ' "$out"; then
    bad "$label: ls exited 0 but printed an error: $(grep -F 'zinf-ckpt: ' "$out" | head -1)"
  fi
  ((want == 0 && ls_rc != 0)) && bad "$label: ls exited $ls_rc, verify must pass"
  [[ $label == created_escape ]] && ! grep -qF '\x1b[2J' "$out" &&
    bad "$label: ls does not show the escaped '\\x1b[2J' of 'created': $(grep created "$out")"

  tool "$label: verify" verify "$path"
  printf '%s\t%s\t%s\n' "$label" "$rc" "$path" >> "$verified"
  ((rc == want)) || bad "$label: verify exited $rc, expected $want: $(tail -1 "$out" | cut -c1-400)"
  contains "$label: verify" "$text"
  if ((rc == 1)); then
    line=$(grep -F 'zinf-ckpt: ' "$out" | tail -1)
    [[ $line =~ ^zinf-ckpt:\ (NotFound|DataLoss|FailedPrecondition):\  ]] ||
      bad "$label: verify's error is not NotFound, DataLoss or FailedPrecondition" \
        "(checkpoint.h: a bad file): ${line:0:300}"
  fi

  dest=$work/export/$label
  mkdir -p "$dest"
  tool "$label: export" export "$path" --out "$dest/model.safetensors" --format safetensors \
    --moments
  ((rc == export_want)) ||
    bad "$label: export exited $rc, expected $export_want: $(tail -1 "$out" | cut -c1-400)"
  if ((rc == 1)); then
    contains "$label: export" "$text"
    [[ -z $(ls -A "$dest") ]] ||
      bad "$label: the failed export left files in its output directory: $(ls -A "$dest")"
  elif ((rc == 0)) && [[ ! -s $dest/model.safetensors ]]; then
    bad "$label: export exited 0 but wrote no model.safetensors"
  fi
  rm -rf "$dest"
}

# check_cases WORKER WORKERS: check_path for every WORKERS-th case of cases.tsv from WORKER on.
check_cases() {
  local worker=$1 workers=$2 i=0 name want text export_want
  out=$work/tool-$worker.txt
  verified=$work/verified-$worker.tsv
  while IFS=$'\t' read -r name want text export_want; do
    ((i++ % workers == worker)) || continue
    failed=0
    check_path "$name" "$corpus/$name.h5" "$want" "$text" "$export_want"
    ((failed)) || echo "  ok $name"
  done < "$corpus/cases.tsv"
}

check "every crafted file: ls, verify and export"
cases=$(grep -c . "$corpus/cases.tsv")
((cases >= 40)) || bad "cases.tsv lists $cases cases, expected at least 40"
check_cases 0 2 &
check_cases 1 2 &
wait
echo "  $cases files in $(elapsed "$t0") s"
out=$work/tool.txt
verified=$work/verified-2.tsv

check "paths that are not checkpoint files"
mkfifo "$work/fifo.h5"
check_path fifo_path "$work/fifo.h5" 1 "not a regular file"
check_path dev_zero /dev/zero 1 "not a regular file"
check_path missing_path "$work/nothing.h5" 1 "no checkpoint at"
esc_name=$work/$'esc-\e[2J-\xc2\x9b-\a.h5'
cp "$corpus/good.h5" "$esc_name"
check_path escape_in_path "$esc_name" 0 "OK (structure"

check "checkpoint directories with a hostile 'latest' or hostile entries"
# dir NAME: a fresh checkpoint directory holding step-7.h5 (a copy of good.h5); prints its path.
dir() {
  local d=$work/dirs/$1
  mkdir -p "$d"
  cp "$corpus/good.h5" "$d/step-7.h5"
  echo "$d"
}
d=$(dir no_latest)
check_path dir_no_latest "$d" 1 "has no 'latest'"
d=$(dir latest_ok)
echo step-7.h5 > "$d/latest"
check_path dir_latest_ok "$d" 0 "OK (structure"
d=$(dir latest_symlink)
echo step-7.h5 > "$d/latest.real"
ln -s latest.real "$d/latest"
check_path dir_latest_symlink "$d" 1 "symbolic link"
d=$(dir latest_parent)
echo ../good.h5 > "$d/latest"
cp "$corpus/good.h5" "$work/dirs/good.h5"
check_path dir_latest_parent "$d" 1 "not a step-<N>.h5 file of this directory"
d=$(dir latest_absolute)
echo "$corpus/good.h5" > "$d/latest"
check_path dir_latest_absolute "$d" 1 "not a step-<N>.h5 file of this directory"
d=$(dir latest_10mb)
head -c $((10 << 20)) /dev/zero | tr '\0' 'x' > "$d/latest"
check_path dir_latest_10mb "$d" 1 "larger than"
d=$(dir latest_fifo)
mkfifo "$d/latest"
check_path dir_latest_fifo "$d" 1 "not a regular file"
d=$(dir latest_is_dir)
mkdir "$d/latest"
check_path dir_latest_is_dir "$d" 1 "latest"
d=$(dir latest_empty)
: > "$d/latest"
check_path dir_latest_empty "$d" 1 "is empty"
d=$(dir latest_escape)
printf 'step-7.h5\e[2J\xc2\x9b\n' > "$d/latest"
check_path dir_latest_escape "$d" 1 "not a step-<N>.h5 file of this directory"
d=$(dir latest_missing)
echo step-5.h5 > "$d/latest"
check_path dir_latest_missing "$d" 1 "which does not exist"
d=$(dir step_fifo)
mkfifo "$d/step-3.h5"
echo step-3.h5 > "$d/latest"
check_path dir_step_fifo "$d" 1 "not a regular file"
d=$(dir step_symlink)
ln -s "$corpus/good.h5" "$d/step-3.h5"
echo step-3.h5 > "$d/latest"
check_path dir_step_symlink "$d" 1 "symbolic link"
d=$(dir step_huge_name)
cp "$corpus/good.h5" "$d/step-99999999999999999999.h5"
echo step-99999999999999999999.h5 > "$d/latest"
check_path dir_latest_huge_step "$d" 1 "not a step-<N>.h5 file of this directory"
# Another directory, as every path checked is resumed from as it was checked, at the end.
d=$(dir huge_step_entry)
cp "$corpus/good.h5" "$d/step-99999999999999999999.h5"
echo step-7.h5 > "$d/latest"
mkfifo "$d/step-8.h5"
ln -s step-7.h5 "$d/step-9.h5"
check_path dir_huge_step_entry "$d" 0 "OK (structure"
tool "dir_huge_step_entry: ls" ls "$d"
if ((rc == 0)); then
  grep -q '^  step-7\.h5 ' "$out" || bad "dir_huge_step_entry: ls does not list step-7.h5"
  grep -qF '99999999999999999999' "$out" &&
    bad "dir_huge_step_entry: ls lists step-99999999999999999999.h5 as a checkpoint"
  grep -q '^  step-8\.h5 .*not a regular file' "$out" ||
    bad "dir_huge_step_entry: ls does not flag the FIFO step-8.h5: $(grep step-8 "$out")"
  grep -q '^  step-9\.h5 .*symbolic link' "$out" ||
    bad "dir_huge_step_entry: ls does not flag the link step-9.h5: $(grep step-9 "$out")"
fi

check "verify and a resume accept exactly the same files (every path above)"
t1=$(stamp)
# label <TAB> verify's exit status <TAB> path, one line per path checked, in one order.
cat "$work"/verified-*.tsv > "$work/verified.tsv"
mapfile -t resume_paths < <(cut -f3 "$work/verified.tsv")
mkdir -p "$work/resume-swap"
# resume.tsv: one line per path, in the same order: accepted | refused | garbage, then why.
timeout --kill-after=10 120 "$mpiexec" "${mpiexec_flags[@]}" -np 1 "$resumer" \
  "$work/resume-swap" "$corpus/good.h5" "${resume_paths[@]}" > "$work/resume.tsv" \
  2> "$work/resumer.log"
rc=$?
if ((rc != 0)) || [[ $(grep -c . "$work/resume.tsv") != "${#resume_paths[@]}" ]]; then
  bad "the resumer exited $rc after $(grep -c . "$work/resume.tsv") of ${#resume_paths[@]}" \
    "resumes: $(tail -3 "$work/resumer.log" | cut -c1-300)"
else
  accepted=0
  while IFS=$'\t' read -r label verify_rc _ <&3 && IFS=$'\t' read -r outcome _ why <&4; do
    if ((verify_rc == 0)) && [[ $outcome != accepted ]]; then
      bad "$label: verify says OK, but the resume $outcome it: ${why:0:300}"
    elif ((verify_rc != 0)) && [[ $outcome != refused ]]; then
      bad "$label: verify refuses it, but the resume $outcome it${why:+: ${why:0:300}}"
    fi
    [[ $outcome == accepted ]] && ((++accepted))
  done 3< "$work/verified.tsv" 4< "$work/resume.tsv"
  echo "  ${#resume_paths[@]} paths, $accepted restored and stepped, in $(elapsed "$t1") s"
fi
# The one check that depends on the resuming config: a dynamic scale that cannot go below 2^20
# (first scale and fp16.min_loss_scale 2^20) refuses the file's loss scale 65536, which verify
# accepts (it holds the file to the file's own config).
timeout --kill-after=10 60 "$mpiexec" "${mpiexec_flags[@]}" -np 1 "$resumer" \
  --fp16 '{"enabled": true, "loss_scale": 0, "initial_scale_power": 20, "min_loss_scale": 1048576}' \
  "$work/resume-swap" "$corpus/good.h5" "$corpus/good_engine.h5" > "$work/resume-min.tsv" \
  2>> "$work/resumer.log"
want="loss scale 65536 is outside [1048576, 1.8446744073709552e+19], the range of this run's fp16"
if [[ $(cut -f1 "$work/resume-min.tsv") != refused ]] || ! grep -qF "$want" "$work/resume-min.tsv"
then
  bad "good_engine resumed with a dynamic scale of at least 2^20: not refused with '$want':" \
    "$(cut -c1-300 "$work/resume-min.tsv")"
fi

check "zinf-train --resume <crafted file>: exit 1, one error line naming the defect, < 30 s"
# The resumes run side by side (each is mostly MPI and model start-up); each has its own limit.
# step_string: a bad file is not a bad command line (exit 2); layout_dim_c1: the error quotes a
# C1 control from the file, which zinf-train's log must escape like zinf-ckpt does.
resumes=(step_int64_max unallocated_chunks external_link step_string layout_dim_c1)
for name in "${resumes[@]}"; do
  mkdir -p "$work/swap-$name"
  (
    start=$(stamp)
    train 1 30 --resume "$corpus/$name.h5" --steps 1 --nvme-path "$work/swap-$name" \
      > "$work/resume-$name.txt" 2>&1
    echo "$? $(elapsed "$start")" > "$work/resume-$name.rc"
  ) &
done
wait
for name in "${resumes[@]}"; do
  text=$(awk -F '\t' -v n="$name" '$1 == n { print $3 }' "$corpus/cases.tsv")
  read -r rc took < "$work/resume-$name.rc"
  log=$work/resume-$name.txt
  lines=$(grep -aF 'zinf-train failed: ' "$log")
  what=$(terminal_bytes "$log")
  if ((rc == 124 || rc == 137)); then
    bad "resume $name: timed out after 30 s"
  elif ((rc != 1)); then
    bad "resume $name: exit status $rc, expected 1: $(grep -a . "$log" | tail -2 | cut -c1-300)"
  elif [[ $(grep -c . <<< "$lines") != 1 ]]; then
    bad "resume $name: $(grep -c . <<< "$lines") 'zinf-train failed: ' lines, expected 1:" \
      "$(tail -3 "$log" | cut -c1-300)"
  elif ! grep -qF -- "$text" <<< "$lines"; then
    bad "resume $name: the error does not name the defect ('$text'): ${lines:0:400}"
  elif [[ -n $what ]]; then
    bad "resume $name: the output holds $what: $(cat -v <<< "$lines" | cut -c1-300)"
  else
    echo "  ok $name in $took s: ${lines#*zinf-train failed: }" | cut -c1-200
  fi
done

echo "took $(elapsed "$t0") s"
[[ ! -s $failures ]] || fail "$(grep -c . "$failures") failed check(s) (the FAIL lines above)"
echo "PASS: $cases crafted files, the hostile paths and directories, verify and resume agreeing" \
  "on every one, and the zinf-train resumes"
