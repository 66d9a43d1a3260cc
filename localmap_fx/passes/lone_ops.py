"""Ops with nothing to fuse with run as their ATen op inside an Inductor graph.

Runs on the AOTAutograd forward and backward graphs, just before Inductor
(``compiler/inner.py``), after ``hoist_subgraph_views``.

Note: [A lone op runs as its ATen op]
    Inductor turns every op it lowers into generated code, and on CPU each
    generated kernel is a C++ file compiled at cold start (0.5-0.8 CPU-s
    per file here, with fresh caches; a Triton kernel on GPU costs more).
    Code generation pays off when it fuses ops: one loop instead of
    several passes over memory.  An op whose neighbours are all matrix
    products, attention, collectives or graph inputs and outputs (a TP
    block's ``relu`` between two ``mm``, its residual ``add``, the
    ``threshold_backward`` of its backward) fuses with nothing: its kernel
    does what the ATen op does, and the C++ file is all it adds.  Such an
    op is *lone* (:func:`find_lone_ops`): a non-view ATen op with a tensor
    result that reads no value another fusible op produced and feeds no
    fusible op, looking through views (free in Inductor) and ``getitem``.
    Every other node is marked to be compiled (:func:`mark_for_inductor`)
    and the graph is compiled under Inductor's ``fallback_by_default`` (the
    switch of its "lite" mode: an unmarked op runs as its ATen op through
    Inductor's own fallback kernel), so only the lone ops change.

    Kept in Inductor whatever their neighbours: ops that write an argument
    (``copy_`` into a mutated input), random ops (Inductor's random
    numbers are not ATen's) and ops outside ``aten``.  An op this module
    does not know as a matrix product, attention or collective counts as
    fusible, so its neighbours stay in Inductor as before.  The lone op's
    result is ATen's, as eager computes it.

    The 64-layer TP stack (``python -m benchmarks.marked_bench --only cold``)
    has only lone ops: its marked compile went from 2.7-3.3 s to 1.5-1.8 s
    wall, and its step did not change (fake group and real layer sizes,
    ``docs/benchmarks.md``)::

        before (Inductor)                          after
        -----------------                          -----
        buf0 = mm(x, w1)                           buf0 = mm(x, w1)
        cpp_fused_relu_0(buf0)      # a C++ file   buf1 = aten.relu(buf0)
        buf2 = mm(buf0, w2)                        buf2 = mm(buf1, w2)
        all_reduce_(buf2)                          all_reduce_(buf2)
        cpp_fused_add_1(buf2, x, buf3)  # another  buf3 = aten.add(buf2, x)
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from .._torch_compat import OpOverload, is_view_op
from ..debug.logs import LOG_NAME
from ..graph_utils import funcol_op, node_value
from . import PassResult

__all__ = ["MARK", "find_lone_ops", "mark_for_inductor", "lone_ops_to_aten", "log_lone_ops"]

log = logging.getLogger(f"{LOG_NAME}.lone_ops")

# the key Inductor's fallback_by_default looks for in node.meta["custom"]
# (torch.fx.passes.regional_inductor._needs_inductor_compile)
MARK = "compile_with_inductor"

# Ops Inductor runs as library calls whatever it fuses around them; by name
# within their namespace (overloads alike).
_EXTERN_ATEN = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
})
# and the collectives (graph_utils.funcol_op), and c10d's own ops
_EXTERN_NAMESPACES = frozenset({"c10d"})
# a view in Inductor's eyes whose schema does not say so
_VIEWS = frozenset({"_unsafe_view"})


def _name(target: OpOverload) -> tuple[str, str]:
    return target.namespace, target._schema.name.split("::")[-1]


def _is_view(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    return isinstance(n.target, OpOverload) and (is_view_op(n.target) or _name(n.target)[1] in _VIEWS)


def _fuses(n: fx.Node) -> bool:
    """Could Inductor fuse ``n`` with a neighbour (it is code Inductor generates, not a library call)?"""
    if n.op != "call_function" or _is_view(n):
        return False
    if isinstance(n.target, OpOverload):
        namespace, name = _name(n.target)
        return (funcol_op(n.target) is None and namespace not in _EXTERN_NAMESPACES
                and not (namespace == "aten" and name in _EXTERN_ATEN))
    return True  # a higher-order op or anything else: assume it fuses


def _sources(n: fx.Node) -> Iterator[fx.Node]:
    """The nodes ``n`` reads, each seen through the views it was read through."""
    for a in n.all_input_nodes:
        while _is_view(a) and a.args and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        yield a


def _readers(n: fx.Node) -> Iterator[fx.Node]:
    """The nodes reading ``n``, directly or through views of it."""
    for u in n.users:
        if _is_view(u):
            yield from _readers(u)
        else:
            yield u


def _candidate(n: fx.Node) -> bool:
    target = n.target
    if n.op != "call_function" or not isinstance(target, OpOverload) or not _fuses(n):
        return False
    return (target.namespace == "aten" and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags
            and isinstance(node_value(n), torch.Tensor))


def find_lone_ops(graph: fx.Graph) -> tuple[fx.Node, ...]:
    """The ops of ``graph`` with nothing to fuse with (Note: [A lone op runs as its ATen op])."""
    return tuple(n for n in graph.nodes
                 if _candidate(n) and not any(_fuses(s) for s in _sources(n))
                 and not any(_fuses(r) for r in _readers(n)))


def _graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    # nested subgraphs (an invoke_subgraph body) are lowered under the same switch
    for m in gm.modules():
        if isinstance(m, fx.GraphModule):
            yield m


def mark_for_inductor(gm: fx.GraphModule, lone: frozenset[fx.Node]) -> PassResult:
    """Mark every op of ``gm`` and its subgraphs but ``lone`` to be compiled by Inductor.

    Only ``node.meta`` changes (the code stays): the result lists no changed module."""
    for m in _graph_modules(gm):
        for n in m.graph.nodes:
            if n.op == "call_function" and n not in lone:
                n.meta["custom"] = {**n.meta.get("custom", {}), MARK: "localmap_fx"}
    return PassResult(gm)


def lone_ops_to_aten(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[fx.Node, ...]]:
    """(``gm`` marked, its lone ops): compile ``gm`` under ``fallback_by_default`` when any op is lone.

    With no lone op, ``gm`` is returned unmarked: it compiles exactly as before."""
    lone = tuple(n for m in _graph_modules(gm) for n in find_lone_ops(m.graph))
    if lone:
        mark_for_inductor(gm, frozenset(lone))
    return gm, lone


def log_lone_ops(kind: str, lone: tuple[fx.Node, ...]) -> None:
    """Log (``TORCH_LOGS=localmap_fx``) which ops of a compiled AOT graph ran as ATen ops."""
    if lone and log.isEnabledFor(logging.INFO):
        log.info("%s graph: %d lone op(s) run as ATen ops, no kernel generated: %s", kind, len(lone),
                 ", ".join(sorted({str(n.target) for n in lone})))
