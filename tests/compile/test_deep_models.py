"""Deep models (issue 21): what the default does with many layers, plain
tensors at layer borders, and regional compilation with ``backend="localmap_fx"``.

The model is :class:`localmap_fx.testing.models.TPStack` (``nn.Module``
blocks with DTensor parameters and a residual).  Numerics run on 2 gloo
ranks against eager (aot_eager bitwise, inductor within 1e-5); structure
is read from the graphs the backend hands on, never from timings (speed
targets live in ``benchmarks/depth_bench.py``).
"""

from __future__ import annotations

import pytest
import torch

import localmap_fx
from localmap_fx.layer_sharing.decide import AUTO_MIN_LAYERS, LayerCost, Reason, decide
from localmap_fx.layer_sharing.find import find_layer_spans

from helpers import mesh_1d


def _stack(mesh, n, impl="ours", d=16, hidden=32, batch=8):
    from localmap_fx.testing.models import TPStack, tp_stack_input

    return TPStack(mesh, n, d=d, hidden=hidden, impl=impl), tp_stack_input(mesh, batch, d)


def _plan_of(n):
    mesh = mesh_1d()
    model, x = _stack(mesh, n)
    seen = {}

    def on_stage(name, gm):
        if name == "fuse_boundaries":
            seen["gm"] = gm

    torch._dynamo.reset()
    torch.compile(model, backend=localmap_fx.backend("eager", share_layers=False, on_stage=on_stage))(x)
    return find_layer_spans(seen["gm"])


def test_auto_weighs_the_piece_price_against_the_layer_compute():
    plan = _plan_of(AUTO_MIN_LAYERS)
    assert len(plan.shared) >= AUTO_MIN_LAYERS - 1
    small = LayerCost(flops=2 * 8 * 16 * 16, device="cpu")
    why = decide(plan, "auto", small)
    assert why.reason is Reason.NOT_WORTH_IT and "slower than one graph" in why.text and "MFLOP" in why.text
    # a layer whose compute dwarfs the piece call is shared
    large = LayerCost(flops=10**13, device="cpu")
    assert large.worth_sharing and decide(plan, "auto", large).shares
    # explicit True shares whatever the cost; below the count "auto" never does
    assert decide(plan, True, small).shares
    fewer = decide(_plan_of(3), "auto", large)
    assert fewer.reason is Reason.FEW_LAYERS and "repeats of a layer" in fewer.text


@pytest.mark.slow
@pytest.mark.inductor
def test_default_inductor_keeps_a_cheap_deep_stack_whole_and_says_why(tmp_path):
    import json
    import os

    mesh = mesh_1d()
    model, x = _stack(mesh, AUTO_MIN_LAYERS)
    torch._dynamo.reset()
    f = torch.compile(model, backend=localmap_fx.backend("inductor", dump_dir=str(tmp_path)))
    f(x).backward()
    (frame,) = os.listdir(tmp_path)
    with open(tmp_path / frame / "summary.json") as fh:
        pieces = json.load(fh)["pieces"]
    assert pieces["shared"] is False
    assert "pieces would run slower than one graph" in pieces["reason"]


def test_layer_pieces_exchange_plain_tensors_only():
    """Note: [A DTensor at a layer border costs a collective]: the residual
    stream crosses every layer border as a local tensor, so no piece input or
    output but the frame's own is a DTensor, and every layer shares one key."""
    from torch.distributed.tensor import DTensor

    from localmap_fx.graph_utils import node_value
    from localmap_fx.layer_sharing.split import META_PIECE, pieces_of

    mesh = mesh_1d()
    model, x = _stack(mesh, 6)
    seen = {}

    def on_stage(name, gm):
        if name == "split_layers":
            seen["outer"] = gm
            seen["pieces"] = [(n.meta[META_PIECE].layer, n.meta[META_PIECE].key is not None,
                               [type(node_value(a)) for a in n.args],
                               [type(node_value(u)) for u in n.users]) for n in pieces_of(gm)]

    torch._dynamo.reset()
    torch.compile(model, backend=localmap_fx.backend("aot_eager", share_layers=True, on_stage=on_stage))(x).backward()
    rows = seen["pieces"]
    layers = [r for r in rows if r[1]]
    assert [r[0] for r in layers] == list(range(len(layers))) and len(layers) >= 5
    for _, _, ins, outs in layers:
        assert DTensor not in ins and DTensor not in outs, (ins, outs)
        assert sum(issubclass(t, torch.Tensor) for t in ins) == 3, ins  # residual + 2 local weights


def _tree(loss, model, x):
    return [loss, x.grad, *(p.grad for p in model.parameters())]


def _gloo_deep_vs_eager(rank, world_size, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    report = {}

    def run(fn, model, x):
        loss = fn(x)
        loss.backward()
        return [t.full_tensor() for t in _tree(loss, model, x)]

    model, x = _stack(mesh, 9)
    eager = run(model, model, x)
    cases = [
        ("shared", "aot_eager", dict(share_layers=True)),
        ("shared", "inductor", dict(share_layers=True)),
        ("default", "inductor", {}),
        ("regional", "aot_eager", {}),
        ("regional", "inductor", {}),
        ("upstream_regional", "aot_eager", {}),
    ]
    for how, inner, opts in cases:
        torch._dynamo.reset()
        model, x = _stack(mesh, 9, impl="torch" if how.startswith("upstream") else "ours")
        be = inner if how.startswith("upstream") else localmap_fx.backend(inner, **opts)
        if how.endswith("regional"):
            for block in model.blocks:
                block.compile(backend=be)
            fn = model
        else:
            fn = torch.compile(model, backend=be, fullgraph=True)
        got = run(fn, model, x)
        for k, (a, b) in enumerate(zip(eager, got)):
            # Each compiled block is a frame of its own.  AOTAutograd's runtime
            # (upstream regional) turns the Partial gradient reaching a block's
            # Replicate output into the Replicate tangent it traced (an
            # all_reduce), so sums happen in another order than in eager: within
            # 1e-5.  Ours runs the block behind the lean DTensor border, with a
            # backward compiled for the Partial gradient: bitwise under aot_eager.
            if inner == "aot_eager" and how != "upstream_regional":
                ok = torch.equal(a, b)
            else:
                ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5 * (1 + a.abs().max().item()))
            report[(how, inner, k)] = (bool(ok), (a - b).abs().max().item())
    return report


@pytest.mark.inductor
@pytest.mark.slow
def test_deep_stack_on_gloo_equals_eager():
    from localmap_fx.testing.dist import run_ranks

    results = run_ranks(_gloo_deep_vs_eager, world_size=2, timeout=900)
    bad = {(r, k): v for r, rep in enumerate(results) for k, v in rep.items() if not v[0]}
    assert not bad, bad
    assert len(results[0]) == 6 * (1 + 1 + 2 * 9)


def _graphs_of_regional(impl: str, backend) -> int:
    from torch._dynamo.utils import counters

    mesh = mesh_1d()
    torch._dynamo.reset()
    counters.clear()
    model, x = _stack(mesh, 4, impl=impl)
    for block in model.blocks:
        block.compile(backend=backend)
    model(x).backward()
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_regional_compiles_as_many_graphs_as_upstream_regional(inner):
    ours = _graphs_of_regional("ours", localmap_fx.backend(inner))
    upstream = _graphs_of_regional("torch", inner)
    assert ours == upstream == 1


def test_depth_report_reads_a_result_and_draws_it():
    """benchmarks.depth_report on a synthetic result: every figure present,
    met/missed from the numbers given, the whole / regional / marked table,
    a PNG drawn (no timing here)."""
    from benchmarks.depth_report import figures, markdown, plot_png

    sides = ("upstream_whole", "upstream_regional", "ours_whole", "ours_regional", "ours_shared", "ours_marked")
    phase = {"dynamo_s": 1.0, "aot_s": 1.0, "inductor_s": 1.0, "cpp_compile_s": 1.0, "cpp_files": 2,
             "kernels": 3, "graphs": 1}
    cold = {f"module/{s}/{n}": {"total_s": float(n + i), **phase} for i, s in enumerate(sides) for n in (8, 64)}
    cold.update({f"module_real/{s}/64": {"total_s": t, **phase} for s, t in (("upstream_whole", 40.0),
                                                                            ("ours_whole", 10.0))})
    pairs = ("ours_whole/upstream_whole", "ours_whole/upstream_regional", "ours_regional/upstream_whole",
             "ours_regional/upstream_regional", "ours_marked/upstream_whole", "ours_shared/upstream_whole",
             "upstream_regional/upstream_whole")
    steady = {"module/16": {
        "numerics_match": {s: True for s in sides},
        "step_us": {c: {s: {"median": 1000.0, "min": 900.0, "max": 1100.0, "n": 2} for s in sides}
                    for c in ("wall", "cpu")},
        "ratios": {c: {p: [0.75, 0.85] if p.startswith("ours_regional") else [0.95, 1.05] for p in pairs}
                   for c in ("wall", "cpu")},
        "price_per_layer_us": {c: [10.0, 20.0] for c in ("wall", "cpu")},
    }}

    def restart(cold_s, warm_s):
        return {"cold": {"seconds": cold_s, "aot": {}, "fx": {}},
                "warm": {"seconds": warm_s, "aot": {}, "fx": {"fxgraph_cache_hit": 2}}, "ratio": warm_s / cold_s}

    warm = {"module/ours_whole/16": restart(10.0, 2.0), "module/ours_marked/16": restart(10.0, 3.0)}
    res = {"config": {"rounds": 8}, "cold": cold, "steady": steady, "warm": warm, "load_start": [1.0],
           "load_end": [2.0], "run_s": 1.0}
    rows = {r["id"]: r for r in figures(res)}
    # ours whole 64+2, upstream regional 64+1
    assert rows["P8[module]"]["median"] == pytest.approx(66 / 65) and rows["P8[module]"]["met"] is False
    assert rows["P8_growth[module,ours_whole]"]["median"] == pytest.approx(66 / 10)
    assert rows["P9_whole[module,16]"]["median"] == pytest.approx(1.0) and rows["P9_whole[module,16]"]["met"]
    assert rows["P9_regional[module,16]"]["met"] is False
    assert rows["price[module,16]"]["median"] == pytest.approx(15.0)
    # ours regional 64+3, ours marked 64+5 over upstream regional 64+1
    assert rows["cold_regional[module]"]["median"] == pytest.approx(67 / 65)
    assert rows["cold_regional[module]"]["met"] is False
    assert rows["cold_marked[module]"]["median"] == pytest.approx(69 / 65) and rows["cold_marked[module]"]["met"]
    assert rows["regional_whole[module,16]"]["met"] and rows["regional[module,16]"]["median"] == pytest.approx(0.8)
    assert rows["marked[module,16]"]["median"] == pytest.approx(1.0)
    assert rows["real_whole[module_real,64]"]["median"] == pytest.approx(0.25)
    assert rows["real_whole[module_real,64]"]["met"]
    assert rows["warm[module,ours_whole,16]"]["met"] and rows["warm[module,ours_marked,16]"]["met"] is False
    md = markdown(res)
    assert "| module | ours_whole | 64 |" in md
    assert "| module | 16 | marked blocks | – | 1.0 | 1.00 | 3.0 (0.30) |" in md
    assert "| module | 64 | regional | 67.0 | – | – | – |" in md
    assert plot_png(res)[:8] == b"\x89PNG\r\n\x1a\n"
