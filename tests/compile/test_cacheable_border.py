"""The DTensor border torch's caches can serve (``localmap_fx/compiler/cacheable_border.py``).

A Dynamo frame with no output chained to an input (a whole model returning
its loss), compiled with Inductor and torch's caches on, runs on
AOTAutograd's runtime over local tensors, between two autograd nodes of the
border (Note: [A border torch's caches can serve]).  The warm restart in a
new process is in ``test_warm_restart.py``; values on real collectives at
the end of this file.
"""

from __future__ import annotations

import glob
import inspect
import os

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from localmap_fx.compiler import BackendOptions
from localmap_fx.compiler.cacheable_border import CacheableBorder, decode_placements, encode_placements
from localmap_fx.compiler.dtensor_border import DTensorBorder
from localmap_fx.compiler.pipeline import compile_graph

from helpers import mesh_1d

pytestmark = pytest.mark.inductor


def _recording(**opts):
    """A backend that keeps the border (or callable) compile_graph returned per frame."""
    options = BackendOptions(inner="inductor", **opts)
    seen: list = []

    def backend(gm, example_inputs):
        fn = compile_graph(gm, example_inputs, options)
        seen.append(inspect.unwrap(fn))
        return fn

    return backend, seen


def _dt(shape, placements, seed, requires_grad=True, mesh=None):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape, generator=g)
    return distribute_tensor(full, mesh or mesh_1d(), placements).detach().requires_grad_(requires_grad)


def _col_row(x, w1, w2):
    h = torch.relu(x @ w1)                      # R @ S(1) -> S(1)
    y = h @ w2                                  # S(1) @ S(0) -> P
    return y.redistribute(x.device_mesh, [Replicate()]) + x


def _loss(x, w1, w2):
    return (_col_row(x, w1, w2) ** 2).sum()


def _grads(*ts):
    out = [(t.grad.placements, t.grad.full_tensor()) for t in ts]
    for t in ts:
        t.grad = None
    return out


def _step(fn, x, w1, w2):
    loss = fn(x, w1, w2)
    loss.backward()
    return [loss.full_tensor(), *_grads(x, w1, w2)]


def _same(a, b, exact=True):
    assert torch.equal(a[0], b[0]) if exact else torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    for (pa, ga), (pb, gb) in zip(a[1:], b[1:]):
        assert pa == pb
        assert torch.equal(ga, gb) if exact else torch.allclose(ga, gb, rtol=1e-5, atol=1e-5)


def _grad_files() -> list[str]:
    from localmap_fx._torch_compat import inductor_cache_dir

    return glob.glob(os.path.join(inductor_cache_dir(), "localmap_fx", "border_grads", "*.json"))


# --- the placements written as constants ----------------------------------------------

def test_placements_are_written_and_read_back():
    for placements in [(Shard(0),), (Replicate(),), (Partial(),), (Partial("max"), Shard(1), Replicate())]:
        text = encode_placements(placements)
        assert text is not None and decode_placements(text) == placements
    assert encode_placements((Shard(1), Partial())) == "S(1),P(sum)"


def test_a_placement_of_another_kind_is_not_written():
    from localmap_fx._torch_compat import StridedShard

    assert encode_placements((StridedShard(0, split_factor=2),)) is None
    with pytest.raises(ValueError, match="no placement this border wrote"):
        decode_placements("X(0)")


# --- which graphs it runs ----------------------------------------------------------------

def test_a_whole_graph_runs_on_aotautograds_runtime_and_equals_eager():
    from torch._inductor.utils import fresh_cache

    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    eager = _step(_loss, x, w1, w2)
    backend, seen = _recording()
    torch._dynamo.reset()
    with fresh_cache():
        got = _step(torch.compile(_loss, backend=backend), x, w1, w2)
    (border,) = seen
    assert isinstance(border, CacheableBorder), border
    assert "from the trace" in border.text()
    # eager's placements: the Replicate input's gradient is Partial, the weights' are Shard
    assert [g[0] for g in got[1:]] == [(Partial(),), (Shard(1),), (Shard(0),)]
    _same(eager, got, exact=False)


def test_a_cache_hit_reads_the_gradient_placements_from_the_file():
    """In one process, after ``torch._dynamo.reset()``: AOTAutogradCache hits
    (nothing traced), so the input gradients' placements come from the file
    the first compile wrote; without the file the border compiles again with
    AOTAutogradCache off (never a guess)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    eager = _step(_loss, x, w1, w2)
    with fresh_cache():
        runs = []
        for delete_file in (False, False, True):
            if delete_file:
                for f in _grad_files():
                    os.remove(f)
            torch._dynamo.reset()
            counters.clear()
            backend, seen = _recording()
            got = _step(torch.compile(_loss, backend=backend), x, w1, w2)
            runs.append((seen[0], dict(counters["aot_autograd"]), got, len(_grad_files())))
    (first, c1, g1, files1), (second, c2, g2, _), (third, c3, g3, files3) = runs
    assert "from the trace" in first.text() and c1.get("autograd_cache_miss") == 1 and files1 == 1
    assert c2.get("autograd_cache_hit") == 1 and "gradient file" in second.text(), (c2, second.text())
    assert "without a gradient file" in third.text() and files3 == 1, third.text()
    for got in (g1, g2, g3):
        _same(eager, got, exact=False)
    _same(g1, g2)


def test_a_block_whose_output_feeds_its_input_keeps_the_lean_border():
    """A stack's block is called once per layer: it keeps the lean border's
    one autograd node and its tangent plan."""
    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    backend, seen = _recording()
    torch._dynamo.reset()
    y = torch.compile(_col_row, backend=backend)(x, w1, w2)
    y.sum().backward()
    assert isinstance(seen[0], DTensorBorder), seen


def test_a_user_reading_aot_graphs_gets_the_lean_border():
    """``on_aot_graph`` (and the dump) read AOTAutograd's graphs, which a cache hit does not have."""
    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    graphs: list = []
    backend, seen = _recording(on_aot_graph=lambda kind, gm: graphs.append(kind))
    torch._dynamo.reset()
    _step(torch.compile(_loss, backend=backend), x, w1, w2)
    assert isinstance(seen[0], DTensorBorder), seen
    assert graphs == ["forward", "backward"]


def test_a_graph_calling_invoke_subgraph_gets_the_lean_border():
    """Outlined region bodies (``share_layers=False``): AOTAutogradCache is
    kept off for such a graph, so nothing would serve the cacheable border."""
    import warnings

    from localmap_fx.testing.models import TPStack, tp_stack_input

    mesh = mesh_1d()
    model, x = TPStack(mesh, 2, d=16, hidden=32), tp_stack_input(mesh, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # outline=True under inductor warns
        backend, seen = _recording(share_layers=False)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).backward()
    assert isinstance(seen[0], DTensorBorder), seen


def test_caches_off_gets_the_lean_border():
    from localmap_fx._torch_compat import functorch_config

    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    backend, seen = _recording()
    torch._dynamo.reset()
    with functorch_config.patch(enable_autograd_cache=False):
        _step(torch.compile(_loss, backend=backend), x, w1, w2)
    assert isinstance(seen[0], DTensorBorder), seen


def test_an_input_in_other_placements_is_refused():
    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    backend, seen = _recording()
    torch._dynamo.reset()
    torch.compile(_loss, backend=backend)(x, w1, w2)
    border = seen[0]
    with pytest.raises(RuntimeError, match="input 1 of a compiled graph is DTensor"):
        border(x, _dt((16, 32), [Shard(0)], 1), w2)


# --- gloo: real collectives ----------------------------------------------------------------

def _summed(x, w1, w2):
    """Not chained (its output is smaller than any input): its Replicate output
    may receive a Partial gradient, which the border reads as traced."""
    return _col_row(x, w1, w2).sum(0)


def _gloo_values(rank, world_size, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    x = _dt((8, 16), [Replicate()], 0, mesh=mesh)
    w1, w2 = _dt((16, 32), [Shard(1)], 1, mesh=mesh), _dt((32, 16), [Shard(0)], 2, mesh=mesh)
    report = {}
    for name, fn in (("loss", _loss), ("partial", _summed)):
        def run(f, name=name):
            out = f(x, w1, w2)
            if name == "partial":
                # a gradient arriving Partial, as after the next region
                out = (out.to_local(grad_placements=[Partial()]) ** 2).sum()
            out.backward()
            return [out.detach().clone(), *_grads(x, w1, w2)]

        eager = run(fn)
        backend, seen = _recording()
        torch._dynamo.reset()
        got = run(torch.compile(fn, backend=backend))
        report[name] = (type(seen[0]).__name__, [p for p, _ in eager[1:]] == [p for p, _ in got[1:]],
                        # relative to each gradient's largest entry, as the other gloo tests compare
                        max(((a - b).abs().max() / (1 + a.abs().max())).item()
                            for (_, a), (_, b) in zip(eager[1:], got[1:])),
                        # relative: the losses are sums of a few hundred squares
                        ((eager[0] - got[0]).abs() / (1 + eager[0].abs())).max().item())
    return report


@pytest.mark.slow
def test_on_gloo_gradients_and_placements_equal_eager():
    from localmap_fx.testing.dist import run_ranks

    for report in run_ranks(_gloo_values, world_size=2, timeout=900):
        for name, (kind, placements_same, grad_err, loss_err) in report.items():
            assert kind == "CacheableBorder", (name, kind)
            assert placements_same, name
            assert grad_err <= 1e-5 and loss_err <= 1e-5, (name, grad_err, loss_err)
