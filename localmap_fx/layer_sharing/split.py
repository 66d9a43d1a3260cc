"""Cut a graph into pieces along a :class:`~.plan.LayerPlan`.

:func:`split_layers` is a pass (``GraphModule -> PassResult``) that builds
a new outer graph calling one ``piece_<i>`` submodule per shared layer and
per run of unshared neighbours; each call carries a :class:`PieceMeta`.
Compiling the pieces, once per key, is :mod:`.compile`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..analysis import copy_nodes, span_io
from ..graph_utils import fetch_attr, is_input_to_local
from ..passes import PassResult
from .plan import LayerPlan, LayerSpan

__all__ = ["META_PIECE", "PieceMeta", "split_layers", "merge_unshared", "pieces_of"]

# node.meta key on the outer graph's call_module nodes (see split_layers)
META_PIECE = "localmap_fx.piece"


@dataclasses.dataclass(frozen=True)
class PieceMeta:
    """What one ``piece_<i>`` call of the outer graph computes."""

    name: str
    layer: int | None  # the layer it serves; None for a prefix / tail / merged piece
    key: tuple | None  # its layer key; None when it is compiled for this call only
    reason: str | None  # why it is not one shared layer, None when it is

def _copy_span(gm: fx.GraphModule, nodes: Sequence[fx.Node], inputs, outputs, name: str) -> fx.GraphModule:
    names = [f"in{i}_{a.name}" for i, a in enumerate(inputs)]
    graph, owner = copy_nodes(nodes, inputs, outputs, functools.partial(fetch_attr, gm), names)
    return fx.GraphModule(owner, graph, class_name=name)


_Cut = tuple[int, int, tuple[LayerSpan, ...]]


def _cuts(plan: LayerPlan, n_nodes: int) -> list[_Cut]:
    """Node ranges in program order: each layer span, and what lies between."""
    cuts: list[_Cut] = []
    at = 0
    for span in plan.spans:
        if span.start > at:
            cuts.append((at, span.start, ()))
        cuts.append((span.start, span.stop, (span,)))
        at = span.stop
    if at < n_nodes:
        cuts.append((at, n_nodes, ()))
    return cuts


def merge_unshared(cuts: Sequence[_Cut]) -> list[_Cut]:
    """Join neighbouring cuts that no other cut shares into one.

    Note: [Unshared neighbours are one piece]
        Every piece is a separate forward and backward compile, and on CPU
        each distinct kernel is a separate C++ compile; a piece compiled for
        one use buys nothing by standing alone.  So the prefix, an unshared
        first or last layer and the tail, when adjacent, go to the inner
        compiler together (where Inductor can also fuse across the old
        border), e.g. the last layer of a TP stack with the loss after it.
    """
    out: list[_Cut] = []
    for a, b, spans in cuts:
        unshared = all(s.key is None for s in spans)
        if out and unshared and all(s.key is None for s in out[-1][2]):
            a0, _, spans0 = out[-1]
            out[-1] = (a0, b, spans0 + spans)
        else:
            out.append((a, b, spans))
    return out


def _piece_reason(spans: Sequence[LayerSpan], a: int, b: int, n_nodes: int) -> str | None:
    if len(spans) == 1 and spans[0].key is not None:
        return None
    parts = [f"layer {s.index}: {s.reason}" if len(spans) > 1 else str(s.reason) for s in spans]
    if spans and (a < spans[0].start or b > spans[-1].stop):
        ends = [w for w, yes in (("prefix", a == 0 and a < spans[0].start),
                                 ("tail", b == n_nodes and b > spans[-1].stop)) if yes]
        parts.append("with the " + " and ".join(ends or ["nodes between layers"]))
    return "; ".join(parts) if parts else None


# Note: [Unwraps that leave an unshared piece stand alone]
#     A shared layer takes its weights' local tensors as inputs, and their
#     ``to_local`` lands in the piece before it, e.g. the prefix merged with
#     an unshared first layer (Note: [Unshared neighbours are one piece]).
#     Compiled by Inductor, that piece returns the weights' own local tensor
#     objects, which AOTAutograd's autograd.Function then gives a grad_fn:
#     the parameter's local tensor turns requires_grad=True and Dynamo's
#     guard on it recompiles the frame on the next step.  So those unwraps
#     go first, in a piece of their own, which runs as an Unwrap (Note: [A
#     piece that only unwraps runs as an Unwrap]).
def _lift_unwraps(piece_nodes: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """``piece_nodes`` as the pieces to emit: the unwraps of inputs read
    after the piece, alone and first, then the rest."""
    inside = set(piece_nodes)
    lifted = [n for n in piece_nodes if is_input_to_local(n) and any(u not in inside for u in n.users)]
    rest = [n for n in piece_nodes if n not in set(lifted)]
    if not lifted or not any(n.op in ("call_function", "call_method", "call_module") for n in rest):
        return [list(piece_nodes)]
    return [lifted, rest]


def split_layers(gm: fx.GraphModule, plan: LayerPlan) -> PassResult:
    """Cut ``gm`` into pieces along ``plan``: one submodule per shared layer
    span; neighbouring unshared nodes (before the first layer, after the
    last, unshared layers) form one submodule each (Note: [Unshared
    neighbours are one piece]).

    The outer graph (a new module, ``gm`` is left as it was: the result's
    ``graph_module``, with nothing to recompile) keeps ``gm``'s placeholders
    and output and calls ``piece_<i>`` submodules; each call node carries
    ``meta[META_PIECE]``, a :class:`PieceMeta`.
    Spans with equal keys are structurally identical (same input order, same
    outputs): their calls share one submodule, copied from the first, and
    one compiled callable serves them all.
    """
    nodes = list(plan.nodes)
    cuts = merge_unshared(_cuts(plan, len(nodes)))
    unshared = "the unwraps of weights that later layers read"

    outer = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = outer.node_copy(n)
    n_piece = 0
    parts: list[tuple[list[fx.Node], PieceMeta]] = []
    for a, b, piece_spans in cuts:
        piece_span = piece_spans[0] if piece_spans else None
        meta = PieceMeta("", piece_span.index if piece_span is not None else None,
                         piece_span.key if piece_span is not None else None,
                         _piece_reason(piece_spans, a, b, len(nodes)))
        if meta.key is not None:
            parts.append((nodes[a:b], meta))
            continue
        # Note: [Unwraps that leave an unshared piece stand alone]
        split = _lift_unwraps(nodes[a:b])
        if len(split) == 2:
            parts.append((split[0], PieceMeta("", None, None, unshared)))
        parts.append((split[-1], meta))
    by_key: dict[tuple, fx.GraphModule] = {}
    for piece_nodes, meta in parts:
        inputs, outputs = span_io(piece_nodes)
        if not outputs:
            # nothing leaves it: only dead code or get_attrs
            if any(n.op == "call_function" or n.op == "call_method" for n in piece_nodes):
                raise AssertionError(f"piece of nodes {piece_nodes[0]}..{piece_nodes[-1]} has effects but no outputs")
            continue
        name = f"piece_{n_piece}"
        n_piece += 1
        # equal keys give identical submodules: one copy serves them all
        sub = by_key.get(meta.key) if meta.key is not None else None
        if sub is None:
            sub = _copy_span(gm, piece_nodes, inputs, outputs, name)
            if meta.key is not None:
                by_key[meta.key] = sub
        root.add_module(name, sub)
        call = outer.call_module(name, tuple(env[i] for i in inputs))
        call.meta[META_PIECE] = dataclasses.replace(meta, name=name)
        for j, o in enumerate(outputs):
            g = outer.call_function(operator.getitem, (call, j))
            g.meta = dict(o.meta)
            env[o] = g
    for n in gm.graph.nodes:
        if n.op == "output":
            outer.node_copy(n, lambda x: env[x])
    out = fx.GraphModule(root, outer, class_name="localmap_fx_layers")
    out.graph.lint()
    return PassResult(out)


def pieces_of(outer: fx.GraphModule) -> list[fx.Node]:
    return [n for n in outer.graph.nodes if META_PIECE in n.meta]

