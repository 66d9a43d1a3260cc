"""Compiled == eager, bitwise, for every example model and capture edge case.

All ranks run in this process (``LocalTensorMode``).  Inner compiler is
aot_eager; invoke_subgraph has no LocalTensor rule in torch 2.14.1, so bodies
stay inline here (``outline=False``).  The gloo tier
(``test_gloo_compiled.py``) covers outlined bodies and inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.models import MODELS, grad_tensors

from helpers import WORLD_SIZE, ltm_mesh_for


def _per_rank(t):
    if isinstance(t, DTensor):
        t = t.to_local()
    return [t._local_tensors[r] for r in range(WORLD_SIZE)]


def assert_same(a, b):
    if isinstance(a, DTensor):
        assert isinstance(b, DTensor)
        assert a.placements == b.placements
        assert a.shape == b.shape
    for x, y in zip(_per_rank(a), _per_rank(b)):
        assert torch.equal(x, y), (x, y)


def _backend(**kw):
    return localmap_fx.backend("aot_eager", outline=False, **kw)


def _run(step, state):
    loss = step(state)
    loss.backward()
    return loss, {k: v.grad for k, v in grad_tensors(state).items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_compiled_equals_eager(name):
    m = MODELS[name]
    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(m.mesh_ndim)
        e_loss, e_grads = _run(m.step, m.build(mesh, 0))
        compiled = torch.compile(m.step, backend=_backend(), fullgraph=True)
        c_loss, c_grads = _run(compiled, m.build(mesh, 0))
    assert_same(e_loss, c_loss)
    assert e_grads.keys() == c_grads.keys()
    for k in e_grads:
        assert_same(e_grads[k], c_grads[k])


def _compare(fn, make_inputs, fullgraph=True, **backend_kw):
    """Run ``fn`` eager and compiled on fresh inputs; compare outputs and grads."""
    with LocalTensorMode(WORLD_SIZE):
        results = []
        for compiled in (False, True):
            inputs = make_inputs()
            f = torch.compile(fn, backend=_backend(**backend_kw), fullgraph=fullgraph) if compiled else fn
            out = f(*inputs)
            loss = out.redistribute(out.device_mesh, [Replicate()] * out.device_mesh.ndim).sum()
            loss.backward()
            results.append((out, [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]))
            torch._dynamo.reset()
    (eo, eg), (co, cg) = results
    assert_same(eo, co)
    assert len(eg) == len(cg)
    for a, b in zip(eg, cg):
        assert (a is None) == (b is None)
        if a is not None:
            assert_same(a, b)


def _mesh():
    return ltm_mesh_for(1)


def test_closure_over_tensor_keeps_alignment_and_grad():
    def make():
        mesh = _mesh()
        bias = torch.arange(8.0).requires_grad_()
        x = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), mesh, [Replicate()]).requires_grad_()
        return x, w, bias

    def fn(x, w, bias):
        @localmap_fx.local_map(out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]), device_mesh=x.device_mesh)
        def body(a, b):
            return a @ b + bias  # closes over a plain tensor

        return body(x, w)

    _compare(fn, make)


def test_tied_inputs():
    def make():
        mesh = _mesh()
        x = distribute_tensor(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]).requires_grad_()
        return (x,)

    @localmap_fx.local_map(out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))
    def body(a, b):
        return a * b + a

    _compare(lambda x: body(x, x), make)


def test_body_returning_input():
    def make():
        mesh = _mesh()
        x = distribute_tensor(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]).requires_grad_()
        return (x,)

    @localmap_fx.local_map(out_placements=([Shard(0)], [Shard(0)]), in_placements=([Shard(0)],))
    def body(a):
        return a, a * 2

    def fn(x):
        a, b = body(x)
        return a + b

    _compare(fn, make)


def test_non_tensor_arguments_and_outputs():
    def make():
        mesh = _mesh()
        x = distribute_tensor(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]).requires_grad_()
        return (x,)

    @localmap_fx.local_map(out_placements=([Shard(0)], None), in_placements=(None, [Shard(0)], None))
    def body(scale, a, shift):
        return a * scale + shift, "done"

    def fn(x):
        out, tag = body(3.0, x, 1)
        assert tag == "done"
        return out

    _compare(fn, make)


@pytest.mark.slow
def test_region_in_module_and_graph_break_outside():
    class Block(nn.Module):
        def __init__(self, mesh):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.w = nn.Parameter(distribute_tensor(torch.randn(8, 8, generator=g), mesh, [Shard(1)]))
            self.fn = localmap_fx.local_map(
                lambda x, w: torch.relu(x @ w),
                out_placements=[Shard(1)],
                in_placements=([Replicate()], [Shard(1)]),
                in_grad_placements=([Partial()], [Shard(1)]),
                device_mesh=mesh,
            )

        def forward(self, x):
            y = self.fn(x, self.w)
            torch._dynamo.graph_break()
            return self.fn(y.redistribute(y.device_mesh, [Replicate()]), self.w)

    with LocalTensorMode(WORLD_SIZE):
        mesh = _mesh()
        results = []
        for compiled in (False, True):
            torch.manual_seed(0)
            block = Block(mesh)
            x = distribute_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)), mesh, [Replicate()]).requires_grad_()
            f = torch.compile(block, backend=_backend()) if compiled else block
            out = f(x)
            out.redistribute(mesh, [Replicate()]).sum().backward()
            results.append((out, x.grad, block.w.grad))
            torch._dynamo.reset()
    for a, b in zip(*results):
        assert_same(a, b)


def test_spmd_derived_output_grad_differs_from_default():
    """An R-typed output gets a Partial grad placement (not DTensor's Replicate)."""

    def make():
        mesh = _mesh()
        x = distribute_tensor(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), mesh, [Replicate()]).requires_grad_()
        return (x,)

    @localmap_fx.local_map(out_placements=[Replicate()], in_placements=([Replicate()],), spmd_types=True)
    def body(a):
        return a * 2

    def fn(x):
        return body(x)

    _compare(fn, make)
    # and the lowered from_local carries the derived placement
    from localmap_fx.testing.graphs import Recorder

    with LocalTensorMode(WORLD_SIZE):
        (x,) = make()
        rec = Recorder("aot_eager", outline=False)
        torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
    lowered = rec.stage("lower_boundaries")
    from_locals = [n for n in lowered.graph.nodes if "from_local" in str(n.target)]
    assert [n.kwargs["grad_placements"] for n in from_locals] == [(Partial(),)]
