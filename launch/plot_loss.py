#!/usr/bin/env python3
"""Line charts of (step, value) series into a PNG, with the Python standard library only.

    python3 launch/plot_loss.py --out FILE.png [--title T] [--xlabel X] [--ylabel Y]
                                [--width 900] [--height 560] SERIES...

Each SERIES is LABEL=FILE, where FILE holds one "step value" pair per line (whitespace
separated; blank lines and lines starting with # are ignored), or LABEL=FILE.jsonl:KEY, where
FILE.jsonl holds one JSON object per line (zinf-train --metrics) and the points are its "step"
and KEY. At most 16 series and 1,000,000 points in all.

Draws a white chart with "nice" auto-ranged axes (ticks at 1, 2 or 5 x 10^k), numeric tick
labels, light grid lines, a 2-pixel line per series in a distinct colour, and a legend. Text uses
a built-in 5x7 pixel font. The PNG is 8-bit RGB, filter 0 on every row, one zlib IDAT chunk.

--out is a new file or an existing regular file, replaced whole (written to a hidden temporary
file in the same directory, then renamed); a link, directory, device, FIFO or socket there is
refused and left as it is.

Exit status: 0 on success, 2 on any bad argument or input (one line on stderr, no traceback).
"""
import argparse
import json
import math
import os
import stat
import struct
import sys
import tempfile
import zlib

MAX_SERIES = 16
MAX_POINTS = 1_000_000

# 5x7 font: 7 rows of 5 bits (bit 4 = leftmost column) as 14 hex digits per glyph.
_FONT_HEX = {
    ' ': '00000000000000', '0': '0E11131519110E', '1': '040C040404040E', '2': '0E11010204081F',
    '3': '1F02040201110E', '4': '02060A121F0202', '5': '1F101E0101110E',
    '6': '0608101E11110E', '7': '1F010204080808', '8': '0E11110E11110E', '9': '0E11110F01020C',
    'A': '0E11111F111111', 'B': '1E11111E11111E', 'C': '0E11101010110E', 'D': '1C12111111121C',
    'E': '1F10101E10101F', 'F': '1F10101E101010', 'G': '0E11101711110F', 'H': '1111111F111111',
    'I': '0E04040404040E', 'J': '0702020202120C', 'K': '11121418141211', 'L': '1010101010101F',
    'M': '111B1515111111', 'N': '11111915131111', 'O': '0E11111111110E', 'P': '1E11111E101010',
    'Q': '0E11111115120D', 'R': '1E11111E141211', 'S': '0F10100E01011E', 'T': '1F040404040404',
    'U': '1111111111110E', 'V': '11111111110A04', 'W': '1111111515150A',
    'X': '11110A040A1111', 'Y': '1111110A040404', 'Z': '1F01020408101F',
    'a': '00000E010F110F', 'b': '1010161911111E', 'c': '00000E1010110E', 'd': '01010D1311110F',
    'e': '00000E111F100E', 'f': '0609081C080808', 'g': '000F11110F010E', 'h': '10101619111111',
    'i': '04000C0404040E', 'j': '0200060202120C', 'k': '10101214181412',
    'l': '0C04040404040E', 'm': '00001A15151111', 'n': '00001619111111', 'o': '00000E1111110E',
    'p': '00001E111E1010', 'q': '00000D130F0101', 'r': '00001619101010', 's': '00000E100E011E',
    't': '08081C08080906', 'u': '0000111111130D', 'v': '00001111110A04',
    'w': '0000111115150A', 'x': '0000110A040A11', 'y': '000011110F010E',
    'z': '00001F0204081F', '.': '00000000000C0C', ',': '000000000C0408', '-': '0000001F000000',
    '_': '0000000000001F', ':': '000C0C000C0C00', '/': '00010204081000', '(': '02040808080402',
    ')': '08040202020408', '%': '18190204081303', '+': '0004041F040400', '=': '00001F001F0000',
    '!': '04040404040004', '?': '0E110102040004', "'": '04040800000000', '"': '0A0A0000000000',
    '[': '0E08080808080E', ']': '0E02020202020E', '*': '0004150E150400', '<': '02040810080402',
    '>': '08040201020408', '#': '0A0A1F0A1F0A0A', '&': '0C121408151209', '@': '0E11171517100E',
    '|': '04040404040404', '~': '00000815020000',
}
FONT = {ch: [int(h[i:i + 2], 16) for i in range(0, 14, 2)] for ch, h in _FONT_HEX.items()}

# Distinct series colours (Tableau 10, then six more).
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
           (0, 0, 128), (128, 0, 0), (0, 128, 128), (255, 0, 255), (85, 85, 0), (0, 0, 0)]
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)


class InputError(Exception):
    """A bad argument or input file: reported as one line on stderr, exit status 2."""


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


def nice_ticks(lo, hi, target=6):
    """Axis limits and ticks at multiples of 1, 2 or 5 x 10^k covering [lo, hi]."""
    if hi - lo <= abs(hi) * 1e-12:  # one value: widen around it
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [i * step for i in range(first, last + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    labels = []
    for t in ticks:
        if abs(t) >= 1e7 or (t != 0 and decimals > 6):
            labels.append(f"{t:.3g}")
        else:
            text = f"{t:.{decimals}f}"
            labels.append(text[1:] if abs(t) < step / 2 and text.startswith('-') else text)
    return ticks[0], ticks[-1], list(zip(ticks, labels))


class Canvas:
    """An RGB raster with pixels, rectangles, thick lines and 5x7 text."""

    def __init__(self, width, height):
        self.w, self.h = width, height
        self.px = bytearray(b'\xff' * (width * height * 3))
        self.clip = (0, 0, width - 1, height - 1)

    def dot(self, x, y, c):
        x0, y0, x1, y1 = self.clip
        if x0 <= x <= x1 and y0 <= y <= y1:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c):
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.dot(x, y, c)

    def line(self, x0, y0, x1, y1, c, thick=2):
        """Bresenham, each point stamped as a thick x thick square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for oy in range(thick):
                for ox in range(thick):
                    self.dot(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    @staticmethod
    def text_width(s, scale):
        return max(0, len(s) * 6 * scale - scale)

    def text(self, x, y, s, scale, c=BLACK, vertical=False):
        """Draw s with its top-left at (x, y); vertical runs bottom-up from (x, y) upwards."""
        for k, ch in enumerate(s):
            rows = FONT.get(ch, FONT['?'])
            for gy, bits in enumerate(rows):
                for gx in range(5):
                    if bits >> (4 - gx) & 1:
                        px, py = k * 6 + gx, gy
                        if vertical:  # rotate 90 degrees counter-clockwise
                            px, py = py, -px
                        for sy in range(scale):
                            for sx in range(scale):
                                self.dot(x + px * scale + sx, y + py * scale + sy, c)

    def png(self):
        def chunk(kind, data):
            return (struct.pack('>I', len(data)) + kind + data +
                    struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff))
        stride = self.w * 3
        raw = b''.join(b'\x00' + bytes(self.px[y * stride:(y + 1) * stride])
                       for y in range(self.h))
        return (b'\x89PNG\r\n\x1a\n' +
                chunk(b'IHDR', struct.pack('>IIBBBBB', self.w, self.h, 8, 2, 0, 0, 0)) +
                chunk(b'IDAT', zlib.compress(raw, 6)) + chunk(b'IEND', b''))


def column_extremes(pix):
    """The pixels pix (in drawing order) less those inside runs of one column that are not a
    run's first, last, lowest or highest."""
    out, i = [], 0
    while i < len(pix):
        j = i
        while j < len(pix) and pix[j][0] == pix[i][0]:
            j += 1
        if j - i <= 4:
            out.extend(pix[i:j])
        else:
            run = range(i, j)
            keep = {i, j - 1, min(run, key=lambda k: pix[k][1]), max(run, key=lambda k: pix[k][1])}
            out.extend(pix[k] for k in sorted(keep))
        i = j
    return out


def plot(series, width, height, title, xlabel, ylabel):
    s = max(1, min(width, height) // 280)  # text scale: 2 at the default size
    ch_h = 7 * s
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    x_lo, x_hi, x_ticks = nice_ticks(min(xs), max(xs), target=max(2, width // 120))
    y_lo, y_hi, y_ticks = nice_ticks(min(ys), max(ys), target=max(2, height // 80))
    y_label_w = max(Canvas.text_width(lbl, s) for _, lbl in y_ticks)
    # Plot area: room for the title on top, tick labels and axis labels left and below.
    # The title at scale s + 1 if it fits, else s, else cut short with "...".
    t_scale = next((k for k in (s + 1, s, 1) if Canvas.text_width(title, k) <= width - 8 * s), 1)
    while title and Canvas.text_width(title, t_scale) > width - 8 * s:
        title = title[:-4] + '...'
    left = 8 * s + (ch_h + 6 * s if ylabel else 0) + y_label_w + 8 * s
    top = 6 * s + (7 * t_scale + 8 * s if title else 0) + ch_h // 2 + 2 * s
    right = width - 12 * s - Canvas.text_width(x_ticks[-1][1], s) // 2
    bottom = height - 8 * s - (ch_h + 6 * s if xlabel else 0) - ch_h - 8 * s
    if right - left < 50 or bottom - top < 50:
        raise InputError(f"{width}x{height} is too small for the labels")
    cv = Canvas(width, height)

    def to_px(x, y):
        return (left + round((x - x_lo) / (x_hi - x_lo) * (right - left)),
                bottom - round((y - y_lo) / (y_hi - y_lo) * (bottom - top)))

    # Grid, ticks and tick labels.
    for t, lbl in x_ticks:
        px, _ = to_px(t, y_lo)
        cv.rect(px, top, px, bottom, GRID)
        cv.rect(px, bottom, px, bottom + 4 * s, BLACK)
        cv.text(px - Canvas.text_width(lbl, s) // 2, bottom + 7 * s, lbl, s)
    for t, lbl in y_ticks:
        _, py = to_px(x_lo, t)
        cv.rect(left, py, right, py, GRID)
        cv.rect(left - 4 * s, py, left, py, BLACK)
        cv.text(left - 7 * s - Canvas.text_width(lbl, s), py - ch_h // 2, lbl, s)
    # Title and axis labels.
    if title:
        cv.text((width - Canvas.text_width(title, t_scale)) // 2, 6 * s, title, t_scale)
    if xlabel:
        cv.text((left + right - Canvas.text_width(xlabel, s)) // 2, height - 8 * s - ch_h,
                xlabel, s)
    if ylabel:
        cv.text(8 * s, (top + bottom + Canvas.text_width(ylabel, s)) // 2, ylabel, s,
                vertical=True)
    # The series, clipped to the plot area. Of a run of points in one pixel column only the
    # first, lowest, highest and last are drawn: the same pixels, in bounded time.
    cv.clip = (left, top, right, bottom)
    for i, (_, pts) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        pix = [to_px(x, y) for x, y in pts]
        prev = pix[0]
        cv.line(*prev, *prev, colour)
        for cur in column_extremes(pix):
            if cur != prev:
                cv.line(*prev, *cur, colour)
                prev = cur
    cv.clip = (0, 0, width - 1, height - 1)
    # Axes frame on top of the data, s pixels wide, outside the plot area.
    cv.rect(left - s + 1, top - s + 1, right + s - 1, top, BLACK)
    cv.rect(left - s + 1, bottom, right + s - 1, bottom + s - 1, BLACK)
    cv.rect(left - s + 1, top, left, bottom, BLACK)
    cv.rect(right, top, right + s - 1, bottom, BLACK)
    # Legend in the top-right corner: a white box with a colour swatch and the label per series.
    row_h, swatch = ch_h + 5 * s, 14 * s
    box_w = swatch + 6 * s + max(Canvas.text_width(lbl, s) for lbl, _ in series) + 12 * s
    box_h = row_h * len(series) + 6 * s
    bx1, by0 = right - 6 * s, top + 6 * s
    bx0 = max(left + 1, bx1 - box_w)
    cv.rect(bx0, by0, bx1, by0 + box_h, WHITE)
    for x0, y0, x1, y1 in ((bx0, by0, bx1, by0), (bx0, by0 + box_h, bx1, by0 + box_h),
                           (bx0, by0, bx0, by0 + box_h), (bx1, by0, bx1, by0 + box_h)):
        cv.rect(x0, y0, x1, y1, (120, 120, 120))
    for i, (lbl, _) in enumerate(series):
        y = by0 + 5 * s + i * row_h
        cy = y + ch_h // 2
        cv.rect(bx0 + 6 * s, cy - s, bx0 + 6 * s + swatch, cy + s, COLOURS[i % len(COLOURS)])
        cv.text(bx0 + 12 * s + swatch, y, lbl, s)
    return cv


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
        data = plot(series, args.width, args.height, args.title, args.xlabel, args.ylabel).png()
        write_output(args.out, data)
    except InputError as e:
        print(f'plot_loss: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
