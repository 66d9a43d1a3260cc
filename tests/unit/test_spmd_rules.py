"""The functional-collective typing rules (localmap_fx.spmd.rules), one by one.

Collectives run on the fake process group (no data moves): only the types
matter here.  The numbers behind each rule are checked in
``test_spmd_bodies.py`` (LocalTensorMode) and ``test_spmd_gloo.py`` (gloo).
"""

from __future__ import annotations

import pathlib

import pytest
import spmd_types as spmd
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.spmd import types as lspmd
from localmap_fx.spmd.rules import RULES, axis_of_group, rule_for, rules_table_markdown

from helpers import mesh_1d, mesh_2d

R, I, V, P = spmd.R, spmd.I, spmd.V, spmd.P
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def _axis(mesh, dim=0):
    return spmd.MeshAxis.of(mesh.get_group(dim))


# --- groups -> mesh axes -----------------------------------------------------------


def test_axis_of_every_group_form():
    m1, m2 = mesh_1d(), mesh_2d()
    tp = _axis(m1)
    assert axis_of_group(m1) == tp
    assert axis_of_group((m1, 0)) == tp
    assert axis_of_group(m1.get_group(0)) == tp
    assert axis_of_group(m1.get_group(0).group_name) == tp
    assert axis_of_group(tp) is tp
    assert axis_of_group((m2, 1)) == _axis(m2, 1)
    assert axis_of_group(m2["dp"]) == _axis(m2, 0)
    assert axis_of_group(m2.get_group(1).group_name) == _axis(m2, 1)
    with pytest.raises(ValueError, match="2-D DeviceMesh names no single mesh dimension"):
        axis_of_group(m2)
    with pytest.raises(ValueError, match=r"pass a mesh dimension, as \(mesh, dim\)"):
        axis_of_group([0, 1, 2, 3])


def test_rule_lookup():
    assert rule_for("all_reduce", "SUM").accepts == ((P, R), (V, R))
    assert rule_for("all_reduce", "avg").backward is not None
    assert rule_for("all_reduce", "max").backward is None
    assert rule_for("all_reduce", "premul_sum").linear is False
    assert rule_for("all_gather_into_tensor", None).accepts == ((V, R),)
    assert rule_for("send", None) is None


def test_typed_in_grad_placements():
    S0 = Shard(0)
    f = lspmd.typed_in_grad_placements
    assert f((Replicate(),)) == (Partial(),)
    assert f((S0,)) is None and f((Partial(),)) is None
    assert f((S0, Replicate())) == (S0, Partial())
    assert f((Partial(), Replicate())) == (Replicate(), Partial())


def test_docs_list_the_rule_table():
    assert rules_table_markdown() in DOCS.read_text()


# --- every row x every input type ----------------------------------------------------

_CALLS = {
    "all_reduce": lambda x, op, m: funcol.all_reduce(x, op, m),
    "all_gather_into_tensor": lambda x, op, m: funcol.all_gather_tensor(x, 0, m),
    "reduce_scatter_tensor": lambda x, op, m: funcol.reduce_scatter_tensor(x, op, 0, m),
    "all_to_all_single": lambda x, op, m: funcol.all_to_all_single(x, None, None, m),
    "broadcast": lambda x, op, m: funcol.broadcast(x, 0, m),
    "all_reduce_coalesced": lambda x, op, m: funcol.all_reduce_coalesced([x], op, m)[0],
    "all_gather_into_tensor_coalesced": lambda x, op, m: funcol.all_gather_into_tensor_coalesced(
        [x], m
    )[0],
    "reduce_scatter_tensor_coalesced": lambda x, op, m: funcol.reduce_scatter_tensor_coalesced(
        [x], op, [0], m
    )[0],
}


def _rows():
    for rule in RULES:
        for op in rule.reduce_ops or (None,):
            op = "max" if op == "*" else op
            for t in (R, I, V, P):
                for grad in (False, True):
                    name = f"{rule.op}-{op}-{t.name}-grad{int(grad)}"
                    yield pytest.param(rule, op, t, grad, id=name)


@pytest.mark.usefixtures("waited_collectives")
@pytest.mark.parametrize("rule,op,t,grad", list(_rows()))
def test_rule_row(rule, op, t, grad):
    mesh = mesh_1d()
    x = torch.randn(8, 4, requires_grad=grad)
    spmd.assert_type(x, {_axis(mesh): t})
    expected = rule.output_type(t)
    if grad and rule.backward is None:
        expected = None
    try:
        with lspmd.checking(mesh):
            y = _CALLS[rule.op](x, op, mesh)
    except spmd.SpmdTypeError as e:
        assert expected is None, f"rejected: {e}"
        assert rule.text in str(e)
        return
    assert expected is not None, "accepted"
    assert spmd.get_local_type(y) == {_axis(mesh): expected}


# --- other axes, flattened groups, bad groups, unknown ops -------------------------


@pytest.mark.usefixtures("waited_collectives")
def test_other_axes_keep_their_type():
    m = mesh_2d()
    dp, tp = _axis(m, 0), _axis(m, 1)
    x = torch.randn(8, 4, requires_grad=True)
    spmd.assert_type(x, {dp: P, tp: V})
    with lspmd.checking(m):
        y = funcol.all_reduce(x, "sum", (m, 1))
    assert spmd.get_local_type(y) == {dp: P, tp: R}


@pytest.mark.usefixtures("waited_collectives")
def test_collective_over_the_whole_2d_mesh_reduces_both_axes():
    m = mesh_2d()
    dp, tp = _axis(m, 0), _axis(m, 1)
    x = torch.randn(8, 4, requires_grad=True)
    spmd.assert_type(x, {dp: P, tp: V})
    with lspmd.checking(m):
        y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    assert spmd.get_local_type(y) == {dp: R, tp: R}


def test_non_linear_reduction_refuses_partial_on_another_axis():
    m = mesh_2d()
    x = torch.randn(8, 4)
    spmd.assert_type(x, {_axis(m, 0): P, _axis(m, 1): V})
    with pytest.raises(spmd.SpmdTypeError, match="is not linear"), lspmd.checking(m):
        funcol.all_reduce(x, "max", (m, 1))


def test_group_that_is_not_a_mesh_dimension():
    mesh = mesh_1d()
    sub = dist.new_group([0, 1])
    x = torch.randn(8, 4)
    spmd.assert_type(x, {_axis(mesh): P})
    with pytest.raises(spmd.SpmdTypeError, match="no SPMD type on the collective's axis"):
        with lspmd.checking(mesh):
            funcol.all_reduce(x, "sum", sub)


def test_untyped_input():
    mesh = mesh_1d()
    with pytest.raises(spmd.SpmdTypeError, match="the input has no SPMD type"):
        with lspmd.checking(mesh):
            funcol.all_reduce(torch.randn(4), "sum", mesh)


def test_functional_collective_without_a_rule():
    mesh = mesh_1d()
    x = torch.randn(8, 4)
    spmd.assert_type(x, {_axis(mesh): P})
    with pytest.raises(spmd.SpmdTypeError, match="no SPMD typing rule"), lspmd.checking(mesh):
        torch.ops._c10d_functional.all_reduce_(x, "sum", mesh.get_group(0).group_name)


@pytest.mark.usefixtures("waited_collectives")
def test_outside_checking_nothing_is_typed():
    mesh = mesh_1d()
    x = torch.randn(8, 4)
    y = funcol.all_reduce(x, "sum", mesh)
    assert not spmd.has_local_type(y)
    with lspmd.checking(mesh), spmd.no_typecheck():
        z = funcol.all_reduce(x, "sum", mesh)
    assert not spmd.has_local_type(z)


# --- the backend's typecheck option and grad mode at compile time -------------------


_OUT_R = (Replicate(),)
_INS_S1_S0 = ((Shard(1),), (Shard(0),))


def _region(body, spmd_types=True, out=_OUT_R, ins=_INS_S1_S0):
    """``body(mesh)`` is the local function (the mesh is looked up outside it)."""
    return localmap_fx.local_map(
        body(mesh_1d()), out_placements=list(out), in_placements=tuple(list(i) for i in ins),
        device_mesh=mesh_1d(), spmd_types=spmd_types,
    )


def _reduced(m):
    return lambda x, w: funcol.all_reduce(x @ w, "sum", m)


def _reduced_twice(m):
    return lambda x, w: funcol.all_reduce(funcol.all_reduce(x @ w, "sum", m), "sum", m)


def _xw():
    mesh = mesh_1d()
    x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]).requires_grad_()
    return x, w


def _compile(fn, **opts):
    return torch.compile(
        lambda a, b: fn(a, b), backend=localmap_fx.backend("aot_eager", outline=False, **opts),
        fullgraph=True,
    )


@pytest.mark.parametrize(
    "typecheck,spmd_types,raises",
    [
        ("regions", True, True),
        ("regions", False, False),
        ("all", False, True),
        ("all", True, True),
        ("off", True, False),
    ],
)
def test_backend_typecheck_option(typecheck, spmd_types, raises):
    fn = _region(_reduced_twice, spmd_types=spmd_types)
    compiled = _compile(fn, typecheck=typecheck)
    if raises:
        with pytest.raises(spmd.SpmdTypeError, match="already the same on every rank"):
            compiled(*_xw())
    else:
        assert compiled(*_xw()).placements == (Replicate(),)


def test_grads_derived_at_compile_time_for_funcol_outputs():
    """R output -> Partial grad; typecheck='off' keeps DTensor's Replicate."""
    from localmap_fx.region import META_LOWERED

    for typecheck, want in (("regions", (Partial(),)), ("off", (Replicate(),))):
        seen = {}

        def on_stage(name, gm, seen=seen):
            seen[name] = [
                n.kwargs["grad_placements"]
                for n in gm.graph.nodes
                if n.meta.get(META_LOWERED) and "run_check" in n.kwargs
            ]

        fn = _region(_reduced)
        torch.compile(
            lambda a, b: fn(a, b),  # noqa: B023 - compiled and run in this iteration
            backend=localmap_fx.backend(
                "aot_eager", outline=False, typecheck=typecheck, on_stage=on_stage
            ),
            fullgraph=True,
        )(*_xw())
        torch._dynamo.reset()
        assert list(seen.values())[-1] == [want], (typecheck, seen)


def _max_body(m):
    return lambda x: funcol.all_reduce(x, "max", m)


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_decides_like_eager(grad):
    """all_reduce(max) has no gradient: refused iff its input needs one, in
    eager and at compile time alike (Dynamo compiles per grad mode)."""
    fn = _region(_max_body, ins=((Shard(0),),))
    x = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Shard(0)]).requires_grad_()
    compiled = torch.compile(
        fn, backend=localmap_fx.backend("aot_eager", outline=False), fullgraph=True
    )
    for run in (fn, compiled):
        with torch.set_grad_enabled(grad):
            if grad:
                with pytest.raises(spmd.SpmdTypeError, match="no correct gradient"):
                    run(x)
            else:
                assert run(x).placements == (Replicate(),)


def test_compiled_forward_has_no_checking_work():
    """The AOT forward graph of a checked funcol region is that of the same
    region compiled with spmd_types=False (the backward differs: it gets the
    grad placements the types give)."""
    import re

    from localmap_fx.testing.graphs import Recorder

    def forward_text(spmd_types):
        rec = Recorder("aot_eager")
        fn = _region(_reduced, spmd_types=spmd_types)
        torch.compile(lambda a, b: fn(a, b).to_local().sum(), backend=rec.backend, fullgraph=True)(
            *_xw()
        ).backward()
        torch._dynamo.reset()
        g = rec.aot["forward"][0]
        t = g.print_readable(print_output=False, include_stride=False, include_device=False)
        lines = [ln for ln in t.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return [re.sub(r"\s*#.*", "", ln) for ln in lines]

    assert forward_text(True) == forward_text(False)
