#!/usr/bin/env bash
# 2 hosts x 2 ranks train the charlm with node-local swap stores and checkpoint into the shared
# folder; each host's node-local folder holds only its own ranks' stores. Two ways to give every
# host its own folder are tried:
#   A. the same path on every host, a different folder behind it: --nvme-path $MH_NVME (each host
#      sees its own nodes/<host>/nvme there, like /mnt/nvme on every node);
#   B. one base with the {node} placeholder: --nvme-path $MH_DIR/shared/nvme/node{node}, which
#      zinf-train expands to the node index (nodes numbered by their lowest world rank).
# zinf.keep_swap keeps the stores after exit so they can be inspected. Checks, for each way: exit 0;
# metrics of steps 1..20 with world_size 4 and finite losses; rank 0's per-node table names both
# hosts with 2 ranks each; the store directory zinf-<job>/ behind each host's folder holds exactly
# rank<r>/ for the ranks Open MPI placed on that host (asked with the same hostfile and -np);
# latest in the shared folder names step-20.h5, which `zinf-ckpt verify` accepts.
#
#   nodelocal_stores.sh ZINF_TRAIN ZINF_CKPT [MPIEXEC]
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mh_binaries "$@"
mh_init nodelocal-stores 2 2
set -- $MH_HOSTS
host1=$1 host2=$2

cat > "$MH_DIR/shared/config.json" << EOF
{"train_micro_batch_size_per_gpu": 16,
 "zero_optimization": {"stage": 1, "sub_group_size": 16384,
                       "offload_optimizer": {"device": "nvme", "pipeline_read": true,
                                             "pipeline_write": true}},
 "zinf": {"keep_swap": true, "job_id": "mhstores",
          "model": {"name": "charlm", "hidden": 128, "layers": 1}, "seed": 7}}
EOF

check "Open MPI places ranks 0,1 on $host1 and 2,3 on $host2"
mh_mpirun 30 -np 4 sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname)"' > "$MH_DIR/placement.txt" \
  2> "$MH_DIR/placement.err" ||
  fail "mpirun of sh across the hosts exited with $?: $(cat "$MH_DIR/placement.txt" \
    "$MH_DIR/placement.err")"
# stdout only: Open MPI may warn on stderr (such as "plm:rsh: Warning: setpgid ... failed").
placement=$(sort -n "$MH_DIR/placement.txt" | tr '\n' ' ')
[[ $placement == "0 $host1 1 $host1 2 $host2 3 $host2 " ]] || fail "placement: $placement"

# ranks_in DIR: the rank<r> entries of DIR, sorted, space-separated.
ranks_in() { (cd "$1" 2> /dev/null && ls -d rank* 2> /dev/null) | sort | tr '\n' ' '; }

for way in A B; do
  if [[ $way == A ]]; then
    nvme=$MH_NVME
    store1=$MH_DIR/nodes/$host1/nvme/zinf-mhstores
    store2=$MH_DIR/nodes/$host2/nvme/zinf-mhstores
  else
    mkdir -p "$MH_DIR/shared/nvme/node0" "$MH_DIR/shared/nvme/node1"
    nvme=$MH_DIR/shared/nvme/'node{node}'
    store1=$MH_DIR/shared/nvme/node0/zinf-mhstores
    store2=$MH_DIR/shared/nvme/node1/zinf-mhstores
  fi
  ckpt=$MH_DIR/shared/ckpt-$way
  log=$MH_DIR/train-$way.log
  check "way $way (--nvme-path $nvme): 20 steps on 2 hosts x 2 ranks exit 0"
  t0=$(stamp)
  mh_mpirun 120 -np 4 "$zinf_train" --config "$MH_DIR/shared/config.json" --steps 20 \
    --nvme-path "$nvme" --checkpoint-dir "$ckpt" --checkpoint-every 10 \
    --metrics "$MH_DIR/shared/metrics-$way.jsonl" > "$log" 2>&1 ||
    fail "way $way: zinf-train exited with $?"
  echo "  took $(elapsed "$t0") s"

  check "way $way: metrics of steps 1..20, world_size 4, finite losses"
  problem=$(metrics_problem "$MH_DIR/shared/metrics-$way.jsonl" 1 20 4) ||
    fail "way $way: $problem"

  check "way $way: rank 0's per-node table: node 0 = $host1, node 1 = $host2, 2 ranks each"
  grep -q "node 0 ($host1): 2 rank(s)" "$log" && grep -q "node 1 ($host2): 2 rank(s)" "$log" ||
    fail "way $way: no per-node table naming both hosts with 2 ranks: $(grep -A2 'per node' "$log")"

  check "way $way: $host1's folder holds rank0 rank1 only, $host2's rank2 rank3 only"
  got1=$(ranks_in "$store1")
  got2=$(ranks_in "$store2")
  echo "  $store1: $got1"
  echo "  $store2: $got2"
  [[ $got1 == "rank0 rank1 " ]] || fail "way $way: $host1's store directory holds: '$got1'"
  [[ $got2 == "rank2 rank3 " ]] || fail "way $way: $host2's store directory holds: '$got2'"
  if [[ $way == A ]]; then
    [[ -z $(ls -A "$MH_DIR/nodelocal") ]] ||
      fail "way A: the mount point $MH_DIR/nodelocal outside the hosts is not empty"
  fi

  check "way $way: latest in the shared folder names step-20.h5, which verifies"
  [[ $(cat "$ckpt/latest" 2> /dev/null) == step-20.h5 ]] ||
    fail "way $way: latest is '$(cat "$ckpt/latest" 2>&1)'"
  timeout 60 "$zinf_ckpt" verify "$ckpt/step-20.h5" > "$MH_DIR/verify-$way.log" 2>&1 ||
    fail "way $way: zinf-ckpt verify exited with $?"
  ls "$ckpt"/*.partial > /dev/null 2>&1 && fail "way $way: a .partial file is left in $ckpt"
done

echo "PASS: 2 hosts x 2 ranks, node-local stores by same path (A) and by {node} (B), shared checkpoint verified"
