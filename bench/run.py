#!/usr/bin/env python3
"""zinf's benchmark harness: every benchmark of docs/benchmarks.md is a subcommand.

    python3 bench/run.py SUBCOMMAND [--out DIR] [flags]    (SUBCOMMAND --help for its flags)

Each run claims its output directory --out (default /tmp/zinf-bench-SUBCOMMAND; it must be new,
empty, or made by an earlier run of the same subcommand), prints one JSON line per measurement
and summary on stdout, keeps them in OUT/results.jsonl with the logs of the programs it ran, and
draws its comparison into OUT/SUBCOMMAND.png (bench/harness/plot.py). Every summary line names
the machine it was measured on ("machine": CPU, SIMD, cores, memory, kernel, date).

Exit status: 0 when every run gave its figures, 1 when a run failed (the end of its log on
stderr) or a subcommand's stated target was missed, 2 for a bad command line or a missing tool
(before anything is made or run).
"""
import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import common, plot  # noqa: E402

# Subcommand -> module of bench/harness: each has HELP, add_arguments(parser) and run(args).
SUBCOMMANDS = {
    "vs-deepspeed": "vs_deepspeed",
    "io-vs-fio": "io_vs_fio",
    "io-sweep": "io_sweep",
    "step": "step",
    "q8-speed": "q8_speed",
    "q8-quality": "q8_quality",
    "checkpoint": "checkpoint",
    "paths": "paths",
    "param-offload": "param_offload",
    "stage3-lm": "stage3_lm",
    "overlap": "overlap",
    "adam-vs-torch": "adam_vs_torch",
    "scaling": "scaling",
    "deepspeed-compat": "deepspeed_compat",
}


def parser():
    top = common.Parser(prog="bench/run.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = top.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"harness.{module_name}")
        sub = subs.add_parser(name, help=module.HELP, description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.prog = f"bench {name}"
        sub.add_argument("--out", default=f"/tmp/zinf-bench-{name}",
                         help="output directory: results.jsonl, logs/, the picture "
                              "(default %(default)s)")
        module.add_arguments(sub)
        sub.set_defaults(module=module)
    subs.add_parser("plot", help="line charts of files into a PNG (the loss curves of "
                                 "zinf-train --metrics): plot --help", add_help=False)
    return top


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":  # the plotter's own command line
        return plot.main(argv[1:], prog="bench plot")
    args = parser().parse_args(argv)
    name = f"bench {args.subcommand}"
    try:
        return args.module.run(args) or 0
    except common.UsageError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except (common.RunError, plot.InputError, plot.ToolError) as e:  # a picture is a result
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
