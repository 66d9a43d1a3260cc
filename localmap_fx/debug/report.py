"""``summary.md``: the region and collective tables as Markdown.

Pure functions of ``summary.json``'s data (see :mod:`.tables` and :mod:`.collectives`), shared by
the dumper, the CLI, the drawing and the diff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .formatting import short_site, tensor_text

__all__ = ["summary_markdown", "region_table", "collective_table", "cause_text"]


def cause_text(row: dict) -> str:
    """``r0 _scale_rows enter arg0`` / ``user code (input from r1)``."""
    if row.get("boundary") == "user code":
        frm = row.get("input_from")
        return "user code" + (f" (input from {'|'.join(frm)})" if frm else "")
    ids = "|".join(row.get("regions") or []) or "?"
    return f"{ids} {row.get('func') or ''} {row.get('boundary')}".replace("  ", " ")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(x: Any) -> str:
        s = "-" if x is None or x == "" else str(x)
        return s.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return out


def _list(xs: Sequence[str] | None) -> str:
    return "-" if xs is None else ", ".join(xs) if xs else "-"


def region_table(regions: Sequence[dict]) -> list[str]:
    rows = []
    for r in regions:
        ins = [i for i in r["inputs"]]
        eff_in = []
        for i in ins:
            if i.get("arg") is None:
                continue
            p = i.get("placements") or "?"
            if i.get("arrived") and i["arrived"] != i.get("placements"):
                p = f"{i['arrived']}->{p}"
            eff_in.append(p)
        grads_in = [i.get("grad") or "default" for i in ins if i.get("arg") is not None]
        rows.append(
            [
                r["id"],
                r["func"],
                f"{short_site(r['call_site'])} ({r['call_function']})",
                r["mesh"],
                _list(eff_in),
                _list([o.get("placements") or "?" for o in r["outputs"]]),
                _list(grads_in),
                _list([o.get("grad") or "default" for o in r["outputs"]]),
                _list([tensor_text(i.get("local")) for i in ins]),
                _list([tensor_text(o.get("local")) for o in r["outputs"]]),
            ]
        )
    return _md_table(
        ["id", "region", "call site", "mesh", "in", "out", "in grad", "out grad", "local inputs", "local outputs"],
        rows,
    )


def collective_table(rows: Sequence[dict]) -> list[str]:
    table = []
    for k, c in enumerate(rows):
        op = c["op"] + (f" ({c['reduce_op']})" if c.get("reduce_op") else "")
        table.append(
            [
                k,
                c["phase"],
                op,
                c.get("mesh_dim") or (f"group {c['group']}" if c.get("group") else None),
                c.get("group_size"),
                c.get("bytes_per_rank"),
                cause_text(c),
                short_site(c.get("site")),
            ]
        )
    return _md_table(
        ["#", "phase", "op", "mesh dim", "group size", "bytes/rank", "caused by", "source line"], table
    )


def summary_markdown(summary: dict) -> str:
    """``summary.md``: the region table and the collective table of one frame."""
    lines = [f"# localmap_fx dump {summary.get('frame', '?')}", ""]
    colls = summary.get("collectives") or {}
    aot = summary.get("aot_graphs") or []
    if aot:
        per_phase = [
            f"{p} {len(colls.get(p) or [])}" if p in aot else f"{p} not compiled yet"
            for p in ("forward", "backward")
        ]
        coll_text = "collectives: " + ", ".join(per_phase)
    elif summary.get("inner") == "eager":
        coll_text = "collectives: unknown (inner compiler eager has no AOT graphs)"
    else:
        coll_text = "collectives: no AOT graph yet"
    n_regions = len(summary.get("regions") or [])
    lines.append(f"inner compiler: {summary.get('inner', '?')} · regions: {n_regions} · {coll_text}")
    lines += ["", "## Regions", ""]
    if summary.get("regions"):
        lines += region_table(summary["regions"])
    else:
        lines.append("No local_map region in this frame.")
    plans = summary.get("redistributes") or []
    if plans:
        lines += ["", "## Redistributions at region entry (planned)", ""]
        lines += _md_table(
            ["region", "arg", "step", "collective", "mesh dim", "group size", "bytes/rank"],
            [
                [f"{p['region']} {p['func']}", f"arg{p['arg']}", p["step"], p["collective"],
                 p["mesh_dim"], p["group_size"], p["bytes_per_rank"]]
                for p in plans
            ],
        )
    pieces = summary.get("pieces")
    if pieces and (pieces.get("shared") or pieces.get("rows")):
        lines += ["", "## Layer pieces", ""]
        if pieces.get("shared"):
            lines.append("Layers with one key run one compiled piece (compiled once).")
        else:
            lines.append(f"Compiled as one graph: {pieces.get('reason')}.")
        if pieces.get("rows"):
            lines.append("")
            lines += _md_table(
                ["piece", "layers", "calls", "key", "nodes", "not shared because", "runs as"],
                [[r["piece"], ", ".join(str(i) for i in r["layers"]) or "-", r.get("calls", "-"), r["key"],
                  r["nodes"], r.get("inline"), r.get("runtime", "-")] for r in pieces["rows"]],
            )
    if summary.get("border"):
        lines += ["", "## DTensor border", "", summary["border"]]
    lines += ["", "## Collectives", ""]
    all_rows = [c for p in ("forward", "backward") for c in (colls.get(p) or [])]
    if all_rows:
        lines += collective_table(all_rows)
    elif aot:
        lines.append("None in the AOT graphs.")
    else:
        lines.append("No AOT graph was compiled, so no collective is known.")
    if summary.get("errors"):
        lines += ["", "## Errors while dumping", ""]
        lines += [f"- {e}" for e in summary["errors"]]
    files = summary.get("files") or {}
    if files:
        lines += ["", "## Files", ""]
        lines += [f"- `{name}`: {what}" for name, what in files.items()]
    return "\n".join(lines) + "\n"
