"""Drop-in tier: code written for torch's ``local_map`` compiles as written.

Models here are written in the *shape* of public code that calls torch's
``local_map`` (torchtitan's TP inner attention and Qwen3.5 vision position
embeddings, autoparallel's DeepSeek-V3 MoE): a ``local_map`` built inside
``forward`` around ``super().__call__`` or ``F.interpolate``, placements read
at run time, keyword and non-tensor arguments, ``.tolist()`` split sizes,
regional compilation.  Each is compiled twice, with torch's ``local_map`` and
``backend="aot_eager"`` (upstream) and with ``localmap_fx.local_map`` and
``backend="localmap_fx"``; the two must give the same number of graphs and
graph breaks (Dynamo's counters), and ours must be bitwise equal to eager.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map as torch_local_map

import localmap_fx

from helpers import mesh_1d

IMPLS = {"torch": torch_local_map, "ours": localmap_fx.local_map}


def _counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since the last ``counters.clear()``."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _compiled(fn, impl: str, **kw):
    torch._dynamo.reset()
    counters.clear()
    backend = "aot_eager" if impl == "torch" else localmap_fx.backend("aot_eager")
    return torch.compile(fn, backend=backend, **kw)


# --- building a local_map inside compiled code, for every kind of callable --------


def _scale(a, k):
    return a * k


class _Doubler(nn.Module):
    def forward(self, a):
        return a * 2


class _HasMethod:
    def __init__(self, k):
        self.k = k

    def scaled(self, a):
        return a * self.k


class _WrapsSuperCall(nn.Module):
    """torchtitan's pattern: ``local_map(super().__call__, ...)`` on first call."""

    def __init__(self):
        super().__init__()
        self._fn = None

    def __call__(self, a, **kwargs):
        if self._fn is None:
            self._fn = self.lm(super().__call__, out_placements=(a.placements,),
                               in_placements=(a.placements,), device_mesh=a.device_mesh)
        return self._fn(a, **kwargs)

    def forward(self, a, *, k=1.0):
        return a * k


def _kinds(lm):
    """name -> (fn(x) building and calling a local_map inside, expected region name)."""
    R = [Shard(0)]

    def closure(x):
        k = 3.0

        def body(a):
            return a * k

        return lm(body, R, (R,))(x)

    module = _Doubler()
    holder = _HasMethod(4.0)
    supercall = _WrapsSuperCall()
    supercall.lm = lm
    return {
        "function": lambda x: lm(_scale, R, (R, None))(x, 2.0),
        "lambda": lambda x: lm(lambda a: a + 1, R, (R,))(x),
        "closure": closure,
        "bound_method": lambda x: lm(holder.scaled, R, (R,))(x),
        "super_call": lambda x: supercall(x, k=5.0),
        "module": lambda x: lm(module, R, (R,))(x),
        "builtin": lambda x: lm(torch.relu, R, (R,))(x),
        "torch_op": lambda x: lm(torch.ops.aten.mul.Tensor, R, (R, R))(x, x),
        "interpolate": lambda x: lm(F.interpolate, out_placements=(x.placements,))(
            x.view(1, 1, *x.shape), size=[8, 6], mode="bilinear", align_corners=True),
        "partial": lambda x: lm(functools.partial(_scale, k=6.0), R, (R,))(x),
    }


@pytest.mark.parametrize("kind", list(_kinds(torch_local_map)))
def test_local_map_built_in_compiled_code_is_one_graph(kind):
    """Every kind of callable real code wraps, built inside compiled code:
    fullgraph=True compiles (no break), the graphs of torch's local_map;
    the result is upstream's compiled result bitwise, and eager's (but see
    test_upstream_aot_eager_bilinear_interpolate_is_not_bitwise_eager)."""
    x = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Shard(0)])
    results, counts = {}, {}
    for impl, lm in IMPLS.items():
        want = _kinds(lm)[kind](x)
        # fresh objects: the module wrapping super().__call__ builds it in the compiled call
        compiled = _compiled(_kinds(lm)[kind], impl, fullgraph=True)
        compiled(x)
        got = compiled(x)
        counts[impl] = _counts()
        assert got.placements == want.placements
        if kind == "interpolate":
            torch.testing.assert_close(got.to_local(), want.to_local(), rtol=0, atol=1e-6)
        else:
            assert torch.equal(got.to_local(), want.to_local())
        results[impl] = got.to_local()
    assert torch.equal(results["ours"], results["torch"])
    # one graph, or two where the first call caches the local_map on the
    # module (the second call sees a different attribute: a recompile, upstream too)
    assert counts["ours"] == counts["torch"] == ((2, 0) if kind == "super_call" else (1, 0))


def test_upstream_aot_eager_bilinear_interpolate_is_not_bitwise_eager():
    """torch 2.14.1, plain tensors, no local_map: aot_eager's bilinear
    F.interpolate differs from eager in the last bits (its decomposition), so
    a compiled interpolate region is compared with a tolerance."""
    x = torch.randn(1, 1, 2, 4)

    def f(x):
        return F.interpolate(x, size=[8, 6], mode="bilinear", align_corners=True)

    got = torch.compile(f, backend="aot_eager")(x)
    assert not torch.equal(got, f(x))
    torch.testing.assert_close(got, f(x), rtol=0, atol=1e-6)


def test_wrapper_keeps_the_callables_public_attributes():
    """__name__, __qualname__, __doc__, __wrapped__ and the callable's own
    attributes, read through the wrapper (what update_wrapper gave)."""

    def body(a):
        """Body docstring."""
        return a

    body.custom = 7
    wrapped = localmap_fx.local_map(body, [Shard(0)], ([Shard(0)],))
    assert (wrapped.__name__, wrapped.__qualname__, wrapped.__doc__) == (
        "body", body.__qualname__, "Body docstring.")
    assert wrapped.__wrapped__ is body and wrapped.custom == 7
    import inspect

    assert str(inspect.signature(wrapped)) == "(a)"
    # a callable without them: no name, no doc of its own
    mod = localmap_fx.local_map(_Doubler(), [Shard(0)], ([Shard(0)],))
    assert not hasattr(mod, "__name__") and mod.__doc__ is None
    assert localmap_fx.local_map.__module__ == "localmap_fx.api"
    assert type(wrapped).__doc__.startswith("A function wrapped by")
    # nested: the outer wrapper keeps its own placements (update_wrapper copied the inner's)
    outer = localmap_fx.local_map(wrapped, [Replicate()], ([Replicate()],))
    assert outer.out_placements == [Replicate()] and outer.__wrapped__ is wrapped


# --- data-dependent sizes (.tolist() split sizes) ---------------------------------


def _dispatch(x, counts):
    """MoE-style dispatch: all_to_all with .tolist() splits, torch.split by
    them, index_select, and the reverse all_to_all."""
    import torch.distributed._functional_collectives as funcol

    sizes = counts.tolist()
    routed = funcol.all_to_all_single(x, sizes, sizes, (_MESH[0], 0))
    parts = torch.split(routed, sizes)
    routed = torch.cat([p * (i + 1) for i, p in enumerate(parts)])
    order = torch.argsort(routed[:, 0], stable=True)
    routed = routed.index_select(0, order).index_select(0, torch.argsort(order, stable=True))
    back = funcol.all_to_all_single(routed, sizes, sizes, (_MESH[0], 0))
    # static output size, as the MoE's scatter_add into its output buffer
    torch._check(back.shape[0] == x.shape[0])
    index = torch.arange(x.shape[0]).reshape(-1, 1).expand(-1, x.shape[1])
    return x.new_zeros(x.shape).scatter_add(0, index, back)


_MESH: list = []


def test_body_binding_unbacked_symbols_is_not_outlined():
    """A body whose .tolist() binds unbacked symbols stays inline when bodies
    are outlined (share_layers=False): outlined, AOTAutograd failed with
    PendingUnbackedSymbolNotFound."""
    from localmap_fx.passes.outline_regions import find_outline_matches
    from localmap_fx.testing.graphs import Recorder

    _MESH[:] = [mesh_1d()]
    lm = localmap_fx.local_map(_dispatch, [Shard(0)], ([Shard(0)], [Replicate()]), device_mesh=mesh_1d())
    x = distribute_tensor(torch.randn(16, 8), mesh_1d(), [Shard(0)]).requires_grad_()
    counts = distribute_tensor(torch.ones(4, dtype=torch.int64), mesh_1d(), [Replicate()])
    rec = Recorder("aot_eager", share_layers=False)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(lambda x, c: lm(x, c), backend=rec.backend, fullgraph=True)(x, counts)
        out.to_local().sum().backward()
    want = lm(x, counts)
    assert torch.equal(out.to_local(), want.to_local())
    (match,) = find_outline_matches(rec.stage("captured"))
    assert match.skip_reason is not None and match.skip_reason.startswith("creates data-dependent sizes (")


# --- models in the shape of public code, on 2 gloo ranks ---------------------------


class _InnerAttention(nn.Module):
    """torchtitan's TP inner attention: ``__call__`` wraps ``super().__call__``
    in a local_map on the first call, placements read from q, kwargs passed on."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self._fn = None

    def __call__(self, q, k, v, **kwargs):
        if isinstance(q, DTensor):
            if self._fn is None:
                self._fn = self.lm(
                    super().__call__,
                    in_placements=(q.placements, k.placements, v.placements),
                    out_placements=(q.placements,),
                    in_grad_placements=(q.placements, k.placements, v.placements),
                    device_mesh=q.device_mesh,
                )
            return self._fn(q, k, v, **kwargs)
        return super().__call__(q, k, v, **kwargs)

    def forward(self, q, k, v, *, scale=None, is_causal=True):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal).transpose(1, 2)


class _AttentionBlock(nn.Module):
    def __init__(self, lm, mesh, dim=16, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        w = lambda *shape: torch.randn(*shape) * 0.1  # noqa: E731
        self.wqkv = nn.ParameterList(nn.Parameter(distribute_tensor(w(dim, dim), mesh, [Shard(0)])) for _ in range(3))
        self.wo = nn.Parameter(distribute_tensor(w(dim, dim), mesh, [Shard(1)]))
        self.inner = _InnerAttention(lm)

    def forward(self, x):
        bs, seq, _ = x.shape
        q, k, v = (F.linear(x, w).view(bs, seq, -1, self.head_dim) for w in self.wqkv)
        out = self.inner(q, k, v, scale=None, is_causal=True).reshape(bs, seq, -1)
        return x + F.linear(out, self.wo).redistribute(x.device_mesh, [Replicate()])


class _Attention(nn.Module):
    def __init__(self, lm, mesh):
        super().__init__()
        self.layers = nn.ModuleList(_AttentionBlock(lm, mesh) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.full_tensor().pow(2).mean()


def _grid_rope(freq, grids, merge, head_dim):
    """Qwen3.5-style helper: a list of [t, h, w] lists and ints, on local tensors."""
    parts = []
    for t, h, w in grids:
        rows = (torch.arange(h // merge)[:, None] * merge + torch.arange(merge)[None]).reshape(-1)
        cols = (torch.arange(w // merge)[:, None] * merge + torch.arange(merge)[None]).reshape(-1)
        parts.append(torch.cat([freq[rows].repeat_interleave(cols.numel(), 0), freq[cols].repeat(rows.numel(), 1)], -1)
                     .repeat(t, 1))
    packed = torch.cat(parts)
    return torch.cat([packed.cos(), packed.sin()], -1)[:, : head_dim * 2]


class _VisionPositions(nn.Module):
    """Qwen3.5 vision position embeddings: ``local_map(F.interpolate,
    out_placements=...)`` per image size with keyword arguments, and a helper
    given a list of lists and ints with in_placements=None."""

    def __init__(self, lm, mesh, dim=8, side=4, head_dim=4):
        super().__init__()
        self.lm, self.dim, self.side, self.head_dim = lm, dim, side, head_dim
        self.pos = nn.Parameter(distribute_tensor(torch.randn(side * side, dim), mesh, [Shard(1)]))
        self.freq = nn.Parameter(distribute_tensor(torch.randn(8, head_dim), mesh, [Replicate()]))

    def forward(self, grids):
        grid = self.pos.reshape(self.side, self.side, -1).permute(2, 0, 1).unsqueeze(0)
        outs = []
        for h, w in dict.fromkeys((h, w) for _, h, w in grids):
            hw = self.lm(F.interpolate, out_placements=(grid.placements,))(
                grid, size=[h, w], mode="bilinear", align_corners=True)
            outs.append(hw.squeeze(0).permute(1, 2, 0).reshape(-1, self.dim))
        rope = self.lm(_grid_rope, out_placements=(self.freq.placements,))(self.freq, grids, 2, self.head_dim)
        return sum(o.full_tensor().pow(2).sum() for o in outs) + rope.full_tensor().pow(2).sum()


class _AllToAll(torch.autograd.Function):
    """autoparallel's all_to_all: an autograd Function over the functional collective."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, *ctx.splits, ctx.group), None, None, None


def _a2a(x, out_splits, in_splits, group):
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_to_all_single(x, out_splits, in_splits, group))


def _moe_region(x, expert_ids, w1, w2, num_experts, group):
    """DeepSeek-V3-style dispatch / experts / combine on local tensors: split
    sizes from .tolist(), torch.split by them, index_select and index_add."""
    ws = num_experts // w1.shape[0]
    order = torch.argsort(expert_ids, stable=True)
    routed = x.index_select(0, order)
    counts = torch.histc(expert_ids.float(), bins=num_experts, min=0, max=num_experts).long()
    recv_counts = _a2a(counts, [w1.shape[0]] * ws, [w1.shape[0]] * ws, group)
    in_splits = counts.view(ws, -1).sum(1).tolist()
    out_splits = recv_counts.view(ws, -1).sum(1).tolist()
    recv = _AllToAll.apply(routed, out_splits, in_splits, group)
    chunks = torch.split(recv, recv_counts.tolist())
    y = torch.cat([torch.relu(c @ w1[i % w1.shape[0]]) @ w2[i % w1.shape[0]] for i, c in enumerate(chunks)])
    back = _AllToAll.apply(y, in_splits, out_splits, group)
    torch._check(back.shape[0] == x.shape[0])
    return x.new_zeros(x.shape).index_add(0, order, back)


class _MoE(nn.Module):
    def __init__(self, lm, mesh, dim=8, hidden=8, num_experts=4):
        super().__init__()
        self.lm, self.mesh, self.num_experts = lm, mesh, num_experts
        self.gate = nn.Parameter(distribute_tensor(torch.randn(num_experts, dim), mesh, [Replicate()]))
        self.w1 = nn.Parameter(distribute_tensor(torch.randn(num_experts, dim, hidden) * 0.3, mesh, [Shard(0)]))
        self.w2 = nn.Parameter(distribute_tensor(torch.randn(num_experts, hidden, dim) * 0.3, mesh, [Shard(0)]))

    def forward(self, x):
        expert_ids = torch.argmax(F.linear(x, self.gate), dim=-1)
        # built per call, inside forward, as autoparallel's DSv3 does
        out = self.lm(
            _moe_region,
            out_placements=[Shard(0)],
            in_placements=([Shard(0)], [Shard(0)], [Shard(0)], [Shard(0)], None, None),
            redistribute_inputs=True,
            device_mesh=self.mesh,
        )(x, expert_ids, self.w1, self.w2, self.num_experts, self.mesh.get_group().group_name)
        return out.full_tensor().pow(2).mean()


def _grads(model):
    # the MoE gate gets none (argmax)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, fn, inputs):
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), _grads(model)


def _drop_in_models(rank: int, world_size: int, device: str) -> dict:
    """Per model and local_map (torch's, ours): (graphs, breaks) compiled, and
    the compiled loss and gradients next to eager's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    cases = {
        "attention": (_Attention, lambda: (distribute_tensor(torch.randn(2, 8, 16), mesh, [Replicate()]),), False),
        "attention_regional": (_Attention, lambda: (distribute_tensor(torch.randn(2, 8, 16), mesh, [Replicate()]),), True),
        "vision": (_VisionPositions, lambda: ([[1, 4, 4], [2, 2, 4], [1, 4, 4]],), False),
        "moe": (_MoE, lambda: (distribute_tensor(torch.randn(16, 8) + torch.arange(16.0)[:, None] * 0.1, mesh, [Shard(0)]),), False),
    }
    report: dict = {}
    for name, (cls, inputs, regional) in cases.items():
        for impl, lm in IMPLS.items():
            torch.manual_seed(0)
            model = cls(lm, mesh)
            eager = _run(model, model, inputs())
            torch.manual_seed(0)
            model = cls(lm, mesh)
            torch._dynamo.reset()
            counters.clear()
            backend = "aot_eager" if impl == "torch" else "localmap_fx"
            kw = {"options": {"inner": "aot_eager"}} if impl == "ours" else {}
            with torch._dynamo.config.patch(capture_scalar_outputs=name == "moe"):
                if regional:
                    for layer in model.layers:
                        layer.compile(backend=backend, **kw)
                    fn = model
                else:
                    fn = torch.compile(model, backend=backend, **kw)
                compiled = _run(model, fn, inputs())
            report[name, impl] = {"counts": _counts(), "eager": eager, "compiled": compiled}
    return report


def _same(a, b) -> bool:
    (la, ga), (lb, gb) = a, b
    return torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.fixture(scope="module")
def drop_in_report():
    from localmap_fx.testing.dist import run_ranks

    return run_ranks(_drop_in_models, world_size=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention", "attention_regional", "vision", "moe"])
def test_public_shaped_model_graphs_and_numerics(drop_in_report, name):
    """backend="localmap_fx" (options={"inner": "aot_eager"}) gives upstream's
    graphs and graph breaks, and eager's loss and gradients bitwise, on both
    ranks; where upstream's compiled result is not bitwise eager
    (NOT_BITWISE_UPSTREAM), ours is bitwise upstream's and within 1e-5 of eager."""
    for report in drop_in_report:
        ours, theirs = report[name, "ours"], report[name, "torch"]
        assert ours["counts"] == theirs["counts"], (ours["counts"], theirs["counts"])
        assert _same(ours["eager"], theirs["eager"])
        if name in NOT_BITWISE_UPSTREAM:
            assert not _same(theirs["compiled"], theirs["eager"])  # upstream's, pinned
            assert _same(ours["compiled"], theirs["compiled"])
            torch.testing.assert_close(ours["compiled"], ours["eager"], rtol=0, atol=1e-5)
        else:
            assert _same(ours["compiled"], ours["eager"])
    # upstream, pinned: no graph break; regionally, the second block recompiles
    # (its inner attention has not built its local_map yet: a guard on the attribute)
    assert drop_in_report[0][name, "torch"]["counts"] == ((2, 0) if name == "attention_regional" else (1, 0))


# upstream's aot_eager is not bitwise eager here: per-block graphs (3.7e-9 on
# a gradient, with torch's local_map too)
NOT_BITWISE_UPSTREAM = ("attention_regional",)


def _split_scale(a, sizes):
    return torch.cat([p * (i + 1) for i, p in enumerate(torch.split(a, sizes))])


@pytest.mark.parametrize("share_layers", [False, "auto"])
def test_sizes_from_tolist_outside_the_region(share_layers):
    """Split sizes computed by .tolist() before the region (a list argument,
    in_placements None) and an .item() bound after it: compiles, eager's
    values bitwise."""
    lm = localmap_fx.local_map(_split_scale, [Shard(0)], ([Shard(0)], None), device_mesh=mesh_1d())

    def fn(x, counts):
        out = lm(x, counts.tolist())
        n = counts[0].item()
        return out.to_local()[:n] * 2

    x = distribute_tensor(torch.randn(16, 4), mesh_1d(), [Shard(0)])
    counts = torch.tensor([1, 3])
    want = fn(x, counts)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(fn, backend=localmap_fx.backend("aot_eager", share_layers=share_layers), fullgraph=True)
        got = compiled(x, counts)
    assert torch.equal(got, want)
