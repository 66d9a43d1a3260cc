"""A bar chart as a PNG, in pure Python (zlib + struct, a 5x7 pixel font).

Keeps the benchmark free of plotting dependencies.  One row per figure: a bar
at the median ratio, a whisker from min to max, a mark at the target.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

__all__ = ["Bar", "bar_chart_png", "line_chart_png"]

# 5x7 glyphs, one string of 7 rows of 5 pixels per character.
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110",
    "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110",
    "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001",
    "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101",
    "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110",
    "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010",
    "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100",
    "Z": "11111 00001 00010 00100 01000 10000 11111",
    " ": "00000 00000 00000 00000 00000 00000 00000",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    ";": "00000 01100 01100 00000 01100 00100 01000",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000",
    "/": "00001 00010 00010 00100 01000 01000 10000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
    "<": "00010 00100 01000 10000 01000 00100 00010",
    ">": "01000 00100 00010 00001 00010 00100 01000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    "[": "01110 01000 01000 01000 01000 01000 01110",
    "]": "01110 00010 00010 00010 00010 00010 01110",
    "%": "11001 11010 00010 00100 01000 01011 10011",
    "_": "00000 00000 00000 00000 00000 00000 11111",
    "*": "00000 00100 10101 01110 10101 00100 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
}

_WHITE = (255, 255, 255)
_BLACK = (20, 20, 20)
_GREY = (200, 200, 200)
_GREEN = (46, 139, 87)
_RED = (200, 60, 50)
_BLUE = (60, 100, 180)


class Bar:
    """One row: ``label``, median ``value`` with ``lo``..``hi``, optional target.

    ``met`` is None for figures without a target (drawn blue).
    """

    def __init__(self, label: str, value: float, lo: float, hi: float, target: float | None, met: bool | None, text: str):
        self.label, self.value, self.lo, self.hi = label, value, lo, hi
        self.target, self.met, self.text = target, met, text


class _Canvas:
    def __init__(self, w: int, h: int) -> None:
        self.w, self.h = w, h
        self.px = [bytearray(_WHITE * w) for _ in range(h)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            self.px[y][3 * x0 : 3 * x1] = row

    def text(self, x: int, y: int, s: str, color=_BLACK, scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT["?"]).split()
            for gy, bits in enumerate(glyph):
                for gx, b in enumerate(bits):
                    if b == "1":
                        self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale, y + (gy + 1) * scale, color)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(r) for r in self.px)

        def chunk(tag: bytes, data: bytes) -> bytes:
            c = struct.pack(">I", len(data)) + tag + data
            return c + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def bar_chart_png(bars: Sequence[Bar], title: str, x_max: float = 2.0, footer: str = "") -> bytes:
    """Horizontal bars on a ratio axis from 0 to ``x_max`` (1.0 marked)."""
    label_w, plot_w, text_w = 250, 520, 330
    row_h, top, bottom = 34, 50, 70
    w = label_w + plot_w + text_w
    h = top + row_h * len(bars) + bottom
    c = _Canvas(w, h)
    c.text(10, 12, title)

    def xpos(v: float) -> int:
        return label_w + int(plot_w * max(0.0, min(v, x_max)) / x_max)

    # axis: gridlines every 0.25, labels every 0.5
    for i in range(int(x_max / 0.25) + 1):
        v = i * 0.25
        x = xpos(v)
        c.rect(x, top - 4, x + 1, h - bottom, _GREY if v != 1.0 else _BLACK)
        if i % 2 == 0:
            c.text(x - 18, h - bottom + 8, f"{v:.1f}")
    if footer:
        c.text(10, h - 26, footer)
    for i, b in enumerate(bars):
        y = top + i * row_h
        c.text(10, y + 10, b.label[:20])
        color = _BLUE if b.met is None else (_GREEN if b.met else _RED)
        c.rect(label_w, y + 8, xpos(b.value), y + row_h - 8, color)
        mid = y + row_h // 2
        c.rect(xpos(b.lo), mid - 1, xpos(b.hi) + 1, mid + 1, _BLACK)
        c.rect(xpos(b.lo), mid - 6, xpos(b.lo) + 1, mid + 6, _BLACK)
        c.rect(xpos(b.hi), mid - 6, xpos(b.hi) + 1, mid + 6, _BLACK)
        if b.target is not None:
            xt = xpos(b.target)
            c.rect(xt - 1, y + 3, xt + 2, y + row_h - 3, (240, 160, 0))
        c.text(label_w + plot_w + 10, y + 10, b.text[:26])
    return c.png()


def line_chart_png(
    panels: Sequence[tuple[str, str, dict[str, list[tuple[float, float]]]]],
    colors: dict[str, tuple[int, int, int]],
    footer: str = "",
) -> bytes:
    """Line charts side by side, one per ``(title, y unit, {series: [(x, y)]})``;
    x on a log2 axis (depths), y from 0 to the panel's maximum; a legend under them."""
    pw, ph, left, top, gap = 420, 300, 64, 40, 80
    legend_h = 24 * ((len(colors) + 1) // 2) + 40
    w = left + len(panels) * (pw + gap)
    h = top + ph + 40 + legend_h
    c = _Canvas(w, h)
    for k, (title, unit, series) in enumerate(panels):
        x0 = left + k * (pw + gap)
        pts = [p for s in series.values() for p in s]
        if not pts:
            continue
        xs = sorted({p[0] for p in pts})
        y_max = max(p[1] for p in pts) * 1.1 or 1.0
        c.text(x0, 10, f"{title} ({unit})")
        c.rect(x0, top, x0 + 1, top + ph, _BLACK)
        c.rect(x0, top + ph, x0 + pw, top + ph + 1, _BLACK)
        for i in range(5):
            v = y_max * i / 4
            y = top + ph - int(ph * i / 4)
            c.rect(x0, y, x0 + pw, y + 1, _GREY)
            c.text(x0 - 56, y - 4, f"{v:.3g}"[:5], scale=1)

        def xpos(x: float, x0: int = x0, xs: list = xs) -> int:
            if len(xs) == 1:
                return x0 + pw // 2
            lo, hi = math.log2(xs[0]), math.log2(xs[-1])
            return x0 + 20 + int((pw - 40) * (math.log2(x) - lo) / (hi - lo))

        def ypos(y: float, y_max: float = y_max) -> int:
            return top + ph - int(ph * y / y_max)

        for x in xs:
            c.text(xpos(x) - 6, top + ph + 8, str(int(x)))
        for name, s in series.items():
            col = colors.get(name, _BLACK)
            s = sorted(s)
            for (xa, ya), (xb, yb) in zip(s, s[1:]):
                pxa, pxb, pya, pyb = xpos(xa), xpos(xb), ypos(ya), ypos(yb)
                steps = max(abs(pxb - pxa), abs(pyb - pya), 1)
                for t in range(steps + 1):
                    px = pxa + (pxb - pxa) * t // steps
                    py = pya + (pyb - pya) * t // steps
                    c.rect(px - 1, py - 1, px + 2, py + 2, col)
            for x, y in s:
                c.rect(xpos(x) - 4, ypos(y) - 4, xpos(x) + 5, ypos(y) + 5, col)
    for i, (name, col) in enumerate(colors.items()):
        x = left + (i % 2) * 420
        y = top + ph + 40 + 24 * (i // 2)
        c.rect(x, y, x + 20, y + 12, col)
        c.text(x + 28, y, name)
    if footer:
        c.text(10, h - 20, footer)
    return c.png()
