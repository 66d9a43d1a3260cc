"""A piece that only unwraps runs as an :class:`~localmap_fx.layer_sharing.unwrap.Unwrap`.

Its gradients must be what eager ``to_local`` gives: placements (the
``grad_placements`` given, Partial included), global shape and stride, and
the local values, for contiguous and strided incoming gradients, on the
first backward and on later ones (kept specs).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from localmap_fx.layer_sharing.unwrap import Unwrap, unwrap_of

from helpers import mesh_1d


def _unwraps(w, x):
    return w.to_local(grad_placements=(Shard(1),)), x.to_local(grad_placements=(Partial(),)), w.to_local()


def _leaves(mesh):
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]).requires_grad_()
    x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()
    return w, x


def test_unwrap_of_reads_sources_and_grad_placements():
    gm = fx.symbolic_trace(lambda w, x: _unwraps(w, x)[:2])
    assert unwrap_of(gm) == Unwrap(2, (0, 1), ((Shard(1),), (Partial(),)))
    # one input unwrapped twice, or anything but to_local: compiled as before
    assert unwrap_of(fx.symbolic_trace(_unwraps)) is None
    assert unwrap_of(fx.symbolic_trace(lambda w, x: (w.to_local() * 2,))) is None


@pytest.mark.parametrize("strided", [False, True])
def test_unwrap_gradients_equal_to_locals(strided):
    mesh = mesh_1d()
    unwrap = unwrap_of(fx.symbolic_trace(lambda w, x: _unwraps(w, x)[:2]))
    for _ in range(2):  # the second backward reuses the specs of the first
        grads = []
        for run in (lambda w, x: _unwraps(w, x)[:2], unwrap):
            w, x = _leaves(mesh)
            outs = run(w, x)
            assert not w._local_tensor.requires_grad and outs[0] is not w._local_tensor
            g = [torch.full_like(o, 0.5) for o in outs]
            if strided:
                g[0] = torch.randn(tuple(reversed(outs[0].shape)), generator=torch.Generator().manual_seed(1)).t()
            torch.autograd.backward(outs, g)
            grads.append((w.grad, x.grad))
        for eager, got in zip(*grads):
            assert (got.placements, got.shape, got.stride()) == (eager.placements, eager.shape, eager.stride())
            assert got.to_local().stride() == eager.to_local().stride()
            assert torch.equal(got.to_local(), eager.to_local())
