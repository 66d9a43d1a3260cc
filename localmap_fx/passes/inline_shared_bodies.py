"""Inline the bodies Dynamo traced once and shared (``outline=False``).

Capture calls a repeated region body through one shared ``invoke_subgraph``
(:mod:`localmap_fx.reuse`).  With ``outline=False`` the backend promises
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

import torch.fx as fx

from ..graph_utils import CUSTOM, fetch_attr
from ..region import find_regions
from .outline_regions import shared_body_call

__all__ = ["SharedCall", "find_shared_calls", "inline_shared_call", "inline_shared_bodies"]


@dataclasses.dataclass(frozen=True)
class SharedCall:
    owner: fx.GraphModule
    call: fx.Node


def find_shared_calls(gm: fx.GraphModule) -> list[SharedCall]:
    """Region bodies that are one Dynamo-made ``invoke_subgraph`` (any nesting level)."""
    out = []
    for region in find_regions(gm):
        call = shared_body_call(region)
        if call is not None:
            out.append(SharedCall(region.owner or gm, call))
    return out


def inline_shared_call(sc: SharedCall) -> None:
    """Copy the called subgraph's nodes in place of ``sc.call``."""
    owner, call = sc.owner, sc.call
    graph = call.graph
    inner: fx.GraphModule = fetch_attr(owner, call.args[0].target)
    custom = dict(call.meta.get(CUSTOM) or {})
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in inner.graph.nodes if n.op == "placeholder"]
    for ph, operand in zip(placeholders, call.args[2:]):
        env[ph] = operand
    results: tuple = ()
    with graph.inserting_before(call):
        for n in inner.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = tuple(env[a] for a in n.args[0])
                continue
            if n.op == "get_attr":
                name = f"{call.args[0].target}_{n.target}".replace(".", "_")
                setattr(owner, name, fetch_attr(inner, n.target))
                copy = graph.get_attr(name)
                copy.meta = dict(n.meta)
            else:
                copy = graph.node_copy(n, lambda a: env[a])
            copy.meta[CUSTOM] = dict(custom)
            env[n] = copy
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{user.name} uses invoke_subgraph {call.name} other than by index")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    attr = call.args[0]
    graph.erase_node(call)
    if not attr.users:
        graph.erase_node(attr)


def inline_shared_bodies(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline every shared region body (see module docstring)."""
    for sc in find_shared_calls(gm):
        inline_shared_call(sc)
    for m in gm.modules():
        if isinstance(m, fx.GraphModule):
            m.graph.lint()
            m.recompile()
    return gm


