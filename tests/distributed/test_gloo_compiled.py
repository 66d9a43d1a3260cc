"""Compiled == eager on real collectives: 2 gloo processes (NCCL when 2 GPUs).

For every 1-D example model: forward value and gradients (values and
placements) of ``torch.compile(step, backend=localmap_fx.backend(inner))`` are
compared with the eager fallback on the same rank: bitwise with
inner="aot_eager", within 1e-6 relative with inner="inductor".  Region bodies
are outlined here (``share_layers=False`` keeps ``outline=True`` in force), so
shared ``invoke_subgraph`` bodies run for real; shared layer pieces are covered
by ``test_share_layers.py``.
"""

from __future__ import annotations

import pytest
import torch

from localmap_fx.testing.dist import run_ranks

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

MODELS_1D = ["tp_mlp", "attention", "redistribute", "partial_grad", "loop3", "spmd"]

PARAMS = [
    pytest.param("gloo", "cpu", id="gloo-cpu"),
    pytest.param(
        "nccl",
        "cuda",
        id="nccl-cuda",
        marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    ),
]


def _compare_models(rank: int, world_size: int, device: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx
    from localmap_fx.testing.models import MODELS, grad_tensors

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    report = {}
    for name in MODELS_1D:
        m = MODELS[name]

        def run(step, m=m):
            state = m.build(mesh, 0)
            loss = step(state)
            loss.backward()
            grads = {k: v.grad for k, v in grad_tensors(state).items()}
            return loss, grads

        e_loss, e_grads = run(m.step)
        for inner in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            c_loss, c_grads = run(torch.compile(m.step, backend=localmap_fx.backend(inner, share_layers=False), fullgraph=True))
            pairs = [("loss", e_loss, c_loss)] + [(k, e_grads[k], c_grads[k]) for k in e_grads]
            for key, a, b in pairs:
                same_placements = a.placements == b.placements
                la, lb = a.to_local().cpu(), b.to_local().cpu()
                if inner == "aot_eager":
                    ok = same_placements and torch.equal(la, lb)
                else:
                    ok = same_placements and torch.allclose(la, lb, rtol=1e-6, atol=1e-6 * la.abs().max().item())
                report[(name, inner, key)] = (ok, str(a.placements), str(b.placements), (la - lb).abs().max().item())
    return report


@pytest.mark.parametrize("backend,device", PARAMS)
def test_compiled_equals_eager_on_real_collectives(backend, device):
    results = run_ranks(_compare_models, world_size=2, backend=backend, device=device, timeout=600)
    bad = {
        (rank, key): val
        for rank, report in enumerate(results)
        for key, val in report.items()
        if not val[0]
    }
    assert not bad, bad
    # every model x inner x tensor was checked on both ranks
    assert len(results[0]) >= len(MODELS_1D) * 2 * 3
