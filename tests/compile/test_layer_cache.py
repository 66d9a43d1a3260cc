"""Compiled layers restored from Inductor's cache without a trace (Note: [A kept compile restarts from Inductor's cache]).

The key's parts and refusals are checked on small graphs; the round trip
compiles one TP block behind the lean border in a fresh cache folder,
forgets Dynamo's compile, and compiles it again: the second compile loads
the block's graphs by their FX keys, and gives the first one's numbers.
The same in a new process is ``tests/compile/test_warm_restart.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial

from localmap_fx.compiler import layer_cache
from localmap_fx.compiler.dtensor_border import DTensorBorder, _saved_from_json, _saved_json

from helpers import border_recording, mesh_1d


def _traced(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def _user_function(x):
    return x * 2


torch.fx.wrap("_user_function")


def test_a_graph_of_torch_calls_may_be_cached():
    gm = _traced(lambda x: torch.relu(x) + torch.ops.aten.mul.Tensor(x, x))
    assert layer_cache.cacheable_graph(gm) is None


def test_a_graph_calling_user_code_is_not_cached():
    """Its code could change under the same name: the key cannot see it."""
    gm = _traced(lambda x: _user_function(x) + 1)
    reason = layer_cache.cacheable_graph(gm)
    assert reason is not None and "_user_function" in reason and __name__ in reason
    assert layer_cache.layer_key(gm, [torch.ones(2)], None) is None


def test_a_graph_calling_a_custom_operator_is_not_cached():
    lib = torch.library.Library("localmap_fx_test_layer_cache", "FRAGMENT")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
        op = torch.ops.localmap_fx_test_layer_cache.twice.default
        gm = _traced(lambda x: op(x))
        reason = layer_cache.cacheable_graph(gm)
        assert reason is not None and "localmap_fx_test_layer_cache" in reason
    finally:
        lib._destroy()


def test_the_key_changes_with_what_the_trace_depends_on():
    from torch._inductor import config as inductor_config

    gm = _traced(lambda x: torch.relu(x) * 3)
    x = torch.ones(4, 2)
    key = layer_cache.layer_key(gm, [x], ["about"])
    assert key is not None and key == layer_cache.layer_key(gm, [x], ["about"])
    others = [
        layer_cache.layer_key(_traced(lambda x: torch.relu(x) * 4), [x], ["about"]),  # the code
        layer_cache.layer_key(gm, [torch.ones(2, 4)], ["about"]),  # a layout
        layer_cache.layer_key(gm, [x.t()], ["about"]),  # a stride
        layer_cache.layer_key(gm, [x.double()], ["about"]),  # a dtype
        layer_cache.layer_key(gm, [x.requires_grad_()], ["about"]),  # requires grad
        layer_cache.layer_key(gm, [torch.ones(4, 2)], ["other"]),  # what the caller says
    ]
    with inductor_config.patch(max_autotune=not inductor_config.max_autotune):
        others.append(layer_cache.layer_key(gm, [torch.ones(4, 2)], ["about"]))
    with torch.no_grad():
        others.append(layer_cache.layer_key(gm, [torch.ones(4, 2)], ["about"]))
    assert None not in others
    assert len({key, *others}) == len(others) + 1


def test_no_entry_or_an_unreadable_one_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    before = layer_cache.counts()
    assert layer_cache.load_layer("0" * 64, None) is None
    folder = tmp_path / "localmap_fx" / "layers"
    folder.mkdir(parents=True)
    (folder / f"{'1' * 64}.json").write_text('{"forward": {"key": "nope"')
    (folder / f"{'2' * 64}.json").write_text(json.dumps({"forward": {}}))
    assert layer_cache.load_layer("1" * 64, None) is None
    assert layer_cache.load_layer("2" * 64, None) is None
    after = layer_cache.counts()
    assert (after.miss - before.miss, after.hit - before.hit) == (3, 0)


def test_the_saved_signature_survives_its_json():
    """A restored variant is compared with compiled ones by this signature (``DTensorBorder.variant_for``)."""
    sig = (("relu", ((16, 32), (32, 1), torch.float32)), ("permute_1", ((32, 16), (1, 32), torch.bfloat16)),
           ("token", "FakeScriptObject"))
    assert _saved_from_json(json.loads(json.dumps(_saved_json(sig)))) == sig


@pytest.mark.slow
@pytest.mark.inductor
def test_a_block_compiled_again_is_restored_with_the_same_numbers(tmp_path, monkeypatch):
    """One TP block, Inductor, a fresh cache folder: the first compile saves
    its entry; after ``torch._dynamo.reset()`` the second loads it (no trace)
    and gives the first compile's loss and gradients, bit for bit, and the
    same plan (the Partial gradient the next block sends)."""
    from localmap_fx.testing.models import TPStack, tp_stack_input

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    mesh = mesh_1d()
    block, x = TPStack(mesh, 1, d=16, hidden=32).blocks[0], tp_stack_input(mesh, 8, 16)
    leaves = [x, *block.parameters()]

    def run():
        backend, seen = border_recording("inductor")
        torch._dynamo.reset()
        y = torch.compile(block, backend=backend)(x)
        (y.to_local(grad_placements=[Partial()]) ** 2).sum().backward()
        grads = [t.grad.to_local().clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return y.to_local().clone(), grads, seen

    before = layer_cache.counts()
    y1, g1, (b1,) = run()
    middle = layer_cache.counts()
    y2, g2, (b2,) = run()
    after = layer_cache.counts()
    assert (middle.saved - before.saved, middle.hit - before.hit) == (1, 0)
    assert (after.hit - middle.hit, after.miss - middle.miss, after.saved - middle.saved) == (1, 0, 0)
    assert isinstance(b1, DTensorBorder) and isinstance(b2, DTensorBorder)
    assert b1.plan.text() == b2.plan.text() == "compile (P(sum))"
    assert b2.first.saved == b1.first.saved
    assert [s and s.placements for s in b2.first.in_grad_specs] == [s and s.placements for s in b1.first.in_grad_specs]
    assert b2.first.layer.reductions == b1.first.layer.reductions
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
