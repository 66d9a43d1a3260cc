"""What changed between two dumps (``localmap-fx inspect A --diff B``).

Regions are matched by function name and occurrence (the second call of
``_layer`` in A with the second in B), so edits that only move source lines
do not show up as changes; collectives are compared as multisets of
(phase, op, mesh dim, group size, bytes per rank, cause).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from .formatting import short_site, tensor_text
from .report import cause_text

__all__ = ["diff_summaries", "diff_frames"]


def _region_key_map(regions: Sequence[dict]) -> dict[tuple[str, int], dict]:
    seen: collections.Counter = collections.Counter()
    out = {}
    for r in regions:
        out[(r["func"], seen[r["func"]])] = r
        seen[r["func"]] += 1
    return out


def _region_fields(r: dict) -> dict[str, str]:
    args = [i for i in r.get("inputs", []) if i.get("arg") is not None]

    def arrived(i: dict) -> str:
        p = str(i.get("placements"))
        return f"{i['arrived']}->{p}" if i.get("arrived") and i["arrived"] != i.get("placements") else p

    return {
        "mesh": str(r.get("mesh")),
        "in": ", ".join(arrived(i) for i in args),
        "out": ", ".join(str(o.get("placements")) for o in r.get("outputs", [])),
        "in grad": ", ".join(str(i.get("grad") or "default") for i in args),
        "out grad": ", ".join(str(o.get("grad") or "default") for o in r.get("outputs", [])),
        "local inputs": ", ".join(tensor_text(i.get("local")) for i in r.get("inputs", [])),
        "local outputs": ", ".join(tensor_text(o.get("local")) for o in r.get("outputs", [])),
        "outlined": str(r.get("outlined")),
    }


def _coll_key(c: dict) -> tuple:
    return (
        c.get("phase"),
        str(c.get("op")) + (f" ({c['reduce_op']})" if c.get("reduce_op") else ""),
        c.get("mesh_dim") or f"group {c.get('group')}",
        c.get("group_size"),
        c.get("bytes_per_rank"),
        cause_text(c),
    )


def _coll_text(key: tuple) -> str:
    phase, op, dim, size, nbytes, cause = key
    return f"{phase} {op} {dim} x{size} {nbytes} B/rank, {cause}"


def diff_summaries(a: dict, b: dict) -> list[str]:
    """Lines describing how frame ``b`` differs from frame ``a`` (empty: same)."""
    out: list[str] = []
    ra, rb = _region_key_map(a.get("regions") or []), _region_key_map(b.get("regions") or [])
    for key in sorted(set(ra) | set(rb), key=lambda k: (k[0], k[1])):
        x, y = ra.get(key), rb.get(key)
        if x is None and y is not None:
            out.append(f"+ region {y['id']} {y['func']} ({short_site(y.get('call_site'))})")
        elif y is None and x is not None:
            out.append(f"- region {x['id']} {x['func']} ({short_site(x.get('call_site'))})")
        elif x is not None and y is not None:
            fx_, fy = _region_fields(x), _region_fields(y)
            for name in fx_:
                if fx_[name] != fy[name]:
                    out.append(f"~ region {x['id']} {x['func']}: {name} [{fx_[name]}] -> [{fy[name]}]")
    ca = collections.Counter(_coll_key(c) for p in ("forward", "backward") for c in (a.get("collectives") or {}).get(p) or [])
    cb = collections.Counter(_coll_key(c) for p in ("forward", "backward") for c in (b.get("collectives") or {}).get(p) or [])
    for phase in ("forward", "backward"):
        na = sum(v for k, v in ca.items() if k[0] == phase)
        nb = sum(v for k, v in cb.items() if k[0] == phase)
        if na != nb:
            out.append(f"~ {phase} collectives: {na} -> {nb}")
    for key in sorted(ca - cb, key=str):
        out.append(f"- {(ca - cb)[key]}x {_coll_text(key)}")
    for key in sorted(cb - ca, key=str):
        out.append(f"+ {(cb - ca)[key]}x {_coll_text(key)}")
    return out


def diff_frames(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """Frame name -> summary, on both sides; frames present on one side only are listed."""
    out: list[str] = []
    if len(a) == 1 and len(b) == 1:
        (na, sa), (nb, sb) = next(iter(a.items())), next(iter(b.items()))
        lines = diff_summaries(sa, sb)
        return [f"{na} -> {nb}:", *("  " + line for line in lines)] if lines else []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"- frame {name}")
        elif name not in a:
            out.append(f"+ frame {name}")
        else:
            lines = diff_summaries(a[name], b[name])
            if lines:
                out.append(f"{name}:")
                out.extend("  " + line for line in lines)
    return out
