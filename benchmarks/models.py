"""Models measured by the benchmarks, each written three ways.

The tensor-parallel stack (``n_blocks`` Megatron-style MLP blocks, each a
column-parallel and a row-parallel region, so ``2 * n_blocks`` regions)::

    h = x                                   # [Replicate()]
    for each block:
        a = col(h, w1)   # relu(h @ w1): in ([R], [S(1)]), grad of h Partial, out [S(1)]
        y = row(a, w2)   # a @ w2:       in ([S(1)], [S(0)]), out [Partial()]
        h = y.redistribute(mesh, [Replicate()])      # all_reduce
    loss = (h * h).sum()

* ``impl="ours"``: regions are ``localmap_fx.local_map``;
* ``impl="torch"``: regions are torch's ``local_map`` (same arguments);
* :func:`build_handwritten`: the same computation on plain local tensors with
  functional collectives, written by hand: forward ``all_reduce`` after each
  row-parallel matmul; in backward an ``all_reduce`` of the input gradient of
  every block but the first (the ``Partial`` gradient of ``h`` that DTensor
  reduces when it leaves the previous block's ``redistribute``).  Its loss and
  gradients equal the DTensor versions'.

The layer stack for compile-time measurements is :func:`build_layer_stack`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from localmap_fx.testing.models import (
    ROW_GRAD_PLACEMENTS,
    layer_region,
    local_map_of,
    seeded_randn,
    tp_block,
    tp_weights,
)

__all__ = ["local_map_of", "build_tp_stack", "build_handwritten", "build_layer_stack"]


def tp_regions(impl: str, mesh, spmd_types: bool | str = False):
    """The column- and row-parallel regions of one TP block, with ``impl``'s local_map."""
    return tp_block(
        mesh,
        local_map_fn=local_map_of(impl),
        row_grads=ROW_GRAD_PLACEMENTS,
        spmd_types=spmd_types,
    )


def tp_stack_tensors(n_blocks: int, batch: int, d: int, hidden: int) -> dict:
    """Full (unsharded) tensors, identical on every rank."""
    w1s, w2s = tp_weights(n_blocks, d, hidden)
    return {"x": seeded_randn(0, batch, d), "w1": w1s, "w2": w2s}


def build_tp_stack(
    mesh,
    impl: str,
    n_blocks: int = 2,
    batch: int = 32,
    d: int = 128,
    hidden: int = 256,
    spmd_types: bool = False,
    device: str = "cpu",
):
    """(step, state): ``step(state)`` returns the loss, a scalar DTensor."""
    col, row = tp_regions(impl, mesh, spmd_types)
    full = tp_stack_tensors(n_blocks, batch, d, hidden)

    def dist(t, placements):
        return distribute_tensor(t.to(device), mesh, placements).requires_grad_()

    state = {
        "x": dist(full["x"], [Replicate()]),
        "w1": [dist(w, [Shard(1)]) for w in full["w1"]],
        "w2": [dist(w, [Shard(0)]) for w in full["w2"]],
    }

    def step(x, w1s, w2s):
        h = x
        for w1, w2 in zip(w1s, w2s):
            h = row(col(h, w1), w2).redistribute(mesh, [Replicate()])
        return (h * h).sum()

    return step, state


class _AllReduceFwd(torch.autograd.Function):
    """all_reduce in forward; the gradient passes through (it is replicated)."""

    @staticmethod
    def forward(ctx, t, group):
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllReduceFwdBwd(torch.autograd.Function):
    """all_reduce in forward and of the (partial) gradient in backward."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


def build_handwritten(mesh, n_blocks: int = 2, batch: int = 32, d: int = 128, hidden: int = 256, device: str = "cpu"):
    """The TP stack on local tensors with funcol collectives: (step, state)."""
    full = tp_stack_tensors(n_blocks, batch, d, hidden)
    ws = mesh.size(0)
    rank = mesh.get_local_rank(0)
    group = mesh.get_group(0)

    def shard(t, dim):
        return t.chunk(ws, dim)[rank].contiguous().to(device).requires_grad_()

    state = {
        "x": full["x"].to(device).requires_grad_(),
        "w1": [shard(w, 1) for w in full["w1"]],
        "w2": [shard(w, 0) for w in full["w2"]],
    }

    def step(x, w1s, w2s):
        h = x
        n = len(w1s)
        for i, (w1, w2) in enumerate(zip(w1s, w2s)):
            y = torch.relu(h @ w1) @ w2
            # the next block's input gradient is partial: reduce it here
            h = (_AllReduceFwdBwd if i < n - 1 else _AllReduceFwd).apply(y, group)
        return (h * h).sum()

    return step, state


def build_layer_stack(mesh, impl: str, n_layers: int, d: int = 32, batch: int = 16):
    """``n_layers`` identical regions: x [S(0)] -> tanh(x @ w) + x, w [R]."""
    layer = layer_region(mesh, local_map_fn=local_map_of(impl))
    x = distribute_tensor(seeded_randn(0, batch, d), mesh, [Shard(0)]).requires_grad_()
    ws = [
        distribute_tensor(seeded_randn(1 + i, d, d) / d**0.5, mesh, [Replicate()]).requires_grad_()
        for i in range(n_layers)
    ]

    def step(x, ws):
        for w in ws:
            x = layer(x, w)
        # pow: every layer's output gradient is then a dense tensor (with a
        # plain sum the last one is an expanded scalar, and invoke_subgraph
        # traces a second backward for that layer)
        return x.to_local().pow(2).sum()

    return step, {"x": x, "ws": ws}


def grads_of(state: dict) -> list[torch.Tensor]:
    """Local gradients of every leaf in ``state`` (DTensor grads unwrapped)."""
    out: list[Any] = []
    for v in (state["x"], *state["w1"], *state["w2"]):
        g = v.grad
        out.append(g.to_local() if isinstance(g, DTensor) else g)
    return out


def zero_grads(state: dict) -> None:
    for v in (state["x"], *state.get("w1", ()), *state.get("w2", ()), *state.get("ws", ())):
        v.grad = None
