"""A torchtitan-style tensor-parallel attention stack, for deep-model benchmarks and tests.

torchtitan parallelizes attention with DTensor modules around one
``local_map``: the q/k/v projections are column-parallel DTensor matmuls
(``[R] @ [S(1)] -> [S(1)]``), their outputs are viewed as heads on DTensors
(the heads dimension sharded), and only the inner attention runs per shard,
wrapped in ``local_map`` (``set_gqa_inner_attention_local_map`` /
``_apply_local_map`` in torchtitan): ``in_placements`` shard the heads,
``out_placements`` keep them sharded.  The output projection is row-parallel
(``[S(1)] @ [S(0)] -> [P]``), redistributed to ``[R]`` and added to the
residual.  So each block mixes DTensor ops and one region, unlike
:class:`~localmap_fx.testing.models.TPStack` whose blocks are two regions.

    x (b, s, d) [R] -- q, k, v = x @ wq, wk, wv  [S(2)] -- view (b, s, h, hd) [S(2)]
      -- transpose (b, h, s, hd) [S(1)] -- local_map(sdpa) [S(1)] -- transpose, view [S(2)]
      -- @ wo [P] -- redistribute [R] -- + x
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .models import local_map_of, seeded_randn

__all__ = ["AttnBlock", "MarkedAttnBlock", "AttnStack", "attn_stack_input"]


def _inner_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class AttnBlock(torch.nn.Module):
    """One attention block: DTensor projections around a ``local_map``-ed inner attention."""

    def __init__(self, mesh, d: int, n_heads: int, seed: int, impl: str = "ours") -> None:
        super().__init__()
        if n_heads % mesh.size(0) or d % n_heads:
            raise ValueError(f"n_heads ({n_heads}) must divide d ({d}) and be a multiple of the mesh size "
                             f"({mesh.size(0)}); pick n_heads accordingly")
        self.mesh = mesh
        self.n_heads = n_heads
        heads = [Shard(1)]
        self.inner = local_map_of(impl)(
            _inner_attention,
            out_placements=heads,  # a list: one output (a tuple would be one per output)
            in_placements=(heads, heads, heads),
            in_grad_placements=(heads, heads, heads),
            device_mesh=mesh,
        )

        def weight(i: int, placements) -> torch.nn.Parameter:
            return torch.nn.Parameter(distribute_tensor(seeded_randn(seed + i, d, d) / d**0.5, mesh, placements))

        self.wq, self.wk, self.wv = (weight(i, [Shard(1)]) for i in range(3))
        self.wo = weight(3, [Shard(0)])
        # a small output projection keeps the residual stream bounded at 64 layers
        # (at 1/sqrt(d) the loss overflowed to inf, then NaN gradients)
        with torch.no_grad():
            self.wo.mul_(0.1)

    def forward(self, x: DTensor) -> DTensor:
        b, s, d = x.shape
        hd = d // self.n_heads

        def heads(w: torch.Tensor) -> torch.Tensor:
            return (x @ w).view(b, s, self.n_heads, hd).transpose(1, 2)

        o = self.inner(heads(self.wq), heads(self.wk), heads(self.wv))
        o = o.transpose(1, 2).reshape(b, s, d)
        return (o @ self.wo).redistribute(self.mesh, [Replicate()]) + x


class MarkedAttnBlock(AttnBlock):
    """An :class:`AttnBlock` whose ``forward`` is marked with ``torch.compiler.nested_compile_region``."""

    @torch.compiler.nested_compile_region
    def forward(self, x: DTensor) -> DTensor:
        return super().forward(x)


class AttnStack(torch.nn.Module):
    """``n_layers`` :class:`AttnBlock`\\ s (:class:`MarkedAttnBlock`\\ s with ``marked``);
    ``forward(x)`` returns the loss ``(h * h).mean()``."""

    def __init__(self, mesh, n_layers: int, d: int = 128, n_heads: int = 8, impl: str = "ours",
                 seed: int = 0, marked: bool = False) -> None:
        super().__init__()
        block = MarkedAttnBlock if marked else AttnBlock
        self.blocks = torch.nn.ModuleList(block(mesh, d, n_heads, seed + 4 * i, impl) for i in range(n_layers))

    def forward(self, x: DTensor) -> DTensor:
        for block in self.blocks:
            x = block(x)
        loss: DTensor = (x * x).mean()  # type: ignore[assignment]  # DTensor ops return DTensors
        return loss


def attn_stack_input(mesh, batch: int = 4, seq: int = 16, d: int = 128, seed: int = 12345) -> DTensor:
    """The replicated input of :class:`AttnStack` (requires grad)."""
    t = distribute_tensor(seeded_randn(seed, batch, seq, d), mesh, [Replicate()])
    t.requires_grad_()
    return t
