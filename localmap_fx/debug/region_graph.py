"""Graph inputs, regions and outputs, and the DTensor edges between them.

:func:`region_graph` is the data :mod:`.draw` turns into a picture (plain,
JSON-ready values, stored in ``summary.json`` under ``"graph"``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..graph_utils import custom_meta, node_value
from ..region import META_INDEX, Region, find_regions
from .tables import enter_info, exit_info, global_desc, placements_text

__all__ = ["region_graph"]


def _input_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", None)
    if callable(src):
        src = src()
    return str(src) if src else node.name


def region_graph(gm: fx.GraphModule, regions: Sequence[Region] | None = None) -> dict:
    """Graph inputs, regions and outputs, and the DTensor edges between them.

    Run on the lowered graph *before* ``fuse_boundaries`` (every argument
    still has its ``to_local``).  Edges through user code between regions are
    marked ``"via": "user code"``.
    """
    if regions is None:
        regions = find_regions(gm)
    exit_owner: dict[fx.Node, tuple[int, int | None]] = {}
    for k, r in enumerate(regions):
        for e in r.exit_nodes:
            exit_owner[e] = (k, custom_meta(e).get(META_INDEX))
    enter_nodes = {n for r in regions for n in r.enter_nodes}

    def sources(start: fx.Node, limit: int = 256) -> list[tuple]:
        """Nearest region exits / DTensor placeholders upstream of ``start``
        (``direct`` when no user op sits in between)."""
        found: list[tuple] = []
        seen: set[fx.Node] = set()
        queue = collections.deque((a, True) for a in start.all_input_nodes)
        while queue and len(seen) < limit:
            n, direct = queue.popleft()
            if n in seen:
                continue
            seen.add(n)
            if n in exit_owner:
                found.append(("region", exit_owner[n], direct))
            elif n.op == "placeholder":
                if isinstance(node_value(n), torch.Tensor):
                    found.append(("input", n, direct))
            else:
                queue.extend((a, direct and n in enter_nodes) for a in n.all_input_nodes)
        return found

    nodes: list[dict] = []
    edges: list[dict] = []
    inputs_seen: dict[fx.Node, str] = {}

    def input_id(n: fx.Node) -> str:
        if n not in inputs_seen:
            iid = f"in{len(inputs_seen)}"
            inputs_seen[n] = iid
            v = node_value(n)
            nodes.append(
                {
                    "id": iid,
                    "kind": "input",
                    "label": _input_name(n),
                    "placements": placements_text(getattr(v, "placements", None)) if hasattr(v, "placements") else None,
                    "global": global_desc(v),
                }
            )
        return inputs_seen[n]

    for k, r in enumerate(regions):
        nodes.append({"id": f"r{k}", "kind": "region", "label": r.spec.func, "site": r.spec.call_site})
    for k, r in enumerate(regions):
        info = enter_info(r)
        first_enter: dict[int, fx.Node] = {}
        for n in r.enter_nodes:
            idx = custom_meta(n).get(META_INDEX)
            if idx is not None and idx not in first_enter:
                first_enter[idx] = n
        for idx, n in sorted(first_enter.items()):
            entry = info.get(idx, {})
            label = entry.get("placements") or "?"
            if entry.get("arrived") and entry.get("arrived") != entry.get("placements"):
                label = f"{entry['arrived']}->{entry.get('placements')}"
            for kind, what, is_direct in sources(n):
                src = input_id(what) if kind == "input" else f"r{what[0]}"
                edges.append(
                    {
                        "src": src,
                        "dst": f"r{k}",
                        "label": f"arg{idx}: {label}",
                        "via": None if is_direct else "user code",
                    }
                )
    # region outputs that reach the graph output
    out_node = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out_node is not None:
        nodes.append({"id": "out", "kind": "output", "label": "output"})
        for kind, what, is_direct in sources(out_node):
            if kind == "region":
                k, j = what
                r = regions[k]
                ex = exit_info(r).get(j, {})
                edges.append(
                    {
                        "src": f"r{k}",
                        "dst": "out",
                        "label": f"out{j}: {ex.get('placements', '?')}",
                        "via": None if is_direct else "user code",
                    }
                )
    unique = list({(e["src"], e["dst"], e["label"]): e for e in edges}.values())
    return {"nodes": nodes, "edges": unique}
