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
    those of torch's ``local_map``; ``tests/test_eager_parity.py`` checks it.
    Specs are read when ``local_map`` is applied: changing the lists passed
    as ``in_placements``/``out_placements`` afterwards is not supported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from weakref import ref as _weakref

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor
from torch.distributed.tensor._utils import assert_no_mixed_partial_types
from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

from . import validate
from ._pytree import flatten_args, pytree, unflatten_args
from .meshcache import MeshCache
from .shapes import contiguous_stride, output_global_shape

if TYPE_CHECKING:
    from .api import LocalMap

__all__ = ["EagerPlan", "call_eager", "wrap_outputs"]

_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_to_local_fn = _ToTorchTensor.apply
_from_local_fn = _FromTorchTensor.apply
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
        if isinstance(p, (Shard, _StridedShard)) and p.dim < 0:
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
        # and the outputs' out_placements that passed their placement checks
        self.grad_fits: set[tuple[int, int, int]] = set()
        self.out_fits: set[tuple[int, int, int]] = set()

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


def _check_out_once(plan: EagerPlan, idx: int, spec: Any, out: torch.Tensor, mesh, flat_out: list) -> None:
    """validate.check_out_spec_fits, once per function, output and layout."""
    key = (idx, mesh.ndim, out.ndim)
    seen = plan.out_fits
    if key not in seen:
        later = _later_tensor_outputs(flat_out, plan.out_specs, idx)
        validate.check_out_spec_fits(spec, idx, mesh.ndim, out.ndim, later)
        seen.add(key)


def _later_tensor_outputs(flat_out: list, out_specs: tuple, idx: int):
    """``(index, spec, ndim)`` of the plain tensor outputs after ``idx``."""
    for j in range(idx + 1, len(flat_out)):
        o = flat_out[j]
        if isinstance(o, _Tensor) and not isinstance(o, DTensor):
            yield j, out_specs[j], o.ndim


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
    for idx, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            if mesh is None:
                mesh = arg.device_mesh
            elif lm.device_mesh is not None and arg.device_mesh is not mesh:
                validate.check_arg_mesh(arg.device_mesh, mesh, idx)
            seen_dtensor = True
            if in_specs is not None:
                spec = in_specs[idx]
                if type(spec) is not tuple or arg.placements != spec:
                    # None, a non-sequence, or a mismatch: validate raises
                    # torch's error or asks for a redistribution.
                    if validate.check_dtensor_in_spec(arg, idx, spec, lm.redistribute_inputs):
                        arg = _redistribute_checked(arg, idx, spec, _later_dtensors(flat_args, in_specs, idx))
            layout = arg._spec
            ref = plan.known_layouts.get(idx)
            known = ref is not None and ref() is layout
            if in_grads is not None:
                grad = in_grads[idx]
                if type(grad) is not tuple:
                    grad = validate.check_dtensor_grad_spec(arg, idx, grad)
                if not known:
                    _check_grad_once(plan, idx, grad, arg, flat_args)
            else:
                grad = None
            if grad is None and lm.spmd_types:
                from .spmd.types import typed_in_grad_placements  # R -> Partial, see there

                grad = typed_in_grad_placements(arg.placements)
            # arg.to_local(grad_placements=grad), see Note: [Eager fast path]
            if type(arg) is DTensor and not getattr(arg, "_is_param", False):
                local = _to_local_fn(arg, grad) if grad_enabled else arg._local_tensor
            elif grad is None:
                local = arg.to_local()
            else:
                local = arg.to_local(grad_placements=grad)
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
            if not known:
                if _unevenly_sharded(arg):
                    uneven_in.append((arg.placements, tuple(arg.shape), tuple(local.shape)))
                else:
                    plan.known_layouts[idx] = _weakref(layout)
            flat_local.append(local)
        else:
            if in_specs is not None and not isinstance(arg, _Tensor):
                # the error prints the entry as the user wrote it
                validate.check_non_tensor_input(arg, idx, lm.in_placements[idx])
            flat_local.append(arg)

    local_args = tuple(flat_local) if args_spec is None else unflatten_args(flat_local, args_spec)

    if lm.spmd_types and seen_dtensor:
        validate.check_spmd_types_available()
        from .spmd import types as spmd  # imported with spmd_types only when used

        splan = plan.spmd_plan(lm, mesh)
        try:
            splan.annotate_inputs(flat_local, in_specs, in_grads)
        except ValueError as e:
            raise spmd.explain(e, mesh) from None
        if lm.spmd_types == "global":
            from .spmd.global_check import run_eager

            out = run_eager(lm.func, local_args, kwargs, flat_local, in_specs, plan.out_specs, mesh, splan.checking)
        else:
            try:
                with splan.checking():
                    out = lm.func(*local_args, **kwargs)
            except spmd.spmd.SpmdTypeError as e:
                raise spmd.explain(e, mesh) from None
    else:
        out = lm.func(*local_args, **kwargs)

    if not seen_dtensor:
        return out
    return wrap_outputs(lm, out, mesh, uneven_in)


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

    grad_specs = None
    if lm.spmd_types:
        try:
            grad_specs = plan.spmd_plan(lm, mesh).out_grad_placements(flat_out, out_specs)
        except ValueError as e:
            from .spmd import types as spmd

            raise spmd.explain(e, mesh) from None

    ready = plan.out_ready
    device_type = mesh.device_type
    flat_dist = []
    for idx, o in enumerate(flat_out):
        spec = out_specs[idx]
        if isinstance(o, DTensor) or not isinstance(o, _Tensor):
            validate.check_output_value(o, idx, spec)
        if isinstance(o, _Tensor):
            _check_out_once(plan, idx, spec, o, mesh, flat_out)
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
                # grad_placements=grad) passes to its autograd Function.
                try:
                    dt = _from_local_fn(
                        o,
                        mesh,
                        placements,
                        False,
                        None,
                        None,
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
