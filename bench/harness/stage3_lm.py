"""ZeRO stage 3 of a PyTorch transformer LM through zinf.torch: offload against memory and the I/O
alone, and the RAM and NVMe bytes per parameter of each stage and offload setting.

    python3 bench/run.py stage3-lm [--path DIR] [--d-model 256] [--layers 4] [--seq 64]
                                   [--batch 8] [--steps 3] [--rounds 2] [--np 2] [--ram SIZE]
                                   [--no-table] [--settings s3-nvme-nvme,...]
                                   [--no-side-by-side]
                                   [--speculative-step auto|true|false]

The model is examples/torch/transformer_lm.py's TransformerLM (nn.Embedding, nn.TransformerEncoder
of nn.TransformerEncoderLayer, nn.LayerNorm, a head tied to the embedding), built inside
zinf.torch.init and trained by zinf.torch.ZeroOptimizer on --np ranks (mpirun; the ranks are
bench/harness/workers/stage3_lm.py) with a DeepSpeed config that sets no size (sub_group_size,
buckets, the live window, max_in_cpu and the pool are DeepSpeed's defaults, chosen by the
engine).

1. Side by side (one mpirun; --no-side-by-side skips it): per round, in the order offload,
   memory, io rotated by one each round, each mode runs 1 warm-up step and --steps timed ones:
   - offload: stage 3, offload_param nvme and offload_optimizer nvme under --path;
   - memory:  the same model and batches in memory (offload_param none, offload_optimizer cpu);
   - io:      the I/O alone: the swap bytes of the latest offload run's median step (round 0
              runs offload first; StepInfo's swap_read_bytes / swap_write_bytes: all ranks, from
              the end of the previous step to the end of this one, so forward and backward reads
              from the store are in it) moved by `zinf-bench io` (O_DIRECT, a fresh file under
              --path, every rank its share at once, write then read). It moves one size both
              ways, max(read, write) per rank rounded up to 1 MiB, and the step's I/O time is
              write_seconds x write / size + read_seconds x read / size, each op at the
              bandwidth it measured.
   A mode's figure is the median over its timed steps of forward + backward + step on the
   slowest rank. JSON lines: {"bench": "stage3-lm", "round", "mode", "step_seconds", ...} per
   mode, {"bench": "stage3-lm-round", ..., "offload_over_max_memory_io"} per round, and
   {"bench": "stage3-lm-summary", "summary", ..., "machine"} (the medians over the rounds; the
   issue's goal <= 1.15).
2. Bytes per parameter (--no-table skips it): each setting (stages 1 and 2 with
   offload_optimizer cpu and nvme; stage 3 with offload_param none and cpu under either
   offload_optimizer, and nvme under nvme, which the engine requires) trains --steps steps in an
   mpirun of its own, once with --layers and once with half as many (twice as many when --layers
   is 1); --settings picks some of them (s1-cpu, s1-nvme, s2-cpu, s2-nvme, s3-cpu-none,
   s3-nvme-none, s3-cpu-cpu, s3-nvme-cpu, s3-nvme-nvme: stage, offload_optimizer and, at stage
   3, offload_param; the default all). {"bench": "stage3-lm-bytes", ...} per run:
   - ram_added_bytes: each rank's peak RSS (ru_maxrss, before close) less its RSS before the
     model was built; ram_bytes_per_parameter: their sum over the model's parameters;
   - plan_bytes_per_rank: the engine's host memory plan (plan_bytes of the metrics; it counts
     the process's RSS before the engine too); plan_bytes_per_parameter: x ranks / parameters;
   - nvme_bytes: the allocated size (du -s -B1) of the setting's swap directory after the last
     step, before close() removes the store (nvme_apparent_bytes: du -sb); per parameter.
   Then per setting {"bench": "stage3-lm-fits", "summary", ..., "machine"}: through its two runs,
   the node's RAM (every rank's peak RSS, the interpreter and torch included) = fixed +
   per_parameter x parameters; ram_largest_parameters = (R - fixed) / per_parameter for R = --ram
   (default the machine's MemTotal); the same from the plan (plan_*). null where the two runs do
   not rise. A run that fails gives {"bench": "stage3-lm-bytes", ..., "error": ...} (its log
   under OUT/logs/); the others still run, and the exit status is 1 at the end.

The picture: the offload, memory and io seconds per round and their medians (side by side);
with --no-side-by-side, the RAM, plan and NVMe bytes per parameter of each setting's larger run
(with both parts, those go to OUT/stage3-lm-bytes.png).

--d-model 159-65536 (below 159 no matrix has more than stage3_param_persistence_threshold, 1e5
elements, and nothing would be partitioned), heads d_model / 64 (at least 1, lowered until it
divides d_model); --layers 1-4096; --seq 1-65536; --batch (sequences per step over all ranks, a
multiple of --np) 1-1000000; --steps 1-1000; --rounds 1-100; --np 1-1024; --ram a size such as
64G. Needs the build (zinf's Python package: --target zinf_python; zinf-bench for the side by
side), torch and numpy for /usr/bin/python3 (python3-torch), mpirun, about 48 bytes per
parameter free under --path, where it works in a directory of its own, removed at the end, and for the memory mode and the
in-memory settings about 20 bytes per parameter of RAM over the ranks (fp32 weights, gradient
and Adam state) besides torch's own.
"""
import shutil
import tempfile
from pathlib import Path

from . import common, plot

HELP = "zinf.torch stage 3 LM: offload vs memory vs the I/O alone; bytes per parameter (mpirun)"
NAME = "stage3-lm"
WORKER = Path(__file__).resolve().parent / "workers" / "stage3_lm.py"
PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold, DeepSpeed's default
MODES = ("offload", "memory", "io")
# (stage, offload_optimizer, offload_param) of the bytes-per-parameter table.
SETTINGS = ((1, "cpu", "none"), (1, "nvme", "none"), (2, "cpu", "none"), (2, "nvme", "none"),
            (3, "cpu", "none"), (3, "nvme", "none"), (3, "cpu", "cpu"), (3, "nvme", "cpu"),
            (3, "nvme", "nvme"))


def setting_name(stage, optimizer, param):
    """s1-cpu, s3-nvme-cpu: the name of a setting in --settings."""
    return f"s{stage}-{optimizer}" + (f"-{param}" if stage == 3 else "")


SETTING_NAMES = tuple(setting_name(*s) for s in SETTINGS)


def add_arguments(p):
    p.add_argument("--path", default="/tmp/zinf-bench-stage3-lm-swap",
                   help="where the swap stores and the io file go, in a directory of the run's "
                        "own (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench, for the io mode (default build/bin/zinf-bench)")
    p.add_argument("--d-model", type=common.count(1, 65536), default=256,
                   help="model width, at least 159 (default %(default)s)")
    p.add_argument("--layers", type=common.count(1, 4096), default=4,
                   help="transformer layers (default %(default)s)")
    p.add_argument("--seq", type=common.count(1, 65536), default=64,
                   help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch", type=common.count(1, 1_000_000), default=8,
                   help="sequences per step over all ranks, a multiple of --np "
                        "(default %(default)s)")
    p.add_argument("--steps", type=common.count(1, 1000), default=3,
                   help="timed steps per mode and round, steps per table run "
                        "(default %(default)s)")
    p.add_argument("--rounds", type=common.count(1, 100), default=2,
                   help="rounds of the side by side, order rotated (default %(default)s)")
    p.add_argument("--np", type=common.count(1, 1024), default=2,
                   help="ranks (mpirun -np; default %(default)s)")
    p.add_argument("--ram", type=common.size(),
                   help="RAM for the largest model of the fits, such as 64G (default MemTotal)")
    p.add_argument("--no-table", action="store_true", help="skip the bytes per parameter")
    p.add_argument("--settings", type=common.one_of(SETTING_NAMES, many=True),
                   default=list(SETTING_NAMES),
                   help="the settings of the bytes per parameter, comma-separated: sSTAGE-"
                        "OPTIMIZER[-PARAM] of " + ",".join(SETTING_NAMES) + " (default all)")
    p.add_argument("--no-side-by-side", action="store_true", help="skip the side by side")
    p.add_argument("--speculative-step", type=common.one_of(("auto", "true", "false")),
                   default="auto",
                   help="zinf.speculative_step; auto leaves it unset (default %(default)s)")


def parameter_count(d_model, layers, seq):
    """examples/torch/transformer_lm.py's parameter_count."""
    return layers * (12 * d_model * d_model + 13 * d_model) + (256 + seq) * d_model + 2 * d_model


def check(args):
    """The checks argparse's types cannot make; a UsageError before anything is made or run."""
    if 4 * args.d_model * args.d_model <= PERSISTENCE_THRESHOLD:
        raise common.UsageError(
            f"--d-model {args.d_model}: the largest matrix (4 d_model^2 elements) is not above "
            "stage3_param_persistence_threshold (1e5, DeepSpeed's default), so stage 3 would "
            "partition nothing; give at least 159")
    if args.batch % args.np:
        raise common.UsageError(f"--batch {args.batch} is not a multiple of --np {args.np}")
    if args.no_table and args.no_side_by_side:
        raise common.UsageError("--no-table and --no-side-by-side leave nothing to run")
    if not args.path:
        raise common.UsageError("--path needs a non-empty directory")


def run(args):
    check(args)
    env = {"PYTHONPATH": common.zinf_python_path(), "OMPI_MCA_mpi_yield_when_idle": 1}
    python = common.torch_python(modules=("torch", "numpy"))
    bench = None if args.no_side_by_side else common.tool("zinf-bench", args.bin)
    mpirun = common.mpirun(args.np, ["-x", "PYTHONPATH", "-x", "OMPI_MCA_mpi_yield_when_idle"])
    ram = args.ram or common.machine()["memory_bytes"]
    if ram is None and not args.no_table:
        raise common.UsageError("cannot read the machine's memory for the fits; give --ram")
    params = parameter_count(args.d_model, args.layers, args.seq)
    path = Path(args.path).absolute()
    free = common.free_bytes(path)
    if free < 48 * params:
        raise common.UsageError(f"needs about {48 * params} bytes free in {path}, {free} "
                                "available")
    common.make_dir(path)
    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    results = common.Results(out)
    work = Path(tempfile.mkdtemp(prefix="bench-stage3-lm.", dir=path))
    common.say(f"bench {NAME}", f"{params} parameters ({4 * params} bytes of fp32 weights) on "
               f"{args.np} ranks, work directory {work}")
    model = ["--d-model", args.d_model, "--seq", args.seq, "--batch", args.batch,
             "--steps", args.steps, "--speculative-step", args.speculative_step]
    worker = mpirun + [python, WORKER]
    machine = common.machine()
    failed = []
    try:
        if not args.no_side_by_side:
            try:
                text = common.run(worker + ["side-by-side", "--path", work, "--bin", bench,
                                            *model, "--layers", args.layers,
                                            "--rounds", args.rounds],
                                  log=logs / "side-by-side.log", env=env)
                for record in common.json_lines(text, "the side-by-side ranks"):
                    if record.get("bench") == "stage3-lm-summary":
                        record.update(summary="medians over the rounds of each mode's median "
                                              "step seconds", machine=machine)
                    results.emit(record)
            except common.RunError as e:
                common.say(f"bench {NAME}", f"side by side: {e}")
                failed.append("side by side")
            if not results.where(bench="stage3-lm-summary") and "side by side" not in failed:
                failed.append("side by side (no summary line)")
        if not args.no_table:
            table(args, worker, env, model, work, logs, results, failed)
            for record in fit(results.where(bench="stage3-lm-bytes"), ram):
                results.emit({**record, "machine": machine})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pictures = []
    if not args.no_side_by_side:
        pictures.append((out / f"{NAME}.png", draw_side_by_side))
    if not args.no_table:
        name = f"{NAME}-bytes.png" if pictures else f"{NAME}.png"
        pictures.append((out / name, draw_bytes))
    for png, draw in pictures:
        draw(png, results)
    if failed:
        raise common.RunError(f"some runs failed: {', '.join(failed)} (logs under {logs})")
    return 0


def table(args, worker, env, model, work, logs, results, failed):
    """The bytes per parameter: each setting at --layers and at half (or twice) as many."""
    other = args.layers // 2 if args.layers > 1 else 2
    for stage, optimizer, param in SETTINGS:
        if setting_name(stage, optimizer, param) not in args.settings:
            continue
        for layers in (other, args.layers):
            what = (f"stage {stage}, offload_optimizer {optimizer}, offload_param {param}, "
                    f"{layers} layers")
            common.say(f"bench {NAME}", f"bytes per parameter: {what}")
            log = logs / f"bytes-s{stage}-o{optimizer}-p{param}-l{layers}.log"
            error = None
            try:
                text = common.run(worker + ["bytes", "--path", work, *model, "--layers", layers,
                                            "--stage", stage, "--offload-optimizer", optimizer,
                                            "--offload-param", param], log=log, env=env)
                records = common.json_lines(text, f"the bytes ranks ({what})")
            except common.RunError as e:
                error, records = str(e).splitlines()[0], []
            for record in records:
                results.emit(record)
            if error is None and not any(r.get("bench") == "stage3-lm-bytes" for r in records):
                error = f"no stage3-lm-bytes line (log: {log})"
            if error is not None:
                common.say(f"bench {NAME}", f"{what}: {error}")
                failed.append(what)
                results.emit({"bench": "stage3-lm-bytes", "stage": stage,
                              "offload_optimizer": optimizer,
                              "offload_param": param if stage == 3 else None,
                              "layers": layers, "error": error})


def fit(records, ram):
    """Per setting, from its runs at two sizes: the node's RAM (all ranks' peak RSS, the
    interpreter and torch included) = fixed + per_parameter x parameters, through the two points;
    the same for the plan (plan_bytes x ranks); the largest model = (ram - fixed) /
    per_parameter. The stage3-lm-fits records."""
    runs = {}
    for record in records:
        if "error" in record:
            continue
        key = (record["stage"], record["offload_optimizer"], record["offload_param"])
        runs.setdefault(key, []).append(record)
    fits = []
    for (stage, optimizer, param), group in runs.items():
        group.sort(key=lambda r: r["parameters"])
        small, large = group[0], group[-1]
        out = {"bench": "stage3-lm-fits",
               "summary": "RAM and plan bytes per parameter through the setting's two sizes",
               "stage": stage, "offload_optimizer": optimizer, "offload_param": param,
               "ram_bytes": ram, "parameters": [small["parameters"], large["parameters"]]}
        for name, total in (("ram", lambda r: sum(r["peak_rss_bytes"])),
                            ("plan", lambda r: r["plan_bytes_per_rank"] * r["ranks"])):
            dp = large["parameters"] - small["parameters"]
            slope = (total(large) - total(small)) / dp if dp > 0 else None
            if slope is None or slope <= 0:
                out.update({f"{name}_fixed_bytes": None, f"{name}_bytes_per_parameter": None,
                            f"{name}_largest_parameters": None})
                continue
            fixed = total(large) - slope * large["parameters"]
            out.update({f"{name}_fixed_bytes": int(fixed),
                        f"{name}_bytes_per_parameter": round(slope, 3),
                        f"{name}_largest_parameters": max(0, int((ram - fixed) / slope))})
        fits.append(out)
    return fits


def draw_side_by_side(png, results):
    """Offload, memory and io seconds per step, one cluster per round and one for the medians."""
    groups, series = [], {mode: [] for mode in MODES}
    rows = [(f"round {r['round']}", r) for r in results.where(bench="stage3-lm-round")]
    rows += [("median", r) for r in results.where(bench="stage3-lm-summary")]
    for group, record in rows:
        groups.append(group)
        for mode in MODES:
            series[mode].append(record.get(f"{mode}_seconds"))
    if groups:
        plot.bars(png, groups, list(series.items()),
                  title="stage 3 LM through zinf.torch: seconds per step (slowest rank)",
                  ylabel="seconds")


def draw_bytes(png, results):
    """RAM (measured), plan and NVMe bytes per parameter of each setting's larger run."""
    larger = {}
    for r in results.where(bench="stage3-lm-bytes"):
        if "error" in r:
            continue
        key = (r["stage"], r["offload_optimizer"], r["offload_param"])
        if key not in larger or r["parameters"] > larger[key]["parameters"]:
            larger[key] = r
    if not larger:
        return
    groups = [setting_name(*key) for key in larger]
    series = [(label, [r.get(key) for r in larger.values()])
              for key, label in (("ram_bytes_per_parameter", "RAM (peak RSS added)"),
                                 ("plan_bytes_per_parameter", "host plan"),
                                 ("nvme_bytes_per_parameter", "NVMe"))]
    plot.bars(png, groups, series, title="stage 3 LM: bytes per parameter (larger run)",
              ylabel="bytes per parameter", width=1700)
