"""The functional all_reduce our runtimes call between graphs, beneath autograd's dispatch when nothing is differentiated.

A run of layers (:mod:`localmap_fx.layer_sharing.runtime`) supplies the
all_reduce a layer's backward had taken out (``passes.hoist_tangent_reductions``),
and the lean DTensor border (:mod:`localmap_fx.compiler.dtensor_border`)
converts a Partial gradient to Replicate with one: both call it inside an
``autograd.Function``'s backward, with grad mode off.

Note: [A collective with nothing to differentiate skips autograd's Python]
    torch registers the autograd of the functional collectives in Python
    (``torch.library.register_autograd``), and that kernel runs on every
    call, even with grad mode off, where it only redispatches below
    autograd.  So a functional all_reduce with nothing to differentiate
    (grad mode off, or an input that does not require grad) is called
    below autograd directly: the out-of-place ``all_reduce`` and
    ``wait_tensor`` took 17.6 us a pair that way and 7.7 below autograd
    (fake process group, 20,000 calls); the marked TP stack's backward on 2
    gloo ranks (64 layers) went from 142.5 to 135.6 ms.  With grad mode on
    and an input that requires grad, the call is made as before.

Note: [Compiled graphs run through autograd's dispatch]
    The compiled forwards and backwards themselves are not called below
    autograd, though their collectives pay the same Python kernels: done
    for a session (the fake-group census of the 64-layer TP stack, CPU ÷
    upstream whole, went from 1.04 to 0.93 for marked blocks with both
    changes), it made the marked step on 2 gloo ranks slower, marked ÷
    upstream whole 1.19 / 1.29 / 1.14 against 1.06 / 1.10 / 0.95 without it
    (``python -m benchmarks.marked_bench --only steady --depths 64 --rounds
    10``, three interleaved pairs, session 20); why was not found, and a
    default may not slow the step.
"""

from __future__ import annotations

import torch

from ._torch_compat import AutoDispatchBelowAutograd

__all__ = ["all_reduce_waited"]


def all_reduce_waited(local: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``wait_tensor(all_reduce(local, reduce_op, group_name))``: the functional all_reduce, waited."""
    ops = torch.ops._c10d_functional
    if torch.is_grad_enabled() and local.requires_grad:
        return ops.wait_tensor(ops.all_reduce(local, reduce_op, group_name))
    # Note: [A collective with nothing to differentiate skips autograd's Python]
    with AutoDispatchBelowAutograd():
        return ops.wait_tensor.default(ops.all_reduce.default(local, reduce_op, group_name))
