"""The eager fast path (Note: [Eager fast path] in localmap_fx/eager.py).

Where the fast path calls DTensor's autograd Functions directly, or skips
pytree, the cases below take the other branches (Parameter DTensors, no_grad,
negative Shard dims, mixed Partial specs, None specs, container outputs, meta
outputs) and check that ours and torch's ``local_map`` agree on results,
``grad_fn`` types, placements and errors.  ``tests/unit/test_eager_parity.py``
covers the common cases.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map as torch_local_map

from localmap_fx import local_map as our_local_map

from helpers import mesh_1d, mesh_2d

IMPLS = {"torch": torch_local_map, "ours": our_local_map}


def _both(body, **kw):
    return {name: lm(body, **kw) for name, lm in IMPLS.items()}


def _dt(mesh, placements, shape=(8, 4), requires_grad=True):
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    return distribute_tensor(t, mesh, placements).requires_grad_(requires_grad)


def _describe(x):
    if isinstance(x, DTensor):
        return (
            "DTensor",
            tuple(x.placements),
            tuple(x.shape),
            tuple(x.stride()),
            x.requires_grad,
            type(x.grad_fn).__name__ if x.grad_fn is not None else None,
            x.to_local().detach().clone(),
        )
    if isinstance(x, torch.Tensor):
        return ("Tensor", x.detach().clone())
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, [_describe(v) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: _describe(v) for k, v in x.items()})
    return ("value", x)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.device != b.device:
            return False
        if a.is_meta:
            return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _outcome(fn, *args):
    try:
        return ("ok", _describe(fn(*args)))
    except Exception as e:  # noqa: BLE001
        return ("error", type(e), str(e).split("\n[localmap_fx]")[0])


def _check(body, args, **kw):
    fns = _both(body, **kw)
    got = {name: _outcome(f, *args) for name, f in fns.items()}
    assert _same(got["ours"], got["torch"]), got
    return got["ours"]


def test_parameter_dtensor_input():
    p = torch.nn.Parameter(_dt(mesh_1d(), [Shard(0)]))
    seen = {}

    def body(t):
        seen[len(seen)] = (isinstance(t, torch.nn.Parameter), type(t.grad_fn).__name__)
        return t * 2

    _check(body, (p,), out_placements=[Shard(0)], in_placements=([Shard(0)],))
    assert seen[0] == seen[1] == (True, "_ToTorchTensorBackward")


def test_no_grad_input_is_the_local_tensor():
    x = _dt(mesh_1d(), [Shard(0)])
    seen = []

    def body(t):
        seen.append(t is x._local_tensor)
        return t + 1

    with torch.no_grad():
        _check(body, (x,), out_placements=[Shard(0)], in_placements=([Shard(0)],))
    assert seen == [True, True]


@pytest.mark.parametrize(
    "out_placements",
    [
        [Shard(-1)],
        (Shard(-2),),
        [Partial()],
        [Partial("max")],
    ],
    # out_placements=None for a tensor output: a documented call-time error
    # (docs/user-guide.md, "Deviations from torch"), covered by tests/compile/test_bad_inputs.py
    ids=["shard_neg1", "shard_neg2_tuple", "partial", "partial_max"],
)
def test_output_specs_taking_the_public_from_local(out_placements):
    x = _dt(mesh_1d(), [Shard(0)])
    _check(lambda t: t * 3, (x,), out_placements=out_placements, in_placements=([Shard(0)],))


def test_mixed_partial_output_spec_raises_like_torch():
    x = _dt(mesh_2d(), [Shard(0), Shard(1)])
    got = _check(
        lambda t: t * 3,
        (x,),
        out_placements=[Partial("sum"), Partial("max")],
        in_placements=([Shard(0), Shard(1)],),
    )
    assert got[0] == "error" and got[1] is ValueError


@pytest.mark.parametrize(
    "body,out_placements",
    [
        (lambda t: (t, t * 2), ([Shard(0)], [Shard(0)])),
        (lambda t: [t, t * 2], ([Shard(0)], [Shard(0)])),
        (lambda t: {"a": t, "b": t * 2}, ([Shard(0)], [Shard(0)])),
        (lambda t: (t * 2, 3), ([Shard(0)], None)),
        (lambda t: (t * 2, (t + 1,)), ([Shard(0)], [Shard(0)])),
    ],
    ids=["tuple", "list", "dict", "tuple_with_int", "nested"],
)
def test_container_outputs(body, out_placements):
    x = _dt(mesh_1d(), [Shard(0)])
    _check(body, (x,), out_placements=out_placements, in_placements=([Shard(0)],))


@pytest.mark.parametrize("as_tuple", [False, True])
def test_dtensor_output_raises_like_torch(as_tuple):
    x = _dt(mesh_1d(), [Shard(0)])
    y = _dt(mesh_1d(), [Replicate()])
    got = _check(
        (lambda t: (t * 2, y)) if as_tuple else (lambda t: y),
        (x,),
        out_placements=([Shard(0)], [Replicate()]) if as_tuple else [Replicate()],
        in_placements=([Shard(0)],),
    )
    assert got[0] == "error" and got[1] is AssertionError


def test_meta_output():
    x = _dt(mesh_1d(), [Shard(0)])
    _check(
        lambda t: torch.empty(t.shape, device="meta"),
        (x,),
        out_placements=[Shard(0)],
        in_placements=([Shard(0)],),
    )


def test_grad_fns_and_gradients_match():
    results = {}
    for name, lm in IMPLS.items():
        x = _dt(mesh_1d(), [Replicate()])
        w = _dt(mesh_1d(), [Shard(1)], shape=(4, 8))
        f = lm(
            lambda a, b: torch.relu(a @ b),
            out_placements=[Shard(1)],
            in_placements=([Replicate()], [Shard(1)]),
            in_grad_placements=([Partial()], [Shard(1)]),
            device_mesh=mesh_1d(),
        )
        y = f(x, w)
        y.sum().backward()
        results[name] = (
            type(y.grad_fn).__name__,
            y.grad_fn.next_functions[0][0].name() if y.grad_fn.next_functions else None,
            tuple(x.grad.placements),
            x.grad.to_local(),
            tuple(w.grad.placements),
            w.grad.to_local(),
        )
    assert _same(results["ours"], results["torch"]), results


def test_spmd_plan_pushes_the_same_mesh_entry():
    pytest.importorskip("spmd_types")
    import spmd_types as spmd
    from spmd_types._state import _current_mesh_entry

    from localmap_fx.spmd.types import SpmdPlan

    with spmd.set_current_mesh(mesh_2d()):
        expected = _current_mesh_entry()
    plan = SpmdPlan(mesh_2d())
    for _ in range(2):  # first call resolves, second uses the cache
        with plan.checking():
            got = _current_mesh_entry()
        assert got == expected
    assert _current_mesh_entry() is None


def test_spmd_types_fast_path_matches_torch():
    pytest.importorskip("spmd_types")
    x = _dt(mesh_1d(), [Replicate()])
    w = _dt(mesh_1d(), [Shard(1)], shape=(4, 8))
    for _ in range(2):  # cached plan on the second call
        _check(
            lambda a, b: torch.relu(a @ b),
            (x, w),
            out_placements=[Shard(1)],
            in_placements=([Replicate()], [Shard(1)]),
            in_grad_placements=([Partial()], [Shard(1)]),
            device_mesh=mesh_1d(),
            spmd_types=True,
        )


# --- repeated calls: the per-layout fast path (Note: [Eager fast path]) -------


def _sequence_outcomes(make, calls):
    """Outcomes of ``calls`` (a list of argument tuples) on one local_map, warmed
    by the calls before each, next to the outcome of a fresh local_map."""
    warmed = make()
    got = []
    for args in calls:
        got.append((_outcome(warmed, *args), _outcome(make(), *args)))
    return got


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_repeated_calls_switching_layouts(impl):
    """Every call after the first of a layout takes the fast path; each
    switch (placements, shape, Parameter, plain tensor, no DTensor, a
    container) falls back to the full path and gives a fresh call's outcome."""
    mesh = mesh_1d()
    lm = IMPLS[impl]

    def make():
        return lm(
            lambda t, k: t * k,
            out_placements=[Shard(0)],
            in_placements=([Shard(0)], None),
            device_mesh=mesh,
        )

    a = _dt(mesh, [Shard(0)])
    b = _dt(mesh, [Shard(0)], shape=(16, 4))
    uneven = _dt(mesh, [Shard(0)], shape=(7, 4))
    r = _dt(mesh, [Replicate()])
    p = torch.nn.Parameter(_dt(mesh, [Shard(0)]))
    calls = [
        (a, 2), (a, 3), (a * 1, 2),  # same layout: an intermediate DTensor too
        (b, 2), (a, 2),  # another global shape, and back
        (uneven, 2), (uneven, 2), (a, 2),  # uneven shards: the full path, every call
        (r, 2), (a, 2),  # mismatched placements raise
        (p, 2), (a, 2),  # a Parameter takes the public to_local
        (torch.ones(2), 2),  # no DTensor: the body runs untouched
        (a, [1, 2]),  # a container is flattened: the count check raises
        (a, 2.5),
    ]
    for warmed, fresh in _sequence_outcomes(make, calls):
        assert _same(warmed, fresh), (warmed, fresh)


def test_repeated_calls_match_torch_across_grad_mode_and_outputs():
    mesh = mesh_1d()
    x = _dt(mesh, [Shard(0)])
    state = {"n": 4}

    def body(t):
        # the output's shape and structure change between calls
        if state["n"] == 0:
            return t * 2, t + 1
        return t[: state["n"]] * 2

    fns = _both(body, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    steps = [(4, True), (4, True), (3, True), (4, False), (4, True), (0, True), (4, True)]
    for n, grad in steps:
        state["n"] = n
        with torch.set_grad_enabled(grad):
            got = {name: _outcome(f, x) for name, f in fns.items()}
        assert _same(got["ours"], got["torch"]), (n, grad, got)


def test_repeated_calls_gradients_bitwise():
    mesh = mesh_1d()
    results = {}
    for name, lm in IMPLS.items():
        x = _dt(mesh, [Replicate()])
        w = _dt(mesh, [Shard(1)], shape=(4, 8))
        f = lm(
            lambda a, b: torch.relu(a @ b),
            out_placements=[Shard(1)],
            in_placements=([Replicate()], [Shard(1)]),
            in_grad_placements=([Partial()], [Shard(1)]),
            device_mesh=mesh,
        )
        seen = []
        for _ in range(3):
            y = f(x, w)
            y.sum().backward()
            seen.append(
                (
                    type(y.grad_fn).__name__,
                    [type(n[0]).__name__ for n in y.grad_fn.next_functions],
                    tuple(x.grad.placements), x.grad.to_local().clone(),
                    tuple(w.grad.placements), w.grad.to_local().clone(),
                )
            )
            x.grad = w.grad = None
        results[name] = seen
    assert _same(results["ours"], results["torch"]), results


def test_repeated_calls_another_mesh():
    """device_mesh=None: the region's mesh is the argument's, per call."""
    m1, m2 = mesh_1d(), mesh_2d()
    fns = _both(lambda t: t + 1, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    a = _dt(m1, [Shard(0)])
    for x in (a, a, _dt(m2, [Shard(0), Shard(1)]), a):
        got = {name: _outcome(f, x) for name, f in fns.items()}
        assert _same(got["ours"], got["torch"]), got


def test_repeated_calls_wrong_mesh_still_raise():
    """The mesh ruling holds on a warmed local_map (the layout keys on the mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    m1 = mesh_1d()
    other = DeviceMesh("cpu", list(reversed(range(dist.get_world_size()))), mesh_dim_names=("tp",))
    f = our_local_map(lambda t: t + 1, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=m1)
    a = _dt(m1, [Shard(0)])
    f(a)
    f(a)
    with pytest.raises(ValueError, match="args leaf 0 is a DTensor on"):
        f(_dt(other, [Shard(0)]))
    f(a)


def test_layout_boundary_plan_text():
    mesh = mesh_1d()
    f = our_local_map(
        lambda a, b: torch.relu(a @ b),
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)]),
        in_grad_placements=([Partial()], [Shard(1)]),
        device_mesh=mesh,
    )
    f(_dt(mesh, [Replicate()]), _dt(mesh, [Shard(1)], shape=(4, 8)))
    assert [lay.boundary.text() for lay in f._eager_plan.layouts] == ["in[0] R grad P; in[1] S(1) grad S(1)"]


def test_spmd_types_repeated_calls_match_torch():
    pytest.importorskip("spmd_types")
    mesh = mesh_1d()
    x = _dt(mesh, [Replicate()])
    w = _dt(mesh, [Shard(1)], shape=(4, 8))
    state = {"bad": False}

    def body(a, b):
        y = torch.relu(a @ b)
        return y.sum(1, keepdim=True) if state["bad"] else y  # V summed over its shards: rejected

    fns = _both(
        body,
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)]),
        in_grad_placements=([Partial()], [Shard(1)]),
        device_mesh=mesh,
        spmd_types=True,
    )
    for bad in (False, False, True, False):
        state["bad"] = bad
        got = {name: _outcome(f, x, w) for name, f in fns.items()}
        assert _same(got["ours"], got["torch"]), (bad, got)


def test_layouts_taken_in_turn_are_all_kept():
    """A function called with a few layouts in turn keeps each (up to 8, most
    recent first), and every call still gives a fresh call's outcome."""
    mesh = mesh_1d()

    def make():
        return our_local_map(lambda t: t * 2, out_placements=[Shard(0)], in_placements=([Shard(0)],))

    f = make()
    xs = [_dt(mesh, [Shard(0)], shape=(8 * (k + 1), 4)) for k in range(10)]
    for x in (xs[0], xs[1], xs[0], xs[1]):
        assert _same(_outcome(f, x), _outcome(make(), x))
    assert [lay.steps[0][2].shape for lay in f._eager_plan.layouts] == [(16, 4), (8, 4)]
    for x in xs:
        f(x)
    assert [lay.steps[0][2].shape[0] for lay in f._eager_plan.layouts] == [80, 72, 64, 56, 48, 40, 32, 24]


def test_eager_calls_never_build_the_capture_annotation():
    """Building and calling a ``local_map`` in eager leaves the region
    annotation unbuilt (capture builds it on first use); a compile then
    builds it and gives the same region as a ``local_map`` compiled fresh."""
    import localmap_fx
    from localmap_fx.region import META_SPEC, spec_of

    mesh = mesh_1d()

    def body(x):
        return x * 2

    lm = our_local_map(body, out_placements=((Shard(0),),), in_placements=((Shard(0),),), device_mesh=mesh)
    x = _dt(mesh, [Shard(0)])
    lm(x).to_local().sum().backward()
    assert lm.spec_annotation is None
    torch._dynamo.reset()
    out = torch.compile(lm, backend=localmap_fx.backend(inner="aot_eager"), fullgraph=True)(x)
    assert torch.equal(out.to_local(), x.to_local() * 2)
    spec = spec_of(lm.spec_annotation[META_SPEC])
    assert (spec["func"], spec["in"], spec["out"]) == (body.__qualname__, ((Shard(0),),), ((Shard(0),),))
