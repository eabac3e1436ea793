"""zinf's checkpoints in DeepSpeed's tools and back (issue 46): DeepSpeed's own zero_to_fp32 and
ds_to_universal, run from a DeepSpeed source tree (never installed, never copied into zinf: the
shim deepspeed_shim.py loads its files by path), on zinf's exports, zinf's import on their outputs,
and the speed of export and import against a plain copy of the same bytes.

    python3 bench/run.py deepspeed-compat [--ds-src TREE|TARBALL] [--np 2] [--world-sizes 1,2,3,4]
                                          [--states fp32,q8] [--params 10007] [--tensors 5]
                                          [--size 16M] [--rounds 3] [--path DIR]
                                          [--no-drop-caches] [--train PATH] [--ckpt PATH]
                                          [--python /usr/bin/python3]

--ds-src: a DeepSpeed source tree (a directory holding deepspeed/) or DeepSpeed's source tarball
(.tar.xz; its deepspeed/ and version.txt are unpacked into OUT/deepspeed-src); default
../shared/bench/deepspeed/deepspeed-src.tar.xz beside the repository. Without either, or with
one that lacks deepspeed/utils/zero_to_fp32.py or deepspeed/checkpoint/ds_to_universal.py, the run
exits 2 ("not found") before anything is made. The tools run in --python (torch; Debian's
/usr/bin/python3 has torch 1.13), their API as tests/interop does: zero_to_fp32's
get_fp32_state_dict_from_zero_checkpoint and convert_zero_checkpoint_to_fp32_state_dict
(max_shard_size=None: its CLI needs huggingface_hub), ds_to_universal's command line (runpy,
--num_extract_workers 1 --num_merge_workers 1).

Checks. For each state in --states, zinf-train (mpirun -np NP) trains a synthetic model of
--params parameters in --tensors tensors for 3 steps with --optimizer-state STATE and saves a
checkpoint; `zinf-ckpt export --format safetensors --moments` of it is the reference (zinf's fp32
weights and moments, a q8 checkpoint's decoded). Then for each W in --world-sizes:
  export_deepspeed        zinf-ckpt export --format deepspeed --world-size W (ZeRO stage 2) runs
  zero_to_fp32            DeepSpeed's zero_to_fp32 (both API calls) gives every parameter of the
                          reference, bitwise, and no other
  ds_to_universal         DeepSpeed's ds_to_universal converts the export; its fp32, exp_avg and
                          exp_avg_sq of every parameter equal the reference bitwise, its step.pt
                          is the Adam step (global_steps - skipped_steps of the export)
  universal_export        (zinf-ckpt with --format deepspeed-universal) zinf's universal export
                          for W equals ds_to_universal's output: the same files, latest_universal,
                          and every .pt the same objects (tensors bitwise, dtype and shape; dict
                          keys in any order; DeepSpeed's classes by name and attributes)
  import_deepspeed        (zinf-ckpt with import-deepspeed) zinf-ckpt import-deepspeed of the
                          export; `zinf-ckpt verify` passes on the file, and its `export --format
                          safetensors --moments` holds the reference's tensors bitwise, in the
                          same order, and its step
  import_universal        (zinf-ckpt with import-deepspeed) the same for ds_to_universal's
                          output (its tag folder); while `import-deepspeed --help` does not name
                          universal checkpoints, a failure there is a skip, not a fail
One JSON line per check: {"check", "state", "world_size", "pass", "detail" or "reason"}; a check
that a zinf-ckpt without the feature cannot make is a line {"check", ..., "skipped": "zinf-ckpt
has no import-deepspeed"}, as are the checks after a failed one that need its output. The files
stay in OUT/checks/STATE/ (the DeepSpeed tools' output in tools-W*/), the logs in OUT/logs/.

Speed (--rounds R > 0). zinf-train trains a synthetic model of --size parameters (1 step, fp32
state); zinf-ckpt exports it once to DeepSpeed's layout for NP ranks (the source, untimed). Each
round then times, in an order rotated every round (common.rotate):
  export   zinf-ckpt export --format deepspeed --world-size NP of the zinf checkpoint
  import   zinf-ckpt import-deepspeed of the source (when zinf-ckpt has it and its checks passed;
           it checks the file it wrote as `verify` does, reading it again, before the rename)
  copy     cp -r --reflink=never of the source to a new directory on the same file system, then
           fsync of every file and directory it made (zinf-ckpt fsyncs what it writes)
each into a new directory under a scratch directory made in --path (removed at the end), its
output removed after it. The plain copy reads and writes the DeepSpeed directory's bytes: what
export writes and import reads. As root, the page cache is dropped (sync, then 3 into
/proc/sys/vm/drop_caches) before every timed run, so each reads from the disk ("cache_dropped"
in the JSON; --no-drop-caches keeps it: the drop is machine-wide). Seconds are wall-clock,
process start included. One JSON line per timed run, then a summary line per operation: medians,
the median over rounds of zinf / copy ("median_ratio"; < 1: faster than the copy), GB/s of the
DeepSpeed directory's bytes; OUT/deepspeed-compat.png draws the median seconds. Space under
--path: about 60 bytes per parameter of --size.

Then the summary line: checks passed, failed, skipped, in all and per check ("by_check"), the
DeepSpeed version, what zinf-ckpt can do, "machine"; a human summary on stderr.

Exit status: 0 when every check made passed; 1 when a check failed (each named with its reason
on stderr) or a run failed; 2 for a bad command line or a missing tool or DeepSpeed tree, before
anything is made.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import common, plot
from .checkpoint import DROP_CACHES, drop_caches, mpirun_prefix

HELP = "DeepSpeed's zero_to_fp32 and ds_to_universal on zinf's exports, zinf's import back, speed"
NAME = "deepspeed-compat"

STATES = ("fp32", "q8")
TARBALL = common.REPO.parent / "shared" / "bench" / "deepspeed" / "deepspeed-src.tar.xz"
TOOL_FILES = ("deepspeed/utils/zero_to_fp32.py", "deepspeed/checkpoint/ds_to_universal.py")
CHECK_STEPS = 3
BYTES_PER_PARAM = 60  # swap 12 + zinf file 12 + DeepSpeed source 16 + one timed output 16, rounded
TOOL_CHECKS = ("zero_to_fp32", "ds_to_universal", "universal_export")
ENV = {"ZINF_LOG_LEVEL": "warn", "OMPI_MCA_mpi_yield_when_idle": "1",
       "PYTHONDONTWRITEBYTECODE": "1"}


def add_arguments(p):
    p.add_argument("--ds-src", default=str(TARBALL),
                   help="DeepSpeed's source: a directory holding deepspeed/, or its source "
                        "tarball (.tar.xz, unpacked into OUT) (default %(default)s)")
    p.add_argument("--np", type=common.count(1, 64), default=2,
                   help="MPI ranks of zinf-train, and the world size of the timed layout "
                        "(default 2)")
    p.add_argument("--world-sizes", type=common.counts(1, 4096, most=16), default=[1, 2, 3, 4],
                   help="DeepSpeed data-parallel world sizes exported and checked "
                        "(default 1,2,3,4)")
    p.add_argument("--states", type=common.one_of(STATES, many=True), default=list(STATES),
                   help="zinf optimizer states checked: fp32, q8 (default both)")
    p.add_argument("--params", type=common.size(1, 1 << 30, unit="elements"), default=10007,
                   help="parameters of the checked model (default 10007)")
    p.add_argument("--tensors", type=common.count(1, 4096), default=5,
                   help="parameter tensors of both models, at most --params (default 5)")
    p.add_argument("--size", type=common.size(1, 1 << 40, unit="elements"), default=16 << 20,
                   help="parameters of the timed model (default 16M: a 256 MiB DeepSpeed "
                        "directory)")
    p.add_argument("--rounds", type=common.count(0, 1000), default=3,
                   help="timed rounds, the order rotated each round; 0: no timing, no picture "
                        "(default 3)")
    p.add_argument("--path", default="/tmp/zinf-bench-deepspeed-compat",
                   help="directory in which the timed part makes (and removes) its scratch "
                        "directory (default %(default)s)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache before every timed run")
    p.add_argument("--train", help="zinf-train (default build/bin/zinf-train)")
    p.add_argument("--ckpt", help="zinf-ckpt (default build/bin/zinf-ckpt)")
    p.add_argument("--python", default=str(common.PYTHON),
                   help="the python with torch that runs DeepSpeed's tools (default %(default)s)")


# --- what is at hand -------------------------------------------------------------------------

def deepspeed_source(text):
    """(tree, None) for a DeepSpeed source tree, (None, tarball) for its source tarball; a
    UsageError ("not found") for anything else."""
    path = Path(text).absolute()
    hint = "give --ds-src a directory holding deepspeed/ or DeepSpeed's source tarball"
    if path.is_dir():
        for name in TOOL_FILES:
            if not (path / name).is_file():
                raise common.UsageError(f"DeepSpeed's tools not found: no {path / name} ({hint})")
        return path, None
    if not path.is_file():
        raise common.UsageError(f"DeepSpeed's source not found: no {path} ({hint})")
    common.need_program("tar", "tar")
    common.need_program("xz", "xz-utils")
    try:
        listing = subprocess.run(["tar", "-tJf", str(path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        listing = None
    names = set(listing.stdout.split()) if listing and listing.returncode == 0 else set()
    for name in TOOL_FILES:
        if name not in names:
            raise common.UsageError(f"DeepSpeed's tools not found: {path} is not a tar.xz "
                                    f"holding {name} ({hint})")
    return None, path


def unpack(tarball, into):
    """deepspeed/ (and version.txt when there is one) of the tarball, unpacked into `into`."""
    into.mkdir()
    names = subprocess.run(["tar", "-tJf", str(tarball)], stdout=subprocess.PIPE, text=True,
                           check=False).stdout.split()
    members = ["deepspeed"] + (["version.txt"] if "version.txt" in names else [])
    common.run(["tar", "-xJf", tarball, "-C", into] + members, timeout=600)
    return into


def ckpt_features(ckpt):
    """What this zinf-ckpt can do, from its --help texts."""
    def help_text(*words):
        try:
            done = subprocess.run([str(ckpt), *words, "--help"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise common.UsageError(f"{ckpt} --help: {e}") from None
        return done.stdout if done.returncode == 0 else ""
    has_import = re.search(r"^\s*import-deepspeed\b", help_text(), re.M) is not None
    return {"universal_export": "deepspeed-universal" in help_text("export"),
            "import": has_import,
            "universal_import": has_import and "universal" in help_text("import-deepspeed")}


def deepspeed_version(tree):
    try:
        return (tree / "version.txt").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


# --- the run ---------------------------------------------------------------------------------

def run(args):
    # Every flag, tool and input checked before anything is made (UsageError: exit 2).
    if args.tensors > args.params:
        raise common.UsageError(f"--tensors {args.tensors} is more than --params {args.params}")
    if args.rounds and args.tensors > args.size:
        raise common.UsageError(f"--tensors {args.tensors} is more than --size {args.size}")
    if args.rounds:
        if os.path.lexists(args.path) and not os.path.isdir(args.path):
            raise common.UsageError(f"--path {args.path} is not a directory")
        need = BYTES_PER_PARAM * args.size
        if common.free_bytes(args.path) < need:
            raise common.UsageError(f"the timed part needs about {need} bytes free under "
                                    f"{args.path} ({BYTES_PER_PARAM} per parameter of --size), "
                                    f"{common.free_bytes(args.path)} are")
    tree, tarball = deepspeed_source(args.ds_src)
    train = common.tool("zinf-train", args.train)
    ckpt = common.tool("zinf-ckpt", args.ckpt)
    python = common.torch_python(args.python).absolute()  # the worker runs in bench/
    mpirun = mpirun_prefix(args.np)
    if args.rounds:
        common.need_program("gnuplot", "gnuplot-nox")
        common.need_program("cp", "coreutils")
    features = ckpt_features(ckpt)

    out = common.fresh_dir(args.out, NAME).resolve()
    logs = common.make_dir(out / "logs")
    if tree is None:
        tree = unpack(tarball, out / "deepspeed-src")
    results = common.Results(out)
    compat = Compat(args, train, ckpt, python, mpirun, tree, features, out, logs, results)
    for state in args.states:
        compat.checks(state)
    speed = []
    if args.rounds:
        common.make_dir(args.path)
        try:
            scratch = Path(tempfile.mkdtemp(prefix="bench-deepspeed-compat.", dir=args.path))
        except OSError as e:
            raise common.RunError(f"cannot make a directory in {args.path}: {e.strerror}") \
                from None
        try:
            speed = compat.speed(scratch.resolve())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return compat.summarize(speed)


class Compat:
    def __init__(self, args, train, ckpt, python, mpirun, tree, features, out, logs, results):
        self.args, self.train, self.ckpt, self.python = args, train, ckpt, python
        self.mpirun, self.tree, self.features = mpirun, tree, features
        self.out, self.logs, self.results = out, logs, results
        self.failed = []  # (check, state, world_size, reason)
        self.import_ok = True  # no import check failed: the timed import may run

    # -- records --

    def emit(self, check, state, world, passed, text):
        record = {"bench": "deepspeed_compat", "check": check, "state": state,
                  "world_size": world, "pass": passed, ("detail" if passed else "reason"): text}
        if not passed:
            self.failed.append((check, state, world, text))
            if check.startswith("import"):
                self.import_ok = False
        return self.results.emit(record)

    def skip(self, check, state, world, why):
        return self.results.emit({"bench": "deepspeed_compat", "check": check, "state": state,
                                  "world_size": world, "skipped": why})

    # -- programs --

    def attempt(self, cmd, log, timeout=600):
        """Runs cmd (its stdout and stderr into log); None when it exits 0, else why not."""
        cmd = [str(c) for c in cmd]
        with open(log, "w", encoding="utf-8") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                    env={**os.environ, **ENV}, check=False).returncode
            except subprocess.TimeoutExpired:
                return f"{Path(cmd[0]).name} {cmd[1]} did not finish within {timeout} s ({log})"
        if rc == 0:
            return None
        tail = Path(log).read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return (f"{Path(cmd[0]).name} {cmd[1]} exited {rc} ({log}): "
                + " | ".join(tail[-3:]))

    def train_model(self, label, directory, params, state, steps):
        """A zinf checkpoint of a synthetic model in directory/ckpt, its swap in directory/swap
        removed after (a RunError when zinf-train fails)."""
        swap = directory / "swap"
        config = directory / "synthetic.json"
        config.write_text(json.dumps({
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zinf": {"model": {"name": "synthetic", "total_params": params,
                               "num_params": self.args.tensors}}}) + "\n", encoding="utf-8")
        common.make_dir(swap)
        common.run(self.mpirun + [self.train, "--config", config, "--steps", steps,
                                  "--nvme-path", swap, "--optimizer-state", state,
                                  "--checkpoint-dir", directory / "ckpt",
                                  "--checkpoint-every", steps],
                   log=self.logs / f"zinf-train-{label}.log",
                   timeout=600 + params // 100_000, env=ENV)
        shutil.rmtree(swap, ignore_errors=True)
        return directory / "ckpt"

    # -- checks --

    def checks(self, state):
        work = common.make_dir(self.out / "checks" / state)
        source = self.train_model(state, work, self.args.params, state, CHECK_STEPS)
        reference = work / "reference.safetensors"
        common.run([self.ckpt, "export", source, "--format", "safetensors", "--moments",
                    "--out", reference], log=self.logs / f"{state}-reference.log", env=ENV)
        cases = []
        for w in self.args.world_sizes:
            ds = work / f"ds-W{w}"
            why = self.attempt([self.ckpt, "export", source, "--format", "deepspeed", "--out", ds,
                                "--world-size", w, "--stage", 2],
                               self.logs / f"{state}-export-W{w}.log")
            self.emit("export_deepspeed", state, w, why is None,
                      why or f"{tree_bytes(ds)} bytes in {ds.name}/")
            if why:
                for check in TOOL_CHECKS + ("import_deepspeed", "import_universal"):
                    self.skip(check, state, w, "the export to DeepSpeed's layout failed")
                continue
            case = {"world_size": w, "ds_dir": str(ds), "work": str(work / f"tools-W{w}"),
                    "zinf_universal": None}
            if self.features["universal_export"]:
                zu = work / f"zinf-universal-W{w}"
                why = self.attempt([self.ckpt, "export", source, "--format",
                                    "deepspeed-universal", "--out", zu, "--world-size", w],
                                   self.logs / f"{state}-export-universal-W{w}.log")
                if why:
                    self.emit("universal_export", state, w, False, why)
                else:
                    case["zinf_universal"] = str(zu)
            cases.append(case)
        tools = self.deepspeed_tools(state, reference, cases)
        for case in cases:
            w = case["world_size"]
            self.import_check("import_deepspeed", state, w, Path(case["ds_dir"]), reference, work)
            universal = tools.get(w)
            if not self.features["import"]:
                self.skip("import_universal", state, w, "zinf-ckpt has no import-deepspeed")
            elif universal is None:
                self.skip("import_universal", state, w, "ds_to_universal failed")
            else:
                self.import_check("import_universal", state, w, Path(universal), reference, work,
                                  claimed=self.features["universal_import"])

    def deepspeed_tools(self, state, reference, cases):
        """DeepSpeed's tools on every export, in one --python process; emits their checks and
        returns {world size: ds_to_universal's output directory} for those that passed."""
        if not cases:
            return {}
        spec_path = self.out / "checks" / state / "tools.json"
        result_path = self.out / "checks" / state / "tools.jsonl"
        spec_path.write_text(json.dumps({
            "tree": str(self.tree), "reference": str(reference), "results": str(result_path),
            "cases": cases}), encoding="utf-8")
        result_path.write_text("", encoding="utf-8")
        log = self.logs / f"{state}-deepspeed-tools.log"
        why = self._worker(spec_path, log, len(cases))
        got = {}
        for line in result_path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
                got[(r["check"], r["world_size"])] = r
            except (ValueError, KeyError, TypeError):
                continue
        universal = {}
        for case in cases:
            w = case["world_size"]
            for check in TOOL_CHECKS:
                r = got.get((check, w))
                if check == "universal_export" and not self.features["universal_export"]:
                    self.skip(check, state, w, "zinf-ckpt has no --format deepspeed-universal")
                elif check == "universal_export" and case["zinf_universal"] is None:
                    continue  # its export failed: reported above
                elif r is None:
                    self.emit(check, state, w, False,
                              f"DeepSpeed's tools gave no result ({why + ', ' if why else ''}"
                              f"log: {log})")
                elif "skipped" in r:
                    self.skip(check, state, w, r["skipped"])
                else:
                    self.emit(check, state, w, bool(r.get("pass")),
                              r.get("detail") if r.get("pass") else r.get("reason"))
                    if check == "ds_to_universal" and r.get("pass"):
                        universal[w] = r.get("universal_dir")
        return universal

    def _worker(self, spec_path, log, ncases):
        """The DeepSpeed tools' process: python -m harness.deepspeed_compat worker SPEC."""
        cmd = [str(self.python), "-m", "harness.deepspeed_compat", "worker", str(spec_path)]
        with open(log, "w", encoding="utf-8") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    cwd=common.REPO / "bench", env={**os.environ, **ENV},
                                    timeout=600 + 120 * ncases, check=False).returncode
            except subprocess.TimeoutExpired:
                return "it did not finish in time"
        return None if rc == 0 else f"it exited {rc}"

    def import_check(self, check, state, w, source, reference, work, claimed=True):
        """`check` of zinf-ckpt import-deepspeed of `source`; claimed=False: its --help does not
        say it reads this kind, so a failure is a skip (a pass is reported as one)."""
        if not self.features["import"]:
            self.skip(check, state, w, "zinf-ckpt has no import-deepspeed")
            return
        kind = "universal" if check == "import_universal" else "ds"
        imported = work / f"imported-{kind}-W{w}.h5"
        again = work / f"imported-{kind}-W{w}.safetensors"
        stem = f"{state}-{check}-W{w}"
        why = self.attempt([self.ckpt, "import-deepspeed", source, "--out", imported, "--force"],
                           self.logs / f"{stem}.log")
        why = why or self.attempt([self.ckpt, "verify", imported],
                                  self.logs / f"{stem}-verify.log")
        why = why or self.attempt([self.ckpt, "export", imported, "--format", "safetensors",
                                   "--moments", "--out", again, "--force"],
                                  self.logs / f"{stem}-export.log")
        why = why or compare_safetensors(reference, again)
        if why and not claimed:
            self.skip(check, state, w, "zinf-ckpt import-deepspeed --help names no universal "
                      f"checkpoint, and it failed on one: {why}")
            return
        self.emit(check, state, w, why is None, why or (
            f"{source.name} imported into {imported.name}: verify passes; fp32 weights, exp_avg "
            "and exp_avg_sq of every parameter, their order and the step equal zinf's"
            + ("" if claimed else " (though its --help names no universal checkpoint)")))

    # -- speed --

    def speed(self, scratch):
        """The timed rounds; returns their records."""
        args = self.args
        source = self.train_model("speed", scratch, args.size, "fp32", 1)
        h5 = next(iter(sorted(source.glob("step-*.h5"))), None)
        ds = scratch / "ds-source"
        common.run([self.ckpt, "export", source, "--format", "deepspeed", "--out", ds,
                    "--world-size", args.np], log=self.logs / "speed-source.log", env=ENV,
                   timeout=3600)
        ds_bytes = tree_bytes(ds)
        can_drop = args.drop_caches and drop_caches(check=True)
        if args.drop_caches and not can_drop:
            common.say(f"bench {NAME}", f"cannot drop the page cache (not root? {DROP_CACHES}); "
                       "the timed runs may read from it")
        ops = ["export", "copy"]
        if not self.features["import"]:
            self.results.emit({"bench": "deepspeed_compat", "measure": "import",
                               "skipped": "zinf-ckpt has no import-deepspeed"})
        elif not self.import_ok:
            self.results.emit({"bench": "deepspeed_compat", "measure": "import",
                               "skipped": "an import check failed"})
        else:
            ops.append("import")
        commands = {
            "export": lambda t: [self.ckpt, "export", source, "--format", "deepspeed", "--out", t,
                                 "--world-size", args.np],
            "import": lambda t: [self.ckpt, "import-deepspeed", ds, "--out", t],
            "copy": lambda t: ["cp", "-r", "--reflink=never", ds, t]}
        records = []
        for r in range(1, args.rounds + 1):
            for op in common.rotate(ops, r - 1):
                target = scratch / f"timed-{op}"
                shutil.rmtree(target, ignore_errors=True)
                if can_drop:
                    drop_caches()
                log = self.logs / f"speed-{op}-{r}.log"
                start = time.perf_counter()
                common.run(commands[op](target), log=log, env=ENV, timeout=3600)
                if op == "copy":
                    fsync_tree(target)
                seconds = time.perf_counter() - start
                written = tree_bytes(target)
                remove(target)
                records.append(self.results.emit({
                    "bench": "deepspeed_compat", "measure": op, "round": r,
                    "seconds": round(seconds, 4), "params": args.size, "world_size": args.np,
                    "deepspeed_bytes": ds_bytes, "zinf_bytes": h5.stat().st_size if h5 else None,
                    "bytes_written": written, "gb_per_s": round(ds_bytes / seconds / 1e9, 3),
                    "cache_dropped": can_drop}))
        return records

    # -- summary --

    def summarize(self, speed):
        machine = common.machine()
        human = []
        summaries = []
        copies = {r["round"]: r["seconds"] for r in speed if r["measure"] == "copy"}
        for op in ("export", "import"):
            mine = [r for r in speed if r["measure"] == op]
            if not mine:
                continue
            med, copy = common.median(r["seconds"] for r in mine), common.median(copies.values())
            ratio = common.median(r["seconds"] / copies[r["round"]] for r in mine)
            s = self.results.emit({
                "bench": "deepspeed_compat", "summary": True, "op": op, "rounds": len(mine),
                "params": self.args.size, "world_size": self.args.np,
                "deepspeed_bytes": mine[0]["deepspeed_bytes"], "zinf_bytes": mine[0]["zinf_bytes"],
                "median_s": round(med, 4), "copy_median_s": round(copy, 4),
                "median_ratio": round(ratio, 3), "gb_per_s": round(mine[0]["deepspeed_bytes"]
                                                                   / med / 1e9, 3),
                "copy_gb_per_s": round(mine[0]["deepspeed_bytes"] / copy / 1e9, 3),
                "cache_dropped": mine[0]["cache_dropped"], "machine": machine})
            summaries.append(s)
            human.append("%-6s median %.3f s (%.2f GB/s), copy %.3f s: zinf / copy %.3f" %
                         (op, med, s["gb_per_s"], copy, ratio))
        checks = [r for r in self.results.records if "check" in r]
        passed = sum(1 for r in checks if r.get("pass") is True)
        skipped = sum(1 for r in checks if "skipped" in r)
        by_check = {}  # check -> {"passed", "failed", "skipped"}: the table of the docs
        for r in checks:
            outcome = "skipped" if "skipped" in r else "passed" if r["pass"] else "failed"
            counts = by_check.setdefault(r["check"], {"passed": 0, "failed": 0, "skipped": 0})
            counts[outcome] += 1
        self.results.emit({
            "bench": "deepspeed_compat", "summary": True, "checks": len(checks),
            "passed": passed, "failed": len(self.failed), "skipped": skipped,
            "pass": not self.failed, "by_check": by_check,
            "failures": [f"{c} ({s}, W={w})" for c, s, w, _ in self.failed],
            "deepspeed": deepspeed_version(self.tree), "ds_src": str(self.args.ds_src),
            "states": self.args.states, "world_sizes": self.args.world_sizes,
            "np": self.args.np, "params": self.args.params, "tensors": self.args.tensors,
            "zinf_ckpt": self.features, "machine": machine})
        if summaries:
            draw(self.out / f"{NAME}.png", summaries)
        name = f"bench {NAME}"
        print(f"{name}: DeepSpeed {deepspeed_version(self.tree) or '(version unknown)'} from "
              f"{self.args.ds_src}: {passed} checks passed, {len(self.failed)} failed, "
              f"{skipped} skipped", file=sys.stderr)
        for check, counts in by_check.items():
            print("  %-17s %d passed, %d failed, %d skipped" %
                  (check, counts["passed"], counts["failed"], counts["skipped"]), file=sys.stderr)
        for line in human:
            print("  " + line, file=sys.stderr)
        for check, state, w, reason in self.failed:
            print(f"{name}: FAIL {check} ({state}, W={w}): {reason}", file=sys.stderr)
        return 1 if self.failed else 0


def draw(png, summaries):
    s0 = summaries[0]
    labels = {"export": "export to DeepSpeed", "import": "import-deepspeed"}
    plot.bars(png, [labels[s["op"]] for s in summaries], [
        ("zinf-ckpt", [s["median_s"] for s in summaries]),
        ("copy (cp -r, fsync)", [s["copy_median_s"] for s in summaries]),
    ], title=f"zinf-ckpt vs copy: {common.size_text(s0['params'])} params, W={s0['world_size']}, "
             f"{s0['deepspeed_bytes'] / 1e6:.0f} MB, {s0['rounds']} rounds, "
             f"cache {'dropped' if s0['cache_dropped'] else 'kept'}",
       ylabel="seconds (median)", width=900)


# --- files -----------------------------------------------------------------------------------

def tree_bytes(path):
    """The bytes of the regular files under `path` (a file's own size for a file)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def remove(path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def fsync_tree(top):
    """fsync of every file and directory under `top` (and of top's parent): what a durable copy
    costs beside a writer that syncs."""
    for directory, _, files in os.walk(top):
        for name in files + ["."]:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(top)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_safetensors(path):
    """(metadata, {name: (dtype, shape, bytes)} in the header's order) of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    base = 8 + size
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        tensors[name] = (spec["dtype"], spec["shape"], data[base + begin:base + end])
    return header.get("__metadata__", {}), tensors


def compare_safetensors(reference, other):
    """None when `other` holds the reference's tensors (names in order, dtype, shape, bytes)
    and its step; else the first difference."""
    try:
        ref_meta, ref = read_safetensors(reference)
        meta, got = read_safetensors(other)
    except (OSError, ValueError, KeyError, struct.error) as e:
        return f"cannot read {reference} or {other}: {e}"
    if list(got) != list(ref):
        missing = [n for n in ref if n not in got]
        extra = [n for n in got if n not in ref]
        return (f"{other.name}: tensors {'missing ' + str(missing[:5]) if missing else ''}"
                f"{' extra ' + str(extra[:5]) if extra else ''}"
                f"{'' if missing or extra else ' in another order'}")
    for name, (dtype, shape, data) in ref.items():
        if got[name][:2] != (dtype, shape):
            return f"{name}: {got[name][:2]} where zinf's is {(dtype, shape)}"
        if got[name][2] != data:
            return f"{name}: the values differ from zinf's"
    if meta.get("step") != ref_meta.get("step"):
        return f"step {meta.get('step')} where zinf's is {ref_meta.get('step')}"
    return None


# --- the DeepSpeed tools' side (runs in --python, with torch) ------------------------------

def worker(spec_path):
    """Runs DeepSpeed's tools on every case of the spec; one JSON line per check appended to the
    spec's results file."""
    import contextlib
    import inspect
    import runpy
    import traceback

    import torch

    from . import deepspeed_shim

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    deepspeed_shim.install(spec["tree"])
    from deepspeed.utils import zero_to_fp32  # noqa: E402 (DeepSpeed's file, by the shim)

    int_of = {torch.float32: torch.int32, torch.float64: torch.int64,
              torch.float16: torch.int16, torch.bfloat16: torch.int16}

    def bits(t):
        t = t.detach().reshape(-1).contiguous()
        return t.view(int_of[t.dtype]) if t.dtype in int_of else t

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))

    _, raw = read_safetensors(spec["reference"])
    ref = {}
    for name, (dtype, shape, data) in raw.items():
        if dtype != "F32":
            raise SystemExit(f"{spec['reference']}: {name} is {dtype}, not F32")
        ref[name] = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
    names = [n for n in ref if "/" not in n]

    def emit(record):
        with open(spec["results"], "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def attempt(check, w, body):
        """body() returns (detail, extra keys) or raises; one line either way."""
        try:
            with contextlib.redirect_stdout(sys.stderr):
                detail, extra = body()
            emit({"check": check, "world_size": w, "pass": True, "detail": detail, **extra})
            return True
        except Exception as e:  # noqa: BLE001 (any failure of DeepSpeed's code is a result)
            traceback.print_exc()
            emit({"check": check, "world_size": w, "pass": False,
                  "reason": f"{type(e).__name__}: {e}"})
            return False
        except SystemExit as e:
            emit({"check": check, "world_size": w, "pass": False,
                  "reason": f"exited {e.code}"})
            return False

    def diff(a, b, where):
        """The first difference between a (DeepSpeed's) and b (zinf's), or None."""
        if torch.is_tensor(a) or torch.is_tensor(b):
            if not (torch.is_tensor(a) and torch.is_tensor(b)):
                return f"{where}: {type(a).__name__} vs {type(b).__name__}"
            if a.dtype != b.dtype or a.shape != b.shape:
                return f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
            return None if torch.equal(bits(a), bits(b)) else f"{where}: values differ"
        if type(a) is not type(b):
            return f"{where}: {type(a).__name__} {a!r:.60} vs {type(b).__name__} {b!r:.60}"
        if isinstance(a, dict):
            if set(a) != set(b):
                return (f"{where}: keys only in DeepSpeed's {sorted(map(str, set(a) - set(b)))}, "
                        f"only in zinf's {sorted(map(str, set(b) - set(a)))}")
            for k in a:
                d = diff(a[k], b[k], f"{where}[{k!r}]")
                if d:
                    return d
            return None
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return f"{where}: {len(a)} items vs {len(b)}"
            for i, (x, y) in enumerate(zip(a, b)):
                d = diff(x, y, f"{where}[{i}]")
                if d:
                    return d
            return None
        if isinstance(a, float):
            return None if a == b or (a != a and b != b) else f"{where}: {a!r} vs {b!r}"
        if isinstance(a, (int, str, bytes, bool, type(None))):
            return None if a == b else f"{where}: {a!r:.60} vs {b!r:.60}"
        if hasattr(a, "__dict__"):
            return diff(vars(a), vars(b), f"{where}.__dict__")
        return None if a == b else f"{where}: {a!r:.60} vs {b!r:.60}"

    for case in spec["cases"]:
        w, ds_dir, work = case["world_size"], case["ds_dir"], Path(case["work"])
        work.mkdir(parents=True, exist_ok=True)

        def run_zero_to_fp32():
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ds_dir)
            if sorted(state) != sorted(names):
                raise AssertionError(f"parameters {sorted(state)}, zinf's are {sorted(names)}")
            for n in names:
                if not same(state[n], ref[n]):
                    raise AssertionError(f"get_fp32_state_dict_from_zero_checkpoint: {n} differs "
                                         "from zinf's fp32 weights")
            convert = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict
            kwargs = {"max_shard_size": None} \
                if "max_shard_size" in inspect.signature(convert).parameters else {}
            convert(ds_dir, str(work / "fp32"), **kwargs)
            saved = torch.load(work / "fp32" / "pytorch_model.bin", map_location="cpu")
            if sorted(saved) != sorted(names):
                raise AssertionError(f"convert_zero_checkpoint_to_fp32_state_dict: parameters "
                                     f"{sorted(saved)}")
            for n in names:
                if not same(saved[n], ref[n]):
                    raise AssertionError(f"convert_zero_checkpoint_to_fp32_state_dict: {n} "
                                         "differs from zinf's fp32 weights")
            return (f"{len(names)} parameters bitwise equal to zinf's fp32 weights (both API "
                    "calls)"), {}

        universal = work / "universal"

        def run_ds_to_universal():
            tag = (Path(ds_dir) / "latest").read_text(encoding="utf-8").strip()
            model = torch.load(Path(ds_dir) / tag / "mp_rank_00_model_states.pt",
                               map_location="cpu")
            adam_step = model["global_steps"] - model["skipped_steps"]
            argv = sys.argv
            sys.argv = ["ds_to_universal", "--input_folder", str(Path(ds_dir) / tag),
                        "--output_folder", str(universal / tag), "--num_extract_workers", "1",
                        "--num_merge_workers", "1"]
            try:
                runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__",
                                 alter_sys=True)
            finally:
                sys.argv = argv
            zero = universal / tag / "zero"
            made = sorted(p.name for p in zero.iterdir() if p.is_dir())
            if made != sorted(names):
                raise AssertionError(f"parameter folders {made}, zinf's are {sorted(names)}")
            for n in names:
                for key, ref_name in (("fp32", n), ("exp_avg", f"exp_avg/{n}"),
                                      ("exp_avg_sq", f"exp_avg_sq/{n}")):
                    d = torch.load(zero / n / f"{key}.pt", map_location="cpu")
                    if not same(d["param"], ref[ref_name]):
                        raise AssertionError(f"{n}/{key}.pt differs from zinf's")
                s = torch.load(zero / n / "step.pt", map_location="cpu")
                if int(s) != adam_step:
                    raise AssertionError(f"{n}/step.pt is {s}, the Adam step is {adam_step}")
            return (f"fp32, exp_avg, exp_avg_sq of {len(names)} parameters bitwise equal to "
                    f"zinf's, step {adam_step}"), {"universal_dir": str(universal / tag)}

        def run_universal_equal():
            theirs, ours = universal, Path(case["zinf_universal"])
            files = sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file())
            mine = sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
            if files != mine:
                raise AssertionError(f"files only in ds_to_universal's "
                                     f"{sorted(set(files) - set(mine))[:5]}, only in zinf's "
                                     f"{sorted(set(mine) - set(files))[:5]}")
            for rel in files:
                if rel.endswith(".pt"):
                    d = diff(torch.load(theirs / rel, map_location="cpu"),
                             torch.load(ours / rel, map_location="cpu"), rel)
                elif (theirs / rel).read_bytes().strip() != (ours / rel).read_bytes().strip():
                    d = f"{rel}: the contents differ"
                else:
                    d = None
                if d:
                    raise AssertionError(d)
            return f"{len(files)} files equal to ds_to_universal's output", {}

        attempt("zero_to_fp32", w, run_zero_to_fp32)
        converted = attempt("ds_to_universal", w, run_ds_to_universal)
        if case["zinf_universal"]:
            if converted:
                attempt("universal_export", w, run_universal_equal)
            else:
                emit({"check": "universal_export", "world_size": w,
                      "skipped": "ds_to_universal failed"})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: python3 -m harness.deepspeed_compat worker SPEC.json "
                 "(bench/run.py deepspeed-compat runs it)")
    sys.exit(worker(sys.argv[2]))
