"""Patterns from real model code, under ``backend="localmap_fx"`` (issue #11).

* ``local_map(fn, ...)`` built inside ``forward`` on every call;
* regions inside nested subgraphs Dynamo builds: activation checkpointing
  (with and without a selective policy), ``nested_compile_region`` and
  ``torch.cond``.

Graphs on the fake process group; numerics under ``LocalTensorMode`` (all
ranks in this process, on a mesh nothing compiles on outside the mode:
``helpers.ltm_mesh_for``; ``outline=False`` since ``invoke_subgraph`` has
no LocalTensor rule).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import localmap_fx
from localmap_fx.testing.graphs import Recorder
from localmap_fx.testing.models import tp_block

from helpers import WORLD_SIZE, ltm_mesh_for, mesh_1d


def _col(x, w):
    return torch.relu(x @ w)


def _inputs(seed=0, mesh=None):
    g = torch.Generator().manual_seed(seed)
    mesh = mesh if mesh is not None else mesh_1d()
    x = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(torch.randn(16, 32, generator=g), mesh, [Shard(1)]).requires_grad_()
    return x, w


def _per_rank(t):
    t = t.to_local()
    return [t._local_tensors[r] for r in range(WORLD_SIZE)]


def _assert_same(a, b):
    assert a.placements == b.placements and a.shape == b.shape
    for x, y in zip(_per_rank(a), _per_rank(b)):
        assert torch.equal(x, y)


# --- local_map built inside forward ------------------------------------------------


class _BuiltInline(torch.nn.Module):
    """MoE-style code: the local_map is made in forward, on every call."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x, w):
        return localmap_fx.local_map(
            _col, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]), device_mesh=self.mesh
        )(x, w)


def _built_inline_closure(x, w):
    def scaled(a, b):
        return torch.relu(a @ b) * 2

    return localmap_fx.local_map(
        scaled,
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)]),
        in_grad_placements=([Replicate()], [Shard(1)]),
    )(x, w)


def test_local_map_built_in_forward_compiles_once_and_keeps_region():
    for fn, func, in_grad in ((_BuiltInline(mesh_1d()), "_col", None), (_built_inline_closure, "scaled", "in_grad=[R, S(1)]")):
        rec = Recorder("aot_eager")
        compiled = torch.compile(fn, backend=rec.backend, fullgraph=True)
        x, w = _inputs()
        for _ in range(3):
            out = compiled(x, w)
        assert out.placements == (Shard(1),)
        # one frame compiled for three calls: no retrace, no recompile
        assert len(rec.stages["captured"]) == 1
        (region,) = localmap_fx.find_regions(rec.stage("captured"))
        assert region.spec.func.endswith(func)
        assert region.spec.in_placements == ((Replicate(),), (Shard(1),))
        assert (in_grad in region.spec.text()) if in_grad else region.spec.in_grad_placements is None
        assert len(localmap_fx.find_regions(rec.stage("fuse_boundaries"))) == 1
        torch._dynamo.reset()


def test_local_map_built_in_forward_closing_over_a_tensor_or_builtin():
    def fn(x, w, s):
        def scaled(a, b):
            return (a @ b) * s

        h = localmap_fx.local_map(scaled, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]))(x, w)
        return localmap_fx.local_map(torch.relu, out_placements=[Shard(1)], in_placements=([Shard(1)],))(h)

    rec = Recorder("aot_eager")
    compiled = torch.compile(fn, backend=rec.backend, fullgraph=True)
    x, w = _inputs()
    s = torch.full((8,), 2.0, requires_grad=True)
    for _ in range(2):
        out = compiled(x, w, s)
    assert len(rec.stages["captured"]) == 1
    regions = localmap_fx.find_regions(rec.stage("captured"))
    assert [r.spec.func for r in regions] == [f"{fn.__qualname__}.<locals>.scaled", "builtin_function_or_method"]
    assert [(i.kind, i.index) for i in regions[0].inputs] == [("arg", 0), ("arg", 1), ("captured", None)]
    out.to_local().sum().backward()
    assert s.grad is not None


def test_local_map_built_in_forward_numerics():
    with LocalTensorMode(WORLD_SIZE):
        results = []
        for compiled in (False, True):
            x, w = _inputs(mesh=ltm_mesh_for(1))
            f = torch.compile(_built_inline_closure, backend=localmap_fx.backend("aot_eager", outline=False),
                              fullgraph=True) if compiled else _built_inline_closure
            out = f(x, w)
            out.redistribute(out.device_mesh, [Replicate()]).sum().backward()
            results.append((out, x.grad, w.grad))
    for a, b in zip(*results):
        _assert_same(a, b)


# --- regions inside nested subgraphs ----------------------------------------------

_COL, _ROW = tp_block(None)


def _block(x, w1, w2):
    return _ROW(_COL(x, w1), w2).redistribute(x.device_mesh, [Replicate()])


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(x, w1, w2):
    return checkpoint(_block, x, w1, w2, use_reentrant=False)


def _selective(x, w1, w2):
    ctx = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    return checkpoint(_block, x, w1, w2, use_reentrant=False, context_fn=ctx)


def _mlp_inputs(seed=0, mesh=None):
    g = torch.Generator().manual_seed(seed)
    mesh = mesh if mesh is not None else mesh_1d()
    x = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Replicate()]).requires_grad_()
    w1 = distribute_tensor(torch.randn(16, 32, generator=g), mesh, [Shard(1)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(32, 16, generator=g), mesh, [Shard(0)]).requires_grad_()
    return x, w1, w2


_EXPECTED_SPECS = [
    "<lambda>: in=[R, S(1)] out=[S(1)] in_grad=[P, S(1)] mesh=tp:4",
    "<lambda>: in=[S(1), S(0)] out=[P] mesh=tp:4",
]


def _spec_texts(regions):
    # _col is named "_col": print the placements part only
    return ["<lambda>:" + r.spec.text().split(":", 1)[1] for r in regions]


@pytest.mark.parametrize("wrapper", [_checkpointed, _selective], ids=["checkpoint", "selective"])
def test_regions_under_checkpoint_found_lowered_and_dumped(wrapper, tmp_path):
    # share_layers=False: the frame is outlined, which must keep nested regions inline
    rec = Recorder("aot_eager", dump_dir=str(tmp_path), share_layers=False)
    x, w1, w2 = _mlp_inputs()
    out = torch.compile(wrapper, backend=rec.backend, fullgraph=True)(x, w1, w2)
    out.sum().backward()
    captured = rec.stage("captured")
    # Dynamo put the regions inside the checkpoint's subgraph
    assert any(n.target is torch.ops.higher_order.tag_activation_checkpoint for n in captured.graph.nodes)
    for stage in ("captured", "outline_regions", "lower_boundaries", "fuse_boundaries"):
        regions = localmap_fx.find_regions(rec.stage(stage))
        assert _spec_texts(regions) == _EXPECTED_SPECS, stage
        assert {r.scope for r in regions} == {"wrap_body_0"}
        assert not any(r.outlined for r in regions)
    # lowered: explicit grad placements inside the checkpoint body
    lowered = localmap_fx.find_regions(rec.stage("lower_boundaries"))
    to_locals = [n for r in lowered for n in r.enter_nodes if n.target == "to_local"]
    assert [n.kwargs["grad_placements"] for n in to_locals] == [
        (Partial(),), (Shard(1),), (Shard(1),), (Shard(0),)
    ]
    # fuse_boundaries dropped the round trip between the two regions (same graph)
    fused = localmap_fx.find_regions(rec.stage("fuse_boundaries"))
    assert [len(r.enter_nodes) for r in fused] == [2, 1]
    # the dump shows both regions, with their placements and where they sit
    (frame,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((frame / "summary.json").read_text())
    assert [r["in_placements"] for r in summary["regions"]] == [["R", "S(1)"], ["S(1)", "S(0)"]]
    assert [r["scope"] for r in summary["regions"]] == ["wrap_body_0", "wrap_body_0"]
    assert "nested subgraph wrap_body_0" in (frame / "region_1.txt").read_text()
    assert w1.grad.placements == (Shard(1),) and x.grad.placements == (Partial(),)


@pytest.mark.parametrize("wrapper", [_checkpointed, _selective], ids=["checkpoint", "selective"])
def test_regions_under_checkpoint_numerics(wrapper):
    with LocalTensorMode(WORLD_SIZE):
        results = []
        for compiled in (False, True):
            x, w1, w2 = _mlp_inputs(mesh=ltm_mesh_for(1))
            f = torch.compile(wrapper, backend=localmap_fx.backend("aot_eager", outline=False),
                              fullgraph=True) if compiled else wrapper
            out = f(x, w1, w2)
            out.sum().backward()
            results.append((out, x.grad, w1.grad, w2.grad))
            torch._dynamo.reset()
    for a, b in zip(*results):
        _assert_same(a, b)


def test_torch_cond_over_dtensor_code_fails_in_torch_itself():
    """Pins torch 2.14.1: a cond whose branches run DTensor code (torch's own
    local_map here) fails in Dynamo, before any backend: the mesh becomes a
    cond operand, which cond rejects.  Regions in control flow are therefore
    covered on hand-built graphs (test_passes_unit.py)."""
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    col = torch_local_map(_col, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]))

    def fn(p, x, w):
        return torch.cond(p, lambda a, b: col(a, b), lambda a, b: col(a, b) * 2, (x, w))

    x, w = _inputs()
    with pytest.raises(Exception, match="can only be of"):
        torch.compile(fn, backend="eager", fullgraph=True)(torch.tensor(True), x, w)


def test_repeated_regions_under_checkpoint_share_then_inline():
    """Dynamo traces the repeated body once inside the checkpoint; the backend
    inlines it there (outline keeps nested regions inline) and finds every region."""
    layer = localmap_fx.local_map(
        lambda x, w: torch.tanh(x @ w) + x, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()])
    )

    def block(x, *ws):
        for w in ws:
            x = layer(x, w)
        return x

    def fn(x, *ws):
        return checkpoint(block, x, *ws, use_reentrant=False).redistribute(x.device_mesh, [Replicate()]).sum()

    g = torch.Generator().manual_seed(0)
    x = distribute_tensor(torch.randn(8, 8, generator=g), mesh_1d(), [Shard(0)]).requires_grad_()
    ws = [distribute_tensor(torch.randn(8, 8, generator=g), mesh_1d(), [Replicate()]).requires_grad_() for _ in range(4)]
    rec = Recorder("aot_eager", share_layers=False)  # outline_regions runs (and keeps nested bodies inline)
    torch.compile(fn, backend=rec.backend, fullgraph=True)(x, *ws).backward()
    body = rec.stage("captured").wrap_body_0
    shared = [n for n in body.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(shared) == 3 and len({n.args[0].target for n in shared}) in (1, 3)
    assert len({id(getattr(body, n.args[0].target)) for n in shared}) == 1
    for stage in ("captured", "outline_regions", "fuse_boundaries"):
        regions = localmap_fx.find_regions(rec.stage(stage))
        assert len(regions) == 4 and {r.scope for r in regions} == {"wrap_body_0"}, stage
    final = rec.stage("fuse_boundaries").wrap_body_0
    assert not any(n.target is torch.ops.higher_order.invoke_subgraph for n in final.graph.nodes)


# --- symbolic sizes (dynamic sequence length) ----------------------------------------


def _norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_size_arithmetic_between_region_nodes_stays_outside():
    """Sequence-sharded input with a symbolic length: Dynamo emits unannotated
    ``sym_size``/``//`` nodes between the region's ``to_local``s; the region is
    still one call with both arguments and its output."""
    from localmap_fx.graph_utils import is_size_computation

    mesh = mesh_1d()
    norm = localmap_fx.local_map(_norm, [Shard(1)], ([Shard(1)], [Replicate()]), device_mesh=mesh)
    rec = Recorder("aot_eager")
    # as in the Llama blocks: the region's input is a redistributed activation
    compiled = torch.compile(
        lambda x, w: norm(x.redistribute(mesh, [Shard(1)]), w) + 1, backend=rec.backend, fullgraph=True
    )
    x = distribute_tensor(torch.randn(2, 16, 8), mesh, [Replicate()])
    w = distribute_tensor(torch.randn(8), mesh, [Replicate()])
    torch._dynamo.mark_dynamic(x, 1)
    compiled(x, w)
    gm = rec.stage("captured")
    nodes = list(gm.graph.nodes)
    (region,) = localmap_fx.find_regions(gm)
    first = nodes.index(region.enter_nodes[0])
    last = nodes.index(region.exit_nodes[-1])
    between = [n for n in nodes[first:last] if is_size_computation(n)]
    assert between, "the test no longer interleaves size arithmetic: update it"
    assert not set(between) & {*region.enter_nodes, *region.body_nodes, *region.exit_nodes}
    assert [i.kind for i in region.inputs][:2] == ["arg", "arg"]
    assert len(region.outputs) == 1
    assert len(localmap_fx.find_regions(rec.stage("fuse_boundaries"))) == 1


def test_data_dependent_all_to_all_inside_a_region():
    """MoE-style dispatch inside the body: split sizes from ``.tolist()``
    (capture_scalar_outputs) make the output's size data-dependent; the region
    compiles, is found, and its output keeps the even-sharding global shape."""
    import torch.distributed._functional_collectives as funcol

    mesh = mesh_1d()

    def dispatch(x, splits):
        sizes = splits.tolist()
        out = funcol.all_to_all_single(x, sizes, sizes, (mesh, 0))
        return funcol.all_to_all_single(out * 3, sizes, sizes, (mesh, 0))

    lm = localmap_fx.local_map(dispatch, [Shard(0)], ([Shard(0)], [Replicate()]), device_mesh=mesh)
    x = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()
    splits = distribute_tensor(torch.ones(WORLD_SIZE, dtype=torch.int64), mesh, [Replicate()])
    rec = Recorder("aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(lambda x, s: lm(x, s), backend=rec.backend, fullgraph=True)(x, splits)
        out.to_local().sum().backward()
    want = lm(x, splits)
    assert out.placements == want.placements and out.shape == want.shape
    assert torch.equal(out.to_local(), want.to_local())
    (region,) = localmap_fx.find_regions(rec.stage("captured"))
    targets = {str(n.target) for n in region.body_nodes}
    assert any("all_to_all_single" in t for t in targets), targets
