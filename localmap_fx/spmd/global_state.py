"""What the global SPMD check knows about one local tensor, per mesh dimension.

Beside each local tensor of a ``spmd_types="global"`` body the check keeps a
:data:`GlobalState`: one :class:`DimState` per mesh dimension, saying how
the local tensor relates to the global tensor the region's placements
describe:

==================  =============================================================
state               the local tensor on this mesh dimension is ...
==================  =============================================================
``REPLICATED``      the whole global tensor, the same on every rank
``Sharded(d)``      this rank's block of the global tensor along tensor dim ``d``
``Pending(op)``     a summand: the global tensor is ``op`` over the ranks of the
                    local tensors (a contraction over a sharded dim, an input
                    placed ``Partial(op)``)
``Stacked(d)``      dim 0 holds one block per rank, each that rank's block along
                    ``d`` (an all_gather along dim 0 of a shard of dim ``d``)
``Opaque``          unknown (after all_to_all, indexing a local expert, any op
                    the oracle could not explain): the check gives no verdict
==================  =============================================================

Where a state came from (:class:`Site`) is kept for error messages only: it
never takes part in comparisons, so states are usable as cache keys.
"""

from __future__ import annotations

import dataclasses
import linecache
import os

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "Site",
    "DimState",
    "Replicated",
    "Sharded",
    "Pending",
    "Stacked",
    "Opaque",
    "REPLICATED",
    "GlobalState",
    "state_of_placement",
    "states_of_placements",
]


@dataclasses.dataclass(frozen=True)
class Site:
    """A line of the body: where an op ran, or where a state came from."""

    file: str
    line: int
    code: str = ""
    what: str = ""  # e.g. "in_placements[0]" for a region input

    def __str__(self) -> str:
        if self.what:
            return self.what
        code = self.code or linecache.getline(self.file, self.line).strip()
        where = f"{os.path.basename(self.file)}:{self.line}"
        return f"{where} (`{code}`)" if code else where


class DimState:
    """The state of a local tensor on one mesh dimension (see module docstring)."""

    __slots__ = ()

    def key(self) -> tuple:
        """A hashable key for the oracle's cache (origins left out)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Replicated(DimState):
    def key(self) -> tuple:
        return ("R",)

    def __str__(self) -> str:
        return "replicated"


@dataclasses.dataclass(frozen=True)
class Sharded(DimState):
    dim: int

    def key(self) -> tuple:
        return ("S", self.dim)

    def __str__(self) -> str:
        return f"a shard of tensor dim {self.dim}"


@dataclasses.dataclass(frozen=True)
class Pending(DimState):
    op: str  # the reduction still to come: "sum", "avg", "max", "min", "product"
    origin: Site | None = dataclasses.field(default=None, compare=False)
    origin_op: str = dataclasses.field(default="", compare=False)
    # a statistic of the local shard (sum/mean/amax over a sharded dim), as
    # opposed to a contraction's summand or a Partial input
    statistic: bool = dataclasses.field(default=False, compare=False)

    def key(self) -> tuple:
        return ("P", self.op)

    def __str__(self) -> str:
        src = ""
        if self.origin is not None:
            src = f" from `{self.origin_op}` at {self.origin}" if self.origin_op else f" from {self.origin}"
        return f"a pending {self.op}{src}"


@dataclasses.dataclass(frozen=True)
class Stacked(DimState):
    dim: int
    inner: DimState = dataclasses.field(default_factory=lambda: Replicated())

    def key(self) -> tuple:
        return ("T", self.dim, self.inner.key())

    def __str__(self) -> str:
        if isinstance(self.inner, Pending):
            return f"the blocks along tensor dim {self.dim} of {self.inner}, stacked along dim 0"
        return f"an all_gather along dim 0 of a shard of tensor dim {self.dim}"


@dataclasses.dataclass(frozen=True)
class Opaque(DimState):
    reason: str = dataclasses.field(default="", compare=False)

    def key(self) -> tuple:
        return ("O",)

    def __str__(self) -> str:
        return f"unknown ({self.reason})" if self.reason else "unknown"


REPLICATED = Replicated()

#: one DimState per mesh dimension
GlobalState = tuple[DimState, ...]


def state_of_placement(p: Placement, ndim: int, origin: Site | None = None) -> DimState:
    """The state a region input placed ``p`` starts from (``ndim``: the tensor's rank)."""
    if isinstance(p, Shard):
        return Sharded(p.dim % ndim if ndim else p.dim)
    if isinstance(p, Partial):
        return Pending(str(p.reduce_op), origin)
    if isinstance(p, Replicate):
        return REPLICATED
    return Opaque(f"placement {p}")


def states_of_placements(placements, ndim: int, origin: Site | None = None) -> GlobalState:
    return tuple(state_of_placement(p, ndim, origin) for p in placements)
