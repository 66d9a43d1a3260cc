"""Run a piece that only unwraps DTensors as one lean ``autograd.Function``.

A split frame's first piece is often nothing but ``to_local`` of the
frame's DTensor inputs: the weights every layer reads as local tensors
(Note: [Weights enter as local tensors] in :mod:`.find`) and the stream's
first local tensor.  Compiled by AOTAutograd, its runtime flattens every
DTensor on the way in and rebuilds each gradient as a DTensor from scratch
on the way back (``__tensor_unflatten__``, a new ``DTensorSpec`` per
gradient per step), and the compile itself traces one graph over every
weight.  Nothing of that is needed: the piece is ``to_local`` per input::

    before (AOTAutograd, aot_eager)              after (Unwrap)
    -------------------------------              --------------
    RuntimeWrapper -> AOTDispatchSubclass        _UnwrapFunction.apply
    -> CompiledFunction(fw: identity)              forward: each input's local tensor, viewed
    backward: identity graph, then one             backward: each gradient wrapped with the spec
    DTensorSpec built per gradient                 to_local's backward gave it the first time

Note: [A piece that only unwraps runs as an Unwrap]
    The forward returns ``local.view_as(local)`` per output, as
    ``DTensor.to_local`` does: a new tensor object, so the parameter's own
    ``_local_tensor`` never gets a ``grad_fn`` (Dynamo guards on its
    ``requires_grad``; Inductor's identity graph returned the object itself
    and the frame recompiled on the next step).  The backward gives each
    gradient the spec torch's ``to_local`` backward
    (``_ToTorchTensor.backward``) gives it, computed by that function at the
    first backward and kept while the input's spec object and the
    gradient's strides stay the same (a parameter's spec is one object for
    its life), so gradients carry eager's placements, shape and strides and
    aot_eager stays bitwise eager.  A piece whose two outputs unwrap one
    input, or that does anything else, is compiled as before.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import is_input_to_local

__all__ = ["Unwrap", "unwrap_of"]


@dataclasses.dataclass(frozen=True)
class Unwrap:
    """Output ``k`` is the local tensor of input ``sources[k]``, its gradient in ``grad_placements[k]``
    (None: ``to_local``'s default)."""

    n_inputs: int
    sources: tuple[int, ...]
    grad_placements: tuple[tuple | None, ...]
    # per output: (input spec, local stride, gradient stride, gradient spec) of the last backward
    _grad_specs: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def text(self) -> str:
        return f"unwrap of {len(self.sources)} DTensors"

    def __call__(self, *inputs: Any) -> tuple:
        return _UnwrapFunction.apply(self, *inputs)

    def grad_spec(self, k: int, spec: Any, local_stride: tuple, grad: torch.Tensor) -> Any:
        """The spec of output ``k``'s gradient (Note: [A piece that only unwraps runs as an Unwrap])."""
        if not self._grad_specs:
            self._grad_specs.extend([None] * len(self.sources))
        stride = grad.stride()
        kept = self._grad_specs[k]
        if kept is not None and kept[0] is spec and kept[1] == local_stride and kept[2] == stride:
            return kept[3]
        from .._torch_compat import ToTorchTensor

        ctx = types.SimpleNamespace(dtensor_spec=spec, grad_placements=self.grad_placements[k],
                                    local_tensor_stride=local_stride)
        made = ToTorchTensor.backward(ctx, grad)[0]._spec
        self._grad_specs[k] = (spec, local_stride, stride, made)
        return made


class _UnwrapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unwrap: Unwrap, *inputs: Any):
        ctx.unwrap = unwrap
        ctx.specs = [inputs[i]._spec for i in unwrap.sources]
        ctx.set_materialize_grads(False)
        outs = []
        for i in unwrap.sources:
            local = inputs[i]._local_tensor
            outs.append(local.view_as(local))
        ctx.strides = [o.stride() for o in outs]
        return tuple(outs)

    # Note: [A compiled backward is no frame for Dynamo] (compiler/dtensor_border.py)
    @staticmethod
    @torch.compiler.disable(reason="a compiled graph's backward runs as compiled")
    def backward(ctx, *grads: torch.Tensor | None):
        from torch.distributed.tensor import DTensor

        unwrap: Unwrap = ctx.unwrap
        in_grads: list[Any] = [None] * unwrap.n_inputs
        for k, (i, g) in enumerate(zip(unwrap.sources, grads)):
            if g is None or not ctx.needs_input_grad[i + 1]:
                continue
            in_grads[i] = DTensor(g, unwrap.grad_spec(k, ctx.specs[k], ctx.strides[k], g), requires_grad=False)
        return (None, *in_grads)


def unwrap_of(sub: fx.GraphModule) -> Unwrap | None:
    """The :class:`Unwrap` running ``sub``, or None when ``sub`` does more than unwrap each input once."""
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    body = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    if not body or not all(is_input_to_local(n) for n in body):
        return None
    out_node = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)) or not all(isinstance(o, fx.Node) and o in body for o in outs):
        return None
    sources = tuple(placeholders.index(o.args[0]) for o in outs)
    if len(set(sources)) != len(sources):
        return None
    grads = []
    for o in outs:
        g = o.kwargs.get("grad_placements", o.args[1] if len(o.args) > 1 else None)
        grads.append(tuple(g) if g is not None else None)
    return Unwrap(len(placeholders), sources, tuple(grads))
