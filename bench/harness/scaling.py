"""Weak and strong scaling of zinf-train's swapped optimizer step over ranks (synthetic model,
pipelined swapper, every rank swapping to one directory, so one disk):
  weak:   a fixed state per rank (--state-per-rank): the total state grows with the ranks; ideal
          is the same step time and an aggregate swap bandwidth that grows (or, on one shared
          disk, stays at the disk's bandwidth: the target is >= 0.9x the bandwidth of the first
          rank count).
  strong: a fixed total state (--strong-total) split over the ranks; ideal is time / N.

    python3 bench/run.py scaling [--state-per-rank 512M] [--strong-total 1G] [--ranks "1 2 4"]
                                 [--steps 5] [--warmup W] [--repeat R] [--modes weak,strong]
                                 [--sub-group-size 16M] [--path DIR] [--bin zinf-train] [--force]
    python3 bench/run.py scaling --hosts "1 2 3" [--state-per-rank 256M] [--steps 5]
                                 [--warmup W] [--sub-group-size 16M] [--bin zinf-train]

--hosts: weak scaling over simulated hosts x 1 rank instead (network + UTS + mount namespaces on
this machine, each host swapping to its own node-local folder; root only): runs
tests/multihost/scaling_hosts.sh, which writes OUT/scaling_hosts.csv and its pictures (columns
hosts, ranks, total_state_bytes, step_seconds, optimizer_seconds, aggregate_swap_GBps,
efficiency_vs_1); its rows also go to results.jsonl, OUT/scaling.png and
OUT/scaling-bandwidth.png. Exit status 77 where simulated hosts cannot be made (the reason
printed). --ranks, --strong-total, --modes, --repeat, --path and --force do not apply to it.

The optimizer state is 12 bytes per parameter (fp32 weights, exp_avg, exp_avg_sq), so a run of
state S trains S / 12 parameters. Sizes take K/M/G/T suffixes (powers of 1024), from 12 bytes to
1T; rank counts are 1-1024 (--ranks "1 2 4" or 1,2,4; the first is the base of the ratios). The
first W steps (default: 2 of 5 or more steps, else 1) are warm-up and left out of the medians.
--repeat R (default 1) runs the whole series R times, round after round (each round every mode
and rank count once, so a slow drift of the machine spreads over all of them), and takes the
medians over the measured steps of all rounds: use it on a machine that is not quiet.

Memory: every rank holds the whole model's fp32 weights and gradient (data parallel), so weak
scaling grows each rank's memory with the ranks: 512M per rank on 4 ranks is a 179M-parameter
model, about 4 GiB per rank. Each run's needs are estimated first (per rank 16 bytes per
parameter for the replicated weights, gradient and MPI's buffers, 8 per parameter of its
partition, 12 swap buffers of a sub-group and 150 MiB of runtime; on disk two slots of the state
and 64 MiB per rank); a run above 90% of MemAvailable or above the free disk is refused (exit 2)
unless --force. The figures are only as quiet as the machine: other jobs on the disk or the cores
show up as noise (each summary carries the highest 1-minute load average seen before its runs).

Per run (mode, N ranks, round r): OUT/configs/MODE-npN.json, OUT/logs/MODE-npN-rR.log and
zinf-train's --metrics lines OUT/metrics/MODE-npN-rR.jsonl. The swap directory is a new
directory zinf-scaling-XXXXXX made under --path (default $TMPDIR or /tmp) and removed at the
end: nothing else under --path is written or removed.

Output: one JSON line per run, one summary per (mode, rank count) and the verdict (weak scaling's
aggregate swap bandwidth at each rank count over the first's, target >= 0.9x) on stdout and in
OUT/results.jsonl; OUT/scaling.csv (mode, ranks, total_state_bytes, state_bytes_per_rank,
step_seconds (median), optimizer_seconds (median; slowest rank), swap_gbps = (optimizer swap
read + write bytes, summed over the ranks) / optimizer_seconds (GB = 1e9), efficiency against the
first rank count n1 (weak: t1 / tN, strong: t1 / (N / n1 * tN), on step_seconds),
swap_gbps_vs_base = swap_gbps / swap_gbps of the first rank count, peak_rss_bytes (max over
ranks and steps)); OUT/scaling.png (median step time against the ranks, weak and strong) and
OUT/scaling-bandwidth.png (aggregate swap bandwidth against the ranks).

Exit status: 0 when every run succeeded (whatever the verdict), 1 when a run failed, 2 for a bad
command line or a machine without room (memory, disk) for the sizes asked.
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import common, plot

HELP = "weak and strong scaling of zinf-train over ranks (or --hosts: simulated hosts)"
NAME = "scaling"

MAX_SIZE = 1 << 40
TARGET = 0.9  # weak scaling: aggregate swap bandwidth >= 0.9x the first rank count's
MODES = ("weak", "strong")
CSV_COLUMNS = ("mode", "ranks", "total_state_bytes", "state_bytes_per_rank", "step_seconds",
               "optimizer_seconds", "swap_gbps", "efficiency", "swap_gbps_vs_base",
               "peak_rss_bytes")
HOSTS_SCRIPT = common.REPO / "tests" / "multihost" / "scaling_hosts.sh"


def modes(text):
    """An argparse type: weak, strong, or both, separated by spaces or commas."""
    return common.one_of(MODES, many=True)(",".join(w for w in re.split(r"[ ,]+", text.strip())
                                                    if w))


def add_arguments(p):
    p.add_argument("--state-per-rank", type=common.size(lo=12, hi=MAX_SIZE),
                   help="weak scaling: optimizer state bytes per rank (default 512M; with "
                        "--hosts 256M)")
    p.add_argument("--strong-total", type=common.size(lo=12, hi=MAX_SIZE),
                   help="strong scaling: total optimizer state bytes (default 1G)")
    p.add_argument("--ranks", type=common.counts(1, 1024),
                   help='rank counts, the first the base of the ratios (default "1 2 4")')
    p.add_argument("--steps", type=common.count(1, 100_000), default=5,
                   help="optimizer steps per run (default %(default)s)")
    p.add_argument("--warmup", type=common.count(0, 100_000),
                   help="warm-up steps left out of the medians (default 2 of 5 or more, else 1)")
    p.add_argument("--repeat", type=common.count(1, 1000),
                   help="rounds of the whole series; medians over all of them (default 1)")
    p.add_argument("--modes", type=modes, help="weak, strong or weak,strong (default both)")
    p.add_argument("--sub-group-size", type=common.size(hi=MAX_SIZE, unit="elements"),
                   default=16 << 20,
                   help="elements per sub-group (default 16M)")
    p.add_argument("--path",
                   help="parent of the swap directory (default $TMPDIR or /tmp)")
    p.add_argument("--bin", help="zinf-train (default build/bin/zinf-train)")
    p.add_argument("--force", action="store_true", default=None,
                   help="run even where the memory or disk estimate says there is no room")
    p.add_argument("--hosts", type=common.counts(1, 9, most=9),
                   help='weak scaling over simulated hosts instead, such as "1 2 3" (root)')


def run(args):
    if args.hosts is not None:
        return run_hosts(args)
    per_rank = args.state_per_rank or 512 << 20
    strong_total = args.strong_total or 1 << 30
    ranks = args.ranks or [1, 2, 4]
    mode_list = args.modes or list(MODES)
    repeat = args.repeat or 1
    warmup = warmup_steps(args)
    if strong_total < 12 * max(ranks) and "strong" in mode_list:
        raise common.UsageError(f"--strong-total {strong_total}: too small for {max(ranks)} "
                                "ranks (12 bytes per parameter, at least one per rank)")
    train = common.tool("zinf-train", args.bin)
    common.need_program("mpirun", "openmpi-bin")

    def params(mode, n):  # the state / 12, split evenly (the flat plan pads the last rank)
        return per_rank * n // 12 if mode == "weak" else strong_total // 12

    parent = Path(args.path or os.environ.get("TMPDIR") or "/tmp")
    check_room([(f"{m} {n} ranks", n, params(m, n)) for m in mode_list for n in ranks],
               args.sub_group_size, parent, args.force)

    out = common.fresh_dir(args.out, NAME)
    for sub in ("logs", "configs", "metrics"):
        (out / sub).mkdir()
    results = common.Results(out)
    common.make_dir(parent)
    try:
        swap_root = Path(tempfile.mkdtemp(prefix="zinf-scaling-", dir=parent)).resolve()
    except OSError as e:
        raise common.UsageError(f"cannot make a directory under {parent}: {e.strerror}") from None
    machine = common.machine()
    common.say(NAME, f"{os.cpu_count()} cores, swap under {swap_root}, output in {out}")
    runs = {}  # (mode, n) -> the one_run records of its rounds
    try:
        for rep in range(1, repeat + 1):
            for mode in mode_list:
                for n in ranks:
                    p = params(mode, n)
                    record = one_run(train, out, swap_root, mode, n, p, rep, repeat, args)
                    runs.setdefault((mode, n), []).append(record)
                    results.emit({"mode": mode, "ranks": n, "round": rep,
                                  "total_state_bytes": 12 * p,
                                  "wall_seconds": record["wall_seconds"],
                                  "load1_before": record["load1_before"],
                                  "metrics": str(record["metrics"])})
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)

    rows = []
    for mode in mode_list:
        base = None
        for n in ranks:
            p = params(mode, n)
            row = figures(mode, n, p, runs[(mode, n)], warmup)
            if base is None:
                base = row
            row["efficiency"] = efficiency(mode, n, row["step_seconds"], base["ranks"],
                                           base["step_seconds"])
            row["swap_gbps_vs_base"] = common.ratio(row["swap_gbps"], base["swap_gbps"])
            rows.append(row)
            results.emit({"summary": True, **row, "rounds": repeat, "machine": machine})
            common.say(NAME, f"{mode}, {n} rank(s): step {row['step_seconds']:.4g} s, optimizer "
                             f"{row['optimizer_seconds']:.4g} s, swap {row['swap_gbps']} GB/s "
                             f"({row['swap_gbps_vs_base']}x), efficiency {row['efficiency']}")
    write_csv(out / "scaling.csv", rows)
    if "weak" in mode_list:
        line, record = verdict([r for r in rows if r["mode"] == "weak"])
        common.say(NAME, f"verdict: {line}")
        results.emit({"summary": True, **record, "machine": machine})
    try:
        draw(out, rows, per_rank, strong_total, ranks)
    except plot.ToolError as e:  # the figures stand without their picture
        common.say(NAME, f"{e}: no picture")
    common.say(NAME, f"wrote {out / 'scaling.csv'}, {out / (NAME + '.png')}, "
                     f"{results.path}")
    return 0


def warmup_steps(args):
    warmup = args.warmup if args.warmup is not None else (2 if args.steps >= 5 else 1)
    if args.steps <= warmup:
        raise common.UsageError(f"--steps {args.steps} leaves no step after {warmup} warm-up "
                                "step(s)")
    return warmup


def mpirun_prefix(n):
    """common.mpirun on one host, with zinf-run's transports there: shared memory between the
    ranks, TCP over loopback only."""
    return common.mpirun(n, ("--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include",
                             "lo"))


def check_room(runs, sub_group, parent, force):
    """Refuses (UsageError, exit 2) a run whose estimated memory exceeds 90% of MemAvailable or
    whose disk exceeds the free space under `parent`, unless `force`. `runs`: (what, ranks,
    parameters)."""
    if force:
        return
    mem_avail = common.available_memory()
    disk_avail = common.free_bytes(parent)
    for what, n, p in runs:
        part = -(-p // n)
        sg = min(sub_group, part)
        mem = n * (16 * p + 8 * part + 12 * 4 * sg + (150 << 20))
        disk = 2 * 12 * p + n * (64 << 20)
        if mem_avail is not None and mem > mem_avail * 9 // 10:
            raise common.UsageError(f"{what}: needs about {mem >> 20} MiB of memory, "
                                    f"{mem_avail >> 20} MiB available (smaller sizes, or --force)")
        if disk > disk_avail:
            raise common.UsageError(f"{what}: needs about {disk >> 20} MiB free under {parent}, "
                                    f"{disk_avail >> 20} MiB available (smaller sizes, another "
                                    "--path, or --force)")


def config(swap_dir, sub_group, job_id, params, steps):
    """zinf-train's config of one run: buffer_count 12 is what the pipelined swapper needs (with
    fewer it steps synchronously)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 1,
            "sub_group_size": sub_group,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap_dir),
                                  "buffer_count": 12, "pipeline_read": True,
                                  "pipeline_write": True},
        },
        "zinf": {"job_id": job_id,
                 "model": {"name": "synthetic", "total_params": params, "num_params": 4},
                 "steps": steps},
    }


def one_run(train, out, swap_root, mode, n, p, rep, repeat, args):
    name = f"{mode}-np{n}"
    cfg = out / "configs" / f"{name}.json"
    metrics = out / "metrics" / f"{name}-r{rep}.jsonl"
    log = out / "logs" / f"{name}-r{rep}.log"
    swap_dir = swap_root / name
    shutil.rmtree(swap_dir, ignore_errors=True)
    swap_dir.mkdir()
    cfg.write_text(json.dumps(config(swap_dir, args.sub_group_size,
                                     f"scaling-{name}-{os.getpid()}", p, args.steps),
                              indent=2) + "\n", encoding="utf-8")
    common.say(NAME, f"round {rep}/{repeat}, {mode}, {n} rank(s): {p} parameters, state "
                     f"{12 * p >> 20} MiB ({12 * p // n >> 20} MiB per rank), {args.steps} "
                     "steps ...")
    load1 = common.load_average()
    start = time.monotonic()
    try:
        stdout = common.run(mpirun_prefix(n) + [train, "--config", cfg, "--metrics", metrics],
                            log=log)
    except common.RunError as e:
        raise common.RunError(f"{mode}, {n} rank(s) failed: {e}") from None
    wall = round(time.monotonic() - start, 2)
    if stdout:
        with open(log, "a", encoding="utf-8") as f:
            f.write(stdout)
    shutil.rmtree(swap_dir, ignore_errors=True)
    records = common.read_metrics(metrics)
    world = records[-1].get("world_size")
    if world != n:
        raise common.RunError(f"{metrics} says world_size {world!r}, expected {n}")
    common.say(NAME, f"{mode}, {n} rank(s): done in {wall:.1f} s (load before: {load1})")
    return {"metrics": metrics, "records": records, "load1_before": load1, "wall_seconds": wall}


def after(records, key, warmup):
    """The numbers under `key` of the steps after the first `warmup`."""
    return [r[key] for r in records
            if isinstance(r.get("step"), (int, float)) and r["step"] > warmup
            and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def figures(mode, n, p, runs, warmup):
    """The medians over the measured steps of every round of (mode, n ranks)."""
    name = f"{mode}-np{n}"

    def every(key, skip=warmup):
        return [v for r in runs for v in after(r["records"], key, skip)]

    measured = len(every("step_seconds"))
    if measured == 0:
        raise common.RunError(f"{name}: no step after warm-up in its metrics")
    step_s = common.median(every("step_seconds"))
    opt_s = common.median(every("optimizer_seconds"))
    read = common.median(every("optimizer_swap_read_bytes"))
    write = common.median(every("optimizer_swap_write_bytes"))
    if any(v != v for v in (opt_s, read, write)):
        raise common.RunError(f"{name}: no optimizer_seconds or optimizer_swap_{{read,write}}_bytes"
                              " in its metrics")
    rss = every("peak_rss_bytes", 0)
    gbps = round((read + write) / opt_s / 1e9, 4) if opt_s > 0 else None
    return {"mode": mode, "ranks": n, "total_state_bytes": 12 * p,
            "state_bytes_per_rank": 12 * p // n, "step_seconds": step_s,
            "optimizer_seconds": opt_s, "swap_gbps": gbps,
            "peak_rss_bytes": max(rss) if rss else None, "steps_measured": measured,
            "max_load1_before": max((r["load1_before"] for r in runs
                                     if r["load1_before"] is not None), default=None),
            "wall_seconds": round(sum(r["wall_seconds"] for r in runs), 2)}


def efficiency(mode, n, step_s, n0, step0):
    """weak: t1 / tN; strong: t1 / (N / n1 * tN)."""
    if mode == "weak":
        return common.ratio(step0, step_s)
    return common.ratio(step0, n / n0 * step_s)


def verdict(weak_rows):
    """The verdict on weak scaling: every rank count's aggregate swap bandwidth over the first's
    at least TARGET. (human line, JSON record)."""
    if len(weak_rows) < 2:
        return "only one rank count: nothing to compare", {"verdict": "n/a"}
    ratios = {r["ranks"]: r["swap_gbps_vs_base"] for r in weak_rows[1:]}
    ok = all(v is not None and v >= TARGET for v in ratios.values())
    text = ", ".join(f"{n} ranks {'?' if v is None else format(v, '.2f')}x"
                     for n, v in ratios.items())
    line = (f"weak-scaling aggregate swap bandwidth vs {weak_rows[0]['ranks']} rank(s): {text} "
            f"(target >= {TARGET}x the single-rank bandwidth on one shared disk): "
            f"{'PASS' if ok else 'FAIL'}")
    record = {"verdict": "pass" if ok else "fail", "target": TARGET,
              **{f"weak_gbps_ratio_np{n}": v for n, v in ratios.items()}}
    return line, record


def write_csv(path, rows):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow(["" if r.get(c) is None else
                        (format(r[c], ".9g") if isinstance(r[c], float) else r[c])
                        for c in CSV_COLUMNS])


def iec(nbytes):
    """512M, 1G, 1.5G: a size as numfmt --to=iec writes it, roughly."""
    for shift, unit in ((40, "T"), (30, "G"), (20, "M"), (10, "K")):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return str(nbytes)


def draw(out, rows, per_rank, strong_total, ranks):
    """OUT/scaling.png (median step time against the ranks) and OUT/scaling-bandwidth.png
    (aggregate swap bandwidth), weak and strong."""
    def series(key):
        return [(mode, [(r["ranks"], r[key]) for r in rows
                        if r["mode"] == mode and r[key] is not None]) for mode in MODES]
    what = (f"zinf-train, {os.cpu_count()} cores, one disk; weak {iec(per_rank)} per rank, "
            f"strong {iec(strong_total)} total")
    logx = len(ranks) > 1
    plot.lines(out / f"{NAME}.png", series("step_seconds"), title=f"median step time: {what}",
               xlabel="ranks", ylabel="step time, median (s)", logx=logx, points=True, width=1000)
    plot.lines(out / f"{NAME}-bandwidth.png", series("swap_gbps"),
               title=f"swap (read + write) / optimizer time: {what}", xlabel="ranks",
               ylabel="aggregate swap bandwidth (GB/s)", logx=logx, points=True, width=1000)


# --- --hosts: tests/multihost/scaling_hosts.sh -----------------------------------------------

def run_hosts(args):
    given = [flag for flag, value in (("--ranks", args.ranks), ("--strong-total",
                                       args.strong_total), ("--modes", args.modes),
                                      ("--repeat", args.repeat), ("--path", args.path),
                                      ("--force", args.force)) if value is not None]
    if given:
        raise common.UsageError(f"{', '.join(given)}: not with --hosts (weak scaling over "
                                "simulated hosts x 1 rank, each swapping to its own folder)")
    warmup = warmup_steps(args)
    train = common.tool("zinf-train", args.bin)
    common.need_program("mpirun", "openmpi-bin")
    per_rank = args.state_per_rank or 256 << 20
    out = common.fresh_dir(args.out, NAME)
    results = common.Results(out)
    cmd = ["bash", HOSTS_SCRIPT, "--hosts", " ".join(map(str, args.hosts)),
           "--state-per-rank", per_rank, "--steps", args.steps, "--warmup", warmup,
           "--sub-group-size", args.sub_group_size, "--bin", train, "--out", out]
    # Its progress, its CSV and the reason of a skip go to stderr as they come: stdout holds
    # JSON lines only.
    done = subprocess.run([str(c) for c in cmd], stdout=sys.stderr, check=False)
    if done.returncode != 0:
        return done.returncode  # 1: a run failed, 2: a bad command line, 77: no simulated hosts
    machine = common.machine()
    rows = []
    try:
        with open(out / "scaling_hosts.csv", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                rows.append({k: float(v) if "." in v else int(v) for k, v in row.items()})
    except (OSError, ValueError) as e:
        raise common.RunError(f"{out / 'scaling_hosts.csv'}: {e}") from None
    for row in rows:
        results.emit({"summary": True, "mode": "hosts", **row, "steps": args.steps,
                      "warmup": warmup, "state_bytes_per_rank": per_rank, "machine": machine})
    if not rows:
        raise common.RunError(f"{out / 'scaling_hosts.csv'}: no rows")
    try:
        draw_hosts(out, rows, per_rank)
    except plot.ToolError as e:
        common.say(NAME, f"{e}: no picture")
    return 0


def draw_hosts(out, rows, per_rank):
    what = (f"zinf-train over simulated hosts x 1 rank, {iec(per_rank)} per rank "
            f"(one machine, {os.cpu_count()} cores)")
    plot.lines(out / f"{NAME}.png", [("weak", [(r["hosts"], r["step_seconds"]) for r in rows])],
               title=f"median step time: {what}", xlabel="hosts", ylabel="step time, median (s)",
               points=True, width=1000)
    plot.lines(out / f"{NAME}-bandwidth.png",
               [("weak", [(r["hosts"], r["aggregate_swap_GBps"]) for r in rows])],
               title=f"swap bytes / optimizer time: {what}",
               xlabel="hosts", ylabel="aggregate swap bandwidth (GB/s)", points=True, width=1000)


if __name__ == "__main__":
    sys.exit("run it as: python3 bench/run.py scaling")
