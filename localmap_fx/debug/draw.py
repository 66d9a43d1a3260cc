"""What the region graph of one dump shows, and its Graphviz form.

:func:`scene` is a pure function of ``summary.json``'s data: graph inputs
(ellipses, with their placements), regions (boxes: function, call site,
placements), the output, DTensor edges labelled with placements (dashed when
user code sits in between), and every collective as a marked octagon tied to
the region boundary that caused it (forward red, backward blue).

Two renderers draw a scene: :mod:`.layout` (our own layered layout, SVG and
PNG, no system package; the default) and Graphviz (:func:`to_dot`, and
:func:`render_graphviz` when its ``dot`` program is installed).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

from .atomic import atomic_write
from .formatting import bytes_text, short_site
from .report import cause_text

__all__ = [
    "Shape",
    "Link",
    "Scene",
    "scene",
    "to_dot",
    "render_graphviz",
    "find_dot",
    "write_new_or_own",
    "DotNotFound",
    "INSTALL_HINT",
]

INSTALL_HINT = (
    "Graphviz's `dot` program was not found on PATH. Drop --layout graphviz to use "
    "localmap-fx's own layout (no system package needed), or install Graphviz from your "
    "system package manager: `apt-get install graphviz` (Debian/Ubuntu), `dnf install graphviz` "
    "(Fedora), `brew install graphviz` (macOS) or `conda install graphviz`."
)

_PHASE_COLOR = {"forward": "#fde0dc", "backward": "#dce8fd"}
_REGION_FILL = "#eef5e9"


class DotNotFound(RuntimeError):
    """Graphviz's ``dot`` is not installed."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """One node of the picture."""

    id: str
    kind: str  # "input" | "region" | "output" | "collective"
    label: str  # lines separated by "\n"
    fill: str | None = None
    tooltip: str | None = None


@dataclasses.dataclass(frozen=True)
class Link:
    """One edge of the picture."""

    src: str
    dst: str
    label: str | None
    style: str  # "solid" | "dashed" (through user code) | "dotted" (a collective's cause)
    tooltip: str | None = None


@dataclasses.dataclass(frozen=True)
class Scene:
    title: str
    shapes: tuple[Shape, ...]
    links: tuple[Link, ...]


def _region_label(r: dict) -> str:
    ins = ", ".join(
        (i.get("arrived") + "->" if i.get("arrived") and i["arrived"] != i.get("placements") else "")
        + str(i.get("placements"))
        for i in r.get("inputs", [])
        if i.get("arg") is not None
    )
    outs = ", ".join(str(o.get("placements")) for o in r.get("outputs", []))
    return (
        f"{r['id']}  {r['func']}\n{short_site(r.get('call_site'))}\n"
        f"in [{ins}]  out [{outs}]\nmesh {r.get('mesh', '-')}"
    )


def scene(summary: dict, title: str | None = None) -> Scene:
    """The shapes and links to draw for one frame's ``summary.json`` data."""
    title = title or f"localmap_fx {summary.get('frame', '')} (inner={summary.get('inner', '?')})"
    regions = {r["id"]: r for r in summary.get("regions") or []}
    graph = summary.get("graph") or {}
    shapes: list[Shape] = []
    links: list[Link] = []
    declared: set[str] = set()
    for n in graph.get("nodes") or []:
        nid = n["id"]
        declared.add(nid)
        if n["kind"] == "region":
            r = regions.get(nid, {"id": nid, "func": n.get("label", nid), "call_site": n.get("site")})
            shapes.append(Shape(nid, "region", _region_label(r), _REGION_FILL))
        elif n["kind"] == "input":
            g = n.get("global")
            shape = f"{g['dtype']}[{', '.join(str(s) for s in g['shape'])}]" if g else ""
            label = f"{n['label']}\n{n.get('placements') or ''} {shape}".rstrip()
            shapes.append(Shape(nid, "input", label))
        else:
            shapes.append(Shape(nid, "output", str(n.get("label", nid))))
    # regions the graph section does not know (a dump written before lowering)
    for rid, r in regions.items():
        if rid not in declared:
            declared.add(rid)
            shapes.append(Shape(rid, "region", _region_label(r), _REGION_FILL))
    for e in graph.get("edges") or []:
        via = bool(e.get("via"))
        links.append(
            Link(e["src"], e["dst"], e.get("label"), "dashed" if via else "solid", "through user code" if via else None)
        )
    colls = summary.get("collectives") or {}
    k = 0
    for phase in ("forward", "backward"):
        for c in colls.get(phase) or []:
            cid = f"c{k}"
            dim = c.get("mesh_dim") or f"group {c.get('group')}"
            label = (
                f"{phase} #{k}\n{c['op']}"
                + (f" ({c['reduce_op']})" if c.get("reduce_op") else "")
                + f"\n{dim} x{c.get('group_size', '?')} · {bytes_text(c.get('bytes_per_rank'))}/rank"
            )
            k += 1
            shapes.append(Shape(cid, "collective", label, _PHASE_COLOR.get(phase, "#eeeeee"), cause_text(c)))
            ids = [i for i in (c.get("regions") or []) if i in declared]
            boundary = str(c.get("boundary") or "")
            if ids and boundary.startswith("enter"):
                links += [Link(cid, rid, boundary.split(" ", 1)[-1], "dotted") for rid in ids]
            elif ids:
                links += [Link(rid, cid, boundary, "dotted") for rid in ids]
            else:
                links += [
                    Link(rid, cid, "user code", "dotted") for rid in (c.get("input_from") or []) if rid in declared
                ]
    return Scene(title, tuple(shapes), tuple(links))


# --- Graphviz -----------------------------------------------------------------------


def _q(text: object) -> str:
    """A DOT double-quoted string; newlines become centred line breaks."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\r", "").replace("\n", "\\n") + '"'


def _attrs(**kw: object) -> str:
    return "[" + " ".join(f"{k}={_q(v)}" for k, v in kw.items() if v is not None) + "]"


_DOT_SHAPE = {
    "region": {"shape": "box", "style": "rounded,filled"},
    "input": {"shape": "ellipse"},
    "output": {"shape": "doublecircle"},
    "collective": {"shape": "octagon", "style": "filled"},
}


def to_dot(summary: dict, title: str | None = None) -> str:
    """DOT text for one frame's ``summary.json`` data."""
    sc = scene(summary, title)
    lines = [
        "digraph localmap_fx {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
        f"  labelloc=t; label={_q(sc.title)};",
    ]
    for s in sc.shapes:
        attrs = {**_DOT_SHAPE[s.kind], "fillcolor": s.fill, "label": s.label, "tooltip": s.tooltip}
        lines.append(f"  {_q(s.id)} {_attrs(**attrs)};")
    for e in sc.links:
        style = None if e.style == "solid" else e.style
        lines.append(f"  {_q(e.src)} -> {_q(e.dst)} {_attrs(label=e.label, style=style, tooltip=e.tooltip)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def find_dot() -> str | None:
    return shutil.which("dot")


def render_graphviz(dot_text: str, fmt: str = "svg", timeout: float = 60.0) -> bytes:
    """``dot -T<fmt>`` of ``dot_text``; :class:`DotNotFound` when Graphviz is missing."""
    dot = find_dot()
    if dot is None:
        raise DotNotFound(INSTALL_HINT)
    proc = subprocess.run(
        [dot, f"-T{fmt}"], input=dot_text.encode("utf-8"), capture_output=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dot failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def write_new_or_own(path: str, data: bytes, marker: bytes, force: bool = False) -> None:
    """Write ``path`` atomically; replace an existing file only if it holds
    ``marker`` (one this tool wrote before) or ``force``."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not force:
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        if marker not in head:
            raise FileExistsError(f"{path} exists and was not written by localmap-fx; remove it or pass --force")
    atomic_write(path, data)
