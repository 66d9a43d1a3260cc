"""The local-level graph a DTensor border compiles.

A DTensor border (:mod:`localmap_fx.compiler.dtensor_border`, and the
cacheable one of :mod:`localmap_fx.compiler.cacheable_border`) compiles the
Dynamo graph behind a wrapper: local tensors in, local tensors out, with
DTensors built and taken apart inside, where AOTAutograd traces them.

Note: [The border's wrapper graph]
    Each DTensor placeholder of the Dynamo graph becomes a local placeholder
    and a call of ``Enter`` (an autograd.Function: forward builds the
    DTensor with the traced spec; backward returns the gradient's local
    tensor *as it is* and records its placements while AOTAutograd traces
    the joint graph, so an input's gradient keeps the placements eager gives
    it, Partial included, when its local tensor has the input's shape or
    fits the input's wide slot (Note: [A gradient wider than its input]);
    any other is redistributed to the input's placements as
    ``DTensor.from_local``'s backward does); each DTensor output gets
    ``to_local`` with the tangent placements of the variant::

        before:  def forward(x: DTensor, mesh, w: DTensor): ... return (y,)   # y DTensor
        after:   def forward(x_local, mesh, w_local):
                     x = enter_0(x_local); w = enter_2(w_local)
                     ... (the Dynamo graph, copied)
                     return (y.to_local(grad_placements=T0),)

Note: [A gradient wider than its input]
    Eager DTensor gives a Shard parameter a Partial gradient when the op that
    reads it says so: ``o @ wo`` with ``wo`` Shard(0) and a Partial gradient
    arriving gives ``wo.grad`` Partial, its local tensor the global shape
    (torchtitan's attention output projection, in a whole-model graph).
    AOTAutograd over DTensors returns that gradient as it is.  At the local
    level the gradient of ``wo``'s local tensor must have the local shape,
    so the border used to reduce-scatter it to Shard(0): one collective per
    layer more than eager and upstream ``torch.compile``, and gradients in
    other placements.  Instead each DTensor input that requires grad and is
    smaller locally than globally gets a *wide slot*: one more placeholder
    of the global shape (an expanded one-element tensor: nothing reads it),
    which ``Enter`` takes too.  A gradient whose local tensor has the
    global shape leaves through the wide slot, and the border hands it to
    the DTensor input with the placements it was traced with; every other
    gradient leaves through the local slot as before::

        before:  w2 = enter(w2_local)             w2.grad: reduce_scatter(P) -> S(0)
        after:   w2 = enter(w2_local, w2_wide)    w2.grad: P (from w2_wide's), as eager
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .specs import make_spec

__all__ = ["Calls", "Enter", "Placements", "Slot", "default_tangent", "wrapper_graph"]

Placements = tuple  # tuple[Placement, ...]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One graph input or output at the border: its traced DTensor spec, or None (plain / object)."""

    spec: Any  # DTensorSpec | None
    shape: tuple[int, ...] = ()


def default_tangent(placements: Placements) -> Placements:
    """What the first variant assumes an output's gradient is in.

    AOTAutograd's and ``to_local``'s default: the output's placements with
    Partial as Replicate (``loss.backward()`` on a Partial loss sends a
    Replicate gradient).
    """
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if p.is_partial() else p for p in placements)


class Enter(torch.autograd.Function):
    """A DTensor input of the wrapper graph: built from its local tensor with
    the traced spec; its backward records the gradient's placements
    (Note: [The border's wrapper graph])."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, wide: torch.Tensor | None, spec: Any, record: list) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        ctx.record = record
        ctx.spec = spec
        ctx.local_shape = tuple(local.shape)
        ctx.wide_shape = None if wide is None else tuple(wide.shape)
        ctx.set_materialize_grads(False)
        # a fresh tensor object sharing memory, as DTensor.from_local makes
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: Any):
        from torch.distributed.tensor import DTensor

        if grad is None:
            return None, None, None, None
        if not isinstance(grad, DTensor):
            raise AssertionError(f"the gradient of a DTensor input is a {type(grad).__name__}")
        spec = ctx.spec
        shape = tuple(grad.to_local().shape)
        # Note: [A gradient wider than its input]: a Partial gradient of a
        # Shard input leaves through the input's wide slot, as eager gives it
        wide = shape != ctx.local_shape and shape == ctx.wide_shape
        if shape != ctx.local_shape and not wide:
            # any other gradient whose local tensor has another shape than the
            # input's is redistributed, as DTensor.from_local's backward does
            grad = grad.redistribute(spec.mesh, default_tangent(spec.placements))
        # read while AOTAutograd traces the joint graph (sizes are static)
        # (the mesh is the input's: inside the trace it may be a fake object)
        ctx.record[:] = [make_spec(spec.mesh, grad.placements, grad.shape, grad.stride(), grad.dtype), wide]
        if wide:
            return None, grad.to_local(), None, None
        return grad.to_local(), None, None, None


def _enter_fn(spec: Any, record: list) -> Callable:
    def enter(local: torch.Tensor, wide: torch.Tensor | None = None):
        return Enter.apply(local, wide, spec, record)

    return enter


def _leave_fn(grad_placements: Placements) -> Callable:
    def leave(out: Any):
        return out.to_local(grad_placements=grad_placements)

    return leave


class Calls:
    """The wrapper's enter and leave nodes: closures over ``Enter`` (its
    record list per input) and ``to_local``."""

    def __init__(self, records: Sequence[list] = ()) -> None:
        self.records = records

    def enter(self, g: fx.Graph, i: int, slot: Slot, local: fx.Node, wide: fx.Node | None) -> fx.Node:
        args = (local, wide) if wide is not None else (local,)
        return g.call_function(_enter_fn(slot.spec, self.records[i]), args)

    def leave(self, g: fx.Graph, out: fx.Node, placements: Placements) -> fx.Node:
        return g.call_function(_leave_fn(placements), (out,))


def wrapper_graph(gm: fx.GraphModule, inputs: Sequence[Slot], outputs: Sequence[Slot],
                  tangents: Sequence[Placements | None], records: Sequence[list],
                  wide: Sequence[int] = (), calls: Calls | None = None) -> fx.GraphModule:
    """The local-level graph around ``gm`` (Note: [The border's wrapper graph]);
    ``wide``: the inputs that get a wide slot, after all others (Note: [A
    gradient wider than its input]).  ``calls``: what enters and leaves
    (default: ``Enter`` with ``records`` and ``to_local``; the cacheable
    border's named calls, Note: [A border torch's caches can serve])."""
    g = fx.Graph()
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = {}
    news = []
    for p, slot in zip(old, inputs):
        new = g.placeholder(f"{p.name}_local" if slot.spec is not None else p.name)
        new.meta = dict(p.meta)
        news.append(new)
    wides = {i: g.placeholder(f"{old[i].name}_wide") for i in wide}
    calls = calls if calls is not None else Calls(records)
    for i, (p, slot, new) in enumerate(zip(old, inputs, news)):
        if slot.spec is not None:
            val = p.meta.get("example_value", p.meta.get("val"))
            local = val._local_tensor if val is not None else None
            for k in ("val", "example_value"):
                if k in new.meta:
                    new.meta[k] = local
            dt = calls.enter(g, i, slot, new, wides.get(i))
            dt.meta = dict(p.meta)
            env[p] = dt
        else:
            env[p] = new
    copied = g.graph_copy(gm.graph, env, return_output_node=True)
    if not isinstance(copied, tuple):
        raise AssertionError("graph_copy returned no output node")
    new_outs, _ = copied
    results = []
    for a, slot, t in zip(new_outs, outputs, tangents):
        if slot.spec is None or t is None:
            results.append(a)
            continue
        left = calls.leave(g, a, t)
        val = a.meta.get("example_value", a.meta.get("val"))
        if val is not None:
            left.meta["val"] = val._local_tensor
        results.append(left)
    g.output(tuple(results))
    wrapped = fx.GraphModule(gm, g)
    return wrapped
