"""The optimizer step with the Adam state on disk: the synchronous and the pipelined swapper
against the I/O engine alone (zinf-bench step), and optionally the memory run: a state of 1.5x
the machine's RAM, whose peak RSS must stay within the pool + 256 MiB.

    python3 bench/run.py step [--path DIR] [--state 4G] [--sub-group-size 16M]
                              [--state-format fp32|q8|fp32,q8] [--rounds N] [--memory-run]

fp32,q8 with --rounds 3: both state formats on the same parameters, alternating. One JSON line
per format with seconds_per_step, io_only_seconds and step_over_io (target: pipelined <= 1.10,
and pipelined faster than sync), then the memory run's line; the picture compares the step's
seconds with the engine alone, per mode and format. Needs free space under --path for the state
plus one spare sub-group (the memory run: 1.5x RAM plus one sub-group).
"""
from . import common, plot

HELP = "swapped Adam step: sync vs pipelined vs the I/O engine alone (zinf-bench step)"
NAME = "step"


def add_arguments(p):
    p.add_argument("--path", default="/tmp/zinf-bench-step-swap",
                   help="directory of the swapped state (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--state", type=common.size(lo=12), default=4 << 30,
                   help="optimizer state bytes (default 4G)")
    p.add_argument("--sub-group-size", type=common.size(unit="elements"), default=16 << 20,
                   help="elements per sub-group (default 16M)")
    p.add_argument("--state-format", type=common.one_of(("fp32", "q8"), many=True),
                   default=["fp32"], help="fp32, q8 or fp32,q8 (default fp32)")
    p.add_argument("--rounds", type=common.count(1, 1000), default=1)
    p.add_argument("--memory-run", action="store_true",
                   help="also step a state of 1.5x RAM once, pipelined, and report peak RSS")


def run(args):
    bench = common.tool("zinf-bench", args.bin)
    big = None
    if args.memory_run:
        ram = common.machine()["memory_bytes"] or 0
        big = ram * 3 // 2
        if common.free_bytes(args.path) < big + big // 8:
            raise common.UsageError(f"the memory run needs about {big + big // 8} bytes free "
                                    f"under {args.path}")
    common.make_dir(args.path)
    out = common.fresh_dir(args.out, NAME)
    (out / "logs").mkdir()
    results = common.Results(out)
    base = [bench, "step", "--path", args.path, "--sub-group-size", args.sub_group_size,
            "--json"]
    text = common.run(base + ["--state-bytes", args.state, "--steps", 3, "--state-format",
                              ",".join(args.state_format), "--rounds", args.rounds],
                      log=out / "logs" / "step.log")
    machine = common.machine()
    for record in common.json_lines(text, "zinf-bench step"):
        results.emit({"part": "step", **record, "machine": machine})
    if big is not None:
        text = common.run(base + ["--state-bytes", big, "--pipeline", "--steps", 1,
                                  "--warmup", 0], log=out / "logs" / "memory-run.log")
        for record in common.json_lines(text, "zinf-bench step (memory run)"):
            results.emit({"part": "memory-run", **record, "machine": machine})
    draw(out / f"{NAME}.png", results.where(part="step"))
    return 0


def draw(png, records):
    """Seconds per step of each mode against the engine alone, one cluster per record."""
    groups, series = [], {}
    for r in records:
        groups.append(f"{r.get('mode', '?')} {r.get('state_format', '')}".strip())
        series.setdefault("step", []).append(r.get("seconds_per_step"))
        series.setdefault("I/O alone", []).append(r.get("io_only_seconds"))
    if groups:
        plot.bars(png, groups, list(series.items()), title="zinf-bench step: seconds per step",
                  ylabel="seconds")
