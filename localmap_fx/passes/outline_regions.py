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
Dynamo traced once, see :mod:`localmap_fx.capture.reuse`) is adopted as it is: the
call is pointed at the shared submodule of identical bodies and renamed.

A body is left inline (and reported by :func:`find_outline_matches` with a
reason) when outlining would change what it computes: it is empty, returns
one of its inputs or a view of one, mutates an input in place, or receives
the same storage twice, or when it sits inside a nested subgraph
(checkpoint, control flow; see Note: [Regions inside nested subgraphs]).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Callable

import torch
import torch.fx as fx

from ..analysis import Effects, find_effects, storage_key, structural_key
from ..graph_utils import binds_unbacked_symbols, fetch_attr, getitem_users, is_symbolic, subgraph_attr
from ..graph_utils import node_value as _val
from ..region import META_REGION, Region, RegionInput, find_regions, shared_body_call
from . import PassResult
from .inline_shared_bodies import inline_nested_shared_bodies

__all__ = [
    "OutlineMatch",
    "find_outline_matches",
    "outline_region",
    "outline_regions",
]


@dataclasses.dataclass
class OutlineMatch:
    region: Region
    key: tuple
    skip_reason: str | None = None
    # the invoke_subgraph Dynamo already made of the body (a call that
    # reused a traced body, see localmap_fx.capture.reuse); adopted, not re-wrapped
    shared_call: fx.Node | None = None


def _skip_reason(region: Region, effects_of: Callable[[Region], Effects]) -> str | None:
    if region.scope:
        # the body would have to live in that subgraph's module: keep it
        # inline (the region is still lowered; see region.py)
        return f"inside the nested subgraph {region.scope}"
    if not region.body_nodes:
        return "empty body"
    inputs = [i.node for i in region.inputs]
    if any(is_symbolic(_val(n)) for n in (*inputs, *region.outputs)):
        # as with reuse and layer sharing: Dynamo shares shape symbols and
        # their arithmetic between calls, which an outlined body would own
        return "symbolic sizes (dynamic shapes)"
    bound = binds_unbacked_symbols(region.body_nodes)
    if bound is not None:
        # Note: [Bodies that create data-dependent sizes]
        return f"creates data-dependent sizes ({bound.name} binds {_symbols(bound)})"
    in_storages: dict[object, str] = {}
    for n in inputs:
        k = storage_key(_val(n))
        if k is None:
            continue
        if k in in_storages:
            return f"inputs {in_storages[k]} and {n.name} share storage"
        in_storages[k] = n.name
    for o in region.outputs:
        if o in inputs:
            return f"returns its input {o.name}"
    # Note: [Deciding that a body writes to or aliases an input] (localmap_fx.analysis)
    effects = effects_of(region)
    if effects.error is not None:
        return f"writes to input ? in place ({effects.error})"  # cannot tell: inline is always right
    for j, o in enumerate(region.outputs):
        if effects.aliased_input(j) is not None:
            return f"output {o.name} aliases an input"
    written = effects.written_inputs()
    if written:
        i, op = written[0]
        return f"writes to input {inputs[i].name} in place ({op})"
    return None


# Note: [Bodies that create data-dependent sizes]
#     A ``.tolist()`` / ``.item()`` in a body (MoE split sizes) binds unbacked
#     symbols (``u0, u1, ...``; the node's ``meta["unbacked_bindings"]``) that
#     later body ops use in their sizes.  Outlined, those bindings live only
#     inside the subgraph: AOTAutograd traces the ``invoke_subgraph`` with
#     the symbols pending and, since the subgraph returns tensors rather than
#     the symbols, fails with ``PendingUnbackedSymbolNotFound``.  Inline, the
#     bindings stay in the graph that uses them, as upstream has them.
def _symbols(node: fx.Node) -> str:
    return ", ".join(sorted(str(s) for s in node.meta.get("unbacked_bindings", {})))


def _body_key(graph: fx.Graph, owner: torch.nn.Module) -> tuple:
    return structural_key(list(graph.nodes), functools.partial(getattr, owner))


def find_outline_matches(gm: fx.GraphModule) -> list[OutlineMatch]:
    matches = []
    # Equal body keys: the same code on inputs with equal metadata, so the
    # same effects; each distinct body is run once.
    effects: dict[tuple, Effects] = {}

    def effects_of(region: Region) -> Effects:
        key = _body_key(region.body_graph, region.body_owner)
        if key not in effects:
            effects[key] = find_effects(region.body_graph, region.body_owner,
                                        [_val(i.node) for i in region.inputs])
        return effects[key]

    for region in find_regions(gm):
        if region.outlined:
            continue
        shared = shared_body_call(region)
        if shared is not None and not region.scope:
            # Dynamo already checked it (no aliasing, mutation or graph break)
            inner = fetch_attr(region.owner or gm, subgraph_attr(shared).target)
            key = _body_key(inner.graph, inner)
            matches.append(OutlineMatch(region, key, None, shared))
            continue
        reason = _skip_reason(region, effects_of)
        key = () if reason else _body_key(region.body_graph, region.body_owner)
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
    if call is None:
        raise AssertionError(f"region {region.spec.func} has no shared call to adopt")
    attr = subgraph_attr(call)
    attr.target = sub_name
    call.args = (attr, identifier, *call.args[2:])
    arg_of = {i.node: i for i in region.inputs}
    inputs = []
    for a in call.args[2:]:
        if not isinstance(a, fx.Node):
            raise AssertionError(f"invoke_subgraph {call.name} has a non-node operand {a!r}")
        inputs.append(arg_of.get(a) or RegionInput("captured", None, a))
    getters = getitem_users(call)
    call.meta[META_REGION] = {
        "spec": region.spec,
        "inputs": inputs,
        "outputs": [getters[k] for k in sorted(getters)],
        "identifier": identifier,
    }
    return call


def outline_regions(gm: fx.GraphModule) -> PassResult:
    """Outline every region body that can be; identical bodies share one subgraph.

    Shared bodies inside nested subgraphs are inlined first (they stay
    inline there, see :func:`inline_nested_shared_bodies`).
    """
    changed = list(inline_nested_shared_bodies(gm).changed)
    by_key: dict[tuple, tuple[str, str]] = {}
    dynamo_names: set[str] = set()
    n_sub = sum(1 for name, _ in gm.named_children() if name.startswith("localmap_fx_body_"))
    for match in find_outline_matches(gm):
        if match.skip_reason is not None:
            continue
        changed.append(gm)
        if match.key not in by_key:
            name = f"localmap_fx_body_{n_sub}"
            n_sub += 1
            if match.shared_call is not None:
                gm.add_submodule(name, fetch_attr(gm, subgraph_attr(match.shared_call).target))
            else:
                gm.add_submodule(name, match.region.subgraph)
            # identifiers become module names in AOT graphs: keep them identifiers
            func = re.sub(r"\W", "_", match.region.spec.func.rsplit(".", 1)[-1])
            by_key[match.key] = (name, f"{name}_{func}")
        name, identifier = by_key[match.key]
        if match.shared_call is not None:
            dynamo_names.add(str(subgraph_attr(match.shared_call).target))
            adopt_shared_call(gm, match, name, identifier)
        else:
            outline_region(gm, match, name, identifier)
    # Dynamo's subgraphs now reached under our names (or merged into another)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in dynamo_names - used:
        delattr(gm, name)
    return PassResult.of(gm, changed)
