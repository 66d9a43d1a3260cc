"""Patterns from real model code, under ``backend="localmap_fx"`` (issue #11).

* ``local_map(fn, ...)`` built inside ``forward`` on every call;
* regions inside nested subgraphs Dynamo builds: activation checkpointing
  (with and without a selective policy), ``nested_compile_region`` and
  ``torch.cond``.

Graphs on the fake process group; numerics under ``LocalTensorMode`` (all
ranks in this process; ``outline=False`` since ``invoke_subgraph`` has no
LocalTensor rule).
"""

from __future__ import annotations

import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.graphs import Recorder

from helpers import WORLD_SIZE, mesh_1d


def _col(x, w):
    return torch.relu(x @ w)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = distribute_tensor(torch.randn(8, 16, generator=g), mesh_1d(), [Replicate()]).requires_grad_()
    w = distribute_tensor(torch.randn(16, 32, generator=g), mesh_1d(), [Shard(1)]).requires_grad_()
    return x, w


def _per_rank(t):
    t = t.to_local()
    return [t._local_tensors[r] for r in range(WORLD_SIZE)]


def _assert_same(a, b):
    assert a.placements == b.placements and a.shape == b.shape
    for x, y in zip(_per_rank(a), _per_rank(b)):
        assert torch.equal(x, y)


# --- local_map built inside forward ------------------------------------------------


class _BuiltInline(torch.nn.Module):
    """MoE-style code: the local_map is made in forward, on every call."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x, w):
        return localmap_fx.local_map(
            _col, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]), device_mesh=self.mesh
        )(x, w)


def _built_inline_closure(x, w):
    def scaled(a, b):
        return torch.relu(a @ b) * 2

    return localmap_fx.local_map(
        scaled,
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)]),
        in_grad_placements=([Replicate()], [Shard(1)]),
    )(x, w)


def test_local_map_built_in_forward_compiles_once_and_keeps_region():
    for fn, func, in_grad in ((_BuiltInline(mesh_1d()), "_col", None), (_built_inline_closure, "scaled", "in_grad=[R, S(1)]")):
        rec = Recorder("aot_eager")
        compiled = torch.compile(fn, backend=rec.backend, fullgraph=True)
        x, w = _inputs()
        for _ in range(3):
            out = compiled(x, w)
        assert out.placements == (Shard(1),)
        # one frame compiled for three calls: no retrace, no recompile
        assert len(rec.stages["captured"]) == 1
        (region,) = localmap_fx.find_regions(rec.stage("captured"))
        assert region.spec.func.endswith(func)
        assert region.spec.in_placements == ((Replicate(),), (Shard(1),))
        assert (in_grad in region.spec.text()) if in_grad else region.spec.in_grad_placements is None
        assert len(localmap_fx.find_regions(rec.stage("fuse_boundaries"))) == 1
        torch._dynamo.reset()


def test_local_map_built_in_forward_numerics():
    with LocalTensorMode(WORLD_SIZE):
        results = []
        for compiled in (False, True):
            x, w = _inputs()
            f = torch.compile(_built_inline_closure, backend=localmap_fx.backend("aot_eager", outline=False),
                              fullgraph=True) if compiled else _built_inline_closure
            out = f(x, w)
            out.redistribute(out.device_mesh, [Replicate()]).sum().backward()
            results.append((out, x.grad, w.grad))
    for a, b in zip(*results):
        _assert_same(a, b)
