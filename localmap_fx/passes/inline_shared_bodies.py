"""Inline the bodies Dynamo traced once and shared (``outline=False``).

Capture calls a repeated region body through one shared ``invoke_subgraph``
(:mod:`localmap_fx.capture.reuse`).  With ``outline=False`` the backend promises
bodies inline -- needed, for example, under ``LocalTensorMode``, for which
torch 2.14.1 has no ``invoke_subgraph`` rule -- so this pass copies each such
body back into the graph at its call::

    before                                           after
    ------                                           -----
    sub = self.subgraph_0          # role body       mm = l0 @ l1           # role body,
    call = invoke_subgraph(sub, "subgraph_0", l0, l1) out = relu(mm)         # this call's spec
    out = call[0]                  # role body
    y = from_local(out, ...)                         y = from_local(out, ...)

The copied nodes get the annotation of *this* call (nodes inside a shared
subgraph carry the first call's).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx

from ..graph_utils import CUSTOM, fetch_attr, subgraph_attr
from ..region import find_regions, shared_body_call
from . import PassResult

__all__ = [
    "SharedCall",
    "find_shared_calls",
    "inline_shared_call",
    "inline_shared_bodies",
    "inline_nested_shared_bodies",
]


@dataclasses.dataclass(frozen=True)
class SharedCall:
    owner: fx.GraphModule
    call: fx.Node


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

def find_shared_calls(gm: fx.GraphModule, nested_only: bool = False) -> list[SharedCall]:
    """Region bodies that are one Dynamo-made ``invoke_subgraph`` (any nesting
    level; only inside nested subgraphs with ``nested_only``)."""
    out = []
    for region in find_regions(gm, bodies=False):
        call = shared_body_call(region)
        if call is not None and (region.scope or not nested_only):
            out.append(SharedCall(region.owner or gm, call))
    return out


def inline_shared_call(sc: SharedCall) -> None:
    """Copy the called subgraph's nodes in place of ``sc.call``, with this call's annotation."""
    splice_subgraph_call(sc.owner, sc.call, annotation=dict(sc.call.meta.get(CUSTOM) or {}))


def inline_shared_bodies(gm: fx.GraphModule) -> PassResult:
    """Inline every shared region body (see module docstring)."""
    return _inline(gm, nested_only=False)


def inline_nested_shared_bodies(gm: fx.GraphModule) -> PassResult:
    """Inline the shared bodies of regions inside nested subgraphs only.

    ``outline_regions`` runs it first, as it keeps those regions inline: an
    ``invoke_subgraph`` inside a checkpoint body gave wrong gradients with
    inductor (torch 2.14.1, 2 gloo ranks; aot_eager was right), see
    tests/distributed/test_reuse_gloo.py.
    """
    return _inline(gm, nested_only=True)


def _inline(gm: fx.GraphModule, nested_only: bool) -> PassResult:
    calls = find_shared_calls(gm, nested_only)
    for sc in calls:
        inline_shared_call(sc)
    return PassResult.of(gm, (sc.owner for sc in calls))


