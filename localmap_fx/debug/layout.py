"""Our own drawing of a region graph: a layered layout, written as SVG or PNG.

No system package is needed: :func:`layout` places a :class:`.draw.Scene`
in pure Python, :func:`to_svg` writes SVG text, :func:`to_png` paints the same
picture with Pillow (a pip package, imported only there).

Note: [A small layered layout]
    Region graphs are small DAGs read left to right (data flows from graph
    inputs through regions to the output), so a reduced Sugiyama layout
    suffices: (1) columns by longest path from the sources, then every node
    without inputs (a collective that feeds a region's entry, a graph input)
    moved right next to its first consumer; (2) rows within a column ordered
    by a few sweeps of the barycenter heuristic (mean row of the neighbours
    already placed), which removes most crossings on graphs this size;
    (3) coordinates from the text size of each label (monospace estimate, so
    SVG and PNG agree without measuring fonts).  Edges are cubic curves from
    the right side of their source to the left side of their target, or
    straight lines when both sit in one column.  Edges closing a cycle (none
    in a well-formed dump) are ignored for layering.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from .draw import Scene

__all__ = ["Box", "Curve", "Picture", "layout", "to_svg", "to_png", "PillowNotFound", "MARKER"]

# Text metrics of the monospace font both renderers use (px at FONT_SIZE).
FONT_SIZE = 12
CHAR_W = 7.3
LINE_H = 15
PAD_X, PAD_Y = 10, 8
COL_GAP, ROW_GAP, MARGIN, TITLE_H = 110, 26, 20, 30
# Written into every file (SVG comment, PNG text chunk): the CLI replaces
# only files that hold it (see draw.write_new_or_own).
MARKER = "localmap_fx region graph"

_LINE_DASH = {"solid": None, "dashed": "6,4", "dotted": "2,3"}
_LINE_COLOR = {"solid": "#333333", "dashed": "#333333", "dotted": "#888888"}


class PillowNotFound(RuntimeError):
    """PNG output needs Pillow."""


@dataclasses.dataclass(frozen=True)
class Box:
    id: str
    kind: str
    lines: tuple[str, ...]
    x: float  # top-left corner
    y: float
    w: float
    h: float
    fill: str
    tooltip: str | None


@dataclasses.dataclass(frozen=True)
class Curve:
    src: str
    dst: str
    points: tuple[tuple[float, float], ...]  # start, control 1, control 2, end
    label: str | None
    label_at: tuple[float, float]
    style: str
    tooltip: str | None


@dataclasses.dataclass(frozen=True)
class Picture:
    title: str
    width: float
    height: float
    boxes: tuple[Box, ...]
    curves: tuple[Curve, ...]


_FILL = {"input": "#ffffff", "output": "#ffffff", "region": "#eef5e9", "collective": "#eeeeee"}


def _size(kind: str, lines: Sequence[str]) -> tuple[float, float]:
    w = max((len(s) for s in lines), default=1) * CHAR_W + 2 * PAD_X
    h: float = len(lines) * LINE_H + 2 * PAD_Y
    if kind in ("input", "output"):  # ellipses need room around the text
        w, h = w * 1.25, h * 1.3
    elif kind == "collective":
        w, h = w + 2 * PAD_X, h + PAD_Y
    return w, h


def _columns(ids: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    succ: dict[str, list[str]] = {i: [] for i in ids}
    pred: dict[str, list[str]] = {i: [] for i in ids}
    # drop edges that close a cycle (DFS back edges), keep the rest
    state: dict[str, int] = {}
    keep: list[tuple[str, str]] = []
    out_edges: dict[str, list[str]] = {i: [] for i in ids}
    for a, b in edges:
        out_edges[a].append(b)

    def dfs(n: str) -> None:
        state[n] = 1
        for m in out_edges[n]:
            if state.get(m) == 1:
                continue  # back edge
            keep.append((n, m))
            if m not in state:
                dfs(m)
        state[n] = 2

    for i in ids:
        if i not in state:
            dfs(i)
    for a, b in dict.fromkeys(keep):
        succ[a].append(b)
        pred[b].append(a)
    col: dict[str, int] = {}

    def depth(n: str) -> int:
        if n not in col:
            col[n] = 0  # guards recursion; the DAG has no cycle left
            col[n] = max((depth(p) + 1 for p in pred[n]), default=0)
        return col[n]

    for i in ids:
        depth(i)
    for i in ids:
        if not pred[i] and succ[i]:
            col[i] = max(0, min(col[s] for s in succ[i]) - 1)
    return col


def _order(columns: dict[int, list[str]], edges: list[tuple[str, str]], sweeps: int = 4) -> None:
    nbrs: dict[str, list[str]] = {}
    for a, b in edges:
        nbrs.setdefault(a, []).append(b)
        nbrs.setdefault(b, []).append(a)
    keys = sorted(columns)
    for sweep in range(sweeps):
        row = {n: i for c in keys for i, n in enumerate(columns[c])}
        for c in keys if sweep % 2 == 0 else reversed(keys):
            def bary(n: str, row: dict[str, int] = row) -> float:
                placed = [row[m] for m in nbrs.get(n, ()) if m in row]
                return sum(placed) / len(placed) if placed else row[n]

            columns[c].sort(key=bary)
            row.update({n: i for i, n in enumerate(columns[c])})


def layout(sc: Scene) -> Picture:
    """Positions for every shape and link of ``sc`` (pure; deterministic)."""
    ids = [s.id for s in sc.shapes]
    known = set(ids)
    edges = [(e.src, e.dst) for e in sc.links if e.src in known and e.dst in known and e.src != e.dst]
    col = _columns(ids, edges)
    columns: dict[int, list[str]] = {}
    for i in ids:
        columns.setdefault(col[i], []).append(i)
    _order(columns, edges)
    sizes = {s.id: _size(s.kind, s.label.split("\n")) for s in sc.shapes}
    col_w = {c: max(sizes[n][0] for n in ns) for c, ns in columns.items()}
    col_h = {c: sum(sizes[n][1] for n in ns) + ROW_GAP * (len(ns) - 1) for c, ns in columns.items()}
    height = max(col_h.values(), default=0.0)
    x = float(MARGIN)
    pos: dict[str, tuple[float, float]] = {}
    for c in sorted(columns):
        y = MARGIN + TITLE_H + (height - col_h[c]) / 2
        for n in columns[c]:
            w, h = sizes[n]
            pos[n] = (x + (col_w[c] - w) / 2, y)
            y += h + ROW_GAP
        x += col_w[c] + COL_GAP
    boxes = tuple(
        Box(
            s.id,
            s.kind,
            tuple(s.label.split("\n")),
            pos[s.id][0],
            pos[s.id][1],
            *sizes[s.id],
            s.fill or _FILL.get(s.kind, "#ffffff"),
            s.tooltip,
        )
        for s in sc.shapes
    )
    box_of = {b.id: b for b in boxes}
    links = [e for e in sc.links if e.src in box_of and e.dst in box_of]
    # ports: the edges leaving (entering) a side are spread along it in the
    # order of the boxes at their other end, so they do not meet in one point
    outs: dict[str, list[int]] = {}
    ins: dict[str, list[int]] = {}
    for k, e in enumerate(links):
        outs.setdefault(e.src, []).append(k)
        ins.setdefault(e.dst, []).append(k)
    src_y: dict[int, float] = {}
    dst_y: dict[int, float] = {}
    for ports, other, into in ((outs, "dst", src_y), (ins, "src", dst_y)):
        for nid, ks in ports.items():
            bx = box_of[nid]

            def far_y(k: int, other: str = other) -> float:
                far = box_of[getattr(links[k], other)]
                return far.y + far.h / 2

            for rank, link in enumerate(sorted(ks, key=far_y)):
                into[link] = bx.y + bx.h * (rank + 1) / (len(ks) + 1)
    curves = []
    for k, e in enumerate(links):
        a, b = box_of[e.src], box_of[e.dst]
        if col[e.src] != col[e.dst]:
            forward = col[e.src] < col[e.dst]
            p0 = (a.x + a.w, src_y[k]) if forward else (a.x, src_y[k])
            p3 = (b.x, dst_y[k]) if forward else (b.x + b.w, dst_y[k])
            dx = (p3[0] - p0[0]) / 2
            pts = (p0, (p0[0] + dx, p0[1]), (p3[0] - dx, p3[1]), p3)
        else:  # same column: top/bottom sides
            down = a.y < b.y
            p0 = (a.x + a.w / 2, a.y + a.h) if down else (a.x + a.w / 2, a.y)
            p3 = (b.x + b.w / 2, b.y) if down else (b.x + b.w / 2, b.y + b.h)
            pts = (p0, p0, p3, p3)
        mid = _bezier(pts, 0.5)
        curves.append(Curve(e.src, e.dst, pts, e.label, mid, e.style, e.tooltip))
    width = max(x - COL_GAP + MARGIN, 2 * MARGIN + len(sc.title) * CHAR_W)
    return Picture(sc.title, width, height + 2 * MARGIN + TITLE_H, boxes, tuple(curves))


def _bezier(p: Sequence[tuple[float, float]], t: float) -> tuple[float, float]:
    u = 1 - t
    c = (u**3, 3 * u * u * t, 3 * u * t * t, t**3)
    return (sum(k * q[0] for k, q in zip(c, p)), sum(k * q[1] for k, q in zip(c, p)))


def _octagon(b: Box) -> list[tuple[float, float]]:
    cut = min(b.w, b.h) * 0.25
    x0, y0, x1, y1 = b.x, b.y, b.x + b.w, b.y + b.h
    return [
        (x0 + cut, y0), (x1 - cut, y0), (x1, y0 + cut), (x1, y1 - cut),
        (x1 - cut, y1), (x0 + cut, y1), (x0, y1 - cut), (x0, y0 + cut),
    ]  # fmt: skip


def _text_top(b: Box) -> float:
    return b.y + (b.h - len(b.lines) * LINE_H) / 2


# --- SVG ------------------------------------------------------------------------------


def _f(v: float) -> str:
    return f"{v:.1f}"


def to_svg(pic: Picture) -> str:
    """SVG text of ``pic`` (self-contained; tooltips as ``<title>``)."""
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f"<!-- {MARKER}, drawn by localmap-fx inspect -->",
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_f(pic.width)}" height="{_f(pic.height)}" '
        f'viewBox="0 0 {_f(pic.width)} {_f(pic.height)}" '
        f'font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="{FONT_SIZE}">',
        "<defs>",
        *(
            f'<marker id="arrow-{style}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" '
            f'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>'
            for style, color in _LINE_COLOR.items()
        ),
        "</defs>",
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        f'<text x="{_f(pic.width / 2)}" y="{_f(MARGIN + 14)}" text-anchor="middle" font-size="{FONT_SIZE + 2}">'
        f"{escape(pic.title)}</text>",
    ]
    for c in pic.curves:
        (x0, y0), (x1, y1), (x2, y2), (x3, y3) = c.points
        dash = _LINE_DASH[c.style]
        out.append(f'<g class="edge" data-src="{escape(c.src)}" data-dst="{escape(c.dst)}">')
        if c.tooltip:
            out.append(f"<title>{escape(c.tooltip)}</title>")
        out.append(
            f'<path d="M{_f(x0)},{_f(y0)} C{_f(x1)},{_f(y1)} {_f(x2)},{_f(y2)} {_f(x3)},{_f(y3)}" fill="none" '
            f'stroke="{_LINE_COLOR[c.style]}" stroke-width="1.2"'
            + (f' stroke-dasharray="{dash}"' if dash else "")
            + f' marker-end="url(#arrow-{c.style})"/>'
        )
        if c.label:
            lx, ly = c.label_at
            w = len(c.label) * CHAR_W + 6
            out.append(
                f'<rect x="{_f(lx - w / 2)}" y="{_f(ly - LINE_H / 2 - 1)}" width="{_f(w)}" height="{LINE_H + 2}" '
                f'fill="#ffffff" fill-opacity="0.85"/>'
                f'<text x="{_f(lx)}" y="{_f(ly + 4)}" text-anchor="middle" fill="#555555">{escape(c.label)}</text>'
            )
        out.append("</g>")
    for b in pic.boxes:
        out.append(f'<g class="node {b.kind}" id="{escape(b.id)}">')
        if b.tooltip:
            out.append(f"<title>{escape(b.tooltip)}</title>")
        style = f'fill="{b.fill}" stroke="#333333" stroke-width="1.2"'
        if b.kind == "region":
            out.append(f'<rect x="{_f(b.x)}" y="{_f(b.y)}" width="{_f(b.w)}" height="{_f(b.h)}" rx="8" {style}/>')
        elif b.kind == "collective":
            pts = " ".join(f"{_f(px)},{_f(py)}" for px, py in _octagon(b))
            out.append(f'<polygon points="{pts}" {style}/>')
        else:
            cx, cy = b.x + b.w / 2, b.y + b.h / 2
            out.append(f'<ellipse cx="{_f(cx)}" cy="{_f(cy)}" rx="{_f(b.w / 2)}" ry="{_f(b.h / 2)}" {style}/>')
            if b.kind == "output":
                out.append(
                    f'<ellipse cx="{_f(cx)}" cy="{_f(cy)}" rx="{_f(b.w / 2 - 4)}" ry="{_f(b.h / 2 - 4)}" '
                    'fill="none" stroke="#333333"/>'
                )
        top = _text_top(b)
        for i, line in enumerate(b.lines):
            out.append(
                f'<text x="{_f(b.x + b.w / 2)}" y="{_f(top + (i + 1) * LINE_H - 3)}" text-anchor="middle">'
                f"{escape(line)}</text>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- PNG ------------------------------------------------------------------------------


def _rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return (int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16))


def to_png(pic: Picture, scale: float = 2.0) -> bytes:
    """PNG bytes of ``pic``, painted with Pillow; :class:`PillowNotFound` without it."""
    try:
        from PIL import Image, ImageDraw, ImageFont, PngImagePlugin
    except ImportError as e:
        raise PillowNotFound(
            "PNG output needs Pillow: `pip install pillow` (requirements-dev.txt installs it), "
            "or write --svg instead."
        ) from e
    import io

    def s(v: float) -> float:
        return v * scale

    img = Image.new("RGB", (math.ceil(s(pic.width)), math.ceil(s(pic.height))), "#ffffff")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=round(FONT_SIZE * scale))
    title_font = ImageFont.load_default(size=round((FONT_SIZE + 2) * scale))

    def text(x: float, y: float, line: str, fill: str = "#000000", f=font) -> None:
        draw.text((s(x), s(y)), line, fill=_rgb(fill), font=f, anchor="mm")

    text(pic.width / 2, MARGIN + 10, pic.title, f=title_font)
    for c in pic.curves:
        pts = [(s(px), s(py)) for px, py in (_bezier(c.points, t / 24) for t in range(25))]
        color = _rgb(_LINE_COLOR[c.style])
        dash = _LINE_DASH[c.style]
        if dash is None:
            draw.line(pts, fill=color, width=max(1, round(1.2 * scale)))
        else:
            on, off = (float(v) * scale for v in dash.split(","))
            _dashed(draw, pts, on, off, color, max(1, round(1.2 * scale)))
        _arrow_head(draw, pts[-2], pts[-1], color, 8 * scale)
        if c.label:
            lx, ly = c.label_at
            w = len(c.label) * CHAR_W + 6
            draw.rectangle((s(lx - w / 2), s(ly - LINE_H / 2), s(lx + w / 2), s(ly + LINE_H / 2)), fill="#ffffff")
            text(lx, ly, c.label, "#555555")
    for b in pic.boxes:
        box = (s(b.x), s(b.y), s(b.x + b.w), s(b.y + b.h))
        fill, outline, width = _rgb(b.fill), _rgb("#333333"), max(1, round(1.2 * scale))
        if b.kind == "region":
            draw.rounded_rectangle(box, radius=s(8), fill=fill, outline=outline, width=width)
        elif b.kind == "collective":
            draw.polygon([(s(px), s(py)) for px, py in _octagon(b)], fill=fill, outline=outline, width=width)
        else:
            draw.ellipse(box, fill=fill, outline=outline, width=width)
            if b.kind == "output":
                draw.ellipse((box[0] + s(4), box[1] + s(4), box[2] - s(4), box[3] - s(4)), outline=outline)
        top = _text_top(b)
        for i, line in enumerate(b.lines):
            text(b.x + b.w / 2, top + (i + 0.5) * LINE_H, line)
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", MARKER)
    info.add_text("Title", pic.title)
    buf = io.BytesIO()
    img.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def _dashed(draw, pts, on: float, off: float, color, width: int) -> None:
    carry, drawing = 0.0, True
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        seg = math.hypot(x1 - x0, y1 - y0)
        pos = 0.0
        while pos < seg:
            step = min((on if drawing else off) - carry, seg - pos)
            if drawing and seg:
                a, b = pos / seg, (pos + step) / seg
                draw.line([(x0 + (x1 - x0) * a, y0 + (y1 - y0) * a), (x0 + (x1 - x0) * b, y0 + (y1 - y0) * b)],
                          fill=color, width=width)
            pos += step
            carry += step
            if carry >= (on if drawing else off) - 1e-9:
                carry, drawing = 0.0, not drawing


def _arrow_head(draw, p: tuple[float, float], q: tuple[float, float], color, size: float) -> None:
    ang = math.atan2(q[1] - p[1], q[0] - p[0])
    left = (q[0] - size * math.cos(ang - 0.4), q[1] - size * math.sin(ang - 0.4))
    right = (q[0] - size * math.cos(ang + 0.4), q[1] - size * math.sin(ang + 0.4))
    draw.polygon([q, left, right], fill=color)
