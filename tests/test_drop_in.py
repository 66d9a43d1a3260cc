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
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
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
