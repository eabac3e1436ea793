"""What every benchmark of the harness shares: its flags' types (counts, sizes, numbers, lists),
medians, the rotated order of the tools in a round, the output directory it claims, its JSON
lines, the programs it runs, and the machine the figures were measured on.

A bad command line is a UsageError (exit 2, before anything is made or run); a run that fails is
a RunError (exit 1, the end of its log named). Both print one line on stderr, no traceback.
"""
import argparse
import json
import math
import os
import platform
import re
import shutil
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_BIN = REPO / "build" / "bin"
# Debian's interpreter, the one python3-torch installs into (python3 on PATH may be another).
PYTHON = Path("/usr/bin/python3")

MAX_COUNT = 999_999_999
MAX_SIZE = 1 << 50  # 1 PiB: far above any disk, far below any overflow


class UsageError(Exception):
    """A bad command line or a missing tool: exit status 2, nothing made or run."""


class RunError(Exception):
    """A run that failed: exit status 1."""


# --- flags -----------------------------------------------------------------------------------

_SIZE = re.compile(r"(0|[1-9][0-9]{0,15})([KMGTkmgt]?)(i?[Bb])?")
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(text):
    """The bytes of 123, 64K, 512M, 1G, 2T, 1GiB or 1GB (powers of 1024); None for anything else
    and for sizes above MAX_SIZE."""
    m = _SIZE.fullmatch(text)
    if not m:
        return None
    value = int(m.group(1)) << _SHIFT[m.group(2).upper()]
    return value if value <= MAX_SIZE else None


def size(lo=1, hi=MAX_SIZE, multiple=1, unit="bytes"):
    """An argparse type: a size (parse_size) in [lo, hi] `unit`s (bytes, or elements for the
    flags that count them: 64M elements), a multiple of `multiple`."""
    def parse(text):
        value = parse_size(text)
        if value is None or not lo <= value <= hi or value % multiple:
            what = f"a multiple of {multiple} {unit} from {lo} to {hi}" if multiple > 1 else \
                f"a size from {lo} to {hi} {unit}"
            raise argparse.ArgumentTypeError(
                f"'{text}': expected {what}, such as 64K, 512M or 2G (powers of 1024)")
        return value
    # What tests/bench/harness_args_test.py tries on every flag of a kind.
    parse.kind, parse.bounds = "size", (lo, hi)
    return parse


def count(lo=1, hi=MAX_COUNT):
    """An argparse type: a decimal integer in [lo, hi], no sign, no leading zeros."""
    def parse(text):
        if not re.fullmatch(r"0|[1-9][0-9]{0,8}", text) or not lo <= int(text) <= hi:
            raise argparse.ArgumentTypeError(f"'{text}': expected an integer from {lo} to {hi}")
        return int(text)
    parse.kind, parse.bounds = "count", (lo, hi)
    return parse


def number(lo=0.0, hi=math.inf):
    """An argparse type: a finite decimal number in (lo, hi] (such as 0.95)."""
    def parse(text):
        try:
            value = float(text) if re.fullmatch(r"[0-9]{1,9}(\.[0-9]{1,9})?", text) else None
        except ValueError:
            value = None
        if value is None or not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"'{text}': expected a number above {lo}"
                                             + (f" and at most {hi}" if hi < math.inf else ""))
        return value
    parse.kind, parse.bounds = "number", (lo, hi)
    return parse


def one_of(choices, many=False):
    """An argparse type: one of `choices`, or with many=True a comma-separated list of them
    without repeats (such as fp32,q8)."""
    def parse(text):
        items = text.split(",") if many else [text]
        if not all(i in choices for i in items) or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(
                f"'{text}': expected {'a comma-separated list of ' if many else 'one of '}"
                + ", ".join(choices))
        return items if many else text
    parse.kind, parse.choices = ("list" if many else "choice"), tuple(choices)
    return parse


def counts(lo=1, hi=MAX_COUNT, most=64):
    """An argparse type: a list of counts separated by spaces or commas ("1 2 4", "1,2,4"),
    at most `most` of them, without repeats."""
    one = count(lo, hi)
    def parse(text):
        words = [w for w in re.split(r"[ ,]+", text.strip()) if w]
        if not words or len(words) > most:
            raise argparse.ArgumentTypeError(f"'{text}': expected 1 to {most} integers")
        try:
            values = [one(w) for w in words]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"'{text}': expected integers from {lo} to {hi}") from None
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"'{text}': a value repeats")
        return values
    return parse


def executable(text):
    """An argparse type: the path of an executable file."""
    path = Path(text)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise argparse.ArgumentTypeError(f"'{text}' is not an executable file "
                                         "(build it first: cmake --build --preset default)")
    return path


class Parser(argparse.ArgumentParser):
    """argparse, with every usage error "bench NAME: --flag 'value': what was expected", exit 2,
    and an option never taken as the value of the flag before it ("--rounds --steps 3")."""

    def error(self, message):
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


# --- figures ---------------------------------------------------------------------------------

def median(values):
    """The median of `values`; nan when there is none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else math.nan


def ratio(top, bottom, digits=3):
    """top / bottom rounded, or None when either is missing, nan or bottom is not positive."""
    if top is None or bottom is None or math.isnan(top) or math.isnan(bottom) or bottom <= 0:
        return None
    return round(top / bottom, digits)


def rotate(items, round_):
    """`items` rotated left by round_: round r starts with item r mod n, so that slow drifts of
    the disk hit every tool alike over the rounds."""
    items = list(items)
    if not items:
        return items
    shift = round_ % len(items)
    return items[shift:] + items[:shift]


def machine():
    """Where a figure was measured: CPU model, the widest SIMD the kernel reports, cores, memory,
    kernel, date (UTC). Every summary line carries it."""
    cpu, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    simd = next((name for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"),
                                         ("sse4.2", "sse4_2")) if flag in flags), "scalar")
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    return {"cpu": cpu, "simd": simd, "cores": os.cpu_count(), "memory_bytes": memory,
            "kernel": platform.release(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def load_average():
    """The 1-minute load average (None where there is none): noise beside a benchmark."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# --- output ----------------------------------------------------------------------------------

def claim_dir(path, name):
    """Makes `path` (created if missing) the output directory of benchmark `name`, marked by the
    file .made-by-<name>: it must not exist, be empty, or hold that marker from an earlier run.
    Anything else (a file, a link, a directory of other files) is a UsageError: a benchmark
    writes, replaces and removes files only in a directory it made."""
    path = Path(path)
    marker = path / f".made-by-{name}"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    if mode is not None:
        if not stat.S_ISDIR(mode):
            raise UsageError(f"{path} exists and is not a directory")
        try:
            marked = stat.S_ISREG(os.lstat(marker).st_mode)
        except OSError:
            marked = False
        if not marked and any(path.iterdir()):
            raise UsageError(f"{path} already holds files {name} did not make; give a new or "
                             "empty directory (or remove this one)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError as e:
        raise UsageError(f"cannot make {path}: {e.strerror}") from None
    return path


def fresh_dir(path, name):
    """claim_dir, then everything in it but the marker removed: a fresh directory per run."""
    path = claim_dir(path, name)
    for entry in path.iterdir():
        if entry.name == f".made-by-{name}":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return path


def make_dir(path):
    """mkdir -p `path` (a swap or scratch directory a program writes in); a UsageError when it
    cannot be made."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make {path}: {e.strerror}") from None
    return Path(path)


class Results:
    """The JSON lines of a run: each record printed on stdout and appended to OUT/results.jsonl
    (replaced at the start of the run)."""

    def __init__(self, out_dir, name="results.jsonl"):
        self.path = Path(out_dir) / name
        self.records = []
        self.path.write_text("", encoding="utf-8")

    def emit(self, record):
        self.records.append(record)
        line = json.dumps(record, allow_nan=False, default=_jsonable)
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        return record

    def where(self, **match):
        """The records with every key of `match` equal to its value."""
        return [r for r in self.records if all(r.get(k) == v for k, v in match.items())]


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def finite(value):
    """None for nan and infinities (JSON has neither), else value."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def say(name, message):
    """A line for the human on stderr, prefixed with the benchmark's name."""
    print(f"{name}: {message}", file=sys.stderr, flush=True)


# --- programs --------------------------------------------------------------------------------

def tool(name, given=None):
    """The path of a zinf program: `given`, else build/bin/NAME; a UsageError when it is not an
    executable (build it first)."""
    path = Path(given) if given else BUILD_BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise UsageError(f"{path} is not an executable (build it: cmake --build --preset default "
                         f"--target {name})")
    return path


def need_program(name, package):
    """The path of `name` on PATH; a UsageError naming the Debian package when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise UsageError(f"{name} is not installed (apt-get install {package})")
    return path


def torch_python(python=PYTHON, modules=("torch",)):
    """`python` when it is an executable that imports every one of `modules`; a UsageError
    naming the Debian package of the first it cannot import otherwise."""
    python = Path(python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise UsageError(f"{python} is not an executable Python")
    for module in modules:
        try:
            imports = subprocess.run([str(python), "-c", f"import {module}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     timeout=300, check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            imports = False
        if not imports:
            raise UsageError(f"{module} is not installed for {python} (apt-get install "
                             f"python3-{module})")
    return python


def zinf_python_path():
    """The PYTHONPATH of ranks that import zinf: the caller's, then build/python. A UsageError
    when zinf's extension (zinf/_zinf*.so) is on neither (not built)."""
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    build = str(REPO / "build" / "python")
    if build not in entries:
        entries.append(build)
    if not any(any(Path(e, "zinf").glob("_zinf*.so")) for e in entries):
        raise UsageError(f"zinf's Python package is not built in {build} (cmake --build "
                         "--preset default --target zinf_python)")
    return os.pathsep.join(entries)


def size_text(value):
    """`value` bytes as the shortest size parse_size reads back (4G, 96M, 12)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    return str(value)


def run(cmd, log=None, timeout=None, env=None, cwd=None):
    """Runs `cmd` (a list) with its stderr into `log` (when given); returns its stdout. A RunError
    when it fails or passes `timeout` seconds, with the end of its log."""
    cmd = [str(c) for c in cmd]
    full_env = None if env is None else {**os.environ, **{k: str(v) for k, v in env.items()}}
    err = open(log, "w", encoding="utf-8") if log else subprocess.PIPE
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=timeout, env=full_env, cwd=cwd, check=False)
    except FileNotFoundError:
        raise UsageError(f"{cmd[0]}: not found") from None
    except subprocess.TimeoutExpired:
        raise RunError(f"{Path(cmd[0]).name} did not finish within {timeout} s"
                       + (f" (log: {log})" if log else "")) from None
    finally:
        if log:
            err.close()
    if done.returncode != 0:
        tail = Path(log).read_text(encoding="utf-8", errors="replace") if log else done.stderr
        tail = "\n".join(tail.strip().splitlines()[-5:])
        raise RunError(f"{' '.join(cmd[:3])} ... exited {done.returncode}"
                       + (f" (log: {log})" if log else "") + f":\n{tail}")
    return done.stdout


def json_lines(text, where="output"):
    """The JSON objects of `text`, one per line; lines that are not JSON objects are skipped
    (programs may log to stdout), but there must be at least one."""
    records = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                records.append(value)
    if not records:
        raise RunError(f"{where}: no JSON line in its output")
    return records


def read_metrics(path):
    """zinf-train's --metrics file: one JSON object per line; a RunError for anything else."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict):
                    raise RunError(f"{path}:{n}: not a JSON object")
                records.append(record)
    except OSError as e:
        raise RunError(f"cannot read {path}: {e.strerror}") from None
    if not records:
        raise RunError(f"{path}: no metrics line")
    return records


def mpirun(ranks, extra=()):
    """The mpirun prefix for `ranks` ranks on this machine (as root, oversubscribed: the CI
    machine has 2 cores)."""
    cmd = [need_program("mpirun", "openmpi-bin"), "-np", str(ranks), "--oversubscribe",
           "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + list(extra)


def free_bytes(path):
    """The bytes free for an unprivileged writer under `path` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def available_memory():
    """MemAvailable in bytes (None where /proc/meminfo has none)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
