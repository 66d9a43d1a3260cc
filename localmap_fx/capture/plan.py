"""Plan a captured ``local_map`` call in plain Python instead of in Dynamo.

:func:`localmap_fx.capture.call.call_captured` is traced by Dynamo, which runs
every Python instruction of it symbolically, about a thousand times slower
than Python itself.  The checks and the bookkeeping of a call (flattening
the arguments, describing each one, planning redistributions, checking the
outputs, working out their global shapes) need only the values' metadata,
which Dynamo already holds as fake tensors.  So for the common call they
run here, in real Python, at trace time, through ``comptime``:

    before (traced by Dynamo, per call)       after
    -------------------------------------     ---------------------------------
    flat_args, spec = flatten_args(args)      comptime(plan_call)   # real Python
    descs = tuple(describe(a) ...)            plan = taken()        # a constant
    plan = _plan_inputs(descs, ...)
    ... body ...                              ... body ...
    flat_out, spec = tree_flatten(out)        comptime(plan_outputs)
    _check_outputs(describe(o) ...)           shapes = taken()
    output_global_shape(...) per output

Measured on the 64-layer TP stack of issue #10 (fake group of 2), this and
the short traced path below halved Dynamo's time (5.0 s -> 2.4 s).

The comptime functions hand their results to the trace through
:mod:`.handoff` (Note: [Handing a value from comptime back to the trace]).

Note: [Why the planned path is short]
    Dynamo's cost per traced Python instruction is tens of microseconds,
    and the planned path runs once per region call (128 times in a 64-layer
    TP stack).  So what it traces is only what must become graph nodes:
    ``redistribute``/``to_local`` per argument, the body, ``from_local`` per
    output, each group under one ``annotate`` whose dict
    (:class:`Annotations`) was merged once per ``LocalMap`` instead of three
    nested ``annotate`` contexts per node group; no helper calls, no
    ``enumerate``.  On that stack this took Dynamo from 5.0 s to about 2.4 s.

Note: [Which calls are planned here]
    Only calls whose arguments are all tensors or Python constants (no
    pytree containers), whose ``in_placements`` is torch's flat form, whose
    sizes are static, and whose body returns one tensor or a tuple of
    tensors.  The plan depends on the inputs' placements, meshes and
    shapes, which Dynamo guards on (DTensor inputs carry their spec in the
    tensor guard) or traces itself (intermediate DTensors), and on the
    ``local_map``'s configuration, which the traced code reads so that
    Dynamo guards it too (Note: [A call's plan depends on its local_map] in
    :mod:`.call`).  Every other call returns ``None`` here and takes the
    traced path, which handles every form.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from .. import argtree, validate
from .._pytree import pytree
from ..boundary import check_arg_meshes
from ..errors import compile_time
from ..graph_utils import node_value
from ..region import META_INDEX, META_SPEC, ROLE_BODY, ROLE_ENTER, ROLE_EXIT, definition_site
from ..shapes import contiguous_stride, input_shapes, output_global_shape
from . import handoff
from .handoff import local_vt, realized

__all__ = ["check_meshes", "pinned_root_call", "plan_call", "plan_outputs", "put_identity"]


# Note: [Constants handed to the trace are private copies]
#     A placement handed to the trace that is also reachable from user code
#     (``lm.out_specs``, a module-level ``Shard(0)``) makes Dynamo guard on
#     two sources of one object, one of them this constant, which has no
#     source it can evaluate (``NameError: name 'taken' is not defined``).
#     So every value is a deep copy, made once per distinct value (by its
#     text) and reused, so that repeated calls cost a ``repr``, not a copy.
#     The copies are placements, flags and names, never user objects; the
#     most recently used ``_MAX_COPIES`` are kept, so a long-lived process
#     that compiles many different regions does not keep every one.
_MAX_COPIES = 1024
_COPIES: OrderedDict[str, Any] = OrderedDict()


def _private(value: Any) -> Any:
    key = repr(value)
    copied = _COPIES.get(key)
    if copied is None:
        copied = _COPIES[key] = copy.deepcopy(value)
        if len(_COPIES) > _MAX_COPIES:
            _COPIES.popitem(last=False)
    else:
        _COPIES.move_to_end(key)
    return copied


def _put(value: Any) -> None:
    handoff.put(value if isinstance(value, handoff.Raise) or value is None else _private(value))


def _static(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    shapes = [t.shape]
    if isinstance(t, DTensor):
        shapes.append(t._local_tensor.shape)
    return all(isinstance(s, int) for shape in shapes for s in shape)


def _values(vt) -> list | None:
    """The real values (fake tensors, constants) of a tuple/list variable's
    items, or None when one is neither."""
    from .._torch_compat import ConstantVariable, TensorVariable

    values = []
    for item in getattr(vt, "items", None) or ():
        item = realized(item)
        if isinstance(item, TensorVariable):
            v = node_value(item.as_proxy().node)
            if not isinstance(v, torch.Tensor) or not _static(v):
                return None
            values.append(v)
        elif type(item) is ConstantVariable and type(item.value) in (int, float, bool, str, type(None)):
            values.append(item.value)
        else:
            return None
    return values


def _tensor_values(vt) -> list:
    """The fake values of a tuple/list variable's tensor items."""
    from .._torch_compat import TensorVariable

    values = []
    for item in getattr(vt, "items", None) or ():
        item = realized(item)
        if isinstance(item, TensorVariable):
            v = node_value(item.as_proxy().node)
            if isinstance(v, torch.Tensor):
                values.append(v)
    return values


def _local_map(ctx):
    from .._torch_compat import UserDefinedObjectVariable

    vt = local_vt(ctx, "lm")
    if type(vt) is not UserDefinedObjectVariable or getattr(vt, "source", None) is None:
        return None  # built inside the traced code: its real object is not filled in
    return vt.value


def build_spec_annotation(ctx) -> None:
    """comptime, traced path: the real ``lm``'s annotation, built on its first
    capture; None for one built in the traced code (it has it already).

    Note: [The annotation enters the trace as a constant]
        A ``local_map``'s annotation is built on its first capture, so on
        the object it is None until then.  Traced code that read
        ``lm.spec_annotation`` made Dynamo guard on that attribute's type:
        blocks compiled one by one (``block.compile``), each holding a
        ``local_map`` of its own, then failed the guard at every block not
        yet captured, and Dynamo compiled the block's code again per block
        (torchtitan's llama3, whose attention calls its ``local_map`` with
        keywords).  So the annotation is handed over (:func:`taken`), a
        constant with no source to guard.
    """
    lm = _local_map(ctx)
    _put(lm.built_spec_annotation() if lm is not None else None)


def check_meshes(ctx) -> None:
    """comptime, traced path: raise (through :func:`taken`) if a DTensor in
    the local ``flat_args`` is not on ``lm.device_mesh``; ``"traced"`` when
    ``lm`` was built in the traced code and traced code has to check."""
    from .._torch_compat import TensorVariable

    lm = _local_map(ctx)
    if lm is None:
        _put("traced")
        return
    def value(item):
        item = realized(item)
        return node_value(item.as_proxy().node) if isinstance(item, TensorVariable) else None

    try:
        check_arg_meshes(getattr(local_vt(ctx, "flat_args"), "items", None) or (), lm.device_mesh, value=value)
    except Exception as e:  # noqa: BLE001 - handed to the trace, raised there
        _put(handoff.Raise(compile_time(e)))
        return
    _put(None)


def pinned_root_call(ctx) -> None:
    """comptime, in ``LocalMap.__call__``: True when that call is the root of
    the frame Dynamo compiles and one of its arguments is a tensor Dynamo pins
    by identity, or has a symbolic size (Note: [A frame that starts at a
    local_map call] in :mod:`localmap_fx.api`).  Pinning is read from the
    frame's real arguments, not Dynamo's variables, so that it installs no
    guard."""
    from .._torch_compat import InstructionTranslator, get_static_address_type

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    if type(tx) is not InstructionTranslator:
        handoff.put(False)  # inlined into a larger frame: captured as usual
        return
    args = tx.f_locals.get("args", ())
    kwargs = tx.f_locals.get("kwargs", {})
    leaves = pytree.tree_leaves((args, kwargs))
    if any(get_static_address_type(leaf) == "guarded" for leaf in leaves):
        handoff.put(True)
        return
    # Automatic dynamic shapes made a size symbolic: torch 2.14.1's DTensor
    # runtime fails such a frame (``__tensor_unflatten__``); eager, as above.
    # (Building the arguments' variables here installs the guards the frame
    # installs anyway: shapes, not identity.)
    handoff.put(any(not _static(t) for t in _tensor_values(local_vt(ctx, "args"))))


def put_identity(ctx) -> None:
    """comptime, in ``LocalMap.__init__`` under Dynamo: ``(name, definition
    site)`` of the local ``func`` (Note: [local_map built while Dynamo traces])."""
    _put(callable_identity(local_vt(ctx, "func")))


def callable_identity(vt) -> tuple[str, str]:
    """Name and site of the callable Dynamo's variable ``vt`` stands for,
    as :func:`localmap_fx.region.spec_annotation` names a real one: the
    code's qualified name and first line, else the type's name."""
    while type(vt).__name__ == "FunctoolsPartialVariable":
        vt = realized(vt.func)
    get_code = getattr(vt, "get_code", None)
    code = None
    if get_code is not None:
        try:
            code = get_code()
        except Exception:  # noqa: BLE001 - no code to name it by
            code = None
    if code is None and type(vt).__name__ == "GetAttrVariable":
        # e.g. super().__call__: an attribute of something Dynamo keeps symbolic
        owner = getattr(vt.obj, "objvar", None) or vt.obj
        try:
            owner_name = owner.python_type().__qualname__
        except Exception:  # noqa: BLE001 - an owner without a known type
            owner_name = type(owner).__name__
        return f"{owner_name}.{vt.name}", "<unknown>"
    obj = None
    if code is None:
        try:
            obj = vt.as_python_constant()
        except Exception:  # noqa: BLE001 - not a constant: its wrapped value, if any
            obj = getattr(vt, "value", None) or getattr(vt, "fn", None)
        if obj is None:
            return type(vt).__name__, "<unknown>"
        code = getattr(obj, "__code__", None)
    if code is None:
        return type(obj).__name__, "<unknown>"
    return code.co_qualname, definition_site(code)


def plan_call(ctx) -> None:
    """comptime, before the region: the call's plan (see :func:`call_plan`),
    or None (take the traced path).  Reads locals ``lm`` and ``args``."""
    from .._torch_compat import TupleVariable

    lm = _local_map(ctx)
    args_vt = local_vt(ctx, "args")
    values = _values(args_vt) if lm is not None and type(args_vt) is TupleVariable else None
    if values is None or argtree.wants_nested(lm.in_placements, len(values), len(values)):
        _put(None)
        return
    try:
        plan = call_plan(lm, values)
    except Exception as e:  # noqa: BLE001 - handed to the trace, raised there
        _put(handoff.Raise(compile_time(e)))
        return
    _put(plan)


def compile_time_plan(lm, values: list) -> tuple:
    """The traced path's input plan: per argument None or ``(target, grad)``."""
    return tuple(
        validate.plan_inputs(
            tuple(validate.describe(v) for v in values),
            lm.in_placements,
            lm.in_grad_placements,
            lm.redistribute_inputs,
        )
    )


def call_plan(lm, values: list) -> tuple:
    """``(enters, body annotation, spec, mesh_from)`` for the planned path.

    ``enters`` has per argument None (passed through) or ``(target, grad,
    annotation)``; the body annotation is None when no argument is a DTensor
    (no region); ``mesh_from`` is the index of the argument whose mesh the
    region uses, or None for ``device_mesh``.
    """
    check_arg_meshes(values, lm.device_mesh)
    plan = compile_time_plan(lm, values)
    notes = annotations_of(lm)
    enters = tuple(None if step is None else (*step, notes.enter(idx)) for idx, step in enumerate(plan))
    if all(step is None for step in plan):
        return enters, None, None, None
    return enters, notes.body, notes.spec, _mesh_from(lm, values)


def _mesh_from(lm, values: list) -> int | None:
    """Index of the argument whose mesh the region uses (the first DTensor),
    or None when ``device_mesh`` is given."""
    from torch.distributed.tensor import DTensor

    if lm.device_mesh is not None:
        return None
    return next(i for i, v in enumerate(values) if isinstance(v, DTensor))


class Annotations:
    """The merged ``annotate`` dicts of one ``LocalMap``'s nodes: its spec's key plus
    the role (and argument / output index).  One dict per node group instead
    of three nested ``annotate`` contexts, each of which Dynamo traces."""

    def __init__(self, spec_annotation: dict) -> None:
        self.spec = spec_annotation[META_SPEC]
        self.body = {**spec_annotation, **ROLE_BODY}
        self._base = spec_annotation
        self._enter: list[dict] = []
        self._exit: list[dict] = []

    def _indexed(self, cache: list[dict], role: dict, idx: int) -> dict:
        while len(cache) <= idx:
            cache.append({**self._base, **role, META_INDEX: len(cache)})
        return cache[idx]

    def enter(self, idx: int) -> dict:
        return self._indexed(self._enter, ROLE_ENTER, idx)

    def exit(self, idx: int) -> dict:
        return self._indexed(self._exit, ROLE_EXIT, idx)


def annotations_of(lm) -> Annotations:
    """``lm``'s :class:`Annotations`, built on its first planned call."""
    notes = lm._capture_annotations
    if notes is None:
        notes = lm._capture_annotations = Annotations(lm.built_spec_annotation())
    return notes


def plan_outputs(ctx) -> None:
    """comptime, after the body: ``(single, per output (placements, global
    shape or None, stride or None, annotation))``, or ``(None, the call's
    annotation)`` (take the traced exit).  Reads locals ``lm``, ``args``,
    ``flat_local`` and ``out``."""
    from .._torch_compat import TensorVariable

    lm = _local_map(ctx)
    out_vt = local_vt(ctx, "out")
    if isinstance(out_vt, TensorVariable):
        outs = _values(_Items([out_vt]))
        single = True
    elif type(out_vt).__name__ == "TupleVariable":
        outs = _values(out_vt)
        single = False
    else:
        outs = None
    args = _values(local_vt(ctx, "args"))
    locals_ = _values(local_vt(ctx, "flat_local"))
    if lm is None or outs is None or args is None or locals_ is None or any(
        not isinstance(o, torch.Tensor) for o in outs
    ):
        # the traced exit, with the annotation plan_call built (Note: [The
        # annotation enters the trace as a constant])
        _put((None, lm.built_spec_annotation() if lm is not None else None))
        return
    # the input plan plan_call made for this call (a constant in the frame)
    enters = local_vt(ctx, "enters").as_python_constant()
    try:
        notes = annotations_of(lm)
        exits: list[tuple] = []
        shapes = output_shapes(lm, args, input_shapes(args, enters, locals_), outs)
        for idx, (spec, (shape, uneven)) in enumerate(zip(lm.out_specs, shapes)):
            if uneven:
                exits.append((spec, shape, contiguous_stride(shape), notes.exit(idx)))
            else:
                exits.append((spec, None, None, notes.exit(idx)))
        _put((single, tuple(exits)))
    except Exception as e:  # noqa: BLE001 - handed to the trace, raised there
        _put(handoff.Raise(compile_time(e)))


class _Items:
    def __init__(self, items: list) -> None:
        self.items = items


def output_shapes(lm, args: list, in_shapes: list, outs: list) -> tuple:
    """Check the outputs like the traced path and give each one's
    ``(global shape, uneven)``."""
    i = _mesh_from(lm, args)
    mesh = lm.device_mesh if i is None else args[i].device_mesh
    validate.check_outputs(tuple(validate.describe(o) for o in outs), lm.out_specs, mesh.ndim)
    return tuple(
        output_global_shape(tuple(o.shape), tuple(spec), tuple(mesh.shape), in_shapes)
        for o, spec in zip(outs, lm.out_specs)
    )
