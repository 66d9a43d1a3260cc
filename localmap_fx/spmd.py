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
Replicate, ``V`` -> Shard (dim taken from out_placements).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

import spmd_types as spmd

__all__ = [
    "placements_to_spmd_type",
    "annotate_inputs",
    "checking",
    "out_grad_placements",
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
) -> dict:
    """{MeshAxis: local type} for one input, validating its grad pair."""
    result = {}
    for dim, placement in enumerate(placements):
        axis = _axis(mesh, dim)
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
    """Strict SPMD type checking of everything run inside, on ``mesh``."""
    from spmd_types._checker import typecheck

    with spmd.set_current_mesh(mesh), typecheck(strict_mode="strict"):
        yield


def out_grad_placements(
    flat_out: Sequence[Any], out_specs: tuple, mesh: DeviceMesh
) -> tuple:
    """Validate the body's output types; return each output's grad placements."""
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
            axis = _axis(mesh, dim)
            actual = actual_type.get(axis)
            if actual is None:
                names = (
                    tuple(range(mesh.ndim))
                    if mesh.mesh_dim_names is None
                    else mesh.mesh_dim_names
                )
                annotated = [
                    names[i] for i in range(mesh.ndim) if _axis(mesh, i) in actual_type
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
        grad_spec = []
        for dim, placement in enumerate(spec):
            t = actual_type[_axis(mesh, dim)]
            if t == spmd.V and type(placement) is Partial:
                grad_spec.append(Replicate())
            else:
                g = _compatible_placement(t.backward_type(), placement)
                if g is None:
                    raise AssertionError("expected grad_placement to be not None")
                grad_spec.append(g)
        grads.append(tuple(grad_spec))
    return tuple(grads)
