"""Uneven sharding: correct global shapes in eager and compiled, no extra collective.

torch 2.14.1's local_map assumes even shards when wrapping outputs (pytorch
#172812): 9 rows over 2 ranks become a global size of 10 on rank 0 and 8 on
rank 1.  localmap_fx infers the size from a matching input (see
localmap_fx/shapes.py).  This is a documented deviation from torch; the parity
tests use even shapes only.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from localmap_fx.shapes import output_global_shape
from localmap_fx.testing.dist import run_ranks

MODES = ("eager", "compiled")


def test_output_global_shape_rule():
    S0, S1, R = Shard(0), Shard(1), Replicate()
    # rank with the short shard of a 9-row input split over 2: local 4 rows
    inputs = [((S0,), (9, 4), (4, 4))]
    assert output_global_shape((4, 4), (S0,), (2,), inputs) == ((9, 4), True)
    # body changed the sharded dim: no matching input, even assumption stays
    assert output_global_shape((8, 4), (S0,), (2,), inputs) == ((16, 4), False)
    # replicated / partial dims keep their local size
    assert output_global_shape((4, 4), (R,), (2,), inputs) == ((4, 4), False)
    # output sharded on dim 1 matches an input sharded on dim 0 with the same local size
    assert output_global_shape((3, 2), (S1,), (2,), [((S0,), (3, 4), (2, 4))]) == ((3, 3), True)
    # 2-D mesh: only the mesh dim that shards the dim is consulted
    inputs2 = [((S0, R), (9, 4), (4, 4))]
    assert output_global_shape((4, 4), (S0, R), (2, 2), inputs2) == ((9, 4), True)


def _uneven(rank: int, world_size: int, device: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import localmap_fx
    from localmap_fx.testing.graphs import Recorder, collective_counts

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    full = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4) / 10
    fn = localmap_fx.local_map(
        lambda a: torch.sin(a) * 2, out_placements=[Shard(0)], in_placements=([Shard(0)],)
    )
    out = {}
    for mode in MODES:
        x = distribute_tensor(full.clone(), mesh, [Shard(0)]).requires_grad_()
        if mode == "eager":
            with CommDebugMode() as comm:
                y = fn(x)
            out["eager_comms"] = comm.get_total_counts()
        else:
            rec = Recorder("aot_eager")
            y = torch.compile(lambda a: fn(a), backend=rec.backend, fullgraph=True)(x)
            out["compiled_comms"] = sum(collective_counts(rec.aot["forward"]).values())
        out[f"{mode}_shape"] = tuple(y.shape)
        out[f"{mode}_full"] = y.full_tensor()
        y.full_tensor().sum().backward()
        out[f"{mode}_grad"] = x.grad.full_tensor()
    return out


@pytest.mark.parametrize("backend,device", [
    pytest.param("gloo", "cpu", id="gloo-cpu"),
    pytest.param("nccl", "cuda", id="nccl-cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")),
])
@pytest.mark.slow
def test_uneven_shard_eager_and_compiled(backend, device):
    results = run_ranks(_uneven, world_size=2, backend=backend, device=device, timeout=300)
    full = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4) / 10
    for r in results:
        for mode in MODES:
            assert r[f"{mode}_shape"] == (9, 4)
            assert r[f"{mode}_comms"] == 0  # no size exchange, no host sync
            torch.testing.assert_close(r[f"{mode}_full"], torch.sin(full) * 2)
            torch.testing.assert_close(r[f"{mode}_grad"], torch.cos(full) * 2)
