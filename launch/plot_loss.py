#!/usr/bin/env python3
"""Line charts of (step, value) series into a PNG, drawn by gnuplot (gnuplot-nox, pngcairo).

    python3 launch/plot_loss.py --out FILE.png [--title T] [--xlabel X] [--ylabel Y]
                                [--width 900] [--height 560] SERIES...

Each SERIES is LABEL=FILE, where FILE holds one "step value" pair per line (whitespace
separated; blank lines and lines starting with # are ignored), or LABEL=FILE.jsonl:KEY, where
FILE.jsonl holds one JSON object per line (zinf-train --metrics) and the points are its "step"
and KEY. At most 16 series and 1,000,000 points in all.

The inputs are read and checked here (every value a finite number); gnuplot gets clean data
files in a private temporary directory and draws one line per series with a legend.

--out is a new file or an existing regular file, replaced whole (written to a hidden temporary
file in the same directory, then renamed); a link, directory, device, FIFO or socket there is
refused and left as it is.

Exit status: 0 on success, 2 on any bad argument or input (one line on stderr, no traceback),
1 when gnuplot is missing or fails.
"""
import argparse
import json
import math
import os
import stat
import subprocess
import sys
import tempfile

MAX_SERIES = 16
MAX_POINTS = 1_000_000

class InputError(Exception):
    """A bad argument or input file: reported as one line on stderr, exit status 2."""


class ToolError(Exception):
    """gnuplot missing or failing: one line on stderr, exit status 1."""


def _number(text, where):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InputError(f"{where}: '{text}' is not a number") from None
    if not math.isfinite(value):
        raise InputError(f"{where}: '{text}' is not a finite number")
    return value


FILE_TYPES = ((stat.S_ISLNK, 'a symbolic link'), (stat.S_ISDIR, 'a directory'),
              (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
              (stat.S_ISFIFO, 'a FIFO'), (stat.S_ISSOCK, 'a socket'))


def write_output(path, data):
    """Writes `data` to `path` (see --out in the module docstring): nothing but a missing name or
    a regular file is ever written, and never opened."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise InputError(f'cannot write {path}: {e.strerror}') from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in FILE_TYPES if test(mode)), 'not a regular file')
        raise InputError(f'{path}: {kind}, not a regular file; an output never replaces one')
    temp = None
    try:
        fd, temp = tempfile.mkstemp(dir=os.path.dirname(path) or '.',
                                    prefix='.' + os.path.basename(path) + '.', suffix='.tmp')
        with os.fdopen(fd, 'wb') as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(temp, path)
        temp = None
    except OSError as e:
        raise InputError(f'cannot write {path}: {e.strerror}') from None
    finally:
        if temp is not None:
            os.unlink(temp)


def read_series(spec):
    """LABEL=FILE or LABEL=FILE.jsonl:KEY -> (label, [(x, y), ...])."""
    label, sep, source = spec.partition('=')
    if not sep or not label or not source:
        raise InputError(f"series '{spec}': expected LABEL=FILE or LABEL=FILE.jsonl:KEY")
    path, key = source, None
    head, colon, tail = source.rpartition(':')
    if colon and head.endswith('.jsonl') and tail:
        path, key = head, tail
    points = []
    try:
        with open(path, encoding='utf-8') as f:
            for n, line in enumerate(f, 1):
                where = f"{path}:{n}"
                line = line.strip()
                if not line or line.startswith('#'):
                    continue
                if key is not None:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        raise InputError(f"{where}: not a JSON object") from None
                    if not isinstance(obj, dict) or 'step' not in obj or key not in obj:
                        raise InputError(f"{where}: no 'step' and '{key}' in this line")
                    fields = [obj['step'], obj[key]]
                else:
                    fields = line.split()
                    if len(fields) != 2:
                        raise InputError(f"{where}: expected 'step value', got '{line}'")
                if isinstance(fields[0], bool) or isinstance(fields[1], bool):
                    raise InputError(f"{where}: a boolean is not a number")
                points.append((_number(fields[0], where), _number(fields[1], where)))
                if len(points) > MAX_POINTS:
                    raise InputError(f"{path}: more than {MAX_POINTS} points")
    except OSError as e:
        raise InputError(f"series '{label}': cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"series '{label}': {path} is not UTF-8 text") from None
    if not points:
        raise InputError(f"series '{label}': {path} has no points")
    return label, points


def gnuplot_text(text):
    """`text` as a gnuplot single-quoted string ('' stands for a quote inside one; a control
    character, which would end the command, as '?')."""
    text = ''.join(c if c.isprintable() else '?' for c in text)
    return "'" + text.replace("'", "''") + "'"


def plot(series, width, height, title, xlabel, ylabel):
    """The PNG bytes of the chart, from gnuplot."""
    with tempfile.TemporaryDirectory(prefix='zinf-plot-') as tmp:
        commands = [f'set terminal pngcairo size {width},{height} noenhanced',
                    f'set output {gnuplot_text(os.path.join(tmp, "chart.png"))}',
                    f'set title {gnuplot_text(title)}', f'set xlabel {gnuplot_text(xlabel)}',
                    f'set ylabel {gnuplot_text(ylabel)}', 'set grid', 'set key outside right top',
                    'set datafile separator " "']
        plots = []
        for i, (label, points) in enumerate(series):
            data = os.path.join(tmp, f'series-{i}.dat')
            with open(data, 'w', encoding='utf-8') as f:
                f.writelines(f'{x!r} {y!r}\n' for x, y in points)
            plots.append(f'{gnuplot_text(data)} using 1:2 with lines linewidth 2 '
                         f'title {gnuplot_text(label)}')
        commands.append('plot ' + ', '.join(plots))
        try:
            run = subprocess.run(['gnuplot'], input='\n'.join(commands) + '\n', text=True,
                                 capture_output=True, timeout=120, check=False)
        except FileNotFoundError:
            raise ToolError('gnuplot is not installed (apt-get install gnuplot-nox)') from None
        except subprocess.TimeoutExpired:
            raise ToolError('gnuplot did not finish within 120 s') from None
        chart = os.path.join(tmp, 'chart.png')
        if run.returncode != 0 or not os.path.isfile(chart):
            raise ToolError(f'gnuplot failed: {run.stderr.strip()[:500]}')
        with open(chart, 'rb') as f:
            return f.read()


def main(argv=None):
    ap = argparse.ArgumentParser(description='Line charts of "step value" series into a PNG.')
    ap.add_argument('--out', required=True, help='PNG file to write')
    ap.add_argument('--title', default='')
    ap.add_argument('--xlabel', default='step')
    ap.add_argument('--ylabel', default='')
    ap.add_argument('--width', type=int, default=900)
    ap.add_argument('--height', type=int, default=560)
    ap.add_argument('series', nargs='+', metavar='LABEL=FILE[.jsonl:KEY]')
    args = ap.parse_args(argv)  # exits 2 with a usage message on a bad command line
    try:
        if not (200 <= args.width <= 10000 and 150 <= args.height <= 10000):
            raise InputError('--width must be 200..10000 and --height 150..10000')
        if len(args.series) > MAX_SERIES:
            raise InputError(f'{len(args.series)} series: at most {MAX_SERIES}')
        series = [read_series(spec) for spec in args.series]
        total = sum(len(pts) for _, pts in series)
        if total > MAX_POINTS:
            raise InputError(f'{total} points in all: at most {MAX_POINTS}')
        data = plot(series, args.width, args.height, args.title, args.xlabel, args.ylabel)
        write_output(args.out, data)
    except InputError as e:
        print(f'plot_loss: {e}', file=sys.stderr)
        return 2
    except ToolError as e:
        print(f'plot_loss: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
