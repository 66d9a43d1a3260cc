"""Outline region bodies into shared ``invoke_subgraph`` calls.

Capture traces each body inline.  This pass turns each body back into one
node, and gives structurally identical bodies (same code, same input shapes,
dtypes and strides) the *same* subgraph module and identifier, so AOTAutograd
and Inductor compile a repeated layer once::

    before                                   after
    ------                                   -----
    l0 = x.to_local(...)                     l0 = x.to_local(...)
    mm = l0 @ l1          # role body        body = invoke_subgraph(region_body_0, "localmap_fx_body_0", l0, l1)
    out = relu(mm)        # role body        out = body[0]
    y = from_local(out, ...)                 y = from_local(out, ...)

A body that capture already made an ``invoke_subgraph`` (a repeated call
Dynamo traced once, see :mod:`localmap_fx.reuse`) is adopted as it is: the
call is pointed at the shared submodule of identical bodies and renamed.

A body is left inline (and reported by :func:`find_outline_matches` with a
reason) when outlining would change what it computes: it is empty, returns
one of its inputs or a view of one, mutates an input in place, or receives
the same storage twice, or when it sits inside a nested subgraph
(checkpoint, control flow; see Note: [Regions inside nested subgraphs]).
"""

from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx as fx

from ..graph_utils import fetch_attr
from ..graph_utils import node_value as _val
from ..region import META_REGION, Region, RegionInput, find_regions

__all__ = ["OutlineMatch", "find_outline_matches", "outline_region", "outline_regions"]


@dataclasses.dataclass
class OutlineMatch:
    region: Region
    key: tuple
    skip_reason: str | None = None
    # the invoke_subgraph Dynamo already made of the body (a call that
    # reused a traced body, see localmap_fx.reuse); adopted, not re-wrapped
    shared_call: fx.Node | None = None


def shared_body_call(region: Region) -> fx.Node | None:
    """The ``invoke_subgraph`` node when the body is exactly one Dynamo-made call.

    (Plus its ``get_attr`` and ``getitem`` nodes.)  Capture makes such bodies
    for repeated calls (:mod:`localmap_fx.reuse`).
    """
    if region.outlined:
        return None
    calls = [n for n in region.body_nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    if len(calls) != 1:
        return None
    call = calls[0]
    for n in region.body_nodes:
        if n is call or (n.op == "get_attr" and n is call.args[0]):
            continue
        if not (n.op == "call_function" and n.target is operator.getitem and n.args[0] is call):
            return None
    return call


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None


def _arg_repr(a, env):
    if isinstance(a, fx.Node):
        return env.get(a, ("ext", a.name))
    if isinstance(a, (list, tuple)):
        return type(a).__name__, tuple(_arg_repr(x, env) for x in a)
    if isinstance(a, dict):
        return tuple((k, _arg_repr(v, env)) for k, v in a.items())
    if isinstance(a, torch.Tensor):
        return ("tensor", id(a))
    return repr(a)


def _structural_key(gm: fx.GraphModule) -> tuple:
    """Equal keys mean the two bodies compute the same thing on same-shaped inputs."""
    env: dict[fx.Node, tuple] = {}
    parts: list[tuple] = []
    for i, n in enumerate(gm.graph.nodes):
        env[n] = ("n", i)
        if n.op == "placeholder":
            v = _val(n)
            # str(): sizes may be SymInts (dynamic shapes), which do not hash
            meta = (
                (str(tuple(v.shape)), str(tuple(v.stride())), v.dtype, v.requires_grad)
                if isinstance(v, torch.Tensor)
                else repr(v)
            )
            parts.append(("ph", meta))
        elif n.op == "get_attr":
            parts.append(("attr", id(getattr(gm, n.target))))
        else:
            parts.append((n.op, n.target if isinstance(n.target, str) else id(n.target),
                          _arg_repr(n.args, env), _arg_repr(n.kwargs, env)))
    return tuple(parts)


def _skip_reason(region: Region) -> str | None:
    if region.scope:
        # the body would have to live in that subgraph's module: keep it
        # inline (the region is still lowered; see region.py)
        return f"inside the nested subgraph {region.scope}"
    if not region.body_nodes:
        return "empty body"
    inputs = [i.node for i in region.inputs]
    in_storages: dict[object, str] = {}
    for n in inputs:
        v = _val(n)
        if isinstance(v, torch.Tensor):
            k = _storage_key(v)
            if k is not None and k in in_storages:
                return f"inputs {in_storages[k]} and {n.name} share storage"
            in_storages[k] = n.name
    for o in region.outputs:
        if o in inputs:
            return f"returns its input {o.name}"
        v = _val(o)
        if isinstance(v, torch.Tensor) and _storage_key(v) in in_storages:
            return f"output {o.name} aliases an input"
    input_set = set(inputs)
    for n in region.body_nodes:
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        first = n.args[0] if n.args else None
        if name.endswith("_") and not name.startswith("_") and isinstance(first, fx.Node) and first in input_set:
            return f"mutates input {first.name} in place ({name})"
        if n.op == "call_function" and n.target is operator.setitem:
            return "mutates an input with setitem"
    return None


def find_outline_matches(gm: fx.GraphModule) -> list[OutlineMatch]:
    matches = []
    for region in find_regions(gm):
        if region.outlined:
            continue
        shared = shared_body_call(region)
        if shared is not None and not region.scope:
            # Dynamo already checked it (no aliasing, mutation or graph break)
            inner = fetch_attr(region.owner or gm, shared.args[0].target)
            matches.append(OutlineMatch(region, _structural_key(inner), None, shared))
            continue
        reason = _skip_reason(region)
        key = () if reason else _structural_key(region.subgraph)
        matches.append(OutlineMatch(region, key, reason))
    return matches


def outline_region(gm: fx.GraphModule, match: OutlineMatch, sub_name: str, identifier: str) -> fx.Node:
    """Replace one region body with ``invoke_subgraph(gm.<sub_name>, identifier, *inputs)``."""
    region = match.region
    graph = gm.graph
    first = region.body_nodes[0]
    with graph.inserting_before(first):
        sub_attr = graph.get_attr(sub_name)
        call = graph.call_function(
            torch.ops.higher_order.invoke_subgraph,
            (sub_attr, identifier, *[i.node for i in region.inputs]),
        )
        call.meta["custom"] = dict(first.meta.get("custom") or {})
        call.meta["stack_trace"] = first.meta.get("stack_trace")
        call.meta["example_value"] = tuple(_val(o) for o in region.outputs)
        getters = []
        for k, o in enumerate(region.outputs):
            g = graph.call_function(operator.getitem, (call, k))
            g.meta = dict(o.meta)
            getters.append(g)
    for o, g in zip(region.outputs, getters):
        o.replace_all_uses_with(g)
    for n in reversed(region.body_nodes):
        if n.users:
            raise AssertionError(f"body node {n.name} still used after outlining")
        graph.erase_node(n)
    call.meta[META_REGION] = {
        "spec": region.spec,
        "inputs": region.inputs,
        "outputs": getters,
        "identifier": identifier,
    }
    return call


def adopt_shared_call(gm: fx.GraphModule, match: OutlineMatch, sub_name: str, identifier: str) -> fx.Node:
    """Make Dynamo's ``invoke_subgraph`` of a body the region's outlined call.

    Points it at ``gm.<sub_name>`` (its own subgraph, or an identical body's)
    under ``identifier``; inputs are the call's operands in order.
    """
    region, call = match.region, match.shared_call
    call.args[0].target = sub_name
    call.args = (call.args[0], identifier, *call.args[2:])
    arg_of = {i.node: i for i in region.inputs}
    inputs = [arg_of.get(a) or RegionInput("captured", None, a) for a in call.args[2:]]
    getters = {n.args[1]: n for n in call.users if n.target is operator.getitem}
    call.meta[META_REGION] = {
        "spec": region.spec,
        "inputs": inputs,
        "outputs": [getters[k] for k in sorted(getters)],
        "identifier": identifier,
    }
    return call


def outline_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Outline every region body that can be; identical bodies share one subgraph."""
    by_key: dict[tuple, tuple[str, str]] = {}
    dynamo_names: set[str] = set()
    n_sub = sum(1 for name, _ in gm.named_children() if name.startswith("localmap_fx_body_"))
    for match in find_outline_matches(gm):
        if match.skip_reason is not None:
            continue
        if match.key not in by_key:
            name = f"localmap_fx_body_{n_sub}"
            n_sub += 1
            if match.shared_call is not None:
                gm.add_submodule(name, fetch_attr(gm, match.shared_call.args[0].target))
            else:
                gm.add_submodule(name, match.region.subgraph)
            # identifiers become module names in AOT graphs: keep them identifiers
            func = re.sub(r"\W", "_", match.region.spec.func.rsplit(".", 1)[-1])
            by_key[match.key] = (name, f"{name}_{func}")
        name, identifier = by_key[match.key]
        if match.shared_call is not None:
            dynamo_names.add(match.shared_call.args[0].target)
            adopt_shared_call(gm, match, name, identifier)
        else:
            outline_region(gm, match, name, identifier)
    # Dynamo's subgraphs now reached under our names (or merged into another)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in dynamo_names - used:
        delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return gm
