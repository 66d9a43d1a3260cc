"""``localmap_fx.local_map``: the decorator users write.

Same signature, call forms and results as torch 2.14.1's
``torch.distributed.tensor.experimental.local_map``.  In eager mode a call runs
the fallback in :mod:`localmap_fx.eager`; under ``torch.compile`` it is
captured as one region (:mod:`localmap_fx.capture.call`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from . import argtree, validate
from ._pytree import flatten_args
from .eager import MISS, EagerPlan, call_eager, call_fast
from .region import spec_annotation

__all__ = ["local_map", "LocalMap"]

PlacementType = Sequence[Placement] | None


def local_map(
    func: Callable | None = None,
    out_placements: PlacementType | tuple[PlacementType, ...] = None,
    in_placements: tuple[PlacementType, ...] | None = None,
    in_grad_placements: tuple[PlacementType, ...] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
    spmd_types: bool | str = False,
):
    """Run ``func``, written for local tensors, on the local shards of DTensors.

    Arguments and behaviour are those of torch 2.14.1's ``local_map`` (see
    ``docs/user-guide.md``): DTensor leaves of ``args`` are checked against
    ``in_placements`` (redistributed first when ``redistribute_inputs``),
    unwrapped with ``to_local(grad_placements=in_grad_placements[i])`` and
    passed to ``func``; tensor outputs are wrapped with
    ``DTensor.from_local(out, device_mesh, out_placements[j])``.  With no
    DTensor argument, ``func`` runs on the arguments untouched.

    With ``spmd_types=True`` the body runs under strict SPMD type checking
    (spmd_types 0.3.1) and the outputs' types decide their grad placements.
    ``spmd_types="global"`` checks that too and, in addition, that the body
    computes on the global tensors what its placements claim (a non-linear
    op on a pending reduction, a softmax or norm over a sharded dimension, a
    collective on the wrong layout raise ``SpmdGlobalError``; see
    :mod:`localmap_fx.spmd.global_check`).

    Under ``torch.compile`` each call becomes one region of the captured graph
    (see :func:`localmap_fx.find_regions`).

    Returns a callable; with ``func=None``, a decorator.
    """
    if func is None:

        def decorated(func):
            return local_map(
                func,
                out_placements,
                in_placements,
                in_grad_placements,
                device_mesh,
                redistribute_inputs=redistribute_inputs,
                spmd_types=spmd_types,
            )

        return decorated
    return LocalMap(
        func,
        out_placements,
        in_placements,
        in_grad_placements,
        device_mesh,
        redistribute_inputs,
        spmd_types,
    )


class _FromFunc:
    """``functools.update_wrapper``'s copy of one attribute, read when asked.

    On an instance it is the wrapped callable's attribute (or ``default``);
    on the class it is ``default``.  Nothing is copied at construction, so
    Dynamo tracing ``local_map(f, ...)`` inside ``forward`` never reads
    attributes it cannot trace (Note: [local_map built while Dynamo traces]).
    """

    def __init__(self, name: str, default: Any) -> None:
        self.name = name
        self.default = default

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self.default
        return getattr(obj.func, self.name, self.default)


class LocalMap:
    """A function wrapped by :func:`local_map`; calling it runs the region."""

    __doc__ = _FromFunc("__doc__", __doc__)

    def __init__(
        self,
        func: Callable,
        out_placements: Any,
        in_placements: Any,
        in_grad_placements: Any,
        device_mesh: DeviceMesh | None,
        redistribute_inputs: bool,
        spmd_types: bool | str,
    ) -> None:
        if isinstance(spmd_types, str) and spmd_types != "global":
            raise ValueError(
                f'local_map(spmd_types={spmd_types!r}) is not supported: use False, True or "global".'
            )
        self.func = func
        self.out_placements = out_placements
        self.in_placements = in_placements
        self.in_grad_placements = in_grad_placements
        self.device_mesh = device_mesh
        self.redistribute_inputs = redistribute_inputs
        self.spmd_types = spmd_types
        # torch reads out_placements as "a tuple means one entry per output".
        self.out_specs = validate.normalize_out_specs(out_placements)
        # Positional parameter names, for in_placements given by name (argtree).
        self.param_names = _param_names(func) if isinstance(in_placements, dict) else None
        # The region annotation capture puts on this function's nodes: built on
        # first capture (:meth:`built_spec_annotation`), so that the eager path
        # never pays for it; while Dynamo traces, now (the real object is not
        # filled in then: Note: [local_map built while Dynamo traces]).
        self.spec_annotation: dict | None = None
        # What capture's plan for a call reads of this object, as one value
        # Dynamo guards by equality (Note: [A call's plan depends on its
        # local_map] in capture/call.py); None for one built while Dynamo
        # traces, which nothing guards.
        self.config_text: str | None = None
        if torch.compiler.is_compiling():
            self.spec_annotation = self._new_spec_annotation(traced=True)
        else:
            self.config_text = repr((in_placements, self.out_specs, in_grad_placements, redistribute_inputs,
                                     spmd_types))
        # Built by the eager path on its first call (see eager.EagerPlan).
        self._eager_plan: EagerPlan | None = None
        # Built by capture on its first planned call (capture_plan.annotations).
        self._capture_annotations: Any = None

    def built_spec_annotation(self) -> dict:
        """The region annotation of this function's calls, built on first use
        (in real Python: capture's ``comptime`` functions call it)."""
        if self.spec_annotation is None:
            self.spec_annotation = self._new_spec_annotation(traced=False)
        return self.spec_annotation

    def _new_spec_annotation(self, traced: bool) -> dict:
        # traced: Dynamo runs this, so the name and site come from comptime and
        # the spec registry is reached through a function Dynamo does not
        # trace; the spmd_types body registry is not reached at all
        return spec_annotation(
            func=self.func,
            identity=_traced_identity(self.func) if traced else None,
            in_placements=self.in_placements,
            out_specs=self.out_specs,
            in_grad_placements=self.in_grad_placements,
            device_mesh=self.device_mesh,
            redistribute_inputs=self.redistribute_inputs,
            spmd_types=self.spmd_types,
            body_key=_register_body(self.func) if self.spmd_types and not traced else None,
            register=_traced_register_spec() if traced else None,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            from ._torch_compat import comptime, skip_frame
            from .capture.call import call_captured, call_outside_dynamo, leave_frame
            from .capture.handoff import taken
            from .capture.plan import pinned_root_call

            # Note: [A frame that starts at a local_map call]
            comptime(pinned_root_call)  # reads the root frame's real ``args``
            if taken():
                # a graph break; the frame so far guards on the body only
                leave_frame(self.func)
                skip_frame()  # that frame (and only it) is never traced
                return call_outside_dynamo(self, args, kwargs)
            return call_captured(self, args, kwargs)
        plan = self._eager_plan
        if plan is not None:
            # a call layout seen before (Note: [Eager fast path]); containers
            # and every other change fall through to the full path
            for layout in plan.layouts:
                out = call_fast(self, plan, layout, args, kwargs)
                if out is not MISS:
                    return out
        if self.param_names is not None or _maybe_nested(self.in_placements, args):
            return _call_nested_eager(self, args, kwargs)
        return call_eager(self, args, kwargs)

    @property
    def __wrapped__(self) -> Callable:
        return self.func

    def __getattr__(self, name: str) -> Any:
        # Only what update_wrapper would have copied: __name__, __qualname__
        # and the callable's own attributes (never our fields: a LocalMap
        # being unpickled or copied has no ``func`` yet).
        func = self.__dict__.get("func")
        if func is None or name in _OWN_FIELDS:
            raise AttributeError(name)
        if name.startswith("__") and name not in ("__name__", "__qualname__", "__type_params__"):
            raise AttributeError(name)
        return getattr(func, name)

    def __repr__(self) -> str:
        name = getattr(self.func, "__qualname__", repr(self.func))
        return f"localmap_fx.local_map({name})"


_OWN_FIELDS = frozenset(
    ("func", "out_placements", "in_placements", "in_grad_placements", "device_mesh",
     "redistribute_inputs", "spmd_types", "out_specs", "param_names", "spec_annotation", "config_text",
     "_eager_plan", "_capture_annotations")
)


# Note: [A frame that starts at a local_map call]
#     When the code calling a ``local_map`` runs in eager (a loop that graph
#     breaks per parameter, as optimizers' loops do), Dynamo compiles
#     ``LocalMap.__call__`` as a frame of its own.  If an argument is a tensor
#     Dynamo pins by identity (``mark_static_address(guard=True)``: Dynamo
#     marks every parameter, gradient and state tensor of an optimizer whose
#     ``step`` it traced), Dynamo's VariableBuilder installs it as a graph
#     constant with an ``ID_MATCH`` guard (torch/_dynamo/variables/builder.py,
#     ``wrap_tensor``), whatever the frame does with it: such a frame
#     recompiles for every parameter, reaches automatic dynamic shapes on the
#     third compile (one code object serves every ``local_map``) and then
#     ``recompile_limit``.  torch's own ``local_map`` frame graph-breaks
#     and runs its boundary in eager.  So such a call is not traced: the root
#     frame reads only the body (``self.func``, guarded like any callable)
#     and calls :func:`_call_outside_dynamo`, which runs the eager path with
#     Dynamo off (checks, ``to_local``, the body, ``from_local``: eager's
#     results, bitwise).  A root frame whose arguments have symbolic sizes
#     (automatic dynamic shapes after calls of other shapes) goes the same
#     way: torch 2.14.1's DTensor runtime fails such a frame
#     (``DTensor.__tensor_unflatten__``: "only integer tensors of a single
#     element can be converted to an index").  Arguments that are ordinary
#     tensors of static shapes, and every call Dynamo inlines into a larger
#     frame, are captured as before.  (``fullgraph=True`` on a frame that
#     starts at such a call is therefore a graph-break error.)


def _register_body(func: Callable) -> int | None:
    from .spmd.functions import register_body

    return register_body(func)


# Note: [local_map built while Dynamo traces]
#     Model code often writes ``local_map(region_fn, ...)(x, w)`` inside
#     ``forward`` (torchtitan wraps ``super().__call__`` on the first call,
#     and ``F.interpolate`` per image size); Dynamo then traces
#     ``LocalMap.__init__`` too, and it cannot trace attribute reads on every
#     callable: ``func.__qualname__`` of a module-level function is a
#     ``getset_descriptor`` there, ``hasattr(super().__call__, ...)`` and
#     ``functools.update_wrapper`` on a builtin are graph breaks.  So
#     nothing in ``__init__`` reads ``func``'s attributes while compiling:
#     the wrapper attributes are read on demand (:class:`_FromFunc`,
#     ``__getattr__``), and the region's name and definition site are worked
#     out at trace time in real Python from Dynamo's variable for ``func``
#     (:func:`localmap_fx.capture.plan.put_identity` / ``callable_identity``), handed back as
#     constants.  Everything else in the annotation is placements and flags,
#     constants already; Dynamo guards on them as usual, so later calls reuse
#     the compiled frame.
def _traced_identity(func: Callable) -> tuple[str, str]:
    from ._torch_compat import comptime
    from .capture.handoff import taken
    from .capture.plan import put_identity

    comptime(put_identity)  # reads the local ``func``
    return taken()


def _traced_register_spec() -> Callable[[dict], str]:
    from .capture.call import traced_register_spec

    return traced_register_spec


def _param_names(func: Callable) -> tuple[str, ...]:
    import inspect

    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _maybe_nested(in_placements: Any, args: tuple) -> bool:
    """Cheap pre-test: only a tuple or list as long as ``args`` can be the mirrored form."""
    # a list mirrors the arguments as a tuple does (capture reads both alike)
    if type(in_placements) not in (tuple, list) or len(in_placements) != len(args):
        return False
    if not any(type(a) in (tuple, list, dict) for a in args):
        return False  # every argument is one leaf: the flat form applies
    return argtree.wants_nested(in_placements, len(flatten_args(args)[0]), len(args))


def _call_nested_eager(lm: LocalMap, args: tuple, kwargs: dict) -> Any:
    """Eager call with a mirrored or by-name in_placements.

    Checks the arguments on their descriptions (the checks capture runs, so
    errors name the argument path), then runs the ordinary eager fallback on
    the flattened leaves with the resolved per-leaf specs; the body gets its
    arguments rebuilt.
    """
    all_leaves, paths, n_positional, kw_tree = argtree.flatten_call(lm.in_placements, args, kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in kw_tree}
    _, specs, grads = validate.plan_nested_inputs(
        tuple(validate.describe(a) for a in all_leaves),
        paths,
        lm.in_placements,
        lm.in_grad_placements,
        lm.redistribute_inputs,
        lm.param_names,
    )
    func = lm.func

    def body(*local_leaves):
        local_args = argtree.unflatten(args, list(local_leaves[:n_positional]))
        local_kw = argtree.unflatten(kw_tree, list(local_leaves[n_positional:]))
        return func(*local_args, **rest, **local_kw)

    flat = LocalMap(
        body,
        lm.out_placements,
        specs,
        grads,
        lm.device_mesh,
        lm.redistribute_inputs,
        lm.spmd_types,
    )
    return call_eager(flat, tuple(all_leaves), {})
