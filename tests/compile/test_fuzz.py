"""Differential fuzzing: eager fallback vs compiled (aot_eager) vs single-device math.

Random meshes (1-D and 2-D), placements, bodies (elementwise, matmul,
reductions, views, multiple outputs), redistribute on/off and grad
placements.  All ranks run in this process (``LocalTensorMode``).

Profiles (``LOCALMAP_FX_FUZZ_PROFILE``): ``ci`` (default, 60 examples,
derandomized: the same ones every run) and ``long`` (500 examples):
``LOCALMAP_FX_FUZZ_PROFILE=long pytest tests/compile/test_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

import localmap_fx

from helpers import WORLD_SIZE, ltm_mesh_for, rank_dtensor

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=500, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("LOCALMAP_FX_FUZZ_PROFILE", "ci"))

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@dataclasses.dataclass(frozen=True)
class Body:
    """A body and the placement rule that makes it correct on shards.

    ``rule(in_mesh_dim_placements) -> (out placements per output, grad per input)``
    is given per mesh dimension; ``None`` means the combination is invalid.
    """

    name: str
    fn: object
    n_in: int
    reference: object
    rule: object


def _elementwise_rule(ps):
    (p,) = ps
    return (p,), (p,)


def _binary_rule(ps):
    a, b = ps
    return ((a,), (a, b)) if a == b else None


def _rowsum_rule(ps):  # sum over dim 1: dim 1 must not be sharded
    (p,) = ps
    if p == S1:
        return None
    return (p,), (p,)


def _transpose_rule(ps):
    (p,) = ps
    swap = {S0: S1, S1: S0, R: R}
    return (swap[p],), (p,)


def _matmul_rule(ps):
    a, b = ps
    table = {
        (S0, R): ((S0,), (S0, P)),
        (R, S1): ((S1,), (P, S1)),
        (S1, S0): ((P,), (S1, S0)),
        (R, R): ((R,), (R, R)),
    }
    return table.get((a, b))


def _two_out_rule(ps):
    (p,) = ps
    return (p, p), (p,)


BODIES = [
    Body("sin", lambda x: torch.sin(x) * 2 + 1, 1, lambda x: torch.sin(x) * 2 + 1, _elementwise_rule),
    Body("mul_add", lambda x, y: x * y + x, 2, lambda x, y: x * y + x, _binary_rule),
    Body("rowsum", lambda x: x.sum(1, keepdim=True) * x, 1, lambda x: x.sum(1, keepdim=True) * x, _rowsum_rule),
    Body("transpose", lambda x: x.t().contiguous() * 3, 1, lambda x: x.t() * 3, _transpose_rule),
    Body("matmul", lambda x, w: x @ w, 2, lambda x, w: x @ w, _matmul_rule),
    Body("two_out", lambda x: (x.exp(), x - 1), 1, lambda x: (x.exp(), x - 1), _two_out_rule),
]


@st.composite
def cases(draw):
    ndim = draw(st.sampled_from([1, 2]))
    body = draw(st.sampled_from(BODIES))
    # per mesh dim, pick input placements the body accepts
    per_dim_in, per_dim_out, per_dim_grad = [], [], []
    for _ in range(ndim):
        options = []
        for combo in _combos(body.n_in):
            r = body.rule(combo)
            if r is not None:
                options.append((combo, r))
        combo, (outs, grads) = draw(st.sampled_from(options))
        per_dim_in.append(combo)
        per_dim_out.append(outs)
        per_dim_grad.append(grads)
    # a placement may not shard the same tensor dim twice on a 2-D mesh
    for i in range(body.n_in):
        shards = [d[i] for d in per_dim_in if d[i] in (S0, S1)]
        if len(shards) != len(set(shards)):
            from hypothesis import assume

            assume(False)
    redistribute = draw(st.booleans())
    actual = []
    for i in range(body.n_in):
        if redistribute:
            actual.append(tuple(draw(st.sampled_from([S0, S1, R])) for _ in range(ndim)))
        else:
            actual.append(tuple(d[i] for d in per_dim_in))
    for a in actual:
        shards = [p for p in a if p in (S0, S1)]
        if len(shards) != len(set(shards)):
            from hypothesis import assume

            assume(False)
    with_grads = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return ndim, body, per_dim_in, per_dim_out, per_dim_grad, redistribute, actual, with_grads, seed


def _combos(n):
    import itertools

    return list(itertools.product([S0, S1, R], repeat=n))


def _full(t):
    return t.full_tensor()


@pytest.mark.slow
@given(cases())
def test_eager_compiled_and_math_agree(case):
    ndim, body, per_in, per_out, per_grad, redistribute, actual, with_grads, seed = case
    n_out = len(per_out[0])
    in_placements = tuple(tuple(d[i] for d in per_in) for i in range(body.n_in))
    out_placements = tuple(tuple(d[j] for d in per_out) for j in range(n_out))
    grad_placements = tuple(tuple(d[i] for d in per_grad) for i in range(body.n_in))
    # elementwise-style rules need no grad hint; matmul's R inputs need Partial.
    needs_grads = any(P in g for g in grad_placements)
    if needs_grads:
        with_grads = True

    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(8, 8, generator=g) for _ in range(body.n_in)]

    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(ndim, "fuzz")
        fn = localmap_fx.local_map(
            body.fn,
            out_placements=out_placements if n_out > 1 else list(out_placements[0]),
            in_placements=in_placements,
            in_grad_placements=grad_placements if with_grads else None,
            device_mesh=mesh,
            redistribute_inputs=redistribute,
        )

        def call(*xs):
            outs = fn(*xs)
            return outs if isinstance(outs, tuple) else (outs,)

        results = []
        for compiled in (False, True):
            xs = [rank_dtensor(f, mesh, a) for f, a in zip(fulls, actual)]
            f = torch.compile(call, backend=localmap_fx.backend("aot_eager", outline=False), fullgraph=True) if compiled else call
            outs = f(*xs)
            loss = sum((o.redistribute(mesh, [R] * ndim) ** 2).sum() for o in outs)
            loss.backward()
            results.append((loss, outs, [x.grad for x in xs]))
            torch._dynamo.reset()
        (el, eo, eg), (cl, co, cg) = results
        # eager == compiled, bitwise, per rank, with placements
        for a, b in [(el, cl), *zip(eo, co), *zip(eg, cg)]:
            assert a.placements == b.placements
            la, lb = a.to_local(), b.to_local()
            for r in range(WORLD_SIZE):
                assert torch.equal(la._local_tensors[r], lb._local_tensors[r])
        full_out = [_full(o) for o in eo]
        full_grads = [_full(gr) for gr in eg]
        full_loss = _full(el)
        full_out = [o._local_tensors[0] if hasattr(o, "_local_tensors") else o for o in full_out]
        full_grads = [t._local_tensors[0] if hasattr(t, "_local_tensors") else t for t in full_grads]
        full_loss = full_loss._local_tensors[0] if hasattr(full_loss, "_local_tensors") else full_loss

    # single-device math
    refs = [f.clone().requires_grad_() for f in fulls]
    ro = body.reference(*refs)
    ro = ro if isinstance(ro, tuple) else (ro,)
    rl = sum((o**2).sum() for o in ro)
    rl.backward()
    torch.testing.assert_close(full_loss, rl.detach(), rtol=1e-4, atol=1e-4)
    for a, b in zip(full_out, ro):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-4)
    for a, b in zip(full_grads, refs):
        torch.testing.assert_close(a, b.grad, rtol=1e-4, atol=1e-4)
