"""The last layer's gradient arrives whole (Note: [The last layer's gradient
arrives whole] in :mod:`localmap_fx.layer_sharing.whole_gradients`).

A split frame (marked blocks, or ``share_layers=True``) used to divide the
loss's Replicate gradient into its Partial form in the tail and sum it back
in the shared layer's compiled backward: one all_reduce per step more than
eager.  Finding and rewriting are checked on hand-built outer graphs; the
compiled stacks on the fake group, where a collective returns its input, so
a division that no all_reduce undoes shows in the values: every split frame
now equals eager there (aot_eager bitwise), and issues eager's collectives.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

import localmap_fx
from localmap_fx._torch_compat import dtensor_from_local
from localmap_fx.layer_sharing.split import META_PIECE, PieceMeta
from localmap_fx.layer_sharing.whole_gradients import (
    META_WHOLE,
    WholeGradient,
    apply_whole_gradients,
    convert_unheld,
    find_whole_gradients,
    partial_gradient,
)
from localmap_fx.passes import apply
from localmap_fx.testing.graphs import Recorder

from helpers import WORLD_SIZE, mesh_1d, waiting_collectives

# --- finding and rewriting, on hand-built outer graphs -------------------------------

def _outer(grad_placements=(Partial(),), tail_reads_twice=False, output_used_twice=False) -> fx.GraphModule:
    """``(h,) = piece_0(x)`` (a layer, key K); ``piece_1(h, mesh)``: the tail,
    ``from_local(in0, in1, (Replicate(),), grad_placements=...)``."""
    mesh = mesh_1d()
    tail = fx.Graph()
    a, m = tail.placeholder("in0"), tail.placeholder("in1")
    dt = tail.call_function(dtensor_from_local, (a, m, (Replicate(),)),
                            {"run_check": False, "grad_placements": grad_placements})
    out = tail.call_method("sum", (dt,))
    if tail_reads_twice:
        out = tail.call_function(operator.add, (out, tail.call_method("sum", (a,))))
    tail.output((out,))
    layer = fx.Graph()
    x = layer.placeholder("in0")
    layer.output((layer.call_function(torch.tanh, (x,)),))

    root = torch.nn.Module()
    root.piece_0 = fx.GraphModule(torch.nn.Module(), layer)
    root.piece_1 = fx.GraphModule(torch.nn.Module(), tail)
    g = fx.Graph()
    x, mesh_in = g.placeholder("x"), g.placeholder("mesh")
    x.meta["example_value"] = torch.randn(4)
    mesh_in.meta["example_value"] = mesh
    call = g.call_module("piece_0", (x,))
    call.meta[META_PIECE] = PieceMeta("piece_0", 0, ("K",), None)
    h = g.call_function(operator.getitem, (call, 0))
    reader = g.call_module("piece_1", (h, mesh_in))
    reader.meta[META_PIECE] = PieceMeta("piece_1", None, None, "tail")
    outs = [g.call_function(operator.getitem, (reader, 0))]
    if output_used_twice:
        outs.append(h)
    g.output(tuple(outs))
    return fx.GraphModule(root, g)


def test_the_tails_from_local_asking_for_a_partial_gradient_is_found():
    plan = find_whole_gradients(_outer())
    (step,) = plan.steps
    group = mesh_1d().get_group(0)
    assert step.gradient == WholeGradient(group.group_name, WORLD_SIZE)
    assert plan.text() == (f"getitem -> piece_1.from_local: grad_placements (Replicate(),), gradient arrives whole "
                           f"over group {group.group_name} (the Partial form is g / {WORLD_SIZE})")


@pytest.mark.parametrize("case", ["replicate_grad", "avg", "tail_reads_twice", "output_used_twice"])
def test_nothing_is_found_where_the_gradient_is_not_one_partial_division(case):
    outer = {
        "replicate_grad": lambda: _outer(grad_placements=(Replicate(),)),
        "avg": lambda: _outer(grad_placements=(Partial("avg"),)),
        "tail_reads_twice": lambda: _outer(tail_reads_twice=True),
        "output_used_twice": lambda: _outer(output_used_twice=True),
    }[case]()
    plan = find_whole_gradients(outer)
    assert plan.steps == ()
    assert plan.text() == "no layer output's gradient can arrive whole"


def test_the_rewrite_asks_for_the_whole_gradient_and_records_it_on_the_output():
    outer = _outer()
    plan = find_whole_gradients(outer)
    outer = apply(lambda g: apply_whole_gradients(g, plan), outer)
    (fl,) = [n for n in outer.piece_1.graph.nodes if n.op == "call_function"]
    assert fl.kwargs["grad_placements"] == (Replicate(),)
    assert "grad_placements = (torch.distributed.tensor.placement_types.Replicate(),)" in outer.piece_1.code
    (h,) = [n for n in outer.graph.nodes if META_WHOLE in n.meta]
    assert h.meta[META_WHOLE] == plan.steps[0].gradient


def test_an_unheld_whole_gradient_is_divided_by_the_outer_graph():
    outer = _outer()
    plan = find_whole_gradients(outer)
    outer = apply(lambda g: apply_whole_gradients(g, plan), outer)
    (h,) = [n for n in outer.graph.nodes if META_WHOLE in n.meta]
    outer = apply(lambda g: convert_unheld(g, [h]), outer)
    assert META_WHOLE not in h.meta
    (conv,) = [n for n in outer.graph.nodes if n.target is partial_gradient]
    assert conv.args == (h, WORLD_SIZE) and list(h.users) == [conv]
    # the conversion: the identity forward, DTensor's Replicate -> Partial division backward
    x = torch.arange(4.0, requires_grad=True)
    y = partial_gradient(x, 4)
    assert torch.equal(y, x) and y is not x
    y.backward(torch.full((4,), 2.0))
    assert torch.equal(x.grad, torch.full((4,), 0.5))


# --- compiled stacks on the fake group --------------------------------------------------

def _stack(n, marked):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    return TPStack(mesh, n, d=16, hidden=32, marked=marked), tp_stack_input(mesh, 8, 16)


def _values(loss, model, x):
    return [t.to_local() for t in [loss, x.grad, *(p.grad for p in model.parameters())]]


def _run(model, x, backend=None):
    f = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    loss = f(x)
    with waiting_collectives() as issued:
        loss.backward()
    return _values(loss, model, x), [n for n in issued if not n.startswith("_")]  # not _wrap_tensor_autograd


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "share_layers"])
def test_a_split_stack_equals_eager_and_issues_its_collectives(inner, marked):
    torch._dynamo.reset()
    model, x = _stack(3, marked)
    want, want_bw = _run(model, x)
    model, x = _stack(3, marked)
    rec = Recorder(inner, share_layers=True)
    got, got_bw = _run(model, x, rec.backend)
    assert "split_layers" in rec.stages
    assert want_bw == got_bw == ["all_reduce.default"] * 2  # L - 1 backward all_reduces: the last layer's gradient arrives whole
    for a, b in zip(want, got):
        if inner == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # the layer's backward reads its tangent's sum as an input; the tail no longer divides
    (layer_bw, *_) = [g for g in rec.aot["backward"] if any(
        n.name.startswith("reduced_tangents") for n in g.graph.find_nodes(op="placeholder"))]
    assert not any("all_reduce" in str(n.target) for n in layer_bw.graph.nodes)
    assert not any(n.target is torch.ops.aten.div.Tensor for g in rec.aot["backward"] for n in g.graph.nodes)


def _refusing_every_layer():
    """Every shared layer refused, as AOTAutograd's runtime would run it."""
    from unittest import mock

    import localmap_fx.layer_sharing.compile as compile_mod
    from localmap_fx.layer_sharing.runtime import Refusal, Refused

    return mock.patch.object(compile_mod, "compiled_layer",
                             lambda *a, **k: Refusal(Refused.NO_METADATA, "refused by the test"))


def test_a_layer_the_run_cannot_hold_is_compiled_with_its_reductions_and_divided_outside():
    """Structure on the fake group (a division no all_reduce undoes shows in
    the values there, as before this change: numerics on gloo below): the layer
    is compiled again without its reductions taken out, and the outer graph
    divides the whole gradient before the layer's backward sums it back."""
    torch._dynamo.reset()
    model, x = _stack(3, True)
    rec = Recorder("aot_eager", share_layers=True)
    with _refusing_every_layer():
        _, got_bw = _run(model, x, rec.backend)
    assert got_bw == ["all_reduce.default"] * 3
    outer = rec.stage("layer_runs")
    assert [n.args[1] for n in outer.graph.nodes if n.target is partial_gradient] == [WORLD_SIZE]
    layer = next(m.piece for name, m in outer.named_children() if hasattr(m, "piece") and m.piece.aot_graphs)
    (bw,) = [g.graph for g in layer.aot_graphs if g.kind == "backward"]
    assert not any(n.name.startswith("reduced_tangents") for n in bw.graph.find_nodes(op="placeholder"))
    assert any("all_reduce" in str(n.target) for n in bw.graph.nodes)


def _gloo_refused_vs_eager(rank, world_size, device):
    from torch.distributed.device_mesh import init_device_mesh

    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, x = TPStack(mesh, 3, d=16, hidden=32, marked=True), tp_stack_input(mesh, 8, 16)
        with _refusing_every_layer():
            f = torch.compile(model, backend=localmap_fx.backend("aot_eager"), fullgraph=True) if compiled else model
            loss = f(x)
            loss.backward()
        out.append([t.full_tensor() for t in (loss, x.grad, *(p.grad for p in model.parameters()))])
    return [bool(torch.equal(a, b)) for a, b in zip(*out)]


@pytest.mark.slow
def test_a_layer_the_run_cannot_hold_keeps_eagers_gradients_on_gloo():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_gloo_refused_vs_eager, world_size=2, timeout=600)
    assert results == [[True] * 8] * 2, results
