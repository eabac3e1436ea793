# shellcheck shell=bash
# A memory cgroup for a job (sourced by the launch/ scripts and tests): every process started
# from a shell that joined it is born inside it, mpirun and its ranks included. Needs root and a
# writable memory controller: cgroup v1 at /sys/fs/cgroup/memory, or the cgroup v2 hierarchy at
# /sys/fs/cgroup with "memory" in cgroup.subtree_control (enabled here when it is not). Never
# touches anything outside the group it made.
#
#   source "$repo/launch/lib/cgroup.sh"
#   group=$(memory_group_make zinf-demo-$$ "$limit_bytes") || exit 1   # says why on stderr
#   trap 'memory_group_remove "$group"' EXIT
#   ( memory_group_join "$group" && exec mpirun ... )                   # every rank inside it
#   peak=$(memory_group_peak "$group")                                  # bytes, "" if unknown
#
# The limit holds the group's anonymous memory and its page cache; swap is kept out (v1
# memory.memsw.limit_in_bytes where the kernel accounts swap, v2 memory.swap.max 0), so a job
# that needs more is killed by the OOM killer instead of swapping.

# memory_group_hierarchy: "v1" or "v2" on stdout for the memory controller this script can use,
# or the reason it cannot on stderr and status 1.
memory_group_hierarchy() {
  if [[ $(id -u) != 0 ]]; then
    echo "a memory cgroup needs root (this is uid $(id -u)); run as root, or in a container" \
      "with a writable /sys/fs/cgroup" >&2
    return 1
  fi
  if [[ -d /sys/fs/cgroup/memory && -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]]; then
    if [[ -w /sys/fs/cgroup/memory ]]; then
      echo v1
      return 0
    fi
    echo "the cgroup v1 memory controller at /sys/fs/cgroup/memory is not writable (mounted" \
      "read-only?); remount it read-write or run where it is" >&2
    return 1
  fi
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    if ! grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
      echo "the cgroup v2 hierarchy at /sys/fs/cgroup has no memory controller" \
        "(cgroup.controllers: $(cat /sys/fs/cgroup/cgroup.controllers))" >&2
      return 1
    fi
    if [[ ! -w /sys/fs/cgroup/cgroup.subtree_control ]]; then
      echo "the cgroup v2 hierarchy at /sys/fs/cgroup is not writable (mounted read-only?)" >&2
      return 1
    fi
    echo v2
    return 0
  fi
  echo "no memory cgroup controller: neither cgroup v1 (/sys/fs/cgroup/memory) nor cgroup v2" \
    "with a memory controller (/sys/fs/cgroup/cgroup.controllers) is mounted" >&2
  return 1
}

# memory_group_make NAME LIMIT_BYTES: makes the group NAME (a new one: an existing NAME is
# refused) with the memory limit LIMIT_BYTES and prints its directory; on failure prints why on
# stderr, removes what it made and returns 1.
memory_group_make() {
  local name=$1 limit=$2 kind dir
  kind=$(memory_group_hierarchy) || return 1
  if [[ $kind == v1 ]]; then
    dir=/sys/fs/cgroup/memory/$name
  else
    dir=/sys/fs/cgroup/$name
    if ! grep -qw memory /sys/fs/cgroup/cgroup.subtree_control &&
      ! echo +memory 2> /dev/null > /sys/fs/cgroup/cgroup.subtree_control; then
      echo "cannot enable the cgroup v2 memory controller for the children of /sys/fs/cgroup" \
        "(writing +memory to its cgroup.subtree_control failed: the root group of a" \
        "container holds processes?)" >&2
      return 1
    fi
  fi
  if ! mkdir "$dir" 2> /dev/null; then
    echo "cannot make the memory cgroup $dir" \
      "($([[ -e $dir ]] && echo exists || echo mkdir failed))" >&2
    return 1
  fi
  local ok=1
  if [[ $kind == v1 ]]; then
    echo "$limit" 2> /dev/null > "$dir/memory.limit_in_bytes" || ok=0
    if [[ -e $dir/memory.memsw.limit_in_bytes ]]; then
      echo "$limit" 2> /dev/null > "$dir/memory.memsw.limit_in_bytes" || ok=0
    fi
  else
    echo "$limit" 2> /dev/null > "$dir/memory.max" || ok=0
    [[ ! -e $dir/memory.swap.max ]] || echo 0 2> /dev/null > "$dir/memory.swap.max" || ok=0
  fi
  if ((ok == 0)); then
    echo "cannot set the memory limit of $dir to $limit bytes" >&2
    rmdir "$dir" 2> /dev/null
    return 1
  fi
  echo "$dir"
}

# memory_group_join DIR: moves the calling shell (its $BASHPID: call it in the subshell that
# then execs the job) into the group.
memory_group_join() {
  echo "$BASHPID" > "$1/cgroup.procs"
}

# memory_group_limit DIR: the group's limit in bytes.
memory_group_limit() {
  if [[ -e $1/memory.limit_in_bytes ]]; then
    cat "$1/memory.limit_in_bytes"
  else
    cat "$1/memory.max"
  fi
}

# memory_group_peak DIR: the group's peak usage in bytes (v1 memory.max_usage_in_bytes, v2
# memory.peak, which kernels before 5.19 lack: then nothing is printed).
memory_group_peak() {
  if [[ -e $1/memory.max_usage_in_bytes ]]; then
    cat "$1/memory.max_usage_in_bytes"
  elif [[ -e $1/memory.peak ]]; then
    cat "$1/memory.peak"
  fi
}

# memory_group_ooms DIR: how many of the group's processes the OOM killer killed (v1
# memory.oom_control oom_kill, v2 memory.events oom_kill; kernels without the count print
# v1's memory.failcnt, the times the group hit its limit).
memory_group_ooms() {
  if [[ -e $1/memory.oom_control ]] && grep -q '^oom_kill ' "$1/memory.oom_control"; then
    awk '$1 == "oom_kill" { print $2 }' "$1/memory.oom_control"
  elif [[ -e $1/memory.failcnt ]]; then
    cat "$1/memory.failcnt"
  else
    awk '$1 == "oom_kill" { print $2 }' "$1/memory.events"
  fi
}

# memory_group_remove DIR: removes the group once its processes are gone (waits up to 10 s
# for exiting ones); never fails the caller.
memory_group_remove() {
  local dir=$1 i
  [[ -n $dir && -d $dir ]] || return 0
  for ((i = 0; i < 100; i++)); do
    rmdir "$dir" 2> /dev/null && return 0
    sleep 0.1
  done
  echo "could not remove the memory cgroup $dir (processes still in it:" \
    "$(tr '\n' ' ' < "$dir/cgroup.procs"))" >&2
  return 0
}
