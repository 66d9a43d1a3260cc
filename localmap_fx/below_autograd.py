"""Calls the compiled runtime makes beneath autograd's dispatch, when nothing is differentiated.

Our runtimes (a run of layers, :mod:`localmap_fx.layer_sharing.runtime`; the
lean DTensor border, :mod:`localmap_fx.compiler.dtensor_border`) call
compiled forwards and backwards inside an ``autograd.Function``, with grad
mode off, and call a collective between graphs (a border's Partial ->
Replicate conversion, the all_reduce a layer's backward had taken out by
``passes.hoist_tangent_reductions``).  With grad mode off, an op's autograd
kernel only passes the call on below autograd; these helpers make the call
there directly.  With grad mode on they change nothing.

Note: [Compiled graphs run below autograd]
    Every op a compiled graph calls through the dispatcher (Inductor's
    extern kernels, its collectives, ATen fallbacks) first reaches its
    autograd kernel.  For the functional collectives that kernel is Python
    (``torch.library.register_autograd``) and runs even with grad mode off,
    where it only redispatches below autograd: Inductor's in-place
    ``all_reduce_`` then ``wait_tensor`` cost 9.2 us a pair that way and
    3.9 us below autograd (fake process group, 20,000 calls).  AOTAutograd's
    runtime, which serves one whole-model graph, pays it too; ours call a
    graph once per block or layer.  Below autograd, views and in-place ops
    still get their autograd metadata and version counters (that is the
    ADInplaceOrView key, which stays on), and grad mode stays off, so the
    tensors are the ones the autograd kernels would have made.  With grad
    mode on (a backward with ``create_graph=True``) the call is made as
    before.

Note: [A collective with nothing to differentiate skips autograd's Python]
    The same for one functional all_reduce called between graphs: below
    autograd when grad mode is off or its input does not require grad,
    which is when the Python kernel would redispatch.  The out-of-place
    ``all_reduce`` and ``wait_tensor`` took 17.6 us a pair that way and 7.7
    below autograd; a run of layers calls one per layer in its backward, a
    regional block's border one per block.  With both notes, the fake-group
    step census of the 64-layer TP stack (``python -m benchmarks.step_census
    --styles module --layers 16 64``, CPU ms ÷ upstream whole) went from
    1.04 to 0.93 for marked blocks and from 1.62 to 1.47 for regional ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._torch_compat import AutoDispatchBelowAutograd

__all__ = ["all_reduce_waited", "call_compiled"]


def call_compiled(fn: Callable[[list], Any], args: list) -> Any:
    """``fn(args)``, below autograd when grad mode is off (Note: [Compiled graphs run below autograd])."""
    if torch.is_grad_enabled():
        return fn(args)
    with AutoDispatchBelowAutograd():
        return fn(args)


def all_reduce_waited(local: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``wait_tensor(all_reduce(local, reduce_op, group_name))``: the functional all_reduce, waited."""
    ops = torch.ops._c10d_functional
    if torch.is_grad_enabled() and local.requires_grad:
        return ops.wait_tensor(ops.all_reduce(local, reduce_op, group_name))
    # Note: [A collective with nothing to differentiate skips autograd's Python]
    with AutoDispatchBelowAutograd():
        return ops.wait_tensor.default(ops.all_reduce.default(local, reduce_op, group_name))
