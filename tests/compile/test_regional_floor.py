"""The regional step with torch's frame left out (:mod:`benchmarks.regional_floor`):
what the figure "torch's frame per block" of docs/benchmarks.md rests on.

The direct step must be the regional step minus Dynamo and nothing else: the
same compiled function, the same arguments in the same slots, so the same
values, and no Dynamo frame on the way."""

from __future__ import annotations

import torch

import localmap_fx

from helpers import mesh_1d

SHAPE = {"batch": 8, "d": 16, "hidden": 32}


def test_a_direct_block_call_gives_the_regional_steps_values_bitwise():
    from benchmarks.depth_bench import build
    from benchmarks.regional_floor import _values, direct_step

    mesh = mesh_1d()
    backend = localmap_fx.backend("aot_eager")
    torch._dynamo.reset()
    regional = _values(*build(mesh, "module", "ours_regional", 3, backend=backend, **SHAPE))
    direct = _values(*direct_step(mesh, "ours", 3, backend, **SHAPE))
    assert len(regional) == len(direct) == 1 + 1 + 2 * 3  # loss, input, two weights per block
    for got, want in zip(direct, regional):
        assert torch.equal(got, want)


def test_a_direct_step_enters_no_dynamo_frame():
    from benchmarks.regional_floor import direct_step

    step, zero, _ = direct_step(mesh_1d(), "ours", 2, localmap_fx.backend("aot_eager"), **SHAPE)
    torch._dynamo.reset()  # a block that went through Dynamo now would compile again
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    step()
    zero()
    assert counters["stats"]["unique_graphs"] == before
