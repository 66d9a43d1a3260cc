"""The gradient of a layer's output that arrives whole: not divided by the
piece after the layer, not summed back by the layer's backward.

:func:`find_whole_gradients` plans (read-only, on a split frame's outer
graph), :func:`apply_whole_gradients` rewrites along the plan (a
``PassResult`` pass); :func:`unheld_whole_gradients` and
:func:`convert_unheld` are the safety net after the compile, for an output
whose layer does not run in a :class:`~.runtime.LayerRun`.

Note: [The last layer's gradient arrives whole]
    The last layer of a stack hands its output to the tail (the loss) as
    a local tensor, which the tail turns back into a Replicate DTensor with
    ``from_local(grad_placements=(Partial(),))`` (Note: [The last layer's
    border] in :mod:`.borders`): the grad placements every other layer's
    input asks for, so that the last call is one more call of the shared
    layer.  The loss's gradient ``g`` is Replicate; the tail's backward
    divided it (``Replicate -> Partial`` is ``g / n``) and the shared
    layer's compiled backward, written for the Partial gradient the next
    layer sends, summed it back over the mesh: one all_reduce per step that
    eager DTensor and upstream ``torch.compile`` do not issue (2L against
    2L - 1 in an L-layer TP stack).  Here the tail keeps the gradient
    whole (``grad_placements`` = its placements, no division) and the
    outer graph records, on the layer's output, that it arrives so
    (:class:`WholeGradient`).  The layer's backward is compiled with its
    tangent's all_reduce taken out
    (:func:`~localmap_fx.passes.hoist_tangent_reductions.hoist_tangent_reductions`)
    and the run supplies it: for the output that arrives whole, ``g``
    itself (what eager's backward reads there) and ``g / n`` for the
    tangent's other uses (the residual's, as eager's add converts it); for
    every other call, the same functional all_reduce of the Partial
    gradient the next layer sends (the same values, the same collective
    count, as the DTensor border does: Note: [The tangent's all_reduce
    belongs to the border])::

        before                                        after
        ------                                        -----
        tail bw:  g -> g / n                          tail bw:  g
        last bw:  bw(saved, g/n) = ...                last bw:  bw(saved, g/n, g)          no collective
                  wait(all_reduce(g/n)) ...           other bw: bw(saved, p, wait(all_reduce(p)))

    A layer that the compile does not run as a CompiledLayer in a run (a
    Refusal: AOTAutograd's runtime) cannot take the gradient whole: the
    outer graph then divides it itself before the layer's backward
    (:func:`convert_unheld`), which is what the tail did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx

from ..graph_utils import getitem_users, is_from_local, node_value
from ..passes import PassResult
from .split import META_PIECE, pieces_of

__all__ = [
    "META_WHOLE", "WholeGradient", "WholeGradientStep", "WholeGradientPlan", "find_whole_gradients",
    "apply_whole_gradients", "whole_gradient_of", "hoisted_keys", "unheld_whole_gradients", "convert_unheld",
    "partial_gradient",
]

# node.meta key on the outer graph's getitem of a layer output whose gradient arrives whole
META_WHOLE = "localmap_fx.whole_gradient"


@dataclasses.dataclass(frozen=True)
class WholeGradient:
    """A layer output's gradient arrives as the Replicate value over ``group_name``;
    its layer's backward was written for the Partial form (``g / group_size``)."""

    group_name: str
    group_size: int

    def text(self) -> str:
        return f"arrives whole over group {self.group_name} (the Partial form is g / {self.group_size})"

    def partial(self, grad: torch.Tensor) -> torch.Tensor:
        """``Replicate -> Partial("sum")``: DTensor's local division, the same op."""
        return grad / self.group_size


@dataclasses.dataclass(frozen=True)
class WholeGradientStep:
    """Output ``output`` (a getitem of a shared layer's call) goes to the piece
    call ``reader`` only, whose graph turns it into a DTensor with
    ``from_local`` asking for a Partial gradient: ask for the whole one."""

    output: fx.Node
    reader: fx.Node
    from_local: fx.Node  # in the reader's graph
    placements: tuple
    gradient: WholeGradient

    def text(self) -> str:
        return (f"{self.output.name} -> {self.reader.target}.{self.from_local.name}: "
                f"grad_placements {self.placements!r}, gradient {self.gradient.text()}")


@dataclasses.dataclass(frozen=True)
class WholeGradientPlan:
    steps: tuple[WholeGradientStep, ...]

    def text(self) -> str:
        return "\n".join(s.text() for s in self.steps) or "no layer output's gradient can arrive whole"


def _partial_dim(placements: tuple, grad: object) -> int | None:
    """The one mesh dim where ``grad`` (else equal to all-Replicate ``placements``) asks for Partial("sum")."""
    from torch.distributed.tensor import Partial, Replicate

    if not isinstance(grad, (tuple, list)) or len(grad) != len(placements):
        return None
    if not all(isinstance(p, Replicate) for p in placements):
        return None
    dims = [d for d, (p, g) in enumerate(zip(placements, grad)) if p != g]
    if len(dims) != 1:
        return None
    g = grad[dims[0]]
    return dims[0] if type(g) is Partial and g.reduce_op == "sum" else None


def _step(outer: fx.GraphModule, output: fx.Node) -> WholeGradientStep | None:
    from torch.distributed.device_mesh import DeviceMesh

    if len(output.users) != 1:
        return None
    reader = next(iter(output.users))
    meta = reader.meta.get(META_PIECE)
    if reader.op != "call_module" or meta is None or meta.key is not None or reader.kwargs:
        return None
    at = [i for i, a in enumerate(reader.args) if a is output]
    sub = outer.get_submodule(str(reader.target))
    placeholders = list(sub.graph.find_nodes(op="placeholder")) if isinstance(sub, fx.GraphModule) else []
    if len(at) != 1 or len(placeholders) != len(reader.args):
        return None
    users = list(placeholders[at[0]].users)
    if len(users) != 1 or not is_from_local(users[0]):
        return None
    fl = users[0]
    if len(fl.args) < 3 or fl.args[0] is not placeholders[at[0]] or not isinstance(fl.args[1], fx.Node):
        return None
    placements = tuple(fl.args[2]) if isinstance(fl.args[2], (tuple, list)) else ()
    dim = _partial_dim(placements, fl.kwargs.get("grad_placements"))
    mesh_at = placeholders.index(fl.args[1]) if fl.args[1] in placeholders else None
    mesh = node_value(reader.args[mesh_at]) if mesh_at is not None else None
    if dim is None or not isinstance(mesh, DeviceMesh):
        return None
    group = mesh.get_group(dim)
    return WholeGradientStep(output, reader, fl, placements, WholeGradient(group.group_name, group.size()))


def find_whole_gradients(outer: fx.GraphModule) -> WholeGradientPlan:
    """The outputs of shared layer calls whose gradient can arrive whole
    (Note: [The last layer's gradient arrives whole]).

    An output qualifies when one piece call compiled for itself alone (the
    tail) reads it, once, and that piece's graph uses it only as
    ``from_local(x, mesh, <all Replicate>, grad_placements=<Partial("sum") on
    one mesh dim, else the same>)``.
    """
    steps: list[WholeGradientStep] = []
    for call in pieces_of(outer):
        if call.meta[META_PIECE].key is None:
            continue
        for _, output in sorted(getitem_users(call).items()):
            step = _step(outer, output)
            if step is not None:
                steps.append(step)
    return WholeGradientPlan(tuple(steps))


def apply_whole_gradients(outer: fx.GraphModule, plan: WholeGradientPlan) -> PassResult:
    """The reader's ``from_local`` asks for the gradient whole; the output records it.

    before::

        (h,) = piece_3(x, w)                                   # the last layer (key K)
        loss = piece_4(h, mesh)
        piece_4: dt = from_local(in0, in1, (Replicate(),), grad_placements=(Partial(),))

    after::

        (h,) = piece_3(x, w)                                   # h.meta[META_WHOLE] = WholeGradient("0", 2)
        loss = piece_4(h, mesh)
        piece_4: dt = from_local(in0, in1, (Replicate(),), grad_placements=(Replicate(),))

    The layer's run must then take ``h``'s gradient whole (or
    :func:`convert_unheld` divides it): the two are one rewrite.
    """
    changed: list[fx.GraphModule] = []
    for step in plan.steps:
        step.from_local.update_kwarg("grad_placements", step.placements)
        step.output.meta[META_WHOLE] = step.gradient
        sub = outer.get_submodule(str(step.reader.target))
        if isinstance(sub, fx.GraphModule):
            changed.append(sub)
    return PassResult.of(outer, changed)


def whole_gradient_of(output: fx.Node) -> WholeGradient | None:
    """What :func:`apply_whole_gradients` recorded on a layer call's getitem."""
    found = output.meta.get(META_WHOLE)
    return found if isinstance(found, WholeGradient) else None


def hoisted_keys(outer: fx.GraphModule) -> set[tuple]:
    """The layer keys whose backward is compiled with its tangent reductions taken out:
    those with a call whose output's gradient arrives whole."""
    return {call.meta[META_PIECE].key for call in pieces_of(outer)
            if call.meta[META_PIECE].key is not None
            and any(whole_gradient_of(o) is not None for o in getitem_users(call).values())}


def unheld_whole_gradients(outer: fx.GraphModule, held: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """The outputs marked whole whose layer call ``held`` says cannot take them so."""
    return [o for call in pieces_of(outer) if not held(call)
            for o in getitem_users(call).values() if whole_gradient_of(o) is not None]


class _PartialGradient(torch.autograd.Function):
    """The identity forward; backward, the Replicate gradient's Partial form (DTensor's division)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_size: int) -> torch.Tensor:
        ctx.group_size = group_size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return grad / ctx.group_size, None


def partial_gradient(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x``, whose gradient is divided into the Partial form (over ``group_size`` ranks) its layer's backward reads."""
    return _PartialGradient.apply(x, group_size)


def convert_unheld(outer: fx.GraphModule, outputs: list[fx.Node]) -> PassResult:
    """Each output in ``outputs`` reaches its reader through :func:`partial_gradient`.

    before::   (h,) = piece_3(x, w)     # h.meta[META_WHOLE]; piece_3 runs as AOTAutograd compiled it
               loss = piece_4(h, mesh)
    after::    (h,) = piece_3(x, w)
               h_partial = partial_gradient(h, 2)
               loss = piece_4(h_partial, mesh)
    """
    for output in outputs:
        gradient = output.meta.pop(META_WHOLE)
        users = list(output.users)
        with outer.graph.inserting_after(output):
            converted = outer.graph.call_function(partial_gradient, (output, gradient.group_size))
        converted.meta = {k: v for k, v in output.meta.items() if k in ("example_value", "val", "tensor_meta")}
        for u in users:
            u.replace_input_with(output, converted)
    return PassResult.of(outer, [outer] if outputs else [])
