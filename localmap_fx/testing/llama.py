"""A Llama-3-style dense transformer written with ``local_map`` regions.

Tensor parallel on the mesh dimension ``"tp"`` (1-D mesh ``("tp",)`` or 2-D
``("dp", "tp")``), Megatron style with sequence parallelism::

    tokens (dp: S(0), tp: R)
      embed      region  vocab-parallel embedding: w S(0) -> Partial  --reduce_scatter-->  h S(1)
      per block (h stays Shard(1), sequence-sharded, between blocks):
        norm     region  RMSNorm on the local sequence chunk; w grad Partial
        attn     region  x gathered to R on entry (its grad: Partial -> reduce_scatter);
                         q/k/v column-parallel (heads sharded), rotary, grouped-query
                         scaled_dot_product_attention (causal)           -> S(2)
        row      region  output projection, row-parallel                  -> Partial --reduce_scatter--> S(1)
        norm, then
        swiglu   region  w1, w3 column-parallel: silu(x w1) * (x w3)       -> S(2)
        row      region  w2 row-parallel                                   -> Partial --reduce_scatter--> S(1)
      norm       region
      output     region  vocabulary-parallel projection                    -> logits S(2)
      loss       region  per-rank log-sum-exp over its vocabulary slice (S(2)) and the
                         target logit where this rank owns the target (Partial); the
                         log-sum-exp of the slices is combined with DTensor ops

Every region is built once in :class:`Llama`'s constructor (the same region
object is reused by all blocks: two calls of ``row`` per block), with either
``localmap_fx.local_map`` or torch's ``local_map`` (``local_map="torch"``) so
the two can be compared on one model.  :func:`reference_loss` is independent
single-device code for the same math.

Weights are stored ``(in, out)`` (``y = x @ w``) as DTensor parameters; on a
2-D mesh they are also sharded on ``dp`` (see ``parallel.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .parallel import MeshLayout, ModelConfig, WeightInit, full_weights, local_map_impl, token_batch

__all__ = ["LlamaConfig", "Llama", "reference_loss", "make_batch", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = (None, "full", "selective")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 64
    max_seq: int = 32
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self, tp: int) -> None:
        bad = []
        if self.dim % self.n_heads:
            bad.append(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            bad.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, name) % tp:
                bad.append(f"{name}={getattr(self, name)} is not a multiple of the tp size {tp}")
        if self.head_dim % 2:
            bad.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if bad:
            raise ValueError("LlamaConfig does not fit the mesh: " + "; ".join(bad))


# --------------------------------------------------------------------------- #
# Region bodies: plain tensor code at local shapes
# --------------------------------------------------------------------------- #


def _embed(tokens: torch.Tensor, w: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Rows of this rank's vocabulary slice; zeros for tokens other ranks own."""
    idx = tokens - vocab_ids[0]
    mine = (idx >= 0) & (idx < w.shape[0])
    out = F.embedding(idx.clamp(0, w.shape[0] - 1), w)
    return out * mine.unsqueeze(-1).to(out.dtype)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, s, heads, head_dim); cos/sin: (s, head_dim / 2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def _attention(x, wq, wk, wv, cos, sin, head_dim: int):
    """Grouped-query causal attention over this rank's heads: (b, s, local heads * head_dim)."""
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, -1, head_dim)
    k = (x @ wk).view(b, s, -1, head_dim)
    v = (x @ wv).view(b, s, -1, head_dim)
    cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, s, -1)


def _swiglu(x, w1, w3):
    return F.silu(x @ w1) * (x @ w3)


def _linear(x, w):
    return x @ w


def _vocab_parallel_ce_parts(logits, targets, vocab_ids):
    """This rank's log-sum-exp over its vocabulary slice, and the target logit if it owns it."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    idx = targets - vocab_ids[0]
    mine = (idx >= 0) & (idx < lf.shape[-1])
    tgt = lf.gather(-1, idx.clamp(0, lf.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return lse, tgt * mine.to(lf.dtype)


def rope_tables(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    ang = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32, device=device), inv)
    return ang.cos(), ang.sin()


# --------------------------------------------------------------------------- #
# Regions: built once per model
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class LlamaRegions:
    embed: Callable
    norm: Callable
    attn: Callable
    swiglu: Callable
    row: Callable
    output: Callable
    loss_parts: Callable


def build_regions(lay: MeshLayout, local_map: Callable, typed_tables: bool = False) -> LlamaRegions:
    R, P = Replicate(), Partial()
    seq = lay.pl(Shard(1), Shard(0))  # activations between blocks
    full_seq = lay.pl(R, Shard(0))  # gathered on tp for attention / MLP
    full_seq_grad = lay.pl(P, Shard(0))  # ... whose gradient is a partial sum over tp
    heads = lay.pl(Shard(2), Shard(0))
    partial = lay.pl(P, Shard(0))
    col_w, col_g = lay.weight_in(Shard(1)), lay.weight_grad(Shard(1))
    row_w, row_g = lay.weight_in(Shard(0)), lay.weight_grad(Shard(0))
    rep_w, rep_g = lay.weight_in(R), lay.weight_grad(P)  # norm weights: tp ranks see other positions
    vocab_ids = lay.pl(Shard(0), R)

    # rotary tables: plain tensors (None), or replicated DTensors typed R, as
    # spmd_types' strict checking needs every tensor a region gets to be typed
    rope, rope_g = (lay.replicate_all(), lay.pl(P, P)) if typed_tables else (None, None)

    def lm(fn, out, ins, grads):
        return local_map(fn, out, ins, grads, lay.mesh, redistribute_inputs=True)

    return LlamaRegions(
        embed=lm(_embed, list(partial), (full_seq, row_w, vocab_ids), (full_seq, row_g, vocab_ids)),
        norm=lm(_rmsnorm, list(seq), (seq, rep_w, None), (seq, rep_g, None)),
        attn=lm(
            _attention,
            list(heads),
            (full_seq, col_w, col_w, col_w, rope, rope, None),
            (full_seq_grad, col_g, col_g, col_g, rope_g, rope_g, None),
        ),
        swiglu=lm(_swiglu, list(heads), (full_seq, col_w, col_w), (full_seq_grad, col_g, col_g)),
        row=lm(_linear, list(partial), (heads, row_w), (heads, row_g)),
        output=lm(_linear, list(heads), (full_seq, col_w), (full_seq_grad, col_g)),
        loss_parts=lm(
            _vocab_parallel_ce_parts,
            (heads, partial),
            (heads, full_seq, vocab_ids),
            (heads, full_seq, vocab_ids),
        ),
    )


# --------------------------------------------------------------------------- #
# Modules
# --------------------------------------------------------------------------- #


def _sac_policy(ctx, op, *args, **kwargs):
    # Keep matmul and attention outputs, recompute the cheap pointwise ops.
    if op in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def selective_checkpoint_context():
    return create_selective_checkpoint_contexts(_sac_policy)


class Block(nn.Module):
    def __init__(self, model: "Llama", params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        # the model's regions and layout; not sub-modules
        self._model = (model,)
        for k, v in params.items():
            setattr(self, k, v)

    def forward(self, x: DTensor) -> DTensor:
        m = self._model[0]
        r, lay, cfg = m.regions, m.layout, m.cfg
        seq = m.seq_placements
        h = r.norm(x, self.attn_norm, cfg.norm_eps)
        a = r.attn(h, self.wq, self.wk, self.wv, m.rope_cos, m.rope_sin, cfg.head_dim)
        x = x + r.row(a, self.wo).redistribute(lay.mesh, seq)
        h = r.norm(x, self.mlp_norm, cfg.norm_eps)
        f = r.swiglu(h, self.w1, self.w3)
        return x + r.row(f, self.w2).redistribute(lay.mesh, seq)


class Llama(nn.Module):
    """Llama-3-style transformer; ``forward(tokens, targets)`` returns the mean loss (Replicate).

    Args:
        cfg: sizes.
        mesh: ``("tp",)`` or ``("dp", "tp")``.
        local_map: ``"localmap_fx"`` (default), ``"torch"`` or a factory with
            torch's ``local_map`` signature.
        checkpoint: ``None``, ``"full"`` (``torch.utils.checkpoint`` of every
            block) or ``"selective"`` (keep matmul / attention outputs).
        dtype: parameter dtype (``torch.bfloat16`` for bf16 parameters).
        seed: initialisation seed (weights are drawn full-size on CPU, then
            distributed, so every mesh gets the same model).
        typed_tables: pass the rotary tables to the attention region as
            replicated DTensors instead of plain tensors, so that the region
            passes spmd_types' strict checking (``local_map`` built with
            ``spmd_types=True`` or ``"global"``), which refuses untyped tensors.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        mesh: DeviceMesh,
        local_map: str | Callable = "localmap_fx",
        checkpoint: str | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        typed_tables: bool = False,
    ) -> None:
        super().__init__()
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"Llama(checkpoint={checkpoint!r}): use one of {CHECKPOINT_MODES}")
        self.cfg = cfg
        self.layout = lay = MeshLayout(mesh, "tp")
        cfg.check(lay.model_size)
        self.checkpoint = checkpoint
        self.regions = build_regions(lay, local_map_impl(local_map), typed_tables)
        self.seq_placements = lay.pl(Shard(1), Shard(0))
        device = mesh.device_type
        full = init_weights(cfg, seed, dtype)

        def param(name, model_pl, dp_dim, grad=True):
            return nn.Parameter(lay.distribute(full[name].to(device), model_pl, dp_dim), requires_grad=grad)

        R = Replicate()
        self.embed = param("embed", Shard(0), 1)
        blocks = []
        for i in range(cfg.n_layers):
            p = lambda n, pl, d, i=i: param(f"layers.{i}.{n}", pl, d)  # noqa: E731
            blocks.append(
                Block(
                    self,
                    {
                        "attn_norm": p("attn_norm", R, 0),
                        "wq": p("wq", Shard(1), 0),
                        "wk": p("wk", Shard(1), 0),
                        "wv": p("wv", Shard(1), 0),
                        "wo": p("wo", Shard(0), 1),
                        "mlp_norm": p("mlp_norm", R, 0),
                        "w1": p("w1", Shard(1), 0),
                        "w3": p("w3", Shard(1), 0),
                        "w2": p("w2", Shard(0), 1),
                    },
                )
            )
        self.layers = nn.ModuleList(blocks)
        self.norm = param("norm", R, 0)
        self.output = param("output", Shard(1), 0)
        cos, sin = rope_tables(cfg, device)
        if typed_tables:
            cos = distribute_tensor(cos, mesh, list(lay.replicate_all()))
            sin = distribute_tensor(sin, mesh, list(lay.replicate_all()))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        ids = torch.arange(cfg.vocab, device=device)
        self.vocab_ids = distribute_tensor(ids, mesh, list(lay.pl(Shard(0), R)))

    def forward(self, tokens: DTensor, targets: DTensor) -> DTensor:
        r, lay = self.regions, self.layout
        h = r.embed(tokens, self.embed, self.vocab_ids).redistribute(lay.mesh, self.seq_placements)
        for blk in self.layers:
            if self.checkpoint == "full":
                h = checkpoint(blk, h, use_reentrant=False)
            elif self.checkpoint == "selective":
                h = checkpoint(blk, h, use_reentrant=False, context_fn=selective_checkpoint_context)
            else:
                h = blk(h)
        h = r.norm(h, self.norm, self.cfg.norm_eps)
        logits = r.output(h, self.output)
        lse_parts, tgt = r.loss_parts(logits, targets, self.vocab_ids)
        # log-sum-exp of the per-rank slices: (b, s, tp) -> (b, s)
        m = lse_parts.detach().amax(dim=-1, keepdim=True)
        lse = (lse_parts - m).exp().sum(dim=-1).log() + m.squeeze(-1)
        loss = (lse - tgt).mean()
        return loss.redistribute(lay.mesh, lay.replicate_all())

    full_weights = full_weights

    def make_inputs(self, batch: int, seq: int, seed: int = 0) -> tuple[DTensor, DTensor]:
        """Random ``(tokens, targets)`` as DTensors placed (dp: S(0), tp: R)."""
        tokens, targets = make_batch(self.cfg, batch, seq, seed)
        pl = list(self.layout.pl(Replicate(), Shard(0)))
        dev = self.layout.mesh.device_type
        mesh = self.layout.mesh
        return distribute_tensor(tokens.to(dev), mesh, pl), distribute_tensor(targets.to(dev), mesh, pl)


def init_weights(cfg: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    init = WeightInit(seed, dtype)
    randn = init.randn
    d, hd = cfg.dim, cfg.head_dim
    out = {"embed": randn(cfg.vocab, d, scale=1.0)}
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        out[pre + "attn_norm"] = init.norm(d)
        out[pre + "wq"] = randn(d, cfg.n_heads * hd, scale=d**-0.5)
        out[pre + "wk"] = randn(d, cfg.n_kv_heads * hd, scale=d**-0.5)
        out[pre + "wv"] = randn(d, cfg.n_kv_heads * hd, scale=d**-0.5)
        out[pre + "wo"] = randn(cfg.n_heads * hd, d, scale=(cfg.n_heads * hd) ** -0.5 / math.sqrt(2 * cfg.n_layers))
        out[pre + "mlp_norm"] = init.norm(d)
        out[pre + "w1"] = randn(d, cfg.ffn_hidden, scale=d**-0.5)
        out[pre + "w3"] = randn(d, cfg.ffn_hidden, scale=d**-0.5)
        out[pre + "w2"] = randn(cfg.ffn_hidden, d, scale=cfg.ffn_hidden**-0.5 / math.sqrt(2 * cfg.n_layers))
    out["norm"] = init.norm(d)
    out["output"] = randn(d, cfg.vocab, scale=d**-0.5)
    return out


def make_batch(cfg: LlamaConfig, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(cfg.vocab, batch, seq, 1000 + seed)


# --------------------------------------------------------------------------- #
# Single-device reference (independent code, full tensors)
# --------------------------------------------------------------------------- #


def reference_loss(cfg: LlamaConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same model on one device with ``torch.nn.functional`` building blocks."""
    b, s = tokens.shape
    hd = cfg.head_dim
    cos, sin = rope_tables(cfg, tokens.device)
    cos, sin = cos[:s], sin[:s]

    def norm(x, weight):
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=cfg.norm_eps)).to(x.dtype) * weight

    def rope(x):  # (b, h, s, hd)
        x1, x2 = x.chunk(2, dim=-1)
        c, si = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([x1 * c - x2 * si, x1 * si + x2 * c], dim=-1)

    h = F.embedding(tokens, w["embed"])
    for i in range(cfg.n_layers):
        p = lambda n, i=i: w[f"layers.{i}.{n}"]  # noqa: E731
        x = norm(h, p("attn_norm"))
        q = (x @ p("wq")).view(b, s, cfg.n_heads, hd).transpose(1, 2)
        k = (x @ p("wk")).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        v = (x @ p("wv")).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        h = h + o.transpose(1, 2).reshape(b, s, -1) @ p("wo")
        x = norm(h, p("mlp_norm"))
        h = h + (F.silu(x @ p("w1")) * (x @ p("w3"))) @ p("w2")
    logits = norm(h, w["norm"]) @ w["output"]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

