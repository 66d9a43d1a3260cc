"""Placement bookkeeping shared by the example models (:mod:`.llama`, :mod:`.moe`).

A model runs on a 1-D mesh ``(model_dim,)`` or a 2-D mesh ``("dp", model_dim)``
where ``model_dim`` is ``"tp"`` (tensor parallel) or ``"ep"`` (expert
parallel).  :class:`MeshLayout` turns "this placement on the model dimension,
that one on dp" into the placement tuple of the actual mesh, so each region
is written once for both meshes.

Note: [Data-parallel sharded parameters]
    On a 2-D mesh every parameter is additionally sharded on ``dp`` (FSDP
    style) along a tensor dimension the model dimension does not shard.  A
    region asks for the parameter ``Replicate`` on ``dp`` with
    ``redistribute_inputs=True`` (one all_gather on entry) and declares its
    gradient ``Partial`` on ``dp`` (each dp rank saw different data), so the
    backward of the entry redistribution is one reduce_scatter: the FSDP
    pattern, written only with placements.

Note: [Regions built once]
    Every ``local_map`` is built when the model is constructed and kept on
    the model; ``forward`` only calls them, as torchtitan-style code does
    with its parallel styles.  (``local_map(...)`` built inside ``forward``
    is a separate pattern with its own tests: ``tests/compile/test_capture_patterns.py``.)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

__all__ = [
    "MeshLayout",
    "LOCAL_MAP_IMPLS",
    "local_map_impl",
    "device_for_rank",
    "ModelConfig",
    "WeightInit",
    "token_batch",
    "full_weights",
]


def _torch_local_map(*args, **kwargs):
    from torch.distributed.tensor.experimental import local_map

    return local_map(*args, **kwargs)


def _ours(*args, **kwargs):
    from ..api import local_map

    return local_map(*args, **kwargs)


# name -> factory with torch's local_map signature
LOCAL_MAP_IMPLS: dict[str, Callable] = {"localmap_fx": _ours, "torch": _torch_local_map}


def local_map_impl(name_or_fn: str | Callable) -> Callable:
    if callable(name_or_fn):
        return name_or_fn
    try:
        return LOCAL_MAP_IMPLS[name_or_fn]
    except KeyError:
        raise ValueError(
            f"local_map={name_or_fn!r} is not known: use one of {sorted(LOCAL_MAP_IMPLS)} or pass a callable"
        ) from None


def device_for_rank() -> torch.device:
    """``cuda:$LOCAL_RANK`` when CUDA is present, else CPU (never assumes one host)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Placements of one model on a 1-D ``(model_dim,)`` or 2-D ``("dp", model_dim)`` mesh."""

    mesh: DeviceMesh
    model_dim: str

    def __post_init__(self) -> None:
        names = self.mesh.mesh_dim_names
        ok = names in ((self.model_dim,), ("dp", self.model_dim))
        if not ok:
            raise ValueError(
                f"the model needs a mesh with mesh_dim_names ({self.model_dim!r},) or "
                f"('dp', {self.model_dim!r}), got {names}: build it with "
                f"init_device_mesh(device, shape, mesh_dim_names=...)"
            )

    @property
    def has_dp(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def model_size(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def dp_size(self) -> int:
        return self.mesh.size(0) if self.has_dp else 1

    def pl(self, model: Placement = Replicate(), dp: Placement = Replicate()) -> tuple[Placement, ...]:
        """The mesh's placement tuple: ``dp`` (2-D only) then ``model``."""
        return (dp, model) if self.has_dp else (model,)

    # --- parameters ---------------------------------------------------------

    def param_placements(self, model: Placement, dp_dim: int | None) -> tuple[Placement, ...]:
        """Stored placement of a parameter: ``model`` plus ``Shard(dp_dim)`` on dp."""
        dp = Shard(dp_dim) if dp_dim is not None else Replicate()
        return self.pl(model, dp)

    def weight_in(self, model: Placement = Replicate()) -> tuple[Placement, ...]:
        """What a region asks for: the parameter whole on dp (gathered on entry)."""
        return self.pl(model, Replicate())

    def weight_grad(self, model_grad: Placement) -> tuple[Placement, ...]:
        """Its gradient: partial over dp (each dp rank saw other data)."""
        return self.pl(model_grad, Partial())

    def distribute(self, full: torch.Tensor, model: Placement, dp_dim: int | None, grad: bool = True) -> DTensor:
        dt = distribute_tensor(full, self.mesh, list(self.param_placements(model, dp_dim)))
        return dt.requires_grad_(grad)  # type: ignore[return-value]

    def replicate_all(self) -> tuple[Placement, ...]:
        return (Replicate(),) * self.mesh.ndim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes every example model has: token embedding, depth, norm epsilon."""

    vocab: int = 64
    dim: int = 32
    n_layers: int = 2
    norm_eps: float = 1e-5


class WeightInit:
    """Seeded random weights of the example models, drawn in call order."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def randn(self, *shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * scale).to(self.dtype)

    def norm(self, dim: int) -> torch.Tensor:
        """A norm's weight near 1 (not exactly 1, so a wrong gradient shows)."""
        return (1.0 + 0.1 * torch.randn(dim, generator=self.g)).to(self.dtype)


def token_batch(vocab: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(tokens, targets)``: targets are the tokens shifted by one."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full tensor (for the single-device reference)."""
    return {k: v.full_tensor() for k, v in model.named_parameters()}  # type: ignore[attr-defined]
