"""The collective table: every functional collective of an AOT graph, attributed.

:func:`collective_rows` lists each ``_c10d_functional`` collective of an AOT
forward or backward graph (subgraphs expanded at each call) with its mesh
dimension, bytes per rank and the region boundary that caused it.  Plain,
JSON-ready values; nothing writes files or mutates a graph.  Sizes that are
symbolic (dynamic shapes, data-dependent split sizes) are written as their
expressions, never guarded on.

Note: [Attributing a collective to a region]
    Capture wraps every node it creates in ``torch.fx.traceback.annotate``;
    AOTAutograd copies ``node.meta["custom"]`` to the forward *and* backward
    nodes it derives from them, so an AOT collective created by a boundary
    carries ``META_SPEC`` (which ``local_map`` function), ``META_ROLE``
    ("enter" / "exit") and ``META_INDEX`` (which argument or output).  The
    spec dict is shared by every call of one function, so the call is told
    apart by ``META_REGION_ID`` (added by the dumper) or else the user frame
    of the node's ``stack_trace``; calls from the same line (a loop) without
    the id stay ambiguous and are all listed.  A collective without the
    annotation comes from user code outside any region (``y.redistribute(...)``
    after a region, say): it is reported with its source line and, when there
    is one, the nearest region whose values it consumes.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import HigherOrderOperator
from ..graph_utils import call_site_of, custom_meta, is_collective, node_value, schema_args, subgraph_calls
from ..region import META_INDEX, META_REGION_ID, META_ROLE, META_SPEC, spec_of
from .tables import size_value, tensor_desc

__all__ = ["collective_rows"]


def _nbytes(val: Any) -> int | str | None:
    if isinstance(val, (list, tuple)):
        parts = [_nbytes(v) for v in val]
        ints = [p for p in parts if isinstance(p, int)]
        if len(ints) == len(parts):
            return sum(ints)
        return " + ".join(str(p) for p in parts)
    if not isinstance(val, torch.Tensor):
        return None
    return size_value(val.numel() * val.element_size())


def _walk(gm: fx.GraphModule, outer: fx.Node | None = None, depth: int = 0):
    """(node, enclosing call) for every node, descending into subgraphs at each call."""
    for node in gm.graph.nodes:
        yield node, outer
        if node.op == "call_function" and isinstance(node.target, HigherOrderOperator) and depth < 8:
            for _, sub in subgraph_calls(gm, node):
                yield from _walk(sub, outer or node, depth + 1)


def _annotation(node: fx.Node, outer: fx.Node | None) -> dict:
    ann = custom_meta(node)
    if outer is not None:
        if META_SPEC not in ann:
            return custom_meta(outer)
        if META_REGION_ID not in ann and META_REGION_ID in custom_meta(outer):
            # A node of a shared body: the call (outer node) says which region.
            return {**ann, META_REGION_ID: custom_meta(outer)[META_REGION_ID]}
    return ann


def _match_regions(ann: dict, site: str, regions: Sequence[dict]) -> list[str]:
    if META_REGION_ID in ann:
        return [ann[META_REGION_ID]]
    spec = spec_of(ann.get(META_SPEC))
    if spec is None:
        return []
    same = [r for r in regions if r["func"] == spec.get("func") and r["func_site"] == spec.get("func_site")]
    at_site = [r for r in same if r["call_site"] == site]
    return [r["id"] for r in (at_site or same)]


def _producer(node: fx.Node, limit: int = 64) -> fx.Node | None:
    """The nearest region node (annotated) whose value ``node`` consumes."""
    seen: set[fx.Node] = set()
    queue = collections.deque(node.all_input_nodes)
    while queue and len(seen) < limit:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if META_SPEC in custom_meta(n):
            return n
        queue.extend(n.all_input_nodes)
    return None


def collective_rows(
    phase: str,
    gm: fx.GraphModule,
    regions: Sequence[dict] = (),
    groups: dict[str, dict] | None = None,
) -> list[dict]:
    """Every functional collective ``gm`` runs (``phase``: "forward"/"backward").

    ``regions`` are :func:`region_rows` (for attribution), ``groups`` is
    :func:`mesh_groups` (group name -> mesh dimension and size).
    """
    groups = groups or {}
    rows = []
    for node, outer in _walk(gm):
        if not is_collective(node):
            continue
        args = schema_args(node.target, node.args, dict(node.kwargs))
        group = args.get("group_name")
        group = getattr(group, "group_name", group)
        group = None if group is None else str(group)
        g = groups.get(group, {}) if group is not None else {}
        size = args.get("group_size", g.get("group_size"))
        inp = args.get("input", args.get("inputs"))
        val = [node_value(x) for x in inp] if isinstance(inp, (list, tuple)) else node_value(inp)
        ann = _annotation(node, outer)
        site, fn = call_site_of([node] if node.meta.get("stack_trace") else [outer] if outer else [])
        role = ann.get(META_ROLE)
        index = ann.get(META_INDEX)
        row = {
            "phase": phase,
            "op": node.target._opname,
            "node": node.name,
            "reduce_op": args.get("reduce_op"),
            "mesh_dim": g.get("mesh_dim"),
            "group": group,
            "group_size": None if size is None else int(size),
            "bytes_per_rank": _nbytes(val),
            "input": tensor_desc(val) if not isinstance(val, list) else None,
            "site": None if site == "<unknown>" else site,
            "function": None if fn == "<unknown>" else fn,
        }
        if META_SPEC in ann:
            row["regions"] = _match_regions(ann, site, regions)
            spec = spec_of(ann[META_SPEC])
            row["func"] = None if spec is None else spec.get("func")
            if role == "enter":
                row["boundary"] = f"enter arg{index}"
            elif role == "exit":
                row["boundary"] = f"exit out{index}"
            else:
                row["boundary"] = role or "region"
            row["input_from"] = None
        else:
            row["regions"] = []
            row["func"] = None
            row["boundary"] = "user code"
            prod = _producer(node)
            if prod is not None:
                psite, _ = call_site_of([prod])
                row["input_from"] = _match_regions(custom_meta(prod), psite, regions) or None
            else:
                row["input_from"] = None
        rows.append(row)
    return rows
