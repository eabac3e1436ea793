"""Training quality of the q8 optimizer state (Adam moments as 8-bit block-wise codes) against
fp32: trains the built-in charlm twice from the same seed for the same number of steps, once with
--optimizer-state fp32 and once with --optimizer-state q8, and compares the held-out losses of the
two runs.

    python3 bench/run.py q8-quality [--steps 1000] [--ranks 2] [--seed 1234] [--bin ZINF_TRAIN]

Each run is launch/zinf-run -np RANKS -- zinf-train --steps STEPS --seed SEED (1234: the
built-in default's) --optimizer-state F --nvme-path OUT/swap-F --metrics OUT/metrics-F.jsonl,
its log (stdout and stderr) in OUT/logs/F.log; OUT is made afresh for every run of the
benchmark. From them it writes, for F in fp32 and q8:
  OUT/heldout-F.tsv  "step value" lines: the held-out loss zinf-train logs every 25 steps (and
                     at the last step)
  OUT/train-F.tsv    "step value" lines: the training loss of every step (--metrics)
and OUT/q8-quality.png with both held-out curves. JSON lines: one per run ("part": "run": its
last held-out loss, the mean of its last four, its swap bytes per element), then the summary:
  {"bench": "q8_quality", "summary": true, "steps": S, "ranks": N, "seed": SEED,
   "fp32_heldout": X, "q8_heldout": Y, "ratio": Y/X, "ratio_last4": R, "within_2pct": BOOL,
   "fp32_bytes_per_element": B, "q8_bytes_per_element": B, "png": PATH, "machine": {...}}
X and Y are the held-out losses at the last step; ratio_last4 is the ratio of the means of the
last four evaluations (the last 100 steps). One evaluation moves by 2-3% from the next in both
runs, so the last point alone is noise-dominated: within_2pct judges ratio_last4 <= 1.02 (q8 at
most 2% worse; lower is better, so a q8 run that ends below fp32 passes). *_bytes_per_element is
the last step's read_bytes_per_element (swap bytes read per parameter per step; as many are
written). A run takes 20-40 s at 1000 steps on a 2-core machine.

Each run must leave a held-out loss at step STEPS and a metrics file of exactly the steps
1..STEPS, each with world_size RANKS and a finite positive loss; otherwise the benchmark fails
(exit 1). Exit 0 when both runs succeeded, whatever the ratio.
"""
import math
import os
import re
import subprocess

from . import common, plot

HELP = "charlm trained with fp32 and with q8 Adam state: held-out losses compared"
NAME = "q8-quality"
FORMATS = ("fp32", "q8")
ZINF_RUN = common.REPO / "launch" / "zinf-run"

# Rank 0's "[rank 0/N] step 25: held-out loss 3.2976" lines.
_HELDOUT = re.compile(r".*\[rank 0/[0-9]*\] step ([0-9]+): held-out loss ([-+.0-9eEnaif]*)$")


def add_arguments(p):
    p.add_argument("--bin", help="zinf-train (default build/bin/zinf-train)")
    p.add_argument("--steps", type=common.count(), default=1000,
                   help="training steps of each run (default %(default)s)")
    p.add_argument("--ranks", type=common.count(1, 1024), default=2,
                   help="ranks of each run (default %(default)s)")
    p.add_argument("--seed", type=common.count(0), default=1234,
                   help="initialization and data seed of both runs (default %(default)s)")


def run(args):
    train = common.tool("zinf-train", args.bin)
    common.need_program("mpirun", "openmpi-bin")
    launcher = ZINF_RUN
    if not (launcher.is_file() and os.access(launcher, os.X_OK)):
        raise common.UsageError(f"{launcher} is not an executable")
    # zinf-run's own checks of the rank count (ranks per core), before anything is made.
    check = subprocess.run([str(launcher), "--dry-run", "-np", str(args.ranks), "--", str(train)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           timeout=60, check=False)
    if check.returncode != 0:
        why = (check.stderr.strip().splitlines() or ["(no message)"])[0]
        raise common.UsageError(f"--ranks {args.ranks}: launch/zinf-run refuses it: {why}")
    out = common.fresh_dir(args.out, NAME).resolve()
    logs = common.make_dir(out / "logs")
    results = common.Results(out)
    machine = common.machine()
    curves, bpe = {}, {}
    for f in FORMATS:
        curves[f], bpe[f] = train_run(launcher, train, args, out, logs, f)
        last4 = curves[f][-4:]
        results.emit({"bench": "q8_quality", "part": "run", "format": f, "steps": args.steps,
                      "ranks": args.ranks, "seed": args.seed, "heldout": curves[f][-1][1],
                      "heldout_last4_mean": round(sum(v for _, v in last4) / len(last4), 6),
                      "evaluations": len(curves[f]), "bytes_per_element": bpe[f],
                      "log": logs / f"{f}.log"})
    png = out / f"{NAME}.png"
    draw(png, curves, args)
    heldout = {f: curves[f][-1][1] for f in FORMATS}
    last4 = {f: sum(v for _, v in curves[f][-4:]) / len(curves[f][-4:]) for f in FORMATS}
    ratio = heldout["q8"] / heldout["fp32"]
    ratio_last4 = last4["q8"] / last4["fp32"]
    results.emit({
        "bench": "q8_quality", "summary": True, "steps": args.steps, "ranks": args.ranks,
        "seed": args.seed, "fp32_heldout": heldout["fp32"], "q8_heldout": heldout["q8"],
        "ratio": round(ratio, 6), "ratio_last4": round(ratio_last4, 6),
        "within_2pct": ratio_last4 <= 1.02,
        "fp32_bytes_per_element": round(bpe["fp32"], 4),
        "q8_bytes_per_element": round(bpe["q8"], 4), "png": png, "machine": machine})
    return 0


def train_run(launcher, train, args, out, logs, f):
    """One training run with optimizer state `f`: writes OUT/heldout-F.tsv and OUT/train-F.tsv;
    returns the held-out curve [(step, loss), ...] and the last step's read_bytes_per_element.
    A RunError when the run fails or its output is incomplete."""
    log = logs / f"{f}.log"
    metrics = out / f"metrics-{f}.jsonl"
    swap = common.make_dir(out / f"swap-{f}")
    common.say(NAME, f"{f}: {args.steps} steps on {args.ranks} rank(s), log in {log}")
    stdout = common.run([launcher, "-np", args.ranks, "--", train, "--steps", args.steps,
                         "--seed", args.seed, "--optimizer-state", f, "--nvme-path", swap,
                         "--metrics", metrics], log=log)
    text = log.read_text(encoding="utf-8", errors="replace")
    if stdout:  # zinf-train logs on stderr; keep anything it printed on stdout with it
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(stdout)
        text += stdout
    curve = []
    for line in text.splitlines():
        m = _HELDOUT.fullmatch(line)
        if m:
            try:
                value = float(m.group(2))
            except ValueError:
                raise common.RunError(f"{f}: held-out loss '{m.group(2)}' at step "
                                      f"{m.group(1)} is not a number (log: {log})") from None
            curve.append((int(m.group(1)), value))
    (out / f"heldout-{f}.tsv").write_text("".join(f"{s} {v!r}\n" for s, v in curve),
                                          encoding="utf-8")
    last = curve[-1][0] if curve else None
    if last != args.steps:
        raise common.RunError(f"{f}: no held-out loss at step {args.steps} in {log} "
                              f"(last: '{last if last is not None else 'none'}')")
    bad = [(s, v) for s, v in curve if not math.isfinite(v)]
    if bad:
        raise common.RunError(f"{f}: held-out loss {bad[0][1]} at step {bad[0][0]} (log: {log})")
    records = common.read_metrics(metrics)
    problem = metrics_problem(records, 1, args.steps, args.ranks)
    if problem:
        raise common.RunError(f"{f}: {metrics}: {problem}")
    (out / f"train-{f}.tsv").write_text("".join(f"{r['step']} {r['loss']!r}\n" for r in records),
                                        encoding="utf-8")
    value = records[-1].get("read_bytes_per_element")
    if not _is_number(value) or not math.isfinite(value):
        raise common.RunError(f"{f}: {metrics}: no read_bytes_per_element at the last step")
    return curve, float(value)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metrics_problem(records, first, last, world):
    """None when `records` hold exactly the steps first..last in order, each with world_size
    `world` and a finite positive loss; else what is wrong."""
    steps = [r.get("step") for r in records]
    if steps != list(range(first, last + 1)) or not all(_is_number(s) for s in steps):
        shown = " ".join(str(s) for s in steps[:20]) + (" ..." if len(steps) > 20 else "")
        return f"metrics steps are not {first}..{last}: {shown}"
    for r in records:
        size = r.get("world_size")
        if not _is_number(size) or size != world:
            return f"world_size is not {world} at step {r['step']}: {size}"
    for r in records:
        loss = r.get("loss")
        if not _is_number(loss) or not math.isfinite(loss) or loss <= 0:
            return f"bad loss at step {r['step']}: {loss}"
    return None


def draw(png, curves, args):
    """The held-out loss curves of both formats."""
    plot.lines(png, [(f, curves[f]) for f in FORMATS],
               title=f"charlm, Adam state fp32 vs q8: {args.ranks} rank(s), seed {args.seed}",
               xlabel="step", ylabel="held-out loss", points=True)
