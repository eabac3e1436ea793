#!/usr/bin/env bash
# Weak and strong scaling of zinf-train's swapped optimizer step over 1, 2, 4 ranks, synthetic
# model, pipelined swapper, all ranks swapping to one directory (one disk):
#   weak:   fixed state per rank (--state-per-rank): total state grows with the ranks; ideal is
#           the same step time and an aggregate swap bandwidth that grows (or, on one shared
#           disk, stays at the disk's bandwidth: the issue's target is >= 0.9x of 1 rank's).
#   strong: fixed total state (--strong-total) split over the ranks; ideal is time / N.
#
#   launch/scaling.sh [--state-per-rank 512M] [--strong-total 1G] [--ranks "1 2 4"] [--steps 5]
#                     [--warmup W] [--repeat R] [--modes "weak strong"]
#                     [--sub-group-size 16777216]
#                     [--path DIR] [--out DIR] [--bin build/bin/zinf-train] [--force]
#   launch/scaling.sh --hosts "1 2 3" [--state-per-rank 256M] [--steps 5] [--out DIR]
#
# --hosts: weak scaling over 1, 2, 3 simulated hosts x 1 rank instead (network + UTS + mount
# namespaces on this machine, each host swapping to its own node-local folder; root only):
# runs tests/multihost/scaling_hosts.sh, which writes scaling_hosts.csv and .png (columns
# hosts, ranks, total_state_bytes, step_seconds, optimizer_seconds, aggregate_swap_GBps,
# efficiency_vs_1) and exits 77 where simulated hosts cannot be made.
#
# The optimizer state is 12 bytes per parameter (fp32 weights, exp_avg, exp_avg_sq), so a run
# of state S trains S / 12 parameters. Sizes take K/M/G/T suffixes (powers of 1024), from 12
# bytes to 1T; rank counts are 1-1024; a bad value (or a flag without one) exits 2 before
# anything is made. The first W
# steps (default: 2 of 5 or more steps, else 1) are warm-up and left out of the medians.
# --repeat R (default 1) runs the whole series R times, round after round, and takes the medians
# over the measured steps of all rounds: use it on a machine that is not quiet.
#
# Memory: every rank holds the whole model's fp32 weights and gradient (data parallel), so weak
# scaling grows each rank's memory with the ranks: 512M per rank on 4 ranks is a 179M-parameter
# model, about 4 GiB per rank. The script estimates what each run needs and refuses (exit 2)
# when it exceeds 90% of MemAvailable or the free disk (--force runs anyway). The figures are
# only as quiet as the machine: other jobs on the disk or the cores show up as noise (each
# summary line carries the highest 1-minute load average seen before its runs).
#
# Per run (mode, N ranks): a config JSON, zinf-train's log and its --metrics JSON lines under
# --out (default ./zinf-scaling-<date>), which must be new, empty or made by an earlier run of
# scaling.sh (it holds .made-by-scaling.sh; any other directory is refused, exit 2); the swap
# directory is a fresh one in a new directory zinf-scaling-XXXXXX made under --path (default:
# ${TMPDIR:-/tmp}) and removed at the end: nothing else under --path is written or removed. Writes --out/scaling.csv, --out/scaling.png (gnuplot, when installed) and
# --out/summary.jsonl; prints the CSV, one "summary: {json}" line per run and per mode, and
# a verdict line on stdout; progress goes to stderr.
#
# CSV columns: mode, ranks, total_state_bytes, state_bytes_per_rank, step_seconds (median),
# optimizer_seconds (median; slowest rank), swap_gbps = (optimizer_swap_read_bytes +
# optimizer_swap_write_bytes) / optimizer_seconds (bytes summed over the ranks, GB = 1e9),
# efficiency vs the first rank count (weak: t1 / tN, strong: t1 / (N / n1 * tN), both on
# step_seconds), swap_gbps_vs_base = swap_gbps / swap_gbps of the first rank count,
# peak_rss_bytes (max over ranks and steps).
#
# Exit status: 0 when every run succeeded (whatever the verdict), 1 when a run failed, 2 for a
# bad command line or a machine without room (memory, disk) for the sizes asked.
set -euo pipefail

repo=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd)
# metric_after, median; and (lib/args.sh) need_value, check_count, check_size.
# shellcheck source=lib/metrics.sh
source "$repo/launch/lib/metrics.sh"
# claim_dir.
# shellcheck source=lib/outdir.sh
source "$repo/launch/lib/outdir.sh"
state_per_rank=512M
strong_total=1G
ranks="1 2 4"
steps=5
warmup=""
repeat=1
modes="weak strong"
sub_group=16777216
path=""
out=""
bin=$repo/build/bin/zinf-train
force=0
hosts_list=""

# shellcheck disable=SC2034  # read by lib/args.sh's messages
args_script="scaling"
die() { usage_die "$@"; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($# > 0)); do
  case $1 in
    --state-per-rank | --strong-total | --ranks | --steps | --warmup | --repeat | --modes | \
      --sub-group-size | --path | --out | --bin)
      need_value "$@"
      case $1 in
        --state-per-rank) state_per_rank=$2 ;;
        --strong-total) strong_total=$2 ;;
        --ranks) ranks=$2 ;;
        --steps) steps=$2 ;;
        --warmup) warmup=$2 ;;
        --repeat) repeat=$2 ;;
        --modes) modes=$2 ;;
        --sub-group-size) sub_group=$2 ;;
        --path) path=$2 ;;
        --out) out=$2 ;;
        --bin) bin=$2 ;;
      esac
      shift 2
      ;;
    --hosts)
      # Weak scaling over simulated hosts (needs root and namespaces; exit 77 otherwise):
      # tests/multihost/scaling_hosts.sh with this script's sizes.
      if (($# < 2)) || [[ $2 == --* ]]; then die "--hosts needs a list such as \"1 2 3\""; fi
      hosts_list=$2
      shift 2
      ;;
    --force) force=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

if [[ -n ${hosts_list:-} ]]; then
  host_args=(--hosts "$hosts_list" --state-per-rank "$state_per_rank" --steps "$steps"
             --sub-group-size "$sub_group" --bin "$bin")
  [[ -n $warmup ]] && host_args+=(--warmup "$warmup")
  [[ -n $out ]] && host_args+=(--out "$out")
  exec bash "$repo/tests/multihost/scaling_hosts.sh" "${host_args[@]}"
fi
# Sizes up to 1 TiB and up to 1024 ranks: the memory estimate below (bytes x ranks x 16) stays
# inside bash's 64-bit arithmetic.
per_rank_bytes=$(check_size --state-per-rank "$state_per_rank" 12 "$((1 << 40))") || exit 2
strong_bytes=$(check_size --strong-total "$strong_total" 12 "$((1 << 40))") || exit 2
check_count --steps "$steps" 1 100000
[[ -n $warmup ]] || warmup=$((steps >= 5 ? 2 : 1))
check_count --warmup "$warmup" 0 100000
check_count --repeat "$repeat" 1 1000
((steps > warmup)) || die "--steps $steps leaves no step after $warmup warm-up step(s)"
check_count --sub-group-size "$sub_group" 1 "$((1 << 40))"
read -r -a rank_list <<< "$ranks"
((${#rank_list[@]} > 0)) || die "--ranks is empty"
for n in "${rank_list[@]}"; do check_count --ranks "$n" 1 1024; done
read -r -a mode_list <<< "$modes"
for m in "${mode_list[@]}"; do [[ $m == weak || $m == strong ]] || die "--modes: '$m' is not weak or strong"; done
((per_rank_bytes >= 12 && strong_bytes >= 12 * ${rank_list[-1]})) || die "sizes too small (12 bytes per parameter)"

[[ -x $bin ]] || die "$bin not found or not executable: build it first (cmake --preset default && cmake --build --preset default --target zinf-train), or pass --bin"
zinf_run=$repo/launch/zinf-run
[[ -x $zinf_run ]] || die "$zinf_run not found"
command -v mpirun > /dev/null || die "mpirun not found: apt-get install openmpi-bin"

# Parameters of a run: the state / 12, split evenly (zinf's flat plan pads the last rank).
run_params() {  # run_params MODE N
  if [[ $1 == weak ]]; then echo $((per_rank_bytes * $2 / 12)); else echo $((strong_bytes / 12)); fi
}

# Room: per rank, the replicated fp32 weights and gradient (8 bytes per parameter) plus MPI's
# reduce-scatter/all-gather buffers (measured: up to ~8 more; 16 is counted), the partition and
# its gradient (8 bytes per parameter / N) and 12 swap buffers of a sub-group (4 bytes per
# element), plus ~150 MiB of runtime; on disk, 2 slots of the state per rank.
mem_avail=$(($(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) * 1024))
probe=${path:-${TMPDIR:-/tmp}}
while [[ ! -d $probe ]]; do probe=$(dirname -- "$probe"); done
disk_avail=$(($(df --output=avail -k "$probe" | tail -1) * 1024))
for mode in "${mode_list[@]}"; do
  for n in "${rank_list[@]}"; do
    p=$(run_params "$mode" "$n")
    part=$(((p + n - 1) / n))
    sg=$((sub_group < part ? sub_group : part))
    mem=$((n * (16 * p + 8 * part + 12 * 4 * sg + (150 << 20))))
    disk=$((2 * 12 * p + n * (64 << 20)))
    if ((mem > mem_avail * 9 / 10 && !force)); then
      die "$mode $n ranks: needs about $((mem >> 20)) MiB of memory, $((mem_avail >> 20)) MiB available (smaller sizes, or --force)"
    fi
    if ((disk > disk_avail && !force)); then
      die "$mode $n ranks: needs about $((disk >> 20)) MiB free in $probe, $((disk_avail >> 20)) MiB available"
    fi
  done
done

out=${out:-$PWD/zinf-scaling-$(date +%Y%m%d-%H%M%S)}
claim_dir "$out" scaling.sh || exit 2
mkdir -p "$out/logs" "$out/configs" "$out/metrics"
out=$(cd "$out" && pwd)
parent=${path:-${TMPDIR:-/tmp}}
mkdir -p "$parent"
path=$(mktemp -d "$parent/zinf-scaling-XXXXXX")
path=$(cd "$path" && pwd)
cleanup() {
  rm -rf "$path"
  return 0
}
trap cleanup EXIT

csv=$out/scaling.csv
summary=$out/summary.jsonl
echo "mode,ranks,total_state_bytes,state_bytes_per_rank,step_seconds,optimizer_seconds,swap_gbps,efficiency,swap_gbps_vs_base,peak_rss_bytes" > "$csv"
: > "$summary"
echo "scaling: $(nproc) cores, swap under $path ($(df --output=source "$path" | tail -1)), output in $out" >&2

# 1. The runs. Round r runs every (mode, ranks) once, so a slow drift of the machine spreads over
#    all of them instead of landing on one.
for ((rep = 1; rep <= repeat; ++rep)); do
  for mode in "${mode_list[@]}"; do
    for n in "${rank_list[@]}"; do
      p=$(run_params "$mode" "$n")
      name=$mode-np$n
      cfg=$out/configs/$name.json
      metrics=$out/metrics/$name-r$rep.jsonl
      log=$out/logs/$name-r$rep.log
      swap_dir=$path/$name
      rm -rf "$swap_dir" "$metrics"
      mkdir -p "$swap_dir"
      # buffer_count 12: what the pipelined swapper needs (with fewer it steps synchronously).
      cat > "$cfg" << EOF
{
  "train_micro_batch_size_per_gpu": 1,
  "zero_optimization": {
    "stage": 1,
    "sub_group_size": $sub_group,
    "offload_optimizer": {"device": "nvme", "nvme_path": "$swap_dir", "buffer_count": 12,
                          "pipeline_read": true, "pipeline_write": true}
  },
  "zinf": {
    "job_id": "scaling-$name-$$",
    "model": {"name": "synthetic", "total_params": $p, "num_params": 4},
    "steps": $steps
  }
}
EOF
      echo "scaling: round $rep/$repeat, $mode, $n rank(s): $p parameters, state $((12 * p >> 20)) MiB ($((12 * p / n >> 20)) MiB per rank), $steps steps ..." >&2
      load1=$(cut -d' ' -f1 /proc/loadavg)
      echo "$load1" >> "$out/metrics/$name.load1"
      start=$SECONDS
      if ! "$zinf_run" -np "$n" -- "$bin" --config "$cfg" --metrics "$metrics" > "$log" 2>&1; then
        echo "scaling: $mode, $n rank(s) failed; the end of $log:" >&2
        tail -20 "$log" >&2
        exit 1
      fi
      rm -rf "$swap_dir"
      world=$(metric_after "$metrics" world_size 0 | tail -1)
      [[ $world == "$n" ]] || { echo "scaling: $metrics says world_size '$world', expected $n" >&2; exit 1; }
      echo "$((SECONDS - start))" >> "$out/metrics/$name.wall"
      echo "scaling: $mode, $n rank(s): done in $((SECONDS - start)) s (load before: $load1)" >&2
    done
  done
done

# 2. The figures: medians over the measured steps of every round.
for mode in "${mode_list[@]}"; do
  base_n="" base_step="" base_gbps=""
  for n in "${rank_list[@]}"; do
    p=$(run_params "$mode" "$n")
    name=$mode-np$n
    all() {  # all KEY WARMUP: the values of KEY over the rounds
      local r
      for ((r = 1; r <= repeat; ++r)); do metric_after "$out/metrics/$name-r$r.jsonl" "$1" "$2"; done
    }
    measured=$(all step_seconds "$warmup" | wc -l)
    ((measured > 0)) || { echo "scaling: $name: no step after warm-up in $out/metrics" >&2; exit 1; }
    step_s=$(all step_seconds "$warmup" | median)
    opt_s=$(all optimizer_seconds "$warmup" | median)
    rd=$(all optimizer_swap_read_bytes "$warmup" | median)
    wr=$(all optimizer_swap_write_bytes "$warmup" | median)
    [[ $rd != nan && $wr != nan ]] ||
      { echo "scaling: $name: no optimizer_swap_{read,write}_bytes in $out/metrics" >&2; exit 1; }
    rss=$(all peak_rss_bytes 0 | sort -g | tail -1)
    load1=$(sort -g "$out/metrics/$name.load1" | tail -1)
    wall=$(awk '{s += $1} END {print s}' "$out/metrics/$name.wall")
    gbps=$(awk -v r="$rd" -v w="$wr" -v t="$opt_s" 'BEGIN {printf "%.4f", (r + w) / t / 1e9}')
    if [[ -z $base_n ]]; then
      base_n=$n base_step=$step_s base_gbps=$gbps
    fi
    eff=$(awk -v mode="$mode" -v n="$n" -v n0="$base_n" -v t="$step_s" -v t0="$base_step" \
      'BEGIN {printf "%.3f", mode == "weak" ? t0 / t : t0 / (n / n0 * t)}')
    bw_rel=$(awk -v g="$gbps" -v g0="$base_gbps" 'BEGIN {printf "%.3f", g / g0}')
    echo "$mode,$n,$((12 * p)),$((12 * p / n)),$step_s,$opt_s,$gbps,$eff,$bw_rel,$rss" >> "$csv"
    echo "{\"mode\":\"$mode\",\"ranks\":$n,\"total_state_bytes\":$((12 * p)),\"state_bytes_per_rank\":$((12 * p / n)),\"step_seconds\":$step_s,\"optimizer_seconds\":$opt_s,\"swap_gbps\":$gbps,\"efficiency\":$eff,\"swap_gbps_vs_base\":$bw_rel,\"peak_rss_bytes\":$rss,\"steps_measured\":$measured,\"rounds\":$repeat,\"max_load1_before\":$load1,\"wall_seconds\":$wall}" >> "$summary"
    echo "scaling: $mode, $n rank(s): step ${step_s} s, optimizer ${opt_s} s, swap ${gbps} GB/s (${bw_rel}x), efficiency ${eff}" >&2
  done
done

# Plot: step time and aggregate swap bandwidth against the ranks, weak and strong.
png=$out/scaling.png
if command -v gnuplot > /dev/null; then
  for mode in weak strong; do
    awk -F, -v m="$mode" 'NR > 1 && $1 == m {print $2, $5, $7}' "$csv" > "$out/$mode.dat"
  done
  plot_line() {  # plot_line COLUMN: the weak and strong series that have data
    local col=$1 sep=""
    for mode in weak strong; do
      if [[ -s $out/$mode.dat ]]; then
        printf '%s"%s" using 1:%s with linespoints lw 2 pt 7 title "%s"' "$sep" "$out/$mode.dat" "$col" "$mode"
        sep=", "
      fi
    done
  }
  if ! gnuplot > "$out/gnuplot.log" 2>&1 << EOF; then
set terminal pngcairo size 1200,500 font ",11"
set output "$png"
set multiplot layout 1,2 title "zinf-train synthetic, pipelined swapper, one swap disk ($(nproc) cores; weak $(numfmt --to=iec "$per_rank_bytes") per rank, strong $(numfmt --to=iec "$strong_bytes") total)"
set logscale x 2
set xtics (${ranks// /,})
set xrange [${rank_list[0]} * 0.8 : ${rank_list[-1]} * 1.25]
set xlabel "ranks"
set grid
set key top left
set yrange [0:*]
set ylabel "step time, median (s)"
set title "step time"
plot $(plot_line 2)
set ylabel "aggregate swap bandwidth (GB/s)"
set title "(swap read + write bytes) / optimizer time"
set key bottom right
plot $(plot_line 3)
unset multiplot
EOF
    echo "scaling: gnuplot failed, see $out/gnuplot.log" >&2
  fi
else
  echo "scaling: gnuplot not found (apt-get install gnuplot-nox): no plot" >&2
fi

cat "$csv"
sed 's/^/summary: /' "$summary"

# Verdict: weak-scaling aggregate swap bandwidth at each rank count against the first one.
if [[ " ${mode_list[*]} " == *" weak "* ]]; then
  verdict=$(awk -F, -v target=0.9 '
    NR > 1 && $1 == "weak" { n[++k] = $2; r[k] = $9 }
    END {
      line = ""; json = ""; ok = 1
      for (i = 2; i <= k; ++i) {
        line = line sprintf("%s%s ranks %.2fx", i > 2 ? ", " : "", n[i], r[i])
        json = json sprintf(",\"weak_gbps_ratio_np%s\":%s", n[i], r[i])
        if (r[i] + 0 < target) ok = 0
      }
      if (k < 2) { print "only one rank count: nothing to compare\t{\"verdict\":\"n/a\"}"; exit }
      printf "weak-scaling aggregate swap bandwidth vs %s rank(s): %s (target >= %.1fx the single-rank bandwidth on one shared disk): %s\t{\"verdict\":\"%s\"%s}\n",
        n[1], line, target, ok ? "PASS" : "FAIL", ok ? "pass" : "fail", json
    }' "$csv")
  echo "verdict: ${verdict%%$'\t'*}"
  echo "${verdict#*$'\t'}" >> "$summary"
  echo "summary: ${verdict#*$'\t'}"
fi
[[ -f $png ]] && echo "scaling: wrote $csv, $png, $summary" >&2 || echo "scaling: wrote $csv, $summary" >&2
