#!/bin/sh
# agent.sh: Open MPI's launch agent (plm_rsh_agent, the ssh replacement) for the simulated hosts of
# tests/multihost/lib.sh. Open MPI runs it the way it runs ssh:
#
#   agent.sh HOST ORTED_COMMAND_WORDS...
#
# where the words form a remote-shell command line (they hold literal quotes), so they are joined
# and re-parsed by sh -c, as sshd would. The orted (and every rank it spawns) runs
#   - in HOST's network namespace (its own address on the harness's bridge, its own loopback),
#   - in a fresh UTS namespace whose hostname is HOST (what gethostname() and Open MPI see),
#   - in a fresh mount namespace (made by `ip netns exec`) where
#       $MH_DIR/nodelocal   is HOST's node-local folder: a bind mount of $MH_DIR/nodes/HOST, or a
#                           tmpfs of the size in $MH_DIR/hostcfg/HOST.tmpfs when that file exists
#                           (a small "disk"; its nvme/ subfolder is created), and
#       /dev/shm            is a private tmpfs (Open MPI's shared memory of that host only).
#     The mounts belong to that namespace alone: they vanish when the host's last process exits.
#   - with a clean environment (PATH, HOME, LANG, USER, SHELL, MH_HOST, MH_NODELOCAL), as ssh gives:
#     pass anything else with mpirun -x NAME.
# Needs MH_DIR (exported by lib.sh; mpirun's environment reaches its agent). Every launch is
# appended to $MH_DIR/agent.log.
set -u
host=${1:?usage: agent.sh HOST COMMAND...}
shift
[ -n "${MH_DIR:-}" ] && [ -f "$MH_DIR/hosts" ] ||
  { echo "multihost agent: MH_DIR is not a harness directory: '${MH_DIR:-}'" >&2; exit 255; }
grep -qx -- "$host" "$MH_DIR/hosts" ||
  { echo "multihost agent: '$host' is not one of this harness's hosts ($(tr '\n' ' ' < "$MH_DIR/hosts"))" >&2; exit 255; }
[ -e "/run/netns/$host" ] ||
  { echo "multihost agent: network namespace '$host' does not exist" >&2; exit 255; }
cmd=$*
tmpfs_size=
[ -f "$MH_DIR/hostcfg/$host.tmpfs" ] && tmpfs_size=$(cat "$MH_DIR/hostcfg/$host.tmpfs")
printf '%s %s: %s\n' "$(date +%T.%N)" "$host" "$cmd" >> "$MH_DIR/agent.log"
exec env -i PATH="$PATH" HOME="${HOME:-/root}" LANG="${LANG:-C.UTF-8}" USER="$(id -un)" \
  SHELL=/bin/sh ip netns exec "$host" unshare --uts -- sh -c '
  host=$1 dir=$2 cmd=$3 tmpfs_size=$4
  hostname "$host" || exit 255
  if [ -n "$tmpfs_size" ]; then
    mount -t tmpfs -o "size=$tmpfs_size,mode=755" "mh-nvme-$host" "$dir/nodelocal" || exit 255
    mkdir "$dir/nodelocal/nvme" || exit 255
  else
    mount --bind "$dir/nodes/$host" "$dir/nodelocal" || exit 255
  fi
  mount -t tmpfs -o mode=1777,size=512m "mh-shm-$host" /dev/shm || exit 255
  export MH_HOST="$host" MH_NODELOCAL="$dir/nodelocal"
  exec sh -c "$cmd"' agent "$host" "$MH_DIR" "$cmd" "$tmpfs_size"
