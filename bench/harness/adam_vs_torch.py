"""zinf's fused CPU Adam (zinf-bench adam) against torch.optim.Adam on the same number of
elements and threads.

    python3 bench/run.py adam-vs-torch [--numel 64M] [--threads 2] [--steps 5] [--bin PATH]
                                       [--python /usr/bin/python3] [--triad-mib 0]

Prints JSON lines: the `zinf-bench adam --json` object, the torch object (torch's default Adam
implementation of its version, foreach/fused left at their defaults; exp_avg and exp_avg_sq
allocated by one untimed step), then the summary {"summary": "adam-vs-torch", "speedup":
torch_seconds / zinf_seconds, ...}. Both sides report their best step time of --steps (zinf-bench
after one warm-up step) and gb_per_s counts 28 bytes per element for both. The picture,
OUT/adam-vs-torch.png, sets the best and the mean milliseconds per step side by side.

--numel is an element count up to 2^30 (K, M, G are powers of 1024: 64M = 67108864). torch runs
in --python (default /usr/bin/python3, Debian's python3-torch, not a pyenv/venv python3 on PATH)
as a separate process; a python that cannot import torch is a missing tool (exit 2, before
anything is made or run). --triad-mib is passed to zinf-bench adam: the MiB of each array of its
STREAM triad (its roofline), 0 = its default max(128, 4 x L3); the triad is not part of the
comparison, a small one only shortens the run.
"""
from . import common, plot

HELP = "zinf's fused CPU Adam against torch.optim.Adam, same elements and threads"
NAME = "adam-vs-torch"
WORKER = common.REPO / "bench" / "harness" / "workers" / "adam_torch.py"


def add_arguments(p):
    p.add_argument("--numel", type=common.size(1, 1 << 30, unit="elements"), default=64 << 20,
                   help="elements per step, up to 2^30 (default 64M = 67108864)")
    p.add_argument("--threads", type=common.count(1, 1024), default=2,
                   help="threads of both (default 2)")
    p.add_argument("--steps", type=common.count(1, 100000), default=5,
                   help="timed steps of each; the best counts (default 5)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--python", default=str(common.PYTHON),
                   help="the python that runs torch (default %(default)s)")
    p.add_argument("--triad-mib", type=common.count(0, 1 << 20), default=0,
                   help="zinf-bench adam --triad-mib: MiB per STREAM triad array, 0 = its "
                        "default (default 0)")


def run(args):
    bench = common.tool("zinf-bench", args.bin)
    common.need_program("gnuplot", "gnuplot-nox")
    python = common.torch_python(args.python)
    out = common.fresh_dir(args.out, NAME)
    (out / "logs").mkdir()
    results = common.Results(out)
    text = common.run([bench, "adam", "--numel", args.numel, "--threads", args.threads,
                       "--steps", args.steps, "--triad-mib", args.triad_mib, "--json"],
                      log=out / "logs" / "zinf-bench-adam.log")
    zinf = results.emit(common.json_lines(text, "zinf-bench adam")[-1])
    text = common.run([python, WORKER, args.numel, args.threads, args.steps],
                      log=out / "logs" / "torch-adam.log")
    torch_rec = results.emit(common.json_lines(text, "torch Adam")[-1])
    try:
        zinf_s, torch_s = float(zinf["seconds"]), float(torch_rec["seconds"])
    except (KeyError, TypeError, ValueError):
        raise common.RunError("no \"seconds\" in the JSON of zinf-bench adam or torch") from None
    results.emit({"summary": NAME, "speedup": common.ratio(torch_s, zinf_s),
                  "zinf_seconds": zinf_s, "torch_seconds": torch_s, "numel": args.numel,
                  "threads": args.threads, "steps": args.steps,
                  "torch_version": torch_rec.get("torch_version"),
                  "simd": zinf.get("simd"), "machine": common.machine()})
    draw(out / f"{NAME}.png", zinf, torch_rec, args)
    return 0


def draw(png, zinf, torch_rec, args):
    """Best and mean milliseconds per step, zinf beside torch."""
    def ms(rec, key):
        value = rec.get(key)
        return None if value is None else 1e3 * float(value)
    plot.bars(png, ["best step", "mean step"],
              [(f"zinf ({zinf.get('simd', '?')})",
                [ms(zinf, "seconds"), ms(zinf, "seconds_mean")]),
               (f"torch {torch_rec.get('torch_version', '')}".strip(),
                [ms(torch_rec, "seconds"), ms(torch_rec, "seconds_mean")])],
              title=f"Adam step, {args.numel} fp32 elements, {args.threads} threads",
              ylabel="milliseconds per step")
