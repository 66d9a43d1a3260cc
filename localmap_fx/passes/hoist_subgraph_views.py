"""Recompute, in the caller, ``invoke_subgraph`` outputs that are views of the subgraph's inputs.

Runs on the AOTAutograd forward and backward graphs, just before Inductor.

Note: [Why outputs that alias subgraph inputs are hoisted]
    When AOTAutograd partitions an outlined region body, the forward subgraph
    often returns a *view of one of its inputs* as a saved activation (``h @ w``
    saves ``h.t()`` for the weight gradient).  Inductor 2.14.1 treats every
    ``invoke_subgraph`` output as a fresh buffer, so once the caller's last
    direct use of ``h`` is gone it reuses ``h``'s storage for a later buffer
    and the saved view is overwritten before the backward reads it: the
    weight gradient is silently wrong (``tests/compile/test_hoist_subgraph_views.py``
    pins this on plain ``nested_compile_region`` code, without localmap_fx).
    Re-creating the view chain in the caller makes the alias visible to
    Inductor's buffer planning; views cost nothing, and the subgraph's own
    (now unused) output stays in place so every call site of a shared
    subgraph keeps the same signature::

        before                                         after
        ------                                         -----
        r = invoke_subgraph(body, "b", h, w)           r = invoke_subgraph(body, "b", h, w)
        out = r[0]                                     out = r[0]
        h_t = r[1]          # = permute(view(h))       h_t = permute(view(h, [32, 16]), [1, 0])
        ... h's buffer reused here ...                 ... h stays alive while h_t is used ...
        return (loss, h_t)                             return (loss, h_t)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import is_view_op
from ..graph_utils import node_value
from . import PassResult

__all__ = ["SubgraphViewOutput", "find_subgraph_view_outputs", "hoist_view_output", "hoist_subgraph_views"]


@dataclasses.dataclass(frozen=True)
class SubgraphViewOutput:
    """Output ``index`` of ``call`` is ``chain`` applied to the call's operand ``operand``."""

    call: fx.Node
    getter: fx.Node
    index: int
    operand: int
    # (target, args after the viewed tensor, kwargs) per view op, innermost first
    chain: tuple[tuple[Any, tuple, tuple], ...]


def _view_chain(sub: fx.GraphModule, out: object) -> tuple[int, tuple] | None:
    """(placeholder position, view chain) when ``out`` is views of a subgraph input, else None."""
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    chain: list[tuple[Any, tuple, tuple]] = []
    node = out
    while isinstance(node, fx.Node) and node.op == "call_function" and is_view_op(node.target):
        rest = node.args[1:]
        if _has_node(rest) or _has_node(node.kwargs):
            return None  # a view whose shape depends on other graph values: leave it
        chain.append((node.target, tuple(rest), tuple(node.kwargs.items())))
        node = node.args[0]
    if not chain or not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    return placeholders.index(node), tuple(reversed(chain))


def _has_node(x: Any) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(x, found.append)
    return bool(found)


def find_subgraph_view_outputs(gm: fx.GraphModule) -> list[SubgraphViewOutput]:
    """Every used ``getitem`` of an ``invoke_subgraph`` call that is a view of the call's operand."""
    matches = []
    for call in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        sub_node, _identifier, *operands = call.args
        if not isinstance(sub_node, fx.Node) or sub_node.op != "get_attr":
            continue
        sub = getattr(gm, str(sub_node.target))
        (outputs,) = sub.graph.find_nodes(op="output")[0].args
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for getter in call.users:
            if getter.target is not operator.getitem or not getter.users:
                continue
            index = getter.args[1]
            if not isinstance(index, int):
                continue
            found = _view_chain(sub, outputs[index])
            if found is None:
                continue
            operand, chain = found
            if not isinstance(operands[operand], fx.Node):
                continue
            matches.append(SubgraphViewOutput(call, getter, index, operand, chain))
    return matches


def hoist_view_output(gm: fx.GraphModule, match: SubgraphViewOutput) -> fx.Node:
    """Replace ``match.getter`` by the same views of the caller's operand; returns the last view."""
    graph = gm.graph
    value = match.call.args[2 + match.operand]
    if not isinstance(value, fx.Node):
        raise AssertionError(f"operand {match.operand} of {match.call.name} is not a node")
    anchor = match.getter
    for target, rest, kwargs in match.chain:
        with graph.inserting_after(anchor):
            view = graph.call_function(target, (value, *rest), dict(kwargs))
        source = node_value(value)
        if isinstance(source, torch.Tensor):
            # the fake value of the view, for Inductor's lowering
            view.meta["val"] = target(source, *rest, **dict(kwargs))
        value = anchor = view
    value.meta = {**match.getter.meta, **value.meta}
    match.getter.replace_all_uses_with(value)
    graph.erase_node(match.getter)
    return value


def hoist_subgraph_views(gm: fx.GraphModule) -> PassResult:
    """Hoist every ``invoke_subgraph`` output that views a subgraph input (see the note above)."""
    matches = find_subgraph_view_outputs(gm)
    for match in matches:
        hoist_view_output(gm, match)
    return PassResult.of(gm, [gm] if matches else [])
