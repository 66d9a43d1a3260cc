"""Blocks marked with ``torch.compiler.nested_compile_region`` (issue 27):
traced once by Dynamo, inlined as layers, compiled once, the glue compiled too.

The model is :class:`localmap_fx.testing.models.TPStack` with ``marked=True``
(``nn.Module`` blocks, DTensor parameters, col + row regions, residual).
Structure is read from the graphs the backend hands on; numerics under
``LocalTensorMode`` (4 ranks in one process) and on 2 gloo ranks against
eager (aot_eager bitwise, inductor within 1e-5).  Speed lives in
``benchmarks/marked_bench.py``.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.layer_sharing.decide import LayerCost, Reason, decide
from localmap_fx.layer_sharing.split import META_PIECE
from localmap_fx.passes.inline_marked_blocks import META_MARKED, MarkedCall
from localmap_fx.testing.graphs import Recorder, normalized

from helpers import WORLD_SIZE, ltm_mesh_for, mesh_1d, rank_dtensor

INVOKE = torch.ops.higher_order.invoke_subgraph


def _stack(mesh, n, marked=True, d=16, hidden=32, batch=8):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    return TPStack(mesh, n, d=d, hidden=hidden, marked=marked), tp_stack_input(mesh, batch, d)


def _compile(n, inner="aot_eager", **opts) -> Recorder:
    """Compile and run one step of a marked stack; every stage's graph and the AOT graphs."""
    torch._dynamo.reset()
    model, x = _stack(mesh_1d(), n)
    rec = Recorder(inner, **opts)
    torch.compile(model, backend=rec.backend, fullgraph=True)(x).backward()
    return rec


def test_dynamo_traces_the_block_once_and_stamps_the_other_calls():
    captured = _compile(4).stage("captured")
    calls = [n for n in captured.graph.nodes if n.target is INVOKE]
    assert len(calls) == 4
    # one subgraph for all four calls: the block was traced once
    assert {n.args[0].target for n in calls} == {"subgraph_0"}
    assert [n.name for n in captured.graph.nodes if n.op == "get_attr"] == [
        "subgraph_0", "subgraph_1", "subgraph_2", "subgraph_3"]


def test_inlined_marked_calls_are_the_layers_and_compile_once():
    rec = _compile(4)
    inlined = rec.stage("inline_marked_blocks")
    assert not any(n.target is INVOKE for n in inlined.graph.nodes)
    marks = {n.meta[META_MARKED] for n in inlined.graph.nodes if META_MARKED in n.meta}
    assert marks == {MarkedCall("subgraph_0", i) for i in range(4)}
    outer = rec.stage("split_layers")
    pieces = [n.meta[META_PIECE] for n in outer.graph.nodes if META_PIECE in n.meta]
    # prefix (the weights' to_local), the four layers as one run, the tail (the loss): compiled, not eager
    assert [p.layer for p in pieces] == [None, 0, 1, 2, 3, None], pieces
    assert len({p.key for p in pieces if p.key is not None}) == 1
    # AOTAutograd traced one layer and the tail: the prefix only unwraps, it
    # runs as an Unwrap (Note: [A piece that only unwraps runs as an Unwrap])
    assert (len(rec.aot["forward"]), len(rec.aot["backward"])) == (2, 2)


class TestMarkedGraph(expecttest.TestCase):
    def test_outer_graph_calls_prefix_one_run_and_tail(self):
        outer = _compile(3).stage("layer_runs")
        self.assertExpectedInline(normalized(outer), """\
class localmap_fx_layers(torch.nn.Module):
    def forward(self, L_x_: "DTensor(f32[8, 16], R)", L_x_device_mesh : torch.distributed.device_mesh.DeviceMesh, L_self_modules_blocks_modules_0_parameters_w1_: "DTensor(f32[16, 32], S(1))", L_self_modules_blocks_modules_0_parameters_w2_: "DTensor(f32[32, 16], S(0))", L_self_modules_blocks_modules_1_parameters_w1_: "DTensor(f32[16, 32], S(1))", L_self_modules_blocks_modules_1_parameters_w2_: "DTensor(f32[32, 16], S(0))", L_self_modules_blocks_modules_2_parameters_w1_: "DTensor(f32[16, 32], S(1))", L_self_modules_blocks_modules_2_parameters_w2_: "DTensor(f32[32, 16], S(0))"):
        l_x_ = L_x_
        l_x_device_mesh = L_x_device_mesh
        l_self_modules_blocks_modules_0_parameters_w1_ = L_self_modules_blocks_modules_0_parameters_w1_
        l_self_modules_blocks_modules_0_parameters_w2_ = L_self_modules_blocks_modules_0_parameters_w2_
        l_self_modules_blocks_modules_1_parameters_w1_ = L_self_modules_blocks_modules_1_parameters_w1_
        l_self_modules_blocks_modules_1_parameters_w2_ = L_self_modules_blocks_modules_1_parameters_w2_
        l_self_modules_blocks_modules_2_parameters_w1_ = L_self_modules_blocks_modules_2_parameters_w1_
        l_self_modules_blocks_modules_2_parameters_w2_ = L_self_modules_blocks_modules_2_parameters_w2_
        piece_0 = self.piece_0(l_self_modules_blocks_modules_0_parameters_w1_, l_self_modules_blocks_modules_0_parameters_w2_, l_self_modules_blocks_modules_1_parameters_w1_, l_self_modules_blocks_modules_1_parameters_w2_, l_self_modules_blocks_modules_2_parameters_w1_, l_self_modules_blocks_modules_2_parameters_w2_, l_x_)
        getitem: "f32[16, 8]" = piece_0[0]
        getitem_1: "f32[8, 16]" = piece_0[1]
        getitem_2: "f32[16, 8]" = piece_0[2]
        getitem_3: "f32[8, 16]" = piece_0[3]
        getitem_4: "f32[16, 8]" = piece_0[4]
        getitem_5: "f32[8, 16]" = piece_0[5]
        getitem_6: "f32[8, 16]" = piece_0[6]
        run_0 = self.run_0(getitem_6, getitem, getitem_1, getitem_2, getitem_3, getitem_4, getitem_5)
        getitem_11: "f32[8, 16]" = run_0[0]
        piece_4 = self.piece_4(getitem_11, l_x_device_mesh)
        getitem_10: "DTensor(f32[], R)" = piece_4[0]
        return (getitem_10,)
""")


def test_marked_frame_is_shared_where_auto_would_keep_it_whole():
    rec = _compile(3, inner="aot_eager")  # 3 < AUTO_MIN_LAYERS
    assert "split_layers" in rec.stages
    from localmap_fx.layer_sharing.plan import LayerPlan, LayerSpan

    plan = LayerPlan(2, 0, (LayerSpan(0, 0, 3, ("k",)), LayerSpan(1, 3, 6, ("k",))))
    cheap = LayerCost(flops=10, device="cpu")
    assert decide(plan, "auto", cheap, ("x",)).reason is Reason.FEW_LAYERS
    marked = decide(plan, "auto", cheap, ("x",), marked=True)
    assert marked.reason is Reason.MARKED and marked.shares
    assert "marked by the user" in marked.text and "x" in marked.text
    assert decide(plan, False, marked=True).reason is Reason.OFF


def test_share_layers_false_compiles_a_marked_stack_as_one_graph():
    rec = _compile(3, share_layers=False)
    assert "split_layers" not in rec.stages
    assert not any(n.target is INVOKE for n in rec.stage("inline_marked_blocks").graph.nodes)
    assert (len(rec.aot["forward"]), len(rec.aot["backward"])) == (1, 1)


def _tree(loss, model, x):
    return [loss, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_fake_pg_marked_equals_the_unmarked_stack_shared(inner):
    # What this checks: marking gives the program found layers give.  Both
    # equal eager on the fake group too (tests/compile/test_whole_gradients.py),
    # and with real collectives: the gloo test below.
    results = []
    for marked in (False, True):
        torch._dynamo.reset()
        model, x = _stack(mesh_1d(), 3, marked=marked)
        be = localmap_fx.backend(inner, share_layers=True)
        loss = torch.compile(model, backend=be, fullgraph=True)(x)
        loss.backward()
        results.append([t.to_local() for t in _tree(loss, model, x)])
    for a, b in zip(*results):
        if inner == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.inductor
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_compiled_training_step_runs_marked_blocks(inner):
    """``loss.backward()`` inside the compiled function graph-breaks, and the
    backward runs with Dynamo's frame hook set.  The marked frame's prefix
    and loss used to keep AOTAutograd's subclass runtime, whose backward
    Dynamo traced and failed on ("SymNodeVariable() is not a constant", as
    upstream's regional step does); the prefix is now an Unwrap and the loss
    runs behind the lean DTensor border, so the step runs, with the
    gradients of the model compiled on its own."""
    results = []
    for whole_step in (False, True):
        torch._dynamo.reset()
        model, x = _stack(mesh_1d(), 3)
        be = localmap_fx.backend(inner)
        if whole_step:
            def step(x, model=model):
                loss = model(x)
                loss.backward()
                return loss

            loss = torch.compile(step, backend=be)(x)
        else:
            loss = torch.compile(model, backend=be)(x)
            loss.backward()
        results.append([t.to_local() for t in _tree(loss, model, x)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.inductor
def test_first_block_unshared_keeps_the_parameters_local_tensors_untouched():
    """An input that needs no grad makes the first marked block a layer of its
    own, merged with the prefix, where the shared blocks' weights are unwrapped.
    Compiled by Inductor, that piece returned those local tensor objects and
    AOTAutograd gave them a grad_fn: the frame recompiled on step 2 (found with
    torchtitan-shaped blocks: Note: [Unwraps that leave an unshared piece stand alone])."""
    torch._dynamo.reset()
    model, x = _stack(mesh_1d(), 3)
    x = x.detach()
    frames = []
    be = localmap_fx.backend("inductor")

    def count(gm, example_inputs):
        frames.append(gm)
        return be(gm, example_inputs)

    f = torch.compile(model, backend=count)
    for _ in range(2):
        f(x).backward()
    assert [p for p in model.parameters() if p._local_tensor.requires_grad] == []
    assert len(frames) == 1


def test_upstream_fails_on_a_marked_dtensor_block():
    """Pins torch 2.14.1: with torch's ``local_map`` and any backend of torch's,
    AOTAutograd re-traces the marked block's ``invoke_subgraph`` body on the
    unwrapped FakeTensors, where ``to_local`` does not exist (issue 27)."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    torch._dynamo.reset()
    model, x = TPStack(mesh_1d(), 3, d=16, hidden=32, impl="torch", marked=True), tp_stack_input(mesh_1d(), 8, 16)
    with pytest.raises(Exception, match="'FakeTensor' object has no attribute 'to_local'"):
        torch.compile(model, backend="aot_eager")(x).backward()


class _NormedBlock(torch.nn.Module):
    def __init__(self, mesh, seed: int) -> None:
        super().__init__()
        w = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
        self.w = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
        self.scale = torch.nn.Parameter(distribute_tensor(torch.ones(16), mesh, [Replicate()]))

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + torch.relu(torch.nn.functional.rms_norm(x, (16,), self.scale) @ self.w)


class _NormedStack(torch.nn.Module):
    """torchtitan's llama3 on its ``partial_dtensor`` backend, in small: marked
    blocks, then a final RMSNorm whose weight is a DTensor."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(_NormedBlock(mesh, seed) for seed in range(2)))
        self.norm = torch.nn.Parameter(distribute_tensor(torch.ones(16), mesh, [Replicate()]))

    def forward(self, x):
        return torch.nn.functional.rms_norm(self.blocks(x), (16,), self.norm)


def test_dynamo_sees_a_marked_calls_dtensor_output_as_a_plain_tensor():
    """Pins torch 2.14.1 (Dynamo): the output of a stamped marked call is a
    plain FakeTensor to Dynamo, so a DTensor op after the blocks (torchtitan's
    final norm) fails while tracing, before any backend is called."""
    mesh = mesh_1d()
    model = _NormedStack(mesh)
    x = distribute_tensor(torch.randn(4, 16), mesh, [Replicate()]).requires_grad_()
    called = []

    def backend(gm, example_inputs):
        called.append(gm)
        return localmap_fx.backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="rms_norm.*got mixed torch.Tensor and DTensor"):
        torch.compile(model, backend=backend, fullgraph=True)(x)
    assert called == []


def test_local_tensor_mode_fails_in_dynamo_upstream():
    """Pins torch 2.14.1: Dynamo cannot trace a marked block on LocalTensors
    (``invoke_subgraph`` has no LocalTensor rule), before any backend runs; so
    marked blocks are checked on the fake group and on gloo, not here."""
    with LocalTensorMode(WORLD_SIZE):
        torch._dynamo.reset()
        model, _ = _stack(ltm_mesh_for(1), 2)
        x = rank_dtensor(torch.randn(8, 16), ltm_mesh_for(1), [Replicate()])
        with pytest.raises(Exception, match="Expected FakeTensor after unwrapping, got .*LocalTensor"):
            torch.compile(model, backend=localmap_fx.backend("aot_eager"), fullgraph=True)(x)


def _gloo_marked_vs_eager(rank, world_size, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))

    def run(fn, model, x):
        loss = fn(x)
        loss.backward()
        return [t.full_tensor() for t in (loss, x.grad, *(p.grad for p in model.parameters()))]

    model, x = _stack(mesh, 4)
    eager = run(model, model, x)
    report = {}
    for inner in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        model, x = _stack(mesh, 4)
        got = run(torch.compile(model, backend=localmap_fx.backend(inner), fullgraph=True), model, x)
        for k, (a, b) in enumerate(zip(eager, got)):
            ok = torch.equal(a, b) if inner == "aot_eager" else torch.allclose(
                a, b, rtol=1e-5, atol=1e-5 * (1 + a.abs().max().item()))
            report[(inner, k)] = (bool(ok), (a - b).abs().max().item())
    return report


@pytest.mark.inductor  # the ranks compile with Inductor too
@pytest.mark.slow
def test_marked_stack_on_gloo_equals_eager():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_gloo_marked_vs_eager, world_size=2, timeout=900)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    assert len(results[0]) == 2 * (1 + 1 + 2 * 4)


@torch.compiler.nested_compile_region
def _to_shard(x):
    return (x * 2).redistribute(x.device_mesh, [Shard(0)])


def _four_calls(x):
    return _to_shard(_to_shard(_to_shard(_to_shard(x)))).sum()


def test_a_call_stamped_for_other_placements_is_refused():
    """Pins torch 2.14.1: Dynamo stamps the body traced on a Replicate input out
    for the Shard(0) output of the first call (Note: [A stamped call's placements]);
    the backend refuses instead of running a body traced for other placements."""
    x = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Replicate()]).requires_grad_()
    torch._dynamo.reset()
    rec = Recorder("aot_eager")
    with pytest.raises(Exception, match=r"gets .* as a DTensor \(Shard\(dim=0\),\).*traced for \(Replicate\(\),\)"):
        torch.compile(_four_calls, backend=rec.backend, fullgraph=True)(x)
    calls = [n for n in rec.stage("captured").graph.nodes if n.target is INVOKE]
    assert [n.args[0].target for n in calls] == ["subgraph_0"] * 4


# --- a body whose backward conjugates (torchtitan's llama3: complex RoPE) ---------------


def _rotate(h: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """torchtitan's ComplexRoPE in small: adjacent pairs as complex numbers, times
    unit complex frequencies; the backward of the product conjugates."""
    hc = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
    return torch.view_as_real(hc * freqs).flatten(-2).type_as(h)


def _freqs(rows: int, cols: int) -> torch.Tensor:
    angles = torch.rand(rows, cols // 2, generator=torch.Generator().manual_seed(3))
    return torch.polar(torch.ones_like(angles), angles)


class _RotaryBlock(torch.nn.Module):
    def __init__(self, d: int, batch: int, seed: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)) / d**0.5)
        self.register_buffer("freqs", _freqs(batch, d))

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _rotate(x @ self.w, self.freqs)


def _rotary_stack(n: int = 3, d: int = 8, batch: int = 4):
    model = torch.nn.Sequential(*(_RotaryBlock(d, batch, seed) for seed in range(n)))
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(9)).requires_grad_()
    return model, x


def _grads_of(fn, model, x) -> list[torch.Tensor]:
    x.grad = None
    model.zero_grad(set_to_none=True)
    loss = fn(x).pow(2).sum()
    loss.backward()
    return _tree(loss.detach(), model, x)


def test_upstream_cannot_differentiate_a_marked_body_that_conjugates():
    """Pins torch 2.14.1: a marked block whose backward conjugates (complex RoPE,
    as in torchtitan's llama3 with its blocks marked) fails in AOTAutograd, no
    DTensor involved: the ``invoke_subgraph`` HOP has no Conjugate-key rule.
    The backend inlines the marked calls, so it never hands one to AOTAutograd."""
    model, x = _rotary_stack()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="invoke_subgraph at dispatch key DispatchKey.Conjugate"):
        _grads_of(torch.compile(model, backend="aot_eager"), model, x)


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_marked_body_that_conjugates_compiles_once_and_equals_eager(inner):
    model, x = _rotary_stack()
    eager = _grads_of(model, model, x)
    torch._dynamo.reset()
    rec = Recorder(inner)
    got = _grads_of(torch.compile(model, backend=rec.backend, fullgraph=True), model, x)
    pieces = [n.meta[META_PIECE] for n in rec.stage("split_layers").graph.nodes if META_PIECE in n.meta]
    assert [p.layer for p in pieces if p.layer is not None] == [0, 1, 2]
    assert len({p.key for p in pieces if p.key is not None}) == 1  # one layer piece, compiled once
    for a, b in zip(eager, got):
        if inner == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


class _ConfiguredMarkedBlock(torch.nn.Module):
    """A marked block holding its own ``local_map``, whose output placement
    is the instance's; ``planned``: called positionally (capture's planned
    path), else with a keyword (its traced path)."""

    def __init__(self, mesh, out, planned: bool) -> None:
        super().__init__()

        def body(a, scale=1.0):
            return a * scale

        self.mesh = mesh
        self.planned = planned
        self.inner = localmap_fx.local_map(body, out_placements=[out], in_placements=([Shard(0)],), device_mesh=mesh)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        y = self.inner(x) if self.planned else self.inner(x, scale=2.0)
        return y.redistribute(self.mesh, [Shard(0)]) * 1.0


@pytest.mark.parametrize("planned", [True, False])
def test_stamped_calls_of_blocks_whose_local_maps_differ_give_eager_values(planned):
    """Note: [A call's plan depends on its local_map] (capture/call.py): a
    marked block is stamped out for an instance only if that instance's
    ``local_map`` is configured alike; one declaring another output placement
    is traced again (with its plan, planned path: the wrong values before)."""
    mesh = mesh_1d()
    blocks = torch.nn.ModuleList(_ConfiguredMarkedBlock(mesh, out, planned)
                                 for out in (Shard(0), Replicate(), Shard(0), Replicate()))
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])

    def run(x):
        return [blk(x) for blk in blocks]

    eager = run(x)
    torch._dynamo.reset()
    got = torch.compile(run, backend=localmap_fx.backend("aot_eager"), fullgraph=True)(x)
    for e, g in zip(eager, got):
        assert g.placements == e.placements
        assert torch.equal(g.to_local(), e.to_local())
