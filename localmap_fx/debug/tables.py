"""Region and redistribute tables, built from graphs (pure functions).

Everything here reads graphs and returns plain, JSON-ready values (lists of
dicts of str / int / None); nothing writes files or mutates a graph.

* :func:`region_rows` - one row per region of a captured or lowered graph:
  call site, placements (in / out / grad, as the lowered graph makes them
  explicit), local shapes and dtypes;
* :func:`plan_rows` - the redistribute plans lowering attached to entry nodes;
* :func:`mesh_groups` - process-group name -> mesh dimension, for attributing
  collectives (:mod:`.collectives`);
* :func:`region_text`, :func:`graph_text` - the text files of a dump.

:mod:`.collectives` builds the collective table, :mod:`.region_graph` the data
the drawing uses, :mod:`.report` renders all of them as ``summary.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import (
    custom_meta,
    is_from_local,
    is_redistribute,
    is_to_local,
    mesh_dim_names,
    node_value,
)
from ..region import META_INDEX, META_LOWERED, META_PLAN, Region, find_regions, index_of, placements_str
from .formatting import tensor_text

__all__ = [
    "graph_text",
    "region_text",
    "region_rows",
    "plan_rows",
    "mesh_groups",
    "is_lowered",
    "tensor_desc",
    "placements_text",
    "size_value",
]

# --- values ----------------------------------------------------------------------


def _dtype_abbr(dtype: torch.dtype) -> str:
    from torch.fx.graph import dtype_abbrs

    return dtype_abbrs.get(dtype, str(dtype).replace("torch.", ""))


def size_value(s: Any) -> int | str:
    """An int for a static size, else the size's text (``u0``, ``2*s1``).

    Never guards: a data-dependent size (``.tolist()`` under
    ``capture_scalar_outputs``) has no value to specialise on.
    """
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        if getattr(expr, "is_number", False):
            try:
                return int(expr)
            except (TypeError, ValueError):
                pass
        return str(expr)
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
    return {"dtype": _dtype_abbr(t.dtype), "shape": [size_value(s) for s in t.shape]}


def global_desc(v: Any) -> dict | None:
    """:func:`tensor_desc` of the global tensor (a DTensor's global shape)."""
    if not isinstance(v, torch.Tensor):
        return None
    return {"dtype": _dtype_abbr(v.dtype), "shape": [size_value(s) for s in v.shape]}


def placements_text(placements: Any) -> str:
    """:func:`region.placements_str` of anything a graph may hold for placements."""
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
    return "x".join(f"{n}:{k}" for n, k in zip(mesh_dim_names(spec), spec.mesh_shape)) or "-"


def _spec_list(specs: Any) -> list[str] | None:
    if specs is None:
        return None
    return [placements_text(s) for s in specs]


def region_text(region_id: str, region: Region) -> str:
    """One region's file: a header (spec, call site, inputs, outputs) and its body."""
    spec = region.spec
    ins = []
    for i in region.inputs:
        name = f"arg{i.index}" if i.kind == "arg" else "captured"
        ins.append(f"{name} <- {i.node.name} {tensor_text(tensor_desc(node_value(i.node)))}")
    outs = [f"out{j} <- {o.name} {tensor_text(tensor_desc(node_value(o)))}" for j, o in enumerate(region.outputs)]
    lines = [
        f"# localmap_fx region {region_id}: {spec.func}",
        f"# spec:      {spec.text()}",
        f"# defined:   {spec.func_site}",
        f"# called at: {spec.call_site} in {spec.call_function}",
        *([f"# inside:    nested subgraph {region.scope}"] if region.scope else []),
        "# inputs:    " + ("; ".join(ins) or "-"),
        "# outputs:   " + ("; ".join(outs) or "-"),
        "# The body below runs on every rank, on local tensors (local shapes).",
        "",
    ]
    return "\n".join(lines) + "\n" + graph_text(region.subgraph)


def enter_info(region: Region) -> dict[int, dict]:
    """Per argument index: placements, grad placements, redistribution, local value."""
    out: dict[int, dict] = {}
    for node in region.enter_nodes:
        idx = custom_meta(node).get(META_INDEX)
        if idx is None:
            continue
        info = out.setdefault(idx, {})
        if is_redistribute(node):
            src, dst = node_value(node.args[0]), node_value(node)
            info["arrived"] = placements_text(getattr(src, "placements", None))
            plan = node.meta.get(META_PLAN)
            if plan is not None:
                info["plan"] = plan.text()
            elif dst is not None:
                info["plan"] = f"{info['arrived']}->{placements_text(getattr(dst, 'placements', None))}"
        elif is_to_local(node):
            src = node_value(node.args[0])
            info["placements"] = placements_text(getattr(src, "placements", None))
            grad = node.kwargs.get("grad_placements")
            info["grad"] = placements_text(grad) if grad is not None else None
            info["local"] = tensor_desc(node_value(node))
            info.setdefault("arrived", info["placements"])
    return out


def exit_info(region: Region) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for node in region.exit_nodes:
        if not is_from_local(node):
            continue
        j = index_of(node)
        val = node_value(node)
        grad = node.kwargs.get("grad_placements")
        out[j] = {
            "placements": placements_text(getattr(val, "placements", None)),
            "grad": placements_text(grad) if grad is not None else None,
            "local": tensor_desc(node_value(node.args[0])),
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
        enter, exits = enter_info(region), exit_info(region)
        inputs = []
        for i in region.inputs:
            if i.kind == "arg":
                e = enter.get(i.index, {}) if i.index is not None else {}
                inputs.append(
                    {
                        "arg": i.index,
                        "placements": e.get("placements"),
                        "arrived": e.get("arrived"),
                        "redistribute": e.get("plan"),
                        "grad": e.get("grad"),
                        "local": tensor_desc(node_value(i.node)),
                    }
                )
            else:
                inputs.append(
                    {"arg": None, "captured": i.node.name, "local": tensor_desc(node_value(i.node))}
                )
        outputs = []
        for j, spec_j in enumerate(spec.out_placements):
            ex = exits.get(j)
            if ex is None:
                outputs.append({"index": j, "placements": placements_text(spec_j), "grad": None, "local": None})
            else:
                outputs.append({"index": j, **ex})
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
                "scope": region.scope,
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
                        "arg": custom_meta(node).get(META_INDEX),
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
        v = node_value(n)
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


def piece_rows(plan, reports, why_whole: str | None) -> dict:
    """The "pieces" entry of summary.json: which layers share one compiled piece.

    ``shared`` is False when the frame went to the inner compiler whole
    (``reason`` says why); ``rows`` then list the layers found, each inline.
    Otherwise one row per compiled piece: the layers it serves, its key
    digest and size, or why a span was not shared.
    """
    layers_text = plan.text() if plan is not None else None
    if reports is None:
        rows = []
        for span in plan.spans if plan is not None else ():
            rows.append({"piece": "-", "layers": [span.index], "key": span.digest, "nodes": span.stop - span.start,
                         "inline": span.reason or why_whole})
        return {"shared": False, "reason": why_whole, "layers_found": layers_text, "rows": rows}
    groups: dict[str, dict] = {}
    for r in reports:
        g = groups.setdefault(r.compiled_as, {"piece": r.compiled_as, "layers": [], "calls": 0,
                                              "key": r.key_digest, "nodes": r.n_nodes, "inline": None,
                                              "runtime": r.runtime})
        g["calls"] += 1
        if r.layer is not None:
            g["layers"].append(r.layer)
        if r.key_digest == "-":
            g["inline"] = r.reason or ("prefix / tail" if r.layer is None else None)
    return {"shared": True, "reason": None, "layers_found": layers_text, "rows": list(groups.values())}
