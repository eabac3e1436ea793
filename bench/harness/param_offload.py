"""ZeRO stage 3 with offload_param nvme (zinf-bench offload-param), on --np ranks:
  1. side by side on one model, the order rotated each round: the offload run against the same
     model in memory and against the I/O alone; each round gives offload / max(memory, io);
  2. the memory run (root, cgroup v1 or v2): all ranks inside a memory cgroup whose limit is
     half the model's fp32 weights train it with everything on NVMe; it must complete with the
     loss falling, and the group's peak usage is reported (v1 memory.max_usage_in_bytes, v2
     memory.peak).

    python3 bench/run.py param-offload [--path DIR] [--bin ZINF_BENCH] [--layers 64]
                                       [--hidden 2048] [--rounds 2] [--steps 3] [--np 2]
                                       [--no-memory-run] [--no-side-by-side]

The model: --layers layers of tanh(x W + b), W [hidden, hidden]: layers x (hidden^2 + hidden)
parameters. JSON lines: zinf-bench's (one per mode and round, "part": "side-by-side", with
step_seconds and its parts gather/compute/optimizer_seconds, the shards read, loss_first and
loss_last, peak_rss_bytes; one per round with offload_over_max_memory_io), the side by side's
summary (per mode the median over the rounds, and the median ratio), then the memory run's
lines and its summary {"bench": "offload-param-memory-run", "ranks", "weights_bytes",
"limit_bytes", "group_peak_bytes", "failcnt" (cgroup v1 only, else null), "oom_kills", "exit",
"loss_falls"}. The picture: the median step time of each mode and its parts.

Needs free space in --path for about 20 bytes per parameter (state, gradient, spare sub-groups)
and, for the side by side's memory mode, about 16 bytes per parameter of RAM. Exit 1 when a run
fails, or when the memory run does not finish or its loss does not fall (so it needs --steps 2
or more).
"""
import os
import subprocess
import time
from pathlib import Path

from . import common, plot

HELP = "stage 3 offload_param nvme vs in memory vs I/O alone, and the cgroup memory run"
NAME = "param-offload"
MODES = ("offload", "memory", "io")
PARTS = (("step", "step_seconds"), ("gather", "gather_seconds"),
         ("compute", "compute_seconds"), ("optimizer", "optimizer_seconds"))
CGROUP = Path("/sys/fs/cgroup")


def add_arguments(p):
    p.add_argument("--path", default="/tmp/zinf-bench-param",
                   help="directory of the swapped parameters and state (default %(default)s)")
    p.add_argument("--bin", help="zinf-bench (default build/bin/zinf-bench)")
    p.add_argument("--layers", type=common.count(1, 4096), default=64,
                   help="layers of the model (default %(default)s)")
    p.add_argument("--hidden", type=common.count(1, 65536), default=2048,
                   help="width of each layer (default %(default)s)")
    p.add_argument("--rounds", type=common.count(1, 100), default=2,
                   help="side-by-side rounds, the mode order rotated each (default %(default)s)")
    p.add_argument("--steps", type=common.count(1, 1000), default=3,
                   help="timed steps per mode (after one warm-up; default %(default)s)")
    p.add_argument("--np", type=common.count(1, 1024), default=2,
                   help="ranks (default %(default)s)")
    p.add_argument("--no-memory-run", dest="memory_run", action="store_false",
                   help="skip the memory run (it needs root and a memory cgroup controller)")
    p.add_argument("--no-side-by-side", dest="side_by_side", action="store_false",
                   help="skip the side-by-side rounds")


def run(args):
    bench = common.tool("zinf-bench", args.bin)
    if not args.side_by_side and not args.memory_run:
        raise common.UsageError("--no-side-by-side and --no-memory-run: nothing to run")
    if args.memory_run and args.steps < 2:
        raise common.UsageError("the memory run needs --steps 2 or more: its loss must fall "
                                "from the first timed step to the last (or pass --no-memory-run)")
    mpirun = common.mpirun(args.np)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    weights = params * 4
    need = params * 20
    avail = common.free_bytes(args.path)
    if avail < need:
        raise common.UsageError(f"needs about {need} bytes free in {args.path}, {avail} "
                                "available")
    limit = weights // 2
    group = None
    if args.memory_run:
        # Made before anything else, so that a machine without the controller stops here.
        group = MemoryGroup.make(f"zinf-bench-param-{os.getpid()}", limit)
    try:
        return _run(args, bench, mpirun, params, weights, limit, group)
    finally:
        if group is not None:
            group.remove()


def _run(args, bench, mpirun, params, weights, limit, group):
    common.make_dir(args.path)
    out = common.fresh_dir(args.out, NAME)
    logs = common.make_dir(out / "logs")
    results = common.Results(out)
    machine = common.machine()
    common.say(NAME, f"{params} parameters ({weights} bytes of fp32 weights) on {args.np} "
                     "ranks")
    model = ["offload-param", "--path", args.path, "--layers", args.layers, "--hidden",
             args.hidden, "--steps", args.steps]
    side = None
    if args.side_by_side:
        text = common.run(mpirun + [bench] + model + ["--rounds", args.rounds, "--json"],
                          log=logs / "side-by-side.log")
        for record in common.json_lines(text, "zinf-bench offload-param"):
            results.emit({"part": "side-by-side", **record})
        side = results.emit(side_summary(results.where(part="side-by-side"), args, params,
                                         weights, machine))
    memory = None
    failure = None
    if group is not None:
        common.say(NAME, f"memory run: {weights} bytes of weights, group limit {limit} bytes")
        memory, failure = memory_run(mpirun + [bench] + model + ["--modes", "offload", "--json"],
                                     group, logs / "memory-run.log", results)
        memory = results.emit({"bench": "offload-param-memory-run", "summary": "memory-run",
                               "ranks": args.np, "weights_bytes": weights,
                               "limit_bytes": limit, **memory, "machine": machine})
    draw(out / f"{NAME}.png", side, memory, args)
    if failure:
        raise common.RunError(failure)
    return 0


def side_summary(records, args, params, weights, machine):
    """Per mode the medians over the rounds of the step time and its parts; the median of the
    rounds' offload / max(memory, io)."""
    summary = {"bench": "offload-param", "summary": "side-by-side", "ranks": args.np,
               "layers": args.layers, "hidden": args.hidden, "params": params,
               "weights_bytes": weights, "rounds": args.rounds, "steps": args.steps}
    for mode in MODES:
        rows = [r for r in records if r.get("mode") == mode]
        for _, key in PARTS:
            summary[f"{mode}_{key}"] = common.finite(common.median([r.get(key) for r in rows]))
    ratios = [r["offload_over_max_memory_io"] for r in records
              if "offload_over_max_memory_io" in r]
    summary["offload_over_max_memory_io"] = common.finite(common.median(ratios))
    summary["machine"] = machine
    return summary


def memory_run(cmd, group, log, results):
    """Runs `cmd` (mpirun and its ranks) inside `group`; its JSON lines emitted with "part":
    "memory-run". Returns the fields of the memory run's summary and, when it failed, why."""
    procs = str(group.path / "cgroup.procs")

    def join():  # in the child, before exec: mpirun and every rank are born inside the group
        with open(procs, "w", encoding="ascii") as f:
            f.write(str(os.getpid()))

    started = None
    with open(log, "w", encoding="utf-8") as err:
        try:
            done = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=err,
                                  text=True, preexec_fn=join, check=False)
        except (OSError, subprocess.SubprocessError) as e:  # joining the group or exec failed
            started = f"cannot start {Path(str(cmd[0])).name} in {group.path}: {e}"
            err.write(started + "\n")
    records = []
    if started is None:
        rc = done.returncode if done.returncode >= 0 else 128 - done.returncode  # as a shell
        try:
            records = common.json_lines(done.stdout, "zinf-bench offload-param (memory run)")
        except common.RunError:
            pass
    else:
        rc = 127
    for record in records:
        results.emit({"part": "memory-run", **record})
    offload = [r for r in records if r.get("mode") == "offload"]
    falls = False
    if offload:
        first, last = offload[-1].get("loss_first"), offload[-1].get("loss_last")
        falls = _number(first) and _number(last) and last < first
    fields = {"group_peak_bytes": group.peak(), "failcnt": group.failcnt(),
              "oom_kills": group.ooms() or 0, "exit": rc, "loss_falls": bool(falls)}
    failure = None
    if rc != 0 or not falls:
        failure = f"memory run failed (exit {rc}, loss falls: {str(bool(falls)).lower()}; " \
                  f"log: {log})" + (f": {started}" if started else "")
    return fields, failure


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def draw(png, side, memory, args):
    """The side by side: per mode the median step time and its parts (the memory run's peak in
    the title); without it, the memory run's weights, limit and peak."""
    model = f"offload-param {args.layers} x {args.hidden}, {args.np} rank(s)"
    if memory is not None:
        peak = memory.get("group_peak_bytes")
        verdict = "loss falls" if memory["loss_falls"] else "FAILED"
        note = (f"memory run: {verdict}, peak {peak / 2**20:.0f} of "
                f"{memory['limit_bytes'] / 2**20:.0f} MiB" if peak is not None else
                f"memory run: {verdict}")
    if side is not None:
        title = f"{model}, median of {args.rounds} round(s)"
        if memory is not None:
            title += f"; {note}"
        plot.bars(png, list(MODES),
                  [(label, [side.get(f"{mode}_{key}") for mode in MODES]) for label, key in PARTS],
                  title=title, ylabel="seconds", width=1100)
    else:
        mib = lambda v: None if v is None else v / 2**20  # noqa: E731
        plot.bars(png, ["memory run"],
                  [("fp32 weights", [mib(memory["weights_bytes"])]),
                   ("group limit", [mib(memory["limit_bytes"])]),
                   ("group peak", [mib(memory.get("group_peak_bytes"))])],
                  title=f"{model} in a memory cgroup: {note}", ylabel="MiB", width=1100)


class MemoryGroup:
    """A memory cgroup for the memory run (as launch/lib/cgroup.sh): cgroup v1 at
    /sys/fs/cgroup/memory, or v2 at /sys/fs/cgroup with "memory" in cgroup.subtree_control
    (enabled here when it is not). The limit holds anonymous memory and page cache; swap is kept
    out, so a run that needs more is killed by the OOM killer instead of swapping. Never touches
    anything outside the group it made."""

    def __init__(self, path, kind):
        self.path, self.kind = path, kind

    @staticmethod
    def hierarchy():
        """"v1" or "v2", or a UsageError saying why no memory cgroup can be made here."""
        hint = "; or pass --no-memory-run"
        if os.geteuid() != 0:
            raise common.UsageError(f"the memory run needs root (this is uid {os.geteuid()}) "
                                    f"and a memory cgroup controller{hint}")
        v1 = CGROUP / "memory"
        if (v1 / "memory.limit_in_bytes").is_file():
            if os.access(v1, os.W_OK):
                return "v1"
            raise common.UsageError(f"the memory run needs a writable memory cgroup: {v1} is "
                                    f"not writable (mounted read-only?){hint}")
        controllers = CGROUP / "cgroup.controllers"
        if controllers.is_file():
            if "memory" not in controllers.read_text().split():
                raise common.UsageError(f"the memory run needs a memory cgroup controller: the "
                                        f"cgroup v2 hierarchy at {CGROUP} has none{hint}")
            if not os.access(CGROUP / "cgroup.subtree_control", os.W_OK):
                raise common.UsageError(f"the memory run needs a writable memory cgroup: the "
                                        f"cgroup v2 hierarchy at {CGROUP} is not writable{hint}")
            return "v2"
        raise common.UsageError(f"the memory run needs a memory cgroup controller: neither "
                                f"cgroup v1 ({v1}) nor cgroup v2 with a memory controller is "
                                f"mounted{hint}")

    @classmethod
    def make(cls, name, limit):
        """The new group `name` with the memory limit `limit` bytes; a UsageError saying why
        when it cannot be made (whatever was made removed)."""
        kind = cls.hierarchy()
        hint = "; or pass --no-memory-run"
        if kind == "v1":
            path = CGROUP / "memory" / name
        else:
            path = CGROUP / name
            control = CGROUP / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                try:
                    control.write_text("+memory")
                except OSError:
                    raise common.UsageError(
                        f"the memory run needs the cgroup v2 memory controller for the children "
                        f"of {CGROUP}: writing +memory to its cgroup.subtree_control failed (the "
                        f"root group of a container holds processes?){hint}") from None
        try:
            path.mkdir()
        except OSError as e:
            raise common.UsageError(f"the memory run needs a memory cgroup: cannot make {path} "
                                    f"({e.strerror}){hint}") from None
        group = cls(path, kind)
        try:
            if kind == "v1":
                (path / "memory.limit_in_bytes").write_text(str(limit))
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            else:
                (path / "memory.max").write_text(str(limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
        except OSError as e:
            group.remove()
            raise common.UsageError(f"the memory run needs a memory cgroup: cannot set the "
                                    f"memory limit of {path} to {limit} bytes ({e.strerror})"
                                    f"{hint}") from None
        return group

    def _read(self, name):
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def _int(self, name):
        text = self._read(name)
        try:
            return int(text.split()[0]) if text else None
        except ValueError:
            return None

    def _key(self, name, key):
        for line in (self._read(name) or "").splitlines():
            words = line.split()
            if len(words) == 2 and words[0] == key and words[1].isdigit():
                return int(words[1])
        return None

    def peak(self):
        """The group's peak usage in bytes (v1 memory.max_usage_in_bytes, v2 memory.peak, which
        kernels before 5.19 lack: then None)."""
        if (self.path / "memory.max_usage_in_bytes").exists():
            return self._int("memory.max_usage_in_bytes")
        return self._int("memory.peak")

    def failcnt(self):
        """The times the group hit its limit (cgroup v1 only, else None)."""
        return self._int("memory.failcnt")

    def ooms(self):
        """How many of the group's processes the OOM killer killed (v1 memory.oom_control
        oom_kill, v2 memory.events oom_kill; v1 kernels without the count: memory.failcnt)."""
        count = self._key("memory.oom_control", "oom_kill")
        if count is not None:
            return count
        if (self.path / "memory.failcnt").exists():
            return self._int("memory.failcnt")
        return self._key("memory.events", "oom_kill")

    def remove(self):
        """Removes the group once its processes are gone (waits up to 10 s for exiting ones);
        never fails the caller."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        left = (self._read("cgroup.procs") or "").split()
        common.say(NAME, f"could not remove the memory cgroup {self.path} (processes still in "
                         f"it: {' '.join(left)})")
