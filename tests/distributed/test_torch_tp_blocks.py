"""Blocks parallelized by torch's own tensor-parallel API, compiled regionally.

The shape of public model code (torch's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, DTensor activations between blocks
as torchtitan's newer sharding configs keep them, a ``local_map``-ed inner
attention), each block compiled on its own: the lean border's tangent plan
meets projections it did not write.  Compared with torch's ``local_map``
compiled the same way: the same frames and graph breaks, gradients within
tolerance of eager, and gradient placements eager's (upstream regional gives
the output projection's gradient ``Shard(1)`` where eager gives ``Partial``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS = 2
D, HEADS = 32, 4


def _blocks(mesh, impl: str) -> nn.ModuleList:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if impl == "ours":
        import localmap_fx

        local_map = localmap_fx.local_map
    else:
        from torch.distributed.tensor.experimental import local_map

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
            self.w1, self.w2 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)
            self.inner = local_map(self._attention, out_placements=[Shard(1)],
                                   in_placements=([Shard(1)], [Shard(1)], [Shard(1)]), device_mesh=mesh)

        @staticmethod
        def _attention(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            h = x + self.wo(self.inner(q, k, v).transpose(1, 2).reshape(b, s, -1))
            return h + self.w2(F.relu(self.w1(h)))

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(LAYERS))
    colwise, rowwise = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    for block in blocks:
        parallelize_module(block, mesh, {"wq": colwise, "wk": colwise, "wv": colwise, "wo": rowwise,
                                         "w1": colwise, "w2": rowwise})
    return blocks


def _step(blocks, x):
    h = x
    for block in blocks:
        h = block(h)
    loss = (h * h).sum()
    loss.backward()
    return loss


class _Whole(nn.Module):
    """The blocks and the loss, compiled as one frame."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (x * x).sum()


def _vs_eager(rank: int, world_size: int, device: str, whole: bool = False) -> dict:
    """Per way (eager, upstream, ours): loss and gradients of a second step,
    their placements, frames and graph breaks; the blocks compiled each on its
    own, or (``whole``) the model with its loss as one frame."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,))
    full = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1))
    ways = ((("upstream", "torch", "inductor"), ("ours", "ours", "localmap_fx")) if whole else
            (("upstream", "torch", "aot_eager"), ("aot_eager", "ours", localmap_fx.backend("aot_eager")),
             ("inductor", "ours", "localmap_fx")))
    out: dict = {}
    for name, impl, backend in (("eager", "ours", None), *ways):
        torch._dynamo.reset()
        counters.clear()
        blocks = _blocks(mesh, impl)
        run: nn.Module = _Whole(blocks)
        if backend is not None and whole:
            run = torch.compile(run, backend=backend)  # type: ignore[assignment]
        elif backend is not None:
            for block in blocks:
                block.compile(backend=backend)
        x = distribute_tensor(full, mesh, [Replicate()]).requires_grad_()
        leaves = [x, *blocks.parameters()]
        for _ in range(2):  # the second step runs what the first compiled
            for t in leaves:
                t.grad = None
            loss = run(x)
            loss.backward()
        out[name] = {
            "values": [loss.full_tensor()] + [t.grad.full_tensor() for t in leaves],
            "placements": [tuple(t.grad.placements) for t in leaves],
            "frames": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
        }
    return out


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.inductor  # the ranks compile with Inductor too
def test_torch_parallelized_blocks_compile_regionally_as_upstream_and_equal_eager():
    from localmap_fx.testing.dist import run_ranks

    for rank in run_ranks(_vs_eager, world_size=2, timeout=900):
        eager, upstream = rank["eager"], rank["upstream"]
        # torch's behaviour, pinned: upstream regional gives the output
        # projections' gradients other placements than eager (Shard(1), not Partial)
        assert upstream["placements"] != eager["placements"]
        for name in ("aot_eager", "inductor"):
            got = rank[name]
            assert (got["frames"], got["breaks"]) == (upstream["frames"], upstream["breaks"]) == (1, 0)
            assert got["placements"] == eager["placements"], name
            for a, b in zip(eager["values"], got["values"]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * (1 + a.abs().max().item()))


def test_torch_parallelized_block_converts_a_partial_gradient():
    """The block's Partial joint gathers weights (torch's Colwise/Rowwise
    projections), so the border compiles Replicate and converts Partial
    (Note: [The gradient a stack sends back] in compiler/tangent_plan.py)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from helpers import border_recording, mesh_1d

    mesh = mesh_1d()
    blocks = _blocks(mesh, "ours")
    backend, seen = border_recording("aot_eager")
    for block in blocks:
        block.compile(backend=backend)
    _step(blocks, distribute_tensor(torch.randn(2, 8, D), mesh, [Replicate()]).requires_grad_())
    (border,) = seen
    assert border.plan.text() == "compile (R); convert (P(sum))"


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.inductor
def test_torch_parallelized_model_compiled_whole_equals_eager():
    """The whole model (the loss inside) behind the border torch's caches
    serve (Note: [A border torch's caches can serve]): one frame, no break,
    eager's values and placements, as upstream ``backend="inductor"``."""
    from localmap_fx.testing.dist import run_ranks

    for rank in run_ranks(_vs_eager, world_size=2, timeout=900, args=(True,)):
        eager, upstream, ours = rank["eager"], rank["upstream"], rank["ours"]
        assert (ours["frames"], ours["breaks"]) == (upstream["frames"], upstream["breaks"]) == (1, 0)
        assert ours["placements"] == eager["placements"] == upstream["placements"]
        for a, b in zip(eager["values"], ours["values"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * (1 + a.abs().max().item()))


@pytest.mark.slow
@pytest.mark.inductor
def test_torch_parallelized_model_compiled_whole_is_served_by_torchs_caches():
    """Compiled twice in one process (``torch._dynamo.reset()`` between, as a
    new process would): the second compile is an AOTAutogradCache hit, reads
    the input gradients' placements from the border's file, and gives the
    first compile's numbers."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache
    from torch.distributed.tensor import Replicate, distribute_tensor

    from localmap_fx.compiler.cacheable_border import CacheableBorder

    from helpers import border_recording, mesh_1d

    mesh = mesh_1d()
    runs = []
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            backend, seen = border_recording()
            blocks = _blocks(mesh, "ours")
            x = distribute_tensor(torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)), mesh,
                                  [Replicate()]).requires_grad_()
            loss = torch.compile(_Whole(blocks), backend=backend)(x)
            loss.backward()
            leaves = [x, *blocks.parameters()]
            runs.append((seen, dict(counters["aot_autograd"]), [loss.to_local()] + [t.grad.to_local() for t in leaves],
                         [tuple(t.grad.placements) for t in leaves]))
    (s1, c1, v1, p1), (s2, c2, v2, p2) = runs
    assert isinstance(s1[0], CacheableBorder) and isinstance(s2[0], CacheableBorder), (s1, s2)
    assert c1.get("autograd_cache_saved") == 1 and c2.get("autograd_cache_hit") == 1, (c1, c2)
    assert "gradient file" in s2[0].text()
    assert p1 == p2
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))
