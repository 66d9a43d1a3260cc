"""The lean DTensor border (``localmap_fx/compiler/dtensor_border.py``).

Hand-written graphs with DTensor inputs and outputs, compiled whole, against
torch autograd in eager; the regional TP stack (each ``nn.Module`` block its
own frame) under aot_eager and inductor; gradients arriving in other
placements than traced (a backward compiled for them, or the redistribute
fallback); what the border refuses.  Single-process tests run on the fake
process group (collectives are no-ops: eager and compiled run the same
collectives on the same values, so equality there is structural); the gloo
tier checks real numerics on 2 ranks.  (LocalTensorMode wraps local tensors
in a subclass, which the border refuses, so it has no tier here.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from localmap_fx.compiler.cacheable_border import CacheableBorder
from localmap_fx.compiler.dtensor_border import BorderRefused, DTensorBorder, dtensor_border
from localmap_fx.compiler.inner import inner_compiler
from localmap_fx.compiler.options import BackendOptions
from localmap_fx.layer_sharing.runtime import Refusal, Refused

from helpers import border_recording, col_row, mesh_1d, seeded_dtensor


def _recording(inner: str, **opts):
    """A backend that keeps what compile_graph returned for each frame."""
    return border_recording(inner, **opts)


def _refusal_of(fn, args, inner="aot_eager"):
    """What dtensor_border says about ``fn``'s graph (the frame then compiles as usual)."""
    seen: list = []

    def backend(gm, example_inputs):
        compile_one = inner_compiler(BackendOptions(inner=inner, lean_border=False))
        seen.append(dtensor_border(gm, example_inputs, compile_one))
        return compile_one(gm, list(example_inputs)).fn

    torch.compile(fn, backend=backend)(*args)
    return seen[0]


def _dt(shape, placements, seed, requires_grad=True):
    return seeded_dtensor(shape, placements, seed, requires_grad)


def _grads(*ts):
    return [None if t.grad is None else (t.grad.placements, t.grad.full_tensor()) for t in ts]


def _clear(*ts):
    for t in ts:
        t.grad = None


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert torch.equal(x[1], y[1])


_col_row = col_row


def _col_row_args():
    """``_col_row``'s operands: x Replicate, w1 Shard(1), w2 Shard(0), seeded."""
    return _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_hand_written_graph_equals_eager_through_the_border(inner):
    x, w1, w2 = _col_row_args()

    loss = (_col_row(x, w1, w2) ** 2).sum()
    loss.backward()
    eager = [loss.to_local().clone(), *_grads(x, w1, w2)]
    _clear(x, w1, w2)

    backend, seen = _recording(inner)
    # the loss inside: a block's own output would be compiled for the gradient
    # the next block sends (test_block_is_compiled_for_the_gradient_the_next_block_sends)
    loss = torch.compile(lambda x, w1, w2: (_col_row(x, w1, w2) ** 2).sum(), backend=backend)(x, w1, w2)
    # the user's mesh object, not the fake stand-in the trace saw
    assert loss.device_mesh is x.device_mesh
    loss.backward()
    got = [loss.to_local().clone(), *_grads(x, w1, w2)]
    (border,) = seen
    # a graph with no output chained to an input: under Inductor, the border
    # torch's caches can serve (Note: [A border torch's caches can serve])
    assert isinstance(border, CacheableBorder if inner == "inductor" else DTensorBorder), border
    # Inductor's reductions sum in another order than eager's on some CPUs
    # (an AMD EPYC's vector width): within 1e-5 there, bitwise under aot_eager
    if inner == "aot_eager":
        assert torch.equal(eager[0], got[0])
        _same(eager[1:], got[1:])
    else:
        torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
        for e, g in zip(eager[1:], got[1:]):
            torch.testing.assert_close(g[1], e[1], rtol=1e-5, atol=1e-5)
    assert eager[1][0] == got[1][0] == (Partial(),)


def _downstream(placements):
    """A loss whose gradient reaches ``y`` in ``placements`` (Partial: as after
    the next block's region; Replicate: as from the loss)."""
    def loss(y):
        return (y.to_local(grad_placements=placements) ** 2).sum()

    return loss


def _tp_block():
    """One block of the TP stack, its input, the leaves, and the losses that send
    its output a Partial (next block) or a Replicate (loss) gradient."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    block, x = TPStack(mesh, 1, d=16, hidden=32).blocks[0], tp_stack_input(mesh, 8, 16)
    return block, x, [x, *block.parameters()], _downstream([Partial()]), _downstream([Replicate()])


def test_block_is_compiled_for_the_gradient_the_next_block_sends():
    """A TP block (Replicate in, Replicate out, its weights inside local_map
    regions): the border compiles the Partial gradient the next block sends;
    eager on the fakes shows the input's gradient is Partial too and one
    collective more than its forward, so the plan keeps it (Note: [The
    gradient a stack sends back]).  A Replicate gradient (the last block's, from the loss) is turned
    into Partial locally, as DTensor's backward does: nothing is compiled for
    it, and the gradients keep eager's placements.  Under the fake process
    group the collectives do nothing, so values are compared for the Partial
    gradient only (same collectives as eager); the gloo test compares both."""
    block, x, leaves, partial, replicate = _tp_block()
    eager = {}
    for down in (partial, replicate):
        down(block(x)).backward()
        eager[down] = _grads(*leaves)
        _clear(*leaves)

    backend, seen = _recording("aot_eager")
    f = torch.compile(block, backend=backend)
    for _ in range(2):
        partial(f(x)).backward()
        got = _grads(*leaves)
        _same(eager[partial], got)
        assert [g[0] for g in got] == [g[0] for g in eager[partial]]
        _clear(*leaves)
        (border,) = seen
        assert list(border.variants) == [((Partial(),),)]
        assert border.plan.text() == "compile (P(sum))"
    replicate(f(x)).backward()
    assert list(border.variants) == [((Partial(),),), ((Replicate(),),)]
    assert border.variants[((Replicate(),),)] is None  # converted, not compiled
    assert "(R) (redistributed: R->P@tp:partition)" in border.text()
    assert [g[0] for g in _grads(*leaves)] == [g[0] for g in eager[replicate]]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_last_block_gradient_is_not_summed_again(inner):
    """The TP block is compiled for the Partial gradient the next block sends,
    and its backward starts by summing it (``Partial -> Replicate``).  The last
    block's gradient comes from the loss, Replicate: converted to Partial
    (``g / 2``) and summed back, it cost one all_reduce per step that eager
    and upstream do not issue.  The border runs that sum itself (Note: [The
    tangent's all_reduce belongs to the border]): a Partial gradient gets the
    same all_reduce, a Replicate one none.  Reductions per backward equal
    eager's for both; values are compared on gloo
    (``test_deep_stack_on_gloo_equals_eager``): the fake group sums nothing."""
    block, x, leaves, partial, replicate = _tp_block()
    eager = {}
    for down in (partial, replicate):
        eager[down] = _reductions_in_backward(down(block(x)))
        _clear(*leaves)
    assert eager == {partial: 1, replicate: 0}

    backend, seen = _recording(inner)
    f = torch.compile(block, backend=backend)
    for down in (partial, replicate, partial, replicate):
        assert _reductions_in_backward(down(f(x))) == eager[down]
        _clear(*leaves)
    (border,) = seen
    assert border.plan.text() == "compile (P(sum))"
    (reduction,) = border.first.layer.reductions
    # (Inductor's joint passes drop the tangent's no-op view first)
    assert (reduction.tangent, reduction.reduce_op, reduction.group_name, reduction.shape in (None, (8, 16))) \
        == (0, "sum", mesh_1d().get_group().group_name, True)


def test_block_whose_partial_gradient_costs_more_is_converted_to_it():
    """A block of DTensor ops (``_col_row``: its weights outside any region):
    for Partial its backward gathers both weights and reduce-scatters, more
    than converting a Partial gradient to Replicate (one all_reduce), so the
    border compiles Replicate only and converts a Partial gradient, never
    compiling for it.  The weights' gradients keep eager's placements: ``w2``'s
    is Partial in eager, and is made so from the Replicate backward's
    ``Shard(0)`` (a local step)."""
    x, w1, w2 = _col_row_args()
    partial = _downstream([Partial()])
    partial(_col_row(x, w1, w2)).backward()
    eager = _grads(x, w1, w2)
    _clear(x, w1, w2)
    assert eager[2][0] == (Partial(),)

    backend, seen = _recording("aot_eager")
    f = torch.compile(_col_row, backend=backend)
    for _ in range(2):
        partial(f(x, w1, w2)).backward()
        (border,) = seen
        assert border.plan.converted == (((Partial(),),),)
        assert border.plan.text() == "compile (R); convert (P(sum))"
        assert border.variants == {((Replicate(),),): border.first, ((Partial(),),): None}
        # each conversion planned once, as direct steps: the arriving gradient
        # all_reduced, w2's Shard(0) gradient laid into zeros as eager's Partial
        assert border.text().endswith("backward for tangents (R), (P(sum)) (redistributed: P->R@tp:all_reduce; "
                                      "input 2: S(0)->P@tp:embed) (planned: compile (R); convert (P(sum)))")
        assert [g[0] for g in _grads(x, w1, w2)] == [g[0] for g in eager]
        _clear(x, w1, w2)


def _reductions_in_backward(loss) -> int:
    """How many reducing collectives ``loss.backward()`` issues (eager DTensor and compiled code alike)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in func.namespace and "reduce" in func.__name__:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    return Count.n


def _two_blocks(x, a1, a2, b1, b2):
    return (_col_row(_col_row(x, a1, a2), b1, b2) ** 2).sum()


def _steady_backward(f, x, ws):
    """Gradients and reductions of ``f``'s second backward (the first may compile)."""
    f(x, *ws).backward()
    _clear(x, *ws)
    n = _reductions_in_backward(f(x, *ws))
    got = _grads(x, *ws)
    _clear(x, *ws)
    return got, n


@pytest.mark.parametrize("inner,aot_cache", [("aot_eager", True), ("inductor", True), ("inductor", False)])
def test_partial_gradient_of_a_shard_weight_leaves_as_eager_gives_it(inner, aot_cache):
    """Two blocks in one graph: the gradient reaching the first block's output
    is Partial (from the second block's ``x @ w1``), so eager gives the first
    ``w2`` (Shard(0)) a Partial gradient of the global shape, and so does
    upstream ``torch.compile``.  The border hands it over as it is, through
    ``w2``'s wide slot, with no more reductions than upstream's backward (it
    used to reduce-scatter it to Shard(0): one more per layer)."""
    x = _dt((8, 16), [Replicate()], 0)
    ws = [_dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2),
          _dt((16, 32), [Shard(1)], 3), _dt((32, 16), [Shard(0)], 4)]

    _two_blocks(x, *ws).backward()
    eager = _grads(x, *ws)
    _clear(x, *ws)
    assert eager[2][0] == (Partial(),)  # what the test is about
    upstream, upstream_reductions = _steady_backward(torch.compile(_two_blocks, backend=inner), x, ws)
    torch._dynamo.reset()

    from localmap_fx._torch_compat import functorch_config

    backend, seen = _recording(inner)
    with functorch_config.patch(enable_autograd_cache=aot_cache):
        got, reductions = _steady_backward(torch.compile(_two_blocks, backend=backend), x, ws)
    (border,) = seen
    # a loss out: the border torch's caches serve, when they are on (Note:
    # [A border torch's caches can serve]); both take the wide slots
    assert isinstance(border, CacheableBorder if inner == "inductor" and aot_cache else DTensorBorder), border
    assert border.wide == (1, 2, 3, 4)  # the Shard weights; x is Replicate
    assert [g[0] for g in got] == [g[0] for g in eager] == [g[0] for g in upstream]
    if inner == "aot_eager":
        _same(eager, got)
    else:
        for e, g in zip(eager, got):
            torch.testing.assert_close(g[1], e[1])
    assert reductions <= upstream_reductions, (reductions, upstream_reductions)


def test_gradient_redistributed_when_no_backward_fits():
    """When a backward for the arriving placements cannot read the first
    forward's saved values, the gradient is redistributed to the traced
    placements: AOTAutograd's way, so its gradients are AOTAutograd's.  (``x``
    needs no gradient: the block is compiled for Replicate first.)"""
    x = _dt((8, 16), [Replicate()], 0, requires_grad=False)
    w1 = _dt((16, 32), [Shard(1)], 1)
    w2 = _dt((32, 16), [Shard(0)], 2)

    downstream = _downstream([Partial()])
    backend, _ = _recording("aot_eager", lean_border=False)
    downstream(torch.compile(_col_row, backend=backend)(x, w1, w2)).backward()
    aot = _grads(x, w1, w2)
    _clear(x, w1, w2)
    torch._dynamo.reset()

    backend, seen = _recording("aot_eager")
    f = torch.compile(_col_row, backend=backend)
    f(x, w1, w2)
    (border,) = seen
    border.variants[((Partial(),),)] = None  # as if its forward saved other values
    downstream(f(x, w1, w2)).backward()
    _same(aot, _grads(x, w1, w2))
    assert list(border.variants) == [((Replicate(),),), ((Partial(),),)]


def test_gradients_alternating_placements_pick_their_backward_each_call():
    """One compiled graph whose output's gradient arrives Partial, then
    Replicate, then Partial again, each time in a fresh DTensor: every call
    runs the backward of the placements that arrived (the border remembers
    placements by identity, Note: [The border's hot path]), and equals eager.
    (``x`` needs no gradient: the block is compiled for Replicate first, and
    for Partial when it arrives.)"""
    x = _dt((8, 16), [Replicate()], 0, requires_grad=False)
    w1 = _dt((16, 32), [Shard(1)], 1)
    w2 = _dt((32, 16), [Shard(0)], 2)

    partial, replicate = _downstream([Partial()]), _downstream([Replicate()])
    eager = {}
    for down in (partial, replicate):
        down(_col_row(x, w1, w2)).backward()
        eager[down] = _grads(x, w1, w2)
        _clear(x, w1, w2)
    backend, seen = _recording("aot_eager")
    f = torch.compile(_col_row, backend=backend)
    for down in (partial, replicate, partial, replicate, partial):
        down(f(x, w1, w2)).backward()
        got = _grads(x, w1, w2)
        _same(eager[down], got)
        assert got[2][0] == eager[down][2][0]  # w2's gradient keeps eager's placements
        _clear(x, w1, w2)
    (border,) = seen
    assert list(border.variants) == [((Replicate(),),), ((Partial(),),)]


def test_border_remembers_few_placement_identities():
    """A gradient built anew each step (new placements objects): the border's
    memory of placements it saw stays bounded."""
    from localmap_fx.compiler import dtensor_border as module

    x, w1, w2 = _col_row_args()
    backend, seen = _recording("aot_eager")
    f = torch.compile(_col_row, backend=backend)
    for _ in range(module._SEEN + 4):
        y = f(x, w1, w2)
        grad = DTensor.from_local(torch.ones_like(y.to_local()), y.device_mesh, (Partial(),), run_check=False)
        y.backward(grad)
    (border,) = seen
    assert 0 < len(border._seen) <= module._SEEN


def test_dtensors_the_border_builds_are_dtensors_as_the_constructor_builds_them():
    """``_new_dtensor`` (DTensor.__new__ without __init__) gives what
    ``DTensor(local, spec, requires_grad=False)`` gives."""
    from localmap_fx.compiler.dtensor_border import _new_dtensor

    x = _dt((8, 16), [Shard(0)], 0)
    local, spec = x.to_local().detach(), x._spec
    a = DTensor(local, spec, requires_grad=False)
    b = _new_dtensor(local, spec)
    assert type(a) is type(b) is DTensor
    assert b._spec is spec and b._local_tensor is local
    for read in (lambda t: t.shape, lambda t: t.stride(), lambda t: t.dtype, lambda t: t.device,
                 lambda t: t.requires_grad, lambda t: t.placements, lambda t: t.device_mesh,
                 lambda t: t.grad_fn, lambda t: t.is_leaf):
        assert read(a) == read(b)
    assert torch.equal((b * 2).full_tensor(), (a * 2).full_tensor())


def test_shard_output_with_plain_and_non_differentiable_outputs():
    """Several outputs: a Shard(0) DTensor, a plain tensor and an integer DTensor
    (no gradient); one input that needs no gradient."""
    x = _dt((8, 16), [Shard(0)], 0)
    w = _dt((16, 16), [Replicate()], 1, requires_grad=False)
    b = torch.randn(2, 16, requires_grad=True)  # the local shard of x @ w on 4 ranks

    def f(x, w, b):
        y = torch.tanh(x @ w)
        local = y.to_local() * b
        return y, local, (y > 0).to(torch.int64)

    def loss_of(outs):
        y, local, mask = outs
        return (y * y).sum().to_local() + local.sum() + mask.to_local().sum()

    eager_out = f(x, w, b)
    loss_of(eager_out).backward()
    eager = [*_grads(x, w), b.grad.clone()]
    x.grad = None
    b.grad = None

    backend, seen = _recording("aot_eager")
    got_out = torch.compile(f, backend=backend)(x, w, b)
    assert isinstance(seen[0], DTensorBorder)
    assert got_out[0].placements == (Shard(0),) and not got_out[2].requires_grad
    assert isinstance(got_out[1], torch.Tensor) and not isinstance(got_out[1], DTensor)
    loss_of(got_out).backward()
    _same(eager[:2], _grads(x, w))
    assert torch.equal(eager[2], b.grad)


def test_input_in_other_placements_than_traced_is_an_error():
    x, w1, w2 = _col_row_args()
    backend, seen = _recording("aot_eager")
    torch.compile(_col_row, backend=backend)(x, w1, w2)
    (border,) = seen
    mesh = x.device_mesh
    args = [a if not isinstance(a, DTensor) or a is not x else x.redistribute(mesh, [Shard(0)])
            for a in _frame_args(border, x, w1, w2)]
    with pytest.raises(RuntimeError, match="traced as DTensor"):
        border(*args)


def _frame_args(border, x, w1, w2):
    """The frame's arguments in Dynamo's order (read from the traced specs)."""
    pool = {id(x): x, id(w1): w1, id(w2): w2}
    out = []
    remaining = list(pool.values())
    for s in border.inputs:
        if s.spec is None:
            out.append(x.device_mesh)
            continue
        t = next(t for t in remaining if t.placements == s.spec.placements and tuple(t.shape) == s.shape)
        remaining.remove(t)
        out.append(t)
    return out


def test_double_backward_through_the_border_is_an_error():
    x, w1, w2 = _col_row_args()
    backend, seen = _recording("aot_eager")
    # (with donated buffers, create_graph=True is refused already, with AOTAutograd's message)
    with torch._functorch.config.patch(donated_buffer=False):
        out = torch.compile(_col_row, backend=backend)(x, w1, w2)
    assert isinstance(seen[0], DTensorBorder)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        torch.autograd.grad((out ** 2).sum(), [x], create_graph=True)


def test_refusals():
    x = _dt((8, 16), [Replicate()], 0)

    def writes(x, buf):
        buf.add_(1)
        return x * 2

    r = _refusal_of(writes, (x, torch.zeros(3)))
    assert isinstance(r, Refusal) and r.code is Refused.WRITES_INPUT and "writes to an input" in r.text

    def aliases(x):
        return x.t(), x * 2

    r = _refusal_of(aliases, (x,))
    assert r == Refusal(BorderRefused.ALIAS, "output 0 shares storage with input 0")

    def region_result(x):
        # from_local of a result: a view of an intermediate (a frame cut by a graph break)
        return DTensor.from_local(x.to_local() * 2, x.device_mesh, [Replicate()])

    r = _refusal_of(region_result, (x,))
    assert r == Refusal(BorderRefused.ALIAS, "output 0 is a view")

    def plain(a):
        return a * 2

    r = _refusal_of(plain, (torch.randn(3, requires_grad=True),))
    assert isinstance(r, Refusal) and r.code is BorderRefused.NO_DTENSOR

    with torch.no_grad():
        r = _refusal_of(lambda x: x * 2, (x,))
    assert isinstance(r, Refusal) and r.code is BorderRefused.NO_GRAD


def test_symbolic_sizes_are_refused():
    seen: list = []

    def backend(gm, example_inputs):
        compile_one = inner_compiler(BackendOptions(inner="aot_eager", lean_border=False))
        seen.append(dtensor_border(gm, example_inputs, compile_one))
        return compile_one(gm, list(example_inputs)).fn

    f = torch.compile(lambda x: x * 2, backend=backend, dynamic=True)
    f(_dt((8, 16), [Replicate()], 0))
    assert any(isinstance(r, Refusal) and r.code is BorderRefused.SYMBOLIC for r in seen), seen


# --- the regional TP stack ---------------------------------------------------------

def _stack(mesh, n, d=16, hidden=32, batch=8):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    return TPStack(mesh, n, d=d, hidden=hidden), tp_stack_input(mesh, batch, d)


def _regional_steps(mesh, n, backend, steps=2):
    """Loss and gradients (as full tensors) of ``steps`` steps; backend None = eager."""
    model, x = _stack(mesh, n)
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend)
    out = []
    for _ in range(steps):
        loss = model(x)
        loss.backward()
        leaves = [x, *model.parameters()]
        out.append([loss.full_tensor()] + [t.grad.full_tensor() for t in leaves])
        for t in leaves:
            t.grad = None
    return out


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_regional_stack_runs_behind_the_border_and_equals_eager(inner):
    mesh = mesh_1d()
    eager = _regional_steps(mesh, 3, None)
    backend, seen = _recording(inner)
    got = _regional_steps(mesh, 3, backend)
    # one frame for every block, as upstream regional compilation (the blocks'
    # outputs carry the user's mesh, so Dynamo's guards on it hold)
    assert len(seen) == 1 and isinstance(seen[0], DTensorBorder), seen
    # compiled once, for the Partial gradients the inner blocks get; the last
    # block's Replicate gradient (from the loss) is converted locally (Note:
    # [The gradient a stack sends back]).  The values are compared on gloo
    # (test_regional_stack_on_gloo_equals_eager_bitwise_under_aot_eager): under
    # the fake process group the conversion's reduction does nothing.
    (border,) = seen
    assert border.first.tangents == ((Partial(),),)
    assert border.variants == {((Partial(),),): border.first, ((Replicate(),),): None}
    for e, g in zip(eager, got):  # the losses: the forward is eager's
        if inner == "aot_eager":
            assert torch.equal(e[0], g[0])
        else:
            torch.testing.assert_close(e[0], g[0], rtol=1e-5, atol=1e-5)


@pytest.mark.inductor
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_backward_called_inside_a_compiled_step_is_not_traced(inner):
    """A whole training step compiled (found with torchtitan-shaped blocks):
    ``loss.backward()`` graph-breaks and runs the border's backward with
    Dynamo's frame hook set.  Dynamo traced that backward (and, under
    Inductor, Inductor's output code: its in-place all_reduce_ then failed to
    compile); Note: [A compiled backward is no frame for Dynamo]."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    backend, seen = _recording(inner)
    model, x = TPStack(mesh, 2, d=16, hidden=32), tp_stack_input(mesh, 8, 16)

    def step(x):
        loss = model(x)
        loss.backward()
        return loss

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    torch.compile(step, backend=recording)(x)
    files = {line.split('"')[1] for gm in graphs for n in gm.graph.nodes
             for line in n.meta.get("stack_trace", "").splitlines() if line.strip().startswith('File "')}
    assert not [f for f in files if f.endswith(("localmap_fx/compiler/dtensor_border.py",
                                                "localmap_fx/compiler/cacheable_border.py")) or "torchinductor" in f], files
    # the step's forward only: nothing after the graph break has an op
    assert len(graphs) == 1 and isinstance(seen[0], CacheableBorder if inner == "inductor" else DTensorBorder), (
        graphs, seen)


def test_lean_border_off_keeps_aotautograds_runtime():
    mesh = mesh_1d()
    backend, seen = _recording("aot_eager", lean_border=False)
    _regional_steps(mesh, 2, backend, steps=1)
    assert seen and not any(isinstance(b, DTensorBorder) for b in seen)


# --- gloo: real collectives ------------------------------------------------------

def _gloo_regional(rank, world_size, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    eager = _regional_steps(mesh, 5, None)
    report = {}
    for inner in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = _regional_steps(mesh, 5, localmap_fx.backend(inner))
        for s, (e, g) in enumerate(zip(eager, got)):
            for k, (a, b) in enumerate(zip(e, g)):
                if inner == "aot_eager":
                    ok = torch.equal(a, b)
                else:
                    ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5 * (1 + a.abs().max().item()))
                report[(inner, s, k)] = (bool(ok), (a - b).abs().max().item())
    return report


@pytest.mark.inductor  # the ranks compile with Inductor too
@pytest.mark.slow
def test_regional_stack_on_gloo_equals_eager_bitwise_under_aot_eager():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_gloo_regional, world_size=2, timeout=900)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    assert len(results[0]) == 2 * 2 * (1 + 1 + 2 * 5)


def test_converts_locally_is_replicate_to_partial_or_shard():
    from localmap_fx.compiler.tangent_plan import converts_locally

    R, P, S0 = Replicate(), Partial(), Shard(0)
    assert converts_locally((R,), (P,)) and converts_locally((R,), (S0,)) and converts_locally((P,), (P,))
    # these need communication: a reduction or a gather
    assert not converts_locally((P,), (R,)) and not converts_locally((S0,), (R,))
    assert not converts_locally((R,), (R, R))  # another mesh rank


def test_chained_finds_the_one_input_an_output_would_feed():
    """A stack's block: the output has the spec of exactly one input that
    requires grad; two such inputs, or one without grad, chain nothing."""
    from localmap_fx.compiler.border_wrapper import Slot
    from localmap_fx.compiler.tangent_plan import chained_outputs

    x = _dt((8, 16), [Replicate()], 0)
    w = _dt((16, 32), [Shard(1)], 1)
    y = _dt((8, 16), [Replicate()], 2)
    frozen = _dt((8, 16), [Replicate()], 3, requires_grad=False)

    def slot(t):
        return Slot(t._spec, tuple(t.shape))

    out = [slot(x)]
    assert chained_outputs([slot(w), slot(x)], out, [w, x]) == {0: 1}
    assert chained_outputs([slot(x), slot(y)], out, [x, y]) == {}  # ambiguous
    assert chained_outputs([slot(frozen)], out, [frozen]) == {}
    assert chained_outputs([slot(x)], [Slot(None)], [x]) == {}  # a plain output


def _border_inputs(gm, example_inputs):
    """What dtensor_border builds before compiling: slots, fake mode, the local
    examples and the inputs with a wide slot (Note: [A gradient wider than its input])."""
    from localmap_fx.compiler import dtensor_border as border_module

    outs = [n.meta["example_value"] for n in next(iter(gm.graph.find_nodes(op="output"))).args[0]]
    inputs, outputs = border_module._slots(example_inputs, outs)
    fake = border_module._fake_mode_of(example_inputs, inputs)
    local, wide = border_module._wrapper_examples(example_inputs, inputs, fake)
    return inputs, outputs, fake, local, wide


def _eager_runs_of(fn, args, tangent_sets):
    """``eager_runs`` over ``fn``'s border wrapper: per set of tangents (per
    output), the collectives eager DTensor issues and each input's gradient."""
    from localmap_fx.compiler.tangent_plan import eager_runs

    got: dict = {}

    def backend(gm, example_inputs):
        inputs, outputs, fake, local, wide = _border_inputs(gm, example_inputs)
        got.update(eager_runs(gm, local, fake, inputs, outputs, tangent_sets, wide))
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    return got


def test_eager_runs_count_a_gather_for_a_gradient_as_backward():
    """``_col_row`` for a Partial gradient: the forward's all_reduce, and in
    the backward two gathers of weights (DTensor's sharding propagation of
    the matrix products' backward) and a reduce_scatter, as AOTAutograd's
    joint graph has them; for Replicate, the forward's all_reduce alone.
    One forward serves both backwards."""
    x, w1, w2 = _col_row_args()
    P, R = ((Partial(),),), ((Replicate(),),)
    runs = _eager_runs_of(_col_row, (x, w1, w2), (P, R))
    assert (runs[P].collectives, runs[P].forward) == (4, 1)
    assert (runs[R].collectives, runs[R].forward) == (1, 1)
    grads = {t: tuple(g for g in run.grads if g is not None) for t, run in runs.items()}  # no mesh slot
    assert grads[P] == ((Partial(),), (Shard(1),), (Partial(),))
    assert grads[R] == ((Partial(),), (Shard(1),), (Shard(0),))


def test_count_collectives_sees_dtensor_dispatch_and_skips_waits():
    """A functional collective called on local tensors counts once (its wait
    not at all), and so does one DTensor's dispatch issues inside an op: a
    mode that took the DTensor op itself would see neither inside it."""
    import torch.distributed._functional_collectives as funcol

    from localmap_fx.compiler.tangent_plan import CountCollectives

    mesh = mesh_1d()
    x = _dt((8, 16), [Replicate()], 0)
    w = _dt((16, 32), [Shard(0)], 1)
    with CountCollectives() as count:
        funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", mesh))
    assert count.n == 1
    with CountCollectives() as count:
        (x @ w.redistribute(mesh, [Replicate()])).to_local()
    assert count.n == 1  # the gather of w
    with CountCollectives() as count:
        _col_row(x, _dt((16, 32), [Shard(1)], 2), _dt((32, 16), [Shard(0)], 3))
    assert count.n == 1  # the row's all_reduce


def test_guess_makes_a_chained_replicate_partial():
    from localmap_fx.compiler.tangent_plan import guessed_tangents

    R, P, S0 = Replicate(), Partial(), Shard(0)
    default = ((R,), (S0,), (R,), None)
    # output 0 feeds an input; 1 is Shard (stays); 2 feeds nothing; 3 is plain
    assert guessed_tangents(default, {0: 0, 1: 1}) == ((P,), (S0,), (R,), None)
    assert guessed_tangents(((S0, R),), {0: 0}) == ((S0, P),)
    assert guessed_tangents(default, {}) == default


def test_sends_asks_the_chained_input_for_the_guessed_placements():
    """A fixed point: the input a changed output feeds gets its gradient in
    the output's guessed placements, through its own slot (not the wide one)."""
    from localmap_fx.compiler.tangent_plan import sends

    R, P = Replicate(), Partial()
    x = _dt((8, 16), [Replicate()], 0)

    def rec(placements, wide=False):
        return [DTensor.from_local(x.to_local(), x.device_mesh, placements)._spec, wide]

    default, guess = ((R,),), ((P,),)
    assert sends([rec([P])], guess, {0: 0}, default)
    assert not sends([rec([R])], guess, {0: 0}, default)
    assert not sends([[]], guess, {0: 0}, default)  # no gradient
    assert not sends([rec([P], wide=True)], guess, {0: 0}, default)
    assert sends([rec([R])], default, {0: 0}, default)  # nothing changed, nothing asked


def _counting_joints():
    """AOTAutograd's joint pass, counting the joint graphs traced (the user's setting, scoped)."""
    from torch._functorch import config as functorch_config

    joints: list = []

    def count(joint, joint_inputs):
        joints.append(len(joint.graph.nodes))
        return joint

    return functorch_config.patch(joint_custom_pass=count), joints


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_plan_traces_and_compiles_one_variant(inner):
    """``_col_row``: eager runs on the fakes decide Replicate before anything
    is traced, so AOTAutograd traces one joint graph (the plan used to trace
    the Partial guess too and stop it at its joint), the inner compiler
    gets that variant's forward and backward, and a Partial gradient never
    compiles more."""
    x, w1, w2 = _col_row_args()
    graphs: list = []
    backend, seen = _recording(inner, on_aot_graph=lambda kind, gm: graphs.append(kind))
    f = torch.compile(_col_row, backend=backend)
    partial = _downstream([Partial()])
    counting, joints = _counting_joints()
    with counting:
        for _ in range(2):
            partial(f(x, w1, w2)).backward()
    (border,) = seen
    assert border.plan.text() == "compile (R); convert (P(sum))"
    assert graphs == ["forward", "backward"]
    assert len(joints) == 1


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_kept_guess_is_compiled_once(inner):
    """The TP block: the Partial guess is compiled, one joint traced, nothing
    else compiled, and a Replicate gradient (the last block's) converts to it."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    block, x = TPStack(mesh, 1, d=16, hidden=32).blocks[0], tp_stack_input(mesh, 8, 16)
    graphs: list = []
    backend, seen = _recording(inner, on_aot_graph=lambda kind, gm: graphs.append(kind))
    f = torch.compile(block, backend=backend)
    counting, joints = _counting_joints()
    with counting:
        for down in (_downstream([Partial()]), _downstream([Replicate()])):
            down(f(x)).backward()
    (border,) = seen
    assert border.plan.text() == "compile (P(sum))"
    assert graphs == ["forward", "backward"]
    assert len(joints) == 1


@torch.compiler.nested_compile_region
def _side(t):
    return t.sin() * 2


def _col_row_and_side(x, w1, w2, s):
    return _col_row(x, w1, w2), _side(_side(s))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_plan_counts_the_graphs_collectives_beside_a_subgraph(inner):
    """A graph with an ``invoke_subgraph`` beside the block: the eager run
    must count the graph's own collectives, the subgraph call running with
    the counting mode set aside (a miscount would make the costly Partial
    look free)."""
    x, w1, w2 = _col_row_args()
    s = torch.randn(4, requires_grad=True)
    seen: list = []

    def backend(gm, example_inputs):
        # the border itself (the backend's pipeline would make the subgraph a marked block)
        border = dtensor_border(gm, example_inputs, inner_compiler(BackendOptions(inner=inner, lean_border=False)))
        seen.append(border)
        return border

    y, k = torch.compile(_col_row_and_side, backend=backend)(x, w1, w2, s)
    (_downstream([Partial()])(y) + k.sum()).backward()
    (border,) = seen
    assert border.plan.text() == "compile (R, -); convert (P(sum), -)"


def test_guess_refused_is_a_refusal_not_an_error():
    """A chained graph that writes a plain input AOTAutograd copies first (eager
    could not run it on the fakes): the border refuses it, as it did before the
    plan compiled the guess."""
    def f(x, s):
        s.mul_(2)
        return x * 2, s * 3

    x = _dt((8, 16), [Replicate()], 0)
    s = torch.randn(4, requires_grad=True) * 1
    got = _refusal_of(f, (x, s))
    assert isinstance(got, Refusal) and got.code == Refused.WRITES_INPUT


def test_plan_that_cannot_run_eager_compiles_the_default_and_says_why(monkeypatch):
    """When eager DTensor cannot run a stack's block on the fake values, the
    border compiles the default (always correct), says so in its plan, and a
    Partial gradient still gives eager's values and placements."""
    from localmap_fx.compiler import dtensor_border as border_module

    def fail(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(border_module, "eager_runs", fail)
    x, w1, w2 = _col_row_args()
    partial = _downstream([Partial()])
    partial(_col_row(x, w1, w2)).backward()
    eager = _grads(x, w1, w2)
    _clear(x, w1, w2)
    backend, seen = _recording("aot_eager")
    partial(torch.compile(_col_row, backend=backend)(x, w1, w2)).backward()
    (border,) = seen
    assert border.plan.text() == "compile (R) (not planned: eager DTensor could not run the graph on fake values " \
                                 "(RuntimeError: boom))"
    got = _grads(x, w1, w2)
    assert [g[0] for g in got] == [g[0] for g in eager]
    for (_, a), (_, b) in zip(got, eager):
        torch.testing.assert_close(a, b)


def test_eager_grads_are_eagers_placements():
    """What the plan reads for the tangent it does not compile (and the
    cacheable border for a gradient in other placements than traced): the
    placements eager DTensor gives each input's gradient."""
    from localmap_fx.compiler.tangent_plan import eager_grads

    x, w1, w2 = _col_row_args()
    expected = {}
    for placements in ([Replicate()], [Partial()]):
        _downstream(placements)(_col_row(x, w1, w2)).backward()
        expected[placements[0]] = tuple(t.grad.placements for t in (x, w1, w2))
        _clear(x, w1, w2)
    got = {}

    def backend(gm, example_inputs):
        inputs, outputs, fake, local, wide = _border_inputs(gm, example_inputs)
        for p in (Replicate(), Partial()):
            got[p] = tuple(g for g in eager_grads(gm, local, fake, inputs, outputs, ((p,),), wide)
                           if g is not None)
        return gm.forward

    torch.compile(_col_row, backend=backend)(x, w1, w2)
    assert got == expected
    assert expected[Partial()][2] != expected[Replicate()][2]  # w2: P against S(0)


def test_eager_partial_backward_of_col_row_gathers_and_reduce_scatters():
    """torch's behaviour, pinned: eager DTensor backpropagates a Partial
    gradient through ``_col_row`` with the collectives AOTAutograd's trace
    of the same code has, two gathers of the weights and a reduce_scatter.
    A dispatch mode that takes DTensor ops itself sees none of them (they
    run inside DTensor's dispatch of ``mm``), which is how an earlier version
    of this test came to pin "no collective"."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from localmap_fx.compiler.tangent_plan import CountCollectives
    from localmap_fx.graph_utils import collective_name, is_collective_op

    class Naive(TorchDispatchMode):
        names: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_collective_op(func):
                Naive.names.append(collective_name(func))
            return func(*args, **(kwargs or {}))

    x, w1, w2 = _col_row_args()
    partial = _downstream([Partial()])
    with Naive():
        partial(_col_row(x, w1, w2)).backward()
    assert Naive.names == ["all_reduce"]  # the forward's, issued by redistribute on local tensors
    _clear(x, w1, w2)
    loss = partial(_col_row(x, w1, w2))
    with CountCollectives() as count:
        loss.backward()
    assert count.n == 3
    assert w2.grad.placements == (Partial(),)
