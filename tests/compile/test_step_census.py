"""The collectives one training step issues, per way of compiling a stack
(:mod:`benchmarks.step_census`, fake process group): what the step figures
of docs/benchmarks.md rest on.

In one graph the attention stack's residual gradient stays ``Partial``
(eager DTensor's sharding propagation), so each block's projections gather
their weights and reduce-scatter; behind a block border (regional, marked)
the gradient becomes ``Replicate`` with one all_reduce per block.  The TP
stack's regions fix its gradients' placements, so every way runs the same
all_reduces, except marked blocks: their last block's ``Replicate`` gradient
crosses the layer border as Partial and its backward sums it again (the
regional border leaves that sum out: Note: [The tangent's all_reduce belongs
to the border]).
"""

from __future__ import annotations

import torch

import localmap_fx

from helpers import mesh_1d

WAYS = ("ours_whole", "ours_regional", "ours_marked")


def _census(style: str, **shape) -> dict:
    from benchmarks.depth_bench import build
    from benchmarks.step_census import collectives_per_step

    mesh = mesh_1d()
    counts = {}
    for way in WAYS:
        torch._dynamo.reset()
        step, zero, _ = build(mesh, style, way, 2, backend=localmap_fx.backend("aot_eager"), **shape)
        for _ in range(2):
            step()
            zero()
        counts[way] = collectives_per_step(step, zero)
    return counts


def test_attention_in_one_graph_gathers_weights_where_a_block_border_all_reduces():
    counts = _census("attention", batch=2, seq=8, d=16, n_heads=4)
    # 2 layers: an all_reduce per layer forward; the last layer's gradient comes
    # from the loss as Replicate, the first's from the last as Partial: that
    # backward gathers two weights and reduce-scatters
    assert counts["ours_whole"] == {"allgather_into_tensor_coalesced": 2, "allreduce": 2,
                                    "reduce_scatter_tensor_coalesced": 1}
    assert counts["ours_regional"] == counts["ours_marked"] == {"allreduce": 3}


def test_tp_stack_runs_its_regions_all_reduces_every_way():
    counts = _census("module", batch=8, d=16, hidden=32)
    assert counts["ours_whole"] == counts["ours_regional"] == {"allreduce": 3}
    assert counts["ours_marked"] == {"allreduce": 4}
