"""Example models written with ``localmap_fx.local_map``.

Shared by the tests, the demo and the benchmarks.  Every model is a
``Model(name, build, step, mesh_ndim)``: ``build(mesh, seed)`` returns the
DTensor parameters and inputs (as a dict), ``step(state)`` runs one forward
and returns a scalar DTensor loss whose backward fills the ``.grad`` of every
tensor in ``state`` that requires grad.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ..api import local_map

__all__ = [
    "Model",
    "MODELS",
    "grad_tensors",
    "tp_block",
    "layer_region",
    "COL_GRAD_PLACEMENTS",
    "ROW_GRAD_PLACEMENTS",
    "local_map_of",
    "seeded_randn",
    "tp_weights",
]


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[DeviceMesh, int], dict]
    step: Callable[[dict], DTensor]
    mesh_ndim: int = 1


def seeded_randn(seed: int, *shape: int) -> torch.Tensor:
    """``randn(*shape)`` from its own generator: the same values on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def local_map_of(side: str) -> Callable:
    """The ``local_map`` of one side of a comparison: ``"ours"`` or ``"torch"``.

    (:func:`localmap_fx.testing.parallel.local_map_impl` is the Llama and MoE
    models' switch, which also takes a callable.)
    """
    if side == "ours":
        return local_map
    if side == "torch":
        from torch.distributed.tensor.experimental import local_map as torch_local_map

        return torch_local_map
    raise ValueError(f"impl must be 'ours' or 'torch', got {side!r}")


def _dist(t: torch.Tensor, mesh, placements, grad=True) -> DTensor:
    d = distribute_tensor(t, mesh, placements)
    d.requires_grad_(grad)
    return d


# --- tensor-parallel MLP: column-parallel then row-parallel -----------------

def _col(x, w):
    return torch.relu(x @ w)


def _row(h, w):
    return h @ w


COL_GRAD_PLACEMENTS = ([Partial()], [Shard(1)])
ROW_GRAD_PLACEMENTS = ([Shard(1)], [Shard(0)])


def tp_block(
    mesh: DeviceMesh | None,
    *,
    local_map_fn: Callable = local_map,
    col_grads: tuple | None = COL_GRAD_PLACEMENTS,
    row_grads: tuple | None = None,
    spmd_types: bool = False,
) -> tuple[Callable, Callable]:
    """The two regions of one Megatron-style tensor-parallel MLP block.

    ``col(x, w1) = relu(x @ w1)``: x ``[R]``, w1 ``[S(1)]`` -> ``[S(1)]``;
    ``row(h, w2) = h @ w2``: h ``[S(1)]``, w2 ``[S(0)]`` -> ``[Partial()]``.
    ``col_grads`` / ``row_grads`` are their ``in_grad_placements`` (by
    default x's gradient is ``Partial``, row's are DTensor's defaults);
    ``local_map_fn`` is ours or torch's ``local_map`` (same signature);
    ``mesh=None`` takes the arguments' mesh.
    """
    col = local_map_fn(
        _col,
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)]),
        in_grad_placements=col_grads,
        device_mesh=mesh,
        spmd_types=spmd_types,
    )
    row = local_map_fn(
        _row,
        out_placements=[Partial()],
        in_placements=([Shard(1)], [Shard(0)]),
        in_grad_placements=row_grads,
        device_mesh=mesh,
        spmd_types=spmd_types,
    )
    return col, row


def _tp_mlp_build(mesh, seed=0, spmd_types=False):
    return {
        "x": _dist(seeded_randn(seed, 8, 16), mesh, [Replicate()]),
        "w1": _dist(seeded_randn(seed + 1, 16, 32), mesh, [Shard(1)]),
        "w2": _dist(seeded_randn(seed + 2, 32, 16), mesh, [Shard(0)]),
        "fns": tp_block(mesh, col_grads=None if spmd_types else COL_GRAD_PLACEMENTS, spmd_types=spmd_types),
        "mesh": mesh,
    }


def _tp_mlp_step(s):
    col, row = s["fns"]
    h = col(s["x"], s["w1"])
    y = row(h, s["w2"]).redistribute(s["mesh"], [Replicate()])
    return (y * y).sum()


# --- attention-like block, heads sharded --------------------------------------

def _attn(x, wq, wk, wv, n_heads_local: int):
    b, d = x.shape
    q = (x @ wq).view(b, n_heads_local, -1).transpose(0, 1)
    k = (x @ wk).view(b, n_heads_local, -1).transpose(0, 1)
    v = (x @ wv).view(b, n_heads_local, -1).transpose(0, 1)
    att = torch.softmax(q @ k.transpose(1, 2) / (q.shape[-1] ** 0.5), dim=-1)
    return (att @ v).transpose(0, 1).reshape(b, -1)


def _attn_build(mesh, seed=0):
    ws = mesh.size(0)
    heads = 2 * ws
    attn = local_map(
        _attn,
        out_placements=[Shard(1)],
        in_placements=([Replicate()], [Shard(1)], [Shard(1)], [Shard(1)], None),
        in_grad_placements=([Partial()], [Shard(1)], [Shard(1)], [Shard(1)], None),
        device_mesh=mesh,
    )
    _, proj = tp_block(mesh)  # its row-parallel region
    d = 4 * heads
    return {
        "x": _dist(seeded_randn(seed, 6, d), mesh, [Replicate()]),
        "wq": _dist(seeded_randn(seed + 1, d, d) / d, mesh, [Shard(1)]),
        "wk": _dist(seeded_randn(seed + 2, d, d) / d, mesh, [Shard(1)]),
        "wv": _dist(seeded_randn(seed + 3, d, d) / d, mesh, [Shard(1)]),
        "wo": _dist(seeded_randn(seed + 4, d, d) / d, mesh, [Shard(0)]),
        "fns": (attn, proj),
        "mesh": mesh,
        "heads_local": heads // ws,
    }


def _attn_step(s):
    attn, proj = s["fns"]
    h = attn(s["x"], s["wq"], s["wk"], s["wv"], s["heads_local"])
    y = proj(h, s["wo"]).redistribute(s["mesh"], [Replicate()])
    return y.pow(2).mean()


# --- one region fn(x, w), its output replicated and summed -------------------

def _one_region_state(fn, mesh, x: DTensor, w: DTensor) -> dict:
    return {"x": x, "w": w, "fns": (fn,), "mesh": mesh}


# --- region with redistribute_inputs=True -------------------------------------

def _scale_rows(x, w):
    return x * w.sum(0, keepdim=True)


def _redistribute_build(mesh, seed=0):
    fn = local_map(
        _scale_rows,
        out_placements=[Shard(0)],
        in_placements=([Shard(0)], [Replicate()]),
        redistribute_inputs=True,
        device_mesh=mesh,
    )
    # x arrives Shard(1) and w Shard(0): both are redistributed on entry.
    return _one_region_state(
        fn, mesh, _dist(seeded_randn(seed, 8, 8), mesh, [Shard(1)]), _dist(seeded_randn(seed + 1, 8, 8), mesh, [Shard(0)])
    )


def _redistribute_step(s):
    (fn,) = s["fns"]
    y = fn(s["x"], s["w"])
    return y.redistribute(s["mesh"], [Replicate()]).sum()


# --- in_grad_placements=Partial on a Replicate input -------------------------

def _partial_grad_build(mesh, seed=0):
    fn, _ = tp_block(mesh)  # its column-parallel region
    return _one_region_state(
        fn, mesh, _dist(seeded_randn(seed, 4, 8), mesh, [Replicate()]), _dist(seeded_randn(seed + 1, 8, 8), mesh, [Shard(1)])
    )


def _partial_grad_step(s):
    (fn,) = s["fns"]
    y = fn(s["x"], s["w"])
    return y.redistribute(s["mesh"], [Replicate()]).sum()


# --- 3-layer loop reusing one region ------------------------------------------

def _layer(x, w):
    return torch.tanh(x @ w) + x


def layer_region(mesh: DeviceMesh, *, local_map_fn: Callable = local_map) -> Callable:
    """One residual layer ``tanh(x @ w) + x``: x ``[S(0)]``, w ``[R]`` (its
    gradient ``Partial``) -> ``[S(0)]``; ours or torch's ``local_map``."""
    return local_map_fn(
        _layer,
        out_placements=[Shard(0)],
        in_placements=([Shard(0)], [Replicate()]),
        in_grad_placements=([Shard(0)], [Partial()]),
        device_mesh=mesh,
    )


def _loop_build(mesh, seed=0, n_layers=3):
    fn = layer_region(mesh)
    return {
        "x": _dist(seeded_randn(seed, 8, 8), mesh, [Shard(0)]),
        "ws": [_dist(seeded_randn(seed + 1 + i, 8, 8) / 4, mesh, [Replicate()]) for i in range(n_layers)],
        "fns": (fn,),
        "mesh": mesh,
    }


def _loop_step(s):
    (fn,) = s["fns"]
    x = s["x"]
    for w in s["ws"]:
        x = fn(x, w)
    return x.redistribute(s["mesh"], [Replicate()]).sum()


# --- spmd_types=True region ---------------------------------------------------

def _spmd_build(mesh, seed=0):
    return _tp_mlp_build(mesh, seed, spmd_types=True)


# --- 2-D mesh (dp x tp) -------------------------------------------------------

def _mesh2d_build(mesh, seed=0):
    col = local_map(
        _col,
        out_placements=[Shard(0), Shard(1)],
        in_placements=([Shard(0), Replicate()], [Replicate(), Shard(1)]),
        in_grad_placements=([Shard(0), Partial()], [Partial(), Shard(1)]),
        device_mesh=mesh,
    )
    row = local_map(
        _row,
        out_placements=[Shard(0), Partial()],
        in_placements=([Shard(0), Shard(1)], [Replicate(), Shard(0)]),
        in_grad_placements=([Shard(0), Shard(1)], [Partial(), Shard(0)]),
        device_mesh=mesh,
    )
    return {
        "x": _dist(seeded_randn(seed, 8, 16), mesh, [Shard(0), Replicate()]),
        "w1": _dist(seeded_randn(seed + 1, 16, 32), mesh, [Replicate(), Shard(1)]),
        "w2": _dist(seeded_randn(seed + 2, 32, 16), mesh, [Replicate(), Shard(0)]),
        "fns": (col, row),
        "mesh": mesh,
    }


def _mesh2d_step(s):
    col, row = s["fns"]
    h = col(s["x"], s["w1"])
    y = row(h, s["w2"]).redistribute(s["mesh"], [Replicate(), Replicate()])
    return (y * y).sum()


MODELS = {
    m.name: m
    for m in (
        Model("tp_mlp", _tp_mlp_build, _tp_mlp_step),
        Model("attention", _attn_build, _attn_step),
        Model("redistribute", _redistribute_build, _redistribute_step),
        Model("partial_grad", _partial_grad_build, _partial_grad_step),
        Model("loop3", _loop_build, _loop_step),
        Model("spmd", _spmd_build, _tp_mlp_step),
        Model("mesh2d", _mesh2d_build, _mesh2d_step, mesh_ndim=2),
    )
}


def grad_tensors(state: dict) -> dict[str, DTensor]:
    """The tensors of ``state`` that receive gradients, by name."""
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor) and v.requires_grad:
            out[k] = v
        elif isinstance(v, list):
            for i, t in enumerate(v):
                if isinstance(t, DTensor) and t.requires_grad:
                    out[f"{k}[{i}]"] = t
    return out


# --- nn.Module tensor-parallel stack (issue 21) --------------------------------

def tp_weights(n_layers: int, d: int, hidden: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full (unsharded) ``w1`` (d x hidden) and ``w2`` (hidden x d) of every
    layer of a tensor-parallel stack, scaled to keep activations near 1."""
    w1s = [seeded_randn(seed + 1 + 2 * i, d, hidden) / d**0.5 for i in range(n_layers)]
    w2s = [seeded_randn(seed + 2 + 2 * i, hidden, d) / hidden**0.5 for i in range(n_layers)]
    return w1s, w2s


class TPBlock(torch.nn.Module):
    """``row(col(x, w1), w2).redistribute(mesh, [R]) + x`` with DTensor parameters."""

    def __init__(self, mesh, w1: torch.Tensor, w2: torch.Tensor, impl: str = "ours") -> None:
        super().__init__()
        self.col, self.row = tp_block(mesh, local_map_fn=local_map_of(impl))
        self.mesh = mesh
        self.w1 = torch.nn.Parameter(distribute_tensor(w1, mesh, [Shard(1)]))
        self.w2 = torch.nn.Parameter(distribute_tensor(w2, mesh, [Shard(0)]))

    def forward(self, x: DTensor) -> DTensor:
        return self.row(self.col(x, self.w1), self.w2).redistribute(self.mesh, [Replicate()]) + x


class MarkedTPBlock(TPBlock):
    """A :class:`TPBlock` whose ``forward`` is marked with ``torch.compiler.nested_compile_region``."""

    @torch.compiler.nested_compile_region
    def forward(self, x: DTensor) -> DTensor:
        return super().forward(x)


class TPStack(torch.nn.Module):
    """``n_layers`` :class:`TPBlock`\\ s (:class:`MarkedTPBlock`\\ s with ``marked``);
    ``forward(x)`` returns the loss ``(h * h).sum()``."""

    def __init__(self, mesh, n_layers: int, d: int = 128, hidden: int = 256, impl: str = "ours",
                 seed: int = 0, marked: bool = False) -> None:
        super().__init__()
        block = MarkedTPBlock if marked else TPBlock
        w1s, w2s = tp_weights(n_layers, d, hidden, seed)
        self.blocks = torch.nn.ModuleList(block(mesh, w1, w2, impl) for w1, w2 in zip(w1s, w2s))

    def forward(self, x: DTensor) -> DTensor:
        for block in self.blocks:
            x = block(x)
        loss: DTensor = (x * x).sum()  # type: ignore[assignment]  # DTensor ops return DTensors
        return loss


def tp_stack_input(mesh, batch: int = 32, d: int = 128, seed: int = 0) -> DTensor:
    """The replicated input of :class:`TPStack` (requires grad)."""
    return _dist(seeded_randn(seed, batch, d), mesh, [Replicate()])
