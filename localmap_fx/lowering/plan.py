"""Redistribute plans: what collectives a placement change costs.

Planning is separate from execution.  :func:`plan_redistribute` asks DTensor's
own planner (so that a plan never costs more than ``DTensor.redistribute``)
and returns a :class:`RedistributePlan`, a tuple of frozen
:class:`RedistributeStep` values with a text form such as
``S(0)->R@tp:all_gather``.  Execution stays with ``DTensor.redistribute`` in
the lowered graph; the plan travels in node metadata for summaries, counts
and tests.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from ..graph_utils import mesh_dim_names
from ..meshcache import MeshCache
from ..region import placements_str

__all__ = ["RedistributeStep", "RedistributePlan", "plan_redistribute", "collective_of"]


def collective_of(src: Placement, dst: Placement) -> str:
    """The collective one mesh-dimension step needs ("local" for none)."""
    if src.is_partial() and dst.is_replicate():
        return "all_reduce"
    if src.is_partial() and dst.is_shard():
        return "reduce_scatter"
    if src.is_shard() and dst.is_replicate():
        return "all_gather"
    if src.is_shard() and dst.is_shard():
        return "all_to_all"
    return "local"


@dataclasses.dataclass(frozen=True)
class RedistributeStep:
    mesh_dim: int
    mesh_dim_name: str
    src: Placement
    dst: Placement
    collective: str
    group_size: int
    bytes_per_rank: int

    def text(self) -> str:
        return (
            f"{placements_str((self.src,))}->{placements_str((self.dst,))}"
            f"@{self.mesh_dim_name}:{self.collective}"
        )


@dataclasses.dataclass(frozen=True)
class RedistributePlan:
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[RedistributeStep, ...]

    def text(self) -> str:
        if not self.steps:
            return "noop"
        return "; ".join(s.text() for s in self.steps)


# (src, dst, shape, stride, dtype)
_PlanKey = tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[int, ...], tuple[int, ...], torch.dtype]

# {mesh: {_PlanKey: plan}}; see Note: [Caches keyed on a mesh]
_PLANS = MeshCache()
_MAX_PLANS_PER_MESH = 1024


def _plan_cached(mesh: DeviceMesh, key: _PlanKey) -> RedistributePlan:
    plans = _PLANS.get_or_make(mesh, dict)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS_PER_MESH:
            plans.clear()
        plan = plans[key] = _make_plan(mesh, key)
    return plan


def _make_plan(mesh: DeviceMesh, key: _PlanKey) -> RedistributePlan:
    src, dst, shape, stride, dtype = key
    # not torch's @cache'd _gen_transform_infos: it keeps every mesh it saw
    # alive (Note: [Caches keyed on a mesh]); plans are cached here instead
    from .._torch_compat import DTensorSpec, TensorMeta
    from .._torch_compat import gen_transform_infos_non_cached as _gen_transform_infos

    meta = TensorMeta(torch.Size(shape), stride, dtype)
    if src == dst:
        return RedistributePlan(src, dst, ())
    infos = _gen_transform_infos(
        DTensorSpec(mesh, src, tensor_meta=meta), DTensorSpec(mesh, dst, tensor_meta=meta)
    )
    names = mesh_dim_names(mesh)
    itemsize = torch.empty((), dtype=dtype).element_size()
    steps = []
    for info in infos:
        s, d = info.src_dst_placements
        coll = collective_of(s, d)
        group = mesh.size(info.mesh_dim)
        logical = math.prod(int(x) for x in info.logical_shape)
        # bytes each rank sends into the collective (its local piece)
        if coll == "all_gather":
            nbytes = (logical // group) * itemsize
        elif coll in ("all_reduce", "reduce_scatter", "all_to_all"):
            nbytes = logical * itemsize if coll != "all_to_all" else (logical // group) * itemsize
        else:
            nbytes = 0
        steps.append(
            RedistributeStep(info.mesh_dim, names[info.mesh_dim], s, d, coll, group, nbytes)
        )
    return RedistributePlan(src, dst, tuple(steps))


def _hint(size) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else int(size)


def plan_redistribute(
    mesh: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    global_shape: tuple[int, ...],
    dtype: torch.dtype,
) -> RedistributePlan:
    """The plan DTensor would run to move a tensor from ``src`` to ``dst``."""
    # Under dynamic shapes sizes are SymInts: plan with their example values
    # (the collectives chosen do not depend on sizes).
    shape = tuple(_hint(s) for s in global_shape)
    stride = tuple(int(s) for s in torch.empty(0).new_empty(shape, device="meta").stride())
    return _plan_cached(mesh, (tuple(src), tuple(dst), shape, stride, dtype))
