"""Region IR and passes on hand-built FX graphs (no Dynamo involved).

Each graph is written node by node with the annotations capture would put on
them, so find_regions, lower, fuse_boundaries and outline_regions are tested
on exactly the structure they document.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.lowering import boundary_plan, find_boundaries, lower
from localmap_fx.passes import apply
from localmap_fx.passes.fuse_boundaries import find_round_trips, fuse_boundaries
from localmap_fx.passes.outline_regions import find_outline_matches, outline_regions
from localmap_fx.region import META_INDEX, META_ROLE, META_SPEC, spec_annotation, spec_of

from helpers import mesh_1d

S0, R, P = Shard(0), Replicate(), Partial()


def _ann(func, ins, outs, grads=None):
    return spec_annotation(
        func=func, in_placements=ins, out_specs=outs, in_grad_placements=grads,
        device_mesh=None, redistribute_inputs=False, spmd_types=False,
    )


def _mark(node, ann, role, index=None, value=None):
    custom = {**ann, META_ROLE: role}
    if index is not None:
        custom[META_INDEX] = index
    node.meta["custom"] = custom
    if value is not None:
        node.meta["example_value"] = value


def _body_sin(a):
    return a.sin()


def _body_scale(a, w):
    return a * w


def _region(g, x, mesh, dt_in, ann, body_fn, out_placements, extra=None):
    """to_local -> body ops -> from_local, annotated as capture does."""
    local = g.call_method("to_local", (x,))
    _mark(local, ann, "enter", 0, dt_in.to_local())
    args = [local] + ([extra] if extra is not None else [])
    body = g.call_function(torch.sin if extra is None else operator.mul, tuple(args))
    local_out = body_fn(*[dt_in.to_local()] + ([extra.meta["example_value"]] if extra is not None else []))
    _mark(body, ann, "body", value=local_out)
    out = g.call_function(DTensor.from_local, (body, mesh, list(out_placements)), {"run_check": False})
    _mark(out, ann, "exit", 0, DTensor.from_local(local_out, dt_in.device_mesh, out_placements, run_check=False))
    return out


def _placeholders(g: fx.Graph, dt: DTensor, w: torch.Tensor) -> tuple:
    """The inputs of a region graph: ``x`` (the DTensor ``dt``), the mesh, ``w``."""
    x = g.placeholder("x")
    x.meta["example_value"] = dt
    m = g.placeholder("mesh")
    wn = g.placeholder("w")
    wn.meta["example_value"] = w
    return x, m, wn


def _two_region_graph():
    """y = scale(sin_region(x), w): two regions, the first feeding the second."""
    mesh = mesh_1d()
    dt = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [S0])
    w = torch.full((4,), 2.0)
    g = fx.Graph()
    x, m, wn = _placeholders(g, dt, w)
    a1 = _ann(_body_sin, ([S0],), ([S0],))
    y1 = _region(g, x, m, dt, a1, _body_sin, [S0])
    a2 = _ann(_body_scale, ([S0],), ([S0],))
    y2 = _region(g, y1, m, y1.meta["example_value"], a2, _body_scale, [S0], extra=wn)
    g.output(y2)
    return fx.GraphModule(torch.nn.Module(), g)


def _key_in_this_process() -> str:
    from localmap_fx.testing.models import _col

    return _ann(_col, ((S0,), (R,)), ((P,),))[META_SPEC]


def test_equal_specs_share_one_key_and_the_key_names_the_spec():
    def f(x):
        return x

    key = _ann(f, ((S0,),), ((S0,),))[META_SPEC]
    assert isinstance(key, str) and key.startswith(f.__qualname__ + "@")
    assert _ann(f, ((S0,),), ((S0,),))[META_SPEC] == key
    assert _ann(f, ((S0,),), ((R,),))[META_SPEC] != key
    assert _ann(f, ((S0,),), ((S0,),), grads=((R,),))[META_SPEC] != key
    spec = spec_of(key)
    assert (spec["func"], spec["in"], spec["out"], spec["in_grad"]) == (f.__qualname__, ((S0,),), ((S0,),), None)


def test_a_spec_key_is_the_same_in_a_new_process():
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}];"
        "import test_passes_unit as t; print(t._key_in_this_process())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _key_in_this_process()


def test_an_unknown_spec_key_is_named_in_the_error():
    with pytest.raises(KeyError, match="no local_map spec is registered under 'f@0'"):
        spec_of("f@0")


def test_find_regions_on_hand_built_graph():
    gm = _two_region_graph()
    regions = localmap_fx.find_regions(gm)
    assert [r.spec.func for r in regions] == ["_body_sin", "_body_scale"]
    first, second = regions
    assert [(i.kind, i.index) for i in first.inputs] == [("arg", 0)]
    assert [(i.kind, i.index) for i in second.inputs] == [("arg", 0), ("captured", None)]
    assert second.inputs[1].node.name == "w"
    assert first.spec.in_placements == ((S0,),) and first.spec.mesh_shape == (4,)
    assert not first.outlined and len(first.body_nodes) == 1
    sub = [n.op for n in first.subgraph.graph.nodes]
    assert sub == ["placeholder", "call_function", "output"]


def test_lower_makes_grad_placements_explicit():
    gm = _two_region_graph()
    boundaries = find_boundaries(gm)
    kinds = [(b.kind, b.region, b.index, b.grad_placements) for b in boundaries]
    assert kinds == [
        ("to_local", 0, 0, (S0,)), ("from_local", 0, 0, (S0,)),
        ("to_local", 1, 0, (S0,)), ("from_local", 1, 0, (S0,)),
    ]
    gm = lower(gm)
    to_locals = [n for n in gm.graph.nodes if n.target == "to_local"]
    assert all(n.kwargs == {"grad_placements": (S0,)} for n in to_locals)
    from_locals = [n for n in gm.graph.nodes if n.target is DTensor.from_local]
    assert all(n.kwargs == {"run_check": False, "grad_placements": (S0,)} for n in from_locals)
    assert all(n.args[2] == (S0,) for n in from_locals)


def test_boundary_plan_of_each_region():
    boundaries = find_boundaries(_two_region_graph())
    texts = [boundary_plan([b for b in boundaries if b.region == r]).text() for r in (0, 1)]
    assert texts == [
        "in[0] S(0) grad S(0); out[0] S(0) shape (8, 4) grad S(0)",
        "in[0] S(0) grad S(0); out[0] S(0) shape (8, 4) grad S(0)",
    ]


def test_fuse_finds_and_removes_the_round_trip():
    gm = lower(_two_region_graph())
    (rt,) = find_round_trips(gm)
    assert rt.from_local.target is DTensor.from_local and rt.to_local.target == "to_local"
    gm = apply(fuse_boundaries, gm)
    ops = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert ops == ["to_local", torch.sin, operator.mul, DTensor.from_local]
    assert len(localmap_fx.find_regions(gm)) == 2


def test_fuse_keeps_round_trips_whose_grad_placements_differ():
    gm = lower(_two_region_graph())
    second_to_local = [n for n in gm.graph.nodes if n.target == "to_local"][1]
    second_to_local.kwargs = {"grad_placements": (R,)}
    assert find_round_trips(gm) == []


def test_outline_replaces_each_body_with_invoke_subgraph():
    gm = _two_region_graph()
    matches = find_outline_matches(gm)
    assert [m.skip_reason for m in matches] == [None, None]
    gm = apply(outline_regions, gm)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 2
    regions = localmap_fx.find_regions(gm)
    assert [r.outlined for r in regions] == [True, True]
    assert [r.node for r in regions] == calls
    # the outlined graph still runs and computes the same thing
    dt = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh_1d(), [S0])
    out = gm(dt, mesh_1d(), torch.full((4,), 2.0))
    assert torch.equal(out.to_local(), dt.to_local().sin() * 2)


def _cond_graph():
    """out = cond(p, true: sin_region(x), false: scale_region(x, w)): regions in branches."""
    mesh = mesh_1d()
    dt = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [S0])
    w = torch.full((4,), 2.0)
    branches = []
    for body, extra in ((_body_sin, False), (_body_scale, True)):
        g = fx.Graph()
        x, m, wn = _placeholders(g, dt, w)
        ann = _ann(body, ([S0],), ([S0],))
        g.output((_region(g, x, m, dt, ann, body, [S0], extra=wn if extra else None),))
        branches.append(fx.GraphModule(torch.nn.Module(), g))
    root = torch.nn.Module()
    root.true_graph_0, root.false_graph_0 = branches
    g = fx.Graph()
    p, x, m, wn = (g.placeholder(n) for n in ("p", "x", "mesh", "w"))
    t, f = g.get_attr("true_graph_0"), g.get_attr("false_graph_0")
    c = g.call_function(torch.ops.higher_order.cond, (p, t, f, (x, m, wn)))
    g.output(g.call_function(operator.getitem, (c, 0)))
    return fx.GraphModule(root, g)


def test_regions_in_control_flow_branches_are_found_and_lowered():
    gm = _cond_graph()
    regions = localmap_fx.find_regions(gm)
    assert [(r.spec.func, r.scope) for r in regions] == [
        ("_body_sin", "true_graph_0"), ("_body_scale", "false_graph_0")
    ]
    assert regions[0].owner is gm.true_graph_0
    assert [(i.kind, i.index) for i in regions[1].inputs] == [("arg", 0), ("captured", None)]
    assert [m.skip_reason for m in find_outline_matches(gm)] == [
        "inside the nested subgraph true_graph_0", "inside the nested subgraph false_graph_0"
    ]
    gm = lower(gm)
    for branch in (gm.true_graph_0, gm.false_graph_0):
        (to_local,) = [n for n in branch.graph.nodes if n.target == "to_local"]
        assert to_local.kwargs == {"grad_placements": (S0,)}
        assert "grad_placements" in branch.code  # the submodule was recompiled
