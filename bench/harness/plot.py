"""The one plotter: every picture of zinf (the loss curves, the I/O sweep, the scaling curves,
the benchmarks' comparisons) is a PNG drawn by gnuplot (gnuplot-nox, pngcairo) from this module.
gnuplot rather than matplotlib: it is one small Debian package install-deps.sh already installs,
starts in milliseconds, and reads the data this module hands it and nothing else.

    lines(out, series, ...)   line charts of (x, y) series: loss curves, sweeps, scaling
    bars(out, groups, series, ...)  clustered bars: one group per measurement, one bar per tool

and, as `python3 bench/run.py plot`, line charts of files:

    python3 bench/run.py plot --out FILE.png [--title T] [--xlabel X] [--ylabel Y]
                              [--logx] [--points] [--width 900] [--height 560] SERIES...

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
1 when gnuplot is missing or fails. The functions raise InputError and ToolError for those.
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
    text = ''.join(c if c.isprintable() else '?' for c in str(text))
    return "'" + text.replace("'", "''") + "'"


def _number_text(value):
    return repr(float(value)) if value is not None and math.isfinite(value) else 'NaN'


def data_file(name):
    """The placeholder of data file `name` in _draw's commands: control characters, which no
    quoted text holds (gnuplot_text turns them into '?')."""
    return f'\x01{name}\x01'


def _draw(commands, data, width, height):
    """The PNG bytes gnuplot draws from `commands`, with `data` ({name: rows of numbers})
    written as data files in a private temporary directory and named by data_file(name) in
    commands."""
    if not (200 <= width <= 10000 and 150 <= height <= 10000):
        raise InputError('width must be 200..10000 and height 150..10000')
    with tempfile.TemporaryDirectory(prefix='zinf-plot-') as tmp:
        files = {}
        for name, rows in data.items():
            files[name] = gnuplot_text(os.path.join(tmp, f'{name}.dat'))
            with open(os.path.join(tmp, f'{name}.dat'), 'w', encoding='utf-8') as f:
                f.writelines(' '.join(_number_text(v) for v in row) + '\n' for row in rows)
        script = [f'set terminal pngcairo size {width},{height} noenhanced',
                  f'set output {gnuplot_text(os.path.join(tmp, "chart.png"))}',
                  'set grid', 'set key outside right top', 'set datafile missing "NaN"']
        for c in commands:
            for name, quoted in files.items():
                c = c.replace(data_file(name), quoted)
            script.append(c)
        try:
            run = subprocess.run(['gnuplot'], input='\n'.join(script) + '\n', text=True,
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


def lines(out, series, title='', xlabel='', ylabel='', logx=False, logy=False, points=False,
          width=900, height=560):
    """Draws `series` ([(label, [(x, y), ...]), ...], at most MAX_SERIES) as line charts into the
    PNG `out` (see --out above)."""
    series = [(label, pts) for label, pts in series if pts]
    if not series:
        raise InputError('nothing to draw: every series is empty')
    if len(series) > MAX_SERIES:
        raise InputError(f'{len(series)} series: at most {MAX_SERIES}')
    if sum(len(pts) for _, pts in series) > MAX_POINTS:
        raise InputError(f'more than {MAX_POINTS} points in all')
    # A series of one point has no line: points then, for all.
    points = points or any(len(pts) == 1 for _, pts in series)
    style = 'linespoints pointtype 7' if points else 'lines'
    xs = sorted({x for _, pts in series for x, _ in pts})
    commands = [f'set title {gnuplot_text(title)}', f'set xlabel {gnuplot_text(xlabel)}',
                f'set ylabel {gnuplot_text(ylabel)}', 'set offsets 0, 0, graph 0.05, graph 0.05']
    commands += ['set logscale x 2'] if logx else []
    if len(xs) <= 20 and all(float(x).is_integer() for x in xs):  # ranks, hosts: their tics
        commands.append('set xtics (' + ', '.join(str(int(x)) for x in xs) + ')')
        if len(xs) == 1:
            commands.append(f'set xrange [{xs[0] - 1}:{xs[0] + 1}]')
    commands += ['set logscale y'] if logy else []
    commands.append('plot ' + ', '.join(
        f'{data_file(f"s{i}")} using 1:2 with {style} linewidth 2 dashtype {i // 8 + 1} '
        f'title {gnuplot_text(label)}' for i, (label, _) in enumerate(series)))
    data = {f's{i}': pts for i, (_, pts) in enumerate(series)}
    write_output(out, _draw(commands, data, width, height))


def bars(out, groups, series, title='', ylabel='', width=900, height=560):
    """Draws clustered bars into the PNG `out`: one cluster per name in `groups` (such as
    "read", "write"), one bar per (label, values) in `series` (such as ("zinf", [2.1, 1.9])),
    values[i] the bar of groups[i] (None: no bar)."""
    if not groups or not series:
        raise InputError('nothing to draw: no groups or no series')
    if len(series) > MAX_SERIES or len(groups) > 1000:
        raise InputError(f'at most {MAX_SERIES} series and 1000 groups')
    for label, values in series:
        if len(values) != len(groups):
            raise InputError(f"series '{label}': {len(values)} values for {len(groups)} groups")
    rows = [[i] + [values[i] for _, values in series] for i in range(len(groups))]
    tics = ', '.join(f'{gnuplot_text(g)} {i}' for i, g in enumerate(groups))
    commands = [f'set title {gnuplot_text(title)}', f'set ylabel {gnuplot_text(ylabel)}',
                'set style data histogram', 'set style histogram clustered gap 1',
                'set style fill solid 0.8 border -1', 'set yrange [0:*]',
                f'set xrange [-0.5:{len(groups) - 0.5}]',
                f'set xtics ({tics})',
                'plot ' + ', '.join(f'{data_file("bars")} using {j + 2} title {gnuplot_text(label)}'
                                    for j, (label, _) in enumerate(series))]
    write_output(out, _draw(commands, {'bars': rows}, width, height))


def main(argv=None, prog='plot'):
    ap = argparse.ArgumentParser(prog=prog, description='Line charts of "x y" series (or of '
                                 'a key of JSON lines against their step) into a PNG.')
    ap.add_argument('--out', required=True, help='PNG file to write')
    ap.add_argument('--title', default='')
    ap.add_argument('--xlabel', default='step')
    ap.add_argument('--ylabel', default='')
    ap.add_argument('--logx', action='store_true', help='x axis in powers of 2')
    ap.add_argument('--points', action='store_true', help='a mark at every point')
    ap.add_argument('--width', type=int, default=900)
    ap.add_argument('--height', type=int, default=560)
    ap.add_argument('series', nargs='+', metavar='LABEL=FILE[.jsonl:KEY]')
    args = ap.parse_args(argv)  # exits 2 with a usage message on a bad command line
    try:
        if len(args.series) > MAX_SERIES:
            raise InputError(f'{len(args.series)} series: at most {MAX_SERIES}')
        series = [read_series(spec) for spec in args.series]
        lines(args.out, series, args.title, args.xlabel, args.ylabel, logx=args.logx,
              points=args.points, width=args.width, height=args.height)
    except InputError as e:
        print(f'{prog}: {e}', file=sys.stderr)
        return 2
    except ToolError as e:
        print(f'{prog}: {e}', file=sys.stderr)
        return 1
    return 0
