"""P1 and P2: the eager fallback against torch's ``local_map``, per call.

Runs on every rank of a real process group (gloo on CPU, NCCL on CUDA); the
model is the two regions of one tensor-parallel MLP block
(:func:`benchmarks.models.build_tp_stack` with one block, no redistribute)::

    forward:           y = row(col(x, w1), w2)
    forward+backward:  the same, then y.backward(g) with a Replicate gradient

Neither side runs a collective: to_local/from_local do not communicate here
and the gradient placements already match.

* P1 = ours ÷ torch, per round, for forward and for forward+backward.
* P1_spmd_fwd = ours spmd_types=True ÷ torch spmd_types=True, forward, per
  round (the whole call).
* P2 = (ours spmd_types=True - ours) ÷ (torch spmd_types=True - torch),
  forward, per round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .models import tp_regions, tp_stack_tensors
from .timing import ratio_stats, summary, time_paired

__all__ = ["eager_ranks"]


def eager_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    full = tp_stack_tensors(1, cfg["batch"], cfg["d"], cfg["hidden"])
    x = distribute_tensor(full["x"].to(device), mesh, [Replicate()]).requires_grad_()
    w1 = distribute_tensor(full["w1"][0].to(device), mesh, [Shard(1)]).requires_grad_()
    w2 = distribute_tensor(full["w2"][0].to(device), mesh, [Shard(0)]).requires_grad_()
    leaves = (x, w1, w2)

    fns = {
        (impl, spmd): tp_regions(impl, mesh, spmd)
        for impl in ("ours", "torch")
        for spmd in (False, True)
    }
    y0 = fns[("torch", False)][1](fns[("torch", False)][0](x, w1), w2)
    g = DTensor.from_local(torch.ones_like(y0.to_local()), mesh, [Replicate()])

    def fwd(key):
        col, row = fns[key]

        def run():
            row(col(x, w1), w2)

        return run

    def fwd_bwd(key):
        col, row = fns[key]

        def run():
            row(col(x, w1), w2).backward(g)
            for t in leaves:
                t.grad = None

        return run

    # Same results on both sides (a sanity check, not a timing).
    outs = {}
    for key in fns:
        col, row = fns[key]
        y = row(col(x, w1), w2)
        y.backward(g)
        outs[key] = [y.to_local()] + [t.grad.to_local() for t in leaves]
        for t in leaves:
            t.grad = None
    same = all(
        all(torch.equal(a, b) for a, b in zip(outs[key], outs[("torch", False)])) for key in outs
    )

    sync = torch.cuda.synchronize if device == "cuda" else None
    rounds, calls = cfg["rounds"], cfg["calls"]
    p1f = time_paired(
        {"torch": fwd(("torch", False)), "ours": fwd(("ours", False))}, rounds, calls, end=sync
    )
    p1b = time_paired(
        {"torch": fwd_bwd(("torch", False)), "ours": fwd_bwd(("ours", False))},
        rounds,
        max(1, calls // 4),
        end=sync,
    )
    p2 = time_paired(
        {
            "torch": fwd(("torch", False)),
            "ours": fwd(("ours", False)),
            "torch_spmd": fwd(("torch", True)),
            "ours_spmd": fwd(("ours", True)),
        },
        rounds,
        calls,
        end=sync,
    )
    dist.barrier()

    def pair(p, num, den):
        return {
            clock: {
                "ratio": ratio_stats(p.ratios(num, den, clock)),
                "ours_us": summary(p.per_call(num, clock)),
                "torch_us": summary(p.per_call(den, clock)),
            }
            for clock in ("cpu", "wall")
        }

    def extra(p):
        return {
            clock: {
                "ratio": ratio_stats(
                    p.extra_ratios(("ours_spmd", "ours"), ("torch_spmd", "torch"), clock)
                ),
                "ours_extra_us": summary(p.extras("ours_spmd", "ours", clock)),
                "torch_extra_us": summary(p.extras("torch_spmd", "torch", clock)),
                **{f"{n}_us": summary(p.per_call(n, clock)) for n in p.clocks[clock]},
            }
            for clock in ("cpu", "wall")
        }

    return {
        "results_equal": same,
        "P1_fwd": pair(p1f, "ours", "torch"),
        "P1_fwd_bwd": pair(p1b, "ours", "torch"),
        "P1_spmd_fwd": pair(p2, "ours_spmd", "torch_spmd"),
        "P2": extra(p2),
    }
