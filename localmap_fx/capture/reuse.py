"""Trace a repeated ``local_map`` call once: Dynamo subgraph reuse, keyed on the region.

Under ``torch.compile`` capture calls the body of a region through
:func:`run_body`.  When the same body is called again with the same
*region key*, Dynamo traces it once, as an ``invoke_subgraph`` on local
tensors, and stamps out the traced subgraph for every later call (torch's
``nested_compile_region`` reuse, ``torch/_dynamo/variables/invoke_subgraph.py``).

Note: [Region reuse key]
    torch keys its reuse cache on the code object of the function it calls
    and then compares the inputs' shape, stride, dtype, device and
    ``requires_grad`` -- never DTensor placements or the mesh, which the body
    (on local tensors) does not see but the region does.  Capture therefore
    calls, per region key, its own *shared body*: a one-line function that
    calls the user's function, with a code object of its own (renamed), so
    torch's cache never mixes two keys.  The key is

        (the function object, in/out/in_grad placements, redistribute_inputs,
         the mesh, each argument's shape/stride/dtype/device/requires_grad
         (or constant value), grad mode)

    A call whose key differs in any part gets another shared body, so it is
    traced on its own and never merged.

Note: [When a call is not shared]
    ``invoke_subgraph`` is stricter than inline tracing: it rejects (with a
    hard error) inputs that share storage, an output that aliases an input or
    another output, and graph breaks inside the body.  So reuse is proven
    before it is used: the *first* call of a key in a trace runs inline, as
    without reuse, and a compile-time probe (``torch._dynamo.comptime``) looks
    at what Dynamo traced: the body must have stayed in the same graph (no
    graph break), returned one tensor or a tuple of tensors, none of them
    sharing storage with an input, a value it closed over, or each other, and
    must not have mutated an input.  Only then do later calls of the key use
    the shared body, and only if their own arguments share no storage with
    each other or with the values the body closed over.  Calls with keyword
    arguments, nested (pytree) ``in_placements``, ``spmd_types=True``,
    symbolic shapes, a function Dynamo cannot name as a real object (a
    closure created in traced code) or a non-tensor, non-constant argument
    always run inline.  Every call still carries the region annotation; the
    backend finds it on the ``invoke_subgraph`` node (see
    :mod:`localmap_fx.passes.outline_regions`).

:func:`region_reuse` switches reuse off (or on) for the compiles inside it;
the default is on.  Dynamo guards on the switch, so toggling it recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import comptime, invoke_subgraph_placeholder
from ..analysis import copy_nodes, find_effects, span_io, storage_key
from ..graph_utils import node_value
from ..region import spec_of
from . import handoff
from .handoff import local_vt, realized, taken

__all__ = ["region_reuse", "reuse_enabled", "run_body", "SHARED_BODY_PREFIX"]

_ENABLED = True

# Names of the shared bodies' code objects (and of their attributes on _SHARED)
SHARED_BODY_PREFIX = "localmap_fx_shared_body_"


@contextlib.contextmanager
def region_reuse(enabled: bool = True) -> Iterator[None]:
    """Turn tracing repeated region calls once on or off inside the block.

    ``with localmap_fx.region_reuse(False): torch.compile(...)(...)`` traces
    every call inline, as before reuse existed.  Restores the previous value.
    """
    global _ENABLED
    previous = _ENABLED
    _ENABLED = bool(enabled)
    try:
        yield
    finally:
        _ENABLED = previous


def reuse_enabled() -> bool:
    return _ENABLED


class _SharedBodies:
    """Holds one shared body per region key, as attributes: traced code reads
    ``getattr(_SHARED, name)``, which Dynamo guards like any attribute."""


# Note: [Shared bodies do not keep the user's function alive]
#     The registry is per user function, held weakly: ``_NAMES[func]`` maps
#     the rest of a region key to the name of its shared body, and a shared
#     body reaches ``func`` through a weak reference (Dynamo traces calling
#     it like calling ``func``).  So nothing here keeps a function, or what
#     its closure holds, alive; when the function is collected its shared
#     bodies are removed from ``_SHARED``.  (Dynamo's own caches, guards and
#     compiled code may still hold it until ``torch._dynamo.reset()``.)
_SHARED = _SharedBodies()
_NAMES: weakref.WeakKeyDictionary[Callable, dict[tuple, str]] = weakref.WeakKeyDictionary()
_ids = itertools.count()


def _forget(names: dict[tuple, str]) -> None:
    for name in names.values():
        if hasattr(_SHARED, name):
            delattr(_SHARED, name)


def _shared_body_name(func: Callable, body_key: tuple) -> str:
    """The shared body of ``func`` for ``body_key`` (the region key without
    ``func``, so that the registry does not hold the function)."""
    names = _NAMES.get(func)
    if names is None:
        names = _NAMES[func] = {}
        weakref.finalize(func, _forget, names)
    name = names.get(body_key)
    if name is None:
        name = f"{SHARED_BODY_PREFIX}{next(_ids)}"
        func_ref = weakref.ref(func)

        def shared_body(*args):
            return func_ref()(*args)  # type: ignore[misc]  # alive: the region calling it holds it

        # Its own code object: torch's reuse cache is keyed on it.
        shared_body.__code__ = shared_body.__code__.replace(co_name=name)
        shared_body.__name__ = shared_body.__qualname__ = name
        # One key has one entry per input metadata; never hit torch's cap
        # (exceeding it is a RuntimeError).
        shared_body.__marked_compile_region_max_reuse_entries__ = sys.maxsize  # type: ignore[attr-defined]
        setattr(_SHARED, name, shared_body)
        names[body_key] = name
    return name


# --- per-trace state (one per Dynamo OutputGraph: a restart starts afresh) --------


@dataclasses.dataclass
class _Verdict:
    safe: bool
    captured: frozenset = frozenset()  # storages of the values the body closed over


@dataclasses.dataclass
class _Probe:
    key: tuple
    graph: torch.fx.Graph
    before: set
    inputs: list  # fake tensors of the tensor arguments


@dataclasses.dataclass
class _TraceState:
    verdicts: dict = dataclasses.field(default_factory=dict)
    probes: list = dataclasses.field(default_factory=list)


# id(OutputGraph) -> (weak reference to it, its state); OutputGraph is
# unhashable.  An entry goes when its OutputGraph does: its verdicts' keys
# hold the user's functions.
_STATES: dict[int, tuple[weakref.ref, _TraceState]] = {}


def _drop_state(key: int, ref: weakref.ref) -> None:
    entry = _STATES.get(key)
    if entry is not None and entry[0] is ref:
        del _STATES[key]


def _state(tx) -> _TraceState:
    output = tx.output
    entry = _STATES.get(id(output))
    if entry is None or entry[0]() is not output:
        ref = weakref.ref(output)
        entry = _STATES[id(output)] = (ref, _TraceState())
        weakref.finalize(output, _drop_state, id(output), ref)
    return entry[1]


def _storages(t: torch.Tensor) -> set:
    key = storage_key(t)
    return set() if key is None else {key}  # no storage (sparse, subclass): unique


def _key_and_inputs(ctx) -> tuple[tuple | None, list, Callable | None]:
    """The region key of this call (None: not shareable), its tensor arguments, the function."""
    from .._torch_compat import ConstantVariable, TensorVariable, UserFunctionVariable

    if _local_tensor_mode():
        # torch 2.14.1 has no invoke_subgraph rule for LocalTensor
        return None, [], None
    func_vt = local_vt(ctx, "func")
    if type(func_vt) is not UserFunctionVariable:
        return None, [], None
    func = func_vt.get_function()
    try:
        spec_key = local_vt(ctx, "spec").as_python_constant()
        mesh = local_vt(ctx, "mesh").as_python_constant()
    except Exception:  # noqa: BLE001 - not constants: no reuse
        return None, [], None
    spec = spec_of(spec_key) if isinstance(spec_key, str) else None
    if spec is None or spec.get("spmd_types"):
        return None, [], None
    arg_keys: list = []
    fakes: list = []
    for item in local_vt(ctx, "local_args").items:
        item = realized(item)
        if isinstance(item, TensorVariable):
            t = node_value(item.as_proxy().node)
            if not isinstance(t, torch.Tensor) or type(t).__name__ == "DTensor":
                return None, [], None
            meta = (tuple(t.shape), tuple(t.stride()))
            if not all(isinstance(s, int) for part in meta for s in part):
                return None, [], None  # symbolic sizes: keep inline
            arg_keys.append(("tensor", *meta, t.dtype, t.device, t.requires_grad))
            fakes.append(t)
        elif isinstance(item, ConstantVariable):
            arg_keys.append(("const", type(item.value), item.value))
        else:
            return None, [], None
    key = (
        func,
        spec_key,  # made from the spec's content
        id(mesh),
        tuple(arg_keys),
        torch.is_grad_enabled(),
    )
    try:
        hash(key)
    except TypeError:
        return None, [], None
    return key, fakes, func


def _local_tensor_mode() -> bool:
    try:
        from .._torch_compat import get_local_tensor_mode_list
    except ImportError:  # noqa: BLE001 - no LocalTensor in this build
        return False
    return bool(get_local_tensor_mode_list())


def _disjoint(fakes: list, captured: frozenset) -> bool:
    seen: set = set(captured)
    for t in fakes:
        s = _storages(t)
        if s & seen:
            return False
        seen |= s
    return True


def _lookup(ctx) -> None:
    """Before the body: decide between the shared body and an inline (probe) trace."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    state = _state(tx)
    decision = None
    key, fakes, func = _key_and_inputs(ctx)
    if key is not None:
        verdict = state.verdicts.get(key)
        if verdict is None:
            graph = ctx.graph()
            state.probes.append(
                _Probe(key, graph, set(graph.nodes), fakes)
            )
        elif verdict.safe and func is not None and _disjoint(fakes, verdict.captured):
            decision = _shared_body_name(func, key[1:])
    # run_body takes it right after (Note: [Handing a value from comptime
    # back to the trace])
    handoff.put(decision)


def _probe_end(ctx) -> None:
    """After an inline body: record whether later calls of its key may share it."""
    from .._torch_compat import TensorVariable, TupleVariable

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    state = _state(tx)
    if not state.probes:
        return
    probe = state.probes.pop()
    graph = ctx.graph()
    safe = graph is probe.graph  # else a graph break split the body
    out = local_vt(ctx, "out")
    outs: list
    if isinstance(out, TensorVariable):
        outs = [out]
    elif type(out) is TupleVariable and all(isinstance(o, TensorVariable) for o in out.items):
        outs = list(out.items)
    else:
        outs, safe = [], False
    captured: set = set()
    if safe:
        new = [n for n in graph.nodes if n not in probe.before]
        new_set = set(new)
        arg_storages: set = set()
        for t in probe.inputs:
            arg_storages |= _storages(t)
        for n in new:
            sources = [n] if n.op == "placeholder" else [a for a in n.all_input_nodes if a not in new_set]
            for a in sources:
                v = node_value(a)
                if isinstance(v, torch.Tensor):
                    captured |= _storages(v) - arg_storages
        # the cheap check first: the fake run of the body is only needed when it passes
        if not _disjoint(probe.inputs, frozenset(captured)) or not _body_is_pure(
                tx, new, [o.as_proxy().node for o in outs], probe.inputs):
            safe = False
    state.verdicts[probe.key] = _Verdict(safe, frozenset(captured))


def _body_is_pure(tx, new: list[fx.Node], outputs: list[fx.Node], args: list) -> bool:
    """The body Dynamo just traced (its ``new`` nodes) returns no (view of an)
    input, closed-over value or other output, and writes to no argument
    (``args``: the arguments' fake values).  Note: [Deciding that a body writes
    to or aliases an input] in :mod:`localmap_fx.analysis`."""
    body = [n for n in new if n.op != "placeholder"]
    inputs, _ = span_io(body)
    inside = set(body)
    inputs += [o for o in dict.fromkeys(outputs) if o not in inside and o not in inputs]  # returned as is
    try:
        graph, owner = copy_nodes(body, inputs, outputs, tx.output.get_submodule,
                                  [f"in{i}" for i in range(len(inputs))])
    except (AttributeError, KeyError):  # a get_attr we cannot read back: cannot tell
        return False
    effects = find_effects(graph, owner, [node_value(a) for a in inputs])
    if effects.error is not None or effects.output_aliases:
        return False
    arg_ids = {id(t) for t in args}
    return not any(id(node_value(inputs[i])) in arg_ids for i, _ in effects.written_inputs())


def run_body(func: Callable, local_args: tuple, kwargs: dict, spec: str, mesh: Any) -> Any:
    """Call the region body ``func(*local_args, **kwargs)`` (traced by Dynamo).

    Through the shared body of its region key when an earlier call of the key
    proved sharing safe, else inline (see the Notes above).  ``spec`` (the
    key of the region's spec, :func:`localmap_fx.region.register_spec`) and
    ``mesh``: part of the key.
    """
    if kwargs or not _ENABLED:
        return func(*local_args, **kwargs)
    comptime(_lookup)
    name = taken()
    if name is not None:
        return invoke_subgraph_placeholder(getattr(_SHARED, name), *local_args)
    out = func(*local_args)
    comptime(_probe_end)
    return out
