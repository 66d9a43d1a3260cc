"""Put outlined region bodies back inline.

The inverse of :func:`localmap_fx.passes.outline_regions.outline_regions`,
used when layer sharing makes outlining pointless or costly (see Note:
[When "auto" shares layers] in :mod:`localmap_fx.compiler.pipeline`): a shared layer
piece is compiled once anyway, and an inline body fuses with its
neighbours, where an ``invoke_subgraph`` call is a kernel border and a call
at run time::

    before                                                after
    ------                                                -----
    body = invoke_subgraph(localmap_fx_body_0, id, l0, l1)    mm = l0 @ l1      # role body
    out = body[0]                                             out = relu(mm)    # role body

The copied nodes keep the body's metadata (region annotations included), so
:func:`localmap_fx.find_regions` still sees every region.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import CUSTOM, fetch_attr, subgraph_attr
from ..region import META_REGION
from . import PassResult

__all__ = ["OutlinedCall", "find_outlined_calls", "inline_body", "inline_bodies", "splice_subgraph_call"]


@dataclasses.dataclass(frozen=True)
class OutlinedCall:
    call: fx.Node
    body: fx.GraphModule


def find_outlined_calls(gm: fx.GraphModule) -> list[OutlinedCall]:
    return [
        OutlinedCall(n, fetch_attr(gm, n.args[0].target))
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target is torch.ops.higher_order.invoke_subgraph
        and META_REGION in n.meta
    ]


def inline_body(gm: fx.GraphModule, oc: OutlinedCall) -> None:
    """Replace one ``invoke_subgraph`` call (and its getitems) by the body's nodes."""
    splice_subgraph_call(gm, oc.call)


def splice_subgraph_call(owner: fx.GraphModule, call: fx.Node, annotation: dict | None = None) -> None:
    """Copy the nodes of the subgraph ``call`` invokes in place of ``call`` and its getitems.

    ``owner`` is the module whose graph holds ``call``.  The copies keep the
    body's metadata; with ``annotation``, their ``meta["custom"]`` is replaced by
    it (nodes of a shared subgraph carry the first call's annotation).
    """
    graph = call.graph
    attr = subgraph_attr(call)
    body: fx.GraphModule = fetch_attr(owner, attr.target)
    operands: list[Any] = list(call.args[2:])
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise AssertionError(f"{call.name}: {len(operands)} operands for {len(placeholders)} body inputs")
    env: dict[fx.Node, Any] = dict(zip(placeholders, operands))
    outputs: Any = None
    with graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = n.args[0]
                continue
            if n.op == "get_attr":
                # a constant the body closed over: hang it on the owner under a fresh name
                name = f"{attr.target}_{n.target}".replace(".", "_")
                if not hasattr(owner, name):
                    setattr(owner, name, fetch_attr(body, n.target))
                copy = graph.get_attr(name)
                copy.meta = dict(n.meta)
            else:
                copy = graph.node_copy(n, lambda x: env[x])
            if annotation is not None:
                copy.meta[CUSTOM] = dict(annotation)
            env[n] = copy
    outs = [env[o] for o in (outputs if isinstance(outputs, (list, tuple)) else (outputs,))]
    for user in list(call.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise AssertionError(f"{call.name} used by {user.name}, not a getitem")
        index = user.args[1]
        if not isinstance(index, int):
            raise AssertionError(f"{user.name} indexes invoke_subgraph {call.name} with {index!r}")
        user.replace_all_uses_with(outs[index])
        graph.erase_node(user)
    graph.erase_node(call)
    if not attr.users:
        graph.erase_node(attr)


def inline_bodies(gm: fx.GraphModule) -> PassResult:
    """Inline every outlined region body of ``gm``."""
    calls = find_outlined_calls(gm)
    if not calls:
        return PassResult(gm)
    for oc in calls:
        inline_body(gm, oc)
    gm.delete_all_unused_submodules()
    return PassResult.of(gm, [gm])
