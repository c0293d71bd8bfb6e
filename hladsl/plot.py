"""Line plots as PNG files, with no plotting library needed.

``line_plot(path, panels, title)`` draws one panel per entry side by side; each
panel is a dict(title, xlabel, ylabel, series={name: [(x, y), ...]}, logx, logy).
With matplotlib installed it draws the figure; otherwise a small built-in
rasteriser (3x5 pixel font, upper case) writes the PNG with zlib. Either way the
numbers themselves belong in the JSON written next to the plot.
"""
from __future__ import annotations

import math
import struct
import zlib

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]

# 3x5 glyphs: five octal digits, one per row, the high bit the left pixel
FONT = dict(zip(
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ .,:-+=()/_%[]^*?",
    "75557 26227 71747 71717 55711 74717 74757 71122 75757 75717 25755 65656 34443 65556 "
    "74647 74644 34553 55755 72227 11152 55655 44447 57755 65555 25552 65644 25563 65655 "
    "34216 72222 55557 55552 55775 55255 55222 71247 00000 00002 00024 02020 00700 02720 "
    "07070 12221 42224 11244 00007 51245 32223 62226 25000 05250 71202".split(), strict=True))


def line_plot(path, panels: list[dict], title: str = "") -> str:
    """Write the plot; return which writer drew it ("matplotlib" or "builtin")."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _builtin_plot(path, panels, title)
        return "builtin"
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, points in panel["series"].items():
            pts = sorted(points)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log" if panel.get("logx") else "linear")
        ax.set_yscale("log" if panel.get("logy") else "linear")
        ax.set(title=panel.get("title", ""), xlabel=panel.get("xlabel", ""),
               ylabel=panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


# -- the built-in rasteriser -------------------------------------------------------------
class Canvas:
    def __init__(self, width, height):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x, y, colour):
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(colour)

    def rect(self, x0, y0, x1, y1, colour):
        for y in range(max(y0, 0), min(y1, self.height)):
            for x in range(max(x0, 0), min(x1, self.width)):
                self.dot(x, y, colour)

    def line(self, x0, y0, x1, y1, colour, width=1):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            x = round(x0 + (x1 - x0) * s / steps)
            y = round(y0 + (y1 - y0) * s / steps)
            self.rect(x - width // 2, y - width // 2, x - width // 2 + width, y - width // 2 + width,
                      colour)

    def text(self, x, y, s, colour=(0, 0, 0), scale=2):
        """Upper-case 3x5 text with its top-left corner at (x, y)."""
        for ch in str(s).upper():
            glyph = FONT.get(ch, FONT["?"])
            for row, digit in enumerate(glyph):
                for col in range(3):
                    if int(digit, 8) >> (2 - col) & 1:
                        self.rect(x + col * scale, y + row * scale, x + (col + 1) * scale,
                                  y + (row + 1) * scale, colour)
            x += 4 * scale

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                        for y in range(self.height))

        def chunk(kind, data):
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def text_width(s, scale=2):
    return 4 * scale * len(str(s))


def _ticks(lo, hi, log):
    if log:
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in (1, 2, 5)]
    else:
        step = 10 ** math.floor(math.log10((hi - lo) or 1.0))
        if (hi - lo) / step < 3:
            step /= 5
        ticks = [step * i for i in range(math.floor(lo / step), math.ceil(hi / step) + 1)]
    return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)] or [lo, hi]


def _label(v):
    if float(v).is_integer() and abs(v) < 1e7:
        return str(int(v))
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0e}".replace("+0", "").replace("+", "")


def _builtin_plot(path, panels, title):
    pw, ph, margin = 420, 300, 70
    names = list(dict.fromkeys(n for p in panels for n in p["series"]))
    legend_rows = -(-len(names) // 3)
    width = len(panels) * (pw + margin) + margin
    height = ph + 2 * margin + 24 * legend_rows + 20
    c = Canvas(width, height)
    c.text(margin, 12, title, scale=3)
    colour_of = {n: COLOURS[i % len(COLOURS)] for i, n in enumerate(names)}
    for k, panel in enumerate(panels):
        x0, y0 = margin + k * (pw + margin), margin
        pts = [p for s in panel["series"].values() for p in s
               if p[1] is not None and math.isfinite(p[1])]
        logx, logy = panel.get("logx"), panel.get("logy")
        pts = [p for p in pts if (p[0] > 0 or not logx) and (p[1] > 0 or not logy)]
        if not pts:
            continue
        tx = (lambda v: math.log10(v)) if logx else float
        ty = (lambda v: math.log10(v)) if logy else float
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        xlo, xhi, ylo, yhi = min(xs), max(xs), min(ys), max(ys)
        if logy:
            ylo, yhi = ylo / 1.3, yhi * 1.3
        elif ylo == yhi:
            ylo, yhi = ylo - 1, yhi + 1
        if xlo == xhi:
            xlo, xhi = (xlo / 2, xhi * 2) if logx else (xlo - 1, xhi + 1)

        def px(v, x0=x0, tx=tx, lo=xlo, hi=xhi):
            return round(x0 + (tx(v) - tx(lo)) / ((tx(hi) - tx(lo)) or 1) * pw)

        def py(v, y0=y0, ty=ty, lo=ylo, hi=yhi):
            return round(y0 + ph - (ty(v) - ty(lo)) / ((ty(hi) - ty(lo)) or 1) * ph)

        grey = (200, 200, 200)
        for t in _ticks(ylo, yhi, logy):
            c.line(x0, py(t), x0 + pw, py(t), grey)
            c.text(x0 - 6 - text_width(_label(t)), py(t) - 5, _label(t))
        free = x0 - margin   # labels left of this would overlap the previous one
        for t in sorted(set(xs)) if logx else _ticks(xlo, xhi, False):
            c.line(px(t), y0, px(t), y0 + ph, grey)
            left = px(t) - text_width(_label(t)) // 2
            if left >= free:
                c.text(left, y0 + ph + 8, _label(t))
                free = left + text_width(_label(t)) + 8
        for a, b, d, e in ((x0, y0, x0 + pw, y0), (x0, y0 + ph, x0 + pw, y0 + ph),
                           (x0, y0, x0, y0 + ph), (x0 + pw, y0, x0 + pw, y0 + ph)):
            c.line(a, b, d, e, (0, 0, 0))
        c.text(x0, y0 - 20, panel.get("title", ""))
        c.text(x0 + pw // 2 - text_width(panel.get("xlabel", "")) // 2, y0 + ph + 26,
               panel.get("xlabel", ""))
        c.text(x0, y0 - 36, panel.get("ylabel", ""), colour=(90, 90, 90))
        for name, series in panel["series"].items():
            good = sorted(p for p in series if p in pts)
            for a, b in zip(good, good[1:]):
                c.line(px(a[0]), py(a[1]), px(b[0]), py(b[1]), colour_of[name], width=2)
            for p in good:
                c.rect(px(p[0]) - 3, py(p[1]) - 3, px(p[0]) + 4, py(p[1]) + 4, colour_of[name])
    top = ph + 2 * margin
    for i, name in enumerate(names):
        x, y = margin + (i % 3) * (width - margin) // 3, top + 24 * (i // 3)
        c.rect(x, y, x + 16, y + 10, colour_of[name])
        c.text(x + 24, y, name)
    with open(path, "wb") as f:
        f.write(c.png())
