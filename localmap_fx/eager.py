"""The eager fallback: local_map run op by op, exactly as torch 2.14.1 does.

The order of checks and conversions is torch's (per argument: check, then
redistribute, then ``to_local``), so that a bad call raises the same error at
the same point, and every collective happens in the same order.

Note: [Eager fast path]
    A local_map call is mostly DTensor bookkeeping (``to_local`` and
    ``from_local`` are autograd Functions), so Python overhead around it is a
    visible share of every call.  What can be decided once per ``local_map``
    function is decided once, in :class:`EagerPlan`: placement specs as
    tuples, which outputs may skip ``DTensor.from_local``'s argument
    normalisation, and (``spmd_types=True``) the SPMD types of the inputs and
    the mesh the checker runs under.  Per call:

    * arguments and outputs that are plain tensors or flat tuples/lists of
      them are not run through pytree;
    * a plain ``DTensor`` argument is unwrapped by calling the autograd
      Function that ``DTensor.to_local`` calls (``_ToTorchTensor``), and a
      tensor output is wrapped by calling the one ``DTensor.from_local``
      calls (``_FromTorchTensor``), with the arguments those methods would
      have passed.  Whenever the method would do anything else (a
      ``Parameter`` DTensor, a DTensor subclass, an output on another device,
      a negative ``Shard`` dim, a spec that is not a tuple of placements, an
      invalid spec that must raise) the public method is called instead.

    Results, autograd graphs (same ``grad_fn`` types) and errors are therefore
    those of torch's ``local_map``; ``tests/unit/test_eager_parity.py`` checks it.
    Specs are read when ``local_map`` is applied: changing the lists passed
    as ``in_placements``/``out_placements`` afterwards is not supported.

    A repeated call pays only for what can change between calls.  The first
    call of a layout runs :func:`call_eager` (every check, in torch's order)
    and, when its arguments are flat and every DTensor among them is a plain,
    evenly sharded one already placed as in_placements asks, keeps a
    :class:`CallLayout` (the last 8 layouts are kept, so that a function
    called with a few layouts in turn takes the fast path for each): per argument the mesh, placements, tensor meta and
    the gradient placements its ``to_local`` gets (the arguments of the
    call's :class:`localmap_fx.boundary.BoundaryPlan`).  ``LocalMap.__call__``
    then runs :func:`call_fast`, which compares each argument with it (type,
    Parameter or not, mesh by identity, placements, tensor meta), reads grad
    mode, and calls the two autograd Functions; ``from_local`` is given the
    global shape and stride it would compute itself
    (``compute_global_tensor_info``), kept per layout and output and reused while the
    local shape and stride are the same.  The body and the SPMD checks
    (``spmd_types=True``: ``assert_type`` on each input, the checker, the
    outputs' types) run on every call.  An argument that differs returns
    :data:`MISS` before anything is done, and the next layout is tried, then
    the full path; outputs that differ from the ones seen with the layout
    are wrapped by :func:`wrap_outputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import ref as _weakref

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from . import validate
from ._pytree import _LEAF_TYPES, flatten_args, pytree, unflatten_args
from ._torch_compat import (
    AsyncCollectiveTensor,
    FromTorchTensor,
    StridedShard,
    ToTorchTensor,
    assert_no_mixed_partial_types,
    compute_global_tensor_info,
)
from .boundary import ArgBoundary, BoundaryPlan, input_grad
from .meshcache import MeshCache
from .shapes import contiguous_stride, output_global_shape

if TYPE_CHECKING:
    from .api import LocalMap

__all__ = ["EagerPlan", "CallLayout", "MISS", "call_eager", "call_fast", "wrap_outputs"]

_Tensor = torch.Tensor
_Size = torch.Size
_is_grad_enabled = torch.is_grad_enabled
_to_local_fn = ToTorchTensor.apply
_from_local_fn = FromTorchTensor.apply
_from_local = DTensor.from_local


def _as_tuple_spec(spec: Any) -> Any:
    """A list/tuple spec as the tuple torch compares with; anything else as given."""
    if type(spec) is tuple or type(spec) is list:
        return tuple(spec)
    return spec


def _from_local_ready(spec: Any) -> tuple | None:
    """``spec`` as ``DTensor.from_local`` would pass it on, or None.

    None means: call ``DTensor.from_local`` itself (it normalises or rejects
    the spec, or would default it).
    """
    if not (type(spec) is tuple or type(spec) is list) or not spec:
        return None
    for p in spec:
        if not isinstance(p, Placement):
            return None
        if isinstance(p, (Shard, StridedShard)) and p.dim < 0:
            return None
    spec = tuple(spec)
    try:
        assert_no_mixed_partial_types(spec)
    except Exception:  # noqa: BLE001 - from_local raises it at call time
        return None
    return spec


class EagerPlan:
    """What the eager path decides once per ``local_map`` function."""

    __slots__ = (
        "in_specs", "in_grads", "out_specs", "out_ready", "spmd_cache", "known_layouts", "grad_fits", "out_fits",
        "layouts", "out_shapes",
    )

    def __init__(self, lm: LocalMap) -> None:
        ins, grads = lm.in_placements, lm.in_grad_placements
        # Only real lists/tuples are snapshotted; other sequences are read at
        # call time, as torch reads them.
        self.in_specs = (
            tuple(_as_tuple_spec(s) for s in ins) if type(ins) in (tuple, list) else ins
        )
        self.in_grads = (
            tuple(_as_tuple_spec(s) for s in grads) if type(grads) in (tuple, list) else grads
        )
        self.out_specs = lm.out_specs
        self.out_ready = tuple(_from_local_ready(s) for s in lm.out_specs)
        # spmd_types=True: {mesh: SpmdPlan}, the mesh held weakly (see
        # Note: [Caches keyed on a mesh])
        self.spmd_cache = MeshCache()
        # {argument index: the DTensorSpec object of the last argument that
        # passed the per-layout checks and was evenly sharded}.  DTensor never
        # mutates a spec in place (in-place ops assign a new one), so the same
        # object means the same layout: the checks would pass again.
        # (held weakly: a DTensorSpec holds its mesh; Note: [Caches keyed on a mesh])
        self.known_layouts: dict = {}
        # (index, mesh ndim, tensor ndim) of the arguments' in_grad_placements
        # and (index, mesh ndim) of the outputs' out_placements that passed
        # their placement checks
        self.grad_fits: set[tuple[int, int, int]] = set()
        self.out_fits: set[tuple[int, int]] = set()
        # the call layouts the fast path takes, most recent first, at most
        # _MAX_LAYOUTS (Note: [Eager fast path])
        self.layouts: list[CallLayout] = []
        # {output index: (mesh, local shape, local stride, global shape,
        # global stride)} of its last from_local on the full path (see
        # _global_info); the mesh held weakly
        self.out_shapes: dict[int, tuple] = {}

    def spmd_plan(self, lm: LocalMap, mesh):
        """The cached :class:`localmap_fx.spmd.types.SpmdPlan` for ``mesh``."""
        plan = self.spmd_cache.get(mesh)
        if plan is not None:
            return plan
        from .spmd import types as spmd

        return self.spmd_cache.set(mesh, spmd.SpmdPlan(mesh))


def _plan(lm: LocalMap) -> EagerPlan:
    plan = lm._eager_plan
    if plan is None:
        plan = lm._eager_plan = EagerPlan(lm)
    return plan


def _later_dtensors(flat_args: list, specs: Any, idx: int):
    """``(index, spec, mesh ndim, ndim)`` of the DTensor arguments after ``idx``
    (what validate's errors list besides the first offender)."""
    for j in range(idx + 1, len(flat_args)):
        a = flat_args[j]
        if isinstance(a, DTensor):
            yield j, specs[j], len(a.placements), a.ndim


def _redistribute_checked(arg: DTensor, idx: int, spec: Any, later) -> DTensor:
    """``arg.redistribute(spec)``; torch's errors get a hint naming in_placements[idx]."""
    target = validate.as_placements(spec)
    validate.check_redistribute_target_length(target, idx, len(arg.placements), later)
    try:
        return arg.redistribute(placements=target)
    except (IndexError, AssertionError, AttributeError, TypeError, RuntimeError, ValueError) as e:
        raise validate.with_hint(
            e,
            f"in_placements[{idx}] = {spec!r}: redistribute_inputs=True moves args "
            f"leaf {idx} to these placements; give one valid Placement per mesh "
            f"dimension ({len(arg.placements)}).",
        ) from None


def _check_grad_once(plan: EagerPlan, idx: int, grad: Any, arg: DTensor, flat_args: list) -> None:
    """validate.check_grad_spec_fits, once per function, argument and layout."""
    key = (idx, len(arg.placements), arg.ndim)
    seen = plan.grad_fits
    if key not in seen:
        later = _later_dtensors(flat_args, plan.in_grads, idx)
        validate.check_grad_spec_fits(grad, idx, len(arg.placements), arg.ndim, later)
        seen.add(key)


def _check_out_once(plan: EagerPlan, idx: int, spec: Any, mesh, flat_out: list) -> None:
    """validate.check_out_spec_fits, once per function, output and layout."""
    key = (idx, mesh.ndim)
    seen = plan.out_fits
    if key not in seen:
        later = _later_tensor_outputs(flat_out, plan.out_specs, idx)
        validate.check_out_spec_fits(spec, idx, mesh.ndim, later)
        seen.add(key)


def _later_tensor_outputs(flat_out: list, out_specs: tuple, idx: int):
    """``(index, spec)`` of the plain tensor outputs after ``idx``."""
    for j in range(idx + 1, len(flat_out)):
        o = flat_out[j]
        if isinstance(o, _Tensor) and not isinstance(o, DTensor):
            yield j, out_specs[j]


def _out_hint(e: BaseException, idx: int, spec: Any, out: torch.Tensor, mesh) -> BaseException:
    return validate.with_hint(
        e,
        f"out_placements[{idx}] = {spec!r}: give one Placement per mesh "
        f"dimension ({mesh.ndim}) for this {out.ndim}-d output.",
    )


def _unevenly_sharded(arg: DTensor) -> bool:
    shape = arg.shape
    for k, p in enumerate(arg.placements):
        if isinstance(p, Shard) and shape[p.dim] % arg.device_mesh.size(k):
            return True
    return False


class CallLayout:
    """A call layout the fast path can take again (Note: [Eager fast path]).

    ``steps`` has per args leaf ``(mesh, placements, tensor meta, grad)``
    for a DTensor argument (the mesh held weakly), ``grad`` being what its
    ``to_local`` is given, and ``(None, tensor_only, None, None)`` for an
    argument passed through, ``tensor_only`` saying whether it must be a
    tensor (its in_placements entry is not None).  ``boundary`` is the call's
    :class:`localmap_fx.boundary.BoundaryPlan` (arguments only: outputs are
    known after the body).  ``outs`` are the outputs' global shapes and
    strides (as :attr:`EagerPlan.out_shapes`) seen with this layout.
    """

    __slots__ = ("steps", "mesh", "cpu", "boundary", "outs")

    def __init__(self, steps: tuple, mesh: Any, boundary: BoundaryPlan, outs: dict[int, tuple]) -> None:
        self.steps = steps
        self.mesh = _weakref(mesh)  # Note: [Caches keyed on a mesh]
        self.cpu = mesh.device_type == "cpu"
        self.boundary = boundary
        # the outputs' global shapes and strides, as EagerPlan.out_shapes,
        # for the calls of this layout
        self.outs = outs


MISS = object()
_MAX_LAYOUTS = 8


def call_fast(lm: LocalMap, plan: EagerPlan, lay: CallLayout, args: tuple, kwargs: dict) -> Any:
    """The call, if its arguments have ``lay``'s layout; else ``MISS`` (nothing done).

    Per call only what the decisions depend on is compared: each argument's
    type, mesh (by identity), placements and tensor meta (global shape,
    stride, dtype: the mesh check, the placement and gradient checks and
    evenness depend on nothing else),
    whether it is a Parameter, and grad mode.
    """
    steps = lay.steps
    if len(args) != len(steps):
        return MISS
    for a, (on, placements, meta, _) in zip(args, steps):
        if on is None:
            t = type(a)
            if isinstance(a, DTensor) or (t not in _LEAF_TYPES and not isinstance(a, _Tensor)):
                return MISS  # a DTensor, or a container pytree would flatten
            if placements and not isinstance(a, _Tensor):  # placements: tensor_only
                return MISS  # raises on the full path
        elif type(a) is DTensor and not getattr(a, "_is_param", False):
            spec = a._spec
            if spec.mesh is not on() or spec.placements != placements or spec.tensor_meta != meta:
                return MISS
        else:
            return MISS
    mesh = lay.mesh()
    if mesh is None:
        return MISS
    grad_enabled = _is_grad_enabled()
    flat_local = []
    for a, (on, _, _, grad) in zip(args, steps):
        if on is None:
            flat_local.append(a)
            continue
        local = _to_local_fn(a, grad) if grad_enabled else a._local_tensor
        if type(local) is not _Tensor and isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
        flat_local.append(local)
    out = _run_body(lm, plan, flat_local, tuple(flat_local), kwargs, mesh)
    dist = _wrap_fast(lm, plan, lay, out, mesh)
    if dist is MISS:
        dist = wrap_outputs(lm, out, mesh)
        lay.outs.update(plan.out_shapes)
    return dist


def _wrap_fast(lm: LocalMap, plan: EagerPlan, lay: CallLayout, out: Any, mesh: Any) -> Any:
    """:func:`wrap_outputs` for outputs seen before (same count, shapes,
    strides, device): ``MISS`` for anything else, before any output is wrapped."""
    t = type(out)
    if t is _Tensor:
        # one tensor output: the common case, without lists
        info = lay.outs.get(0)
        if (
            info is None
            or len(plan.out_specs) != 1
            or info[0]() is not mesh
            or not (out.is_cpu if lay.cpu else out.device.type == mesh.device_type)
            or out.shape != info[1]
            or out.stride() != info[2]
        ):
            return MISS
        grad = _out_grads(lm, plan, [out], mesh)[0] if lm.spmd_types else None
        return _from_local_fn(out, mesh, plan.out_ready[0], False, info[3], info[4], grad)
    if t is not tuple or len(out) != len(plan.out_specs):
        return MISS
    shapes = lay.outs
    infos = []
    for idx, o in enumerate(out):
        info = shapes.get(idx)
        if (
            info is None
            or type(o) is not _Tensor
            or info[0]() is not mesh
            or not (o.is_cpu if lay.cpu else o.device.type == mesh.device_type)
            or o.shape != info[1]
            or o.stride() != info[2]
        ):
            return MISS
        infos.append(info)
    grads = _out_grads(lm, plan, list(out), mesh) if lm.spmd_types else None
    ready = plan.out_ready
    flat_dist = []
    for idx, (o, info) in enumerate(zip(out, infos)):
        grad = None if grads is None else grads[idx]
        flat_dist.append(
            _from_local_fn(o, mesh, ready[idx], False, info[3], info[4], tuple(grad) if grad is not None else None)
        )
    return tuple(flat_dist)


def _global_info(plan: EagerPlan, idx: int, o: torch.Tensor, mesh: Any, placements: tuple) -> tuple:
    """``(global shape, global stride)`` of output ``idx`` as ``from_local``
    would compute them (``compute_global_tensor_info``), kept for the next
    call with the same local shape and stride."""
    info = plan.out_shapes.get(idx)
    shape, stride = o.shape, o.stride()
    if info is None or info[0]() is not mesh or info[1] != shape or info[2] != stride:
        gshape, gstride = compute_global_tensor_info(o, mesh, list(placements))
        info = (_weakref(mesh), shape, stride, _Size(gshape), tuple(gstride))
        plan.out_shapes[idx] = info
    return info[3], info[4]


def _run_body(lm: LocalMap, plan: EagerPlan, flat_local: list, local_args: Any, kwargs: dict, mesh: Any) -> Any:
    """The user's function on the local tensors (under the SPMD checker when asked)."""
    if not lm.spmd_types:
        return lm.func(*local_args, **kwargs)
    from .spmd import types as spmd  # imported with spmd_types only when used

    splan = plan.spmd_plan(lm, mesh)
    try:
        splan.annotate_inputs(flat_local, plan.in_specs, plan.in_grads)
    except ValueError as e:
        raise spmd.explain(e, mesh) from None
    if lm.spmd_types == "global":
        from .spmd.global_check import run_eager

        return run_eager(lm.func, local_args, kwargs, flat_local, plan.in_specs, plan.out_specs, mesh, splan.checking)
    try:
        with splan.checking():
            return lm.func(*local_args, **kwargs)
    except spmd.spmd.SpmdTypeError as e:
        raise spmd.explain(e, mesh) from None


def _out_grads(lm: LocalMap, plan: EagerPlan, flat_out: list, mesh: Any) -> tuple:
    """spmd_types=True: each output's gradient placements, from its SPMD type."""
    try:
        return plan.spmd_plan(lm, mesh).out_grad_placements(flat_out, plan.out_specs)
    except ValueError as e:
        from .spmd import types as spmd

        raise spmd.explain(e, mesh) from None


def call_eager(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    plan = lm._eager_plan or _plan(lm)
    flat_args, args_spec = flatten_args(args)
    in_specs = plan.in_specs
    in_grads = plan.in_grads
    if in_specs is not None and len(in_specs) != len(flat_args):
        validate.check_in_count(in_specs, len(flat_args))
    if in_grads is not None and len(in_grads) != len(flat_args):
        validate.check_grad_count(in_grads, len(flat_args))

    mesh = lm.device_mesh
    seen_dtensor = False
    grad_enabled = _is_grad_enabled()
    flat_local: list = []
    uneven_in: list = []  # see localmap_fx/shapes.py
    # the fast path can take this layout again: flat arguments, every DTensor
    # a plain, evenly sharded one already placed as in_placements asks
    reusable = args_spec is None and lm.spmd_types != "global" and (
        in_specs is None or type(in_specs) is tuple) and (in_grads is None or type(in_grads) is tuple)
    steps: list = []
    bounds: list[ArgBoundary] = []
    for idx, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            if mesh is None:
                mesh = arg.device_mesh
            elif lm.device_mesh is not None and arg.device_mesh is not mesh:
                validate.check_arg_mesh(arg.device_mesh, mesh, idx)
            seen_dtensor = True
            source = arg.placements
            target = None
            if in_specs is not None:
                spec = in_specs[idx]
                if type(spec) is not tuple or arg.placements != spec:
                    # None, a non-sequence, or a mismatch: validate raises
                    # torch's error or asks for a redistribution.
                    reusable = False
                    if validate.check_dtensor_in_spec(arg, idx, spec, lm.redistribute_inputs):
                        target = validate.as_placements(spec)
                        arg = _redistribute_checked(arg, idx, spec, _later_dtensors(flat_args, in_specs, idx))
            layout = arg._spec
            ref = plan.known_layouts.get(idx)
            known = ref is not None and ref() is layout
            given = None
            if in_grads is not None:
                given = in_grads[idx]
                if type(given) is not tuple:
                    reusable = False
                    given = validate.check_dtensor_grad_spec(arg, idx, given)
                if not known:
                    _check_grad_once(plan, idx, given, arg, flat_args)
            grad = input_grad(arg.placements, given, bool(lm.spmd_types))
            # arg.to_local(grad_placements=grad), see Note: [Eager fast path]
            if type(arg) is DTensor and not getattr(arg, "_is_param", False):
                local = _to_local_fn(arg, grad) if grad_enabled else arg._local_tensor
            else:
                reusable = False
                local = arg.to_local() if grad is None else arg.to_local(grad_placements=grad)
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
            if not known:
                if _unevenly_sharded(arg):
                    reusable = False
                    uneven_in.append((arg.placements, tuple(arg.shape), tuple(local.shape)))
                else:
                    plan.known_layouts[idx] = _weakref(layout)
            if reusable:
                steps.append((_weakref(arg.device_mesh), arg.placements, layout.tensor_meta, grad))
                bounds.append(ArgBoundary(idx, source, target, grad))
            flat_local.append(local)
        else:
            if in_specs is not None and not isinstance(arg, _Tensor):
                # the error prints the entry as the user wrote it
                validate.check_non_tensor_input(arg, idx, lm.in_placements[idx])
            steps.append((None, in_specs is not None and in_specs[idx] is not None, None, None))
            flat_local.append(arg)

    local_args = tuple(flat_local) if args_spec is None else unflatten_args(flat_local, args_spec)

    if not seen_dtensor:
        # torch runs the function untouched when no DTensor is given: no region.
        return lm.func(*local_args, **kwargs)
    if lm.spmd_types:
        validate.check_spmd_types_available()
    out = _run_body(lm, plan, flat_local, local_args, kwargs, mesh)
    dist = wrap_outputs(lm, out, mesh, uneven_in)
    if reusable:
        lay = CallLayout(tuple(steps), mesh, BoundaryPlan(tuple(bounds)), dict(plan.out_shapes))
        plan.layouts = [lay, *plan.layouts[: _MAX_LAYOUTS - 1]]
    return dist


def _flatten_out(out: Any) -> tuple[list, Any]:
    """(leaves, spec); spec is a type (tuple/list) or None for fast shapes."""
    t = type(out)
    if t is DTensor or not isinstance(out, _Tensor):
        if (t is tuple or t is list) and all(
            type(o) is not DTensor and isinstance(o, _Tensor) for o in out
        ):
            return list(out), t
        return pytree.tree_flatten(out)
    return [out], None


def wrap_outputs(lm: LocalMap, out: Any, mesh, uneven_in: list | None = None) -> Any:
    """Turn the body's local outputs into DTensors placed per out_placements."""
    plan = lm._eager_plan or _plan(lm)
    if type(out) is _Tensor:
        flat_out, out_spec = [out], None
    else:
        flat_out, out_spec = _flatten_out(out)
    out_specs = plan.out_specs
    if len(flat_out) != len(out_specs):
        validate.check_out_count(len(flat_out), out_specs)

    for o in flat_out:
        if isinstance(o, AsyncCollectiveTensor):
            # A collective's result returned as is: wait for it now, so that
            # an output nobody reads (or one rejected below) leaves no
            # unwaited work behind (torch warns "there are still N unwaited
            # collective calls" at exit).  The wrapper stays: wait() marks it
            # completed.
            o.wait()

    grad_specs = _out_grads(lm, plan, flat_out, mesh) if lm.spmd_types else None

    ready = plan.out_ready
    device_type = mesh.device_type
    flat_dist = []
    for idx, o in enumerate(flat_out):
        spec = out_specs[idx]
        if isinstance(o, DTensor) or not isinstance(o, _Tensor):
            validate.check_output_value(o, idx, spec)
        if isinstance(o, _Tensor):
            _check_out_once(plan, idx, spec, mesh, flat_out)
            grad = None if grad_specs is None else grad_specs[idx]
            placements = ready[idx]
            if uneven_in:
                shape, uneven = output_global_shape(
                    tuple(o.shape), tuple(spec), tuple(mesh.shape), uneven_in
                )
                if uneven:
                    flat_dist.append(
                        _from_local(
                            o, mesh, spec, run_check=False, shape=shape,  # type: ignore[arg-type]  # any int sequence
                            stride=contiguous_stride(shape), grad_placements=grad,
                        )
                    )
                    continue
            if placements is not None and (
                (o.is_cpu if device_type == "cpu" else o.device.type == device_type) or o.is_meta
            ):
                # What DTensor.from_local(o, mesh, spec, run_check=False,
                # grad_placements=grad) passes to its autograd Function, with
                # the global shape and stride it would compute (kept per
                # output: Note: [Eager fast path]).
                try:
                    shape, stride = _global_info(plan, idx, o, mesh, placements)
                    dt = _from_local_fn(
                        o,
                        mesh,
                        placements,
                        False,
                        shape,
                        stride,
                        tuple(grad) if grad is not None else None,
                    )
                except (IndexError, RuntimeError, TypeError, ValueError) as e:
                    raise _out_hint(e, idx, spec, o, mesh) from None
                flat_dist.append(dt)
            else:
                try:
                    dt = _from_local(o, mesh, spec, run_check=False, grad_placements=grad)
                except (IndexError, RuntimeError, TypeError, ValueError) as e:
                    raise _out_hint(e, idx, spec, o, mesh) from None
                flat_dist.append(dt)
        else:
            flat_dist.append(o)
    if out_spec is None:
        return flat_dist[0]
    if out_spec is tuple:
        return tuple(flat_dist)
    if out_spec is list:
        return flat_dist
    return pytree.tree_unflatten(flat_dist, out_spec)
