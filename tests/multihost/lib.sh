# shellcheck shell=bash
# The multi-host test harness (sourced by the tests in this folder, not run): N simulated hosts on
# one machine, each a Linux network + UTS + mount namespace with its own address, hostname,
# /dev/shm and node-local folder, plus one folder shared by all of them; commands run across them
# with Open MPI's mpirun and a hostfile, launched through agent.sh in place of ssh.
#
#   source tests/multihost/lib.sh
#   mh_binaries "$@"             # ZINF_TRAIN ZINF_CKPT [MPIEXEC] from the command line
#   mh_init NAME N [SLOTS]       # N hosts (1..9) with SLOTS slots each (default 2), or exit 77
#   mh_mpirun LIMIT_S -np 4 PROG ARGS...          # mpirun --hostfile $MH_DIR/hostfile ...
#   mh_mpirun_bg LIMIT_S ...; mh_wait            # the same in the background ($mh_job_pid)
#   mh_host_pids HOST                            # pids running on HOST
#   mh_set_tmpfs HOST SIZE                       # HOST's node-local folder becomes a SIZE tmpfs
#   mh_hostfile FILE HOST:SLOTS...               # another hostfile; MH_HOSTFILE=FILE mh_mpirun
#
# What a test sees:
#   $MH_DIR                 the harness's scratch directory (also the test's working directory)
#   $MH_HOSTS               the hosts' names (mh<slot>-node1, mh<slot>-node2, ...) = hostnames
#   $MH_DIR/hostfile        "HOST slots=SLOTS" per host
#   $MH_DIR/nodes/HOST      HOST's node-local folder as seen from outside (by the test)
#   $MH_DIR/nodelocal       the same path on every host, showing that host's own folder only,
#                           like a node-local NVMe mount point; $MH_NVME = its nvme/ subfolder
#   $MH_DIR/shared          the same folder on every host (the shared file system)
#
# Network: a bridge zmhbr<slot> with 198.19.<slot>.1/24 in the root namespace (where mpirun runs)
# and host i at 198.19.<slot>.(i+1) (veth "v" + host name), IPv6 off, no route anywhere else;
# Open MPI's out-of-band and TCP traffic is restricted to that subnet (OMPI_MCA_* variables, so a
# plain `mpirun --hostfile` or `launch/zinf-run --hostfile` works too), shared memory inside a
# host. /etc/hosts gets one "ADDR HOST # zinf-multihost-slot<k>" line per host, so nothing asks
# DNS.
#
# Teardown. Every thing mh_init makes is first written to an undo log in the slot's registry
# directory /run/zinf-multihost/slot<k> (owner pid and start time, then one line per namespace,
# link, /etc/hosts tag, directory, and per job the pid and start time of its `timeout`);
# mh_teardown runs on EXIT (also after HUP/INT/PIPE/TERM, a failed check or a skip): it stops the
# jobs it started (SIGTERM, then SIGKILL to the job's process group), then SIGKILLs every process
# left inside the hosts' network namespaces, by pid, and undoes the log in reverse; it fails the
# test if a namespace, link or /etc/hosts line of its slot is left. A run killed with SIGKILL (a CTest timeout)
# cannot clean up: the next mh_init finds the slot's owner dead and undoes its log first. Nothing
# is mounted outside the hosts' own mount namespaces, so no mount can outlive them.
#
# Skips (exit 77, "SKIP: reason"): not root, no ip/unshare/mount/mpirun, namespaces or mounts
# refused by the kernel.
set -u

mh_lib_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
zinf_train=
zinf_ckpt=
mh_mpiexec=mpirun
mh_registry=/run/zinf-multihost
mh_slot=
mh_slot_dir=
mh_job_pid=
MH_DIR=
MH_NVME=
MH_HOSTS=
# The ranks print INFO lines (step lines, summaries); a fault spec from the caller's environment
# would break the tests.
export ZINF_LOG_LEVEL=info
unset ZINF_FAULT_INJECT

check() { echo "check: $*"; }

# fail MESSAGE: a FAIL line, the tail of every log of the test, exit 1 (the trap tears down).
fail() {
  echo "FAIL: $*" >&2
  local f
  for f in "${MH_DIR:-/nonexistent}"/*.log; do
    [[ -f $f ]] && { echo "--- tail of $f" >&2; tail -25 "$f" >&2; }
  done
  exit 1
}

mh_skip() {
  echo "SKIP: $*"
  exit 77
}

stamp() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(stamp)" 'BEGIN { printf "%.1f", b - a }'; }

# Start time of a process (field 22 of /proc/PID/stat), to tell a pid from a reused one.
mh_start_time() {
  local stat
  stat=$(cat "/proc/$1/stat" 2> /dev/null) || return 1
  stat=${stat##*) }
  awk '{ print $20 }' <<< "$stat"
}

mh_undo_log() { echo "$*" >> "$mh_slot_dir/undo"; }

# Kills PID with SIGNAL if it is still the process recorded with START_TIME.
mh_kill_if_same() {
  local pid=$1 start=$2 sig=$3
  [[ $(mh_start_time "$pid") == "$start" ]] && kill "-$sig" "$pid" 2> /dev/null
  return 0
}

# Removes the /etc/hosts lines tagged TAG, in place (the file may be a bind mount).
mh_hosts_remove() {
  local tag=$1 tmp
  grep -q -- "# $tag\$" /etc/hosts 2> /dev/null || return 0
  tmp=$(mktemp) || return 1
  (
    flock 9
    grep -v -- "# $tag\$" /etc/hosts > "$tmp" && cat "$tmp" > /etc/hosts
  ) 9> "$mh_registry/etc-hosts.lock"
  rm -f "$tmp"
}

# Undoes the log in directory SLOT_DIR (ours at exit, or a dead owner's): jobs, then the processes
# inside each namespace (SIGKILL, by pid), then every entry in reverse order.
mh_undo() {
  local dir=$1 kind a b pids i tries
  [[ -f $dir/undo ]] || { rm -rf "$dir"; return 0; }
  # A job is `timeout ... mpirun ...`, timeout leading its own process group: SIGTERM (timeout
  # passes it to mpirun, which stops its ranks), up to 3 s, then SIGKILL to the whole group, so
  # that no mpirun is left to launch into the namespaces while they are emptied.
  local job_list=()
  while read -r kind a b; do
    [[ $kind == job && $(mh_start_time "$a") == "$b" ]] && job_list+=("$a $b")
  done < "$dir/undo"
  if ((${#job_list[@]} > 0)); then
    for i in "${job_list[@]}"; do mh_kill_if_same $i TERM; done
    for tries in $(seq 1 30); do
      pids=
      for i in "${job_list[@]}"; do
        read -r a b <<< "$i"
        [[ $(mh_start_time "$a") == "$b" ]] && pids+=" $a"
      done
      [[ -z $pids ]] && break
      sleep 0.1
    done
    for a in $pids; do
      echo "teardown: job $a still runs 3 s after SIGTERM: SIGKILL to its process group"
      kill -9 -- "-$a" 2> /dev/null || kill -9 "$a" 2> /dev/null
    done
  fi
  for tries in 1 2 3 4 5 6 7 8 9 10; do
    pids=
    while read -r kind a b; do
      [[ $kind == netns && -e /run/netns/$a ]] && pids+=" $(ip netns pids "$a" 2> /dev/null | tr '\n' ' ')"
    done < "$dir/undo"
    [[ -z ${pids// /} ]] && break
    ((tries == 1)) && echo "teardown: killing leftover processes in the hosts:$pids"
    # shellcheck disable=SC2086  # a list of pids
    kill -9 $pids 2> /dev/null
    sleep 0.3
  done
  mapfile -t lines < <(tac "$dir/undo")
  for i in "${lines[@]}"; do
    read -r kind a b <<< "$i"
    case $kind in
      netns) ip netns del "$a" 2> /dev/null ;;
      link) ip link del "$a" 2> /dev/null ;;
      etchosts) mh_hosts_remove "$a" ;;
      ompi) rm -rf "/tmp/ompi.$a.$(id -u)" ;;
      dir) [[ ${MH_KEEP:-0} == 1 ]] && echo "teardown: kept $a (MH_KEEP=1)" || rm -rf "$a" ;;
    esac
  done
  rm -rf "$dir"
}

mh_teardown() {
  local rc=$?
  trap - EXIT HUP INT TERM
  trap '' PIPE  # the reader of our output may be gone; clean up all the same
  cd / || true
  if [[ -n $mh_slot_dir && -d $mh_slot_dir ]]; then
    mh_undo "$mh_slot_dir"
    echo "teardown: hosts, bridge, /etc/hosts lines, harness slot $mh_slot and $MH_DIR removed"
    local left
    left=$( (ip netns list; ip -br link) 2> /dev/null | grep -E "^(v?mh$mh_slot-node[0-9]|zmhbr$mh_slot)\\b")
    grep -q -- "# zinf-multihost-slot$mh_slot\$" /etc/hosts && left+=" /etc/hosts lines"
    [[ -n $left ]] && { echo "FAIL: teardown left: $left" >&2; ((rc == 0 || rc == 77)) && rc=1; }
  fi
  exit "$rc"
}

# Claims a free slot 0..15 (a directory in the registry), reclaiming the slots of dead owners.
mh_claim_slot() {
  local k pid start
  mkdir -p "$mh_registry" || mh_skip "cannot create $mh_registry"
  for k in $(seq 0 15); do
    if [[ -d $mh_registry/slot$k ]]; then
      read -r pid start < "$mh_registry/slot$k/owner" 2> /dev/null || { pid=0; start=; }
      if [[ $pid != 0 && $(mh_start_time "$pid") == "$start" ]]; then
        continue
      fi
      # The owner died without tearing down (SIGKILL): take the slot over atomically, undo it.
      if mv "$mh_registry/slot$k" "$mh_registry/reclaim.$k.$$" 2> /dev/null; then
        echo "reclaiming slot $k left by dead pid $pid"
        mh_undo "$mh_registry/reclaim.$k.$$"
      fi
    fi
    if mkdir "$mh_registry/slot$k" 2> /dev/null; then
      mh_slot=$k
      mh_slot_dir=$mh_registry/slot$k
      echo "$$ $(mh_start_time $$)" > "$mh_slot_dir/owner"
      return 0
    fi
  done
  echo "FAIL: no free harness slot in $mh_registry" >&2
  exit 1
}

# mh_binaries ZINF_TRAIN ZINF_CKPT [MPIEXEC]: the programs the test runs (absolute paths, since
# the test works in $MH_DIR). Every test is `<test>.sh ZINF_TRAIN ZINF_CKPT [MPIEXEC]`: CTest passes
# the built binaries and CMake's MPIEXEC_EXECUTABLE; by hand: build/bin/zinf-train
# build/bin/zinf-ckpt. ZINF_CKPT may be "-" where the test needs no zinf-ckpt.
mh_binaries() {
  zinf_train=$(readlink -f "${1:-}")
  zinf_ckpt=${2:--}
  [[ $zinf_ckpt == - ]] || zinf_ckpt=$(readlink -f "$zinf_ckpt")
  mh_mpiexec=${3:-mpirun}
  [[ -x $zinf_train && ( $zinf_ckpt == - || -x $zinf_ckpt ) ]] ||
    { echo "FAIL: usage: $0 ZINF_TRAIN ZINF_CKPT [MPIEXEC] (executables; got '${1:-}' '${2:-}')" >&2; exit 1; }
}

# mh_init NAME N [SLOTS]: see the top of the file.
mh_init() {
  local name=$1 n=$2 slots=${3:-2} tool i h addr
  [[ $n =~ ^[1-9]$ ]] || { echo "FAIL: mh_init: N must be 1..9, not '$n'" >&2; exit 1; }
  trap mh_teardown EXIT
  trap 'exit 129' HUP
  trap 'exit 130' INT
  trap 'exit 141' PIPE
  trap 'exit 143' TERM
  [[ $(id -u) == 0 ]] || mh_skip "simulated hosts need root (network and mount namespaces); uid is $(id -u)"
  for tool in ip unshare mount hostname flock tac timeout "$mh_mpiexec"; do
    command -v "$tool" > /dev/null || mh_skip "'$tool' is not installed"
  done
  mh_claim_slot

  MH_DIR=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-mh-$name-XXXXXX") ||
    { echo "FAIL: cannot make a scratch directory" >&2; exit 1; }
  mh_undo_log dir "$MH_DIR"
  export MH_DIR
  echo "scratch directory $MH_DIR, harness slot $mh_slot"
  mkdir -p "$MH_DIR/nodelocal" "$MH_DIR/shared" "$MH_DIR/hostcfg"
  export MH_NVME=$MH_DIR/nodelocal/nvme

  local bridge=zmhbr$mh_slot net=198.19.$mh_slot
  mh_undo_log link "$bridge"
  ip link add "$bridge" type bridge 2> "$MH_DIR/setup.err" ||
    mh_skip "cannot create a bridge: $(cat "$MH_DIR/setup.err")"
  sysctl -qw "net.ipv6.conf.$bridge.disable_ipv6=1" 2> /dev/null
  ip addr add "$net.1/24" dev "$bridge" && ip link set "$bridge" up ||
    { echo "FAIL: cannot configure $bridge" >&2; exit 1; }
  MH_HOSTS=
  : > "$MH_DIR/hostfile"
  for i in $(seq 1 "$n"); do
    h=mh$mh_slot-node$i
    addr=$net.$((i + 1))
    mh_undo_log netns "$h"
    ip netns add "$h" 2> "$MH_DIR/setup.err" ||
      mh_skip "cannot create a network namespace: $(cat "$MH_DIR/setup.err")"
    mh_undo_log link "v$h"
    ip link add "v$h" type veth peer name eth0 netns "$h" &&
      ip link set "v$h" master "$bridge" up &&
      ip -n "$h" addr add "$addr/24" dev eth0 &&
      ip -n "$h" link set eth0 up && ip -n "$h" link set lo up ||
      { echo "FAIL: cannot wire host $h" >&2; exit 1; }
    sysctl -qw "net.ipv6.conf.v$h.disable_ipv6=1" 2> /dev/null
    ip netns exec "$h" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 \
      net.ipv6.conf.default.disable_ipv6=1 2> /dev/null
    mh_undo_log ompi "$h"
    mkdir -p "$MH_DIR/nodes/$h/nvme"
    echo "$h" >> "$MH_DIR/hosts"
    echo "$h slots=$slots" >> "$MH_DIR/hostfile"
    MH_HOSTS+="$h "
  done
  MH_HOSTS=${MH_HOSTS% }
  mh_undo_log etchosts "zinf-multihost-slot$mh_slot"
  (
    flock 9
    i=1
    for h in $MH_HOSTS; do
      echo "$net.$((i + 1)) $h # zinf-multihost-slot$mh_slot" >> /etc/hosts
      i=$((i + 1))
    done
  ) 9> "$mh_registry/etc-hosts.lock"

  # The namespaces and mounts work as the agent uses them (gVisor, user namespaces and
  # containers without CAP_SYS_ADMIN may refuse some of it).
  set -- $MH_HOSTS
  ip netns exec "$1" unshare --uts -- sh -c "hostname $1 && mount --bind '$MH_DIR/nodes/$1' \
    '$MH_DIR/nodelocal' && mount -t tmpfs -o size=1m mh-probe /dev/shm" > "$MH_DIR/setup.err" 2>&1 ||
    mh_skip "a host cannot set its hostname or mount its folders: $(cat "$MH_DIR/setup.err")"
  rm -f "$MH_DIR/setup.err"

  # Open MPI across the hosts: the agent in place of ssh, TCP on the harness's subnet only,
  # no binding (the hosts share the real cores), yield when idle (oversubscribed cores).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_plm_rsh_agent=$mh_lib_dir/agent.sh OMPI_MCA_plm_rsh_no_tree_spawn=1
  export OMPI_MCA_oob_tcp_if_include=$net.0/24 OMPI_MCA_btl_tcp_if_include=$net.0/24
  export OMPI_MCA_oob_tcp_disable_ipv6_family=1 OMPI_MCA_btl_tcp_disable_family=6
  export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_mpi_yield_when_idle=1
  export OMPI_MCA_hwloc_base_binding_policy=none OMPI_MCA_rmaps_base_oversubscribe=1
  cd "$MH_DIR" || exit 1
  echo "hosts: $MH_HOSTS (subnet $net.0/24)"
}

# The mpirun arguments every job gets; the ranks' environment is clean (as over ssh), so the
# ZINF_* variables the tests use are passed explicitly.
mh_mpirun_args() {
  mh_args=(--hostfile "${MH_HOSTFILE:-$MH_DIR/hostfile}" -x ZINF_LOG_LEVEL)
  local v
  for v in ZINF_LOG_ALL_RANKS ZINF_IO_ENGINE; do
    [[ -n ${!v:-} ]] && mh_args+=(-x "$v")
  done
}

# mh_mpirun_bg LIMIT_S MPIRUN_ARGS...: mpirun across the hosts in the background, killed after
# LIMIT_S seconds; its pid (timeout's) in $mh_job_pid, recorded for the teardown.
mh_mpirun_bg() {
  local limit=$1
  shift
  mh_mpirun_args
  timeout --kill-after=5 "$limit" "$mh_mpiexec" "${mh_args[@]}" "$@" &
  mh_job_pid=$!
  mh_undo_log job "$mh_job_pid" "$(mh_start_time "$mh_job_pid")"
}

# mh_wait: waits for the last background job; returns its status (124/137: timed out).
mh_wait() {
  wait "$mh_job_pid"
}

# mh_mpirun LIMIT_S MPIRUN_ARGS...: the same in the foreground; returns mpirun's status.
mh_mpirun() {
  mh_mpirun_bg "$@"
  mh_wait
}

# mh_hostfile FILE HOST:SLOTS...: writes an Open MPI hostfile; `MH_HOSTFILE=FILE mh_mpirun ...`
# uses it instead of $MH_DIR/hostfile.
mh_hostfile() {
  local file=$1 spec
  shift
  : > "$file"
  for spec in "$@"; do echo "${spec%:*} slots=${spec##*:}" >> "$file"; done
}

# mh_host_pids HOST [COMM]: the pids running on HOST (in its network namespace), only those whose
# command name is COMM when given.
mh_host_pids() {
  local p
  for p in $(ip netns pids "$1" 2> /dev/null); do
    [[ -z ${2:-} || $(cat "/proc/$p/comm" 2> /dev/null) == "$2" ]] && echo "$p"
  done
}

# mh_set_tmpfs HOST SIZE: from the next launch on, HOST's node-local folder is an empty tmpfs of
# SIZE (mount's size= syntax) holding an empty nvme/, mounted in that host's namespace only.
mh_set_tmpfs() {
  echo "$2" > "$MH_DIR/hostcfg/$1.tmpfs"
}

# metric, metric_after, metrics_problem, median, parse_size (tests/testing/metrics.sh).
# shellcheck source=../testing/metrics.sh
source "$(dirname "${BASH_SOURCE[0]}")/../testing/metrics.sh"
