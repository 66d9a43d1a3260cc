"""Planning a captured call in real Python (localmap_fx.capture.plan).

The planned path must build exactly the graph the traced path builds, raise
the same errors, and step aside (to the traced path) for every call it does
not plan.  ``_traced_only`` switches planning off by making the comptime
planner hand over ``None``, which is what it does for an unplanned call.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.capture import plan as capture_plan
from localmap_fx.testing.graphs import Recorder, normalized
from localmap_fx.testing.models import MODELS, grad_tensors

from helpers import mesh_1d, mesh_for


@contextlib.contextmanager
def _traced_only():
    with mock.patch("localmap_fx.capture.call.plan_call", lambda ctx: capture_plan._put(None)):
        yield


@contextlib.contextmanager
def _counting():
    """Counts calls planned end to end (inputs and outputs)."""
    calls = []
    real = capture_plan.output_shapes

    def counted(*args):
        calls.append(args)
        return real(*args)

    with mock.patch.object(capture_plan, "output_shapes", counted):
        yield calls


def _run(model_name: str):
    torch._dynamo.reset()
    m = MODELS[model_name]
    state = m.build(mesh_for(m.mesh_ndim), 0)
    rec = Recorder("aot_eager")
    loss = torch.compile(m.step, backend=rec.backend, fullgraph=True)(state)
    loss.backward()
    grads = {k: t.grad.full_tensor() for k, t in grad_tensors(state).items()}
    return rec, loss.full_tensor(), grads


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_planned_call_builds_the_traced_graph(model_name):
    with _counting() as planned:
        rec, loss, grads = _run(model_name)
    with _traced_only(), _counting() as planned_when_off:
        rec_t, loss_t, grads_t = _run(model_name)
    assert planned_when_off == []
    if model_name != "spmd":  # spmd_types regions are planned too, but check the count
        assert len(planned) > 0
    for stage in ("captured", "lower_boundaries"):
        assert normalized(rec.stage(stage)) == normalized(rec_t.stage(stage)), stage
    assert torch.equal(loss, loss_t)
    assert grads.keys() == grads_t.keys()
    for k in grads:
        assert torch.equal(grads[k], grads_t[k]), k


def _compile(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, backend=localmap_fx.backend("aot_eager"), fullgraph=True)(*args)


def _x(placements=(Shard(0),)):
    return distribute_tensor(torch.randn(8, 4), mesh_1d(), list(placements))


@pytest.mark.parametrize(
    "case",
    ["nested_placements", "keyword_argument", "list_output", "int_output", "tensor_in_list"],
)
def test_calls_it_does_not_plan_take_the_traced_path(case):
    mesh = mesh_1d()
    S0 = [Shard(0)]
    if case == "nested_placements":
        lm = localmap_fx.local_map(lambda xs: xs[0] + xs[1], S0, ((S0, S0),), device_mesh=mesh)
        fn = lambda x: lm((x, x))  # noqa: E731
    elif case == "keyword_argument":
        lm = localmap_fx.local_map(lambda x, *, k: x * k, S0, (S0,), device_mesh=mesh)
        fn = lambda x: lm(x, k=2.0)  # noqa: E731
    elif case == "list_output":
        lm = localmap_fx.local_map(lambda x: [x + 1, x * 2], (S0, S0), (S0,), device_mesh=mesh)
        fn = lambda x: lm(x)[1]  # noqa: E731
    elif case == "int_output":
        lm = localmap_fx.local_map(lambda x: (x * 2, 3), (S0, None), (S0,), device_mesh=mesh)
        fn = lambda x: lm(x)[0] * lm(x)[1]  # noqa: E731
    else:
        lm = localmap_fx.local_map(lambda xs: xs[0] * 2, S0, (S0,), device_mesh=mesh)
        fn = lambda x: lm([x])  # noqa: E731
    x = _x()
    expected = fn(x).full_tensor()
    with _counting() as planned:
        got = _compile(fn, x).full_tensor()
    assert planned == []
    assert torch.equal(got, expected)


def test_uneven_output_gets_its_global_shape_on_the_planned_path():
    mesh = mesh_1d()
    lm = localmap_fx.local_map(lambda x: x * 2, [Shard(0)], ([Shard(0)],), device_mesh=mesh)
    x = distribute_tensor(torch.randn(7, 3), mesh, [Shard(0)])
    with _counting() as planned:
        out = _compile(lm, x)
    assert len(planned) == 1
    assert out.shape == (7, 3)
    assert torch.equal(out.full_tensor(), lm(x).full_tensor())


@pytest.mark.parametrize("where", ["inputs", "outputs"])
def test_errors_found_while_planning_match_eager(where):
    mesh = mesh_1d()
    if where == "inputs":
        lm = localmap_fx.local_map(lambda x: x, [Shard(0)], ([Replicate()],), device_mesh=mesh)
    else:
        lm = localmap_fx.local_map(lambda x: (x, x), [Shard(0)], ([Shard(0)],), device_mesh=mesh)
    x = _x()
    with pytest.raises(Exception) as eager:
        lm(x)
    with _counting(), pytest.raises(Exception) as compiled:
        _compile(lm, x)
    error = compiled.value
    # eager's type (compile-time errors subclass it: localmap_fx.errors) and
    # eager's fix hint; the argument is described by kind, not printed
    assert isinstance(error, type(eager.value)), type(error)
    assert eager.value.__notes__[0].startswith("[localmap_fx]")
    assert error.__notes__[0] == eager.value.__notes__[0]
