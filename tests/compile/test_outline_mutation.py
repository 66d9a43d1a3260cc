"""Outlining never changes what a body computes, whatever way it writes to an input.

``outline_regions`` keeps a body inline when it writes into an input's
storage (see Note: [Deciding that a body writes to or aliases an input] in
localmap_fx/analysis.py): in place, through
a view, with ``out=``, ``copy_`` or ``setitem``.  Each body below runs
compiled with outlining on and off (and eagerly); outputs and the inputs
after the call must agree.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.passes.outline_regions import find_outline_matches

from helpers import mesh_1d


def _view_add(x, w):
    x[0].add_(1.0)  # write through a view of the input
    return x * w


def _flat_view_mul(x, w):
    x.view(-1).mul_(2.0)
    return x + w


def _out_arg(x, w):
    torch.mul(w, 3.0, out=x)  # out= into the input
    return x + 1


def _copy_into(x, w):
    x.copy_(w * 2)
    return x - w


def _setitem(x, w):
    x[1] = w[1]
    return x * 2


def _pure(x, w):
    return x * w + 1


BODIES = {f.__name__.lstrip("_"): f for f in (_view_add, _flat_view_mul, _out_arg, _copy_into, _setitem)}


def _run(body, mode):
    mesh = mesh_1d()
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    f = localmap_fx.local_map(
        body, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]), device_mesh=mesh
    )
    if mode == "eager":
        run = f
    else:
        torch._dynamo.reset()
        run = torch.compile(
            lambda a, b: f(a, b) * 1,
            backend=localmap_fx.backend("aot_eager", outline=(mode == "outlined")),
            fullgraph=True,
        )
    out = run(x, w)
    return out.to_local().clone(), x.to_local().clone()


@pytest.mark.parametrize("name", list(BODIES))
def test_outlined_matches_inline(name):
    body = BODIES[name]
    eager = _run(body, "eager")
    inline = _run(body, "inline")
    outlined = _run(body, "outlined")
    for got, what in ((inline, "inline"), (outlined, "outlined")):
        torch.testing.assert_close(got[0], eager[0], msg=f"{what} output")
        torch.testing.assert_close(got[1], eager[1], msg=f"{what} input after the call")


def _matches(body):
    """find_outline_matches on the graph Dynamo captures for ``body``."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(find_outline_matches(gm))
        return gm

    mesh = mesh_1d()
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]).redistribute(mesh, [Shard(0)])
    f = localmap_fx.local_map(
        body, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]), device_mesh=mesh
    )
    torch._dynamo.reset()
    torch.compile(lambda a, b: f(a, b), backend=backend, fullgraph=True)(x, w)
    return seen


@pytest.mark.parametrize("name", list(BODIES))
def test_writing_bodies_stay_inline(name):
    (m,) = _matches(BODIES[name])
    assert m.skip_reason is not None and m.skip_reason.startswith("writes to input"), m.skip_reason


def test_pure_body_is_outlined():
    (m,) = _matches(_pure)
    assert m.skip_reason is None
