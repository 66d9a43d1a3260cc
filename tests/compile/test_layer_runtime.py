"""Shared layers run as their compiled forward and backward (issue 21).

:mod:`localmap_fx.layer_sharing.runtime`: a :class:`CompiledLayer` is
built from what AOTAutograd compiled for a piece, or refused (a Refusal);
consecutive layer calls become one :class:`LayerRun` (one autograd node).
The run's gradient bookkeeping is checked on hand-written layers against
eager autograd; the compiled path on a TP stack (fake process group) for
structure, and on 2 gloo ranks in ``test_deep_models`` / ``test_share_layers``
for numerics.
"""

from __future__ import annotations

import json
import operator
import os

import pytest
import torch
import torch.fx as fx
from torch._functorch._aot_autograd.schemas import OutputType

import localmap_fx
from localmap_fx.compiler.inner import AotGraph
from localmap_fx.layer_sharing.runs import chain_layer_runs as _chain_layer_runs
from localmap_fx.layer_sharing.runs import find_layer_runs
from localmap_fx.layer_sharing.runtime import CompiledLayer, LayerRun, Refusal, Refused, RunStep, compiled_layer
from localmap_fx.layer_sharing.whole_gradients import WholeGradient
from localmap_fx.passes import apply
from localmap_fx.passes.hoist_tangent_reductions import TangentReduction

from helpers import mesh_1d, waiting_collectives


def chain_layer_runs(outer, runs, layer_of):
    return apply(lambda g: _chain_layer_runs(g, runs, layer_of), outer)

CPU = torch.device("cpu")


def _scale_layer(n: int) -> CompiledLayer:
    """y = tanh(x * w) written as AOTAutograd's partitioned pair would be."""

    def fw(args):
        x, w = args
        args.clear()
        y = torch.tanh(x * w)
        return [y, x, w, y]

    def bw(args):
        x, w, y, g = args
        args.clear()
        gz = g * (1 - y * y)
        return [gz * w, gz * x]

    return CompiledLayer(fw, bw, 1, (((n,), (1,)),), ((torch.float32, CPU),))


def _split_layer(n: int) -> CompiledLayer:
    """(a, b) = (x * w, x + w): two outputs, so a tangent can be missing."""

    def fw(args):
        x, w = args
        return [x * w, x + w, x, w]

    def bw(args):
        x, w, ga, gb = args
        return [ga * w + gb, ga * x + gb]

    layout = ((n,), (1,))
    return CompiledLayer(fw, bw, 2, (layout, layout), ((torch.float32, CPU),) * 2)


class _Piece(torch.nn.Module):
    def __init__(self, fn, runtime="layer"):
        super().__init__()
        self.fn = fn
        self.runtime = runtime

    def forward(self, *args):
        return self.fn(*args)


def _outer(layers, wiring):
    """An outer graph like split_layers' (call_module + getitem) over ``layers``.

    ``wiring[i]`` names piece i's inputs: "x", "w<i>", or "<j>.<k>" (output k of piece j).
    """
    g = fx.Graph()
    root = torch.nn.Module()
    env = {"x": g.placeholder("x")}
    for i in range(len(layers)):
        env[f"w{i}"] = g.placeholder(f"w{i}")
    last = None
    for i, (layer, ins) in enumerate(zip(layers, wiring)):
        root.add_module(f"piece_{i}", _Piece(layer))
        call = g.call_module(f"piece_{i}", tuple(env[s] for s in ins))
        for k in range(layer.n_outputs):
            env[f"{i}.{k}"] = last = g.call_function(operator.getitem, (call, k))
    g.output((last, env["0.0"]))
    return fx.GraphModule(root, g)


def _eager_of(layers, wiring, x, ws):
    env = {"x": x, **{f"w{i}": w for i, w in enumerate(ws)}}
    last = None
    for i, (layer, ins) in enumerate(zip(layers, wiring)):
        outs = layer(*[env[s] for s in ins])  # one _LayerFunction per layer
        for k, o in enumerate(outs):
            env[f"{i}.{k}"] = last = o
    return last, env["0.0"]


def _plain_of(wiring, x, ws):
    """The same math with torch's own autograd (no compiled layers at all)."""
    env = {"x": x, **{f"w{i}": w for i, w in enumerate(ws)}}
    last = None
    for i, ins in enumerate(wiring):
        a, b = (env[s] for s in ins)
        outs = [torch.tanh(a * b)] if len(ins) == 2 and i % 2 == 0 else [a * b, a + b]
        for k, o in enumerate(outs):
            env[f"{i}.{k}"] = last = o
    return last, env["0.0"]


def _inputs(n_layers, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen).requires_grad_()
    ws = [torch.randn(n, generator=gen).requires_grad_() for _ in range(n_layers)]
    return x, ws


# layers alternate: even = tanh(x * w) (one output), odd = (x * w, x + w);
# piece 3 reads output 1 of piece 1 (skips piece 2), piece 2 output 0 of piece 1;
# the graph returns the last output and piece 0's output (read after the run too)
WIRING = [("x", "w0"), ("0.0", "w1"), ("1.0", "w2"), ("1.1", "w3"), ("3.0", "w4")]


def _layers(n=5):
    return [_scale_layer(n) if i % 2 == 0 else _split_layer(n) for i in range(len(WIRING))]


def test_a_run_of_layers_gives_autograds_gradients():
    outer = _outer(_layers(), WIRING)
    runs = find_layer_runs(outer, lambda n: True)
    assert [[c.target for c in r] for r in runs] == [[f"piece_{i}" for i in range(5)]]
    chained = chain_layer_runs(outer, runs, lambda n: outer.get_submodule(str(n.target)).fn)
    assert [n.target for n in chained.graph.nodes if n.op == "call_module"] == ["run_0"]
    run: LayerRun = chained.get_submodule("run_0").run
    assert run.text() == (
        "run of 5 layers [0: piece_0(in0, in1); 1: piece_1(0.0, in2); 2: piece_2(1.0, in3); "
        "3: piece_3(1.1, in4); 4: piece_4(3.0, in5)] -> (0.0, 4.0)")

    results = {}
    for how, fn in (("run", lambda x, ws: chained(x, *ws)),
                    ("per_layer", lambda x, ws: _eager_of(_layers(), WIRING, x, ws)),
                    ("autograd", lambda x, ws: _plain_of(WIRING, x, ws))):
        x, ws = _inputs(5)
        last, first = fn(x, ws)
        # piece 3's output 1 is read by nobody (a zero tangent); piece 0's
        # output is read inside the run and after it (gradients add up)
        (last.sum() + 3 * first.sum()).backward()
        results[how] = [last.detach(), first.detach(), x.grad, *(w.grad for w in ws)]
    for a, b, c in zip(results["run"], results["per_layer"], results["autograd"]):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_a_missing_tangent_is_zeros_and_no_grad_runs_forward_only():
    layers = [_split_layer(4), _split_layer(4)]
    wiring = [("x", "w0"), ("0.0", "w1")]
    outer = _outer(layers, wiring)
    chained = chain_layer_runs(outer, find_layer_runs(outer, lambda n: True),
                               lambda n: outer.get_submodule(str(n.target)).fn)
    x, ws = _inputs(2, n=4)
    last, first = chained(x, *ws)
    last.sum().backward()  # piece 1's output 0 and piece 0's output 0 get no gradient from outside
    x2, ws2 = _inputs(2, n=4)
    a = x2 * ws2[0]
    (a + ws2[1]).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(ws[0].grad, ws2[0].grad)
    torch.testing.assert_close(ws[1].grad, ws2[1].grad)
    with torch.no_grad():
        out = chained(x, *ws)
    assert not out[0].requires_grad and torch.equal(out[0], last.detach())


def test_runs_stop_at_a_piece_that_is_not_a_layer():
    outer = _outer(_layers(), WIRING)
    runs = find_layer_runs(outer, lambda n: n.target != "piece_2")
    assert [[c.target for c in r] for r in runs] == [["piece_0", "piece_1"], ["piece_3", "piece_4"]]
    assert find_layer_runs(outer, lambda n: n.target == "piece_0") == []
    # a layer whose output's gradient arrives whole is a run by itself
    # (Note: [The last layer's gradient arrives whole])
    alone = find_layer_runs(outer, lambda n: n.target in ("piece_0", "piece_2"), alone=lambda n: n.target == "piece_2")
    assert [[c.target for c in r] for r in alone] == [["piece_2"]]


def test_a_run_checks_saved_versions_and_keeps_them_for_retain_graph():
    layer = _scale_layer(3)
    x, ws = _inputs(1, n=3)
    (y,) = layer(x, ws[0])
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # saved values kept for the second backward: gradients add up
    x2, ws2 = _inputs(1, n=3)
    torch.tanh(x2 * ws2[0]).sum().mul(2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    (y,) = layer(x, ws[0])
    with torch.no_grad():
        ws[0].mul_(2)  # a saved input written before the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_backward_that_reuses_saved_buffers_refuses_retain_graph():
    import dataclasses

    layer = dataclasses.replace(_scale_layer(3), donates_buffers=True)
    x, ws = _inputs(1, n=3)
    (y,) = layer(x, ws[0])
    with pytest.raises(RuntimeError, match="donated buffers"):
        y.sum().backward(retain_graph=True)


def test_tangents_get_the_traced_strides():
    seen = []

    def fw(args):
        return [args[0] * 2]

    def bw(args):
        seen.append(args[0].stride())
        return [args[0] * 2]

    layer = CompiledLayer(fw, bw, 1, (((2, 3), (3, 1)),), ((torch.float32, CPU),))
    x = torch.randn(2, 3, requires_grad=True)
    (y,) = layer(x)
    y.backward(torch.randn(3, 2).t())  # a transposed (non-contiguous) gradient
    assert seen == [(3, 1)]
    torch.testing.assert_close(x.grad.stride(), (3, 1))


def test_saved_objects_and_sizes_reach_the_backward_in_its_order():
    group = object()  # stands for an opaque value, e.g. a process group

    def fw(args):
        x, w = args
        return [x * w, x, w, group, 3]  # outputs, tensors, objects, sizes

    def bw(args):
        n, x, w, obj, g = args  # sizes, tensors, objects, tangents
        if obj is not group or n != 3:
            raise AssertionError(f"backward got {args!r}")
        return [g * w, g * x]

    layer = CompiledLayer(fw, bw, 1, (((3,), (1,)),), ((torch.float32, CPU),), n_opaque=1, n_symints=1)
    outer = _outer([layer, layer], [("x", "w0"), ("0.0", "w1")])
    chained = chain_layer_runs(outer, find_layer_runs(outer, lambda n: True),
                               lambda n: outer.get_submodule(str(n.target)).fn)
    for how in ("single", "run"):
        x, ws = _inputs(2, n=3)
        if how == "run":
            last, _ = chained(x, *ws)
        else:
            (last,) = layer(*layer(x, ws[0]), ws[1])
        last.sum().backward()
        torch.testing.assert_close(x.grad, ws[0] * ws[1])
        torch.testing.assert_close(ws[1].grad, x * ws[0])


def test_an_output_without_a_tangent_is_not_differentiable():
    def fw(args):
        x, w = args
        return [x * w, (x > 0).sum(), x, w]  # the count has no tangent

    def bw(args):
        x, w, g = args
        return [g * w, g * x]

    layer = CompiledLayer(fw, bw, 2, (((3,), (1,)),), ((torch.float32, CPU),), tangent_outputs=(0,))
    outer = _outer([layer, layer], [("x", "w0"), ("0.0", "w1")])
    chained = chain_layer_runs(outer, find_layer_runs(outer, lambda n: True),
                               lambda n: outer.get_submodule(str(n.target)).fn)
    x, ws = _inputs(2, n=3)
    count, first = chained(x, *ws)  # piece 1's count, piece 0's product
    assert not count.requires_grad and first.requires_grad
    (first * 2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * ws[0])
    assert ws[1].grad is None  # piece 1's product leads nowhere
    single = layer(x.detach().requires_grad_(), ws[0])
    assert single[0].requires_grad and not single[1].requires_grad


class _Meta:
    """The ViewAndMutationMeta fields compiled_layer reads, all benign."""

    def __init__(self, **changes):
        from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta

        inp = type("I", (), dict(mutates_data=False, mutates_metadata=False, mutates_storage_metadata=False))
        out = type("O", (), dict(output_type=OutputType.non_alias, raw_type=torch.Tensor,
                                 requires_grad_for_backward=True))
        self.input_info = [inp()]
        self.output_info = [out()]
        self.num_intermediate_bases = 0
        self.tokens = {}
        self.num_backward_tokens = 0
        self.num_graphsafe_rng_states = 0
        self.num_symints_saved_for_bw = 0
        self.num_opaque_objects_saved_for_bw = 0
        self.subclass_fw_graph_out_meta = [PlainTensorMeta(0)]
        self.is_rng_op_functionalized = False
        self.num_tensors_saved_with_no_vc_check = 0
        self.bw_donated_idxs = []
        self.__dict__.update(changes)


def _kept():
    def fw_f(x):
        return (x * 2, x)

    def bw_f(x, tangents_1):
        return (tangents_1 * 2,)

    fw = fx.symbolic_trace(fw_f)
    bw = fx.symbolic_trace(bw_f)
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = torch.empty(3)
    return [AotGraph("forward", fw, lambda a: fw_f(*a)), AotGraph("backward", bw, lambda a: bw_f(*a))]


@pytest.mark.parametrize("changes, code, reason", [
    (dict(input_info=[type("I", (), dict(mutates_data=True, mutates_metadata=False,
                                         mutates_storage_metadata=False))()]), Refused.WRITES_INPUT,
     "writes to an input"),
    (dict(num_intermediate_bases=1), Refused.ALIASED_OUTPUT, "aliases"),
    (dict(tokens={0: None}), Refused.EFFECTS, "effect tokens"),
    (dict(subclass_fw_graph_out_meta=[object()]), Refused.SUBCLASS_OUTPUT, "tensor subclass"),
    (dict(is_rng_op_functionalized=True), Refused.RNG, "RNG is functionalized"),
    (dict(num_tensors_saved_with_no_vc_check=1), Refused.UNCHECKED_SAVED, "does not version-check"),
    (dict(output_info=[type("O", (), dict(output_type=OutputType.non_alias, raw_type=torch.Tensor,
                                          requires_grad_for_backward=False))()]), Refused.CALLING_CONVENTION,
     "1 tangents for 0"),
])
def test_compiled_layer_refuses_what_needs_aotautograds_runtime(changes, code, reason):
    assert isinstance(compiled_layer(_kept(), _Meta()), CompiledLayer)
    why = compiled_layer(_kept(), _Meta(**changes))
    assert isinstance(why, Refusal) and why.code is code and reason in why.text
    none = compiled_layer(_kept()[:1], _Meta())
    assert isinstance(none, Refusal) and none.code is Refused.NO_BACKWARD and "no backward" in none.text


def test_a_dtensor_at_the_border_keeps_aotautograds_runtime():
    from torch.distributed.tensor import Replicate, distribute_tensor

    dt = distribute_tensor(torch.ones(4), mesh_1d(), [Replicate()])
    assert compiled_layer(_kept(), _Meta(), border=[torch.ones(4), dt]) == Refusal(
        Refused.SUBCLASS_AT_BORDER, "a DTensor crosses its border")
    assert isinstance(compiled_layer(_kept(), _Meta(), border=[torch.ones(4), 3]), CompiledLayer)


def _pieces_summary(tmp_path, model, x, **opts):
    torch._dynamo.reset()
    f = torch.compile(model, backend=localmap_fx.backend(dump_dir=str(tmp_path), **opts))
    f(x).backward()
    (frame,) = os.listdir(tmp_path)
    with open(tmp_path / frame / "summary.json") as fh:
        return json.load(fh)["pieces"]


def _functional_stack(mesh, n):
    from benchmarks.models import build_tp_stack

    step, st = build_tp_stack(mesh, "ours", n_blocks=n, batch=8, d=8, hidden=16)
    return (lambda x: step(x, st["w1"], st["w2"])), st["x"]


@pytest.mark.parametrize("inner, style", [("aot_eager", "module"), ("inductor", "module"), ("aot_eager", "functional")])
def test_shared_tp_layers_run_as_one_run(tmp_path, inner, style):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    if style == "module":
        model, x = TPStack(mesh, 5, d=16, hidden=32), tp_stack_input(mesh, 8, 16)
    else:  # no residual: the border is the next layer's to_local (Note: [Where layers are cut])
        model, x = _functional_stack(mesh, 5)
    pieces = _pieces_summary(tmp_path, model, x, inner=inner, share_layers=True)
    rows = [(r["layers"], r["calls"], r["runtime"]) for r in pieces["rows"]]
    # prefix (to_local of the weights), every layer (one compiled piece, the last
    # one too: Note: [The last layer's border]), the loss (a DTensor: behind the
    # lean DTensor border); the prefix only unwraps (Note: [A piece that only
    # unwraps runs as an Unwrap])
    assert rows == [([], 1, "unwrap of 11 DTensors"), ([0, 1, 2, 3, 4], 5, "layer in run_0"),
                    ([], 1, "DTensor border")], rows


def test_layers_without_a_backward_keep_aotautograds_runtime(tmp_path):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    model = TPStack(mesh, 4, d=16, hidden=32).requires_grad_(False)
    x = tp_stack_input(mesh, 8, 16).detach()
    torch._dynamo.reset()
    f = torch.compile(model, backend=localmap_fx.backend("aot_eager", share_layers=True, dump_dir=str(tmp_path)))
    f(x)
    (frame,) = os.listdir(tmp_path)
    with open(tmp_path / frame / "summary.json") as fh:
        rows = json.load(fh)["pieces"]["rows"]
    layer_row = next(r for r in rows if r["layers"] and r["calls"] > 1)
    assert layer_row["runtime"] == "aot: AOTAutograd compiled no backward for it (no input requires grad)"


class _DTensorWeightBlock(torch.nn.Module):
    """torchtitan's shape: DTensor weights used by F.linear outside the region."""

    def __init__(self, mesh, d, seed):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.mesh = mesh
        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(d, d, generator=gen) / d, mesh, [Shard(0)]))
        self.wo = torch.nn.Parameter(distribute_tensor(torch.randn(d, d, generator=gen) / d, mesh, [Shard(1)]))
        self.act = localmap_fx.local_map(torch.tanh, out_placements=[Shard(1)], in_placements=([Shard(1)],),
                                         device_mesh=mesh)
        self.replicate = [Replicate()]

    def forward(self, x):
        h = self.act(torch.nn.functional.linear(x, self.w))
        return x + torch.nn.functional.linear(h, self.wo).redistribute(self.mesh, self.replicate)


@pytest.mark.slow
def test_auto_shares_layers_that_dtensors_cross_behind_the_lean_border(tmp_path):
    """Note: [No DTensor at an automatic border]: behind the lean DTensor border
    (the default) "auto" shares such layers; without it, it keeps one graph and
    share_layers=True runs them through AOTAutograd's runtime."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = mesh_1d()
    blocks = torch.nn.Sequential(*(_DTensorWeightBlock(mesh, 8, i) for i in range(8)))
    x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()

    def model(x):
        return blocks(x).sum()

    pieces = _pieces_summary(tmp_path / "auto", model, x, inner="aot_eager")
    assert pieces["shared"] is True
    assert {r["runtime"] for r in pieces["rows"] if r["calls"] > 1} == {"DTensor border"}
    pieces = _pieces_summary(tmp_path / "auto_aot", model, x, inner="aot_eager", lean_border=False)
    assert pieces["shared"] is False
    assert "DTensors would cross the layer borders" in pieces["reason"], pieces["reason"]
    pieces = _pieces_summary(tmp_path / "shared", model, x, inner="aot_eager", share_layers=True, lean_border=False)
    assert pieces["shared"] is True
    assert {r["runtime"] for r in pieces["rows"] if r["calls"] > 1} == {"aot: a DTensor crosses its border"}

def _reducing_layer(n: int, seen: list) -> CompiledLayer:
    """y = x * w written as a partitioned pair whose backward had its
    tangent's all_reduce taken out: bw(x, w, g, reduced_g) -> (g, reduced_g * x);
    ``seen`` records what each backward call received."""

    def fw(args):
        x, w = args
        return [x * w, x, w]

    def bw(args):
        x, w, g, reduced = args
        seen.append((g.clone(), reduced.clone()))
        return [g, reduced * x]

    return CompiledLayer(fw, bw, 1, (((n,), (1,)),), ((torch.float32, CPU),),
                         reductions=(TangentReduction(0, "sum", mesh_1d().get_group(0).group_name, None),))


def test_a_run_supplies_the_reductions_taken_out_of_a_layers_backward():
    """Note: [The last layer's gradient arrives whole]: a step computes the
    all_reduce the graph would have (the fake group returns its input); a step
    whose output's gradient arrives whole over the reduction's group hands
    that gradient as the reduced value, its Partial form (g / n) as the
    tangent, and issues no collective."""
    group = mesh_1d().get_group(0)
    g = torch.arange(4.0) + 1
    seen: list = []
    layer = _reducing_layer(4, seen)
    for whole, collectives, tangent, reduced in [
        ((), ["all_reduce.default"], g, g),
        (((0, WholeGradient(group.group_name, group.size())),), [], g / group.size(), g),
        # another group's sum is not the one that arrived: divided, then reduced
        (((0, WholeGradient("another", 3)),), ["all_reduce.default"], g / 3, g / 3),
    ]:
        step = RunStep("layer", layer, (("in", 0), ("in", 1)), whole)
        with waiting_collectives() as issued:
            args = step.backward_args([g])
        assert issued == collectives
        torch.testing.assert_close(args[0], tangent, rtol=0, atol=0)
        torch.testing.assert_close(args[1], reduced, rtol=0, atol=0)


def test_a_run_of_one_layer_whose_gradient_arrives_whole_runs_its_backward_once():
    group = mesh_1d().get_group(0)
    seen: list = []
    layer = _reducing_layer(4, seen)
    x = torch.arange(4.0, requires_grad=True)
    w = torch.full((4,), 2.0, requires_grad=True)
    run = LayerRun((RunStep("layer", layer, (("in", 0), ("in", 1)),
                            ((0, WholeGradient(group.group_name, group.size())),)),), 2, ((0, 0),))
    (y,) = run(x, w)
    y.backward(torch.ones(4))
    (got,) = seen
    assert torch.equal(got[0], torch.full((4,), 1.0 / group.size())) and torch.equal(got[1], torch.ones(4))
    assert torch.equal(x.grad, torch.full((4,), 1.0 / group.size()))
    assert torch.equal(w.grad, x.detach())