"""The torchtitan-style attention stack (:mod:`localmap_fx.testing.attention_stack`)
on 2 gloo ranks: eager equals torch's ``local_map``, and every way of compiling
it (whole, regional, marked blocks, layers shared behind the lean DTensor
border) equals eager.

Its blocks mix DTensor ops (projections, head views, redistribute, residual)
with one region (SDPA over sharded heads), where :class:`TPStack`'s blocks are
regions only.  The deep-model benchmark (``benchmarks/depth_bench.py``, style
``attention``) times it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

LAYERS = 3
WAYS = ("whole", "regional", "marked", "shared")


def _grads(fn, model, x) -> list[torch.Tensor]:
    for t in (x, *model.parameters()):
        t.grad = None
    loss = fn(x)
    loss.backward()
    return [t.full_tensor() for t in (loss, x.grad, *(p.grad for p in model.parameters()))]


def _attention_vs_eager(rank: int, world_size: int, device: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx
    from localmap_fx.testing.attention_stack import AttnStack, attn_stack_input

    torch.manual_seed(0)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))

    def stack(impl="ours", marked=False):
        return AttnStack(mesh, LAYERS, d=32, n_heads=4, impl=impl, marked=marked), attn_stack_input(mesh, 2, 8, 32)

    model, x = stack()
    eager = _grads(model, model, x)
    model, x = stack("torch")
    report = {("torch_eager", k): (torch.equal(a, b), (a - b).abs().max().item())
              for k, (a, b) in enumerate(zip(eager, _grads(model, model, x)))}
    for inner in ("aot_eager", "inductor"):
        for way in WAYS:
            torch._dynamo.reset()
            model, x = stack(marked=way == "marked")
            backend = localmap_fx.backend(inner, share_layers=True if way == "shared" else "auto")
            if way == "regional":
                for block in model.blocks:
                    block.compile(backend=backend)
                fn = model
            else:
                fn = torch.compile(model, backend=backend)
            _grads(fn, model, x)  # a second step runs what the first compiled
            got = _grads(fn, model, x)
            # aot_eager: the sum order of a Partial gradient may differ by an ulp
            tol = 1e-6 if inner == "aot_eager" else 1e-5
            for k, (a, b) in enumerate(zip(eager, got)):
                ok = torch.allclose(a, b, rtol=tol, atol=tol * (1 + a.abs().max().item()))
                report[(f"{inner}_{way}", k)] = (bool(ok), (a - b).abs().max().item())
    return report


@pytest.mark.inductor  # the ranks compile with Inductor too
def test_attention_stack_compiled_every_way_equals_eager():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_attention_vs_eager, world_size=2, timeout=900)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    # loss, x and 4 weights per layer, for torch's eager and each compiled way
    assert len(results[0]) == (1 + 2 * len(WAYS)) * (2 + 4 * LAYERS)
