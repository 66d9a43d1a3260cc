"""Placements <-> SPMD types (spmd_types 0.3.1), shared by eager and compile.

Mapping (per mesh dimension), as torch 2.14.1's ``local_map`` assigns it:

====================  ========================================
placement             local SPMD type
====================  ========================================
``Shard(d)``          ``V`` (varying)
``Replicate()``       ``I`` if its grad placement is Replicate,
                      else ``R``
``Partial()``         ``P``
====================  ========================================

After the body runs, each output's SPMD type fixes the placement of its
gradient: ``P``/``V``-as-Partial -> Replicate, ``R`` -> Partial, ``I`` ->
Replicate, ``V`` -> Shard (dim taken from out_placements).  Inputs get the
gradient of their type too (:func:`typed_in_grad_placements`).

:func:`checking` is spmd_types' strict checker plus our typing rules for
functional collectives (:mod:`localmap_fx.spmd.rules`); eager calls and the
compile-time check (:mod:`localmap_fx.spmd.check`) both use it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..boundary import typed_in_grad_placements  # Note: [Input gradients follow the SPMD type]

try:
    import spmd_types as spmd
except ImportError:  # pragma: no cover - reported by validate.check_spmd_types_available()
    spmd = None  # type: ignore[assignment]

__all__ = [
    "placements_to_spmd_type",
    "annotate_inputs",
    "checking",
    "out_grad_placements",
    "typed_in_grad_placements",
    "SpmdPlan",
    "explain",
]


def _axis(mesh: DeviceMesh, dim: int):
    return spmd.MeshAxis.of(mesh.get_group(dim))


def _valid_grad_placements(placement: Placement) -> str:
    if type(placement) is Shard:
        return "Shard (spmd.V)"
    if type(placement) is Replicate:
        return "Partial (spmd.R) or Replicate (spmd.I)"
    if type(placement) is Partial:
        return "Replicate (spmd.P)"
    raise ValueError(
        f"local_map(spmd_types=True) does not support placement type {type(placement).__name__}"
    )


def _compatible_placement(local_type, placement: Placement) -> Placement | None:
    """The DTensor placement a local type allows, given the one asked for."""
    if local_type == spmd.V:
        return placement if type(placement) in (Shard, Partial) else None
    return spmd.spmd_type_to_dtensor_placement(local_type)


def placements_to_spmd_type(
    placements: Sequence[Placement],
    grad_placements: Sequence[Placement] | None,
    mesh: DeviceMesh,
    axis_of=None,
) -> dict:
    """{MeshAxis: local type} for one input, validating its grad pair.

    ``axis_of(dim)`` (default: ``MeshAxis.of(mesh.get_group(dim))``) gives
    the mesh axis of a mesh dimension.
    """
    if axis_of is None:
        axis_of = functools.partial(_axis, mesh)
    result = {}
    for dim, placement in enumerate(placements):
        axis = axis_of(dim)
        grad_p = grad_placements[dim] if grad_placements is not None else None
        if type(placement) is Shard:
            fwd_type = spmd.V
        elif type(placement) is Replicate:
            fwd_type = spmd.I if type(grad_p) is Replicate else spmd.R
        elif type(placement) is Partial:
            fwd_type = spmd.P
        else:
            raise ValueError(
                f"local_map(spmd_types=True) does not support placement type "
                f"{type(placement).__name__}: {placement}"
            )
        if grad_p is not None:
            actual = _compatible_placement(fwd_type.backward_type(), grad_p)
            if actual is None or type(actual) is not type(grad_p):
                raise ValueError(
                    "local_map(spmd_types=True) cannot represent this "
                    "forward/backward placement pair:\n"
                    f"in_placements={placement}, in_grad_placements={grad_p}.\n\n"
                    "The local_map boundary assigns one SPMD type to each "
                    "local tensor, which also fixes the expected backward "
                    f"placement. For in_placements={placement}, valid grad "
                    f"placements are {_valid_grad_placements(placement)}.\n\n"
                    "If the forward and backward layouts intentionally "
                    "diverge in a way not represented by one SPMD type, "
                    "expand the local_map region to include that divergence, "
                    "so the local_map region boundary respects tied FWD-BWD "
                    "typing."
                )
        result[axis] = fwd_type
    return result


def annotate_inputs(
    flat_local_args: Sequence[Any],
    in_specs: tuple | None,
    in_grad_specs: tuple | None,
    mesh: DeviceMesh,
) -> None:
    """Attach SPMD types to the local tensors the body receives."""
    if in_specs is None:
        return
    for idx, local in enumerate(flat_local_args):
        if not isinstance(local, torch.Tensor) or in_specs[idx] is None:
            continue
        grad = in_grad_specs[idx] if in_grad_specs is not None else None
        spmd.assert_type(local, placements_to_spmd_type(in_specs[idx], grad, mesh))


@contextlib.contextmanager
def checking(mesh: DeviceMesh):
    """Strict SPMD type checking of everything run inside, on ``mesh``.

    Functional collectives are typed by :func:`localmap_fx.spmd.rules.rules`,
    a mode entered inside spmd_types' own (so it sees every call first).
    """
    from spmd_types._checker import typecheck

    from .rules import rules

    with spmd.set_current_mesh(mesh), typecheck(strict_mode="strict"), rules():
        yield


def out_grad_placements(
    flat_out: Sequence[Any], out_specs: tuple, mesh: DeviceMesh, axis_of=None
) -> tuple:
    """Validate the body's output types; return each output's grad placements."""
    if axis_of is None:
        axis_of = functools.partial(_axis, mesh)
    grads: list = []
    for out, spec in zip(flat_out, out_specs, strict=True):
        if spec is not None and not isinstance(out, torch.Tensor):
            raise ValueError(
                f"out_placements specifies {spec} but the corresponding "
                f"output is {type(out).__name__}, not a Tensor"
            )
        if spec is None:
            if isinstance(out, torch.Tensor):
                raise ValueError(
                    "out_placements has None for a Tensor output. Provide "
                    "placements for Tensor outputs and use None only for "
                    "non-Tensor outputs."
                )
            grads.append(None)
            continue
        actual_type = spmd.get_local_type(out)
        if not actual_type:
            raise ValueError(
                "Output tensor has no spmd_types annotation but out_placements "
                "expects one. Ensure the function's output is derived from "
                "annotated inputs or is explicitly annotated."
            )
        for dim, placement in enumerate(spec):
            axis = axis_of(dim)
            actual = actual_type.get(axis)
            if actual is None:
                names = (
                    tuple(range(mesh.ndim))
                    if mesh.mesh_dim_names is None
                    else mesh.mesh_dim_names
                )
                annotated = [
                    names[i] for i in range(mesh.ndim) if axis_of(i) in actual_type
                ]
                raise ValueError(
                    "Output tensor has no spmd_types annotation on "
                    f"DeviceMesh dimension {names[dim]} "
                    f"but out_placements expects {placement}. "
                    "Actual annotations on this DeviceMesh are: "
                    f"{annotated}"
                )
            got = _compatible_placement(actual, placement)
            if got is None or type(got) is not type(placement):
                raise ValueError(
                    f"Output tensor placement mismatch on {axis}: "
                    f"out_placements={placement} but spmd_types inferred "
                    f"spmd.{actual.name}"
                )
        grad_spec: list[Placement] = []
        for dim, placement in enumerate(spec):
            t = actual_type[axis_of(dim)]
            if t == spmd.V and type(placement) is Partial:
                grad_spec.append(Replicate())
            else:
                g = _compatible_placement(t.backward_type(), placement)
                if g is None:
                    raise AssertionError("expected grad_placement to be not None")
                grad_spec.append(g)
        grads.append(tuple(grad_spec))
    return tuple(grads)


def _axis_names(mesh: DeviceMesh) -> str:
    """``"default_pg is mesh dimension 'tp'"``: spmd_types' axis names -> the user's."""
    names = mesh.mesh_dim_names
    if not names:
        return ""
    from spmd_types.types import format_axis

    parts = []
    for dim, name in enumerate(names):
        try:
            axis = format_axis(_axis(mesh, dim))
        except Exception:  # noqa: BLE001 - no name to give
            continue
        if str(axis) != name:
            parts.append(f"{axis} is device_mesh dimension {name!r}")
    return "; ".join(parts)


# The errors of the SPMD check that a missing collective or a wrong
# placement causes (the note names the mesh axes and the fixes) ...
_TYPE_MISMATCH = ("Output tensor placement mismatch", "Output tensor has no spmd_types annotation")
# ... and the others, each with its own fix.
_OTHER_HINTS = {
    "local_map(spmd_types=True) cannot represent": (
        "change in_grad_placements to one of the grad placements listed above for "
        "that input, or pass spmd_types=False."
    ),
    "local_map(spmd_types=True) does not support placement type": (
        "spmd_types=True types Shard, Replicate and Partial placements only: use "
        "those in in_placements / out_placements, or pass spmd_types=False."
    ),
    "out_placements has None for a Tensor output": (
        "give that output its placements in out_placements, e.g. [Shard(0)]."
    ),
}


def explain(e: BaseException, mesh: DeviceMesh | None) -> BaseException:
    """Attach localmap_fx's hint to an error of the SPMD check, as a note.

    spmd_types names mesh axes by their process group (``default_pg``); for
    a type error the note says which ``device_mesh`` dimension that is and
    how to fix the body or the placements.  ``str(e)`` is left as torch's.
    """
    if getattr(e, "_localmap_fx_explained", False):
        return e
    is_type_error = (spmd is not None and isinstance(e, spmd.SpmdTypeError)) or str(e).startswith(_TYPE_MISMATCH)
    if is_type_error:
        names = _axis_names(mesh) if mesh is not None else ""
        e.add_note(
            "[localmap_fx] " + (f"mesh axes: {names}. " if names else "")
            + "Fix the body or the placements so that each value's SPMD type is "
            "what the region declares: add the missing collective (or "
            "spmd_types' reinterpret/convert), or change out_placements / "
            "in_grad_placements; see docs/user-guide.md, \"What the SPMD checker "
            "proves\"."
        )
    else:
        hint = next((h for start, h in _OTHER_HINTS.items() if str(e).startswith(start)), None)
        if hint is not None:
            e.add_note(f"[localmap_fx] {hint}")
    try:
        e._localmap_fx_explained = True  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - exotic exception types
        pass
    return e


class SpmdPlan:
    """Per (local_map function, mesh) state of the eager ``spmd_types=True`` path.

    Computes once what torch's ``local_map`` recomputes on every call and
    that only depends on the mesh and the placement specs: the ``MeshAxis``
    of each mesh dimension, each input's SPMD types, and the mesh entry
    ``spmd.set_current_mesh(mesh)`` pushes.  Every call still runs
    ``spmd.assert_type`` on each input and the strict checker on the body, so
    verdicts and errors are torch's (failed computations are not cached and
    are redone, raising the same error at the same point).
    """

    __slots__ = ("_mesh", "_axes", "_in_types", "_mesh_entry")

    def __init__(self, mesh: DeviceMesh) -> None:
        # weakly: plans are cached per mesh (Note: [Caches keyed on a mesh])
        self._mesh = weakref.ref(mesh)
        self._axes: dict[int, Any] = {}
        self._in_types: dict[int, tuple] = {}
        self._mesh_entry: tuple | None = None

    @property
    def mesh(self) -> DeviceMesh:
        mesh = self._mesh()
        if mesh is None:
            raise AssertionError("SpmdPlan used after its DeviceMesh was collected")
        return mesh

    def axis(self, dim: int):
        a = self._axes.get(dim)
        if a is None:
            a = self._axes[dim] = _axis(self.mesh, dim)
        return a

    def annotate_inputs(
        self,
        flat_local_args: Sequence[Any],
        in_specs: tuple | None,
        in_grad_specs: tuple | None,
    ) -> None:
        """:func:`annotate_inputs` with the per-input types cached."""
        if in_specs is None:
            return
        for idx, local in enumerate(flat_local_args):
            spec = in_specs[idx]
            if not isinstance(local, torch.Tensor) or spec is None:
                continue
            grad = in_grad_specs[idx] if in_grad_specs is not None else None
            hit = self._in_types.get(idx)
            if hit is not None and hit[0] is spec and hit[1] is grad:
                types = hit[2]
            else:
                types = placements_to_spmd_type(spec, grad, self.mesh, self.axis)
                self._in_types[idx] = (spec, grad, types)
            spmd.assert_type(local, dict(types))

    def checking(self):
        """``checking(mesh)``, pushing a cached mesh entry."""
        entry = self._mesh_entry
        if entry is None:
            try:
                from spmd_types._mesh import _resolve_axes
                from spmd_types._state import _axes_to_pgs

                resolved, names = _resolve_axes(self.mesh)
                entry = (resolved, names, _axes_to_pgs(self.mesh))
            except Exception:  # noqa: BLE001 - the public path raises it below
                return checking(self.mesh)
            self._mesh_entry = entry
        return _CheckingWithEntry(entry)

    def out_grad_placements(self, flat_out: Sequence[Any], out_specs: tuple) -> tuple:
        return out_grad_placements(flat_out, out_specs, self.mesh, self.axis)


class _CheckingWithEntry:
    """``with spmd.set_current_mesh(mesh), typecheck(strict_mode="strict")``.

    ``set_current_mesh(mesh)`` resolves the mesh's axes and process groups on
    every entry; this pushes the same ``MeshEntry`` from values resolved once.
    """

    __slots__ = ("entry", "tc", "rules")

    def __init__(self, entry: tuple) -> None:
        self.entry = entry
        self.tc: Any = None  # spmd_types' checker, entered in __enter__
        self.rules: Any = None  # our functional-collective rules (spmd.rules)

    def __enter__(self):
        from spmd_types._checker import typecheck
        from spmd_types._state import _push_mesh

        from .rules import rules

        resolved, names, pgs = self.entry
        _push_mesh(resolved, names, pgs, local_axes=frozenset())
        try:
            self.tc = typecheck(strict_mode="strict")
            self.tc.__enter__()
            try:
                self.rules = rules()
                self.rules.__enter__()
            except BaseException:
                self.tc.__exit__(None, None, None)
                raise
        except BaseException:
            from spmd_types._state import _pop_mesh

            _pop_mesh()
            raise
        return None

    def __exit__(self, *exc):
        from spmd_types._state import _pop_mesh

        try:
            try:
                self.rules.__exit__(*exc)
            finally:
                suppress = self.tc.__exit__(*exc)
            return suppress
        finally:
            _pop_mesh()
