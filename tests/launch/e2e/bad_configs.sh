#!/usr/bin/env bash
# A corpus of at least 30 bad configs, each giving its specific error, end to end: for every
# tests/config/bad_configs/NN-name.json, `zinf-train --config NN-name.json --steps 1
# --nvme-path <scratch>` (one rank, an MPI singleton) must exit 2 and print exactly one
# "zinf-train failed: " line that contains the text of NN-name.expect. Command-line overrides are
# applied to the config before it is parsed, so a flag that would overwrite what a file gets wrong
# is left out for that file (--nvme-path where the file has an offload_optimizer block, --steps
# where it sets zinf.steps). Then bad command lines: --steps 0 or -3, --model nope, an unknown
# flag, --resume latest without a checkpoint directory (2) or with an empty one (1), --resume of
# a missing file and --data naming a missing path (1), --config naming one (2: a config that
# cannot be loaded is a bad config, --check-config's exit code too): each names what is wrong.
# Last, a few of them on 2 ranks under mpirun: the same exit code, and each rank prints the same
# one-line error. Hostile inputs: a 400k-deep config, a 20 MB one, FIFOs and devices as config, data,
# metrics and checkpoint, a micro-batch of 2^31-1, bad ZINF_* values: each a clean error (or a WARN
# with the value escaped), never a crash or a hang.
#
#   bad_configs.sh ZINF_TRAIN ZINF_CKPT MPIEXEC
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
corpus=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../config/bad_configs" && pwd) ||
  { echo "FAIL: no tests/config/bad_configs directory" >&2; exit 1; }
e2e_init bad-configs
mkdir -p "$work/swap"

failures=0
cases=0
bad() {  # bad WHAT: one failed case; the test goes on and fails at the end
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# expect_failure NAME WANT_RC TEXT ARGS...: zinf-train ARGS (singleton) exits with a code that
# matches the pattern WANT_RC ("2", "1|2") and prints exactly one "zinf-train failed: " line,
# which contains TEXT.
expect_failure() {
  local name=$1 want_rc=$2 text=$3 rc lines
  shift 3
  cases=$((cases + 1))
  local err=$work/err-$name.txt
  timeout --kill-after=5 30 "$zinf_train" "$@" > "$work/out-$name.txt" 2> "$err"
  rc=$?
  lines=$(grep -F 'zinf-train failed: ' "$err")
  if [[ ! $rc =~ ^($want_rc)$ ]]; then
    bad "$name: exit code $rc, expected $want_rc; stderr: $(tail -3 "$err")"
  elif [[ $(grep -c . <<< "$lines") != 1 ]]; then
    bad "$name: $(grep -c . <<< "$lines") 'zinf-train failed: ' lines, expected 1; stderr:" \
      "$(tail -3 "$err")"
  elif ! grep -qF -- "$text" <<< "$lines"; then
    bad "$name: the error does not contain '$text'; it is: ${lines#*zinf-train failed: }"
  else
    echo "  ok $name (exit $rc): ${lines#*zinf-train failed: }"
    return 0
  fi
  return 1
}

t0=$(stamp)
check "every bad config exits 2 with its specific error"
# Four at a time: each case is an MPI singleton start-up, mostly waiting. Each case's lines go to
# its own log, printed (and its FAIL lines counted) in corpus order once all have ended.
count=0
for json in "$corpus"/*.json; do
  name=$(basename "$json" .json)
  [[ -f $corpus/$name.expect ]] || { bad "$name.json has no $name.expect"; continue; }
  expect=$(head -1 "$corpus/$name.expect")
  [[ -n $expect ]] || { bad "$name.expect is empty"; continue; }
  flags=()
  grep -q '"offload_optimizer"' "$json" || flags+=(--nvme-path "$work/swap")
  grep -q '"steps"' "$json" || flags+=(--steps 1)
  while (($(jobs -rp | wc -l) >= 4)); do wait -n; done
  (expect_failure "$name" 2 "$expect" --config "$json" "${flags[@]}") > "$work/case-$name.log" 2>&1 &
  count=$((count + 1))
done
wait
for log in "$work"/case-*.log; do
  cat "$log"
  if grep -q '^FAIL: ' "$log"; then failures=$((failures + 1)); fi
done
echo "  $count bad configs in $(elapsed "$t0") s"
((count >= 30)) || bad "only $count bad configs ran, the corpus must have at least 30"

check "bad command lines"
cases=0
swap=(--nvme-path "$work/swap")
expect_failure steps-zero 2 'zinf.steps: 0 is out of range' --steps 0 "${swap[@]}"
expect_failure steps-negative 2 'steps' --steps -3 "${swap[@]}"
expect_failure model-nope 2 '"nope" is not one of "charlm", "synthetic"' \
  --model nope --steps 1 "${swap[@]}"
expect_failure unknown-flag 2 '--no-such-flag' --no-such-flag --steps 1 "${swap[@]}"
expect_failure resume-latest-without-dir 2 \
  'zinf.checkpoint.load: "latest" resumes from <dir>/latest, but zinf.checkpoint.dir is not set' \
  --resume latest --steps 1 "${swap[@]}"
expect_failure checkpoint-every-zero 2 'zinf.checkpoint.every: 0 is out of range' \
  --checkpoint-every 0 --checkpoint-dir "$work/ckpt" --steps 1 "${swap[@]}"
mkdir -p "$work/empty-ckpt"
expect_failure resume-latest-without-checkpoint 1 "$work/empty-ckpt" \
  --resume latest --checkpoint-dir "$work/empty-ckpt" --steps 1 "${swap[@]}"
expect_failure resume-latest-missing-dir 1 "$work/no-such-ckpt" \
  --resume latest --checkpoint-dir "$work/no-such-ckpt" --steps 1 "${swap[@]}"
expect_failure resume-missing-file 1 "$work/no-such-step-5.h5" \
  --resume "$work/no-such-step-5.h5" --steps 1 "${swap[@]}"
expect_failure data-missing 1 /nonexistent/zinf-e2e-corpus.txt \
  --data /nonexistent/zinf-e2e-corpus.txt --steps 1 "${swap[@]}"
# A config file that is not there, or not a regular file: a bad command line (2), whatever the
# error's code (NotFound here); the message names the path.
expect_failure config-missing 2 /nonexistent/zinf-e2e.json \
  --config /nonexistent/zinf-e2e.json --steps 1 "${swap[@]}"

check "hostile inputs: special files, huge and deep files, sizes that cannot fit, bad environment"
# A 400k-deep document (nlohmann alone would overflow the stack printing it), a 20 MB file, a
# FIFO and a device as the config, data, metrics and checkpoint; a micro-batch of 2^31-1.
python3 -c "import sys; sys.stdout.write('{\"x\": ' + '[' * 400000 + ']' * 400000 + '}')" \
  > "$work/deep.json"
head -c $((20 << 20)) /dev/zero | tr '\0' ' ' > "$work/huge.json"
mkfifo "$work/fifo"
echo '{"train_micro_batch_size_per_gpu": 2147483647}' > "$work/micro.json"
expect_failure config-400k-deep 2 'JSON nesting deeper than 32 levels' \
  --config "$work/deep.json" --steps 1 "${swap[@]}"
expect_failure config-20mb 2 'larger than 16777216 bytes' --config "$work/huge.json" --steps 1 \
  "${swap[@]}"
expect_failure config-fifo 2 'a FIFO, not a regular file' --config "$work/fifo" --steps 1 \
  "${swap[@]}"
expect_failure config-device 2 'a character device, not a regular file' --config /dev/zero \
  --steps 1 "${swap[@]}"
expect_failure data-fifo 1 'a FIFO, not a regular file' --data "$work/fifo" --steps 1 "${swap[@]}"
expect_failure metrics-fifo 1 'not a regular file' --metrics "$work/fifo" --steps 1 "${swap[@]}"
expect_failure resume-fifo 1 'not a regular file or a directory' --resume "$work/fifo" --steps 1 \
  "${swap[@]}"
expect_failure micro-batch-2g 1 'ResourceExhausted: rank 0: this rank needs at least' \
  --config "$work/micro.json" --steps 1 "${swap[@]}"
ZINF_IO_ENGINE=bogus expect_failure env-io-engine 2 "ZINF_IO_ENGINE: unknown I/O engine 'bogus'" \
  --steps 1 "${swap[@]}"
ZINF_FAULT_INJECT='read:99999999999999999999999:eio' expect_failure env-fault-count 2 \
  "is not a count >= 1" --steps 1 "${swap[@]}"
# Ignored with a WARN, escaped: an unknown kernel cap and a log level with terminal controls.
cases=$((cases + 1))
ZINF_SIMD=bogus ZINF_LOG_LEVEL=$'\e[2Jinfo' timeout --kill-after=5 30 "$zinf_train" --steps 1 \
  "${swap[@]}" > "$work/out.txt" 2> "$work/err.txt"
rc=$?
if ((rc != 0)); then
  bad "env-warnings: exit code $rc, expected 0; stderr: $(tail -3 "$work/err.txt")"
elif grep -q $'\e' "$work/err.txt"; then
  bad "env-warnings: an ESC byte from ZINF_LOG_LEVEL reached the terminal unescaped"
elif ! grep -q "ZINF_SIMD: unknown SIMD path 'bogus'" "$work/err.txt" ||
     ! grep -qF "ZINF_LOG_LEVEL='\x1b[2Jinfo'" "$work/err.txt"; then
  bad "env-warnings: no WARN naming ZINF_SIMD and the escaped ZINF_LOG_LEVEL"
else
  echo "  ok env-warnings (exit 0): both named in WARN lines, the ESC escaped"
fi

check "on 2 ranks under mpirun: the exit code, one identical 'zinf-train failed: ' line per rank"
# expect_failure_np2 NAME WANT_RC TEXT ARGS...: as expect_failure, on 2 ranks under mpirun.
expect_failure_np2() {
  local name=$1 want_rc=$2 text=$3 rc lines messages
  shift 3
  cases=$((cases + 1))
  train 2 60 "$@" > "$work/np2.txt" 2>&1
  rc=$?
  lines=$(grep -F 'zinf-train failed: ' "$work/np2.txt")
  messages=$(sed -e 's/.*zinf-train failed: //' <<< "$lines" | sort -u)
  if ((rc != want_rc)); then
    bad "$name on 2 ranks: mpirun exit code $rc, expected $want_rc; $(grep -m3 . "$work/np2.txt")"
  elif [[ $(grep -oE '\[rank [0-9]+/2\]' <<< "$lines" | sort | tr '\n' ' ') != \
          "[rank 0/2] [rank 1/2] " ]]; then
    bad "$name on 2 ranks: expected one 'zinf-train failed: ' line from each rank, got: $lines"
  elif (($(wc -l <<< "$messages") != 1)); then
    bad "$name on 2 ranks: the ranks' messages differ: $messages"
  elif ! grep -qF -- "$text" <<< "$messages"; then
    bad "$name on 2 ranks: the error does not contain '$text'; it is: $messages"
  else
    echo "  ok $name on 2 ranks (exit $rc): $messages"
  fi
}
for name in 01-unknown-top-level-key 23-batch-mismatch 49-json-syntax-error; do
  expect_failure_np2 "$name" 2 "$(head -1 "$corpus/$name.expect")" \
    --config "$corpus/$name.json" --steps 1 --nvme-path "$work/swap"
done
expect_failure_np2 unknown-flag 2 '--no-such-flag' --no-such-flag --steps 1 "${swap[@]}"
expect_failure_np2 data-missing 1 /nonexistent/zinf-e2e-corpus.txt \
  --data /nonexistent/zinf-e2e-corpus.txt --steps 1 "${swap[@]}"

check "no run left swap files, none made ./zinf-swap"
[[ -z $(ls "$work/swap" 2> /dev/null) ]] ||
  bad "failed runs left files in the swap directory: $(ls "$work/swap")"
[[ -e $work/zinf-swap ]] && bad "a run with --nvme-path made ./zinf-swap"

if ((failures > 0)); then
  echo "FAIL: $failures case(s) failed (see the FAIL lines above)" >&2
  exit 1
fi
echo "PASS: $count bad configs, then $cases bad command lines and 2-rank runs, each with its" \
  "error, in $(elapsed "$t0") s"
