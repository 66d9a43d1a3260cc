"""Drop boundary round trips between adjacent regions.

When region A's output goes straight into region B with the same placements
and the same gradient placements, ``from_local`` followed by ``to_local`` is
the identity in forward *and* backward (the gradient is re-wrapped with the
placements it already has).  This pass feeds A's local output to B directly::

    before                                               after
    ------                                               -----
    y = from_local(o, mesh, (S(0),), grad=(S(0),))       (y kept only if used elsewhere)
    l = y.to_local(grad_placements=(S(0),))
    b = body_B(l)                                        b = body_B(o)

It runs after :func:`localmap_fx.lower`, when grad placements are explicit.
Round trips inside nested subgraphs (a checkpoint body) are removed in their
own graph; the result names every module whose graph changed.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..graph_utils import is_from_local, is_to_local, nested_graphs, node_value
from ..region import META_LOWERED, role_of
from . import PassResult

__all__ = ["RoundTrip", "find_round_trips", "remove_round_trip", "fuse_boundaries"]


@dataclasses.dataclass(frozen=True)
class RoundTrip:
    owner: fx.GraphModule  # the module whose graph holds both nodes
    from_local: fx.Node
    to_local: fx.Node


def find_round_trips(gm: fx.GraphModule) -> list[RoundTrip]:
    """Round trips in ``gm.graph`` and in every nested subgraph (each stays in its graph)."""
    out = []
    owners: dict[int, fx.GraphModule] = {}  # one module per graph, the first found
    for g in nested_graphs(gm):
        owners.setdefault(id(g.module.graph), g.module)
    for owner, node in ((m, n) for m in owners.values() for n in m.graph.nodes):
        if not (is_to_local(node) and role_of(node) == "enter"):
            continue
        src = node.args[0]
        if not (isinstance(src, fx.Node) and is_from_local(src) and role_of(src) == "exit"):
            continue
        if not (node.meta.get(META_LOWERED) and src.meta.get(META_LOWERED)):
            continue
        g_in = node.kwargs.get("grad_placements")
        g_out = src.kwargs.get("grad_placements")
        if not (isinstance(g_in, (list, tuple)) and isinstance(g_out, (list, tuple))) or tuple(g_in) != tuple(g_out):
            continue
        local, dst = node_value(src.args[0]), node_value(node)
        if local is None or dst is None or local.device != dst.device or local.dtype != dst.dtype:
            continue
        out.append(RoundTrip(owner, src, node))
    return out


def remove_round_trip(rt: RoundTrip) -> None:
    """Feed the local tensor to the ``to_local``'s users; drop the ``from_local`` if now unused."""
    graph = rt.owner.graph  # the root graph or a nested subgraph's
    local = rt.from_local.args[0]
    if not isinstance(local, fx.Node):
        raise AssertionError(f"from_local {rt.from_local.name} has no local tensor node")
    rt.to_local.replace_all_uses_with(local)
    graph.erase_node(rt.to_local)
    if not rt.from_local.users:
        graph.erase_node(rt.from_local)


def fuse_boundaries(gm: fx.GraphModule) -> PassResult:
    """Remove every round trip of ``gm`` (see module docstring)."""
    trips = find_round_trips(gm)
    for rt in trips:
        remove_round_trip(rt)
    return PassResult.of(gm, (rt.owner for rt in trips))
