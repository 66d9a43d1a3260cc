"""Eager ``localmap_fx.local_map`` on real process groups (2 ranks).

A tensor-parallel MLP::

    h = relu(x @ w1.T + b1)     column-parallel: w1, b1 Shard(0); h Shard(1)
    y = h @ w2.T                row-parallel:    w2 Shard(1); y Partial
    z = y.redistribute(R) + b2  all_reduce, then the replicated bias
    loss = (z * z).sum()

is run forward and backward with ``localmap_fx.local_map`` and with torch's
own ``local_map`` on the same inputs in the same processes, and the same math
runs on full tensors on one device.  Checks: outputs and every gradient match
the single-device math (tight tolerance); grad placements are the expected
ones; ours equals torch's bitwise (local values, placements) and issues the
same collectives.  Variants: explicit ``in_grad_placements``, torch's
default grad placements, ``redistribute_inputs=True``, ``spmd_types=True``.

Everything runs in one spawn per (backend, device) (module-scoped fixture);
each case catches its own exception so that one broken case fails only its
tests, with the rank's traceback.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from localmap_fx.testing.dist import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
B, D, H = 4, 8, 16  # batch, model dim, hidden dim (H and D divisible by 2)
RTOL, ATOL = 1e-5, 1e-5

CASES = ("tp_mlp", "default_grad_placements", "redistribute_inputs", "spmd_types")
# Cases whose gradients are all correct (the default case's x.grad is not:
# torch's local_map labels it Replicate although each rank holds a partial sum).
EXACT_CASES = ("tp_mlp", "redistribute_inputs", "spmd_types")
PARAMS = ("x", "w1", "b1", "w2", "b2")


# ---------------------------------------------------------------------------
# Child side: runs in each spawned rank.
# ---------------------------------------------------------------------------


def _data(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    shapes = {"x": (B, D), "w1": (H, D), "b1": (H,), "w2": (D, H), "b2": (D,)}
    return {k: torch.randn(s, generator=g).to(device) for k, s in shapes.items()}


def _reference(data: dict[str, torch.Tensor]) -> dict:
    """The MLP on full tensors, one device."""
    t = {k: v.clone().requires_grad_() for k, v in data.items()}
    h = torch.relu(t["x"] @ t["w1"].t() + t["b1"])
    z = h @ t["w2"].t() + t["b2"]
    (z * z).sum().backward()
    return {"out": z.detach(), "grads": {k: v.grad for k, v in t.items()}}


def _regions(lm, case: str):
    """The two regions of the MLP, written with ``lm`` (torch's or ours)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, S0, S1, P = [Replicate()], [Shard(0)], [Shard(1)], [Partial()]
    kw: dict = {}
    # x is replicated but its gradient is a partial sum on each rank.
    col_grads = (P, S0, S0)
    if case == "default_grad_placements":
        col_grads = None
    elif case == "redistribute_inputs":
        kw = {"redistribute_inputs": True}
    elif case == "spmd_types":
        kw = {"spmd_types": True}

    def column(x, w, b):
        return torch.relu(x @ w.t() + b)

    def row(h, w):
        return h @ w.t()

    col = lm(
        column,
        out_placements=S1,
        in_placements=(R, S0, S0),
        in_grad_placements=col_grads,
        **kw,
    )
    row_ = lm(row, out_placements=P, in_placements=(S1, S1), **kw)
    return col, row_


def _input_placements(case: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    placements = {"x": [Replicate()], "w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [Replicate()]}
    if case == "redistribute_inputs":
        # Batch-sharded activations and a replicated w2: both regions must
        # redistribute their inputs first.
        placements["x"] = [Shard(0)]
        placements["w2"] = [Replicate()]
    return placements


def _run_dist(lm, case: str, mesh, data: dict) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    placements = _input_placements(case)
    t = {
        k: distribute_tensor(v, mesh, placements[k]).requires_grad_()
        for k, v in data.items()
    }
    col, row = _regions(lm, case)
    with CommDebugMode() as comm:
        h = col(t["x"], t["w1"], t["b1"])
        y = row(h, t["w2"])
        z = y.redistribute(placements=[Replicate()]) + t["b2"]
        (z * z).sum().backward()
    return {
        "h_placements": tuple(h.placements),
        "y_placements": tuple(y.placements),
        "out_local": z.to_local(),
        "out": z.full_tensor(),
        "grad_placements": {k: tuple(v.grad.placements) for k, v in t.items()},
        "grad_locals": {k: v.grad.to_local() for k, v in t.items()},
        "grads": {k: v.grad.full_tensor() for k, v in t.items()},
        "comms": {str(op): n for op, n in comm.get_comm_counts().items()},
    }


def _spmd_type_error(lm, mesh) -> str:
    """The error text for a body whose output type contradicts out_placements."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    x = DTensor.from_local(torch.ones(2, 2, device=mesh.device_type), mesh, [Replicate()])
    bad = lm(
        lambda a: a * 2,  # R stays R, but out_placements claims Partial
        out_placements=[Partial()],
        in_placements=([Replicate()],),
        spmd_types=True,
    )
    try:
        bad(x)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _guard(fn, *args) -> dict:
    try:
        return {"ok": fn(*args)}
    except Exception:  # noqa: BLE001 - reported per case to the parent
        return {"error": traceback.format_exc()}


def _all_checks(rank: int, world_size: int, device: str) -> dict:
    """Every case with ours and torch's local_map; one spawn for the module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    data = _data(device)
    results: dict = {"ref": _reference(data), "world_size": world_size}
    for case in CASES:
        results[case] = {
            "torch": _guard(_run_dist, torch_local_map, case, mesh, data),
            "ours": _guard(_run_dist, localmap_fx.local_map, case, mesh, data),
        }
    results["spmd_type_error"] = {
        "torch": _guard(_spmd_type_error, torch_local_map, mesh),
        "ours": _guard(_spmd_type_error, localmap_fx.local_map, mesh),
    }
    return results


# ---------------------------------------------------------------------------
# Parent side: pytest.
# ---------------------------------------------------------------------------

BACKENDS = [
    pytest.param(("gloo", "cpu"), id="gloo-cpu"),
    pytest.param(
        ("nccl", "cuda"),
        id="nccl-cuda",
        marks=pytest.mark.skipif(
            torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
        ),
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request) -> list[dict]:
    backend, device = request.param
    return run_ranks(
        _all_checks, world_size=WORLD_SIZE, backend=backend, device=device, timeout=180
    )


def _get(rank_result: dict, case: str, impl: str):
    rec = rank_result[case][impl]
    if "error" in rec:
        pytest.fail(f"{impl} local_map failed in case {case!r}:\n{rec['error']}", pytrace=False)
    return rec["ok"]


def _expected_grad_placements(case: str) -> dict:
    from torch.distributed.tensor import Partial, Replicate, Shard

    expected = {
        "x": (Partial(),),
        "w1": (Shard(0),),
        "b1": (Shard(0),),
        "w2": (Shard(1),),
        "b2": (Replicate(),),
    }
    if case == "default_grad_placements":
        expected["x"] = (Replicate(),)
    elif case == "redistribute_inputs":
        # Backward of the input redistributions: Partial -> Shard(0) for x
        # (reduce_scatter), Shard(1) -> Replicate for w2 (all_gather).
        expected["x"] = (Shard(0),)
        expected["w2"] = (Replicate(),)
    return expected


@pytest.mark.parametrize("case", EXACT_CASES)
def test_matches_single_device(ranks, case):
    for rank, res in enumerate(ranks):
        ref = res["ref"]
        ours = _get(res, case, "ours")
        torch.testing.assert_close(
            ours["out"], ref["out"], rtol=RTOL, atol=ATOL, msg=lambda m, rank=rank: f"rank {rank} out: {m}"
        )
        for name in PARAMS:
            torch.testing.assert_close(
                ours["grads"][name],
                ref["grads"][name],
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, rank=rank, name=name: f"rank {rank} grad of {name}: {m}",
            )


def test_default_grad_placements_weights_match_single_device(ranks):
    """Without in_grad_placements only x.grad is off (torch's semantics)."""
    for res in ranks:
        ref = res["ref"]
        ours = _get(res, "default_grad_placements", "ours")
        torch.testing.assert_close(ours["out"], ref["out"], rtol=RTOL, atol=ATOL)
        for name in ("w1", "b1", "w2", "b2"):
            torch.testing.assert_close(ours["grads"][name], ref["grads"][name], rtol=RTOL, atol=ATOL)
        # Each rank's x.grad is its partial sum, labelled Replicate.
        assert not torch.allclose(ours["grads"]["x"], ref["grads"]["x"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES)
def test_placements(ranks, case):
    from torch.distributed.tensor import Partial, Shard

    for res in ranks:
        ours = _get(res, case, "ours")
        assert ours["h_placements"] == (Shard(1),)
        assert ours["y_placements"] == (Partial(),)
        assert ours["grad_placements"] == _expected_grad_placements(case)


@pytest.mark.parametrize("case", CASES)
def test_bitwise_equal_to_torch_local_map(ranks, case):
    for rank, res in enumerate(ranks):
        theirs = _get(res, case, "torch")
        ours = _get(res, case, "ours")
        where = f"rank {rank}, case {case}"
        assert torch.equal(ours["out_local"], theirs["out_local"]), where
        assert ours["h_placements"] == theirs["h_placements"], where
        assert ours["y_placements"] == theirs["y_placements"], where
        assert ours["grad_placements"] == theirs["grad_placements"], where
        for name in PARAMS:
            assert torch.equal(ours["grad_locals"][name], theirs["grad_locals"][name]), (
                f"{where}: local grad of {name} differs"
            )


@pytest.mark.parametrize("case", CASES)
def test_same_collectives_as_torch_local_map(ranks, case):
    for res in ranks:
        assert _get(res, case, "ours")["comms"] == _get(res, case, "torch")["comms"]


def test_redistribute_inputs_communicates(ranks):
    comms = _get(ranks[0], "redistribute_inputs", "ours")["comms"]
    plain = _get(ranks[0], "tp_mlp", "ours")["comms"]
    assert sum(comms.values()) > sum(plain.values()), (comms, plain)


def test_spmd_type_error_matches_torch(ranks):
    for res in ranks:
        theirs = _get(res, "spmd_type_error", "torch")
        ours = _get(res, "spmd_type_error", "ours")
        assert theirs.startswith("ValueError: Output tensor placement mismatch"), theirs
        # Ours keeps torch's text and may append a hint.
        assert ours.startswith(theirs), f"ours: {ours}\ntorch: {theirs}"


def _raise_on_rank1(rank: int, world_size: int, device: str) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("raised on purpose by rank 1")
    dist.barrier()  # rank 0 waits for a peer that has left


def test_harness_reraises_child_exception():
    """run_ranks re-raises the first failing rank's error with its traceback."""
    from localmap_fx.testing.dist import RankTraceback

    with pytest.raises(ValueError, match="raised on purpose by rank 1") as info:
        run_ranks(_raise_on_rank1, world_size=2, timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, RankTraceback)
    assert "rank 1 of 2 raised builtins.ValueError first" in cause.tb
    assert "in _raise_on_rank1" in cause.tb
