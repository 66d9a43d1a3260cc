"""Shared region bodies and regions under checkpointing, on real collectives.

Two gloo processes.  A 3-layer tensor-parallel stack (column region with a
``Partial`` input gradient, row region, redistribute, residual), plain and
under ``torch.utils.checkpoint`` (selective too): compiled with the default
backend (reuse on, bodies outlined) it must match eager -- loss and every
gradient, values and placements: bitwise with aot_eager, 1e-6 relative with
inductor.  Also checks that the compiled frames did share bodies.
"""

from __future__ import annotations

import pytest

from localmap_fx.testing.dist import run_ranks

pytestmark = [pytest.mark.inductor, pytest.mark.slow]


def _compare(rank: int, world_size: int, device: str, reuse: bool = True, outline: bool = True) -> dict:
    import functools

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import localmap_fx
    from localmap_fx.testing.graphs import Recorder
    from localmap_fx.testing.models import tp_block

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    col, row = tp_block(None)

    def block(x, w1, w2):
        return row(col(x, w1), w2).redistribute(mesh, [Replicate()]) + x

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def stack(kind):
        def step(x, ws):
            for w1, w2 in ws:
                if kind == "plain":
                    x = block(x, w1, w2)
                elif kind == "checkpoint":
                    x = checkpoint(block, x, w1, w2, use_reentrant=False)
                else:
                    ctx = functools.partial(create_selective_checkpoint_contexts, policy)
                    x = checkpoint(block, x, w1, w2, use_reentrant=False, context_fn=ctx)
            return (x * x).sum()

        return step

    def inputs():
        g = torch.Generator().manual_seed(0)
        x = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Replicate()]).requires_grad_()
        ws = [
            (
                distribute_tensor(torch.randn(16, 32, generator=g), mesh, [Shard(1)]).requires_grad_(),
                distribute_tensor(torch.randn(32, 16, generator=g), mesh, [Shard(0)]).requires_grad_(),
            )
            for _ in range(3)
        ]
        return x, ws

    def run(step):
        x, ws = inputs()
        loss = step(x, ws)
        loss.backward()
        return [("loss", loss), ("x", x.grad)] + [
            (f"w{k}{j}", w.grad) for k, pair in enumerate(ws) for j, w in enumerate(pair)
        ]

    report = {}
    for kind in ("plain", "checkpoint", "selective"):
        eager = run(stack(kind))
        for inner in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            rec = Recorder(inner, outline=outline)
            with localmap_fx.region_reuse(reuse):
                compiled = run(torch.compile(stack(kind), backend=rec.backend, fullgraph=True))
            captured = rec.stage("captured")
            shared = sum(
                1
                for m in captured.modules()
                for n in m.graph.nodes
                if n.target is torch.ops.higher_order.invoke_subgraph
            )
            report[(kind, inner, "shared_calls")] = (shared > 0, shared)
            for (key, a), (_, b) in zip(eager, compiled):
                la, lb = a.to_local(), b.to_local()
                if inner == "aot_eager":
                    ok = a.placements == b.placements and torch.equal(la, lb)
                else:
                    ok = a.placements == b.placements and torch.allclose(
                        la, lb, rtol=1e-6, atol=1e-6 * la.abs().max().item()
                    )
                rel = ((la - lb).abs().max() / la.abs().max().clamp_min(1e-30)).item()
                report[(kind, inner, key)] = (ok, str(a.placements), str(b.placements), rel)
    return report


def test_shared_bodies_and_checkpointed_regions_match_eager_on_gloo():
    results = run_ranks(_compare, world_size=2, backend="gloo", device="cpu", timeout=600)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    # 3 kinds x 2 inner compilers x (loss, x, 6 weights, shared-call count)
    assert len(results[0]) == 3 * 2 * 9
