"""A border's planned conversions on 2 gloo ranks: the collective sums, and rank 1's shard lands at its offset.

The fake group of tests/unit/test_conversions.py is rank 0 and moves no data;
here each rank holds its own values, and every conversion must equal DTensor's
``redistribute_local_tensor`` bit for bit on every rank.
"""

from __future__ import annotations

import pytest

from localmap_fx.testing.dist import run_ranks


def _conversions(rank: int, world_size: int, device: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    from localmap_fx.compiler.conversions import plan_conversion

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))

    def spec(placements, shape):
        meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
        return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)

    out = {}
    # 5 rows over 2 ranks: rank 0 holds 3, rank 1 holds 2 at offset 3
    for name, src, dst, local_shape in [
        ("P->R", [Partial()], [Replicate()], (5, 4)),
        ("R->P", [Replicate()], [Partial()], (5, 4)),
        ("S(0)->P", [Shard(0)], [Partial()], (3 - rank, 4)),
        ("S(1)->P", [Shard(1)], [Partial()], (5, 2)),
    ]:
        g = torch.Generator().manual_seed(10 + rank)
        local = torch.randn(local_shape, generator=g)
        s, d = spec(src, (5, 4)), spec(dst, (5, 4))
        conversion = plan_conversion(s, d)
        want = redistribute_local_tensor(local.clone(), s, d)
        got = conversion(local.clone())
        out[name] = {"text": conversion.text(), "equal": bool(torch.equal(got._local_tensor, want)),
                     "local": got._local_tensor, "input": local}
    return out


@pytest.mark.slow
def test_conversions_equal_dtensors_on_two_ranks():
    import torch

    r0, r1 = run_ranks(_conversions, world_size=2, backend="gloo", device="cpu", timeout=120)
    for name in ("P->R", "R->P", "S(0)->P", "S(1)->P"):
        assert r0[name]["equal"] and r1[name]["equal"], name
        assert "_Redistribute" not in r0[name]["text"] and ":" in r0[name]["text"]
    # the values themselves, independently of DTensor: the sum, the halves, the offsets
    total = r0["P->R"]["input"] + r1["P->R"]["input"]
    assert torch.equal(r0["P->R"]["local"], total) and torch.equal(r1["P->R"]["local"], total)
    assert torch.equal(r0["R->P"]["local"], r0["R->P"]["input"] / 2)
    s0, s1 = r0["S(0)->P"], r1["S(0)->P"]
    assert s0["local"].shape == s1["local"].shape == (5, 4)
    assert torch.equal(s0["local"][:3], s0["input"]) and not s0["local"][3:].any()
    assert torch.equal(s1["local"][3:], s1["input"]) and not s1["local"][:3].any()
    c1 = r1["S(1)->P"]
    assert torch.equal(c1["local"][:, 2:], c1["input"]) and not c1["local"][:, :2].any()
