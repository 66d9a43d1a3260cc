"""How a local_map call becomes a region of the graph Dynamo captures.

Under ``torch.compile`` Dynamo traces :func:`call_captured` instead of the eager
fallback.  It performs the same checks (:mod:`localmap_fx.validate`) and the
same boundary operations, but wraps every node it creates in
``torch.fx.traceback.annotate`` so that the region survives as metadata:

* ``META_SPEC`` -> the key of the region's placements (:func:`region.spec_annotation`,
  Note: [A region's spec travels as a key]), the same for every node of
  every call of one ``local_map`` function;
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
    into one shared ``invoke_subgraph`` so they are compiled once.  Only a
    *repeated* call whose first call (inline) proved it safe goes through
    ``invoke_subgraph``, so that Dynamo traces it once
    (:mod:`localmap_fx.capture.reuse`, Note: [When a call is not shared]).

Note: [spmd_types under compile]
    The spmd_types checker cannot run inside Dynamo (process groups are opaque
    there).  Capture therefore emits ``from_local`` without grad placements for
    ``spmd_types=True`` regions and marks them; the lowering pass type-checks
    the body on fake tensors at compile time and fills in the grad placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.fx.traceback import annotate

from .. import argtree, validate
from .._pytree import flatten_args, pytree, unflatten_args
from .._torch_compat import AsyncCollectiveTensor, assume_constant_result, comptime
from ..boundary import check_arg_meshes
from ..errors import compile_time
from ..region import META_INDEX, META_SPEC, ROLE_BODY, ROLE_ENTER, ROLE_EXIT, leaf_spec_key, register_spec
from ..shapes import contiguous_stride, input_shapes, output_global_shape
from .handoff import taken
from .plan import build_spec_annotation, check_meshes, plan_call, plan_outputs
from .reuse import run_body

if TYPE_CHECKING:
    from ..api import LocalMap

__all__ = ["call_captured"]

_ENTER = {**ROLE_ENTER}
_BODY = {**ROLE_BODY}
_EXIT = {**ROLE_EXIT}


def _at_compile_time(check):
    """Run ``check`` for real while Dynamo traces; errors keep their eager type."""

    def run(*args):
        try:
            return check(*args)
        except Exception as e:
            raise compile_time(e) from None

    run.__name__ = check.__name__
    run.__qualname__ = check.__qualname__
    return assume_constant_result(run)


_plan_inputs = _at_compile_time(validate.plan_inputs)
_plan_nested_inputs = _at_compile_time(validate.plan_nested_inputs)
_check_outputs = _at_compile_time(validate.check_outputs)
_check_arg_mesh = _at_compile_time(validate.check_arg_mesh)
# registering is Python state Dynamo does not trace (Note: [A region's spec travels as a key])
_leaf_spec_key = assume_constant_result(leaf_spec_key)
traced_register_spec = assume_constant_result(register_spec)


@assume_constant_result
def _depends_on(config_text: str | None) -> None:
    """Nothing: what the traced code passes here, Dynamo guards by value.

    Note: [A call's plan depends on its local_map]
        The plan and the annotation a call gets at trace time (``comptime``,
        in real Python) come from the ``local_map``'s placements and flags,
        which Dynamo sees only where traced code reads them.  Unread, a
        compiled block was reused for another instance whose ``local_map``
        differs (``block.compile`` on each block; a stamped
        ``nested_compile_region`` call), with the first one's plan: wrong
        placements, or a ``spmd_types`` region never checked.  The traced
        code reads them as one string built with the object
        (``LocalMap.config_text``, their repr), so one guard compares it and
        instances configured alike still share the compiled code.  Read one
        by one (placements compared by equality) they were 27 more sources
        per TP block for the reuse check of each stamped call: Dynamo's
        trace of the marked 64-layer stack 0.68 -> 0.82 CPU s, against
        0.69 with the string (0.68 with no guard).
    """


def _check_meshes(lm: LocalMap, flat_args: list) -> None:
    """Every DTensor argument on ``device_mesh`` (validate.check_arg_mesh).

    Checked at trace time on the fake values, so no graph node reads a mesh;
    only a ``local_map`` built in the traced code (no real object to read
    ``device_mesh`` from) is checked by traced code.
    """
    comptime(check_meshes)  # reads the locals ``lm`` and ``flat_args``
    if taken() == "traced":
        check_arg_meshes(flat_args, lm.device_mesh, _check_arg_mesh)


def call_captured(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    _depends_on(lm.config_text)  # Note: [A call's plan depends on its local_map]
    if not kwargs:
        # the common call is planned in real Python (localmap_fx.capture.plan)
        comptime(plan_call)
        plan = taken()
        if plan is not None:
            return _call_planned(lm, args, plan)
    return _call_traced(lm, args, kwargs)


def _call_planned(lm: LocalMap, args: tuple, plan: tuple) -> Any:
    """A flat call planned by comptime: Dynamo traces only the boundary ops.

    Every instruction here is traced per call (Note: [Why the planned path is
    short] in :mod:`localmap_fx.capture.plan`): no helpers, one ``annotate``
    per node group, the annotations built once per ``LocalMap``.
    """
    enters, body_annotation, spec, mesh_from = plan
    if body_annotation is None:
        # torch runs the function untouched when no DTensor is given: no region.
        return lm.func(*args)
    mesh = lm.device_mesh if mesh_from is None else args[mesh_from].device_mesh
    flat_local = []
    for arg, step in zip(args, enters):
        if step is None:
            flat_local.append(arg)
            continue
        target, grad, annotation = step
        with annotate(annotation):
            if target is not None:
                arg = arg.redistribute(placements=target)
            local = arg.to_local() if grad is None else arg.to_local(grad_placements=grad)
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
        flat_local.append(local)
    with annotate(body_annotation):
        # repeated calls of one region key are traced once (localmap_fx.capture.reuse)
        out = run_body(lm.func, tuple(flat_local), {}, spec, mesh)
    comptime(plan_outputs)
    exits = taken()
    if exits is None or exits[0] is None:
        # outputs not planned: the traced exit, with the call's annotation
        # (None: this runs as Python after a graph break, and reads the object)
        annotation = exits[1] if exits is not None and exits[1] is not None else lm.built_spec_annotation()
        return _exit_traced(lm, annotation, out, mesh, input_shapes(args, enters, flat_local))
    single, exits = exits
    outs = (out,) if single else out
    flat_dist = []
    for o, (placements, shape, stride, annotation) in zip(outs, exits):
        with annotate(annotation):
            if shape is None:
                dt = DTensor.from_local(o, mesh, placements, run_check=False)
            else:
                dt = DTensor.from_local(o, mesh, placements, run_check=False, shape=shape, stride=stride)
        flat_dist.append(dt)
    return flat_dist[0] if single else tuple(flat_dist)


def _call_traced(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    """Every other call: Dynamo traces the checks and the bookkeeping."""
    comptime(build_spec_annotation)  # reads the local ``lm``
    base = taken()  # Note: [The annotation enters the trace as a constant] (capture/plan.py)
    if base is None:
        # a local_map built in the traced code (its annotation built there), or Python
        base = lm.built_spec_annotation()
    flat_args, args_spec = flatten_args(args)
    nested = argtree.wants_nested(lm.in_placements, len(flat_args), len(args))
    if nested:
        # in_placements mirrors the arguments (or names them): own flattening
        flat_args, paths, n_positional, kw_tree = argtree.flatten_call(lm.in_placements, args, kwargs)
        _check_meshes(lm, flat_args)
        plan, flat_specs, flat_grads = _plan_nested_inputs(
            tuple(validate.describe_traced(a) for a in flat_args),
            paths,
            lm.in_placements,
            lm.in_grad_placements,
            lm.redistribute_inputs,
            lm.param_names,
        )
        # the region records the placements per flattened leaf
        annotation = {META_SPEC: _leaf_spec_key(base[META_SPEC], flat_specs, flat_grads)}
    else:
        annotation = base
        _check_meshes(lm, flat_args)
        plan = _plan_inputs(
            tuple(validate.describe_traced(a) for a in flat_args),
            lm.in_placements,
            lm.in_grad_placements,
            lm.redistribute_inputs,
        )

    mesh = lm.device_mesh
    seen_dtensor = False
    flat_local: list = []
    for idx, (arg, step) in enumerate(zip(flat_args, plan)):
        if step is None:
            flat_local.append(arg)
            continue
        if mesh is None:
            mesh = arg.device_mesh
        seen_dtensor = True
        flat_local.append(_enter(arg, step, annotation, idx))

    if nested:
        local_args = argtree.unflatten(args, flat_local[:n_positional])
        kwargs = {**kwargs, **argtree.unflatten(kw_tree, flat_local[n_positional:])}
    else:
        local_args = unflatten_args(flat_local, args_spec)
    if not seen_dtensor:
        # torch runs the function untouched when no DTensor is given: no region.
        return lm.func(*local_args, **kwargs)

    with annotate(annotation), annotate(_BODY):
        # repeated calls of one region key are traced once (localmap_fx.capture.reuse)
        out = run_body(lm.func, local_args, kwargs, annotation[META_SPEC], mesh)
    return _exit_traced(lm, annotation, out, mesh, input_shapes(flat_args, plan, flat_local))


def _enter(arg: DTensor, step: tuple, annotation: dict, idx: int) -> torch.Tensor:
    """Redistribute (if planned) and take the local tensor of argument ``idx``."""
    target, grad = step
    with annotate(annotation), annotate(_ENTER), annotate({META_INDEX: idx}):
        if target is not None:
            arg = arg.redistribute(placements=target)
        local = arg.to_local(grad_placements=grad) if grad is not None else arg.to_local()
        if isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
    return local


def _exit(o: torch.Tensor, mesh: Any, spec: Any, shape: tuple, uneven: bool, annotation: dict, idx: int) -> DTensor:
    """Output ``idx`` as a DTensor; uneven shards need their global shape."""
    with annotate(annotation), annotate(_EXIT), annotate({META_INDEX: idx}):
        if uneven:
            dt = DTensor.from_local(o, mesh, spec, run_check=False, shape=shape, stride=contiguous_stride(shape))  # type: ignore[arg-type]
        else:
            dt = DTensor.from_local(o, mesh, spec, run_check=False)
    return dt


def _exit_traced(lm: LocalMap, annotation: dict, out: Any, mesh: Any, in_shapes: list) -> Any:
    flat_out, out_spec = pytree.tree_flatten(out)
    out_specs = lm.out_specs
    _check_outputs(tuple(validate.describe_traced(o) for o in flat_out), out_specs, mesh.ndim)
    flat_dist = []
    for idx, (o, spec) in enumerate(zip(flat_out, out_specs)):
        if isinstance(o, torch.Tensor):
            shape, uneven = output_global_shape(tuple(o.shape), tuple(spec), tuple(mesh.shape), in_shapes)
            flat_dist.append(_exit(o, mesh, spec, shape, uneven, annotation, idx))
        else:
            flat_dist.append(o)
    return pytree.tree_unflatten(flat_dist, out_spec)


# Note: [A frame that starts at a local_map call] (api.py): called from
# LocalMap.__call__ when that frame graph-breaks; disabled, so Dynamo guards
# the frame on the body only and runs the call in eager.
@torch.compiler.disable(reason="a local_map frame with pinned or symbolic arguments runs in eager")
def leave_frame(func: Callable) -> None:
    pass


@torch.compiler.disable(reason="a local_map frame with pinned or symbolic arguments runs in eager")
def call_outside_dynamo(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    return lm(*args, **kwargs)
