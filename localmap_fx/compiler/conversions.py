"""Placement conversions at a compiled graph's border, planned once.

A DTensor border converts a gradient whose placements are not the ones its
compiled code was traced with: a tangent arriving ``Partial`` at an output
traced ``Replicate`` (one all_reduce, as AOTAutograd coerces it), or an
input's gradient turned into the placements eager DTensor gives it
(``Shard(0)`` laid into zeros as ``Partial``).  DTensor's
``redistribute_local_tensor`` plans the change again on every call (about
100 µs of Python per conversion in torch 2.14, where the collective itself
is a few dispatcher calls), and a regional stack converts once or twice per
block per step.  The border knows each conversion when it builds the
backward for a placement, so it plans it there, once (:func:`plan_conversion`):
a :class:`Conversion` of frozen steps with a text form, which runs the
ops directly::

    step                           runs (per call)
    P->R@tp:all_reduce             wait_tensor(all_reduce(local, "sum", <tp group>))
    S(0)->P@tp:embed               zeros(<global dim 0>).narrow(0, offset, size).add_(local)
    R->P@tp:partition              local / <tp size>       (avg, min, max: local)
    <anything else>                redistribute_local_tensor(local, src, dst), DTensor's own

Each direct step computes what DTensor's placement methods compute
(``Partial._reduce_value``, ``Shard._to_partial_tensor``,
``Partial._partition_value``), bit for bit: the same collective, ``0 + x``
where DTensor index_adds into zeros, the same division.  A change on more
than one mesh dimension, a placement subclass (``_MaskPartial``,
``_StridedShard``) or a mesh dimension sharding the same tensor dimension
twice keeps DTensor's way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..below_autograd import all_reduce_waited
from ..lowering.plan import plan_redistribute

__all__ = ["Conversion", "new_dtensor", "plan_conversion"]


@dataclasses.dataclass(frozen=True)
class _AllReduce:
    """``Partial`` -> ``Replicate`` on one mesh dimension."""

    kind: ClassVar[str] = "all_reduce"
    reduce_op: str
    group_name: str

    def run(self, local: torch.Tensor) -> torch.Tensor:
        return all_reduce_waited(local, self.reduce_op, self.group_name)


@dataclasses.dataclass(frozen=True)
class _Embed:
    """``Shard(dim)`` -> ``Partial(sum)``: this rank's shard in zeros of the dimension's global size."""

    kind: ClassVar[str] = "embed"
    dim: int
    offset: int
    size: int
    global_size: int

    def run(self, local: torch.Tensor) -> torch.Tensor:
        if local.size(self.dim) != self.size:
            raise RuntimeError(f"localmap_fx: a Shard({self.dim}) gradient has {local.size(self.dim)} rows "
                               f"on dimension {self.dim}, its placement says {self.size}")
        shape = list(local.shape)
        shape[self.dim] = self.global_size
        out = local.new_zeros(shape)
        out.narrow(self.dim, self.offset, self.size).add_(local)
        return out


@dataclasses.dataclass(frozen=True)
class _Partition:
    """``Replicate`` -> ``Partial``: each rank's share of the value (``divisor`` 1: the value itself)."""

    kind: ClassVar[str] = "partition"
    divisor: int
    reduce_op: str
    group_name: str

    def run(self, local: torch.Tensor) -> torch.Tensor:
        return local / self.divisor if self.divisor != 1 else local


@dataclasses.dataclass(frozen=True)
class _Redistribute:
    """Any other change: DTensor's own ``redistribute_local_tensor``, planned per call."""

    src: Any  # DTensorSpec
    dst: Any

    def run(self, local: torch.Tensor) -> torch.Tensor:
        from .._torch_compat import redistribute_local_tensor

        return redistribute_local_tensor(local, self.src, self.dst)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A gradient's local tensor in ``src`` placements -> the DTensor of ``dst`` (a spec)."""

    dst: Any  # DTensorSpec
    steps: tuple[Any, ...]
    texts: tuple[str, ...]

    def text(self) -> str:
        return "; ".join(self.texts) if self.texts else "noop"

    def undone_by(self, reduce_op: str, group_name: str) -> bool:
        """Whether an ``all_reduce(reduce_op)`` over ``group_name`` of this
        conversion's result is the value it converted: a lone ``Replicate ->
        Partial(reduce_op)`` partition over that group (n shares of ``v / n``
        sum to ``v``; avg, min and max of equal values are that value)."""
        return (len(self.steps) == 1 and type(self.steps[0]) is _Partition
                and self.steps[0].reduce_op == reduce_op and self.steps[0].group_name == group_name)

    def __call__(self, local: torch.Tensor) -> DTensor:
        for step in self.steps:
            local = step.run(local)
        return new_dtensor(local, self.dst)


def new_dtensor(local: torch.Tensor, spec: Any) -> DTensor:
    """``DTensor(local, spec, requires_grad=False)`` without its ``__init__``.

    ``DTensor(...)`` is ``DTensor.__new__`` (the C++ constructor, which sets
    the spec and the local tensor) then ``DTensor.__init__``, which does
    nothing but is wrapped in ``torch._disable_dynamo`` (an eval-frame switch,
    more than half of the construction's time).  A border builds its
    DTensors where Dynamo never traces (inside the compiled graph's call,
    which Dynamo runs disabled, and in its backward).
    """
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def plan_conversion(src: Any, dst: Any) -> Conversion:
    """The :class:`Conversion` from spec ``src`` to spec ``dst`` (same mesh and global tensor)."""
    mesh = src.mesh
    meta = dst.tensor_meta
    plan = plan_redistribute(mesh, tuple(src.placements), tuple(dst.placements), tuple(meta.shape), meta.dtype)
    texts = tuple(s.text() for s in plan.steps)
    if not plan.steps:
        return Conversion(dst, (), ())
    step = _direct(plan.steps, src, meta) if len(plan.steps) == 1 else None
    if step is None:
        return Conversion(dst, (_Redistribute(src, dst),), texts)
    # the planner's text names the collective ("local" for two of these): name the step instead
    head, _, _ = texts[0].rpartition(":")
    return Conversion(dst, (step,), (f"{head}:{step.kind}",))


def _direct(steps: tuple, src: Any, meta: Any) -> Any:
    """The direct step for a one-dimension change, None where DTensor's way is kept."""
    (s,) = steps
    mesh, a, b, k = src.mesh, s.src, s.dst, s.mesh_dim
    if type(a) is Partial and type(b) is Replicate:
        return _AllReduce(a.reduce_op, mesh.get_group(k).group_name)
    if type(a) is Replicate and type(b) is Partial:
        group = mesh.get_group(k).group_name
        if b.reduce_op == "sum":
            return _Partition(mesh.size(k), b.reduce_op, group)
        return _Partition(1, b.reduce_op, group) if b.reduce_op in ("avg", "min", "max") else None
    if type(a) is Shard and type(b) is Partial and b.reduce_op == "sum":
        others = [p for j, p in enumerate(src.placements) if j != k]
        if any(type(p) not in (Shard, Replicate, Partial) or type(p) is Shard and p.dim == a.dim for p in others):
            return None
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return None
        global_size = int(meta.shape[a.dim])
        size, offset = Shard.local_shard_size_and_offset(global_size, mesh.size(k), coordinate[k])
        return _Embed(a.dim, int(offset), int(size), global_size)
    return None
