"""How a local_map call becomes a region of the graph Dynamo captures.

Under ``torch.compile`` Dynamo traces :func:`call_captured` instead of the eager
fallback.  It performs the same checks (:mod:`localmap_fx.validate`) and the
same boundary operations, but wraps every node it creates in
``torch.fx.traceback.annotate`` so that the region survives as metadata:

* ``META_SPEC`` -> the region's placements (:func:`region.spec_annotation`),
  the same object for every node of every call of one ``local_map`` function;
* ``META_ROLE`` -> ``"enter"`` (redistribute / to_local of argument ``i``),
  ``"body"`` (the user's function, traced at local shapes) or ``"exit"``
  (from_local of output ``j``);
* ``META_INDEX`` -> ``i`` or ``j`` on enter / exit nodes.

Note: [Why capture inlines the body instead of using invoke_subgraph]
    ``nested_compile_region`` around the body keeps a subgraph through Dynamo,
    but Dynamo inlines single-use regions before any backend sees them,
    rejects tied inputs and bodies that return an input, and cannot graph
    break inside.  Tracing the body inline and marking its nodes has none of
    those limits; :func:`localmap_fx.find_regions` groups the marked nodes
    back into regions, and the ``outline_regions`` pass turns repeated bodies
    into one shared ``invoke_subgraph`` so they are compiled once.

Note: [spmd_types under compile]
    The spmd_types checker cannot run inside Dynamo (process groups are opaque
    there).  Capture therefore emits ``from_local`` without grad placements for
    ``spmd_types=True`` regions and marks them; the lowering pass type-checks
    the body on fake tensors at compile time and fills in the grad placements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.fx.traceback import annotate

from . import validate
from ._pytree import flatten_args, pytree, unflatten_args
from .region import ROLE_BODY, ROLE_ENTER, ROLE_EXIT, META_INDEX

if TYPE_CHECKING:
    from .api import LocalMap

__all__ = ["call_captured"]

_ENTER = {**ROLE_ENTER}
_BODY = {**ROLE_BODY}
_EXIT = {**ROLE_EXIT}


def call_captured(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
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
            with annotate(lm.spec_annotation), annotate(_ENTER), annotate({META_INDEX: idx}):
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
    if not seen_dtensor:
        # torch runs the function untouched when no DTensor is given: no region.
        return lm.func(*local_args, **kwargs)

    with annotate(lm.spec_annotation), annotate(_BODY):
        out = lm.func(*local_args, **kwargs)

    flat_out, out_spec = pytree.tree_flatten(out)
    out_specs = lm.out_specs
    validate.check_out_count(len(flat_out), out_specs)
    flat_dist = []
    for idx, (o, spec) in enumerate(zip(flat_out, out_specs)):
        validate.check_output_value(o, idx, spec)
        if isinstance(o, torch.Tensor):
            with annotate(lm.spec_annotation), annotate(_EXIT), annotate({META_INDEX: idx}):
                flat_dist.append(DTensor.from_local(o, mesh, spec, run_check=False))
        else:
            flat_dist.append(o)
    return pytree.tree_unflatten(flat_dist, out_spec)
