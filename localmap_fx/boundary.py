"""One boundary plan per call: what a region's borders do, decided in one place.

A ``local_map`` call crosses its region's border twice.  Each DTensor argument
is redistributed (when ``in_placements`` asks for other placements and
``redistribute_inputs=True``) and unwrapped with ``to_local``; each tensor
output is wrapped with ``from_local``.  What every one of those operations
does depends only on the call's layout, so it is decided once, as a
:class:`BoundaryPlan`, and rendered by each mode::

    call layout -> BoundaryPlan                  rendered by
    ----------------------------------------     --------------------------------
    in[0] R grad P   in[1] S(1) grad S(1)        eager: _ToTorchTensor.apply(arg, grad)
    out[0] S(1) shape (64, 128) grad S(1)        capture: redistribute/to_local/from_local nodes
                                                 lowering: the same nodes, every grad explicit

Gradient placements are derived here and nowhere else:
:func:`input_grad` (``in_grad_placements``, else the SPMD type's for
``spmd_types=True``, else DTensor's default) and :func:`explicit_grad`
(DTensor's default written out, for lowered graphs).  :func:`check_arg_meshes`
is the one loop that puts every DTensor argument on ``device_mesh``
(the mesh ruling, :func:`localmap_fx.validate.check_arg_mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from . import validate
from ._torch_compat import normalize_placements_for_grad
from .region import placements_str

__all__ = [
    "ArgBoundary",
    "OutBoundary",
    "BoundaryPlan",
    "input_grad",
    "explicit_grad",
    "typed_in_grad_placements",
    "check_arg_meshes",
]

Placements = tuple[Placement, ...]


@dataclasses.dataclass(frozen=True)
class ArgBoundary:
    """Args leaf ``index`` crossing into the region."""

    index: int
    placements: Placements  # as the argument arrives
    target: Placements | None  # redistributed to these first; None: not redistributed
    grad: Placements | None  # to_local(grad_placements=...); None: DTensor's default

    @property
    def local_placements(self) -> Placements:
        """The placements the body's local tensor has."""
        return self.target if self.target is not None else self.placements

    def text(self) -> str:
        move = "" if self.target is None else f"->{placements_str(self.target)}"
        grad = placements_str(explicit_grad(self.local_placements, self.grad))
        return f"in[{self.index}] {placements_str(self.placements)}{move} grad {grad}"


@dataclasses.dataclass(frozen=True)
class OutBoundary:
    """Output ``index`` of the body leaving the region."""

    index: int
    placements: Placements
    shape: tuple[int, ...] | None  # global shape; None: from_local derives it (even shards)
    grad: Placements | None  # from_local(grad_placements=...); None: DTensor's default

    def text(self) -> str:
        shape = "" if self.shape is None else f" shape {tuple(self.shape)}"
        grad = placements_str(explicit_grad(self.placements, self.grad))
        return f"out[{self.index}] {placements_str(self.placements)}{shape} grad {grad}"


@dataclasses.dataclass(frozen=True)
class BoundaryPlan:
    """Every border operation of one call: DTensor arguments in, tensor outputs out."""

    args: tuple[ArgBoundary, ...]
    outs: tuple[OutBoundary, ...] = ()

    def text(self) -> str:
        """E.g. ``in[0] R grad P; in[1] S(0)->S(1) grad S(1); out[0] P shape (8, 8) grad R``
        (gradient placements written out, DTensor's default included)."""
        parts = [a.text() for a in self.args] + [o.text() for o in self.outs]
        return "; ".join(parts) or "no boundary"

    def with_outs(self, outs: Iterable[OutBoundary]) -> BoundaryPlan:
        return dataclasses.replace(self, outs=tuple(outs))


@functools.lru_cache(maxsize=256)
def typed_in_grad_placements(placements: Placements) -> Placements | None:
    """Grad placements of a ``spmd_types=True`` input whose in_grad_placements are not given.

    Note: [Input gradients follow the SPMD type]
        Without in_grad_placements, an input is typed from its placements
        alone: ``Replicate()`` becomes ``R``, whose gradient is ``P``
        (Partial).  DTensor's default grad placement for ``to_local()`` is
        the forward one, ``Replicate()``, i.e. the gradient of an ``I``.
        torch 2.14.1's local_map(spmd_types=True) uses that default, so the
        per-rank partial gradients the checked body produces for an ``R``
        input are read as replicated ones: wrong by a sum over the axis
        (even for ``x * 2``).  We give such inputs the gradient their type
        says: ``Partial()`` on every Replicate dimension (Shard stays Shard,
        Partial -> Replicate as DTensor already does).  None when nothing
        differs from DTensor's default.
    """
    if not any(type(p) is Replicate for p in placements):
        return None
    return tuple(
        Partial() if type(p) is Replicate else (Replicate() if p.is_partial() else p)
        for p in placements
    )


def input_grad(placements: Placements, given: Sequence[Placement] | None, typed: bool) -> Placements | None:
    """The gradient placements of an argument whose local tensor has ``placements``.

    ``given``: its ``in_grad_placements`` entry (None: not given); ``typed``:
    the region is type-checked (``spmd_types=True``).  None means DTensor's
    default (:func:`explicit_grad`), which is what ``to_local()`` uses.
    """
    if given is not None:
        return given if type(given) is tuple else tuple(given)
    if typed:
        return typed_in_grad_placements(placements)
    return None


def explicit_grad(placements: Placements, grad: Sequence[Placement] | None) -> Placements:
    """``grad``, or DTensor's default for ``placements`` (Partial -> Replicate) written out."""
    if grad is not None:
        return tuple(grad)
    return tuple(normalize_placements_for_grad(placements))


def check_arg_meshes(
    flat_args: Sequence[Any],
    device_mesh: Any,
    check: Callable[[Any, Any, int], None] = validate.check_arg_mesh,
    value: Callable[[Any], Any] = lambda a: a,
) -> None:
    """Every DTensor argument on ``device_mesh`` (the mesh ruling,
    :func:`localmap_fx.validate.check_arg_mesh`); nothing to check without one.

    ``value(a)`` is the argument's value (capture reads fake values off
    Dynamo's variables); ``check`` raises for an argument on another mesh
    (capture passes a variant that runs at trace time).
    """
    if device_mesh is None:
        return
    for idx, a in enumerate(flat_args):
        v = value(a)
        if isinstance(v, DTensor) and v.device_mesh is not device_mesh:
            check(v.device_mesh, device_mesh, idx)
