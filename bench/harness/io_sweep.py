"""zinf's own I/O sweep (zinf-bench io --sweep): block size 128K-8M x queue depth 1-32 x intra-op
parallelism 1, 2 (the knobs of DeepSpeed's "aio" block, not DeepSpeed's grid), each
configuration writing a fresh file of --size bytes and reading it back, O_DIRECT.

    python3 bench/run.py io-sweep [--path DIR] [--size 256M] [--engine uring|posix|auto]
                                  [--single-submit] [--no-overlap-events]
                                  [--bin build/bin/zinf-bench]

zinf-bench writes the sweep as OUT/io-sweep.csv (op, block_size, queue_depth,
intra_op_parallelism, size_bytes, seconds, mib_per_s); each row is also a JSON line. Then one
summary line per op with its fastest configuration, and one for both ops ("op": "both") with the
"aio" block zinf-bench picks for both directions (the best sum of each direction's throughput
over that direction's best): paste it into a config. The pictures: MiB/s against the queue depth,
one line per block size and parallelism, in OUT/io-sweep.png (read) and OUT/io-sweep-write.png.

The file lives in a fresh directory made under --path (created if missing) and removed at the
end: nothing else there is written or removed; it needs --size bytes free. 84 configurations
move 168 x --size bytes in all.
"""
import csv
import json
import shutil
import tempfile
from pathlib import Path

from . import common, plot

HELP = "zinf's I/O sweep: block size x queue depth x parallelism (zinf-bench io --sweep)"
NAME = "io-sweep"
OPS = ("read", "write")
COLUMNS = {"op": str, "block_size": int, "queue_depth": int, "intra_op_parallelism": int,
           "size_bytes": int, "seconds": float, "mib_per_s": float}
CONFIGURATIONS = 7 * 6 * 2  # zinf-bench io --sweep's grid
MIB = 1 << 20


def add_arguments(p):
    p.add_argument("--path", default="/tmp",
                   help="directory on the disk to measure; the file lives in a fresh directory "
                        "made under it (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--size", type=common.size(lo=4096, multiple=4096), default=256 << 20,
                   help="bytes written and read per configuration, a multiple of 4K "
                        "(default 256M)")
    p.add_argument("--engine", type=common.one_of(("uring", "posix", "auto")), default="uring",
                   help="I/O engine: uring, posix or auto (default %(default)s)")
    p.add_argument("--single-submit", action="store_true", help="aio.single_submit = true")
    p.add_argument("--no-overlap-events", action="store_true", help="aio.overlap_events = false")


def run(args):
    bench = common.tool("zinf-bench", args.bin)
    if Path(args.path).exists() and not Path(args.path).is_dir():
        raise common.UsageError(f"--path {args.path} is not a directory")
    if common.free_bytes(args.path) < args.size:
        raise common.UsageError(f"the sweep needs {args.size} bytes free under {args.path}")
    common.make_dir(args.path)
    out = common.fresh_dir(args.out, NAME)
    (out / "logs").mkdir()
    results = common.Results(out)
    table = out / f"{NAME}.csv"
    flags = ["--size", args.size, "--engine", args.engine, "--sweep", "--csv", table]
    flags += ["--single-submit"] if args.single_submit else []
    flags += ["--no-overlap-events"] if args.no_overlap_events else []
    # A hung run must not hold the sweep forever: at least 10 MiB/s, plus start-up.
    timeout = 600 + 2 * CONFIGURATIONS * args.size // (10 * MIB)
    work = tempfile.mkdtemp(prefix="zinf-io-sweep.", dir=args.path)
    try:
        text = common.run([bench, "io", "--path", work] + flags,
                          log=out / "logs" / "zinf-bench-io.log", timeout=timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "logs" / "zinf-bench-io.stdout").write_text(text, encoding="utf-8")
    rows = [results.emit({"part": "sweep", **row, "engine": args.engine})
            for row in read_table(table)]
    aio = aio_block(text)
    machine = common.machine()
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            raise common.RunError(f"{table}: no {op} rows")
        best = max(mine, key=lambda r: r["mib_per_s"])
        results.emit({"summary": True, "op": op, "configurations": len(mine),
                      "size_bytes": args.size, "engine": args.engine,
                      "best": config_of(best), "mib_per_s": round(best["mib_per_s"], 1),
                      "machine": machine})
        common.say(NAME, f"fastest {op}: {best['mib_per_s']:.1f} MiB/s with "
                         f"{json.dumps(config_of(best))}")
    both = {"summary": True, "op": "both", "size_bytes": args.size, "engine": args.engine,
            "aio": aio}
    for op in OPS:  # the chosen configuration's figures
        match = [r for r in rows if r["op"] == op and config_of(r) == config_of(aio)]
        both[f"{op}_mib_per_s"] = round(match[0]["mib_per_s"], 1) if match else None
    results.emit({**both, "machine": machine})
    common.say(NAME, f'for both directions: "aio": {json.dumps(aio)}')
    for op in OPS:
        draw(out / (f"{NAME}.png" if op == "read" else f"{NAME}-{op}.png"), rows, op,
             args.size, args.engine)
    return 0


def read_table(path):
    """The rows of zinf-bench's CSV, typed; a RunError when its columns are not COLUMNS."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != list(COLUMNS):
                raise common.RunError(f"{path}: columns {reader.fieldnames}, expected "
                                      f"{list(COLUMNS)}")
            rows = [{k: COLUMNS[k](v) for k, v in row.items()} for row in reader]
    except OSError as e:
        raise common.RunError(f"zinf-bench io wrote no {path}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise common.RunError(f"{path}: a value is not a number: {e}") from None
    if not rows:
        raise common.RunError(f"{path}: no rows")
    return rows


def aio_block(text):
    """The "aio": {...} block zinf-bench io --sweep prints on stdout (several lines)."""
    key = '"aio":'
    at = text.find(key)
    try:
        aio = json.JSONDecoder().raw_decode(text[at + len(key):].lstrip())[0] if at >= 0 else None
    except ValueError:
        aio = None
    if not isinstance(aio, dict):
        raise common.RunError('zinf-bench io --sweep printed no "aio" block')
    return aio


def config_of(row):
    return {k: row.get(k) for k in ("block_size", "queue_depth", "intra_op_parallelism")}


def size_label(n):
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def draw(png, rows, op, size, engine):
    """MiB/s against the queue depth, one line per block size and parallelism."""
    series = {}
    for r in sorted((r for r in rows if r["op"] == op),
                    key=lambda r: (r["intra_op_parallelism"], r["block_size"],
                                   r["queue_depth"])):
        label = f"{size_label(r['block_size'])} par {r['intra_op_parallelism']}"
        series.setdefault(label, []).append((r["queue_depth"], r["mib_per_s"]))
    plot.lines(png, list(series.items()),
               title=f"zinf-bench io sweep: {op}, {size_label(size)} per configuration, {engine}",
               xlabel="queue depth", ylabel="MiB/s", logx=True, points=True)
