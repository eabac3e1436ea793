"""zinf beside DeepSpeed itself, in one run on the same disk: DeepSpeed's own ops (its aio op and
its optimizer swappers, built from its source as ../shared/bench/deepspeed/README.md says and
called by path through the scripts there, never copied into zinf) against zinf-bench, each round
rotating the order of the tools so that slow drifts of the disk hit all alike.

    python3 bench/run.py vs-deepspeed [--path DIR] [--deepspeed DIR] [--ds-build DIR]
                                      [--ds-src DIR] [--bin PATH] [--python PATH] [--rounds 3]
                                      [--size 2G] [--elements 128M] [--sub-group 32M]
                                      [--steps 3] [--threads N]

Engine I/O (O_DIRECT, 1 MiB blocks, queue depth 8, one request stream): DeepSpeed's aio op
(ds_aio_bench.py: one sync_pwrite / sync_pread of a --size pinned buffer), `zinf-bench io` (its
default request size and requests in flight) and fio (io_uring), writing then reading --size
bytes. Fairness: every write goes into a fresh file at the same path, preallocated and never
written before (zinf-bench io creates and fallocates its own, as it only writes into a file it
creates; DeepSpeed's and fio's are made by fallocate(1) just before they run, since DeepSpeed
writes over an existing file), the allocation untimed in all three; every read reads one file
written once (by fio) before the first round.

Swapped step (fp32 Adam state on disk, --elements elements in sub-groups of --sub-group, one
untimed step then --steps timed ones, aio block 1 MiB and queue depth 8, --threads Adam threads
each): DeepSpeed's PartitionedOptimizerSwapper (4 buffers) and PipelinedOptimizerSwapper (9
buffers, the fewest it runs with), driven as stage3.py drives them (ds_swapper_step.py), against
`zinf-bench step --sync` with a budget of 4 buffers and `--pipeline` with the bytes of 10 (a
buffer: one sub-group of fp32, 128 MiB by default): DeepSpeed keeps the gradients outside its 9
buffers, in a partition-sized fp32 buffer (4 bytes per element); zinf's 10th buffer holds one
sub-group's gradient instead, so zinf still takes less memory. The mode zinf ran (its JSON "mode")
is reported as "ran". zinf runs with --no-io-only: its engine-alone pass after each step would
double zinf's disk traffic, which DeepSpeed's runs do not have.

Output: one JSON line per measurement ({"part": "io", ...} and {"part": "step", ...}), then one
{"summary": ...} line per comparison: ratios zinf/DeepSpeed of speed for I/O (> 1: zinf faster)
and of median time per step (< 1: zinf faster), from the medians over all rounds; a human summary
on stderr. The pictures: OUT/vs-deepspeed.png (median GB/s of read and write: zinf, DeepSpeed,
fio) and OUT/vs-deepspeed-step.png (median seconds per step: zinf's modes beside DeepSpeed's
swappers).

The data files (2 x --size, and the step's 12 bytes per element plus a sub-group) go into a
private directory made under --path (default: OUT/data), on the disk to measure, removed at the
end. The defaults take minutes; nothing else should run meanwhile.

Exit status: 0 when every run gave its figures, whoever is faster (this reports, it does not
judge); 1 when a run failed; 2 for a bad command line or a missing tool, among them DeepSpeed's
ops not built (see README.md beside ds_aio_bench.py).
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import common, plot

HELP = "zinf beside DeepSpeed's own aio op and optimizer swappers (and fio), same disk, one run"
NAME = "vs-deepspeed"

BLOCK_SIZE = 1 << 20
QUEUE_DEPTH = 8
DS_OPS = ("async_io", "cpu_adam", "pin_memory")
DS_SCRIPTS = ("ds_aio_bench.py", "ds_swapper_step.py")
IO_TOOLS = ("deepspeed", "zinf", "fio")
STEP_RUNS = (("deepspeed", "sync"), ("deepspeed", "pipelined"), ("zinf", "sync"),
             ("zinf", "pipelined"))
LABELS = {"deepspeed": "DeepSpeed", "zinf": "zinf", "fio": "fio"}


def add_arguments(p):
    p.add_argument("--path", help="directory on the disk to measure; the data files go into a "
                                  "private directory made in it (default: OUT/data)")
    p.add_argument("--deepspeed", default=str(common.REPO.parent / "shared" / "bench" /
                                              "deepspeed"),
                   help="DeepSpeed's bench scripts, ds_aio_bench.py and ds_swapper_step.py "
                        "(default %(default)s)")
    p.add_argument("--ds-build", default="/tmp/ds/build",
                   help="DeepSpeed's built ops, OP/OP.so (default %(default)s)")
    p.add_argument("--ds-src", default="/tmp/ds/src",
                   help="DeepSpeed's unpacked source (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--python", default=str(common.PYTHON),
                   help="the python DeepSpeed's ops were built with, with torch "
                        "(default %(default)s)")
    p.add_argument("--rounds", type=common.count(1, 1000), default=3,
                   help="rounds, each tool once per round in a rotated order (default 3)")
    p.add_argument("--size", type=common.size(lo=BLOCK_SIZE, multiple=BLOCK_SIZE),
                   default=2 << 30, help="bytes each I/O run writes and reads, a multiple of "
                                         "the 1 MiB block (default 2G)")
    p.add_argument("--elements", type=common.size(unit="elements"), default=128 << 20,
                   help="fp32 parameters of the swapped step (default 128M)")
    p.add_argument("--sub-group", type=common.size(unit="elements"), default=32 << 20,
                   help="elements per sub-group, at most --elements (default 32M)")
    p.add_argument("--steps", type=common.count(1, 1000), default=3,
                   help="timed steps per run, after one untimed (default 3)")
    p.add_argument("--threads", type=common.count(1, 1024),
                   default=len(os.sched_getaffinity(0)),
                   help="Adam threads of each tool (default: the cores, %(default)s)")


def check(args):
    """Every tool and input checked before anything is made or run (UsageError: exit 2)."""
    if args.sub_group > args.elements:
        raise common.UsageError(f"--sub-group {args.sub_group} is larger than --elements "
                                f"{args.elements}")
    ds_dir = Path(args.deepspeed).absolute()
    for name in DS_SCRIPTS:
        if not (ds_dir / name).is_file():
            raise common.UsageError(f"DeepSpeed's bench scripts not found: no {ds_dir / name} "
                                    "(give their directory with --deepspeed)")
    for op in DS_OPS:
        so = Path(args.ds_build) / op / f"{op}.so"
        if not so.is_file():
            raise common.UsageError(
                f"DeepSpeed's ops are not built: no {so} (build them as {ds_dir}/README.md "
                "says, or give their directory with --ds-build)")
    if not (Path(args.ds_src) / "deepspeed/runtime/swap_tensor/"
            "pipelined_optimizer_swapper.py").is_file():
        raise common.UsageError(f"DeepSpeed's source not found in {args.ds_src} (unpack it as "
                                f"{ds_dir}/README.md says, or give --ds-src)")
    if args.path and Path(args.path).exists() and not Path(args.path).is_dir():
        raise common.UsageError(f"--path {args.path} is not a directory")
    bench = common.tool("zinf-bench", args.bin)
    common.need_program("fio", "fio")
    common.need_program("gnuplot", "gnuplot-nox")
    common.need_program("fallocate", "util-linux")
    python = common.torch_python(args.python)
    data_root = Path(args.path) if args.path else Path(args.out)
    need = 2 * args.size + 12 * args.elements + 16 * args.sub_group
    free = common.free_bytes(data_root)
    if free < need:
        raise common.UsageError(f"this run needs about {need} bytes free under {data_root}, "
                                f"{free} are (lower --size or --elements, or give --path)")
    return ds_dir, bench, python


def run(args):
    ds_dir, bench, python = check(args)
    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    results = common.Results(out)
    if args.path:
        data = Path(tempfile.mkdtemp(prefix=".zinf-vs-deepspeed-",
                                     dir=common.make_dir(args.path))).absolute()
    else:
        data = (out / "data").absolute()
        data.mkdir()
    try:
        measure(args, results, logs, data, ds_dir, bench, python)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    summarize(results, out)
    return 0


def last_field(text, key, where):
    """`key` of the last JSON object of `text` that has it."""
    for record in reversed(common.json_lines(text, where)):
        if key in record:
            return record[key]
    raise common.RunError(f"{where}: no JSON object with \"{key}\" in its output")


def measure(args, results, logs, data, ds_dir, bench, python):
    size, numel, sub = args.size, args.elements, args.sub_group
    write_file, read_file, swap = data / "write.dat", data / "read.dat", data / "swap"
    buffer_bytes = 4 * sub
    ds_env = {"TORCH_EXTENSIONS_DIR": Path(args.ds_build).absolute(),
              "DS_SRC": Path(args.ds_src).absolute(), "OMP_NUM_THREADS": args.threads}

    def io_run(tool, op, r):
        log = logs / f"io-{tool}-{op}-r{r}.log"
        file = read_file
        if op == "write":
            file = write_file
            file.unlink(missing_ok=True)
            if tool != "zinf":  # zinf-bench io creates and fallocates its own file
                common.run(["fallocate", "-l", size, file], log=log)
        if tool == "deepspeed":
            text = common.run([python, ds_dir / "ds_aio_bench.py", "--op", op, "--file", file,
                               "--size", size, "--block-size", BLOCK_SIZE, "--queue-depth",
                               QUEUE_DEPTH, "--intra-op-parallelism", 1], log=log, env=ds_env)
            gbs = float(last_field(text, "gb_per_s", "ds_aio_bench.py"))
        elif tool == "zinf":
            text = common.run([bench, "io", "--path", data, "--file", file, "--op", op,
                               "--size", size, "--block-size", BLOCK_SIZE, "--queue-depth",
                               QUEUE_DEPTH, "--json"], log=log)
            gbs = float(last_field(text, "mib_per_s", "zinf-bench io")) * (1 << 20) / 1e9
        else:
            text = common.run(["fio", "--name=vs-deepspeed", f"--filename={file}", f"--rw={op}",
                               f"--bs={BLOCK_SIZE}", f"--iodepth={QUEUE_DEPTH}",
                               "--ioengine=io_uring", "--direct=1", "--numjobs=1",
                               f"--size={size}", "--output-format=json"], log=log)
            try:
                gbs = json.loads(text[text.index("{"):])["jobs"][0][op]["bw_bytes"] / 1e9
            except (ValueError, KeyError, IndexError, TypeError):
                raise common.RunError(f"fio: no {op} bandwidth in its JSON (log: {log})") \
                    from None
        if op == "write":
            file.unlink(missing_ok=True)
        results.emit({"part": "io", "round": r, "op": op, "tool": tool, "size_bytes": size,
                      "gb_per_s": gbs})

    def step_run(tool, mode, r):
        log = logs / f"step-{tool}-{mode}-r{r}.log"
        # DeepSpeed's pipeline runs with 9 buffers and the gradients outside its pool (a
        # partition-sized fp32 buffer); zinf's takes 10: its 10th holds the sub-group's gradient.
        buffers = 4 if mode == "sync" else 9 if tool == "deepspeed" else 10
        shutil.rmtree(swap, ignore_errors=True)
        swap.mkdir()
        if tool == "deepspeed":
            text = common.run([python, ds_dir / "ds_swapper_step.py", "--dir", swap / "ds",
                               "--elements", numel, "--sub-group", sub, "--steps", args.steps,
                               "--queue-depth", QUEUE_DEPTH]
                              + (["--pipelined"] if mode == "pipelined" else []),
                              log=log, env=ds_env)
            records = [rec for rec in common.json_lines(text, "ds_swapper_step.py")
                       if "seconds" in rec]
            seconds = [rec["seconds"] for rec in records]
            ran = records[-1].get("mode") if records else None
        else:
            text = common.run([bench, "step", "--path", swap, "--state-bytes", 12 * numel,
                               "--state-format", "fp32", "--sub-group-size", sub,
                               "--sync" if mode == "sync" else "--pipeline", "--steps",
                               args.steps, "--threads", args.threads, "--queue-depth",
                               QUEUE_DEPTH, "--block-size", BLOCK_SIZE, "--budget",
                               buffers * buffer_bytes, "--no-io-only", "--json"], log=log)
            seconds = last_field(text, "step_seconds", "zinf-bench step")
            ran = last_field(text, "mode", "zinf-bench step")
        shutil.rmtree(swap, ignore_errors=True)
        if not isinstance(seconds, list) or not seconds:
            raise common.RunError(f"{tool} {mode} step: no timed step in its output (log: {log})")
        results.emit({"part": "step", "round": r, "tool": tool, "mode": mode, "ran": ran,
                      "budget_bytes": buffers * buffer_bytes, "elements": numel,
                      "sub_group": sub, "step_seconds": seconds})

    common.say(NAME, f"{args.rounds} round(s); I/O {size} bytes; step {numel} elements in "
                     f"sub-groups of {sub}, {args.steps} timed steps, {args.threads} Adam "
                     f"threads; logs in {logs}")
    common.run(["fio", "--name=prepare", f"--filename={read_file}", "--rw=write",
                f"--bs={BLOCK_SIZE}", f"--iodepth={QUEUE_DEPTH}", "--ioengine=io_uring",
                "--direct=1", f"--size={size}"], log=logs / "prepare-read-file.log")
    for r in range(1, args.rounds + 1):
        order = common.rotate(IO_TOOLS, r - 1)
        for op in ("write", "read"):
            for tool in order:
                io_run(tool, op, r)
        for tool, mode in common.rotate(STEP_RUNS, r - 1):
            step_run(tool, mode, r)


def summarize(results, out):
    machine = common.machine()
    human, io_medians, step_medians = [], {}, {}
    for op in ("write", "read"):
        med = {t: common.finite(common.median(
            rec["gb_per_s"] for rec in results.where(part="io", op=op, tool=t)))
            for t in IO_TOOLS}
        io_medians[op] = med
        speed = common.ratio(med["zinf"], med["deepspeed"])
        results.emit({"summary": "io", "op": op, "median_gb_per_s": med,
                      "zinf_over_deepspeed_speed": speed,
                      "fio_over_deepspeed_speed": common.ratio(med["fio"], med["deepspeed"]),
                      "machine": machine})
        human.append(f"engine {op:<5}  DeepSpeed {med['deepspeed']:.2f} GB/s, zinf "
                     f"{med['zinf']:.2f}, fio {med['fio']:.2f}: zinf/DeepSpeed speed {speed}x")
    for mode in ("sync", "pipelined"):
        runs = {t: results.where(part="step", tool=t, mode=mode) for t in ("deepspeed", "zinf")}
        med = {t: common.finite(common.median(s for rec in runs[t] for s in rec["step_seconds"]))
               for t in runs}
        step_medians[mode] = med
        ran = sorted({str(rec["ran"]) for rec in runs["zinf"]})
        time_ratio = common.ratio(med["zinf"], med["deepspeed"])
        results.emit({"summary": "step", "mode": mode, "median_seconds": med, "zinf_ran": ran,
                      "zinf_over_deepspeed_time": time_ratio, "machine": machine})
        human.append(f"step {mode:<9} DeepSpeed {med['deepspeed']:.3f} s, zinf "
                     f"{med['zinf']:.3f} s (ran {'/'.join(ran)}): zinf/DeepSpeed time "
                     f"{time_ratio}x")
    common.say(NAME, "zinf vs DeepSpeed (I/O: > 1 is zinf faster; steps: < 1 is zinf faster):")
    for line in human:
        common.say(NAME, "  " + line)
    draw(out, io_medians, step_medians)


def draw(out, io_medians, step_medians):
    """OUT/vs-deepspeed.png: median GB/s per op and tool; OUT/vs-deepspeed-step.png: median
    seconds per step of each zinf mode beside the DeepSpeed swapper it is measured against."""
    ops = ("read", "write")
    plot.bars(out / f"{NAME}.png", list(ops),
              [(LABELS[t], [io_medians[op][t] for op in ops]) for t in ("zinf", "deepspeed",
                                                                         "fio")],
              title="engine I/O, O_DIRECT, 1 MiB blocks, queue depth 8: median GB/s",
              ylabel="GB/s")
    modes = ("sync", "pipelined")
    plot.bars(out / f"{NAME}-step.png",
              ["sync (DS Partitioned)", "pipelined (DS Pipelined)"],
              [(LABELS[t], [step_medians[m][t] for m in modes]) for t in ("zinf", "deepspeed")],
              title="swapped fp32 Adam step: median seconds per step", ylabel="seconds")
