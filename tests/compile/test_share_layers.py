"""Layer sharing (issue #10, items 2-4): repeated layers found, split into pieces,
compiled once per distinct key; differing layers never merged.

Finder (:func:`find_layer_spans`) and rewriter (:func:`split_layers`) are
tested on graphs captured from small models (FakeStore group, inner="eager"
so nothing is compiled); reuse is counted through AOTAutograd graphs and
Inductor's kernel counter, never timed.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.analysis import span_io
from localmap_fx.graph_utils import node_value
from localmap_fx.layer_sharing.decide import AUTO_MIN_LAYERS, Decision, LayerCost, Reason, decide
from localmap_fx.layer_sharing.find import find_layer_spans
from localmap_fx.layer_sharing.plan import LayerSpan, compute_nodes
from localmap_fx.layer_sharing.split import META_PIECE, merge_unshared
from localmap_fx.layer_sharing.split import split_layers as _split_layers
from localmap_fx.passes import apply

from helpers import mesh_1d


def split_layers(gm, plan):
    return apply(lambda g: _split_layers(g, plan), gm)


def _layer_fn(mesh, redistribute_inputs=False):
    @localmap_fx.local_map(
        out_placements=[Shard(0)],
        in_placements=([Shard(0)], [Replicate()]),
        in_grad_placements=([Shard(0)], [Partial()]),
        device_mesh=mesh,
        redistribute_inputs=redistribute_inputs,
    )
    def layer(x, w):
        return torch.tanh(x @ w) + x

    return layer


def _state(mesh, n, d=8, batch=16, bias=None):
    g = torch.Generator().manual_seed(0)
    x = distribute_tensor(torch.randn(batch, d, generator=g), mesh, [Shard(0)]).requires_grad_()
    ws = [
        distribute_tensor(torch.randn(d, d, generator=g) / d, mesh, [Replicate()]).requires_grad_()
        for _ in range(n)
    ]
    bs = [bias(i) if bias is not None else None for i in range(n)]
    return x, ws, bs


def _step(layer):
    def step(x, ws, bs):
        for w, b in zip(ws, bs):
            x = layer(x, w)
            if b is not None:
                x = x + b
        return (x * x).sum()

    return step


def _capture(step, *args, **opts) -> fx.GraphModule:
    """The graph layer sharing sees (after the other passes)."""
    seen = {}

    def on_stage(name, gm):
        if name == "fuse_boundaries":
            seen["gm"] = gm

    torch._dynamo.reset()
    torch.compile(step, backend=localmap_fx.backend("eager", share_layers=False, on_stage=on_stage, **opts))(*args)
    return seen["gm"]


def _keys(plan):
    return [s.key is not None for s in plan.spans]


# ---------------------------------------------------------------- finding


def test_finder_finds_one_key_for_identical_layers():
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 4)
    gm = _capture(_step(_layer_fn(mesh)), x, ws, bs)
    plan = find_layer_spans(gm)
    assert plan.period == 1 and len(plan.spans) == 4
    assert len({s.key for s in plan.spans}) == 1 and plan.spans[0].key is not None
    # spans are contiguous and the same length
    assert [s.stop - s.start for s in plan.spans] == [plan.spans[0].stop - plan.spans[0].start] * 4
    assert all(a.stop == b.start for a, b in zip(plan.spans, plan.spans[1:]))
    text = re.sub(r"key [0-9a-f]{10}", "key K", plan.text())
    assert text.splitlines()[0] == "4 layers of 1 region(s), from region 0"
    assert all(line.endswith("key K") for line in text.splitlines()[1:])


def test_finder_starts_the_layers_after_a_region_that_is_no_layer():
    """An embedding-like region, then one region per layer (torchtitan's llama3
    with only its inner attention a region): each layer is one region.  The
    period search used to start only below the period, so the layers came out
    two at a time (4 layers of 2 blocks at 8 blocks)."""
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 4)
    embed = localmap_fx.local_map(lambda x: x * 2, out_placements=[Shard(0)], in_placements=([Shard(0)],),
                                  device_mesh=mesh)
    layer = _layer_fn(mesh)

    def step(x, ws, bs):
        return _step(layer)(embed(x), ws, bs)

    plan = find_layer_spans(_capture(step, x, ws, bs))
    assert (plan.first_region, plan.period, len(plan.spans)) == (1, 1, 4)
    assert len({s.key for s in plan.spans}) == 1 and plan.spans[0].key is not None


def test_finder_tp_stack_has_two_regions_per_layer():
    from benchmarks.models import build_tp_stack

    mesh = mesh_1d()
    step, st = build_tp_stack(mesh, "ours", n_blocks=3, batch=8, d=8, hidden=16)
    gm = _capture(step, st["x"], st["w1"], st["w2"])
    plan = find_layer_spans(gm)
    assert plan.period == 2 and len(plan.spans) == 3
    # borders lie after the next layer's to_local, so a plain tensor crosses
    # them (Note: [Where layers are cut]); the last layer has no next layer
    first, second, last = plan.spans
    assert first.key is not None and first.key == second.key
    assert last.key is None and last.reason.startswith("last layer")
    nodes = compute_nodes(gm, plan.hoisted)
    assert plan.nodes == tuple(nodes)  # the spans index the compute nodes, hoisted weights first
    _, outputs = span_io(nodes[first.start : first.stop])
    assert outputs and not any(hasattr(node_value(o), "placements") for o in outputs)


def test_merge_joins_only_neighbours_that_nothing_shares():
    def span(i, start, stop, shared):
        return LayerSpan(i, start, stop, ("K",) if shared else None, None if shared else "differs")

    prefix = (0, 2, ())
    a, b, c, d = span(0, 2, 5, False), span(1, 5, 8, True), span(2, 8, 11, True), span(3, 11, 14, False)
    tail = (14, 16, ())
    cuts = [prefix, (2, 5, (a,)), (5, 8, (b,)), (8, 11, (c,)), (11, 14, (d,)), tail]
    assert merge_unshared(cuts) == [(0, 5, (a,)), (5, 8, (b,)), (8, 11, (c,)), (11, 16, (d,))]
    # two shared layers next to each other stay two calls of one piece
    assert merge_unshared([(5, 8, (b,)), (8, 11, (c,))]) == [(5, 8, (b,)), (8, 11, (c,))]
    assert merge_unshared([prefix, tail]) == [(0, 16, ())]


def test_tp_stack_last_layer_and_loss_are_one_piece():
    from benchmarks.models import build_tp_stack

    mesh = mesh_1d()
    step, st = build_tp_stack(mesh, "ours", n_blocks=3, batch=8, d=8, hidden=16)
    gm = _capture(step, st["x"], st["w1"], st["w2"])
    outer = split_layers(gm, find_layer_spans(gm))
    metas = [n.meta[META_PIECE] for n in outer.graph.nodes if META_PIECE in n.meta]
    assert [(m.layer, m.key is not None) for m in metas] == [(None, False), (0, True), (1, True), (2, False)]
    last = outer.get_submodule(metas[-1].name)
    ops = [getattr(n.target, "__name__", str(n.target)) for n in last.graph.nodes if n.op.startswith("call_")]
    assert "sum" in ops, ops  # the loss joined the last layer's piece
    assert metas[-1].reason.endswith("with the tail")


def test_finder_without_repeats_says_why():
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 1)
    plan = find_layer_spans(_capture(_step(_layer_fn(mesh)), x, ws, bs))
    assert plan.spans == () and plan.reason == "fewer than 2 local_map regions in the root graph"


@pytest.mark.parametrize(
    "what,bias",
    [
        # the same code between regions, only the value's metadata differs in layer 2
        ("placements", lambda m, i: distribute_tensor(torch.ones(16, 8), m, [Shard(0)] if i == 2 else [Replicate()])),
        ("shape", lambda m, i: distribute_tensor(torch.ones(1, 8) if i == 2 else torch.ones(8), m, [Replicate()])),
        ("dtype", lambda m, i: distribute_tensor(torch.ones(8, dtype=torch.float16 if i == 2 else torch.float32), m, [Replicate()])),
        ("requires_grad", lambda m, i: distribute_tensor(torch.ones(8), m, [Replicate()]).requires_grad_(i != 2)),
    ],
)
def test_layers_that_differ_are_never_merged(what, bias):
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 4, bias=lambda i: bias(mesh, i))
    plan = find_layer_spans(_capture(_step(_layer_fn(mesh)), x, ws, bs))
    assert len(plan.spans) == 4
    keys = [s.key for s in plan.spans]
    assert keys[2] is None or keys[2] not in (keys[0], keys[1], keys[3]), what
    others = [k for i, k in enumerate(keys) if i != 2]
    assert any(k is not None for k in others)


def test_layers_on_other_meshes_are_never_merged():
    # same ranks, other dim name: a different mesh
    mesh_a = mesh_1d()
    mesh_b = init_device_mesh("cpu", tuple(mesh_a.shape), mesh_dim_names=("other",))
    la, lb = _layer_fn(mesh_a), _layer_fn(mesh_b)

    def step(x, ws):
        for i, w in enumerate(ws):
            # DTensor code after the region: its from_local (and mesh) stays in the layer
            x = (lb if i == 2 else la)(x, w) * 2
        return x.to_local().sum()

    x, ws, _ = _state(mesh_a, 4)
    plan = find_layer_spans(_capture(step, x, ws))
    keys = [s.key for s in plan.spans]
    assert len(keys) == 4
    assert keys[2] is None or keys[2] not in (keys[0], keys[1], keys[3])


def test_mutating_layer_stays_inline_with_reason():
    mesh = mesh_1d()
    layer = _layer_fn(mesh)

    def step(x, ws):
        for w in ws:
            x = layer(x, w)
            x.mul_(0.5)
        return x.to_local().sum()

    x, ws, _ = _state(mesh, 3)
    x = x.detach()  # in-place update of a leaf that requires grad is an error
    ws = [w.detach() for w in ws]
    plan = find_layer_spans(_capture(step, x, ws))
    assert len(plan.spans) == 3
    assert all(s.key is None and "in place (mul_)" in s.reason for s in plan.spans)
    assert decide(plan, True).reason is Reason.NO_SHARED_LAYER


def test_layer_returning_a_view_of_its_input_stays_inline_with_reason():
    mesh = mesh_1d()
    layer = _layer_fn(mesh)

    def step(x, ws):
        views = []
        for w in ws:
            y = layer(x, w)
            views.append(x.t())  # a view of this layer's input (S(0) -> S(1)), used after the loop
            x = y
        return x.to_local().sum() + sum(v.to_local().sum() for v in views)

    x, ws, _ = _state(mesh, 3)
    plan = find_layer_spans(_capture(step, x, ws))
    reasons = [s.reason or "" for s in plan.spans]
    assert any("aliases input" in r for r in reasons), reasons


# ---------------------------------------------------------------- rewriting


def test_split_gives_equal_pieces_for_equal_keys_and_runs_like_the_graph():
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 3)
    gm = _capture(_step(_layer_fn(mesh)), x, ws, bs)
    plan = find_layer_spans(gm)
    outer = split_layers(gm, plan)
    calls = [n for n in outer.graph.nodes if n.op == "call_module"]
    metas = [c.meta[META_PIECE] for c in calls]
    # the model input's to_local (later layers get local values: fuse_boundaries),
    # three layers, then the tail
    assert [m.layer for m in metas] == [None, 0, 1, 2, None]
    assert len({m.key for m in metas[1:4]}) == 1
    ops = [[(n.op, str(n.target)) for n in getattr(outer, c.target).graph.nodes if n.op != "placeholder"]
           for c in calls[1:4]]
    assert ops[0] == ops[1] == ops[2]
    # layer i feeds layer i+1 through the outer graph
    fed = [a.args[0] for a in calls[2].args if isinstance(a, fx.Node) and a.target is operator.getitem]
    assert calls[1] in fed
    # the pieces compute what the graph computed
    args = [x, mesh, *ws]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(args)
    assert torch.equal(outer(*args)[0].to_local(), gm(*args)[0].to_local())


# ---------------------------------------------------------------- compiling


class _AotCounter:
    def __init__(self):
        self.graphs = []

    def __call__(self, kind, gm):
        self.graphs.append(kind)


@pytest.mark.parametrize("n", [3, 6])
def test_aot_traces_each_distinct_layer_once(n):
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, n)
    count = _AotCounter()
    torch._dynamo.reset()
    f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("aot_eager", share_layers=True, on_aot_graph=count))
    f(x, ws, bs).backward()
    # one layer piece and the tail, forward and backward, independent of n;
    # the prefix (the inputs' to_local) is no compile (Note: [A piece that
    # only unwraps runs as an Unwrap])
    assert count.graphs.count("forward") == 2 and count.graphs.count("backward") == 2


def test_without_sharing_one_graph_is_traced():
    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 3)
    count = _AotCounter()
    f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("aot_eager", share_layers=False, on_aot_graph=count))
    f(x, ws, bs).backward()
    assert count.graphs == ["forward", "backward"]


def test_auto_policy_shares_from_the_threshold_on():
    mesh = mesh_1d()
    for n, expect in ((AUTO_MIN_LAYERS - 1, False), (AUTO_MIN_LAYERS, True)):
        x, ws, bs = _state(mesh, n)
        plan = find_layer_spans(_capture(_step(_layer_fn(mesh)), x, ws, bs))
        assert decide(plan, "auto").shares == expect, n
        assert decide(plan, "auto").reason is (Reason.SHARE if expect else Reason.FEW_LAYERS), n
        assert decide(plan, True).shares
        assert decide(plan, False) == Decision(Reason.OFF, "share_layers=False")
        if expect:
            # Note: [No DTensor at an automatic border]: "auto" keeps one graph, True shares anyway
            crossing = decide(plan, "auto", dtensor_borders=("a", "b", "c", "d"))
            assert crossing.reason is Reason.DTENSOR_AT_BORDER and "(a, b, c, ...)" in crossing.text
            assert crossing.why_whole == crossing.text
            assert decide(plan, True, dtensor_borders=("a",)).shares
            # behind the lean DTensor border they are shared, at the border's price under inductor
            lean = decide(plan, "auto", dtensor_borders=("a",), lean_border=True)
            assert lean.reason is Reason.SHARE and "the lean DTensor border" in lean.text
            small, big = LayerCost(10**8, "cpu"), LayerCost(10**10, "cpu")  # 3 and 300 ms fwd+bwd
            assert decide(plan, "auto", small, lean_border=True).shares
            assert decide(plan, "auto", small, ("a",), lean_border=True).reason is Reason.NOT_WORTH_IT
            assert "behind the DTensor border" in decide(plan, "auto", small, ("a",), lean_border=True).text
            assert decide(plan, "auto", big, ("a",), lean_border=True).shares


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_generates_kernels_once_per_distinct_layer():
    from torch._inductor import metrics

    mesh = mesh_1d()
    counts = {}
    for n in (3, 6):
        x, ws, bs = _state(mesh, n)
        torch._dynamo.reset()
        metrics.reset()
        f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("inductor", share_layers=True))
        f(x, ws, bs).backward()
        counts[n] = metrics.generated_kernel_count
    # (from 3 layers on the last one is shared too: Note: [The last layer's
    # border]; the loss after it has no matrix product and skips Inductor:
    # Note: [A piece without matrix products skips Inductor])
    assert counts[3] == counts[6] > 0


def test_shared_pieces_give_the_unshared_answer():
    mesh = mesh_1d()
    results = []
    for share in (True, False):
        x, ws, bs = _state(mesh, 3)
        torch._dynamo.reset()
        f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("aot_eager", share_layers=share))
        loss = f(x, ws, bs)
        loss.backward()
        results.append([loss.to_local(), x.grad.to_local(), *[w.grad.to_local() for w in ws]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_guards_recompile_with_shared_layers():
    mesh = mesh_1d()
    graphs = []
    inner = localmap_fx.backend("aot_eager", share_layers=True)

    def be(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    step = _step(_layer_fn(mesh, redistribute_inputs=True))
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        f = torch.compile(step, backend=be)
        x, ws, bs = _state(mesh, 3)
        f(x, ws, bs)
        f(*_state(mesh, 3))
        assert len(graphs) == 1
        # weights of other placements: redistribute inside the regions, new graph
        x, ws, bs = _state(mesh, 3)
        f(x, [w.redistribute(mesh, [Shard(0)]) for w in ws], bs)
        assert len(graphs) == 2
        # dtype
        x, ws, bs = _state(mesh, 3)
        f(x.to(torch.float64), [w.to(torch.float64) for w in ws], bs)
        assert len(graphs) == 3
        # shape
        x, ws, bs = _state(mesh, 3, batch=32)
        f(x, ws, bs)
        assert len(graphs) == 4


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_share_layers_compiles_one_frame_over_three_training_steps(inner):
    """DTensor parameters of an nn.Module: the weights' to_local never gives the
    parameters' local tensors a grad_fn (Note: [A piece that only unwraps
    runs as an Unwrap]), so Dynamo's requires_grad guard on them holds on the next step."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    model, x = TPStack(mesh, 3, d=16, hidden=32), tp_stack_input(mesh, 8, 16)
    frames = []
    be = localmap_fx.backend(inner, share_layers=True)

    def count(gm, example_inputs):
        frames.append(gm)
        return be(gm, example_inputs)

    torch._dynamo.reset()
    f = torch.compile(model, backend=count)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        f(x).backward()
        opt.step()
    assert len(frames) == 1
    assert not any(p._local_tensor.requires_grad for p in model.parameters())


def test_dump_and_cli_show_which_layers_share_a_piece(tmp_path):
    import contextlib
    import io
    import json
    import os

    from localmap_fx.debug import cli

    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 3)
    torch._dynamo.reset()
    f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("aot_eager", share_layers=True, dump_dir=str(tmp_path)))
    f(x, ws, bs).backward()
    (frame,) = os.listdir(tmp_path)
    with open(tmp_path / frame / "summary.json") as fh:
        pieces = json.load(fh)["pieces"]
    assert pieces["shared"] is True
    rows = {r["piece"]: r for r in pieces["rows"]}
    layer_rows = [r for r in rows.values() if r["layers"]]
    assert len(layer_rows) == 1 and layer_rows[0]["layers"] == [0, 1, 2] and layer_rows[0]["calls"] == 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", str(tmp_path / frame)]) == 0
    text = re.sub(r"\| [0-9a-f]{10} \|", "| KEY |", out.getvalue())
    section = text.split("## Layer pieces\n\n", 1)[1].split("\n\n## ", 1)[0]
    assert section == """\
Layers with one key run one compiled piece (compiled once).

| piece | layers | calls | key | nodes | not shared because | runs as |
|---|---|---|---|---|---|---|
| piece_0 | - | 1 | - | 4 | prefix / tail | unwrap of 4 DTensors |
| piece_1 | 0, 1, 2 | 3 | KEY | 3 | - | layer in run_0 |
| piece_4 | - | 1 | - | 3 | prefix / tail | DTensor border |"""
    # prefix: to_local of x and of the 3 weights (Note: [Weights enter as
    # local tensors]); layer: x @ w, tanh, + x (bodies inline, boundaries
    # fused); tail: from_local, x * x, sum (its output a DTensor: behind the
    # lean DTensor border)


def test_dump_says_why_layers_stay_in_one_graph(tmp_path):
    import json
    import os

    mesh = mesh_1d()
    x, ws, bs = _state(mesh, 3)
    torch._dynamo.reset()
    f = torch.compile(_step(_layer_fn(mesh)), backend=localmap_fx.backend("aot_eager", dump_dir=str(tmp_path)))
    f(x, ws, bs)
    (frame,) = os.listdir(tmp_path)
    with open(tmp_path / frame / "summary.json") as fh:
        pieces = json.load(fh)["pieces"]
    assert pieces["shared"] is False and "share_layers='auto': 3 repeats" in pieces["reason"]
    assert [r["layers"] for r in pieces["rows"]] == [[0], [1], [2]]
    with open(tmp_path / frame / "summary.md") as fh:
        assert "Compiled as one graph: share_layers='auto': 3 repeats" in fh.read()


def _gloo_shared_vs_eager(rank, world_size, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx
    from benchmarks.models import build_tp_stack

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    report = {}

    def run(step, st):
        loss = step(st["x"], st["w1"], st["w2"])
        loss.backward()
        return [loss, st["x"].grad, *(w.grad for w in st["w1"]), *(w.grad for w in st["w2"])]

    shape = dict(n_blocks=3, batch=8, d=16, hidden=32)
    step, st = build_tp_stack(mesh, "ours", **shape)
    eager = run(step, st)
    for inner in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        pieces = []
        step, st = build_tp_stack(mesh, "ours", **shape)
        be = localmap_fx.backend(inner, share_layers=True, on_aot_graph=lambda k, g, pieces=pieces: pieces.append(k))
        got = run(torch.compile(step, backend=be, fullgraph=True), st)
        for k, (a, b) in enumerate(zip(eager, got)):
            la, lb = a.to_local(), b.to_local()
            if inner == "aot_eager":
                ok = torch.equal(la, lb)
            else:
                ok = torch.allclose(la, lb, rtol=1e-6, atol=1e-6 * la.abs().max().item())
            report[(inner, k)] = (bool(ok and a.placements == b.placements), (la - lb).abs().max().item())
        # the layer was shared: at most the prefix (to_locals), one piece for
        # layers 0-1, the last layer and the tail were compiled, of 5 pieces
        n_fw, n_bw = pieces.count("forward"), pieces.count("backward")
        report[(inner, "aot_graphs")] = (1 <= n_fw <= 4 and n_bw == n_fw, pieces)
    return report


@pytest.mark.inductor
@pytest.mark.slow
def test_shared_layers_on_gloo_equal_eager():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_gloo_shared_vs_eager, world_size=2, timeout=600)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    assert len(results[0]) == 2 * (1 + 1 + 3 + 3 + 1)


def test_graph_break_splits_the_stack_into_frames_each_shared_on_its_own():
    mesh = mesh_1d()
    layer = _layer_fn(mesh)

    def step(x, ws):
        for w in ws[:3]:
            x = layer(x, w)
        torch._dynamo.graph_break()
        for w in ws[3:]:
            x = layer(x, w)
        return (x * x).sum()

    results = []
    frames = []
    for share in (True, False):
        x, ws, _ = _state(mesh, 6)
        torch._dynamo.reset()
        inner = localmap_fx.backend("aot_eager", share_layers=share, on_stage=lambda name, gm, share=share: frames.append((share, name)))
        loss = torch.compile(step, backend=inner)(x, ws)
        loss.backward()
        results.append([loss.to_local(), x.grad.to_local(), *[w.grad.to_local() for w in ws]])
    # two frames, each split into pieces of its own when sharing
    assert [n for s, n in frames if s and n == "split_layers"] == ["split_layers"] * 2
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_attention_layers_that_dtensors_cross_share_behind_the_dtensor_border(tmp_path):
    """torchtitan's style: the weights are DTensors used outside the region, so
    DTensors cross every layer border.  Each layer piece is compiled once and
    runs behind the lean DTensor border (Note: [No DTensor at an automatic
    border]); with lean_border=False it keeps AOTAutograd's runtime."""
    import glob
    import json

    from localmap_fx.testing.attention_stack import AttnStack, attn_stack_input

    mesh = mesh_1d()
    runtimes = {}
    for lean in (True, False):
        torch._dynamo.reset()
        model = AttnStack(mesh, 4, d=16, n_heads=4)
        x = attn_stack_input(mesh, 2, 4, 16)
        dump = tmp_path / str(lean)
        be = localmap_fx.backend("aot_eager", share_layers=True, lean_border=lean, dump_dir=str(dump))
        torch.compile(model, backend=be)(x).backward()
        (summary,) = glob.glob(str(dump / "*" / "summary.json"))
        rows = json.load(open(summary))["pieces"]["rows"]
        runtimes[lean] = {r["piece"]: (r["layers"], r["runtime"]) for r in rows}
    assert runtimes[True]["piece_1"] == ([0, 1, 2], "DTensor border")
    assert runtimes[False]["piece_1"] == ([0, 1, 2], "aot: a DTensor crosses its border")


def test_attention_layers_shared_behind_the_border_issue_fewer_collectives():
    """Why the lean DTensor border's price is low (Note: [No DTensor at an
    automatic border]): one graph issues eager's collectives (the backward
    gathers the projection weights and reduce-scatters), while the shared
    layers' backward, its tangent arriving Partial at each border, sums each
    layer's gradient in one all_reduce."""
    from benchmarks.depth_bench import module_step
    from benchmarks.step_census import collectives_per_step
    from localmap_fx.testing.attention_stack import AttnStack, attn_stack_input

    mesh = mesh_1d()
    counts = {}
    for way, share in (("eager", None), ("one_graph", False), ("shared", True)):
        torch._dynamo.reset()
        model = AttnStack(mesh, 4, d=16, n_heads=4)
        x = attn_stack_input(mesh, 2, 4, 16)
        fn = model if share is None else torch.compile(
            model, backend=localmap_fx.backend("aot_eager", share_layers=share, outline=False))
        step, zero, _ = module_step(fn, model, x)
        for _ in range(2):  # compile, then a step that runs what the first compiled
            step()
            zero()
        counts[way] = collectives_per_step(step, zero, steps=1)
    assert counts["one_graph"] == counts["eager"]
    assert set(counts["shared"]) == {"allreduce"}
    assert sum(counts["shared"].values()) < sum(counts["eager"].values()), counts
