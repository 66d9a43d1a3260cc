"""Repeated region calls are traced by Dynamo once (issue #10, item 1).

Counted on the graph Dynamo captures: the ``invoke_subgraph`` calls and the
distinct subgraph modules they run (one per traced body).  The first call of
a region key runs inline (the probe, see localmap_fx/reuse.py); every later
call with the same key runs the one shared subgraph.  Calls that differ in
placements, grad placements, mesh, shape, stride, dtype or requires_grad are
never merged.  Numerics of shared bodies on real collectives:
test_gloo_compiled.py (loop3) and test_reuse_gloo below.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.graphs import Recorder

from helpers import WORLD_SIZE, ensure_fake_pg, mesh_1d

INVOKE = torch.ops.higher_order.invoke_subgraph


def _layer(x, w):
    return torch.tanh(x @ w) + x


def _shared_calls(gm):
    """(number of invoke_subgraph calls, number of distinct subgraph modules) of the root graph."""
    calls = [n for n in gm.graph.nodes if n.target is INVOKE]
    mods = {id(getattr(gm, n.args[0].target)) for n in calls}
    return len(calls), len(mods)


def _compile(fn, *inputs, fullgraph=True, inner="aot_eager"):
    # outlined shared bodies are what these tests count (Note: [Outline or
    # inline, decided once] in localmap_fx.compiler.pipeline)
    rec = Recorder(inner, share_layers=False)
    out = torch.compile(fn, backend=rec.backend, fullgraph=fullgraph)(*inputs)
    return rec, out


def _dt(shape, placements, seed=0, grad=True, dtype=torch.float32, mesh=None):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return distribute_tensor(t, mesh or mesh_1d(), placements).requires_grad_(grad)


LAYER = localmap_fx.local_map(_layer, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]))


def _stack(x, *ws):
    for w in ws:
        x = LAYER(x, w)
    return x.redistribute(x.device_mesh, [Replicate()]).sum()


def _stack_inputs(n=6):
    return [_dt((8, 8), [Shard(0)])] + [_dt((8, 8), [Replicate()], seed=k + 1) for k in range(n)]


def test_repeated_calls_trace_one_shared_body():
    rec, loss = _compile(_stack, *_stack_inputs(6))
    captured = rec.stage("captured")
    # call 1 is the inline probe; calls 2..6 run one traced subgraph
    assert _shared_calls(captured) == (5, 1)
    regions = localmap_fx.find_regions(captured)
    assert len(regions) == 6 and all(r.spec.func == "_layer" for r in regions)
    # the backend outlines all six onto one submodule, as before reuse
    final = rec.stage("fuse_boundaries")
    assert _shared_calls(final) == (6, 1)
    assert all(r.outlined for r in localmap_fx.find_regions(final))
    loss.backward()


def test_reuse_switch_restores_and_recompiles():
    inputs = _stack_inputs(4)
    with localmap_fx.region_reuse(False):
        rec, off = _compile(_stack, *inputs)
        assert _shared_calls(rec.stage("captured")) == (0, 0)
        with localmap_fx.region_reuse(True):
            rec_on, on = _compile(_stack, *inputs)
        assert _shared_calls(rec_on.stage("captured")) == (3, 1)
    from localmap_fx.capture import reuse

    assert reuse.reuse_enabled()  # default on, restored
    # one compiled function, switch flipped between calls: Dynamo recompiles
    rec = Recorder("aot_eager")
    f = torch.compile(_stack, backend=rec.backend, fullgraph=True)
    f(*inputs)
    with localmap_fx.region_reuse(False):
        f(*inputs)
    assert [_shared_calls(g)[0] for g in rec.stages["captured"]] == [3, 0]


def test_outline_false_inlines_shared_bodies():
    rec = Recorder("aot_eager", outline=False)
    torch.compile(_stack, backend=rec.backend, fullgraph=True)(*_stack_inputs(4))
    final = rec.stage("fuse_boundaries")
    assert _shared_calls(final) == (0, 0)
    regions = localmap_fx.find_regions(final)
    assert len(regions) == 4 and not any(r.outlined for r in regions)
    assert all(len(r.body_nodes) == 3 for r in regions)  # matmul, tanh, add


# --- calls that differ in one property are never merged ----------------------------


def _mesh_ep():
    ensure_fake_pg()
    return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("ep",))


def _variant(kind):
    """Two local_maps A, B and inputs (a, wa), (b, wb) with equal local code and,
    except for ``kind``, equal everything; B differs from A in ``kind``."""
    x_pl, w_pl = [Shard(0)], [Replicate()]
    a, wa = _dt((8, 8), x_pl), _dt((8, 8), w_pl, 1)
    b, wb = _dt((8, 8), x_pl, 2), _dt((8, 8), w_pl, 3)
    kw_a = dict(out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]))
    kw_b = dict(kw_a)
    if kind == "placements":
        kw_b["out_placements"] = [Partial()]  # same local shapes, other meaning
    elif kind == "grad_placements":
        kw_b["in_grad_placements"] = ([Shard(0)], [Partial()])
    elif kind == "mesh":
        mesh = _mesh_ep()
        b, wb = _dt((8, 8), x_pl, 2, mesh=mesh), _dt((8, 8), w_pl, 3, mesh=mesh)
    elif kind == "shape":
        b, wb = _dt((16, 8), x_pl, 2), _dt((8, 8), w_pl, 3)
    elif kind == "stride":
        wb = _dt((8, 8), w_pl, 3).detach().t().requires_grad_()  # local stride (1, 8)
    elif kind == "dtype":
        b, wb = _dt((8, 8), x_pl, 2, dtype=torch.float64), _dt((8, 8), w_pl, 3, dtype=torch.float64)
    elif kind == "requires_grad":
        wb = _dt((8, 8), w_pl, 3, grad=False)
    else:
        raise AssertionError(kind)
    A = localmap_fx.local_map(_layer, **kw_a)
    B = localmap_fx.local_map(_layer, **kw_b)
    return A, B, (a, wa, b, wb)


KINDS = ["placements", "grad_placements", "mesh", "shape", "stride", "dtype", "requires_grad"]


@pytest.mark.parametrize("kind", KINDS)
def test_calls_differing_in_one_property_are_not_merged(kind):
    A, B, inputs = _variant(kind)

    def fn(a, wa, b, wb):
        # three calls each (Dynamo inlines a subgraph used only once)
        return [A(a, wa) for _ in range(3)], [B(b, wb) for _ in range(3)]

    rec, (ya, yb) = _compile(fn, *inputs)
    captured = rec.stage("captured")
    calls = [n for n in captured.graph.nodes if n.target is INVOKE]
    # calls 2 and 3 of A share one traced body, calls 2 and 3 of B another
    mods = [getattr(captured, n.args[0].target) for n in calls]
    assert len(mods) == 4
    assert mods[0] is mods[1] and mods[2] is mods[3] and mods[0] is not mods[2]
    # each call keeps its own call-site spec (not the first call's)
    regions = localmap_fx.find_regions(captured)
    assert len(regions) == 6
    if kind == "placements":
        assert [r.spec.out_placements for r in regions] == [((Shard(0),),)] * 3 + [((Partial(),),)] * 3
        assert yb[2].placements == (Partial(),)
    if kind == "grad_placements":
        assert [r.spec.in_grad_placements is None for r in regions] == [True] * 3 + [False] * 3
    if kind == "mesh":
        assert [r.spec.mesh_dim_names for r in regions] == [("tp",)] * 3 + [("ep",)] * 3
    final = localmap_fx.find_regions(rec.stage("fuse_boundaries"))
    assert len(final) == 6 and all(r.outlined for r in final)


def test_torch_reuse_alone_would_merge_differing_placements():
    """Why the key matters: torch's own reuse (one function, same local
    metadata) stamps out one subgraph for calls whose placements differ."""

    @torch.compiler.nested_compile_region
    def body(x, w):
        return torch.tanh(x @ w) + x

    def fn(a, wa, b, wb):
        la, lb = a.to_local(), b.to_local()
        return [body(la, wa.to_local()) for _ in range(2)], [body(lb, wb.to_local()) for _ in range(2)]

    _, _, inputs = _variant("placements")
    rec, _ = _compile(fn, *inputs)
    assert _shared_calls(rec.stage("captured"))[1] == 1


# --- where reuse cannot be used, calls run inline (no new error) --------------------


def test_tied_inputs_fall_back_inline():
    body = localmap_fx.local_map(lambda a, b: a * b + 1, out_placements=[Shard(0)],
                                 in_placements=([Shard(0)], [Shard(0)]))

    def fn(x, y):
        h = body(y, x)          # probe: proves the body safe
        h = body(h, x)
        h = body(h, y)
        return body(x, x)       # tied: same key, but its arguments share storage

    x, y = _dt((8, 8), [Shard(0)]), _dt((8, 8), [Shard(0)], 1)
    rec, out = _compile(fn, x, y)
    assert _shared_calls(rec.stage("captured")) == (2, 1)  # calls 2 and 3, not the tied one
    assert torch.equal(out.to_local(), x.to_local() * x.to_local() + 1)


@pytest.mark.parametrize("body", [lambda a: a, lambda a: a.view(-1), lambda a: (a * 2, a)],
                         ids=["input", "view", "tuple_with_input"])
def test_body_returning_input_or_view_runs_inline(body):
    outs = [Shard(0)] if not isinstance(body(torch.ones(1)), tuple) else ([Shard(0)], [Shard(0)])
    lm = localmap_fx.local_map(body, out_placements=outs, in_placements=([Shard(0)],))

    def fn(x):
        for _ in range(3):
            y = lm(x)
            y = y[0] if isinstance(y, tuple) else y
        return y

    rec, out = _compile(fn, _dt((8, 8), [Shard(0)]))
    assert _shared_calls(rec.stage("captured")) == (0, 0)
    assert len(localmap_fx.find_regions(rec.stage("captured"))) == 3


def test_mutating_body_runs_inline():
    lm = localmap_fx.local_map(lambda a, b: b.add_(1) * a, out_placements=[Shard(0)],
                               in_placements=([Shard(0)], [Shard(0)]))

    def fn(x, w):
        return lm(lm(x, w), w)

    x, w = _dt((8, 8), [Shard(0)], grad=False), _dt((8, 8), [Shard(0)], 1, grad=False)
    w0 = w.to_local().clone()
    rec, out = _compile(fn, x, w)
    assert _shared_calls(rec.stage("captured")) == (0, 0)
    assert torch.allclose(w.to_local(), w0 + 2)


def test_graph_break_inside_a_repeated_body():
    def body(a):
        torch._dynamo.graph_break()
        return a.sin()

    lm = localmap_fx.local_map(body, out_placements=[Shard(0)], in_placements=([Shard(0)],))

    def fn(x):
        return lm(lm(lm(x)))

    x = _dt((8, 8), [Shard(0)])
    rec, out = _compile(fn, x, fullgraph=False)
    assert all(_shared_calls(g) == (0, 0) for g in rec.stages["captured"])
    assert torch.allclose(out.to_local(), x.to_local().sin().sin().sin())


def test_closure_over_a_tensor_is_shared_with_the_captured_value():
    bias = torch.full((8,), 0.5, requires_grad=True)
    lm = localmap_fx.local_map(lambda a, w: a @ w + bias, out_placements=[Shard(0)],
                               in_placements=([Shard(0)], [Replicate()]))

    def fn(x, w):
        return lm(lm(lm(x, w), w), w)

    x, w = _dt((8, 8), [Shard(0)]), _dt((8, 8), [Replicate()], 1)
    rec, out = _compile(fn, x, w)
    assert _shared_calls(rec.stage("captured")) == (2, 1)
    regions = localmap_fx.find_regions(rec.stage("captured"))
    assert [i.kind for i in regions[2].inputs] == ["arg", "arg", "captured"]
    out.to_local().sum().backward()
    assert bias.grad is not None
