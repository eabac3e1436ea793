"""Checkpoint save and restore against the copy bound measured in the same run (issue 6).

    python3 bench/run.py checkpoint [--path DIR] [--state 4G] [--ranks 2] [--trials 3]
                                    [--target 1.25] [--bin build/bin/zinf-bench]
                                    [--no-drop-caches]

Each trial measures
  (a) mpirun -np RANKS zinf-bench ckpt: SaveCheckpoint of --state bytes of Adam state (split over
      the ranks, flat plan) into RUN/ckpt, then RestoreCheckpoint of it twice: in one pass
      (verify_before_write = false: every chunk verified as it is read, what zinf-train does when
      it restores into its freshly created swap store) and verifying the whole file before writing
      (verify_before_write = true, the API default, for a live swapper whose store must stay
      untouched by a bad file: it reads the file twice);
  (b) the copy bound: fio writing the same number of bytes into RUN/fio and fio reading them back:
      RANKS jobs (one per rank, bytes / RANKS each, whole MiB), io_uring, O_DIRECT, bs 1M,
      iodepth 8 (the shape of io-vs-fio), the write with end_fsync=1.
      bound = fio_write_seconds + fio_read_seconds (scaled to the checkpoint's bytes)

A save moves the state once off the swap store and once into the checkpoint, a restore the other
way round, so each should stay within TARGET (1.25) times the bound. The two tools alternate which
goes first every trial, so that slow drifts of the disk hit both alike.

Space. --path must hold about 2x the state plus one sub-group per rank (swap store + checkpoint;
fio reuses the space after the checkpoint is deleted); the run refuses to start with less. The
swap store (RUN/swap), the checkpoint (RUN/ckpt) and the fio files (RUN/fio) share one file
system: RUN is a fresh directory --path/bench-checkpoint.XXXXXX made for this run and removed at
its end, so nothing else under --path is written or removed.

Page cache. HDF5 writes go through MPI-IO as buffered writes; SaveCheckpoint fdatasyncs the file on
every rank before the commit, so the timed save includes getting the data to the disk, like fio's
O_DIRECT write plus end_fsync. When run as root (and /proc/sys/vm/drop_caches is writable), the
page cache is dropped before every timed operation of both tools (zinf-bench ckpt --drop-caches;
sync and drop_caches before each fio run), so the restore reads the checkpoint from the disk and
not from the pages the save left behind. The JSON says whether that happened ("cache_dropped");
without it a restore can look faster than the disk. --no-drop-caches skips the drops (they are
machine-wide: other jobs lose their cache too).

Order and noise. Every zinf-bench run saves once, then restores in both modes, the page cache
dropped before each; the two restores alternate which goes first, because on the 2-core VM this was
written on the first read of a freshly saved checkpoint was slower than any later one even with the
guest page cache dropped (host-side caching of the virtual disk?); and buffered I/O costs a lot of
system CPU there, so a concurrent build or job on the same disk moves the checkpoint figures much
more than fio's O_DIRECT ones. Run it on a quiet machine, with --trials >= 3.

MPI. mpirun runs as root on one node over loopback (--mca btl self,vader,tcp --mca
btl_tcp_if_include lo); a non-empty ZINF_MPIRUN_ARGS replaces every mpirun argument but -np.

Output: one JSON line per trial (the fio and checkpoint seconds, GB/s and ratios op / bound), then
one summary line per operation (save, restore, restore_single_pass) with the median ratio and
pass = median <= TARGET; the same as CSV in OUT/checkpoint.csv; the zinf-bench and fio output of
every trial under OUT/logs/; a human summary on stderr; OUT/checkpoint.png: median GB/s of each
operation beside the copy bound's and the slowest that passes (bound / TARGET).
Exit status: 0 when save and the one-pass restore meet the target, 1 when not (or a run failed),
2 on usage or tool errors. The verify-first restore is reported, not judged: it reads the file
twice by design.
"""
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from . import common, plot

HELP = "checkpoint save/restore (zinf-bench ckpt under mpirun) against fio's copy bound"
NAME = "checkpoint"

ELEMENT_BYTES = 12  # fp32 + exp_avg + exp_avg_sq: zinf-bench ckpt's unit of --state-bytes
SUB_GROUP_NUMEL = 32 << 20  # zinf-bench ckpt's default --sub-group-size
DROP_CACHES = "/proc/sys/vm/drop_caches"
OPS = ("save", "restore", "restore_single_pass")
# As root on a single node over loopback; a non-empty ZINF_MPIRUN_ARGS replaces these.
MPI_LOOPBACK = ("--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", "lo")


def add_arguments(p):
    p.add_argument("--path", "--dir", dest="path", default="/tmp/zinf-bench-ckpt",
                   help="directory in which the run makes (and removes) its scratch directory: "
                        "swap store, checkpoint, fio files (default %(default)s)")
    p.add_argument("--state", type=common.size(lo=ELEMENT_BYTES), default=4 << 30,
                   help="Adam state bytes over all ranks, at least 12 (default 4G)")
    p.add_argument("--ranks", type=common.count(1, 1024), default=2,
                   help="MPI ranks of zinf-bench ckpt, and fio jobs (default 2)")
    p.add_argument("--trials", type=common.count(1, 1000), default=3,
                   help="trials, the tools' order alternating (default 3)")
    p.add_argument("--target", type=common.number(), default=1.25,
                   help="the largest median ratio op / bound that passes (default 1.25)")
    p.add_argument("--bin", "--bench", dest="bin",
                   help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache before every timed operation")


def mpirun_prefix(ranks):
    """mpirun -np RANKS and its arguments: ZINF_MPIRUN_ARGS when set and not empty, else
    common.mpirun's (as root, oversubscribed) over loopback."""
    extra = os.environ.get("ZINF_MPIRUN_ARGS", "")
    if extra.strip():
        try:
            words = shlex.split(extra)
        except ValueError as e:
            raise common.UsageError(f"ZINF_MPIRUN_ARGS: {e}") from None
        return [common.need_program("mpirun", "openmpi-bin"), "-np", str(ranks)] + words
    return common.mpirun(ranks, MPI_LOOPBACK)


def run(args):
    # Every flag, tool and the space checked before anything is made or run.
    bench = common.tool("zinf-bench", args.bin)
    fio = common.need_program("fio", "fio")
    mpirun = mpirun_prefix(args.ranks)
    common.need_program("gnuplot", "gnuplot-nox")
    if not args.path:
        raise common.UsageError("--path needs a non-empty directory")
    if os.path.lexists(args.path) and not os.path.isdir(args.path):
        raise common.UsageError(f"--path {args.path} is not a directory")
    # The exact byte count zinf-bench uses (12-byte elements), and fio's per-job size in MiB.
    nbytes = args.state // ELEMENT_BYTES * ELEMENT_BYTES
    job_mib = (nbytes // args.ranks + 1048575) // 1048576
    fio_bytes = job_mib * 1048576 * args.ranks
    per_rank = -(-nbytes // args.ranks)
    need = 2 * nbytes + args.ranks * min(per_rank, SUB_GROUP_NUMEL * ELEMENT_BYTES)
    if common.free_bytes(args.path) < need:
        raise common.UsageError(f"the run needs about {need} bytes free under {args.path} "
                                f"(2x the state plus one sub-group per rank), "
                                f"{common.free_bytes(args.path)} are")

    out = common.fresh_dir(args.out, NAME)
    logs = out / "logs"
    logs.mkdir()
    common.make_dir(args.path)
    try:
        scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint.", dir=args.path))
    except OSError as e:
        raise common.UsageError(f"cannot make a directory in {args.path}: {e.strerror}") from None
    try:
        can_drop = args.drop_caches and drop_caches(check=True)
        if args.drop_caches and not can_drop:
            common.say(f"bench {NAME}", "cannot drop the page cache (not root?); restores may "
                       "read from it")
        results = common.Results(out)
        bounds = trials(args, results, bench, fio, mpirun, scratch, logs, nbytes, fio_bytes,
                        job_mib, can_drop)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summarize(args, out, results, bounds, can_drop)


def drop_caches(check=False):
    """sync, then drop the page cache; with check, False instead of an error when it cannot."""
    os.sync()
    try:
        with open(DROP_CACHES, "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError:
        if check:
            return False
        raise
    return True


def trials(args, results, bench, fio, mpirun, scratch, logs, nbytes, fio_bytes, job_mib,
           can_drop):
    """Emits one JSON line per trial; returns the bound of each trial in seconds (unrounded)."""
    bounds = []
    for t in range(1, args.trials + 1):
        times = {}
        for tool in common.rotate(("ckpt", "fio"), t - 1):
            if tool == "fio":
                fio_dir = scratch / "fio"
                shutil.rmtree(fio_dir, ignore_errors=True)
                fio_dir.mkdir()
                for rw in ("write", "read"):
                    times[f"fio_{rw}"] = run_fio(fio, fio_dir, rw, args.ranks, job_mib, t, logs,
                                                 can_drop)
                shutil.rmtree(fio_dir, ignore_errors=True)
            else:
                times.update(run_ckpt(args, bench, mpirun, scratch, t, logs, nbytes, can_drop))
        w, r = times["fio_write"], times["fio_read"]
        bound = (w + r) * nbytes / fio_bytes  # fio moved fio_bytes >= nbytes: scale to nbytes
        row = {"trial": t, "bytes": nbytes, "ranks": args.ranks, "fio_jobs": args.ranks,
               "fio_write_s": round(w, 3), "fio_read_s": round(r, 3), "bound_s": round(bound, 3),
               "fio_write_gb_per_s": round(fio_bytes / w / 1e9, 3),
               "fio_read_gb_per_s": round(fio_bytes / r / 1e9, 3)}
        for op in OPS:
            s = times[op]
            row.update({f"{op}_s": round(s, 3), f"{op}_gb_per_s": round(nbytes / s / 1e9, 3),
                        f"{op}_ratio": round(s / bound, 3)})
        results.emit(row)
        bounds.append(bound)
    return bounds


def run_fio(fio, directory, rw, ranks, job_mib, trial, logs, can_drop):
    """Seconds of one fio pass (write or read) over RANKS files of job_mib MiB in `directory`:
    the group's bytes / aggregate bandwidth (fio's own clock, so neither process start nor file
    layout counts)."""
    if can_drop:
        drop_caches()
    cmd = [fio, "--name=zinf-ckpt-bound", f"--directory={directory}", "--ioengine=io_uring",
           "--direct=1", "--bs=1M", "--iodepth=8", f"--numjobs={ranks}", f"--size={job_mib}M",
           f"--rw={rw}", "--group_reporting", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    text = common.run(cmd, log=logs / f"fio-{rw}-{trial}.log")
    (logs / f"fio-{rw}-{trial}.json").write_text(text, encoding="utf-8")
    try:
        job = json.loads(text[text.index("{"):])["jobs"][0][rw]
        seconds = job["io_bytes"] / job["bw_bytes"]
        if not seconds > 0:
            raise ValueError
        return seconds
    except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError):
        raise common.RunError(f"fio {rw}: no figures in its JSON "
                              f"({logs / f'fio-{rw}-{trial}.json'})") from None


def run_ckpt(args, bench, mpirun, scratch, trial, logs, nbytes, can_drop):
    """{save, restore, restore_single_pass: seconds} of one mpirun of zinf-bench ckpt; its JSON
    lines stay in the log."""
    cmd = mpirun + [bench, "ckpt", "--path", scratch / "swap", "--dir", scratch / "ckpt",
                    "--state-bytes", nbytes, "--trials", 1, "--single-pass"]
    if can_drop:
        cmd.append("--drop-caches")
    text = common.run(cmd, log=logs / f"ckpt-{trial}.log")
    (logs / f"ckpt-{trial}.json").write_text(text, encoding="utf-8")
    shutil.rmtree(scratch / "ckpt", ignore_errors=True)
    times = {}
    for o in common.json_lines(text, "zinf-bench ckpt"):
        if o.get("op") == "save":
            op = "save"
        elif o.get("op") == "restore":
            op = "restore" if o.get("verify_before_write", True) else "restore_single_pass"
        else:
            continue
        seconds = o.get("seconds")
        ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0
        times[op] = float(seconds) if ok else None
        if o.get("bytes") != nbytes:
            raise common.RunError(f"zinf-bench ckpt {op} moved {o.get('bytes')} bytes, "
                                  f"expected {nbytes} (log: {logs / f'ckpt-{trial}.json'})")
    missing = [op for op in OPS if times.get(op) is None]
    if missing:
        raise common.RunError(f"zinf-bench ckpt (trial {trial}) gave no seconds for "
                              f"{', '.join(missing)} (log: {logs / f'ckpt-{trial}.json'})")
    return times


def summarize(args, out, results, bounds, dropped):
    rows = list(results.records)  # the trials: the summaries join results.records below
    state = common.size_text(args.state)
    machine = common.machine()
    ok = True
    human, summaries = [], []

    def med(key):
        return common.median(r[key] for r in rows)

    for op in OPS:
        m = med(f"{op}_ratio")
        passed = m <= args.target
        if op != "restore":
            ok = ok and passed  # verify-first reads twice: reported, not judged
        summaries.append(results.emit({
            "summary": True, "op": op, "trials": len(rows), "state": state,
            "bytes": rows[0]["bytes"], "ranks": rows[0]["ranks"], "median_ratio": round(m, 3),
            "target": args.target, "pass": passed, "median_s": round(med(f"{op}_s"), 3),
            "median_gb_per_s": round(med(f"{op}_gb_per_s"), 3),
            "median_bound_s": round(med("bound_s"), 3),
            "median_fio_write_gb_per_s": round(med("fio_write_gb_per_s"), 3),
            "median_fio_read_gb_per_s": round(med("fio_read_gb_per_s"), 3),
            "cache_dropped": dropped, "machine": machine}))
        ratios = ", ".join("%.3f" % r[f"{op}_ratio"] for r in rows)
        human.append("%-19s: ratios %s; median %.3f (%s %.2f%s) at %.2f GB/s" %
                     (op, ratios, m, "<=" if passed else ">", args.target,
                      ", verify first: reported, not judged" if op == "restore" else "",
                      med(f"{op}_gb_per_s")))
    write_csv(out / f"{NAME}.csv", rows, summaries)
    draw(out / f"{NAME}.png", summaries, rows[0]["bytes"] / common.median(bounds) / 1e9)
    print("checkpoint vs copy bound (fio write + read, %d jobs, io_uring, O_DIRECT, bs 1M, qd 8; "
          "state %s on %d ranks; page cache %s):" % (rows[0]["ranks"], state, rows[0]["ranks"],
                                                     "dropped" if dropped else "NOT dropped"),
          file=sys.stderr)
    print("  bound median %.2f s (fio write %.2f GB/s, read %.2f GB/s)" %
          (med("bound_s"), med("fio_write_gb_per_s"), med("fio_read_gb_per_s")),
          file=sys.stderr)
    for h in human:
        print("  " + h, file=sys.stderr)
    print("  " + ("PASS" if ok else "FAIL"), file=sys.stderr)
    return 0 if ok else 1


def write_csv(path, rows, summaries):
    """The trials as CSV (a header, one row per trial), the summaries as "# JSON" lines."""
    keys = list(rows[0].keys())
    lines = [",".join(keys)] + [",".join(str(r.get(k, "")) for k in keys) for r in rows]
    lines += ["# " + json.dumps({k: v for k, v in s.items() if k != "machine"})
              for s in summaries]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def draw(png, summaries, bound_gb_per_s):
    """Median GB/s of each operation beside the copy bound's (the checkpoint's bytes over the
    median fio write + read time) and the slowest figure that passes (bound / target)."""
    labels = {"save": "save", "restore": "restore, verify 1st",
              "restore_single_pass": "restore, 1 pass"}
    groups = [labels[s["op"]] for s in summaries]
    s0 = summaries[0]
    plot.bars(png, groups, [
        ("checkpoint", [s["median_gb_per_s"] for s in summaries]),
        ("fio copy bound", [bound_gb_per_s] * len(groups)),
        (f"bound / {s0['target']:g}", [bound_gb_per_s / s0["target"]] * len(groups)),
    ], title=f"checkpoint vs copy bound: {s0['state']}, {s0['ranks']} ranks, "
             f"{s0['trials']} trials, cache {'dropped' if s0['cache_dropped'] else 'kept'}",
       ylabel="GB/s (state bytes / seconds, median)", width=1000)
