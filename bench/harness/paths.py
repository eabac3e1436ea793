"""Two swap paths of unequal speed: does striping weighted by bandwidth add them up?
(zinf.nvme_path_weights, DESIGN.md "Swap store").

    python3 bench/run.py paths [--fast /dev/shm] [--slow /var/tmp] [--state 2G] [--size 1G]
                               [--sub-group-size 16M] [--rounds 3] [--mode pipeline|sync]
                               [--weightings equal,given,probe] [--bin build/bin/zinf-bench]
                               [--target 0.85]

In one run, after a calibration round 0 (each path alone, so that "given" has figures in every
order), for --rounds rounds, in an order rotated every round:
  alone fast, alone slow  zinf-bench io on each path by itself (write, then read, --size bytes);
  equal                   zinf-bench step striped over both paths with equal shares (the default);
  given                   the same with the path weights set to the ratio of the latest alone
                          figures (MiB/s read + written of each path);
  probe                   the same with the weights "probe" (the store measures at open).
Every run uses block size 1M and queue depth 16; a step is 1 warm-up and 2 timed steps.

One JSON line per measurement, then one summary line per weighting with the median over rounds
of the step's I/O throughput (bytes read + written per step / step time) over the sum of the two
paths alone (each path's latest alone figure: bytes read + written / time), and of the engine-alone
pass through the striped store (io_only) over that sum; a human summary on stderr. OUT/paths.png
shows the median MiB/s of each path alone, their sum, and the striped store under each weighting
(the step and the engine alone through it).

--fast and --slow are directories in which the run makes (and removes) one fresh directory each;
both must take O_DIRECT (tmpfs does since Linux 6.6). Needs free space for --state on each path
(and --size). Exit status: 0 when the given weights reach --target (or "given" is not run), 1 when
not (or a run failed), 2 on usage or tool errors.
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import common, plot

HELP = "two swap paths of unequal speed: each alone, then striped with equal/given/probed weights"
NAME = "paths"

WEIGHTINGS = ("equal", "given", "probe")
BLOCK_SIZE = "1M"
QUEUE_DEPTH = 16
MIB = 1048576


def add_arguments(p):
    p.add_argument("--fast", default="/dev/shm", help="directory on the fast path "
                   "(default %(default)s)")
    p.add_argument("--slow", default="/var/tmp", help="directory on the slow path "
                   "(default %(default)s)")
    p.add_argument("--state", type=common.size(lo=12), default=2 << 30,
                   help="optimizer state bytes of the striped step (default 2G)")
    p.add_argument("--size", type=common.size(), default=1 << 30,
                   help="bytes zinf-bench io writes and reads on each path alone (default 1G)")
    p.add_argument("--sub-group-size", type=common.size(unit="elements"), default=16 << 20,
                   help="elements per sub-group of the step (default 16M)")
    p.add_argument("--rounds", type=common.count(1, 1000), default=3)
    p.add_argument("--mode", type=common.one_of(("pipeline", "sync")), default="pipeline",
                   help="the step's swapper: pipeline or sync (default pipeline)")
    p.add_argument("--weightings", type=common.one_of(WEIGHTINGS, many=True),
                   default=list(WEIGHTINGS),
                   help="which striped steps to run: equal, given, probe (default all three)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--target", type=common.number(), default=0.85,
                   help="the smallest median step / sum alone that passes with the given "
                        "weights (default 0.85)")


def positive(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise common.RunError(f"{what}: expected a positive number, got {value!r}")
    return float(value)


def run(args):
    # The flags (argparse), then the tools and directories: a bad command line exits 2 before
    # anything is made or run.
    bench = common.tool("zinf-bench", args.bin)
    common.need_program("gnuplot", "gnuplot-nox")
    for flag, directory in (("--fast", args.fast), ("--slow", args.slow)):
        if not os.path.isdir(directory):
            raise common.UsageError(f"{flag} {directory} is not a directory")
    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    # The runs' files live in directories made for this run (removed at the end): nothing else
    # in --fast or --slow is written or removed.
    made = []
    try:
        for label, parent in (("fast", args.fast), ("slow", args.slow)):
            try:
                made.append(Path(tempfile.mkdtemp(prefix="zinf-bench-paths.", dir=parent)))
            except OSError as e:
                raise common.UsageError(f"cannot make a directory in {parent} (--{label}): "
                                        f"{e.strerror}") from None
        results = common.Results(out)
        Bench(args, bench, logs, results, dict(zip(("fast", "slow"), made))).rounds()
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
    return summarize(args, out, results)


class Bench:
    def __init__(self, args, bench, logs, results, dirs):
        self.args, self.bench, self.logs, self.results, self.dirs = args, bench, logs, results, dirs
        self.alone_mib = {}  # path label -> MiB/s of its latest alone run (read + written)

    def rounds(self):
        # Calibration (round 0): the first figures for "given", so that every rotation has them.
        self.alone("fast", 0)
        self.alone("slow", 0)
        items = [("alone", "fast"), ("alone", "slow")] + \
            [("step", w) for w in self.args.weightings]
        for r in range(1, self.args.rounds + 1):
            for kind, what in common.rotate(items, r - 1):
                if kind == "step":
                    self.step(what, r)
                else:
                    self.alone(what, r)

    def logged(self, name, cmd):
        """cmd's stdout kept in logs/NAME.json, its stderr in logs/NAME.log."""
        text = common.run(cmd, log=self.logs / f"{name}.log")
        (self.logs / f"{name}.json").write_text(text, encoding="utf-8")
        return common.json_lines(text, f"zinf-bench ({self.logs / f'{name}.json'})")

    def alone(self, label, round_):
        """zinf-bench io on one path by itself: one JSON line."""
        name = f"r{round_}-alone-{label}"
        ops = {o.get("op"): o for o in self.logged(name, [
            self.bench, "io", "--path", self.dirs[label], "--size", self.args.size,
            "--block-size", BLOCK_SIZE, "--queue-depth", QUEUE_DEPTH, "--engine", "auto",
            "--op", "both", "--json"])}
        if "write" not in ops or "read" not in ops:
            raise common.RunError(f"zinf-bench io ({name}): no write and read lines")
        w, r = ops["write"], ops["read"]
        # Read and written, as a step does: the same bytes both ways over the time of both.
        seconds = positive(w.get("seconds"), f"{name} write seconds") + \
            positive(r.get("seconds"), f"{name} read seconds")
        both = (positive(w.get("size_bytes"), f"{name} write size_bytes")
                + positive(r.get("size_bytes"), f"{name} read size_bytes")) / MIB / seconds
        record = self.results.emit({
            "bench": "paths", "round": round_, "run": "alone", "path": label,
            "dir": str(self.dirs[label]), "write_mib_per_s": round(w["mib_per_s"], 1),
            "read_mib_per_s": round(r["mib_per_s"], 1), "mib_per_s": round(both, 1)})
        self.alone_mib[label] = record["mib_per_s"]

    def step(self, weighting, round_):
        """zinf-bench step striped over both paths: one JSON line."""
        name = f"r{round_}-step-{weighting}"
        weights = {"equal": [], "probe": ["--path-weights", "probe"],
                   "given": ["--path-weights",
                             f"{self.alone_mib['fast']},{self.alone_mib['slow']}"]}[weighting]
        o = self.logged(name, [
            self.bench, "step", "--path", f"{self.dirs['fast']},{self.dirs['slow']}", *weights,
            "--state-bytes", self.args.state, "--sub-group-size", self.args.sub_group_size,
            f"--{self.args.mode}", "--steps", 2, "--warmup", 1, "--block-size", BLOCK_SIZE,
            "--queue-depth", QUEUE_DEPTH, "--json"])[-1]
        try:
            moved = (o["read_bytes"] + o["write_bytes"]) / MIB
            mode, path_weights = o["mode"], o["path_weights"]
        except (KeyError, TypeError):
            raise common.RunError(f"zinf-bench step ({name}): a line without read_bytes, "
                                  "write_bytes, mode or path_weights") from None
        alone_sum = self.alone_mib["fast"] + self.alone_mib["slow"]
        step_mib = moved / positive(o.get("seconds_per_step"), f"{name} seconds_per_step")
        io_mib = moved / positive(o.get("io_only_seconds"), f"{name} io_only_seconds")
        positive(alone_sum, "the sum of the paths alone (MiB/s)")
        self.results.emit({
            "bench": "paths", "round": round_, "run": "step", "weights": weighting,
            "mode": mode, "path_weights": path_weights,
            "seconds_per_step": round(o["seconds_per_step"], 4),
            "step_mib_per_s": round(step_mib, 1), "io_only_mib_per_s": round(io_mib, 1),
            "alone_sum_mib_per_s": round(alone_sum, 1),
            "step_over_alone_sum": round(step_mib / alone_sum, 3),
            "io_only_over_alone_sum": round(io_mib / alone_sum, 3)})


def summarize(args, out, results):
    rows = list(results.records)  # the measurements: the summaries join results.records below
    steps = [r for r in rows if r["run"] == "step"]
    state = common.size_text(args.state)
    machine = common.machine()
    passed = True
    human, summaries = [], []
    for weighting in WEIGHTINGS:
        mine = [r for r in steps if r["weights"] == weighting]
        if not mine:
            continue
        step_ratio = common.median(r["step_over_alone_sum"] for r in mine)
        io_ratio = common.median(r["io_only_over_alone_sum"] for r in mine)
        summary = {"summary": True, "weights": weighting, "rounds": len(mine), "mode": args.mode,
                   "state": state, "path_weights": mine[-1]["path_weights"],
                   "median_step_over_alone_sum": round(step_ratio, 3),
                   "median_io_only_over_alone_sum": round(io_ratio, 3), "target": args.target}
        if weighting == "given":
            summary["pass"] = step_ratio >= args.target
            passed = summary["pass"]
        summaries.append(results.emit({**summary, "machine": machine}))
        human.append("%-5s weights %-8s step %.3f, engine through the store %.3f of the sum alone"
                     % (weighting, ":".join(map(str, mine[-1]["path_weights"])), step_ratio,
                        io_ratio))
    alone = [r for r in rows if r["run"] == "alone" and r["round"] > 0]
    for label in ("fast", "slow"):
        mib = [r["mib_per_s"] for r in alone if r["path"] == label]
        if mib:
            human.append("%s alone: median %.0f MiB/s read + written" %
                         (label, common.median(mib)))
    draw(out / f"{NAME}.png", args, rows)
    print("bench paths (%s step, state %s; target for given weights: %.2f):" %
          (args.mode, state, args.target), file=sys.stderr)
    for h in human:
        print("  " + h, file=sys.stderr)
    return 0 if passed else 1


def draw(png, args, rows):
    """Median MiB/s (read + written) of each path alone and their sum, then of the striped store
    under each weighting: the step, and the engine alone through the store."""
    alone = {label: common.median(r["mib_per_s"] for r in rows if r["run"] == "alone"
                                  and r["round"] > 0 and r["path"] == label)
             for label in ("fast", "slow")}
    groups = ["fast alone", "slow alone", "sum alone"]
    step = [None, None, None]
    engine = [alone["fast"], alone["slow"], alone["fast"] + alone["slow"]]
    for weighting in args.weightings:
        mine = [r for r in rows if r["run"] == "step" and r["weights"] == weighting]
        weights = ":".join(f"{w:g}" if isinstance(w, (int, float)) else str(w)
                           for w in mine[-1]["path_weights"])
        groups.append(f"{weighting} {weights}")
        step.append(common.median(r["step_mib_per_s"] for r in mine))
        engine.append(common.median(r["io_only_mib_per_s"] for r in mine))
    plot.bars(png, groups, [("step", step), ("I/O engine", engine)],
              title=f"two paths striped: {args.mode} step, state {common.size_text(args.state)}, "
                    f"{args.rounds} rounds (weights fast:slow)",
              ylabel="MiB/s read + written (median)", width=1000)
