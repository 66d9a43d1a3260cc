"""Gradients verified on real ranks: samples of the LocalTensorMode suites on 2 gloo ranks.

``LocalTensorMode`` can mis-sum a ``Partial`` gradient whose local value is a
plain tensor (../shared/notes/torch-2.14-findings.md), so every suite that
claims "gradients match single-device math" also runs a sample here, in one
launch of two gloo processes:

* SPMD bodies (``test_spmd_bodies.CASES``): every accepted 1-D body without
  functional collectives (those are in test_spmd_gloo.py), Partial inputs
  and autograd.Function bodies included; eager and compiled (outlined);
* fuzzing (``test_fuzz.BODIES``): every body with every input placement its
  rule accepts on a 1-D mesh, eager and compiled;
* parity (``test_eager_parity``'s claim): on the same fuzz cases, torch's own
  ``local_map`` gives the same outputs and gradients as ours.

Forward values and gradients are compared with the math on plain tensors.
"""

from __future__ import annotations

import pytest

from localmap_fx.testing.dist import run_ranks

pytestmark = pytest.mark.slow

TOL = 1e-4


def _spmd_cases() -> list[str]:
    from test_spmd_bodies import CASES

    return [
        n for n, c in CASES.items()
        if c.ndim == 1 and not c.funcol and c.error is None and c.requires_grad
    ]


def _fuzz_cases() -> list[tuple[int, tuple]]:
    from test_fuzz import BODIES, _combos

    out = []
    for b, body in enumerate(BODIES):
        for combo in _combos(body.n_in):
            if body.rule(combo) is not None:
                out.append((b, combo))
    return out


def _loss_and_grads(fn, inputs, cts):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    fulls = [o.full_tensor() for o in outs]
    loss = sum((f * ct).sum() for f, ct in zip(fulls, cts))
    loss.backward()
    return fulls, [x.grad.full_tensor() for x in inputs]


def _err(got, want) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def _run(rank: int, world_size: int, device: str) -> dict:
    import torch
    from test_fuzz import BODIES
    from test_spmd_bodies import CASES, _as_tuple, _local_map, _reference
    from test_spmd_gloo import _inputs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    import localmap_fx

    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    S0, R = Shard(0), Replicate()
    report: dict = {}

    def compiled(fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend=localmap_fx.backend("aot_eager"), fullgraph=True)

    for name in _spmd_cases():
        case = CASES[name]
        globals_, _ = _inputs(case, mesh)
        g = torch.Generator().manual_seed(7)
        cts = [torch.randn(o.shape, generator=g) for o in _as_tuple(case.ref(world_size, *globals_))]
        want_outs, want_grads = _reference(case, globals_, cts, world_size)
        for mode in ("eager", "compiled") if case.compiles else ("eager",):
            _, inputs = _inputs(case, mesh)
            fn = _local_map(case, mesh)
            outs, grads = _loss_and_grads(fn if mode == "eager" else compiled(fn), inputs, cts)
            report[("spmd", name, mode)] = max(_err(outs, want_outs), _err(grads, want_grads))

    cases = [(b, combo, None) for b, combo in _fuzz_cases()]
    # negative control: matmul (S0, R) with the weight's grad declared R
    # instead of P reads per-rank partial gradients as replicated ones
    matmul = next(i for i, b in enumerate(BODIES) if b.name == "matmul")
    cases.append((matmul, (S0, R), (S0, R)))
    for b, combo, wrong_grads in cases:
        body = BODIES[b]
        outs_p, grads_p = body.rule(combo)
        grads_p = wrong_grads or grads_p
        g = torch.Generator().manual_seed(b)
        fulls = [torch.randn(8, 8, generator=g) for _ in range(body.n_in)]
        leaves = [f.clone().requires_grad_(True) for f in fulls]
        want = body.reference(*leaves)
        want = want if isinstance(want, tuple) else (want,)
        cts = [torch.randn(w.shape, generator=g) for w in want]
        sum((w * ct).sum() for w, ct in zip(want, cts)).backward()
        want_outs, want_grads = [w.detach() for w in want], [x.grad for x in leaves]
        out_placements = tuple([p] for p in outs_p) if len(outs_p) > 1 else [outs_p[0]]
        kw = dict(
            out_placements=out_placements,
            in_placements=tuple([p] for p in combo),
            in_grad_placements=tuple([p] for p in grads_p),
            device_mesh=mesh,
        )
        kind = "fuzz" if wrong_grads is None else "control"
        for mode in ("eager", "compiled", "torch"):
            impl = torch_local_map if mode == "torch" else localmap_fx.local_map
            fn = impl(body.fn, **kw)
            inputs = [
                distribute_tensor(f.clone(), mesh, [p]).requires_grad_(True)
                for f, p in zip(fulls, combo)
            ]
            outs, grads = _loss_and_grads(fn if mode != "compiled" else compiled(fn), inputs, cts)
            report[(kind, f"{body.name}{combo}", mode)] = max(
                _err(outs, want_outs), _err(grads, want_grads)
            )
    return report


def test_gradients_on_gloo_match_single_device_math():
    results = run_ranks(_run, world_size=2, backend="gloo", device="cpu", timeout=600)
    assert results[0].keys() == results[1].keys()
    bad = {
        (r, k): e for r, rep in enumerate(results) for k, e in rep.items()
        if (k[0] == "control") == (e < TOL)  # the control must be wrong
    }
    assert not bad, bad
    kinds = {k[0] for k in results[0]}
    assert kinds == {"spmd", "fuzz", "control"}
    assert sum(k[0] == "spmd" for k in results[0]) >= 15
    assert sum(k[0] == "fuzz" for k in results[0]) >= 3 * 15
