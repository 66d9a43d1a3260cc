"""A matrix product whose only use is an ``add`` accumulates into the addend: ``addmm``, through reshapes.

Runs inside Inductor as part of the lone-op pass (``lone_ops.py``), before it
looks for lone ops, on CPU graphs.

Note: [A sum of matrix products accumulates in the library call]
    A backward sums the gradients an input gets from each of its users:
    the attention block's input feeds the q, k and v projections and the
    residual, so its gradient is ``r + mm_q + mm_k + mm_v``.  Inductor's
    post-grad passes turn ``add(mm(a, b), c)`` into ``addmm(c, a, b)`` (the
    library computes ``c + a @ b`` with its ``beta``; on CPU always, on GPU
    unless every user of the sum is pointwise), but a 3-D activation's
    product is read through a ``reshape``, which their pattern does not look
    through: the adds then fuse into a kernel of their own, a C++ file at
    cold start (0.5-1 CPU-s here) for work the products can do themselves.
    This pass makes the same rewrite through the reshapes, so the chain
    becomes a chain of ``addmm`` and what is left over (the residual's
    ``r / 2``) is lone and runs as its ATen op (Note: [A lone op runs as its
    ATen op])::

        before                                     after
        ------                                     -----
        r = div(tangent, 2)                        r = div(tangent, 2)      # lone: ATen
        q = mm(dq, wq)                             q = addmm(reshape(r, [32, 32]), dq, wq)
        s = add(r, reshape(q, [2, 16, 32]))        k = addmm(q, dk, wk)
        k = mm(dk, wk)                             v = addmm(k, dv, wv)
        s = add(s, reshape(k, [2, 16, 32]))        out = reshape(v, [2, 16, 32])
        v = mm(dv, wv)
        out = add(s, reshape(v, [2, 16, 32]))

    Memory traffic is the same (each ``addmm`` reads its addend and writes
    the sum; before, each product was written and read back by the fused
    kernel), and the sum's order is the graph's.  Only where nothing but
    the call changes: ``aten.add.Tensor`` without ``alpha``, no
    broadcasting or type promotion, the product read by the ``add`` alone
    (through reshapes, views of a contiguous product), the addend and the
    sum contiguous, static shapes, float32 or float64 (a bf16 chain would
    round each link's sum, the fused kernel rounds once), on CPU (Inductor's GPU rule keeps the add for a
    pointwise epilogue, and nothing here is measured on GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx as fx

from .._torch_compat import detect_fake_mode
from ..graph_utils import carried_meta, is_symbolic, node_value

__all__ = ["Accumulation", "accumulate_into_addmm", "find_accumulations"]

aten = torch.ops.aten
# the views a product is read through: Inductor's post-grad graphs say reshape
# (its view_to_reshape pass); of a contiguous product each is a view
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# dtypes whose partial sums the chain keeps at full precision, as the fused kernel did
# (a bf16 or fp16 chain rounds each link's sum, the kernel once, in fp32)
_EXACT = (torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """``add`` (an ``aten.add.Tensor`` node) sums the product ``mm`` (read as its
    argument ``side``, through ``views``) and its other argument."""

    add: fx.Node
    mm: fx.Node
    side: int
    views: tuple[fx.Node, ...]

    def __str__(self) -> str:
        return f"{self.add.name} = {self.add.args[1 - self.side]} + {self.mm.name} -> addmm"


def _product(arg: object) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """The ``mm`` node ``arg`` is, seen through views each read once, and those views."""
    views: list[fx.Node] = []
    while isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target in _VIEWS:
        if len(arg.users) != 1:
            return None
        views.append(arg)
        arg = arg.args[0]
    if not (isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is aten.mm.default):
        return None
    if len(arg.users) != 1:
        return None
    return arg, tuple(views)


def _plain(value: object, like: torch.Tensor) -> bool:
    # symbolic sizes are left alone: comparing them here would guard after Dynamo's guards
    return (isinstance(value, torch.Tensor) and not is_symbolic(value) and not is_symbolic(like)
            and value.shape == like.shape and value.dtype == like.dtype
            and value.device == like.device and value.device.type == "cpu" and value.is_contiguous())


def find_accumulations(graph: fx.Graph) -> tuple[Accumulation, ...]:
    """The ``add`` nodes of ``graph`` whose matrix product can accumulate into the
    other addend (Note: [A sum of matrix products accumulates in the library call])."""
    found: list[Accumulation] = []
    taken: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not aten.add.Tensor or n.kwargs or len(n.args) != 2:
            continue
        out = node_value(n)
        if not isinstance(out, torch.Tensor) or not _plain(out, out) or out.dtype not in _EXACT:
            continue
        for side in (1, 0):
            product = _product(n.args[side])
            other = n.args[1 - side]
            if (product is None or product[0] in taken or not isinstance(other, fx.Node)
                    or other is product[0] or other in product[1]):
                continue
            mm_value = node_value(product[0])
            if (not _plain(node_value(other), out) or not _plain(mm_value, mm_value)
                    or mm_value.numel() != out.numel()  # the add broadcasts the product
                    or not _plain(mm_value.view(out.shape), out)):
                continue
            taken.add(product[0])
            found.append(Accumulation(n, product[0], side, product[1]))
            break
    return tuple(found)


def _call(graph: fx.Graph, op, args: tuple, like: fx.Node) -> fx.Node:
    """A new node ``op(*args)`` with its fake value and ``like``'s provenance."""
    node = graph.call_function(op, args)
    node.meta["val"] = op(*(node_value(a) if isinstance(a, fx.Node) else a for a in args))
    node.meta.update(carried_meta(like))
    return node


def accumulate_into_addmm(graph: fx.Graph, accumulations: tuple[Accumulation, ...]) -> None:
    """Replace each of ``accumulations`` by ``reshape(addmm(reshape(other), a, b))`` (in place:
    Inductor's interface for a post-grad pass); a reshape of the previous link's sum back to
    the product's shape is not made: the sum is read as it is."""
    for acc in accumulations:
        add, mm = acc.add, acc.mm
        other = add.args[1 - acc.side]  # read now: an earlier rewrite may have replaced it
        if not isinstance(other, fx.Node):
            raise TypeError(f"accumulate_into_addmm: {add.name}'s addend is not a node: {other!r}")
        shape = list(node_value(mm).shape)
        out_shape = list(node_value(add).shape)
        fake_mode = detect_fake_mode((node_value(other), *(node_value(a) for a in mm.args[:2])))
        with graph.inserting_before(add), fake_mode if fake_mode is not None else contextlib.nullcontext():
            addend = other
            source = other.args[0] if other.op == "call_function" and other.target in _VIEWS else None
            if isinstance(source, fx.Node) and _plain(node_value(source), node_value(mm)):
                addend = source
            elif list(node_value(other).shape) != shape:
                addend = _call(graph, aten.reshape.default, (other, shape), add)
            result = _call(graph, aten.addmm.default, (addend, *mm.args[:2]), add)
            if out_shape != shape:
                result = _call(graph, aten.reshape.default, (result, out_shape), add)
        add.replace_all_uses_with(result)
        graph.erase_node(add)
        for view in acc.views:
            graph.erase_node(view)
        graph.erase_node(mm)
        if addend is not other and not other.users:
            graph.erase_node(other)
