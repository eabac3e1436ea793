"""zinf-bench io against fio on the same directory, file size and I/O shape (io_uring, O_DIRECT,
1 MiB blocks, queue depth 8, one job): each trial writes a fresh file and reads it back with
each tool, the order alternating (fio first in odd trials, zinf in even ones) so that slow drifts
of the disk hit both alike.

    python3 bench/run.py io-vs-fio [--path DIR] [--size 1G] [--trials 3] [--target 0.95]
                                   [--bin build/bin/zinf-bench]

--size is a multiple of 1 MiB (both tools move whole 1 MiB blocks), --trials an integer 1-1000,
--target a positive number. Both tools work in a fresh directory made under --path (created if
missing) and removed at the end: nothing else there is written or removed; it needs --size bytes
free.

One JSON line per trial and op (fio_mib_per_s, zinf_mib_per_s, ratio = zinf/fio), then one
summary line per op with the median ratio and both tools' median MiB/s; a human summary on
stderr; the picture: both tools' median MiB/s, write and read. Exit status 1 when a median ratio
is below --target (after the figures and the picture are written).
"""
import json
import math
import shutil
import tempfile
from pathlib import Path

from . import common, plot

HELP = "zinf-bench io vs fio: io_uring, O_DIRECT, 1 MiB blocks, qd 8 (median ratio vs --target)"
NAME = "io-vs-fio"
OPS = ("write", "read")
MIB = 1 << 20


def add_arguments(p):
    p.add_argument("--path", default="/tmp",
                   help="directory on the disk to measure; each run works in a fresh directory "
                        "made under it (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--size", type=common.size(lo=MIB, multiple=MIB), default=1 << 30,
                   help="bytes written and read per tool and trial, a multiple of 1M "
                        "(default 1G)")
    p.add_argument("--trials", type=common.count(1, 1000), default=3,
                   help="trials, the tools' order alternating (default %(default)s)")
    p.add_argument("--target", type=common.number(), default=0.95,
                   help="the median ratio zinf/fio each op must reach (default %(default)s)")


def run(args):
    bench = common.tool("zinf-bench", args.bin)
    fio = common.need_program("fio", "fio")
    if Path(args.path).exists() and not Path(args.path).is_dir():
        raise common.UsageError(f"--path {args.path} is not a directory")
    if common.free_bytes(args.path) < args.size:
        raise common.UsageError(f"the run needs {args.size} bytes free under {args.path}")
    common.make_dir(args.path)
    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    results = common.Results(out)
    # A hung tool must not hold the run forever: at least 1 MiB/s, plus start-up.
    timeout = 300 + args.size // MIB
    work = tempfile.mkdtemp(prefix="zinf-vs-fio.", dir=args.path)
    try:
        rows = []
        for trial in range(1, args.trials + 1):
            figures = {}
            for who in common.rotate(("fio", "zinf"), trial - 1):
                if who == "fio":
                    figures["fio"] = run_fio(fio, work, args.size, trial, logs, timeout)
                else:
                    figures["zinf"] = run_zinf(bench, work, args.size, trial, logs, timeout)
            for op in OPS:
                f, z = figures["fio"][op], figures["zinf"][op]
                rows.append(results.emit({
                    "trial": trial, "op": op, "fio_mib_per_s": round(f, 1),
                    "zinf_mib_per_s": round(z, 1), "ratio": common.ratio(z, f)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine, load = common.machine(), common.load_average()
    summaries, missed = [], []
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        med = common.median(r["ratio"] for r in mine)
        passed = not math.isnan(med) and med >= args.target
        if not passed:
            missed.append(f"{op} {med:.3f}")
        summaries.append(results.emit({
            "summary": True, "op": op, "trials": len(mine), "size_bytes": args.size,
            "median_ratio": common.finite(round(med, 3)), "target": args.target,
            "pass": passed,
            "fio_median_mib_per_s": round(common.median(r["fio_mib_per_s"] for r in mine), 1),
            "zinf_median_mib_per_s": round(common.median(r["zinf_mib_per_s"] for r in mine), 1),
            "load_average": load, "machine": machine}))
    common.say(NAME, f"zinf-bench io vs fio (io_uring, O_DIRECT, bs 1M, qd 8, size "
                     f"{args.size // MIB} MiB):")
    for s in summaries:
        ratios = ", ".join(f"{r['ratio']:.3f}" if r["ratio"] is not None else "?"
                           for r in rows if r["op"] == s["op"])
        common.say(NAME, f"  {s['op']:<5}: ratios {ratios}; median {s['median_ratio']} "
                         f"({'meets' if s['pass'] else 'below'} {args.target})")
    draw(out / f"{NAME}.png", summaries)
    if missed:
        raise common.RunError(f"median ratio zinf/fio below --target {args.target}: "
                              + ", ".join(missed))
    return 0


def run_fio(fio, work, size, trial, logs, timeout):
    """{op: MiB/s} of fio writing a fresh file in `work`, then reading it (removed after)."""
    path = Path(work) / "fio.dat"
    figures = {}
    try:
        for op in OPS:
            stem = logs / f"fio-{op}-trial{trial}"
            text = common.run([fio, "--name=zinf-vs-fio", f"--filename={path}",
                               "--ioengine=io_uring", "--direct=1", "--bs=1M", "--iodepth=8",
                               "--numjobs=1", f"--rw={op}", f"--size={size}",
                               "--output-format=json"],
                              log=stem.with_suffix(".log"), timeout=timeout)
            stem.with_suffix(".json").write_text(text, encoding="utf-8")
            figures[op] = fio_mib_per_s(text, op, stem.with_suffix(".json"))
    finally:
        path.unlink(missing_ok=True)
    return figures


def fio_mib_per_s(text, op, where):
    """MiB/s of the one job in fio's JSON output (notes before the JSON are skipped)."""
    start = text.find("{")
    try:
        job = json.JSONDecoder().raw_decode(text[start:])[0]["jobs"][0]
        value = job[op]["bw_bytes"] / MIB
        if job.get("error"):
            raise common.RunError(f"fio {op}: error {job['error']} (see {where})")
    except (ValueError, KeyError, IndexError, TypeError):
        raise common.RunError(f"fio {op}: no bandwidth in its JSON output ({where})") from None
    if not value > 0:
        raise common.RunError(f"fio {op}: moved no bytes ({where})")
    return value


def run_zinf(bench, work, size, trial, logs, timeout):
    """{op: MiB/s} of zinf-bench io writing a fresh file in `work`, then reading it."""
    text = common.run([bench, "io", "--path", work, "--size", size, "--block-size", "1M",
                       "--queue-depth", 8, "--intra-op-parallelism", 1, "--engine", "uring",
                       "--op", "both", "--json"],
                      log=logs / f"zinf-trial{trial}.log", timeout=timeout)
    figures = {r.get("op"): r.get("mib_per_s") for r in common.json_lines(text, "zinf-bench io")}
    for op in OPS:
        if not isinstance(figures.get(op), (int, float)) or not figures[op] > 0:
            raise common.RunError(f"zinf-bench io: no {op} figure in its output "
                                  f"(log: {logs / f'zinf-trial{trial}.log'})")
    return figures


def draw(png, summaries):
    """Median MiB/s of each tool, one cluster per op."""
    groups = [s["op"] for s in summaries]
    plot.bars(png, groups, [("zinf", [s["zinf_median_mib_per_s"] for s in summaries]),
                            ("fio", [s["fio_median_mib_per_s"] for s in summaries])],
              title=f"zinf-bench io vs fio (io_uring, O_DIRECT, 1 MiB blocks, qd 8): median of "
                    f"{summaries[0]['trials']} trials", ylabel="MiB/s")
