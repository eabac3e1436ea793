#!/usr/bin/env bash
# launch/zinf-run: the mpirun command it builds (--dry-run, parsed back word by word), its usage
# errors (exit 2 and the message), and real runs: ranks started, exit status, stdin, and
# SIGTERM/SIGINT reaching the ranks.
#
#   zinf_run_test.sh PATH/TO/zinf-run
#
# Prints one line per failed check and exits 1 if any failed. Needs Open MPI's mpirun.
set -u
zr=${1:?usage: zinf_run_test.sh PATH/TO/zinf-run}
zr=$(readlink -f -- "$zr")
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-run-test-XXXXXX")
bg_pid=""
cleanup() {
  [[ -n $bg_pid ]] && kill -KILL "$bg_pid" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT

failures=0
checks=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
pass() { checks=$((checks + 1)); }

command -v mpirun > /dev/null || { echo "SKIP: mpirun not found" >&2; exit 0; }
# As zinf-run counts them: OMP_NUM_THREADS / OMP_THREAD_LIMIT do not change it.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# zinf-run exports the ZINF_* variables of its environment across hosts: the expected command
# lines below assume none is set but those a check sets itself.
while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^ZINF_' || true)

# Runs zinf-run; sets rc, out (stdout) and err (stderr).
run_zr() {
  "$zr" "$@" > "$work/out" 2> "$work/err"
  rc=$?
  out=$(cat "$work/out")
  err=$(cat "$work/err")
}

# The words of the "zinf-run: ..." line of the last run, parsed back as the shell would.
printed_words() {
  local line
  line=$(grep '^zinf-run: ' <<< "$err" | head -1)
  line=${line#zinf-run: }
  eval "words=($line)"
}

# expect_argv NAME EXPECTED_WORD... : the printed command parses back to exactly these words.
expect_argv() {
  local name=$1
  shift
  local -a words=()
  printed_words
  if [[ ${#words[@]} -ne $# ]] || [[ "$(printf '%s\n' "${words[@]}")" != "$(printf '%s\n' "$@")" ]]; then
    fail "$name: printed command is [${words[*]}], expected [$*] (stderr: $err)"
  else
    pass
  fi
}
has_word() {  # has_word WORD: the printed command contains WORD as one word
  local -a words=()
  printed_words
  local w
  for w in "${words[@]}"; do [[ $w == "$1" ]] && return 0; done
  return 1
}
expect_has() {
  local name=$1 word=$2
  if has_word "$word"; then pass; else fail "$name: '$word' missing from: $err"; fi
}
expect_lacks() {
  local name=$1 word=$2
  if has_word "$word"; then fail "$name: '$word' should not be in: $err"; else pass; fi
}
expect_rc() {
  local name=$1 want=$2
  if [[ $rc -eq $want ]]; then pass; else fail "$name: exit status $rc, expected $want (stderr: $err)"; fi
}
expect_err() {  # expect_err NAME REGEX: stderr matches the extended regex
  local name=$1 re=$2
  if grep -Eq -- "$re" <<< "$err"; then pass; else fail "$name: stderr does not match /$re/: $err"; fi
}

root=()
((EUID == 0)) && root=(--allow-run-as-root)
# shellcheck disable=SC2054  # an MCA value is a comma list, one word
single_host=(--mca btl self,vader,tcp --mca btl_tcp_if_include lo)

# --- dry run: the command, word by word ------------------------------------------------------
run_zr -np 1 --dry-run -- echo a
expect_rc "dry-run -np 1" 0
expect_argv "dry-run -np 1" mpirun "${root[@]}" "${single_host[@]}" -np 1 echo a
[[ -z $out ]] && pass || fail "dry-run ran the program: stdout '$out'"

over=$((cores + 1))
run_zr -np "$over" --dry-run -- echo a
expect_rc "dry-run -np cores+1" 0
expect_argv "dry-run -np $over (cores $cores)" mpirun "${root[@]}" --oversubscribe --bind-to none \
  "${single_host[@]}" -np "$over" echo a

run_zr -np "$cores" --dry-run -- echo a
expect_lacks "dry-run -np cores" --oversubscribe
expect_lacks "dry-run -np cores" --bind-to

if ((EUID == 0)); then
  run_zr -np 1 --dry-run -- echo a
  expect_has "root" --allow-run-as-root
else
  run_zr -np 1 --dry-run -- echo a
  expect_lacks "not root" --allow-run-as-root
fi

# Hostfile: no oversubscription, no btl restriction, even with many ranks.
echo "localhost slots=64" > "$work/hosts"
run_zr -np 64 --hostfile "$work/hosts" --dry-run -- echo a
expect_rc "hostfile" 0
expect_argv "hostfile" mpirun "${root[@]}" --hostfile "$work/hosts" -np 64 echo a
# Across hosts the ZINF_* variables set here are exported to every rank (-x NAME).
ZINF_LOG_LEVEL=warn ZINF_IO_ENGINE=posix run_zr -np 4 --hostfile "$work/hosts" --dry-run -- echo a
expect_rc "hostfile exports ZINF_*" 0
expect_argv "hostfile exports ZINF_*" mpirun "${root[@]}" --hostfile "$work/hosts" \
  -x ZINF_IO_ENGINE -x ZINF_LOG_LEVEL -np 4 echo a

# --nvme: appended to the program's arguments, placeholders and odd characters kept as one word.
nv="/mnt/nvme 0/zinf-{local_rank},/mnt/it's/{node}-{local_rank}"
run_zr -np 2 --nvme "$nv" --dry-run -- echo --config 'my cfg.json' '' 'a"b' '$HOME' '*'
expect_rc "nvme" 0
expect_argv "nvme and quoting" mpirun "${root[@]}" "${single_host[@]}" -np 2 echo \
  --config 'my cfg.json' '' 'a"b' '$HOME' '*' --nvme-path "$nv"
expect_err "nvme printed single-quoted" "--nvme-path '/mnt/nvme 0/zinf-\{local_rank\},/mnt/it'\\\\''s/\{node\}-\{local_rank\}'$"
run_zr -np 2 '--nvme=/nvme/{local_rank}' --dry-run -- echo
expect_argv "--nvme=" mpirun "${root[@]}" "${single_host[@]}" -np 2 echo --nvme-path '/nvme/{local_rank}'

# --mpi-arg: passed through in order; a user btl / binding replaces the added one.
run_zr -np "$over" --mpi-arg --mca --mpi-arg btl --mpi-arg self,tcp --mpi-arg --bind-to \
  --mpi-arg core --mpi-arg=-x --mpi-arg=ZINF_LOG_LEVEL --dry-run -- echo
expect_argv "mpi-arg" mpirun "${root[@]}" --oversubscribe --mca btl_tcp_if_include lo \
  --mca btl self,tcp --bind-to core -x ZINF_LOG_LEVEL -np "$over" echo
run_zr -np "$over" --mpi-arg --host --mpi-arg a,b --dry-run -- echo
expect_argv "mpi-arg --host is multi-host" mpirun "${root[@]}" --host a,b -np "$over" echo

# PROGRAM lookup: PATH first, then <script dir>/../build/bin, also through a symlink.
mkdir -p "$work/repo/launch" "$work/repo/build/bin" "$work/elsewhere"
cp "$zr" "$work/repo/launch/zinf-run"
printf '#!/bin/sh\necho fake\n' > "$work/repo/build/bin/zinf-fake"
chmod +x "$work/repo/launch/zinf-run" "$work/repo/build/bin/zinf-fake"
ln -s "$work/repo/launch/zinf-run" "$work/elsewhere/zr"
for script in "$work/repo/launch/zinf-run" "$work/elsewhere/zr"; do
  "$script" -np 1 --dry-run -- zinf-fake x > "$work/out" 2> "$work/err"
  rc=$?
  err=$(cat "$work/err")
  expect_rc "build/bin lookup via $script" 0
  expect_argv "build/bin lookup via $script" mpirun "${root[@]}" "${single_host[@]}" -np 1 \
    "$work/repo/build/bin/zinf-fake" x
done
(cd "$work" && "$work/repo/launch/zinf-run" -np 1 --dry-run -- ./zinf-fake) > /dev/null 2> "$work/err"
rc=$?
err=$(cat "$work/err")
expect_rc "a path is not looked up" 0
expect_err "a path is not looked up" " -np 1 \./zinf-fake$"

# --- usage errors: exit 2, nothing started, a message saying what is wrong -------------------
usage_error() {  # usage_error NAME REGEX ARGS...
  local name=$1 re=$2
  shift 2
  run_zr "$@"
  expect_rc "$name" 2
  expect_err "$name" "$re"
  if grep -q '^zinf-run: mpirun' <<< "$err"; then fail "$name: printed a command: $err"; else pass; fi
}
usage_error "missing -np" "missing -np" -- echo a
usage_error "missing -np value" "-np needs a value" -np
usage_error "bad N 0" "bad number of ranks '0'" -np 0 -- echo a
usage_error "bad N -1" "bad number of ranks '-1'" -np -1 -- echo a
usage_error "bad N abc" "bad number of ranks 'abc'" -np abc -- echo a
usage_error "bad N 2x" "bad number of ranks '2x'" -np 2x -- echo a
# Beyond 2^20 ranks, or beyond what bash arithmetic holds: refused, never passed to mpirun.
usage_error "bad N 2^20+1" "bad number of ranks '1048577': expected an integer from 1 to 1048576" \
  -np 1048577 -- echo a
usage_error "bad N 20 digits" "bad number of ranks '99999999999999999999'" \
  -np 99999999999999999999 -- echo a
usage_error "bad N 2^64" "bad number of ranks '18446744073709551617'" \
  --np=18446744073709551617 -- echo a
usage_error "bad N +2" "bad number of ranks '\+2'" -np +2 -- echo a
usage_error "bad N 02" "bad number of ranks '02'" -np 02 -- echo a
# A single-valued option given twice, in any spelling: refused, not "the last one wins".
usage_error "-np twice" "-np: the number of ranks given twice" -np 1 -np 2 -- echo a
usage_error "-np and -n" "-n: the number of ranks given twice" -np 1 -n 1 -- echo a
usage_error "-np and --np=" "--np: the number of ranks given twice" -np 1 --np=2 -- echo a
usage_error "--hostfile twice" "--hostfile: a hostfile given twice" \
  -np 1 --hostfile "$work/hosts" --hostfile="$work/hosts" -- echo a
usage_error "--nvme twice" "--nvme: the NVMe path list given twice" \
  -np 1 --nvme /a --nvme /b -- echo a
usage_error "-np through --mpi-arg" "--mpi-arg -np: the number of ranks is given with" \
  -np 1 --mpi-arg -np --mpi-arg 2 -- echo a
run_zr -np 1048576 --oversubscribe --dry-run -- echo a
expect_rc "-np 2^20 is accepted (with --oversubscribe)" 0
# More than 4 ranks per core on one host: refused unless --oversubscribe (zinf-run's own or
# through --mpi-arg) or a hostfile / --host says where else they go.
limit=$((4 * cores))
usage_error "-np above 4 x cores" \
  "-np $((limit + 1)) on this host's $cores core\\(s\\) is more than 4 ranks per core: give --oversubscribe" \
  -np $((limit + 1)) --dry-run -- echo a
usage_error "-np 2^20 without --oversubscribe" "more than 4 ranks per core" \
  -np 1048576 --dry-run -- echo a
run_zr -np "$limit" --dry-run -- echo a
expect_rc "-np 4 x cores is accepted" 0
OMP_NUM_THREADS=1 OMP_THREAD_LIMIT=1 run_zr -np "$limit" --dry-run -- echo a
expect_rc "-np 4 x cores with OMP_NUM_THREADS=1 (nproc would say 1)" 0
run_zr -np $((limit + 1)) --oversubscribe --dry-run -- echo a
expect_rc "--oversubscribe" 0
expect_argv "--oversubscribe" mpirun "${root[@]}" --oversubscribe --bind-to none \
  "${single_host[@]}" -np $((limit + 1)) echo a
run_zr -np $((limit + 1)) --mpi-arg --oversubscribe --dry-run -- echo a
expect_rc "--mpi-arg --oversubscribe" 0
run_zr -np $((limit + 1)) --hostfile "$work/hosts" --dry-run -- echo a
expect_rc "a hostfile, many ranks" 0
run_zr -np 2 --oversubscribe --dry-run -- echo a
expect_argv "--oversubscribe below the cores" mpirun "${root[@]}" --oversubscribe \
  "${single_host[@]}" -np 2 echo a
usage_error "missing --" "missing '--'" -np 2
usage_error "program without --" "put '--' before the program" -np 2 echo a
usage_error "missing program" "missing program after '--'" -np 2 --
usage_error "unknown option" "unknown option '--frobnicate'" -np 2 --frobnicate -- echo a
usage_error "missing hostfile" "hostfile '$work/nope' does not exist" -np 2 --hostfile "$work/nope" -- echo a
usage_error "program not found" "program 'zinf-no-such-program' not found" -np 1 -- zinf-no-such-program
usage_error "empty --nvme" "--nvme needs a non-empty path list" -np 1 --nvme '' -- echo
usage_error "--nvme empty entry" "empty path in the list" -np 1 --nvme /a,,/b -- echo
usage_error "--nvme and --nvme-path" "give one of them" -np 1 --nvme /a -- echo --nvme-path /b
ZINF_MPIRUN=/nonexistent/mpirun run_zr -np 1 -- echo a
expect_rc "missing mpirun" 2
expect_err "missing mpirun" "apt-get install openmpi-bin"
mkdir -p "$work/nompi"
for tool in bash dirname readlink nproc cat; do ln -sf "$(command -v "$tool")" "$work/nompi/$tool"; done
PATH=$work/nompi run_zr -np 1 -- echo a
expect_rc "no mpirun on PATH" 2
expect_err "no mpirun on PATH" "'mpirun' not found: install Open MPI \(apt-get install openmpi-bin\)"

run_zr --help
expect_rc "--help" 0
grep -q '^usage: zinf-run -np N' <<< "$out" && pass || fail "--help: no usage line on stdout: $out"
grep -q -- '--nvme-path' <<< "$out" && pass || fail "--help does not explain --nvme: $out"

# --- real runs --------------------------------------------------------------------------------
run_zr -np 3 -- hostname
expect_rc "-np 3 hostname" 0
lines=$(grep -c . <<< "$out")
[[ $lines -eq 3 ]] && pass || fail "-np 3 hostname printed $lines lines, expected 3: $out"
expect_err "-np 3 hostname prints its command" "^zinf-run: mpirun .*-np 3 hostname$"

run_zr -np 2 -- bash -c 'exit 3'
expect_rc "exit status of the ranks" 3
run_zr -np 1 -- true
expect_rc "exit status 0" 0

out=$(echo "line on stdin" | "$zr" -np 1 -- cat 2> /dev/null)
[[ $out == "line on stdin" ]] && pass || fail "stdin does not reach rank 0: '$out'"

# Signals: SIGTERM / SIGINT to zinf-run stop every rank within 10 s, with a non-zero status.
# (Started from a script, a background job ignores SIGINT unless mpirun installs its handler:
# this checks that it does.)
for sig in TERM INT; do
  tag=$((4000 + RANDOM % 1000)).$$
  "$zr" -np 2 -- sleep "$tag" > "$work/out" 2> "$work/err" &
  bg_pid=$!
  for ((i = 0; i < 100; ++i)); do
    [[ $(pgrep -c -f "^sleep $tag\$") -eq 2 ]] && break
    sleep 0.1
  done
  n=$(pgrep -c -f "^sleep $tag\$")
  [[ $n -eq 2 ]] && pass || fail "SIG$sig: $n of 2 ranks started within 10 s"
  kill -"$sig" "$bg_pid"
  start=$SECONDS
  exited=0
  for ((i = 0; i < 100; ++i)); do
    kill -0 "$bg_pid" 2> /dev/null || { exited=1; break; }
    sleep 0.1
  done
  if ((exited)); then
    wait "$bg_pid"
    rc=$?
    bg_pid=""
    [[ $rc -ne 0 ]] && pass || fail "SIG$sig: zinf-run exited 0"
    echo "SIG$sig: zinf-run exited with $rc after $((SECONDS - start)) s"
  else
    fail "SIG$sig: zinf-run still running 10 s after the signal"
    kill -KILL "$bg_pid" 2> /dev/null
    wait "$bg_pid" 2> /dev/null
    bg_pid=""
  fi
  sleep 0.5
  left=$(pgrep -f "^sleep $tag\$" | tr '\n' ' ')
  if [[ -n $left ]]; then
    fail "SIG$sig: rank processes left behind: $left"
    kill -KILL $left 2> /dev/null
  else
    pass
  fi
done

if ((failures > 0)); then
  echo "zinf_run_test: $failures check(s) failed, $checks passed" >&2
  exit 1
fi
echo "zinf_run_test: all $checks checks passed"
