"""A DTensor border whose compile torch's caches serve in a new process.

Note: [A border torch's caches can serve]
    The lean border (:mod:`~localmap_fx.compiler.dtensor_border`) keeps its
    AOT graphs: it runs the compiled forward and backward itself and reads
    the joint graph to plan a stack's gradients.  An AOTAutogradCache hit
    returns neither, so its graphs are traced and partitioned again in every
    new process (a 64-layer TP stack compiled whole: warm restart 7.0 s
    against 20.0 s cold, where a graph that hits AOTAutogradCache takes
    3.6 s).  A graph with no output chained to an input (a whole model that
    returns its loss) has no tangent plan to make, so it needs neither:

    * the wrapper graph (Note: [The border's wrapper graph]) is built from
      named functions, :func:`border_enter` and :func:`border_leave`, whose
      arguments say everything (the mesh by its process-independent key,
      :func:`~localmap_fx.compiler.cache_keys.mesh_constant`; placements,
      shape, stride and dtype as constants), declared cacheable in a scoped
      ``unsafe_marked_cacheable_functions``, so AOTAutogradCache keys it;
    * AOTAutograd's own runtime runs it, over local tensors only (no
      subclass runtime, no mesh input), between two autograd nodes of the
      border: :class:`_Unwrap` (DTensor inputs to local tensors; in backward
      the local gradients become DTensors in the placements the trace gave
      them) and :class:`_Wrap` (local outputs to DTensors; in backward a
      gradient in other placements than traced is redistributed, as
      AOTAutograd does, then unwrapped);
    * the placements each input's gradient gets are what the joint trace
      recorded (``Enter``'s backward).  A cache hit traces nothing, so the
      border writes them beside torch's caches (``<inductor cache
      dir>/localmap_fx/border_grads/<key>.json``, keyed by the code of the
      wrapper and of every module under it (a checkpointed body lives in
      one), its inputs' layouts and the versions) when it traces, and reads
      them on a hit, told by torch's cache counters.  A hit without that
      file (a cache copied without it) compiles again with AOTAutogradCache
      off: slower, never a guess.  Every key holds this rank's coordinate in
      each mesh (Note: [A trace belongs to its rank] in cache_keys.py), and
      the named calls' cache version is a hash of the code they run.

    One call costs three autograd nodes where the lean border has one
    (microseconds, paid once per step by a whole model), so a graph whose
    output feeds an input of the same spec (a stack's block, called per
    layer) keeps the lean border and its plan.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..graph_utils import calls_invoke_subgraph
from ..layer_sharing.runtime import Refusal
from . import cache_keys
from .border_wrapper import Calls, Enter, Slot, default_tangent, wrapper_graph
from .conversions import Conversion, plan_conversion
from .dtensor_border import (
    DTensorBorder,
    Prepared,
    _input_checks,
    _new_dtensor,
    _respec,
    _wide_value,
    check_grad,
    check_inputs,
    dtensor_border,
    prepare,
    regrad_conversions,
)
from .specs import decode_placements, decode_records, encode_placements, encode_records, make_spec
from .tangent_plan import chained_outputs, eager_grads

__all__ = ["BORDER_ENTER", "BORDER_LEAVE", "CacheableBorder", "border_enter", "border_for", "border_leave",
           "decode_placements", "encode_placements"]

BORDER_ENTER = f"{__name__}.border_enter"
BORDER_LEAVE = f"{__name__}.border_leave"
# enters every key of a wrapper that calls them, and every gradient file: bump
# it when what they do changes
KEY_VERSION = "1"


@functools.cache
def _version() -> str:
    """What the wrapper's named calls do, in every key that holds them: the
    key version, and the source of the code they run (an edit of it must not
    let a cache serve an artifact traced with the old one)."""
    parts = [KEY_VERSION] + [inspect.getsource(f) for f in (
        border_enter, border_leave, decode_placements, Enter, make_spec)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# --- the wrapper's named functions ---------------------------------------------------

# the record lists (per input, its gradient's [spec, wide]: ``Enter``) of the
# wrapper being compiled; set only while the border compiles one (one at a
# time per process)
_RECORDING: list[list[list]] = []


def border_enter(local: torch.Tensor, wide: torch.Tensor | None, mesh: Any, placements: str,
                 shape: tuple, stride: tuple, dtype: torch.dtype, index: int) -> DTensor:
    """The DTensor input ``index`` of the wrapped graph (traced by AOTAutograd only)."""
    spec = make_spec(mesh, decode_placements(placements), shape, stride, dtype)
    record = _RECORDING[-1][index] if _RECORDING else []
    return Enter.apply(local, wide, spec, record)


def border_leave(out: DTensor, placements: str) -> torch.Tensor:
    """A DTensor output's local tensor, its gradient read in ``placements`` (traced only)."""
    return out.to_local(grad_placements=decode_placements(placements))


@contextlib.contextmanager
def _recorded(records: list[list]) -> Iterator[None]:
    _RECORDING.append(records)
    try:
        yield
    finally:
        _RECORDING.pop()


def _cacheable_scope():
    """``unsafe_marked_cacheable_functions`` with the wrapper's functions (and
    the mesh stand-in), for one compile."""
    from .._torch_compat import inductor_config as config

    return config.patch(unsafe_marked_cacheable_functions={
        **config.unsafe_marked_cacheable_functions, cache_keys.MESH_CONSTANT: cache_keys.KEY_VERSION,
        BORDER_ENTER: _version(), BORDER_LEAVE: _version()})


# --- the gradient files ------------------------------------------------------------

def _grads_key(wrapped: fx.GraphModule, local_inputs: Sequence[Any]) -> str:
    """The gradient file's key: the code of the wrapper and of every module
    under it (a higher-order op's body, such as a checkpointed function's,
    lives in a submodule), its inputs' layouts, and the versions."""
    layouts = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), t.requires_grad) if isinstance(t, torch.Tensor)
               else type(t).__name__ for t in local_inputs]
    codes = [(name, m.code) for name, m in wrapped.named_modules() if isinstance(m, fx.GraphModule)]
    text = json.dumps([_version(), torch.__version__, codes, layouts])
    return hashlib.sha256(text.encode()).hexdigest()


def _grads_path(key: str) -> str:
    from .._torch_compat import inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "localmap_fx", "border_grads", f"{key}.json")


def _save_grads(key: str, entries: list) -> None:
    path = _grads_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next process compiles without AOTAutogradCache's hit


def _load_grads(key: str, meshes: Sequence[Any]) -> list[list] | None:
    """Per input, [spec, wide] as ``Enter`` records it, from the file; None when absent or unreadable."""
    try:
        with open(_grads_path(key)) as f:
            return decode_records(json.load(f), meshes)
    except (OSError, ValueError):
        return None


# --- the border ----------------------------------------------------------------------

class CacheableBorder:
    """A compiled graph run between DTensors on AOTAutograd's runtime (Note: [A border torch's caches can serve])."""

    def __init__(self, compiled: Callable, gm: fx.GraphModule, p: Prepared, records: Sequence[list],
                 tangents: tuple, example_inputs: Sequence[Any], source: str) -> None:
        self._compiled = compiled
        self._gm, self._prepared = gm, p
        self.inputs, self.outputs, self.wide = p.inputs, p.outputs, p.wide
        self.tangents = tangents
        self.source = source  # where the input gradients' placements came from
        self._dt_inputs = tuple(i for i, s in enumerate(self.inputs) if s.spec is not None)
        self._in_checks = _input_checks(self.inputs)
        self._needs_grad = tuple(bool(example_inputs[i].requires_grad) for i in self._dt_inputs)
        # per input: the spec its gradient was traced with (None: no gradient)
        self._in_grad_specs = tuple(r[0] if r else None for r in records)
        self._in_grads = tuple((r[0], bool(r[1])) if r else (None, False)
                               for r in (records[i] for i in self._dt_inputs))
        # Note: [A gradient wider than its input]: only a wide slot its
        # gradient left through needs a fresh value that requires grad each
        # call (the others are passed as they are: their gradient is dropped)
        self._wide_values = tuple(_wide_value(example_inputs[i]) for i in self.wide)
        used = {i for i, (_, wide) in zip(self._dt_inputs, self._in_grads) if wide}
        self._used_wide = tuple(k for k, i in enumerate(self.wide) if i in used)
        self._wide_at = {i: len(self._dt_inputs) + n for n, i in enumerate(i for i in self.wide if i in used)}
        self._dt_outputs = tuple(i for i, s in enumerate(self.outputs) if s.spec is not None)
        self._out_specs = tuple(self.outputs[i].spec for i in self._dt_outputs)
        # per DTensor output: the spec its gradient is traced in
        self._tangent_specs = tuple(_respec(self.outputs[i].spec, tangents[i]) for i in self._dt_outputs)
        # arrived tangents -> {input: its gradient's conversion to the placements eager gives it}
        self._regrads: dict[tuple, dict[int, Conversion]] = {}
        # (DTensor output, arrived placements) -> the conversion to the traced tangent
        self._to_traced: dict[tuple[int, tuple], Conversion] = {}

    def text(self) -> str:
        return (f"DTensor border, AOTAutograd's runtime (torch's caches serve it): "
                f"{len(self._dt_inputs)} DTensor inputs, {len(self._dt_outputs)} DTensor outputs; "
                f"input gradients' placements from {self.source}")

    def __call__(self, *args: Any) -> Any:
        check_inputs(self._in_checks, args)
        state = _CallState()
        local = _Unwrap.apply(self, state, *(args[i] for i in self._dt_inputs))
        call = list(args)
        for k, i in enumerate(self._dt_inputs):
            call[i] = local[k]
        wides = list(self._wide_values)
        for n, k in enumerate(self._used_wide):
            wides[k] = local[len(self._dt_inputs) + n]
        call += wides
        outs = list(self._compiled(*call))
        wrapped = _Wrap.apply(self, state, *(outs[i] for i in self._dt_outputs))
        for k, i in enumerate(self._dt_outputs):
            outs[i] = wrapped[k]
        return tuple(outs)

    def to_traced(self, k: int, g: DTensor) -> DTensor:
        """The gradient ``g`` of DTensor output ``k`` in the placements traced (AOTAutograd's way)."""
        key = (k, tuple(g.placements))
        convert = self._to_traced.get(key)
        if convert is None:
            convert = self._to_traced[key] = plan_conversion(g._spec, self._tangent_specs[k])
        return convert(g._local_tensor)

    def regrad_for(self, arrived: tuple) -> dict[int, Conversion]:
        """For gradients that arrived in ``arrived`` (per graph output) where
        the trace assumed others: input -> the spec eager DTensor gives its
        gradient, where it differs from the traced one (as the lean border's
        plan does; Note: [The gradient a stack sends back])."""
        regrad = self._regrads.get(arrived)
        if regrad is None:
            p = self._prepared
            try:
                wanted = eager_grads(self._gm, p.local_inputs, p.fake_mode, p.inputs, p.outputs, arrived, p.wide)
            except Exception:  # noqa: BLE001  (inside a backward: any failure keeps the traced placements)
                # eager cannot run the graph on the fakes: the traced
                # placements, the same values
                wanted = (None,) * len(p.inputs)
            regrad = regrad_conversions(wanted, self._in_grad_specs)
            self._regrads[arrived] = regrad
        return regrad


class _CallState:
    """One call's note from its _Wrap backward to its _Unwrap backward (which runs after it)."""

    __slots__ = ("regrad",)

    def __init__(self) -> None:
        self.regrad: dict[int, Any] | None = None


class _Unwrap(torch.autograd.Function):
    """DTensor inputs -> their local tensors, then one value per wide slot."""

    @staticmethod
    def forward(ctx, border: CacheableBorder, state: _CallState, *inputs: DTensor):
        ctx.border, ctx.state = border, state
        ctx.set_materialize_grads(False)
        local = [t._local_tensor.view_as(t._local_tensor) for t in inputs]
        wides = [border._wide_values[k].view_as(border._wide_values[k]) for k in border._used_wide]
        ctx.mark_non_differentiable(*(t for t, needs in zip(local, border._needs_grad) if not needs))
        return (*local, *wides)

    # Note: [A compiled backward is no frame for Dynamo] (compiler/dtensor_border.py)
    @staticmethod
    @torch.compiler.disable(reason="a compiled graph's backward runs as compiled")
    def backward(ctx, *grads: torch.Tensor | None):
        border: CacheableBorder = ctx.border
        regrad = ctx.state.regrad
        out: list[Any] = []
        for k, (i, (spec, wide)) in enumerate(zip(border._dt_inputs, border._in_grads)):
            g = grads[border._wide_at[i]] if wide else grads[k]
            if g is None:
                out.append(None)
                continue
            if spec is None:
                raise RuntimeError(f"localmap_fx: DTensor input {i} got a gradient its trace did not record")
            convert = regrad.get(i) if regrad else None
            out.append(_new_dtensor(g, spec) if convert is None else convert(g))
        return (None, None, *out)


class _Wrap(torch.autograd.Function):
    """Local outputs -> DTensors; in backward, DTensor gradients -> local tensors in the traced placements."""

    @staticmethod
    def forward(ctx, border: CacheableBorder, state: _CallState, *local: torch.Tensor):
        ctx.border, ctx.state = border, state
        ctx.set_materialize_grads(False)
        # the local tensors are the compiled function's outputs, which require grad
        outs = tuple(_new_dtensor(t.detach(), spec) for t, spec in zip(local, border._out_specs))
        ctx.mark_non_differentiable(*(o for o, t in zip(outs, local) if not t.requires_grad))
        return outs

    @staticmethod
    @torch.compiler.disable(reason="a compiled graph's backward runs as compiled")
    def backward(ctx, *grads: Any):
        border: CacheableBorder = ctx.border
        out: list[Any] = []
        arrived: list | None = None
        for k, (g, spec) in enumerate(zip(grads, border._tangent_specs)):
            if g is None:
                out.append(None)
                continue
            check_grad(border._dt_outputs[k], g)
            if g.placements != spec.placements:
                # AOTAutograd's way: a gradient is read in the placements traced
                # ...and the input gradients get the placements eager gives them
                if arrived is None:
                    arrived = list(border.tangents)
                arrived[border._dt_outputs[k]] = tuple(g.placements)
                g = border.to_traced(k, g)
            out.append(g._local_tensor)
        # assigned each backward: a retained graph's next backward may see other placements
        ctx.state.regrad = border.regrad_for(tuple(arrived)) if arrived is not None else None
        return (None, None, *out)


class _NamedCalls(Calls):
    """The wrapper's enter and leave as calls of :func:`border_enter` and
    :func:`border_leave` whose arguments are constants (the mesh by its key)."""

    def __init__(self, mesh_keys: dict[int, str]) -> None:
        super().__init__()
        self.mesh_keys = mesh_keys
        self.mesh_nodes: dict[int, fx.Node] = {}

    def enter(self, g: fx.Graph, i: int, slot: Slot, local: fx.Node, wide: fx.Node | None) -> fx.Node:
        mesh = slot.spec.mesh
        if id(mesh) not in self.mesh_nodes:
            self.mesh_nodes[id(mesh)] = g.call_function(cache_keys.mesh_constant, (self.mesh_keys[id(mesh)],))
        meta = slot.spec.tensor_meta
        return g.call_function(border_enter, (
            local, wide, self.mesh_nodes[id(mesh)], encode_placements(slot.spec.placements),
            tuple(meta.shape), tuple(meta.stride), meta.dtype, i))

    def leave(self, g: fx.Graph, out: fx.Node, placements: Any) -> fx.Node:
        return g.call_function(border_leave, (out, encode_placements(placements)))


def border_for(gm: fx.GraphModule, example_inputs: Sequence[Any], compile_one: Callable,
               cacheable: bool) -> DTensorBorder | CacheableBorder | Refusal:
    """``gm`` compiled behind a DTensor border: a :class:`CacheableBorder`
    when ``cacheable`` (torch's caches are on) and ``gm`` is a Dynamo frame
    with no output chained to an input and no ``invoke_subgraph`` call
    (AOTAutogradCache is kept off for those), else the lean
    :class:`~localmap_fx.compiler.dtensor_border.DTensorBorder`; or why it
    keeps AOTAutograd's runtime."""
    p = prepare(gm, example_inputs)
    if isinstance(p, Refusal):
        return p
    if (cacheable and "dynamo_compile_id" in gm.meta and not chained_outputs(p.inputs, p.outputs, example_inputs)
            and not calls_invoke_subgraph(gm)):
        border = cacheable_border(gm, example_inputs, p, compile_one)
        if border is not None:
            return border
    return dtensor_border(gm, example_inputs, compile_one, p, cache=cacheable)


def cacheable_border(gm: fx.GraphModule, example_inputs: Sequence[Any], p: Prepared,
                     compile_one: Callable) -> CacheableBorder | None:
    """``gm`` compiled behind a :class:`CacheableBorder`, or None when its
    placements or meshes cannot be written as constants (the lean border then
    compiles it)."""
    from .._torch_compat import functorch_config

    inputs, outputs, wide, local_inputs = p.inputs, p.outputs, p.wide, p.local_inputs
    mesh_keys: dict[int, str] = {}
    for s in (*inputs, *outputs):
        if s.spec is None:
            continue
        if encode_placements(s.spec.placements) is None:
            return None
        key = cache_keys.keep_mesh(s.spec.mesh)
        if key is None:
            return None
        mesh_keys[id(s.spec.mesh)] = key
    tangents = tuple(None if s.spec is None else default_tangent(s.spec.placements) for s in outputs)
    wrapped = wrapper_graph(gm, inputs, outputs, tangents, (), wide, _NamedCalls(mesh_keys))
    key = _grads_key(wrapped, local_inputs)
    in_meshes = [s.spec.mesh if s.spec is not None else None for s in inputs]

    def compile_recording(aot_cache: bool = True) -> tuple[Any, list[list], bool]:
        """(compiled, what its trace recorded, whether AOTAutogradCache served it: nothing traced)."""
        records: list[list] = [[] for _ in inputs]
        before = cache_keys.CacheCounts.now()
        with _cacheable_scope(), _recorded(records), functorch_config.patch(
                enable_autograd_cache=functorch_config.enable_autograd_cache and aot_cache):
            compiled = compile_one(wrapped, list(local_inputs), as_is=True)
        return compiled, records, cache_keys.CacheCounts.now().since(before).aot_hit > 0

    compiled, records, hit = compile_recording()
    source = "the trace"
    loaded = _load_grads(key, in_meshes) if hit else None
    if loaded is not None:
        records, source = loaded, "the border's gradient file (AOTAutogradCache hit)"
    elif hit:
        compiled, records, _ = compile_recording(aot_cache=False)
        source = "the trace (AOTAutogradCache hit without a gradient file)"
    if loaded is None:
        entries = encode_records(records)
        if entries is not None:
            _save_grads(key, entries)
    cache_keys.log.info("DTensor border, AOTAutograd's runtime: input gradients' placements from %s", source)
    return CacheableBorder(compiled.fn, gm, p, records, tangents, example_inputs, source)
