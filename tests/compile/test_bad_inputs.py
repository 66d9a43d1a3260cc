"""Bad calls: a clear error naming the argument and the fix, eager and compiled.

For every case the eager error must:
  * where torch 2.14.1's local_map raises at the call: have torch's type and
    contain torch's text (we only append);
  * where torch accepts the call silently (or fails later, in backward): be
    raised at the call (these are the documented deviations);
  * name the argument (``in_placements[i]``, ``out_placements[j]``, ...) and
    say how to fix it (a ``[localmap_fx]`` hint, an exception note).
Under ``torch.compile(fullgraph=True)`` the same call raises an instance of
the eager type naming the same argument (not a Dynamo internal error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map as torch_local_map

import localmap_fx

from helpers import full_text, mesh_1d, mesh_2d

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@dataclasses.dataclass
class Case:
    name: str
    kwargs: dict  # local_map arguments (body given separately)
    args: Callable[[], tuple]
    names: str  # text the message must contain (the argument)
    body: Callable = lambda *a: a[0] * 2
    torch_raises: bool = True  # False: torch is silent here (a deviation)


def _t(*shape):
    # the same values on every call: messages print them (torch's DTensor repr)
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def x1(placements=(S0,), shape=(8, 4)):
    return lambda: (distribute_tensor(_t(*shape), mesh_1d(), list(placements)),)


def x2(placements=(S0, R)):
    return lambda: (distribute_tensor(_t(8, 4), mesh_2d(), list(placements)),)


def pair(p0=(S0,), p1=(R,)):
    return lambda: (
        distribute_tensor(_t(8, 4), mesh_1d(), list(p0)),
        distribute_tensor(_t(4, 4), mesh_1d(), list(p1)),
    )


def with_value(v, p=(S0,)):
    return lambda: (distribute_tensor(_t(8, 4), mesh_1d(), list(p)), v)


def _cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    # in_placements count
    for n in (0, 2, 3):
        specs = tuple([S0] for _ in range(n))
        add(Case(f"in_count_{n}", dict(out_placements=[S0], in_placements=specs), x1(), "in_placements"))
    add(Case("in_count_pair_1", dict(out_placements=[S0], in_placements=([S0],)), pair(), "in_placements"))
    # DTensor given None placements, at each position
    add(Case("dtensor_none_0", dict(out_placements=[S0], in_placements=(None, [R])), pair(), "in_placements[0]"))
    add(Case("dtensor_none_1", dict(out_placements=[S0], in_placements=([S0], None)), pair(), "in_placements[1]"))
    add(Case("dtensor_none_2d", dict(out_placements=[S0, R], in_placements=(None,)), x2(), "in_placements[0]"))
    # mismatched placements without redistribute_inputs
    for actual, wanted in [((S0,), (R,)), ((S0,), (S1,)), ((R,), (S0,)), ((S1,), (P,)), ((R,), (P,))]:
        add(Case(f"mismatch_{actual[0]}_{wanted[0]}", dict(out_placements=[S0], in_placements=(list(wanted),)), x1(actual), "in_placements[0]"))
    add(Case("mismatch_2d", dict(out_placements=[S0, R], in_placements=([R, R],)), x2(), "in_placements[0]"))
    add(Case("mismatch_second", dict(out_placements=[S0], in_placements=([S0], [S0])), pair(), "in_placements[1]"))
    add(Case("mismatch_longer_spec", dict(out_placements=[S0], in_placements=([S0, R],)), x1(), "in_placements[0]"))
    # non-tensor arguments with placements
    for v in (3, 2.5, "name", True, None):
        add(Case(f"nontensor_{type(v).__name__}", dict(out_placements=[S0], in_placements=([S0], [R])), with_value(v), "in_placements[1]", body=lambda a, b: a * 2))
    # grad placements None for a DTensor
    add(Case("grad_none_0", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=(None,)), x1(), "in_grad_placements[0]"))
    add(Case("grad_none_1", dict(out_placements=[S0], in_placements=([S0], [R]), in_grad_placements=([S0], None)), pair(), "in_grad_placements[1]"))
    # output count
    add(Case("out_count_more_outputs", dict(out_placements=[S0], in_placements=([S0],)), x1(), "out_placements", body=lambda a: (a, a)))
    add(Case("out_count_fewer_outputs", dict(out_placements=([S0], [S0], [S0]), in_placements=([S0],)), x1(), "out_placements", body=lambda a: (a, a)))
    add(Case("out_count_empty", dict(out_placements=([S0],), in_placements=([S0],)), x1(), "out_placements", body=lambda a: ()))
    # body returns a DTensor
    held = distribute_tensor(torch.randn(8, 4), mesh_1d(), [S0])
    add(Case("out_dtensor", dict(out_placements=[S0], in_placements=([S0],)), x1(), "output 0", body=lambda a: held))
    # non-tensor outputs with placements
    add(Case("out_nontensor_int", dict(out_placements=([S0], [S0]), in_placements=([S0],)), x1(), "out_placements[1]", body=lambda a: (a, 1)))
    add(Case("out_nontensor_str", dict(out_placements=([S0], [R]), in_placements=([S0],)), x1(), "out_placements[1]", body=lambda a: (a, "s")))
    add(Case("out_nontensor_first", dict(out_placements=([S0], [S0]), in_placements=([S0],)), x1(), "out_placements[0]", body=lambda a: (None, a)))
    # out_placements that DTensor.from_local rejects
    add(Case("out_longer_than_mesh", dict(out_placements=[S0, R], in_placements=([S0],)), x1(), "out_placements[0]", torch_raises=False))
    add(Case("out_shard_oob", dict(out_placements=[Shard(5)], in_placements=([S0],)), x1(), "out_placements[0]"))
    add(Case("out_shard_oob_neg", dict(out_placements=[Shard(-3)], in_placements=([S0],)), x1(), "out_placements[0]"))
    add(Case("out_not_placement", dict(out_placements=["S0"], in_placements=([S0],)), x1(), "out_placements[0]"))
    add(Case("out_bare", dict(out_placements=S0, in_placements=([S0],)), x1(), "out_placements[0]"))
    add(Case("out_shard_oob_2d", dict(out_placements=[S0, Shard(2)], in_placements=([S0, R],)), x2(), "out_placements[0]"))
    # out_placements torch accepts silently
    add(Case("out_shorter_than_mesh", dict(out_placements=[S0], in_placements=([S0, R],)), x2(), "out_placements[0]", torch_raises=False))
    add(Case("out_empty", dict(out_placements=[], in_placements=([S0],)), x1(), "out_placements[0]", torch_raises=False))
    add(Case("out_none_for_tensor", dict(out_placements=None, in_placements=([S0],)), x1(), "out_placements[0]", torch_raises=False))
    add(Case("out_none_for_tensor_multi", dict(out_placements=([S0], None), in_placements=([S0],)), x1(), "out_placements[1]", body=lambda a: (a, a), torch_raises=False))
    # the argument's mesh is checked first (the ruling on meshes: arg_on_other_mesh)
    add(Case("out_wrong_mesh", dict(out_placements=[S0], in_placements=([S0],), device_mesh=mesh_2d()), x1(),
             "args leaf 0 is a DTensor on DeviceMesh((tp=4), 'cpu')", torch_raises=False))
    # redistribute_inputs=True with an invalid target
    rd = dict(redistribute_inputs=True)
    add(Case("rd_target_short", dict(out_placements=[S0, R], in_placements=([S0],), **rd), x2(), "in_placements[0]"))
    add(Case("rd_target_empty", dict(out_placements=[S0], in_placements=([],), **rd), x1(), "in_placements[0]"))
    add(Case("rd_target_str", dict(out_placements=[S0], in_placements=(["S1"],), **rd), x1(), "in_placements[0]"))
    add(Case("rd_target_oob", dict(out_placements=[S0], in_placements=([Shard(5)],), **rd), x1(), "in_placements[0]"))
    add(Case("rd_target_oob_neg", dict(out_placements=[S0], in_placements=([Shard(-3)],), **rd), x1(), "in_placements[0]"))
    add(Case("rd_target_long", dict(out_placements=[S0], in_placements=([S1, R],), **rd), x1(), "in_placements[0]", torch_raises=False))
    add(Case("rd_target_oob_2d", dict(out_placements=[S0, R], in_placements=([R, Shard(4)],), **rd), x2(), "in_placements[0]"))
    add(Case("rd_second_target_oob", dict(out_placements=[S0], in_placements=([S0], [Shard(3)]), **rd), pair(), "in_placements[1]"))
    # bare placements where a sequence is expected
    add(Case("in_bare", dict(out_placements=[S0], in_placements=(S0,)), x1(), "in_placements[0]"))
    add(Case("in_bare_rd", dict(out_placements=[S0], in_placements=(S1,), **rd), x1(), "in_placements[0]"))
    add(Case("grad_bare", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=(S0,)), x1(), "in_grad_placements[0]"))
    # grad placements torch accepts (and fails in backward, or never)
    add(Case("grad_long", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=([S0, R],)), x1(), "in_grad_placements[0]", torch_raises=False))
    add(Case("grad_short_2d", dict(out_placements=[S0, R], in_placements=([S0, R],), in_grad_placements=([S0],)), x2(), "in_grad_placements[0]", torch_raises=False))
    add(Case("grad_oob", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=([Shard(7)],)), x1(), "in_grad_placements[0]", torch_raises=False))
    add(Case("grad_not_placement", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=(["x"],)), x1(), "in_grad_placements[0]", torch_raises=False))
    add(Case("grad_second_oob", dict(out_placements=[S0], in_placements=([S0], [R]), in_grad_placements=([S0], [Shard(2)])), pair(), "in_grad_placements[1]", torch_raises=False))
    add(Case("grad_empty", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=([],)), x1(), "in_grad_placements[0]", torch_raises=False))
    # in_grad_placements with the wrong number of entries (issue #12): a
    # ValueError that is also torch's IndexError
    add(Case("grad_count_short", dict(out_placements=[S0], in_placements=([S0], [R]), in_grad_placements=([S0],)), pair(), "in_grad_placements has 1 entry but the function gets 2"))
    add(Case("grad_count_long", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=([S0], [S0])), x1(), "in_grad_placements has 2 entries but the function gets 1", torch_raises=False))
    # more placements than the mesh has dimensions, not redistributed: the
    # mesh rank is the cause, said first
    # a DTensor on a mesh of another shape than device_mesh: torch unwraps it
    # and wraps the outputs on device_mesh
    add(Case("arg_on_other_mesh", dict(out_placements=[S0], in_placements=([S0, R],), device_mesh=mesh_1d()), x2(),
             "args leaf 0 is a DTensor on DeviceMesh((dp=2, tp=2), 'cpu')", torch_raises=False))
    add(Case("in_more_than_mesh", dict(out_placements=[S0], in_placements=([S0, R],)), x1(), "has 2 placements but the argument's device mesh has 1 dimension"))
    # nested args: placements still index flattened leaves
    add(Case("nested_mismatch", dict(out_placements=[S0], in_placements=([S0], [S0])), lambda: ([distribute_tensor(_t(8, 4), mesh_1d(), [S0]), distribute_tensor(_t(8, 4), mesh_1d(), [R])],), "in_placements[1]", body=lambda xs: xs[0] * 2))
    add(Case("nested_dtensor_none", dict(out_placements=[S0], in_placements=([S0], None)), lambda: ({"q": distribute_tensor(_t(8, 4), mesh_1d(), [S0]), "k": distribute_tensor(_t(8, 4), mesh_1d(), [S0])},), "in_placements[1]", body=lambda d: d["q"] * 2))
    # spmd_types: the body's output type does not fit out_placements
    sp = dict(spmd_types=True, device_mesh=mesh_1d())
    add(Case("spmd_missing_reduction", dict(out_placements=[R], in_placements=([S1], [S0]), **sp), lambda: (distribute_tensor(_t(4, 8), mesh_1d(), [S1]), distribute_tensor(_t(8, 4), mesh_1d(), [S0])), "out_placements", body=lambda a, b: a @ b))
    add(Case("spmd_names_mesh_dim", dict(out_placements=[R], in_placements=([S1], [S0]), **sp), lambda: (distribute_tensor(_t(4, 8), mesh_1d(), [S1]), distribute_tensor(_t(8, 4), mesh_1d(), [S0])), "default_pg is device_mesh dimension 'tp'", body=lambda a, b: a @ b))
    add(Case("spmd_bad_grad_pair", dict(out_placements=[S0], in_placements=([S0],), in_grad_placements=([R],), **sp), x1(), "in_grad_placements"))
    return cases


CASES = _cases()


def test_enough_distinct_bad_calls():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


def _raise_of(fn, args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - we compare what is raised
        return e
    return None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_eager_error(case):
    ours = _raise_of(localmap_fx.local_map(case.body, **case.kwargs), case.args())
    assert ours is not None, "no error raised"
    theirs = _raise_of(torch_local_map(case.body, **case.kwargs), case.args())
    if case.torch_raises:
        assert theirs is not None, "torch raises here: update the case"
        # torch's type, or a ValueError subclass of it (PlacementsIndexError...)
        assert isinstance(ours, type(theirs))
        assert type(ours) is type(theirs) or isinstance(ours, ValueError), type(ours)
        if type(ours) is type(theirs):
            # torch's text byte for byte; the hint is a note
            assert str(ours) == str(theirs)
        else:
            assert str(theirs) in str(ours)
    else:
        assert theirs is None, "torch raises here now: not a deviation any more"
    assert case.names in full_text(ours)
    assert "[localmap_fx]" in full_text(ours)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_error(case):
    eager = _raise_of(localmap_fx.local_map(case.body, **case.kwargs), case.args())
    fn = localmap_fx.local_map(case.body, **case.kwargs)
    compiled = torch.compile(lambda *a: fn(*a), backend=localmap_fx.backend("aot_eager"), fullgraph=True)
    err = _raise_of(compiled, case.args())
    assert err is not None
    assert isinstance(err, type(eager)), (type(err), err)
    # a hint, as a note (the message describes arguments by kind and Dynamo
    # appends the user frames)
    assert err.__notes__ and all(n.startswith("[localmap_fx]") for n in err.__notes__)
    assert case.names in full_text(err)


def test_dtensor_on_another_mesh_is_named_in_both_modes():
    """An argument on a 2-D mesh given to a region on a 1-D ``device_mesh``:
    a ValueError naming the argument and both meshes, compiled as eager."""
    x = distribute_tensor(torch.randn(8, 4), mesh_2d(), [Shard(0), Shard(0)])
    fn = localmap_fx.local_map(lambda a: a * 2, [Shard(0)], ([Shard(0)],), device_mesh=mesh_1d())
    eager = _raise_of(fn, (x,))
    compiled = _raise_of(torch.compile(lambda a: fn(a), backend=localmap_fx.backend("aot_eager"), fullgraph=True), (x,))
    assert isinstance(eager, ValueError) and isinstance(compiled, ValueError)
    for err in (eager, compiled):
        assert str(err).startswith(
            "args leaf 0 is a DTensor on DeviceMesh((dp=2, tp=2), 'cpu') (ranks [[0, 1], [2, 3]]) but "
            "local_map's device_mesh is DeviceMesh((tp=4), 'cpu') (ranks [0, 1, 2, 3])."
        ), err
        assert err.__notes__[0].startswith("[localmap_fx] pass the argument on device_mesh")


@pytest.mark.parametrize("compiled", [False, True])
def test_dtensor_on_an_equal_mesh_is_accepted(compiled):
    """Another DeviceMesh object of the same shape over the same ranks is
    device_mesh for a region: accepted; the outputs are on device_mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    twin = DeviceMesh("cpu", mesh_1d().mesh.clone(), mesh_dim_names=("tp",))
    assert twin is not mesh_1d()
    x = distribute_tensor(torch.randn(8, 4), twin, [Shard(0)])
    fn = localmap_fx.local_map(lambda a: a * 2, [Shard(0)], ([Shard(0)],), device_mesh=mesh_1d())
    call = torch.compile(lambda a: fn(a), backend=localmap_fx.backend("aot_eager"), fullgraph=True) if compiled else fn
    out = call(x)
    assert out.device_mesh is mesh_1d()
    assert torch.equal(out.to_local(), x.to_local() * 2)


@pytest.mark.parametrize("built_inside", [False, True])
def test_dtensor_on_another_mesh_traced_path(built_inside):
    """The traced path (keyword arguments), with the local_map built outside
    or inside the compiled function: the same ValueError as eager."""
    x = distribute_tensor(torch.randn(8, 4), mesh_2d(), [Shard(0), Shard(0)])
    m1 = mesh_1d()

    def make():
        return localmap_fx.local_map(lambda a, k=1: a * k, [Shard(0)], ([Shard(0)],), device_mesh=m1)

    outer = make()

    def fn(a):
        return (make() if built_inside else outer)(a, k=2)

    compiled = _raise_of(torch.compile(fn, backend=localmap_fx.backend("aot_eager"), fullgraph=True), (x,))
    assert isinstance(compiled, ValueError), compiled
    assert str(compiled).startswith(str(_raise_of(fn, (x,))))
