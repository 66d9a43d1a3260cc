"""Checked funcol bodies on real collectives: eager == compiled == single-device math.

Two gloo processes run a few accepted bodies of ``test_spmd_bodies.CASES``
(functional collectives of every kind, and a Replicate input whose gradient
follows its SPMD type) eagerly and compiled (``localmap_fx.backend``, bodies
outlined, inner aot_eager; inductor for two of them).  Forward values and
gradients are compared with the reference on plain tensors.  Compiled
funcol bodies cannot run under ``LocalTensorMode`` in torch 2.14.1, hence
this tier.  (gloo has no ``avg`` reduction, so avg bodies are left to the
LocalTensorMode tests.)  A negative control compiles one body with
``typecheck="off"`` and must get wrong gradients.
"""

from __future__ import annotations

import pytest

from localmap_fx.testing.dist import run_ranks

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

GLOO_CASES = [
    "ar_sum_matmul",
    "ar_sum_partial_then_relu",
    "ar_sum_varying",
    "ag_varying",
    "ag_varying_dim1_then_tanh",
    "rs_sum_matmul",
    "rs_sum_varying",
    "a2a_varying",
    "coalesced_all_reduce",
    "colwise_matmul",
]
INDUCTOR_CASES = ["ar_sum_matmul", "rs_sum_matmul"]
# typecheck="off" drops the grad placements the types give (R output ->
# Partial grad): funcol's all_reduce backward then sums a replicated grad.
NEGATIVE_CONTROL = "ar_sum_matmul"


def _inputs(case, mesh, seed=0):
    """The case's global inputs and DTensors holding them on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate

    g = torch.Generator().manual_seed(seed)
    globals_ = [torch.randn(shape, generator=g) for shape, _ in case.ins]
    n, rank = dist.get_world_size(), dist.get_rank()
    dts = []
    for i, (x, (_, placements)) in enumerate(zip(globals_, case.ins)):
        if any(isinstance(p, Partial) for p in placements):
            # same noise on every rank; rank r keeps x/n + noise_r - mean
            gn = torch.Generator().manual_seed(1000 + i)
            noise = [torch.randn(x.shape, generator=gn) for _ in range(n)]
            local = x / n + noise[rank] - sum(noise) / n
            dt = DTensor.from_local(local, mesh, list(placements), run_check=False)
        else:
            base = [Replicate() if isinstance(p, Partial) else p for p in placements]
            dt = distribute_tensor(x.clone(), mesh, base)
        dts.append(dt.detach().requires_grad_(case.requires_grad))
    return globals_, dts


def _run_cases(rank: int, world_size: int, device: str) -> dict:
    import torch
    from test_spmd_bodies import CASES, _as_tuple, _local_map, _reference
    from torch.distributed.device_mesh import init_device_mesh

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    report = {}
    for name in GLOO_CASES:
        case = CASES[name]
        globals_, _ = _inputs(case, mesh)
        g = torch.Generator().manual_seed(7)
        ref_outs = _as_tuple(case.ref(world_size, *globals_))
        cts = [torch.randn(o.shape, generator=g) for o in ref_outs]
        want_outs, want_grads = _reference(case, globals_, cts, world_size)
        modes = [("eager", None, {}), ("aot_eager", "aot_eager", {})]
        if name in INDUCTOR_CASES:
            modes.append(("inductor", "inductor", {}))
        if name == NEGATIVE_CONTROL:
            modes.append(("typecheck_off", "aot_eager", {"typecheck": "off"}))
        for mode, inner, opts in modes:
            torch._dynamo.reset()
            _, inputs = _inputs(case, mesh)
            fn = _local_map(case, mesh)
            if inner is not None:
                fn = torch.compile(fn, backend=localmap_fx.backend(inner, **opts), fullgraph=True)
            outs = _as_tuple(fn(*inputs))
            fulls = [o.full_tensor() for o in outs]
            loss = sum((f * ct).sum() for f, ct in zip(fulls, cts))
            loss.backward()
            errs = [(f - w).abs().max().item() for f, w in zip(fulls, want_outs)]
            errs += [
                (x.grad.full_tensor() - w).abs().max().item() for x, w in zip(inputs, want_grads)
            ]
            report[(name, mode)] = max(errs)
    return report


def test_checked_funcol_bodies_on_gloo():
    results = run_ranks(_run_cases, world_size=2, backend="gloo", device="cpu", timeout=300)
    bad = {
        (rank, key): err
        for rank, report in enumerate(results)
        for key, err in report.items()
        if (key[1] == "typecheck_off") == (err < 1e-4)
    }
    assert not bad, bad
    assert len(results[0]) == 2 * len(GLOO_CASES) + len(INDUCTOR_CASES) + 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
