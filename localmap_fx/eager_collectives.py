"""Collectives the compiled runtime runs between graphs, on plain local tensors.

A border converts a gradient's placement (``compiler.conversions``) and a run
of layers supplies the all_reduce taken out of a layer's backward
(``passes.hoist_tangent_reductions``) outside any compiled graph, once per
call or per layer each step.  They call the functional collectives the
graphs call, so the values are the graphs'.

Note: [A collective with nothing to differentiate skips autograd's Python]
    torch registers the autograd of ``_c10d_functional.all_reduce`` and
    ``wait_tensor`` in Python (``torch.library.register_autograd``), so
    every call reaches a Python kernel even in a backward, where it only
    checks that nothing requires grad and redispatches below autograd:
    about 18 us a call here, 60 us per layer of a run's backward (measured
    on the 64-layer TP stack, fake process group: a marked step's backward
    took 18.7 ms against 15.0 for one whole graph with the same kernels).
    When grad mode is off or the input does not require grad, the call is
    made below autograd directly: the dispatch that kernel makes, without
    the Python.  Otherwise the autograd path runs, as before.
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
