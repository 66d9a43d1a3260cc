"""The eager fallback: local_map run op by op, exactly as torch 2.14.1 does.

The order of checks and conversions is torch's (per argument: check, then
redistribute, then ``to_local``), so that a bad call raises the same error at
the same point, and every collective happens in the same order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from . import validate
from ._pytree import flatten_args, pytree, unflatten_args

if TYPE_CHECKING:
    from .api import LocalMap

__all__ = ["call_eager", "wrap_outputs"]


def call_eager(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    flat_args, args_spec = flatten_args(args)
    in_specs = lm.in_placements
    in_grads = lm.in_grad_placements
    validate.check_in_count(in_specs, len(flat_args))

    mesh = lm.device_mesh
    seen_dtensor = False
    flat_local: list = []
    for idx, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            if mesh is None:
                mesh = arg.device_mesh
            seen_dtensor = True
            if in_specs is not None:
                spec = in_specs[idx]
                if validate.check_dtensor_in_spec(arg, idx, spec, lm.redistribute_inputs):
                    arg = arg.redistribute(placements=validate.as_placements(spec))
            if in_grads is not None:
                grad = validate.check_dtensor_grad_spec(arg, idx, in_grads[idx])
                local = arg.to_local(grad_placements=grad)
            else:
                local = arg.to_local()
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
            flat_local.append(local)
        else:
            if in_specs is not None and not isinstance(arg, torch.Tensor):
                validate.check_non_tensor_input(arg, idx, in_specs[idx])
            flat_local.append(arg)

    local_args = unflatten_args(flat_local, args_spec)

    if lm.spmd_types and seen_dtensor:
        validate.check_spmd_types_available()
        from . import spmd

        spmd.annotate_inputs(flat_local, in_specs, in_grads, mesh)
        with spmd.checking(mesh):
            out = lm.func(*local_args, **kwargs)
    else:
        out = lm.func(*local_args, **kwargs)

    if not seen_dtensor:
        return out
    return wrap_outputs(lm, out, mesh)


def wrap_outputs(lm: LocalMap, out: Any, mesh) -> Any:
    """Turn the body's local outputs into DTensors placed per out_placements."""
    flat_out, out_spec = pytree.tree_flatten(out)
    out_specs = lm.out_specs
    validate.check_out_count(len(flat_out), out_specs)

    grad_specs = None
    if lm.spmd_types:
        from . import spmd

        grad_specs = spmd.out_grad_placements(flat_out, out_specs, mesh)

    flat_dist = []
    for idx, (o, spec) in enumerate(zip(flat_out, out_specs)):
        validate.check_output_value(o, idx, spec)
        if isinstance(o, torch.Tensor):
            flat_dist.append(
                DTensor.from_local(
                    o,
                    mesh,
                    spec,
                    run_check=False,
                    grad_placements=None if grad_specs is None else grad_specs[idx],
                )
            )
        else:
            flat_dist.append(o)
    return pytree.tree_unflatten(flat_dist, out_spec)
