"""A corpus of local_map bodies, each labelled right or silently wrong, for the global SPMD check.

Every :class:`Body` is a region body written for local shards, the
placements it is called with, and the single-device function it is meant to
compute (``ref``, on the global inputs).  ``wrong`` bodies run, have the
right shapes and types per rank, and compute something else; their
``error`` is a substring of the message ``spmd_types="global"`` must give.

The labels are not taken on trust: ``tests/distributed/test_spmd_global.py`` runs every
body on real gloo ranks and checks that a right body gives ``ref``'s values
and a wrong one does not.

Meshes: ``"tp"`` / ``"ep"`` / ``"sp"`` bodies run on a 1-D mesh of 2 ranks,
``"dp,tp"`` bodies on a 2 x 2 mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Body:
    """One region body; ``body(mesh)`` returns the function given to ``local_map``."""

    mesh: str  # comma-separated mesh dimension names: "tp" (2 ranks) or "dp,tp" (2 x 2)
    body: Callable[[Any], Callable]
    ins: tuple  # per input: (global shape or a tensor factory, placements)
    out: Any  # out_placements
    ref: Callable  # ref(*global inputs) -> output or tuple of outputs
    wrong: bool = False
    error: str = ""  # substring of the global check's message (wrong bodies)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.split(","))


def _g(mesh, name: str = ""):
    """The group of mesh dimension ``name`` (the only one of a 1-D mesh)."""
    return (mesh, mesh.mesh_dim_names.index(name) if name else 0)


def _ar(x, mesh, op="sum", name=""):
    return funcol.all_reduce(x, op, _g(mesh, name))


def _long(n: int, high: int):
    """A factory of integer inputs (targets, ids)."""
    return lambda g: torch.randint(0, high, (n,), generator=g)


def _arange(n: int):
    return lambda g: torch.arange(n)


# --- row-parallel matmul and what comes before its reduction ---------------------------

def _rowpar(pre: Callable | None = None, post: Callable | None = None):
    def body(mesh):
        def f(x, w):
            y = x @ w
            if pre is not None:
                y = pre(y)
            y = _ar(y, mesh)
            return post(y) if post is not None else y

        return f

    return body


def _rowpar_bias(before: bool):
    def body(mesh):
        def f(x, w, b):
            if before:
                return _ar(x @ w + b, mesh)
            return _ar(x @ w, mesh) + b

        return f

    return body


ROW = (((4, 8), [S1]), ((8, 6), [S0]))
ROW_BIAS = ROW + (((6,), [R]),)

# --- vocabulary-parallel softmax and cross-entropy -----------------------------------


def _vocab_softmax(global_max: bool):
    def body(mesh):
        def f(x):
            m = x.amax(-1, keepdim=True)
            if global_max:
                m = _ar(m, mesh, "max")
            e = torch.exp(x - m)
            return e / _ar(e.sum(-1, keepdim=True), mesh)

        return f

    return body


def _vocab_ce_right(mesh):
    def f(x, t, ids):
        m = _ar(x.amax(-1, keepdim=True), mesh, "max")
        lse = torch.log(_ar(torch.exp(x - m).sum(-1), mesh)) + m.squeeze(-1)
        idx = t - ids[0]
        mine = (idx >= 0) & (idx < x.shape[-1])
        tgt = x.gather(-1, idx.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        tgt = _ar(tgt * mine.to(x.dtype), mesh)
        return (lse - tgt).mean()

    return f


def _vocab_ce_wrong(mesh):
    def f(x, t, ids):
        idx = (t - ids[0]).clamp(0, x.shape[-1] - 1)
        return _ar(F.cross_entropy(x, idx), mesh) / 2

    return f


VOCAB_CE = (((4, 10), [S1]), (_long(4, 10), [R]), (_arange(10), [S0]))

# --- layer norm and RMS norm over a sharded hidden dimension ----------------------------


def _ln_right(mesh):
    def f(x):
        h = x.shape[-1] * 2
        mean = _ar(x.sum(-1, keepdim=True), mesh) / h
        xc = x - mean
        var = _ar((xc * xc).sum(-1, keepdim=True), mesh) / h
        return xc * torch.rsqrt(var + EPS)

    return f


def _ln_wrong(mesh):
    return lambda x: F.layer_norm(x, x.shape[-1:], eps=EPS)


def _rms_right(mesh):
    def f(x, w):
        ms = _ar(x.pow(2).sum(-1, keepdim=True), mesh) / (x.shape[-1] * 2)
        return x * torch.rsqrt(ms + EPS) * w

    return f


def _rms_wrong(mesh):
    return lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rms_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


# --- sequence parallel: norm on the local tokens, then all_gather --------------------------


def _seq_norm_gather(gather_dim: int):
    def body(mesh):
        def f(x, w):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
            return funcol.all_gather_tensor(y, gather_dim, _g(mesh))

        return f

    return body


# --- MoE: experts sharded over ep -------------------------------------------------------


def _moe_einsum(local_softmax: bool):
    def body(mesh):
        def f(x, w, g):
            if local_softmax:
                g = torch.softmax(g, -1)  # the gates of this rank's experts only
            h = torch.einsum("td,edf->tef", x, w)
            return _ar(torch.einsum("tef,te->tf", h, g), mesh, name="ep")

        return f

    return body


def _moe_ref(softmax: bool):
    def ref(x, w, g):
        if softmax:
            g = torch.softmax(g, -1)
        return torch.einsum("tef,te->tf", torch.einsum("td,edf->tef", x, w), g)

    return ref


def _moe_loop(local_softmax: bool):
    def body(mesh):
        def f(x, w, g):
            if local_softmax:
                g = torch.softmax(g, -1)
            y = torch.zeros(x.shape[0], w.shape[-1])
            for e in range(w.shape[0]):  # this rank's experts
                y = y + g[:, e : e + 1] * F.silu(x @ w[e])
            return _ar(y, mesh, name="ep")

        return f

    return body


def _moe_loop_ref(softmax: bool):
    def ref(x, w, g):
        if softmax:
            g = torch.softmax(g, -1)
        return sum(g[:, e : e + 1] * F.silu(x @ w[e]) for e in range(w.shape[0]))

    return ref


MOE = (((6, 4), [R]), ((4, 4, 5), [S0]), ((6, 4), [S1]))


def _moe_a2a(mean_aux: bool):
    """Tokens sharded over ep; chunk j of every rank's tokens goes to expert j (all_to_all)."""

    def body(mesh):
        def f(x, w):
            recv = funcol.all_to_all_single(x, None, None, _g(mesh, "ep"))
            y = F.silu(recv @ w[0])  # this rank's expert, on the tokens it received
            back = funcol.all_to_all_single(y, None, None, _g(mesh, "ep"))
            score = (x * x).sum(-1)
            aux = score.mean() if mean_aux else score.sum() / (x.shape[0] * 2)
            return back, aux

        return f

    return body


def _moe_a2a_ref(x, w):
    # rank r holds rows [4r, 4r+4); rows 4r+2j .. 4r+2j+2 go to expert j
    out = torch.empty(x.shape[0], w.shape[-1])
    for r in range(2):
        for j in range(2):
            rows = slice(4 * r + 2 * j, 4 * r + 2 * j + 2)
            out[rows] = F.silu(x[rows] @ w[j])
    return out, (x * x).sum(-1).mean()


# --- ring attention: K/V blocks passed around with permute, online softmax -----------------


def _ring_attention(mesh):
    def f(q, k, v):
        n = 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        m = torch.full((q.shape[0], 1), float("-inf"))
        denom = torch.zeros(q.shape[0], 1)
        acc = torch.zeros_like(q)
        ring = [(i + 1) % n for i in range(n)]
        for step in range(n):
            s = (q @ k.transpose(0, 1)) * scale
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new)
            corr = torch.exp(m - m_new)
            denom = denom * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v
            m = m_new
            if step < n - 1:
                kv = torch.cat([k, v], dim=-1).flatten()
                kv = funcol.permute_tensor(kv, ring, _g(mesh)).view(k.shape[0], -1)
                k, v = kv[:, : k.shape[1]], kv[:, k.shape[1] :]
        return acc / denom

    return f


def _attention_ref(q, k, v):
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1) @ v


ATTN = (((8, 4), [S0]), ((8, 4), [S0]), ((8, 4), [S0]))

# --- 2-D mesh (dp, tp) --------------------------------------------------------------------


def _dt_rowpar(relu: bool, reduce_over: str = "tp"):
    def body(mesh):
        def f(x, w):
            y = x @ w
            if relu:
                y = torch.relu(y)
            return _ar(y, mesh, name=reduce_over)

        return f

    return body


DT_ROW = (((4, 8), [S0, S1]), ((8, 6), [R, S0]))


def _dt_loss(mean: bool):
    def body(mesh):
        def f(x, w):
            y = _ar(x @ w, mesh, name="tp")
            return y.mean() if mean else y.sum() / (y.shape[0] * 2 * y.shape[1])

        return f

    return body


def _dt_mlp(mesh):
    def f(x, w1, w2):
        return _ar(F.gelu(x @ w1) @ w2, mesh, name="tp")

    return f


BODIES: dict[str, Body] = {
    # row parallel
    "row_parallel": Body("tp", _rowpar(), ROW, [R], lambda x, w: x @ w),
    "row_parallel_relu_after_reduce": Body("tp", _rowpar(post=torch.relu), ROW, [R], lambda x, w: torch.relu(x @ w)),
    "row_parallel_relu_before_reduce": Body(
        "tp", _rowpar(pre=torch.relu), ROW, [R], lambda x, w: torch.relu(x @ w), True,
        "`relu` at global_corpus.py",
    ),
    "row_parallel_gelu_before_reduce": Body(
        "tp", _rowpar(pre=F.gelu), ROW, [R], lambda x, w: F.gelu(x @ w), True, "all-reduce before `gelu`",
    ),
    "row_parallel_bias_after_reduce": Body("tp", _rowpar_bias(False), ROW_BIAS, [R], lambda x, w, b: x @ w + b),
    "row_parallel_bias_before_reduce": Body(
        "tp", _rowpar_bias(True), ROW_BIAS, [R], lambda x, w, b: x @ w + b, True, "counted 2 times",
    ),
    "row_parallel_add_constant_before_reduce": Body(
        "tp", _rowpar(pre=lambda y: y + 1.0), ROW, [R], lambda x, w: x @ w + 1.0, True, "not linear in a pending sum",
    ),
    "partial_output_scaled": Body("tp", lambda m: lambda x, w: (x @ w) * 2.0, ROW, [P], lambda x, w: (x @ w) * 2.0),
    "partial_output_after_relu": Body(
        "tp", lambda m: lambda x, w: torch.relu(x @ w), ROW, [P], lambda x, w: torch.relu(x @ w), True,
        "all-reduce before `relu`",
    ),
    # vocabulary parallel
    "vocab_softmax": Body("tp", _vocab_softmax(True), (((4, 10), [S1]),), [S1], lambda x: torch.softmax(x, -1)),
    "vocab_softmax_local": Body(
        "tp", lambda m: lambda x: torch.softmax(x, -1), (((4, 10), [S1]),), [S1], lambda x: torch.softmax(x, -1),
        True, "`softmax` at global_corpus.py",
    ),
    "vocab_softmax_local_max": Body(
        "tp", _vocab_softmax(False), (((4, 10), [S1]),), [S1], lambda x: torch.softmax(x, -1), True,
        "pending max from `amax`",
    ),
    "vocab_cross_entropy": Body("tp", lambda m: _vocab_ce_right(m), VOCAB_CE, [R], lambda x, t, ids: F.cross_entropy(x, t)),
    "vocab_cross_entropy_local": Body(
        "tp", lambda m: _vocab_ce_wrong(m), VOCAB_CE, [R], lambda x, t, ids: F.cross_entropy(x, t), True,
        "`cross_entropy` at global_corpus.py",
    ),
    # sharded hidden dimension
    "hidden_layer_norm": Body("tp", _ln_right, (((4, 8), [S1]),), [S1], lambda x: F.layer_norm(x, (8,), eps=EPS)),
    "hidden_layer_norm_local": Body(
        "tp", _ln_wrong, (((4, 8), [S1]),), [S1], lambda x: F.layer_norm(x, (8,), eps=EPS), True,
        "normalise with the all-reduced statistics",
    ),
    "hidden_rms_norm": Body("tp", _rms_right, (((4, 8), [S1]), ((8,), [S0])), [S1], _rms_ref),
    "hidden_rms_norm_local": Body(
        "tp", _rms_wrong, (((4, 8), [S1]), ((8,), [S0])), [S1], _rms_ref, True, "pending avg from `mean`",
    ),
    # sequence parallel
    "seq_parallel_norm_all_gather": Body(
        "tp", _seq_norm_gather(1), (((2, 6, 4), [S1]), ((4,), [R])), [R], _rms_ref,
    ),
    "seq_parallel_norm_all_gather_wrong_dim": Body(
        "tp", _seq_norm_gather(0), (((2, 6, 4), [S1]), ((4,), [R])), [R], _rms_ref, True,
        "gather_dim=1",
    ),
    # losses
    "loss_sum_over_global_count": Body(
        "tp", lambda m: lambda x: x.sum() / (x.numel() * 2), (((4, 6), [S0]),), [P], lambda x: x.mean(),
    ),
    "loss_sum_of_rank_means": Body(
        "tp", lambda m: lambda x: x.mean(), (((4, 6), [S0]),), [P], lambda x: x.mean(), True,
        "pending avg from `mean`",
    ),
    # collectives on the wrong state
    "all_reduce_of_shard": Body(
        "tp", lambda m: lambda x: _ar(x, m), (((4, 6), [S0]),), [R], lambda x: x, True,
        "use all_gather(dim=0)",
    ),
    "all_gather_dim_1": Body(
        "tp", lambda m: lambda x: funcol.all_gather_tensor(x, 1, _g(m)), (((4, 6), [S1]),), [R], lambda x: x,
    ),
    "all_gather_wrong_dim": Body(
        "tp", lambda m: lambda x: funcol.all_gather_tensor(x, 0, _g(m)), (((4, 6), [S1]),), [R], lambda x: x,
        True, "gather_dim=1",
    ),
    "all_gather_wrong_dim_1": Body(
        "tp", lambda m: lambda x: funcol.all_gather_tensor(x, 1, _g(m)), (((4, 6), [S0]),), [R], lambda x: x,
        True, "use all_gather(dim=0)",
    ),
    # Megatron MLP
    "megatron_mlp": Body(
        "tp", lambda m: lambda x, w1, w2: _ar(F.gelu(x @ w1) @ w2, m),
        (((4, 6), [R]), ((6, 8), [S1]), ((8, 6), [S0])), [R], lambda x, w1, w2: F.gelu(x @ w1) @ w2,
    ),
    "megatron_mlp_reduce_scatter": Body(
        "tp", lambda m: lambda x, w1, w2: funcol.reduce_scatter_tensor(F.gelu(x @ w1) @ w2, "sum", 0, _g(m)),
        (((4, 6), [R]), ((6, 8), [S1]), ((8, 6), [S0])), [S0], lambda x, w1, w2: F.gelu(x @ w1) @ w2,
    ),
    "megatron_mlp_reduce_scatter_declared_dim_1": Body(
        "tp", lambda m: lambda x, w1, w2: funcol.reduce_scatter_tensor(F.gelu(x @ w1) @ w2, "sum", 0, _g(m)),
        (((4, 6), [R]), ((6, 8), [S1]), ((8, 6), [S0])), [S1], lambda x, w1, w2: F.gelu(x @ w1) @ w2, True,
        "declare it Shard(0)",
    ),
    # MoE, experts sharded over ep
    "moe_einsum": Body("ep", _moe_einsum(False), MOE, [R], _moe_ref(False)),
    "moe_einsum_local_gate_softmax": Body(
        "ep", _moe_einsum(True), MOE, [R], _moe_ref(True), True, "`softmax` at global_corpus.py",
    ),
    "moe_expert_loop": Body("ep", _moe_loop(False), MOE, [R], _moe_loop_ref(False)),
    "moe_expert_loop_local_gate_softmax": Body(
        "ep", _moe_loop(True), MOE, [R], _moe_loop_ref(True), True, "`softmax` at global_corpus.py",
    ),
    "moe_all_to_all": Body(
        "ep", _moe_a2a(False), (((8, 4), [S0]), ((2, 4, 4), [S0])), ([S0], [P]), _moe_a2a_ref,
    ),
    "moe_all_to_all_aux_mean": Body(
        "ep", _moe_a2a(True), (((8, 4), [S0]), ((2, 4, 4), [S0])), ([S0], [P]), _moe_a2a_ref, True,
        "pending avg from `mean`",
    ),
    # ring attention
    "ring_attention": Body("sp", _ring_attention, ATTN, [S0], _attention_ref),
    # 2-D mesh
    "dp_tp_row_parallel": Body("dp,tp", _dt_rowpar(False), DT_ROW, [S0, R], lambda x, w: x @ w),
    "dp_tp_row_parallel_relu_before_reduce": Body(
        "dp,tp", _dt_rowpar(True), DT_ROW, [S0, R], lambda x, w: torch.relu(x @ w), True,
        "over 'tp'",
    ),
    "dp_tp_reduce_over_dp": Body(
        "dp,tp", _dt_rowpar(False, "dp"), DT_ROW, [S0, R], lambda x, w: x @ w, True,
        "`all_reduce('sum')` at global_corpus.py",
    ),
    "dp_tp_loss": Body("dp,tp", _dt_loss(False), DT_ROW, [P, R], lambda x, w: (x @ w).mean()),
    "dp_tp_loss_mean": Body(
        "dp,tp", _dt_loss(True), DT_ROW, [P, R], lambda x, w: (x @ w).mean(), True, "mesh dimension 'dp'",
    ),
    "dp_tp_megatron_mlp": Body(
        "dp,tp", lambda m: _dt_mlp(m), (((4, 6), [S0, R]), ((6, 8), [R, S1]), ((8, 6), [R, S0])), [S0, R],
        lambda x, w1, w2: F.gelu(x @ w1) @ w2,
    ),
    "dp_tp_layer_norm_local": Body(
        "dp,tp", _ln_wrong, (((4, 8), [S0, S1]),), [S0, S1], lambda x: F.layer_norm(x, (8,), eps=EPS), True,
        "sharded over mesh dimension 'tp'",
    ),
    "dp_tp_layer_norm": Body(
        "dp,tp", lambda m: _ln_right_2d(m), (((4, 8), [S0, S1]),), [S0, S1], lambda x: F.layer_norm(x, (8,), eps=EPS),
    ),
}


def _ln_right_2d(mesh):
    def f(x):
        h = x.shape[-1] * 2
        mean = _ar(x.sum(-1, keepdim=True), mesh, name="tp") / h
        xc = x - mean
        var = _ar((xc * xc).sum(-1, keepdim=True), mesh, name="tp") / h
        return xc * torch.rsqrt(var + EPS)

    return f


def global_inputs(body: Body, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [spec(g) if callable(spec) else torch.randn(spec, generator=g) for spec, _ in body.ins]
