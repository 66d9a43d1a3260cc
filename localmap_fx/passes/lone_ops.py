"""Ops with nothing to fuse with run as their ATen op inside an Inductor graph.

Runs inside Inductor, on each graph it is about to lower: the last of its
post-grad passes (``config.post_grad_custom_post_pass``), set for the
compiles of ``compiler/inner.py`` by :func:`compiling_lone_ops_as_aten`.

Note: [A lone op runs as its ATen op]
    Inductor turns every op it lowers into generated code, and on CPU each
    generated kernel is a C++ file compiled at cold start (0.5-0.8 CPU-s
    per file here, with fresh caches; a Triton kernel on GPU costs more).
    Code generation pays off when it fuses ops: one loop instead of
    several passes over memory.  An op whose neighbours are all matrix
    products, attention, collectives or graph inputs and outputs (a TP
    block's ``relu`` between two ``mm``, its residual ``add``) fuses with
    nothing: its kernel does what the ATen op does, and the C++ file is all
    it adds.  Such an op is *lone* (:func:`find_lone_ops`): a non-view ATen
    op with a tensor result that reads no value another fusible op produced
    and feeds no fusible op, looking through views (free in Inductor) and
    ``getitem``.  Every other node is marked to be compiled
    (:func:`mark_for_inductor`) and the graph is lowered under Inductor's
    ``fallback_by_default`` (the switch of its "lite" mode: an unmarked op
    runs as its ATen op through Inductor's own fallback kernel), so only the
    lone ops change, and their results are eager's.

    The marks are made after Inductor's own post-grad passes, on the graph
    it lowers: a pattern those passes rewrite (``mm`` + ``add`` into
    ``addmm``) gives new nodes, which a mark made earlier would miss and
    which would then run as ATen ops.  The pass carries a cache uuid (the
    hash of this file), so Inductor's FX graph cache keeps working.  With
    ``use_post_grad_passes`` off no pass runs, and nothing is switched.

    Kept in Inductor whatever their neighbours: ops that write an argument
    (``copy_`` into a mutated input), random ops (Inductor's random
    numbers are not ATen's) and ops outside ``aten``.  An op this module
    does not know as a matrix product, attention or collective counts as
    fusible, so its neighbours stay in Inductor as before.  An op Inductor
    would get decomposed into a group that fuses on its own (the backward's
    ``threshold_backward`` as ``le`` + ``where``) is held back from
    AOTAutograd and decomposed here only where it fuses (Note: [A pointwise
    op decomposes only where it fuses], ``late_decompositions.py``).

    Note: [Repeated layers in one graph keep their kernels]
        An ATen call costs a few microseconds more than a generated kernel's
        call (``OpOverload.__call__``, a new output, Inductor's metadata
        assert), on every call; a kernel costs its C++ file once, and one
        file serves every call of the same code.  A graph compiled once and
        called per block (a regional block, a shared or marked layer piece)
        saves its files for a few calls per block.  One graph of N repeated
        layers (``share_layers="auto"`` keeping a frame whole: the default
        at small layer sizes) saves the files of one layer and pays N layers'
        calls per step, and its step is the one that must keep up with
        upstream whole-model compilation: the attention stack's whole-model
        step measured 1.05-1.06 of upstream's with lone ops as ATen ops, 1.00
        without (session 26, fake group, 16 layers).  So the pipeline
        compiles such a graph with ``lone_ops_as_aten`` off
        (``compiler/pipeline.py``, stage ``inner``).

    The 64-layer TP stack's layer piece had three kernels and keeps none
    (session 24 took the forward's two, session 25 the backward's
    ``threshold_backward``): ``docs/benchmarks.md`` gives the cold compiles
    and steps before and after::

        before (Inductor)                          after
        -----------------                          -----
        buf0 = mm(x, w1)                           buf0 = mm(x, w1)
        cpp_fused_relu_0(buf0)      # a C++ file   buf1 = aten.relu(buf0)
        buf2 = mm(buf0, w2)                        buf2 = mm(buf1, w2)
        all_reduce_(buf2)                          all_reduce_(buf2)
        cpp_fused_add_1(buf2, x, buf3)  # another  buf3 = aten.add(buf2, x)
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import CustomGraphPass, OpOverload, get_hash_for_files, inductor_config, is_view_op
from ..debug.logs import LOG_NAME
from ..graph_utils import funcol_op, node_value
from . import attention_layouts, late_decompositions, matmul_accumulation

__all__ = ["MARK", "LoneOpsToAten", "aot_decompositions", "compiling_lone_ops_as_aten", "find_lone_ops",
           "keeps_whole", "made_by_inductor", "mark_for_inductor"]

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


def _through_views(a: fx.Node) -> fx.Node:
    """What ``a`` is a view of (itself if it is none): the node that made its values."""
    while _is_view(a) and a.args and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a


def made_by_inductor(a: fx.Node) -> bool:
    """Are ``a``'s values, seen through views, made by code Inductor generates (not a graph
    input, not a library call's result)?"""
    return _fuses(_through_views(a))


def _sources(n: fx.Node) -> Iterator[fx.Node]:
    """The nodes ``n`` reads, each seen through the views it was read through."""
    for a in n.all_input_nodes:
        yield _through_views(a)


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


def _extern(n: fx.Node) -> bool:
    """A matrix product, attention or collective: a library call Inductor fuses nothing into."""
    return n.op == "call_function" and not _is_view(n) and not _fuses(n)


def keeps_whole(lone: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    """The held-back ops among ``lone`` (Note: [A pointwise op decomposes only where it
    fuses]) that stay whole and run as ATen ops: lone, next to a matrix product,
    attention or collective (an op whose only neighbours are a subgraph's inputs and
    outputs, as in a flex-attention ``score_mod``, has no fallback there), and not
    marked by the user for Inductor, which has no lowering for them."""
    held = late_decompositions.held_back_ops()
    return tuple(n for n in lone
                 if n.target in held and MARK not in n.meta.get("custom", {})
                 and (any(_extern(s) for s in _sources(n)) or any(_extern(r) for r in _readers(n))))


def mark_for_inductor(graph: fx.Graph, lone: frozenset[fx.Node]) -> None:
    """Mark every op of ``graph`` but ``lone`` to be compiled by Inductor (``node.meta`` only).

    Inductor's interface for a post-grad pass (``Graph -> None``, edited in
    place); a nested subgraph is its own graph, handed to the pass apart."""
    for n in graph.nodes:
        if n.op == "call_function" and n not in lone:
            n.meta["custom"] = {**n.meta.get("custom", {}), MARK: "localmap_fx"}


class LoneOpsToAten(CustomGraphPass):
    """Inductor's last post-grad pass: mark all but the lone ops (Note: [A lone op runs as its ATen op])."""

    def __call__(self, graph: fx.Graph) -> None:
        # Note: [A sum of matrix products accumulates in the library call] (matmul_accumulation.py)
        accumulations = matmul_accumulation.find_accumulations(graph)
        matmul_accumulation.accumulate_into_addmm(graph, accumulations)
        if accumulations and log.isEnabledFor(logging.INFO):
            log.info("graph of %d nodes: %d matrix product(s) accumulate into their addend (addmm)",
                     len(graph.nodes), len(accumulations))
        # Note: [Attention's layout copy runs as its ATen op] (attention_layouts.py)
        copies = attention_layouts.find_layout_copies(graph, made_by_inductor)
        attention_layouts.copy_by_aten(graph, copies)
        lone = find_lone_ops(graph)
        # Note: [A pointwise op decomposes only where it fuses] (late_decompositions.py)
        kept = frozenset(keeps_whole(lone))
        held = late_decompositions.held_back_ops()
        late = [n for n in graph.nodes if n.target in held and n not in kept]
        whole = late_decompositions.decompose(graph, late)
        decomposed = frozenset(late) - frozenset(whole)
        lone = tuple(n for n in lone if n not in decomposed)
        # a held-back op left whole has no lowering: unmarked, it runs through Inductor's fallback kernel
        mark_for_inductor(graph, frozenset((*lone, *whole)))
        if lone and log.isEnabledFor(logging.INFO):
            log.info("graph of %d nodes: %d lone op(s) run as ATen ops, no kernel generated: %s",
                     len(graph.nodes), len(lone), ", ".join(sorted({str(n.target) for n in lone})))

    def uuid(self) -> Any:
        return get_hash_for_files((__file__, late_decompositions.__file__, matmul_accumulation.__file__,
                                   attention_layouts.__file__))


_PASS = LoneOpsToAten()


def compiling_lone_ops_as_aten(on: bool = True) -> contextlib.AbstractContextManager:
    """Scope in which Inductor runs lone ops as ATen ops: ``fallback_by_default`` on, and
    :class:`LoneOpsToAten` after the post-grad passes already set (a user's are kept);
    ``on=False`` (``lone_ops_as_aten=False``): no change.

    Entered around AOTAutograd too, so its cache key holds both (a process with
    ``lone_ops_as_aten=False`` is not served this compile); nested, it changes nothing."""
    if not on:
        return contextlib.nullcontext()
    if not inductor_config.use_post_grad_passes:
        return contextlib.nullcontext()  # no post-grad pass would mark anything
    passes = _post_passes()
    if _PASS in passes:
        return contextlib.nullcontext()  # already inside the scope (a lazily compiled backward's)
    return inductor_config.patch(fallback_by_default=True, post_grad_custom_post_pass=(*passes, _PASS))


def _post_passes() -> tuple:
    """Inductor's ``post_grad_custom_post_pass`` setting as a tuple (it takes one pass or several)."""
    current = inductor_config.post_grad_custom_post_pass
    return tuple(current) if isinstance(current, (list, tuple)) else ((current,) if current is not None else ())


def _in_scope() -> bool:
    return bool(inductor_config.fallback_by_default) and _PASS in _post_passes()


def aot_decompositions() -> dict | None:
    """The decomposition table ``compile_fx`` hands AOTAutograd: inside
    :func:`compiling_lone_ops_as_aten`, Inductor's without the ops the pass
    decomposes only where they fuse (Note: [A pointwise op decomposes only where
    it fuses]); outside it, None (Inductor's own)."""
    return late_decompositions.aot_table() if _in_scope() else None
