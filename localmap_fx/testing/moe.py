"""A DeepSeek-V3-style mixture-of-experts model written with ``local_map`` regions.

Expert parallel on the mesh dimension ``"ep"`` (1-D mesh ``("ep",)`` or 2-D
``("dp", "ep")``).  Tokens are sharded over ``ep`` along the sequence
(and over ``dp`` along the batch); every non-expert weight is replicated on
``ep`` (its gradient ``Partial``), experts are sharded ``Shard(0)`` on ``ep``::

    tokens (dp: S(0), ep: S(1))
      embed    region   local rows of the replicated table
      per block:  h = h + moe(norm(h))
        norm   region   RMSNorm
        moe    region   router: sigmoid scores, top-k on score + bias, weights
                        normalised over the k picks and scaled;
                        dispatch: each (token, pick) gets a slot in a per-expert
                        buffer (E, C, D), C = local tokens (dropless);
                        exchange: all_to_all over ep (funcol, autograd) -> this
                        rank's experts get (E_local, ep * C, D);
                        grouped experts: SwiGLU as batched matmuls;
                        exchange back, combine with the routing weights;
                        shared expert on every token.
                        Returns (y, aux, tokens_per_expert, capacity):
                          y                  same placements as h
                          aux                load-balancing loss share, Partial
                          tokens_per_expert  this rank's counts (no gradient),
                                             Partial: the sum is the global count
                          capacity           slots per expert and source rank,
                                             a Python int (out placement None)
      norm, then
      head     region   logits and the cross-entropy sum of the local tokens
                        divided by the global token count -> Partial

``dispatch="all_gather"`` replaces the two all_to_alls by an all_gather of
the buffers and a reduce_scatter of the results (same numbers, ep times the
bytes), for process groups without all_to_all.  (torch 2.14.1's gloo does
implement ``all_to_all_single`` on CPU, so the default works there too;
DTensor's own Shard->Shard redistribution on CPU still falls back to
all_gather + chunk.)

Like :mod:`.llama`, regions are built once per model (``local_map="torch"``
builds them with torch's ``local_map``), and :func:`reference_loss` is
independent single-device code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from .._torch_compat import funcol
from .llama import _rmsnorm, selective_checkpoint_context
from .parallel import MeshLayout, ModelConfig, WeightInit, full_weights, local_map_impl, token_batch

__all__ = ["MoEConfig", "MoE", "reference_loss", "make_batch", "DISPATCH_MODES"]

DISPATCH_MODES = ("all_to_all", "all_gather")


@dataclasses.dataclass(frozen=True)
class MoEConfig(ModelConfig):
    n_experts: int = 4
    top_k: int = 2
    moe_hidden: int = 32
    shared_hidden: int = 32
    route_scale: float = 1.0
    aux_coef: float = 0.01

    def check(self, ep: int) -> None:
        bad = []
        if self.n_experts % ep:
            bad.append(f"n_experts={self.n_experts} is not a multiple of the ep size {ep}")
        if not 1 <= self.top_k <= self.n_experts:
            bad.append(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if bad:
            raise ValueError("MoEConfig does not fit the mesh: " + "; ".join(bad))


# --------------------------------------------------------------------------- #
# Region bodies
# --------------------------------------------------------------------------- #


def _embed_rows(tokens, w):
    return F.embedding(tokens, w)


def _route(t, wr, bias, top_k: int, route_scale: float):
    """Sigmoid scores, top-k on score + bias (bias only steers the choice), weights."""
    scores = torch.sigmoid(t.float() @ wr.float())
    _, idx = torch.topk(scores + bias.float(), top_k, dim=-1)
    w = scores.gather(-1, idx)
    w = w / w.sum(-1, keepdim=True) * route_scale
    return scores, idx, w


def _experts(x, w1, w2, w3):
    """Grouped SwiGLU experts: x (E_local, N, D) -> (E_local, N, D)."""
    return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


def _moe(x, wr, bias, w1, w2, w3, ws1, ws2, ws3, expert_ids, top_k: int, route_scale: float,
         n_shards: int, group: Any, dispatch: str):
    b, s, d = x.shape
    t = x.reshape(-1, d)
    n_tok = t.shape[0]
    n_exp = wr.shape[-1]
    e_local = w1.shape[0]
    ep = n_exp // e_local

    scores, idx, weights = _route(t, wr, bias, top_k, route_scale)
    flat = idx.reshape(-1)  # (T * k,) expert of each (token, pick)
    onehot = F.one_hot(flat, n_exp)
    # slot of each (token, pick) in its expert's buffer: rank among earlier picks of that expert
    pos = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    slot = flat * n_tok + pos
    src = t.repeat_interleave(top_k, dim=0)
    buf = t.new_zeros(n_exp * n_tok, d).index_add(0, slot, src).view(n_exp, n_tok, d)

    if dispatch == "all_to_all":
        # (ep: destination, E_local, C, D) -> (ep: source, E_local, C, D)
        recv = funcol.all_to_all_single_autograd(buf.reshape(ep, -1).contiguous(), None, None, group)
        recv = funcol.wait_tensor(recv) if isinstance(recv, funcol.AsyncCollectiveTensor) else recv
        mine = recv.view(ep, e_local, n_tok, d)
    else:
        # every rank's buffers, then the rows of this rank's experts
        allbuf = funcol.all_gather_tensor_autograd(buf.unsqueeze(0), 0, group)
        allbuf = funcol.wait_tensor(allbuf) if isinstance(allbuf, funcol.AsyncCollectiveTensor) else allbuf
        mine = allbuf.index_select(1, expert_ids)  # (ep: source, E_local, C, D)
    out = _experts(mine.transpose(0, 1).reshape(e_local, ep * n_tok, d), w1, w2, w3)
    out = out.view(e_local, ep, n_tok, d).transpose(0, 1)  # (ep: source, E_local, C, D)
    if dispatch == "all_to_all":
        back = funcol.all_to_all_single_autograd(out.reshape(ep, -1).contiguous(), None, None, group)
        back = funcol.wait_tensor(back) if isinstance(back, funcol.AsyncCollectiveTensor) else back
    else:
        full = out.new_zeros(ep, n_exp, n_tok, d).index_copy(1, expert_ids, out.contiguous())
        back = funcol.reduce_scatter_single_autograd(full.reshape(ep, -1), "sum", 0, group)
        back = funcol.wait_tensor(back) if isinstance(back, funcol.AsyncCollectiveTensor) else back
    back = back.reshape(n_exp * n_tok, d)
    routed = (back.index_select(0, slot).view(n_tok, top_k, d) * weights.unsqueeze(-1).to(back.dtype)).sum(1)
    shared = (F.silu(t @ ws1) * (t @ ws3)) @ ws2
    y = (routed + shared).view(b, s, d)

    # DeepSeek-V3 sequence-wise balance loss on this rank's tokens; its share
    # of the mean over all token shards (the region returns it Partial).
    counts = onehot.sum(0).float()  # picks per expert
    frac = counts * (n_exp / (top_k * n_tok))
    prob = (scores / scores.sum(-1, keepdim=True)).mean(0)
    aux = (frac * prob).sum() / n_shards
    return y, aux, counts.detach(), n_tok


def _head_loss(h, w, targets, n_global: int):
    logits = (h @ w).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / n_global


# --------------------------------------------------------------------------- #
# Regions and modules
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class MoERegions:
    embed: Callable
    norm: Callable
    moe: Callable
    head: Callable


def build_regions(lay: MeshLayout, local_map: Callable) -> MoERegions:
    R, P = Replicate(), Partial()
    tok = lay.pl(Shard(1), Shard(0))
    rep_w, rep_g = lay.weight_in(R), lay.weight_grad(P)
    exp_w, exp_g = lay.weight_in(Shard(0)), lay.weight_grad(Shard(0))
    partial = lay.pl(P, P)
    ids = lay.pl(Shard(0), R)

    def lm(fn, out, ins, grads):
        return local_map(fn, out, ins, grads, lay.mesh, redistribute_inputs=True)

    consts = (None,) * 5  # top_k, route_scale, n_shards, group, dispatch
    return MoERegions(
        embed=lm(_embed_rows, list(tok), (tok, rep_w), (tok, rep_g)),
        norm=lm(_rmsnorm, list(tok), (tok, rep_w, None), (tok, rep_g, None)),
        moe=lm(
            _moe,
            (tok, partial, partial, None),
            (tok, rep_w, rep_w, exp_w, exp_w, exp_w, rep_w, rep_w, rep_w, ids) + consts,
            (tok, rep_g, rep_w, exp_g, exp_g, exp_g, rep_g, rep_g, rep_g, ids) + consts,
        ),
        head=lm(_head_loss, list(partial), (tok, rep_w, tok, None), (tok, rep_g, tok, None)),
    )


class MoEBlock(nn.Module):
    def __init__(self, model: "MoE", params: dict[str, nn.Parameter], bias: torch.Tensor) -> None:
        super().__init__()
        self._model = (model,)
        for k, v in params.items():
            setattr(self, k, v)
        # aux-loss-free balancing bias (DeepSeek-V3): steers top-k, never trained
        self.register_buffer("bias", bias, persistent=True)

    def forward(self, h: DTensor):
        m = self._model[0]
        r, cfg = m.regions, m.cfg
        x = r.norm(h, self.norm, cfg.norm_eps)
        y, aux, counts, capacity = r.moe(
            x, self.router, self.bias, self.w1, self.w2, self.w3, self.ws1, self.ws2, self.ws3,
            m.expert_ids, cfg.top_k, cfg.route_scale, m.layout.mesh.size(), m.ep_group, m.dispatch,
        )
        return h + y, aux, counts, capacity


class MoE(nn.Module):
    """DeepSeek-V3-style MoE language model; ``forward(tokens, targets)`` returns
    ``(loss, stats)``: the loss (cross-entropy + ``aux_coef`` x balance loss,
    Replicate) and ``stats = {"aux": DTensor, "tokens_per_expert": [Partial
    DTensor per layer], "capacity": int}``.

    Args are those of :class:`localmap_fx.testing.llama.Llama`, plus
    ``dispatch``: ``"all_to_all"`` (default) or ``"all_gather"``.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        mesh: DeviceMesh,
        local_map: str | Callable = "localmap_fx",
        checkpoint: str | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        dispatch: str = "all_to_all",
    ) -> None:
        super().__init__()
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"MoE(dispatch={dispatch!r}): use one of {DISPATCH_MODES}")
        if checkpoint not in (None, "full", "selective"):
            raise ValueError(f"MoE(checkpoint={checkpoint!r}): use None, 'full' or 'selective'")
        self.cfg, self.dispatch, self.checkpoint = cfg, dispatch, checkpoint
        self.layout = lay = MeshLayout(mesh, "ep")
        cfg.check(lay.model_size)
        self.regions = build_regions(lay, local_map_impl(local_map))
        # funcol takes the group by name: a string is a constant under torch.compile
        self.ep_group = mesh.get_group("ep").group_name
        device = mesh.device_type
        full = init_weights(cfg, seed, dtype)

        def param(name, model_pl, dp_dim):
            return nn.Parameter(lay.distribute(full[name].to(device), model_pl, dp_dim))

        R, S0 = Replicate(), Shard(0)
        self.embed = param("embed", R, 0)
        blocks = []
        for i in range(cfg.n_layers):
            pre = f"layers.{i}."
            names = {"norm": (R, 0), "router": (R, 0), "w1": (S0, 1), "w2": (S0, 1), "w3": (S0, 1),
                     "ws1": (R, 0), "ws2": (R, 0), "ws3": (R, 0)}
            params = {k: param(pre + k, pl, d) for k, (pl, d) in names.items()}
            bias = distribute_tensor(torch.zeros(cfg.n_experts, device=device), mesh, list(lay.replicate_all()))
            blocks.append(MoEBlock(self, params, bias))
        self.layers = nn.ModuleList(blocks)
        self.norm = param("norm", R, 0)
        self.output = param("output", R, 0)
        ids = torch.arange(cfg.n_experts, device=device)
        self.expert_ids = distribute_tensor(ids, mesh, list(lay.pl(S0, R)))

    def forward(self, tokens: DTensor, targets: DTensor):
        r, lay, cfg = self.regions, self.layout, self.cfg
        h = r.embed(tokens, self.embed)
        auxes, counts = [], []
        for blk in self.layers:
            if self.checkpoint == "full":
                h, aux, c, cap = checkpoint(blk, h, use_reentrant=False)
            elif self.checkpoint == "selective":
                h, aux, c, cap = checkpoint(blk, h, use_reentrant=False, context_fn=selective_checkpoint_context)
            else:
                h, aux, c, cap = blk(h)
            auxes.append(aux)
            counts.append(c)
        h = r.norm(h, self.norm, cfg.norm_eps)
        ce = r.head(h, self.output, targets, targets.numel())
        aux = auxes[0]
        for a in auxes[1:]:
            aux = aux + a
        loss = (ce + cfg.aux_coef * aux).redistribute(lay.mesh, lay.replicate_all())
        # stats carry no gradient (a compiled step that returned them with one would
        # expect a tangent for them in backward)
        return loss, {"aux": aux.detach(), "tokens_per_expert": counts, "capacity": cap}

    full_weights = full_weights

    def make_inputs(self, batch: int, seq: int, seed: int = 0) -> tuple[DTensor, DTensor]:
        """Random ``(tokens, targets)`` placed (dp: S(0), ep: S(1))."""
        tokens, targets = make_batch(self.cfg, batch, seq, seed)
        mesh, dev = self.layout.mesh, self.layout.mesh.device_type
        pl = list(self.layout.pl(Shard(1), Shard(0)))
        return distribute_tensor(tokens.to(dev), mesh, pl), distribute_tensor(targets.to(dev), mesh, pl)


def init_weights(cfg: MoEConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    init = WeightInit(seed, dtype)
    randn = init.randn
    d, e, f, fs = cfg.dim, cfg.n_experts, cfg.moe_hidden, cfg.shared_hidden
    out = {"embed": randn(cfg.vocab, d, scale=1.0)}
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        out[pre + "norm"] = init.norm(d)
        out[pre + "router"] = randn(d, e, scale=d**-0.5)
        out[pre + "w1"] = randn(e, d, f, scale=d**-0.5)
        out[pre + "w2"] = randn(e, f, d, scale=f**-0.5 / math.sqrt(2 * cfg.n_layers))
        out[pre + "w3"] = randn(e, d, f, scale=d**-0.5)
        out[pre + "ws1"] = randn(d, fs, scale=d**-0.5)
        out[pre + "ws2"] = randn(fs, d, scale=fs**-0.5 / math.sqrt(2 * cfg.n_layers))
        out[pre + "ws3"] = randn(d, fs, scale=d**-0.5)
    out["norm"] = init.norm(d)
    out["output"] = randn(d, cfg.vocab, scale=d**-0.5)
    return out


def make_batch(cfg: MoEConfig, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(cfg.vocab, batch, seq, 2000 + seed)


def reference_loss(cfg: MoEConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor,
                   dp: int = 1, ep: int = 1) -> torch.Tensor:
    """The same model on one device: a loop over experts, no buffers or exchange.

    The balance loss is computed per token shard (batch split ``dp`` ways,
    sequence split ``ep`` ways) and averaged, as the parallel model does.
    """
    h = F.embedding(tokens, w["embed"])

    def norm(x, weight):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=cfg.norm_eps).to(x.dtype) * weight

    aux_total = 0.0
    b, s, d = h.shape
    for i in range(cfg.n_layers):
        p = lambda n, i=i: w[f"layers.{i}.{n}"]  # noqa: E731
        x = norm(h, p("norm"))
        t = x.reshape(-1, d)
        scores = torch.sigmoid(t.float() @ p("router").float())
        _, idx = torch.topk(scores, cfg.top_k, dim=-1)  # bias is zero
        gate = scores.gather(-1, idx)
        gate = gate / gate.sum(-1, keepdim=True) * cfg.route_scale
        routed = torch.zeros_like(t)
        for e in range(cfg.n_experts):
            hit = idx == e  # (T, k)
            g = (gate * hit).sum(-1, keepdim=True).to(t.dtype)
            y = (F.silu(t @ p("w1")[e]) * (t @ p("w3")[e])) @ p("w2")[e]
            routed = routed + g * y
        shared = (F.silu(t @ p("ws1")) * (t @ p("ws3"))) @ p("ws2")
        h = h + (routed + shared).view(b, s, d)
        aux_total = aux_total + _reference_aux(cfg, scores, idx, tokens.shape, dp, ep)
    logits = (norm(h, w["norm"]) @ w["output"]).float()
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ce + cfg.aux_coef * aux_total


def _reference_aux(cfg, scores, idx, shape, dp, ep):
    b, s = shape
    sc = scores.view(b, s, -1)
    ix = idx.view(b, s, -1)
    total = 0.0
    for bi in range(dp):
        for si in range(ep):
            bs = slice(bi * b // dp, (bi + 1) * b // dp)
            ss = slice(si * s // ep, (si + 1) * s // ep)
            sc_ = sc[bs, ss].reshape(-1, sc.shape[-1])
            ix_ = ix[bs, ss].reshape(-1)
            counts = torch.bincount(ix_, minlength=cfg.n_experts).float()
            frac = counts * (cfg.n_experts / (cfg.top_k * sc_.shape[0]))
            prob = (sc_ / sc_.sum(-1, keepdim=True)).mean(0)
            total = total + (frac * prob).sum()
    return total / (dp * ep)
