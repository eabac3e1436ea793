#!/usr/bin/env bash
# Weak scaling of zinf-train over simulated hosts (tests/multihost/lib.sh): 1, 2, 3 hosts x R
# ranks, a fixed optimizer state per rank (synthetic model, pipelined swapper), each host swapping
# to its own node-local folder and the ranks talking over TCP between hosts. Ideal: the same step
# time on every host count and an aggregate swap bandwidth that grows with the hosts. On one
# machine the "hosts" share its cores and its disk, so the figures show the overhead of the
# multi-node path (TCP collectives, per-node stores), not a cluster's scaling.
#
#   tests/multihost/scaling_hosts.sh [--hosts "1 2 3"] [--ranks-per-host 1] [--state-per-rank 256M]
#       [--steps 5] [--warmup W] [--sub-group-size 4194304] [--out DIR]
#       [--bin build/bin/zinf-train] [--mpiexec mpirun]
#
# The state is 12 bytes per parameter (fp32 weights, exp_avg, exp_avg_sq); sizes take K/M/G
# suffixes (powers of 1024). The first W steps (default 2 of 5 or more, else 1) are warm-up and
# left out of the medians. Writes DIR/scaling_hosts.csv, DIR/scaling_hosts.png (step time) and
# DIR/scaling_hosts_bandwidth.png (aggregate swap bandwidth; both drawn by bench/run.py plot when
# gnuplot is installed), per run a config, a log and the --metrics lines (default DIR:
# ./zinf-scaling-hosts-<date>), and prints the CSV.
#
# CSV columns: hosts, ranks (hosts x ranks per host), total_state_bytes, step_seconds (median),
# optimizer_seconds (median; slowest rank), aggregate_swap_GBps = (optimizer_swap_read_bytes +
# optimizer_swap_write_bytes, summed over all ranks) / optimizer_seconds (GB = 1e9),
# efficiency_vs_1 = step_seconds of the first host count / step_seconds (weak scaling).
#
# Exit status: 0 when every run succeeded, 1 when one failed, 2 for a bad command line, 77 when
# simulated hosts cannot be made here (not root, no namespaces; the reason is printed), like the
# tests of this folder. Meant to be called by `bench/run.py scaling --hosts` as well.
set -u
here=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
repo=$(cd "$here/../.." && pwd)
hosts_list="1 2 3"
ranks_per_host=1
state_per_rank=256M
steps=5
warmup=""
sub_group=4194304
out=""
bin=$repo/build/bin/zinf-train
mpiexec=mpirun

die() {
  echo "scaling_hosts: $*" >&2
  exit 2
}
usage() { sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($# > 0)); do
  case $1 in
    --hosts | --ranks-per-host | --state-per-rank | --steps | --warmup | --sub-group-size | \
      --out | --bin | --mpiexec)
      (($# >= 2)) || die "$1 needs a value"
      case $1 in
        --hosts) hosts_list=${2//,/ } ;;
        --ranks-per-host) ranks_per_host=$2 ;;
        --state-per-rank) state_per_rank=$2 ;;
        --steps) steps=$2 ;;
        --warmup) warmup=$2 ;;
        --sub-group-size) sub_group=$2 ;;
        --out) out=$2 ;;
        --bin) bin=$2 ;;
        --mpiexec) mpiexec=$2 ;;
      esac
      shift 2
      ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# The harness (mh_*), and parse_size, median, metric, metric_after (tests/testing/metrics.sh).
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$here/lib.sh"
per_rank_bytes=$(parse_size "$state_per_rank") || die "--state-per-rank '$state_per_rank': expected a size such as 256M"
((per_rank_bytes >= 12)) || die "--state-per-rank: at least 12 bytes (one parameter)"
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps '$steps': expected an integer >= 1"
[[ -n $warmup ]] || warmup=$((steps >= 5 ? 2 : 1))
if [[ ! $warmup =~ ^[0-9]+$ ]] || ((steps <= warmup)); then
  die "--warmup '$warmup' leaves no step of $steps"
fi
[[ $ranks_per_host =~ ^[1-9]$ ]] || die "--ranks-per-host '$ranks_per_host': 1..9"
[[ $sub_group =~ ^[1-9][0-9]*$ ]] || die "--sub-group-size '$sub_group': elements >= 1"
read -r -a hosts_arr <<< "$hosts_list"
((${#hosts_arr[@]} > 0)) || die "--hosts is empty"
max_hosts=0
for h in "${hosts_arr[@]}"; do
  [[ $h =~ ^[1-9]$ ]] || die "--hosts: '$h' is not 1..9"
  ((h > max_hosts)) && max_hosts=$h
done
[[ -x $bin ]] || die "$bin not found or not executable (build zinf-train, or pass --bin)"
out=${out:-$PWD/zinf-scaling-hosts-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)

mh_binaries "$bin" - "$mpiexec"
mh_init scaling-hosts "$max_hosts" "$ranks_per_host"
read -r -a all_hosts <<< "$MH_HOSTS"

csv=$out/scaling_hosts.csv
echo "hosts,ranks,total_state_bytes,step_seconds,optimizer_seconds,aggregate_swap_GBps,efficiency_vs_1" > "$csv"
echo "scaling_hosts: $(nproc) cores, node-local folders under $MH_DIR/nodes, output in $out" >&2
base_step=
for h in "${hosts_arr[@]}"; do
  n=$((h * ranks_per_host))
  p=$((per_rank_bytes * n / 12))
  name=hosts$h
  specs=()
  for ((i = 0; i < h; ++i)); do specs+=("${all_hosts[i]}:$ranks_per_host"); done
  mh_hostfile "$MH_DIR/hostfile-$name" "${specs[@]}"
  cat > "$out/$name.json" << EOF
{"train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 1, "sub_group_size": $sub_group,
                       "offload_optimizer": {"device": "nvme", "buffer_count": 12,
                                             "pipeline_read": true, "pipeline_write": true}},
 "zinf": {"job_id": "scaling-$name", "steps": $steps,
          "model": {"name": "synthetic", "total_params": $p, "num_params": 4}}}
EOF
  echo "scaling_hosts: $h host(s) x $ranks_per_host rank(s): $p parameters, state $((12 * p >> 20)) MiB, $steps steps ..." >&2
  start=$SECONDS
  rm -f "$out/$name.jsonl"
  MH_HOSTFILE=$MH_DIR/hostfile-$name mh_mpirun $((120 + 60 * steps)) -np "$n" "$zinf_train" \
    --config "$out/$name.json" --nvme-path "$MH_NVME" --metrics "$out/$name.jsonl" \
    > "$out/$name.log" 2>&1
  rc=$?
  if ((rc != 0)); then
    echo "FAIL: $h host(s): zinf-train exited with $rc; the end of $out/$name.log:" >&2
    tail -20 "$out/$name.log" >&2
    exit 1
  fi
  world=$(metric "$out/$name.jsonl" world_size | tail -1 | cut -d' ' -f2)
  [[ $world == "$n" ]] || { echo "FAIL: $name: metrics say world_size '$world', expected $n" >&2; exit 1; }
  step_s=$(metric_after "$out/$name.jsonl" step_seconds "$warmup" | median)
  opt_s=$(metric_after "$out/$name.jsonl" optimizer_seconds "$warmup" | median)
  rd=$(metric_after "$out/$name.jsonl" optimizer_swap_read_bytes "$warmup" | median)
  wr=$(metric_after "$out/$name.jsonl" optimizer_swap_write_bytes "$warmup" | median)
  [[ $rd != nan && $wr != nan ]] ||
    { echo "FAIL: $name: no optimizer_swap_{read,write}_bytes in $out/$name.jsonl" >&2; exit 1; }
  gbps=$(awk -v r="$rd" -v w="$wr" -v t="$opt_s" 'BEGIN { printf "%.4f", (r + w) / t / 1e9 }')
  [[ -n $base_step ]] || base_step=$step_s
  eff=$(awk -v t="$step_s" -v t0="$base_step" 'BEGIN { printf "%.3f", t0 / t }')
  echo "$h,$n,$((12 * p)),$step_s,$opt_s,$gbps,$eff" >> "$csv"
  echo "scaling_hosts: $h host(s): step $step_s s, optimizer $opt_s s, aggregate swap $gbps GB/s, efficiency $eff ($((SECONDS - start)) s)" >&2
done

# The pictures, by the one plotter (bench/harness/plot.py): median step time and aggregate swap
# bandwidth against the hosts.
png=$out/scaling_hosts.png
bw_png=$out/scaling_hosts_bandwidth.png
if command -v gnuplot > /dev/null; then
  awk -F, 'NR > 1 { print $1, $4 }' "$csv" > "$out/scaling_hosts_step.dat"
  awk -F, 'NR > 1 { print $1, $6 }' "$csv" > "$out/scaling_hosts_bandwidth.dat"
  what="$ranks_per_host rank(s) per host, $(numfmt --to=iec "$per_rank_bytes") per rank"
  what+="; one machine, $(nproc) cores"
  if ! { /usr/bin/python3 "$repo/bench/run.py" plot --out "$png" --xlabel hosts \
           --ylabel "step time, median (s)" --title "median step time, simulated hosts: $what" \
           --width 1000 "weak=$out/scaling_hosts_step.dat" &&
         /usr/bin/python3 "$repo/bench/run.py" plot --out "$bw_png" --xlabel hosts \
           --ylabel "aggregate swap bandwidth (GB/s)" \
           --title "swap (read + write) / optimizer time: $what" \
           --width 1000 "weak=$out/scaling_hosts_bandwidth.dat"; } > "$out/plot.log" 2>&1; then
    echo "FAIL: the plotter failed, see $out/plot.log" >&2
    exit 1
  fi
else
  echo "scaling_hosts: gnuplot not found (apt-get install gnuplot-nox): no plot" >&2
fi
cat "$csv"
echo "scaling_hosts: wrote $csv$([[ -f $png ]] && echo ", $png, $bw_png")" >&2
