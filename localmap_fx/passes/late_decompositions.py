"""Activation gradients decomposed after AOTAutograd, only where they fuse.

Used by the lone-op pass (:mod:`localmap_fx.passes.lone_ops`): inside
``compiling_lone_ops_as_aten`` AOTAutograd gets Inductor's decomposition
table without :func:`held_back_ops` (:func:`aot_table`), and the pass
decomposes the held-back ops that are not lone (:func:`decompose`).

Note: [A pointwise op decomposes only where it fuses]
    Inductor has no lowering of its own for many pointwise ops
    (``threshold_backward``, ``gelu_backward``, ``silu_backward``,
    ``tanh_backward``...): it hands AOTAutograd a table that decomposes them
    into core ops while the graph is traced, and the group it gets fuses into
    a kernel of its own even with nothing around it.  A TP block's backward
    ``threshold_backward`` (relu's gradient, between two matrix products)
    kept a C++ file that way, compiled at every cold start.  Whether an op is
    lone is known only on the graph Inductor lowers (Note: [A lone op runs as
    its ATen op]), after AOTAutograd has decomposed it.  So those ops are held
    back from AOTAutograd, and the lone-op pass decomposes each held-back op
    that is not lone, with the same table, before marking the graph: a lone
    one runs as its ATen op (eager's values), the others reach lowering as the
    core ops they always did::

        AOT graph (table without held-back ops)   after the lone-op pass
        ---------------------------------------   ----------------------
        mm_1 = mm(tangent, w2_t)                   mm_1 = mm(tangent, w2_t)
        tb = threshold_backward(mm_1, relu, 0)     tb = threshold_backward(...)  # lone: ATen
        mm_2 = mm(tb, w1_t)                        mm_2 = mm(tb, w1_t)

        g = gelu_backward(tangent, h)             mul, erf, add, ... = the table's
        s = add(g, other)   # fuses with g        decomposition of gelu_backward; add

    Held back: the gradients of pointwise activations
    (:data:`ACTIVATION_GRADIENTS`) that the table decomposes and Inductor does
    not lower, nothing else: Inductor's own passes match the decomposed forms
    of other ops (its no-op pass every ``round``, its CPU conv + ``gelu``
    fusion, its fused attention dropout's backward).  A lone one stays whole
    only next to a matrix product, attention or collective, and not marked by
    the user for Inductor (``lone_ops.keeps_whole``): alone in a subgraph
    (a flex-attention ``score_mod``) Inductor has no fallback kernel for it.
    One whose decomposition cannot be traced on its example values (a
    symbolic scalar input, a constant tensor) stays as it is and runs as its
    ATen op, fused with nothing (logged).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Hashable, Iterable
from typing import Any, cast

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch_compat import (
    OpOverload,
    detect_fake_mode,
    enable_python_dispatcher,
    inductor_lowerings,
    select_decomp_table,
)
from ..debug.logs import LOG_NAME
from ..graph_utils import carried_meta

__all__ = ["ACTIVATION_GRADIENTS", "aot_table", "decompose", "held_back_ops"]

log = logging.getLogger(f"{LOG_NAME}.lone_ops")


# The gradients of pointwise activations: between the two matrix products of an MLP
# (a TP block's column and row projections) they are lone in the backward.  By name,
# default overloads; only those Inductor decomposes and cannot lower are held back.
# Forward activations stay out: Inductor's pattern passes match their decomposed
# forms (CPU conv + gelu fusion), as they match dropout's backward (fused attention).
ACTIVATION_GRADIENTS = (
    "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "hardsigmoid_backward", "hardswish_backward", "mish_backward",
)


@functools.cache
def _held_back(table_ops: frozenset[OpOverload]) -> frozenset[OpOverload]:
    ops = (getattr(torch.ops.aten, name).default for name in ACTIVATION_GRADIENTS
           if hasattr(torch.ops.aten, name))
    return frozenset(op for op in ops if op in table_ops and not op._schema.is_mutable
                     and torch.Tag.nondeterministic_seeded not in op.tags and op not in inductor_lowerings)


def held_back_ops() -> frozenset[OpOverload]:
    """The ops of Inductor's decomposition table AOTAutograd leaves whole (Note: [A pointwise op
    decomposes only where it fuses]): the activation gradients (:data:`ACTIVATION_GRADIENTS`)
    Inductor decomposes and does not lower."""
    return _held_back(frozenset(select_decomp_table()))


def aot_table() -> dict[OpOverload, Callable[..., Any]]:
    """Inductor's decomposition table without :func:`held_back_ops`: what AOTAutograd gets."""
    held = held_back_ops()
    return {op: fn for op, fn in select_decomp_table().items() if op not in held}


def _traced(n: fx.Node) -> fx.GraphModule | None:
    """``n``'s op traced through Inductor's table on ``n``'s example values; its
    placeholders are ``n``'s tensor arguments, in ``n.all_input_nodes`` order."""
    inputs = n.all_input_nodes
    values = [a.meta.get("val") for a in inputs]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None  # a symbolic scalar or a value-less input: nothing to trace it on
    slot = {a: i for i, a in enumerate(inputs)}

    def call(*tensors: torch.Tensor) -> Any:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: tensors[slot[a]])
        return n.target(*args, **kwargs)  # type: ignore[operator]

    fake_mode = detect_fake_mode(values)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
        gm = make_fx(call, select_decomp_table(), tracing_mode="real")(*values)
    if any(m.op == "get_attr" for m in gm.graph.nodes) or not isinstance(gm.graph.output_node().args[0], fx.Node):
        return None  # a constant tensor, or a constant result: nothing this graph can hold
    return gm


def _signature(n: fx.Node) -> Hashable | None:
    """What ``n``'s decomposition depends on: its op, constant arguments and input layouts
    (None with a symbolic size: such a node is traced on its own)."""
    layouts = []
    for a in n.all_input_nodes:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return None
        layout = (v.dtype, v.device, tuple(v.shape), tuple(v.stride()))
        if any(isinstance(d, torch.SymInt) for d in (*layout[2], *layout[3])):
            return None
        layouts.append(layout)
    position = {a: i for i, a in enumerate(n.all_input_nodes)}
    constants = fx.node.map_arg((n.args, n.kwargs), lambda a: ("input", position[a]))
    return (n.target, tuple(layouts), repr(constants))



def decompose(graph: fx.Graph, nodes: Iterable[fx.Node]) -> tuple[fx.Node, ...]:
    """Replace each of ``nodes`` by its decomposition in Inductor's table, in place
    (Inductor's post-grad pass interface: ``Graph -> None``); returns the nodes left
    whole (an input that is no tensor with an example value, or a decomposition needing
    a constant tensor), which the caller leaves to run as ATen ops (Inductor lowers none
    of them).  Nodes alike (op, constants, input layouts) are traced once."""
    left: list[fx.Node] = []
    traced: dict[Hashable, fx.GraphModule | None] = {}
    for n in nodes:
        key = _signature(n)
        if key is None:
            gm = _traced(n)
        else:
            if key not in traced:
                traced[key] = _traced(n)
            gm = traced[key]
        if gm is None:
            left.append(n)
            continue
        placeholders = gm.graph.find_nodes(op="placeholder")
        env: dict[fx.Node, Any] = dict(zip(placeholders, n.all_input_nodes))
        with graph.inserting_before(n):
            out = cast(fx.Node, graph.graph_copy(gm.graph, env))  # _traced returns a node's graph only
        # Inductor names a kernel after the ops it was decomposed from, as AOTAutograd marks them
        carried = carried_meta(n)
        original = n.meta.get("original_aten", n.target)
        for m in gm.graph.nodes:
            if m.op == "call_function":  # graph_copy mapped each copied node in env
                env[m].meta.update(carried, original_aten=original)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
    if left:
        log.info("left whole, run as ATen ops (an input with no tensor example value, or a decomposition "
                 "needing a constant): %s", ", ".join(sorted({str(n.target) for n in left})))
    return tuple(left)
