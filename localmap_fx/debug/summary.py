"""Tables of regions and collectives, built from graphs (pure functions).

Everything here reads graphs and returns plain, JSON-ready values (lists of
dicts of str / int / None); nothing writes files or mutates a graph.

* :func:`region_rows` - one row per region of a captured or lowered graph:
  call site, placements (in / out / grad, as the lowered graph makes them
  explicit), local shapes and dtypes.
* :func:`plan_rows` - the redistribute plans lowering attached to entry nodes.
* :func:`collective_rows` - one row per ``_c10d_functional`` collective in an
  AOT forward or backward graph (subgraphs expanded at each call), with its
  mesh dimension and the region boundary that caused it.
* :func:`region_graph` - regions, graph inputs and outputs and the edges
  between them, for drawing (:mod:`localmap_fx.debug.draw`).
(:mod:`localmap_fx.debug.report` renders them as ``summary.md``.)

Note: [Attributing a collective to a region]
    Capture wraps every node it creates in ``torch.fx.traceback.annotate``;
    AOTAutograd copies ``node.meta["custom"]`` to the forward *and* backward
    nodes it derives from them, so an AOT collective created by a boundary
    carries ``localmap_fx.spec`` (which ``local_map`` function),
    ``localmap_fx.role`` ("enter" / "exit") and ``localmap_fx.index`` (which
    argument or output).  The spec dict is shared by every call of one
    function, so the call is told apart by the user frame of the node's
    ``stack_trace``; calls from the same line (a loop) stay ambiguous and are
    all listed.  A collective without the annotation comes from user code
    outside any region (``y.redistribute(...)`` after a region, say): it is
    reported with its source line and, when there is one, the nearest region
    whose values it consumes.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import (
    call_site_of,
    custom_meta as _custom,
    fetch_attr,
    is_collective,
    is_from_local,
    is_redistribute,
    is_to_local,
    mesh_dim_names,
    node_value as _val,
)
from ..region import (
    META_INDEX,
    META_LOWERED,
    META_PLAN,
    META_REGION_ID,
    META_ROLE,
    META_SPEC,
    Region,
    find_regions,
    placements_str,
)

__all__ = [
    "graph_text",
    "region_text",
    "region_rows",
    "plan_rows",
    "mesh_groups",
    "collective_rows",
    "region_graph",
    "is_lowered",
    "tensor_desc",
    "tensor_text",
    "short_site",
]

# --- small formatting helpers --------------------------------------------------


def _dtype_abbr(dtype: torch.dtype) -> str:
    from torch.fx.graph import dtype_abbrs

    return dtype_abbrs.get(dtype, str(dtype).replace("torch.", ""))


def _dim(s: Any) -> int | str:
    try:
        return int(s)
    except (TypeError, ValueError):
        return str(s)


def tensor_desc(val: Any) -> dict | None:
    """``{"dtype": "f32", "shape": [8, 16]}`` (the local tensor of a DTensor)."""
    if val is None:
        return None
    local = getattr(val, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else val
    if not isinstance(t, torch.Tensor):
        return None
    return {"dtype": _dtype_abbr(t.dtype), "shape": [_dim(s) for s in t.shape]}


def tensor_text(desc: dict | None) -> str:
    if desc is None:
        return "-"
    return f"{desc['dtype']}[{', '.join(str(s) for s in desc['shape'])}]"


def short_site(site: str | None) -> str:
    """``/long/path/models.py:77`` -> ``models.py:77``."""
    if not site:
        return "-"
    return os.path.basename(site)


def _pl(placements: Any) -> str:
    if placements is None:
        return "None"
    try:
        return placements_str(tuple(placements))
    except TypeError:
        return repr(placements)


def graph_text(gm: fx.GraphModule) -> str:
    """The graph as ``print_readable`` prints it (no colours), plus a newline."""
    return gm.print_readable(print_output=False, include_stride=False, colored=False) + "\n"


def is_lowered(gm: fx.GraphModule) -> bool:
    """True once :func:`localmap_fx.lower` has made the boundaries explicit."""
    return any(n.meta.get(META_LOWERED) for n in gm.graph.nodes)


# --- regions -------------------------------------------------------------------


def _mesh_text(spec) -> str:
    names = mesh_dim_names(spec)
    return "x".join(f"{n}:{k}" for n, k in zip(names, spec.mesh_shape)) or "-"


def _spec_list(specs: Any) -> list[str] | None:
    if specs is None:
        return None
    return [_pl(s) for s in specs]


def region_text(region_id: str, region: Region) -> str:
    """One region's file: a header (spec, call site, inputs, outputs) and its body."""
    spec = region.spec
    ins = []
    for i in region.inputs:
        name = f"arg{i.index}" if i.kind == "arg" else "captured"
        ins.append(f"{name} <- {i.node.name} {tensor_text(tensor_desc(_val(i.node)))}")
    outs = [f"out{j} <- {o.name} {tensor_text(tensor_desc(_val(o)))}" for j, o in enumerate(region.outputs)]
    lines = [
        f"# localmap_fx region {region_id}: {spec.func}",
        f"# spec:      {spec.text()}",
        f"# defined:   {spec.func_site}",
        f"# called at: {spec.call_site} in {spec.call_function}",
        "# inputs:    " + ("; ".join(ins) or "-"),
        "# outputs:   " + ("; ".join(outs) or "-"),
        "# The body below runs on every rank, on local tensors (local shapes).",
        "",
    ]
    return "\n".join(lines) + "\n" + graph_text(region.subgraph)


def _enter_info(region: Region) -> dict[int, dict]:
    """Per argument index: placements, grad placements, redistribution, local value."""
    out: dict[int, dict] = {}
    for node in region.enter_nodes:
        idx = _custom(node).get(META_INDEX)
        if idx is None:
            continue
        info = out.setdefault(idx, {})
        if is_redistribute(node):
            src, dst = _val(node.args[0]), _val(node)
            info["arrived"] = _pl(getattr(src, "placements", None))
            plan = node.meta.get(META_PLAN)
            if plan is not None:
                info["plan"] = plan.text()
            elif dst is not None:
                info["plan"] = f"{info['arrived']}->{_pl(getattr(dst, 'placements', None))}"
        elif is_to_local(node):
            src = _val(node.args[0])
            info["placements"] = _pl(getattr(src, "placements", None))
            grad = node.kwargs.get("grad_placements")
            info["grad"] = _pl(grad) if grad is not None else None
            info["local"] = tensor_desc(_val(node))
            info.setdefault("arrived", info["placements"])
    return out


def _exit_info(region: Region) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for node in region.exit_nodes:
        if not is_from_local(node):
            continue
        j = _custom(node).get(META_INDEX)
        val = _val(node)
        grad = node.kwargs.get("grad_placements")
        out[j] = {
            "placements": _pl(getattr(val, "placements", None)),
            "grad": _pl(grad) if grad is not None else None,
            "local": tensor_desc(_val(node.args[0])),
        }
    return out


def region_rows(gm: fx.GraphModule, regions: Sequence[Region] | None = None) -> list[dict]:
    """One row per region of ``gm`` (captured or lowered), in program order.

    Grad placements are the explicit ones of a lowered graph; on a captured
    graph they are ``None`` where capture left them to DTensor's defaults.
    """
    if regions is None:
        regions = find_regions(gm)
    rows = []
    for k, region in enumerate(regions):
        spec = region.spec
        enter, exits = _enter_info(region), _exit_info(region)
        inputs = []
        for i in region.inputs:
            if i.kind == "arg":
                e = enter.get(i.index, {})
                inputs.append(
                    {
                        "arg": i.index,
                        "placements": e.get("placements"),
                        "arrived": e.get("arrived"),
                        "redistribute": e.get("plan"),
                        "grad": e.get("grad"),
                        "local": tensor_desc(_val(i.node)),
                    }
                )
            else:
                inputs.append(
                    {"arg": None, "captured": i.node.name, "local": tensor_desc(_val(i.node))}
                )
        outputs = []
        for j, spec_j in enumerate(spec.out_placements):
            e = exits.get(j)
            if e is None:
                outputs.append({"index": j, "placements": _pl(spec_j), "grad": None, "local": None})
            else:
                outputs.append({"index": j, **e})
        rows.append(
            {
                "id": f"r{k}",
                "func": spec.func,
                "spec": spec.text(),
                "call_site": spec.call_site,
                "call_function": spec.call_function,
                "func_site": spec.func_site,
                "mesh": _mesh_text(spec),
                "in_placements": _spec_list(spec.in_placements),
                "out_placements": _spec_list(spec.out_placements),
                "in_grad_placements": _spec_list(spec.in_grad_placements),
                "redistribute_inputs": spec.redistribute_inputs,
                "spmd_types": spec.spmd_types,
                "outlined": region.outlined,
                "inputs": inputs,
                "outputs": outputs,
            }
        )
    return rows


def plan_rows(gm: fx.GraphModule, regions: Sequence[Region] | None = None) -> list[dict]:
    """The planned redistributions at region entry (lowered graphs)."""
    if regions is None:
        regions = find_regions(gm)
    rows = []
    for k, region in enumerate(regions):
        for node in region.enter_nodes:
            plan = node.meta.get(META_PLAN)
            if plan is None:
                continue
            for step in plan.steps:
                rows.append(
                    {
                        "region": f"r{k}",
                        "func": region.spec.func,
                        "arg": _custom(node).get(META_INDEX),
                        "step": step.text(),
                        "collective": step.collective,
                        "mesh_dim": step.mesh_dim_name,
                        "group_size": step.group_size,
                        "bytes_per_rank": step.bytes_per_rank,
                    }
                )
    return rows


# --- process groups ------------------------------------------------------------


def _meshes(gm: fx.GraphModule, regions: Iterable[Region]) -> list:
    from torch.distributed.device_mesh import DeviceMesh

    found: list = []

    def add(m):
        if isinstance(m, DeviceMesh) and all(m is not x for x in found):
            found.append(m)

    for r in regions:
        add(r.spec.mesh)
    for n in gm.graph.nodes:
        v = _val(n)
        add(getattr(v, "device_mesh", None))
        add(v)
    return found


def mesh_groups(gm: fx.GraphModule, regions: Iterable[Region] = ()) -> dict[str, dict]:
    """Process-group name -> ``{"mesh_dim": "tp", "group_size": 4}`` for every
    mesh dimension of every mesh seen in ``gm`` (inputs and regions)."""
    groups: dict[str, dict] = {}
    for mesh in _meshes(gm, regions):
        names = mesh_dim_names(mesh)
        for d in range(mesh.ndim):
            try:
                name = mesh.get_group(d).group_name
            except Exception:  # noqa: BLE001 - a mesh without groups on this rank
                continue
            groups.setdefault(str(name), {"mesh_dim": names[d], "group_size": int(mesh.size(d))})
    return groups


# --- collectives ---------------------------------------------------------------


def _schema_args(node: fx.Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
    return out


def _nbytes(val: Any) -> int | str | None:
    if isinstance(val, (list, tuple)):
        parts = [_nbytes(v) for v in val]
        if all(isinstance(p, int) for p in parts):
            return sum(parts)
        return " + ".join(str(p) for p in parts)
    if not isinstance(val, torch.Tensor):
        return None
    n = val.numel() * val.element_size()
    try:
        return int(n)
    except (TypeError, ValueError):
        return str(n)


def _subgraph_calls(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """GraphModules a higher-order call runs (``invoke_subgraph``'s body, say)."""
    subs = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            try:
                obj = fetch_attr(gm, a.target)
            except AttributeError:
                continue
            if isinstance(obj, fx.GraphModule):
                subs.append(obj)
    return subs


def _walk(gm: fx.GraphModule, outer: fx.Node | None = None, depth: int = 0):
    """(node, enclosing call) for every node, descending into subgraphs at each call."""
    for node in gm.graph.nodes:
        yield node, outer
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) and depth < 8:
            for sub in _subgraph_calls(gm, node):
                yield from _walk(sub, outer or node, depth + 1)


def _annotation(node: fx.Node, outer: fx.Node | None) -> dict:
    ann = _custom(node)
    if outer is not None:
        if META_SPEC not in ann:
            return _custom(outer)
        if META_REGION_ID not in ann and META_REGION_ID in _custom(outer):
            # A node of a shared body: the call (outer node) says which region.
            return {**ann, META_REGION_ID: _custom(outer)[META_REGION_ID]}
    return ann


def _match_regions(ann: dict, site: str, regions: Sequence[dict]) -> list[str]:
    if META_REGION_ID in ann:
        return [ann[META_REGION_ID]]
    spec = ann.get(META_SPEC)
    if not isinstance(spec, dict):
        return []
    same = [r for r in regions if r["func"] == spec.get("func") and r["func_site"] == spec.get("func_site")]
    at_site = [r for r in same if r["call_site"] == site]
    return [r["id"] for r in (at_site or same)]


def _producer(node: fx.Node, limit: int = 64) -> fx.Node | None:
    """The nearest region node (annotated) whose value ``node`` consumes."""
    seen = set()
    queue = collections.deque(node.all_input_nodes)
    while queue and len(seen) < limit:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if META_SPEC in _custom(n):
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
        args = _schema_args(node)
        group = args.get("group_name")
        group = getattr(group, "group_name", group)
        group = None if group is None else str(group)
        g = groups.get(group, {})
        size = args.get("group_size", g.get("group_size"))
        inp = args.get("input", args.get("inputs"))
        val = [_val(x) for x in inp] if isinstance(inp, (list, tuple)) else _val(inp)
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
            row["func"] = ann[META_SPEC].get("func") if isinstance(ann[META_SPEC], dict) else None
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
                row["input_from"] = _match_regions(_custom(prod), psite, regions) or None
            else:
                row["input_from"] = None
        rows.append(row)
    return rows


# --- region graph (for drawing) ---------------------------------------------------


def _input_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", None)
    if callable(src):
        src = src()
    return str(src) if src else node.name


def _global_desc(v: Any) -> dict | None:
    if not isinstance(v, torch.Tensor):
        return None
    return {"dtype": _dtype_abbr(v.dtype), "shape": [_dim(s) for s in v.shape]}


def region_graph(gm: fx.GraphModule, regions: Sequence[Region] | None = None) -> dict:
    """Graph inputs, regions and outputs, and the DTensor edges between them.

    Run on the lowered graph *before* ``fuse_boundaries`` (every argument
    still has its ``to_local``).  Edges through user code between regions are
    marked ``"via": "user code"``.
    """
    if regions is None:
        regions = find_regions(gm)
    exit_owner: dict[fx.Node, tuple[int, int]] = {}
    for k, r in enumerate(regions):
        for e in r.exit_nodes:
            exit_owner[e] = (k, _custom(e).get(META_INDEX))
    enter_nodes = {n for r in regions for n in r.enter_nodes}

    def sources(start: fx.Node, limit: int = 256) -> list[tuple]:
        """Nearest region exits / DTensor placeholders upstream of ``start``
        (``direct`` when no user op sits in between)."""
        found, seen = [], set()
        queue = collections.deque((a, True) for a in start.all_input_nodes)
        while queue and len(seen) < limit:
            n, direct = queue.popleft()
            if n in seen:
                continue
            seen.add(n)
            if n in exit_owner:
                found.append(("region", exit_owner[n], direct))
            elif n.op == "placeholder":
                if isinstance(_val(n), torch.Tensor):
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
            v = _val(n)
            nodes.append(
                {
                    "id": iid,
                    "kind": "input",
                    "label": _input_name(n),
                    "placements": _pl(getattr(v, "placements", None)) if hasattr(v, "placements") else None,
                    "global": _global_desc(v),
                }
            )
        return inputs_seen[n]

    for k, r in enumerate(regions):
        nodes.append({"id": f"r{k}", "kind": "region", "label": r.spec.func, "site": r.spec.call_site})
    for k, r in enumerate(regions):
        info = _enter_info(r)
        first_enter: dict[int, fx.Node] = {}
        for n in r.enter_nodes:
            idx = _custom(n).get(META_INDEX)
            if idx is not None and idx not in first_enter:
                first_enter[idx] = n
        for idx, n in sorted(first_enter.items()):
            e = info.get(idx, {})
            label = e.get("placements") or "?"
            if e.get("arrived") and e.get("arrived") != e.get("placements"):
                label = f"{e['arrived']}->{e.get('placements')}"
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
                ex = _exit_info(r).get(j, {})
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
