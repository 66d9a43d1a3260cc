"""The region graph of one dump as Graphviz DOT, and SVG through ``dot``.

:func:`to_dot` is a pure function of ``summary.json``'s data: graph inputs
(ellipses, with their placements), regions (boxes: function, call site,
placements), the output, DTensor edges labelled with placements (dashed when
user code sits in between), and every collective as a marked octagon tied to
the region boundary that caused it (forward red, backward blue).
:func:`render_svg` runs Graphviz's ``dot``, which is a system package.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .atomic import atomic_write
from .formatting import bytes_text, short_site
from .report import cause_text

__all__ = ["to_dot", "render_svg", "find_dot", "write_new_or_own", "DotNotFound", "INSTALL_HINT"]

INSTALL_HINT = (
    "Graphviz's `dot` program was not found on PATH. Install Graphviz from your system "
    "package manager: `apt-get install graphviz` (Debian/Ubuntu), `dnf install graphviz` "
    "(Fedora), `brew install graphviz` (macOS) or `conda install graphviz`. "
    "Without it, `--dot OUT.dot` writes the graph as DOT text."
)

_PHASE_COLOR = {"forward": "#fde0dc", "backward": "#dce8fd"}


class DotNotFound(RuntimeError):
    """Graphviz's ``dot`` is not installed."""


def _q(text: object) -> str:
    """A DOT double-quoted string; newlines become centred line breaks."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\r", "").replace("\n", "\\n") + '"'


def _attrs(**kw: object) -> str:
    return "[" + " ".join(f"{k}={_q(v)}" for k, v in kw.items() if v is not None) + "]"


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


def to_dot(summary: dict, title: str | None = None) -> str:
    """DOT text for one frame's ``summary.json`` data."""
    lines = [
        "digraph localmap_fx {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
        f"  labelloc=t; label={_q(title or 'localmap_fx ' + str(summary.get('frame', '')) + ' (inner=' + str(summary.get('inner', '?')) + ')')};",
    ]
    regions = {r["id"]: r for r in summary.get("regions") or []}
    graph = summary.get("graph") or {}
    declared: set[str] = set()
    for n in graph.get("nodes") or []:
        nid = n["id"]
        declared.add(nid)
        if n["kind"] == "region":
            r = regions.get(nid, {"id": nid, "func": n.get("label", nid), "call_site": n.get("site")})
            lines.append(f"  {_q(nid)} {_attrs(shape='box', style='rounded,filled', fillcolor='#eef5e9', label=_region_label(r))};")
        elif n["kind"] == "input":
            g = n.get("global")
            shape = f"{g['dtype']}[{', '.join(str(s) for s in g['shape'])}]" if g else ""
            label = f"{n['label']}\n{n.get('placements') or ''} {shape}".rstrip()
            lines.append(f"  {_q(nid)} {_attrs(shape='ellipse', label=label)};")
        else:
            lines.append(f"  {_q(nid)} {_attrs(shape='doublecircle', label=n.get('label', nid))};")
    # regions the graph section does not know (a dump written before lowering)
    for rid, r in regions.items():
        if rid not in declared:
            declared.add(rid)
            lines.append(f"  {_q(rid)} {_attrs(shape='box', style='rounded,filled', fillcolor='#eef5e9', label=_region_label(r))};")
    for e in graph.get("edges") or []:
        style = "dashed" if e.get("via") else None
        tip = "through user code" if e.get("via") else None
        lines.append(f"  {_q(e['src'])} -> {_q(e['dst'])} {_attrs(label=e.get('label'), style=style, tooltip=tip)};")
    colls = summary.get("collectives") or {}
    k = 0
    for phase in ("forward", "backward"):
        for c in colls.get(phase) or []:
            cid = f"c{k}"
            k += 1
            dim = c.get("mesh_dim") or f"group {c.get('group')}"
            label = (
                f"{phase} #{k - 1}\n{c['op']}"
                + (f" ({c['reduce_op']})" if c.get("reduce_op") else "")
                + f"\n{dim} x{c.get('group_size', '?')} · {bytes_text(c.get('bytes_per_rank'))}/rank"
            )
            lines.append(
                f"  {_q(cid)} {_attrs(shape='octagon', style='filled', fillcolor=_PHASE_COLOR.get(phase, '#eeeeee'), label=label, tooltip=cause_text(c))};"
            )
            ids = [i for i in (c.get("regions") or []) if i in declared]
            boundary = str(c.get("boundary") or "")
            if ids and boundary.startswith("enter"):
                for rid in ids:
                    lines.append(f"  {_q(cid)} -> {_q(rid)} {_attrs(style='dotted', label=boundary.split(' ', 1)[-1])};")
            elif ids:
                for rid in ids:
                    lines.append(f"  {_q(rid)} -> {_q(cid)} {_attrs(style='dotted', label=boundary)};")
            else:
                for rid in [i for i in (c.get("input_from") or []) if i in declared]:
                    lines.append(f"  {_q(rid)} -> {_q(cid)} {_attrs(style='dotted', label='user code')};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def find_dot() -> str | None:
    return shutil.which("dot")


def render_svg(dot_text: str, timeout: float = 60.0) -> bytes:
    """SVG bytes for ``dot_text``; :class:`DotNotFound` when Graphviz is missing."""
    dot = find_dot()
    if dot is None:
        raise DotNotFound(INSTALL_HINT)
    proc = subprocess.run(
        [dot, "-Tsvg"], input=dot_text.encode("utf-8"), capture_output=True, timeout=timeout, check=False
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

