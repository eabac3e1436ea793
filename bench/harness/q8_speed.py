"""q8 against fp32 on every SIMD path this CPU has, the two measurements behind the q8 speed goals:
- the kernel: zinf-bench adam, fp32 and q8 alternating (the order rotated each round), q8's
  elements/s over fp32's and q8's fraction of the STREAM triad measured in the same run;
- the step: zinf-bench step --pipeline --state-format fp32,q8 in each --path (a disk and, for
  storage faster than the kernel, a tmpfs), q8's seconds per step over fp32's, per round.

    python3 bench/run.py q8-speed [--path DIR]... [--state 4G] [--numel 64M] [--threads 2]
                                  [--rounds 3] [--simd avx512,avx2] [--triad-mib 0]
                                  [--bin build/bin/zinf-bench]

--rounds 1-99 and --threads 0-1024 (0: all cores) are integers, --state and --numel sizes,
--simd a comma-separated list of avx512, avx2 and scalar (default: the AVX paths this CPU has),
--triad-mib the MiB of each STREAM triad array (0: max(128, 4 x L3), as zinf-bench adam picks).
One JSON line per kernel pair ("bench": "q8-kernel") and per step round ("q8-step"), then one
summary per measurement, path and SIMD path (min, median and max of q8/fp32). The pictures: the
kernel's median elements/s, fp32 against q8, per SIMD path (OUT/q8-speed.png), and the step's
median seconds per SIMD path and --path (OUT/q8-speed-step.png).

Each step run works in a fresh directory under its --path (created if missing), removed
afterwards: it needs the state's bytes free there plus a sub-group. Run it with nothing else
running.
"""
import shutil
import tempfile
from pathlib import Path

from . import common, plot

HELP = "q8 vs fp32: the Adam kernel per SIMD path, and the pipelined swapped step per --path"
NAME = "q8-speed"
FORMATS = ("fp32", "q8")
SIMD_PATHS = ("avx512", "avx2", "scalar")
SUB_GROUP_BYTES = 32 * 12 << 20  # zinf-bench step's default sub-group: 32M elements of fp32 state


def add_arguments(p):
    p.add_argument("--path", action="append", default=None,
                   help="where the step's state lives; repeat for several (a disk, /dev/shm); "
                        "default /tmp")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--state", type=common.size(lo=12), default=4 << 30,
                   help="the step's fp32 optimizer state bytes (default 4G)")
    p.add_argument("--numel", type=common.size(unit="elements"), default=64 << 20,
                   help="elements per kernel step (default 64M)")
    p.add_argument("--threads", type=common.count(0, 1024), default=2,
                   help="Adam threads, 0: all cores (default %(default)s)")
    p.add_argument("--rounds", type=common.count(1, 99), default=3,
                   help="rounds (default %(default)s)")
    p.add_argument("--simd", type=common.one_of(SIMD_PATHS, many=True),
                   help="SIMD paths, such as avx512,avx2 (default: those this CPU has)")
    p.add_argument("--triad-mib", type=common.count(0, 1 << 20), default=0,
                   help="MiB per STREAM triad array of the kernel runs; 0: zinf-bench's "
                        "max(128, 4 x L3) (default %(default)s)")


def cpu_simd_paths():
    """The AVX paths of this CPU's flags, widest first (avx512 needs f, bw, vl and dq)."""
    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    break
    except OSError:
        pass
    paths = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        paths.append("avx512")
    if "avx2" in flags:
        paths.append("avx2")
    return paths


def run(args):
    paths = args.path or ["/tmp"]
    if len(set(paths)) != len(paths):
        raise common.UsageError("--path: a directory repeats")
    for p in paths:
        if Path(p).is_symlink():
            raise common.UsageError(f"--path {p} is a symbolic link; give the directory itself")
        if Path(p).exists() and not Path(p).is_dir():
            raise common.UsageError(f"--path {p} is not a directory")
    simds = args.simd or cpu_simd_paths()
    if not simds:
        raise common.UsageError("q8-speed needs AVX-512 or AVX2 (this CPU has neither); "
                                "--simd scalar measures the scalar path")
    bench = common.tool("zinf-bench", args.bin)
    need = args.state + min(args.state, SUB_GROUP_BYTES)
    for p in paths:
        if common.free_bytes(p) < need:
            raise common.UsageError(f"the step needs about {need} bytes free under {p}")
    for p in paths:
        common.make_dir(p)
    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    results = common.Results(out)
    for round_ in range(1, args.rounds + 1):
        for simd in simds:
            kernel = {}
            for fmt in common.rotate(FORMATS, round_ - 1):
                text = common.run([bench, "adam", "--numel", args.numel, "--threads",
                                   args.threads, "--simd", simd, "--state-format", fmt,
                                   "--triad-mib", args.triad_mib, "--json"],
                                  log=logs / f"adam-{simd}-{fmt}-round{round_}.log")
                kernel[fmt] = common.json_lines(text, "zinf-bench adam")[-1]
            fp32, q8 = kernel["fp32"], kernel["q8"]
            results.emit({"bench": "q8-kernel", "simd": simd, "round": round_,
                          "fp32_elements_per_s": fp32.get("elements_per_s"),
                          "q8_elements_per_s": q8.get("elements_per_s"),
                          "q8_over_fp32": common.ratio(q8.get("elements_per_s"),
                                                       fp32.get("elements_per_s")),
                          "q8_triad_fraction": q8.get("roofline_fraction"),
                          "triad_gb_per_s": q8.get("triad_gb_per_s")})
            for i, p in enumerate(paths, 1):
                log = logs / f"step-{simd}-path{i}-round{round_}.log"
                results.emit(step_round(bench, p, simd, round_, args, log))
    machine, load = common.machine(), common.load_average()
    groups = {}
    for r in results.records:
        groups.setdefault((r["bench"], r["simd"], r.get("path")), []).append(r)
    for (bench_name, simd, path), rows in groups.items():
        summary = {"summary": True, "bench": bench_name + "-summary", "simd": simd,
                   "rounds": len(rows)}
        if path is not None:
            summary["path"] = path
        for field in ("q8_over_fp32", "q8_triad_fraction"):
            values = [r[field] for r in rows if r.get(field) is not None]
            if values:
                summary[field + "_min"] = min(values)
                summary[field + "_median"] = common.median(values)
                summary[field + "_max"] = max(values)
        for field in ("fp32_elements_per_s", "q8_elements_per_s", "fp32_seconds", "q8_seconds"):
            values = [r[field] for r in rows if r.get(field) is not None]
            if values:
                summary[field + "_median"] = common.median(values)
        results.emit({**summary, "load_average": load, "machine": machine})
    summaries = results.where(summary=True)
    draw(out, summaries)
    return 0


def step_round(bench, path, simd, round_, args, log):
    """One round of the pipelined step, fp32 and q8 alternating, in a fresh directory under
    `path` (removed after); the step's log into `log`."""
    work = tempfile.mkdtemp(prefix="zinf-q8-speed.", dir=path)
    try:
        text = common.run([bench, "step", "--path", work, "--pipeline", "--state-bytes",
                           args.state, "--state-format", "fp32,q8", "--threads", args.threads,
                           "--json"], env={"ZINF_SIMD": simd}, log=log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {r.get("state_format"): r for r in common.json_lines(text, "zinf-bench step")}
    if not all(f in rows for f in FORMATS):
        raise common.RunError(f"zinf-bench step: no line for each of {', '.join(FORMATS)}")
    f, q = rows["fp32"], rows["q8"]
    return {"bench": "q8-step", "simd": simd, "path": path, "round": round_,
            "fp32_seconds": f.get("seconds_per_step"), "q8_seconds": q.get("seconds_per_step"),
            "q8_over_fp32": common.ratio(q.get("seconds_per_step"), f.get("seconds_per_step")),
            "fp32_io_only_seconds": f.get("io_only_seconds"),
            "q8_io_only_seconds": q.get("io_only_seconds")}


def draw(out, summaries):
    """fp32 against q8: the kernel's median elements/s per SIMD path (OUT/q8-speed.png), the
    step's median seconds per SIMD path and --path (OUT/q8-speed-step.png)."""
    kernel = [s for s in summaries if s["bench"] == "q8-kernel-summary"]
    plot.bars(out / f"{NAME}.png", [s["simd"] for s in kernel],
              [(f, [s.get(f"{f}_elements_per_s_median") for s in kernel]) for f in FORMATS],
              title="zinf-bench adam: median elements/s, fp32 vs q8 (higher is faster)",
              ylabel="elements/s")
    step = [s for s in summaries if s["bench"] == "q8-step-summary"]
    if step:
        plot.bars(out / f"{NAME}-step.png", [f"{s['simd']} {s['path']}" for s in step],
                  [(f, [s.get(f"{f}_seconds_median") for s in step]) for f in FORMATS],
                  title="zinf-bench step --pipeline: median seconds per step, fp32 vs q8 "
                        "(lower is faster)", ylabel="seconds")
