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
import os

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from localmap_fx.compiler.cacheable_border import CacheableBorder
from localmap_fx.compiler.dtensor_border import DTensorBorder
from localmap_fx.compiler.specs import decode_placements, encode_placements

from helpers import border_recording, col_row, mesh_1d, seeded_dtensor

pytestmark = pytest.mark.inductor


def _recording(**opts):
    """A backend that keeps the border (or callable) compile_graph returned per frame."""
    return border_recording("inductor", **opts)


_dt = seeded_dtensor
_col_row = col_row


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


def test_a_strided_shard_is_written_and_read_back():
    from localmap_fx._torch_compat import StridedShard

    placements = (StridedShard(0, split_factor=2), Shard(1))
    assert encode_placements(placements) == "SS(0,2),S(1)"
    assert decode_placements("SS(0,2),S(1)") == placements


def test_a_placement_of_another_kind_is_not_written():
    class Odd(Replicate):
        pass

    assert encode_placements((Odd(),)) is None
    with pytest.raises(ValueError, match="no placement this border wrote"):
        decode_placements("X(0)")
    with pytest.raises(ValueError, match="no placements text"):
        decode_placements("R,,S(0)")


# --- which graphs it runs ----------------------------------------------------------------

@pytest.mark.slow
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


@pytest.mark.slow
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


def _checkpointed(body):
    from torch.utils.checkpoint import checkpoint

    def f(x, w1, w2):
        y = checkpoint(body, x, w1, w2, use_reentrant=False)
        return (y.redistribute(x.device_mesh, [Replicate()]) ** 2).sum()

    return f


def _body_partial(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def _body_gathered(x, w1, w2):
    return torch.relu(x @ w1).redistribute(placements=[Replicate()]) @ w2


@pytest.mark.slow
def test_the_gradient_file_is_keyed_on_subgraph_bodies_too():
    """Found by a review: two frames whose top-level code is the same (a
    checkpointed body, in a submodule of the graph) got one gradient file, so
    a cache hit on the first read the second's placements (``w2.grad`` was
    None).  Each frame now has its own file, and every hit gives eager's
    placements."""
    from torch._inductor.utils import fresh_cache

    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)
    fa, fb = _checkpointed(_body_partial), _checkpointed(_body_gathered)
    eager = {f: _step(f, x, w1, w2) for f in (fa, fb)}
    assert [g[0] for g in eager[fa][1:]] != [g[0] for g in eager[fb][1:]]  # what the test is about
    with fresh_cache():
        for f in (fa, fb, fa, fb):
            torch._dynamo.reset()
            backend, seen = _recording()
            got = _step(torch.compile(f, backend=backend), x, w1, w2)
            assert isinstance(seen[0], CacheableBorder), seen
            assert [g[0] for g in got[1:]] == [g[0] for g in eager[f][1:]], (f, seen[0].text())
        assert len(_grad_files()) == 2


def test_a_retained_graph_reads_each_backwards_placements():
    """Found by a review: a first backward whose gradient arrived Partial left
    its input-gradient placements for the next backward of the same graph
    (``retain_graph=True``), whose gradient arrived as traced."""
    from localmap_fx._torch_compat import functorch_config

    x, w1, w2 = _dt((8, 16), [Replicate()], 0), _dt((16, 32), [Shard(1)], 1), _dt((32, 16), [Shard(0)], 2)

    def summed(x, w1, w2):
        return _col_row(x, w1, w2).sum(0)

    def run(fn):
        out = fn(x, w1, w2)
        (out.to_local(grad_placements=[Partial()]) ** 2).sum().backward(retain_graph=True)
        first = [g[0] for g in _grads(x, w1, w2)]
        (out ** 2).sum().backward()
        return first, [g[0] for g in _grads(x, w1, w2)]

    eager = run(summed)
    assert eager[0] != eager[1]  # what the test is about
    backend, seen = _recording()
    torch._dynamo.reset()
    with functorch_config.patch(donated_buffer=False):  # retain_graph
        got = run(torch.compile(summed, backend=backend))
    assert isinstance(seen[0], CacheableBorder), seen
    assert got == eager


@pytest.mark.slow
def test_a_frame_with_no_dtensor_input_compiles_once_and_hits():
    """Found by a review: DTensors made inside the frame (``from_local`` of
    plain inputs) never called the wrapper's enter, which was how the border
    told a trace from a cache hit, so every compile ran twice and none was
    ever saved."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache
    from torch.distributed.tensor import DTensor

    mesh = mesh_1d()

    def f(a, b):
        x = DTensor.from_local(a, mesh, [Replicate()])
        w = DTensor.from_local(b, mesh, [Shard(1)])
        return (torch.relu(x @ w) ** 2).sum()

    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 8, requires_grad=True)
    with fresh_cache():
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            backend, seen = _recording()
            torch.compile(f, backend=backend)(a, b).backward()
            runs.append((seen[0], dict(counters["aot_autograd"]), a.grad.clone(), b.grad.clone()))
            a.grad = b.grad = None
    (first, c1, ga1, gb1), (second, c2, ga2, gb2) = runs
    assert isinstance(first, CacheableBorder) and "from the trace" in first.text()
    assert c1.get("autograd_cache_miss") == 1 and c1.get("autograd_cache_saved") == 1, c1
    assert c2.get("autograd_cache_hit") == 1 and c2.get("autograd_cache_miss", 0) == 0, c2
    assert "gradient file" in second.text()
    assert torch.equal(ga1, ga2) and torch.equal(gb1, gb2)


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


def _resharded(x, w1, w2):
    """``Shard(1)`` then ``Replicate`` again: the backward chunks the gradient
    to this rank's ``Shard(1)``, so the trace holds this rank's offset (Note:
    [A trace belongs to its rank])."""
    y = _col_row(x, w1, w2).redistribute(x.device_mesh, [Shard(1)]).redistribute(x.device_mesh, [Replicate()])
    return (y ** 2).sum()


def _gloo_values(rank, world_size, device):
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    w1, w2 = _dt((16, 32), [Shard(1)], 1, mesh=mesh), _dt((32, 16), [Shard(0)], 2, mesh=mesh)
    report = {}
    for name, fn, x in (("loss", _loss, _dt((8, 16), [Replicate()], 0, mesh=mesh)),
                        ("partial", _summed, _dt((8, 16), [Replicate()], 0, mesh=mesh)),
                        ("resharded", _resharded, _dt((8, 16), [Replicate()], 0, mesh=mesh))):
        def run(f, name=name, x=x):
            out = f(x, w1, w2)
            if name == "partial":
                # a gradient arriving Partial, as after the next region
                out = (out.to_local(grad_placements=[Partial()]) ** 2).sum()
            out.backward()
            return [out.detach().clone(), *_grads(x, w1, w2)]

        eager = run(fn)
        # compiled twice: a trace, then (both ranks share the cache folder) an AOTAutogradCache hit
        for attempt in ("trace", "hit"):
            backend, seen = _recording()
            torch._dynamo.reset()
            counters.clear()
            got = run(torch.compile(fn, backend=backend))
            report[(name, attempt)] = (
                type(seen[0]).__name__, counters["aot_autograd"].get("autograd_cache_hit", 0),
                [p for p, _ in eager[1:]] == [p for p, _ in got[1:]],
                # relative to each gradient's largest entry, as the other gloo tests compare
                max(((a - b).abs().max() / (1 + a.abs().max())).item()
                    for (_, a), (_, b) in zip(eager[1:], got[1:])),
                # relative: the losses are sums of a few hundred squares
                ((eager[0] - got[0]).abs() / (1 + eager[0].abs())).max().item())
    return report


@pytest.mark.slow
def test_on_gloo_gradients_and_placements_equal_eager(tmp_path, monkeypatch):
    """Both ranks share one cache folder, as on one host by default: the
    second compile of each graph is an AOTAutogradCache hit, and must serve
    each rank its own trace (the first version served one rank's to both)."""
    from localmap_fx.testing.dist import run_ranks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    for report in run_ranks(_gloo_values, world_size=2, timeout=900):
        for (name, attempt), (kind, hits, placements_same, grad_err, loss_err) in report.items():
            assert kind == "CacheableBorder", (name, kind)
            assert hits == (attempt == "hit"), (name, attempt, hits)
            assert placements_same, (name, attempt)
            assert grad_err <= 1e-5 and loss_err <= 1e-5, (name, attempt, grad_err, loss_err)


def _gloo_stable_keys(rank, world_size, device):
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    x = _dt((8, 16), [Replicate()], 0, mesh=mesh)
    w1, w2 = _dt((16, 32), [Shard(1)], 1, mesh=mesh), _dt((32, 16), [Shard(0)], 2, mesh=mesh)
    eager = _step(_resharded, x, w1, w2)
    out = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        got = _step(torch.compile(_resharded, backend=localmap_fx.backend(stable_cache_keys=True)), x, w1, w2)
        out.append((counters["aot_autograd"].get("autograd_cache_hit", 0),
                    max(((a - b).abs().max() / (1 + a.abs().max())).item()
                        for (_, a), (_, b) in zip(eager[1:], got[1:]))))
    return out


@pytest.mark.slow
def test_on_gloo_stable_cache_keys_serve_each_rank_its_own_trace(tmp_path, monkeypatch):
    """``stable_cache_keys=True`` lifts the mesh by the same key: the second
    compile hits, and each rank gets its own trace (Note: [A trace belongs to
    its rank])."""
    from localmap_fx.testing.dist import run_ranks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    for (hits1, err1), (hits2, err2) in run_ranks(_gloo_stable_keys, world_size=2, timeout=900):
        assert (hits1, hits2) == (0, 1)
        assert err1 <= 1e-5 and err2 <= 1e-5, (err1, err2)
