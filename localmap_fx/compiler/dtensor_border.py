"""A lean DTensor border for a compiled graph.

A graph whose inputs or outputs are DTensors (a block compiled on its own by
``block.compile(backend="localmap_fx")``, or a whole model) normally runs
through AOTAutograd's subclass runtime on every call: flatten and unflatten
every DTensor, coerce every tangent to the placements it was traced with
(``process_runtime_tangent``: an eager ``redistribute`` when the gradient
arriving at a ``Replicate`` output is ``Partial``, i.e. one all_reduce per
block per backward outside the compiled code), and rebuild specs.  Here the
graph is compiled at the local level instead and run by one
``autograd.Function`` that takes DTensors and returns DTensors::

    AOTAutograd (per call)                       DTensorBorder (per call)
    ----------------------                       ------------------------
    flatten inputs, unflatten outputs,           local tensors out of the inputs
    DTensorSpec rebuilt per output,              (placements and shape checked),
    tangents coerced to traced placements        compiled forward, outputs wrapped in
    (eager redistribute), backward,              specs built at compile time; backward:
    gradients rebuilt as DTensors                the compiled backward for the placements
                                                 the gradients really have

What is compiled is the Dynamo graph behind a local-level wrapper
(:mod:`.border_wrapper`), for the tangent placements a plan picks before the
compile (:mod:`.tangent_plan`); its AOT forward and backward are kept and run
as a :class:`~localmap_fx.layer_sharing.runtime.CompiledLayer` (same
checks: no input written, no aliased output, no effect tokens or RNG state,
static sizes).  Anything else returns a :class:`Refusal` and the graph keeps
AOTAutograd's runtime.  This module compiles the variants and runs them::

    border_wrapper.wrapper_graph   the graph, at the local level
    tangent_plan.plan_tangents     which tangents to compile it for (eager runs on fakes)
    dtensor_border.dtensor_border  compile; DTensorBorder picks a backward per arriving gradient

Note: [A backward per tangent placement]
    The placements of a gradient arriving at an output are known only when
    the backward runs (in a regional TP stack: ``Partial`` from the next
    block's region, ``Replicate`` for the last block, whose gradient comes
    from the loss).  The border traces its first variant with the
    placements AOTAutograd assumes (:func:`default_tangent`).  A gradient
    in other placements gets a backward of its own, compiled once, at the
    first backward that sees them: the same wrapper graph, with
    ``to_local(grad_placements=<seen>)`` on that output, so the reduction
    (if any) happens in compiled code, in the order eager DTensor does it.
    Its forward must save what the first variant's does (the values saved,
    by name and layout: :func:`_saved_signature`); then its backward reads
    what the first variant's forward saved, whatever block called it.  When
    it does not, the gradient is redistributed to the traced placements, as
    AOTAutograd does.
    A gradient is never read as a local tensor in placements it does not
    have.

Note: [The tangent's all_reduce belongs to the border]
    The TP block's backward compiled for a Partial gradient starts with its
    sum over the mesh (``Partial -> Replicate``, before the row region's
    local backward).  The last block of a stack receives the loss's
    Replicate gradient: converted to Partial (``g / n``), the compiled
    backward summed it back to ``g``: one all_reduce per step more than
    eager and upstream (32 against 31 in a 16-layer stack).  So the variant
    compiled for a guessed tangent has that sum taken out of its backward
    graph (:func:`~localmap_fx.passes.hoist_tangent_reductions.hoist_tangent_reductions`:
    its result becomes a placeholder after the tangents) and the border
    supplies it: for a gradient that arrived Partial, the same functional
    all_reduce over the same group (the same values, the same collective
    count); for one whose conversion the sum undoes (a lone ``Replicate ->
    Partial`` over that group, :meth:`Conversion.undone_by`), the gradient
    as it arrived, which is what eager's backward reads there.  The other
    uses of the tangent (the residual's) keep the converted value.  Only
    the planned guess is compiled so: a default variant's arrivals are its
    own placements, and the sum would only move out of compiled code::

        before:  bw(saved, g/2) = ... wait(all_reduce(g/2)) ...    last block: 1 collective
        after:   bw(saved, g/2, g)                                 last block: none
                 bw(saved, p, wait(all_reduce(p)))                 other blocks: 1, as before

Note: [The border's hot path]
    A regional stack calls one border once per block per step, so its
    per-call Python is paid as often as the compiled code runs.  Everything
    a call reads is built at compile time (which inputs to unwrap, which
    outputs to wrap and their specs, per backward its tangent layouts and
    the specs of the input gradients), and a call checks only what can
    change: each DTensor input's type, placements and shape; each
    gradient's type and local shape.  Two torch costs are avoided:
    comparing placements of different classes (``Partial() != Replicate()``
    costs ~3 µs in torch 2.14, pybind), which picking the backward for the
    arriving gradient did per call; and ``DTensor.__init__``, a no-op behind
    ``torch._disable_dynamo`` (:func:`_new_dtensor`).  The backward is
    picked by the identity of the placements tuples that arrived (a spec
    the border built for the next block's input gradient, or one DTensor's
    sharding propagation reuses, arrives as the same object each step);
    the tuples are kept alive while remembered, so an identity is never
    reused by another tuple, and at most ``_SEEN`` are remembered (a
    gradient built anew each step misses and is compared by value).
    Costs per call are in docs/benchmarks.md (the lean border's section).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from .._torch_compat import FakeTensor, get_current_graph_task_keep_graph
from ..layer_sharing.runtime import CompiledLayer, Refusal, _as_traced, compile_with_metadata, compiled_layer
from ..passes.hoist_tangent_reductions import REDUCTION, TangentReduction, hoist_tangent_reductions
from .border_wrapper import Placements, Slot, default_tangent, wrapper_graph
from .conversions import Conversion, plan_conversion
from .conversions import new_dtensor as _new_dtensor
from .specs import decode_records, encode_placements, encode_records, make_spec
from .tangent_plan import (
    TangentPlan,
    chained_outputs,
    converts_locally,
    eager_runs,
    guessed_tangents,
    placements_text,
    plan_tangents,
)

if TYPE_CHECKING:
    from .inner import AotGraph, CompileOne

__all__ = ["BorderRefused", "DTensorBorder", "dtensor_border"]


class BorderRefused(enum.Enum):
    """Why a graph keeps AOTAutograd's DTensor runtime (the :class:`Refusal` code)."""

    NO_DTENSOR = "no_dtensor"
    NO_DTENSOR_OUT = "no_dtensor_out"
    ALIAS = "alias"
    SUBCLASS = "subclass"
    SYMBOLIC = "symbolic"
    MESH = "mesh"
    NO_GRAD = "no_grad"
    NO_FAKE_MODE = "no_fake_mode"
    ATTRIBUTES = "attributes"
    OUTPUT = "output"


@dataclasses.dataclass
class _Variant:
    """One compile of the wrapper graph: tangent placements -> compiled layer + input-gradient specs."""

    tangents: tuple[Placements | None, ...]  # per graph output (None: plain output)
    layer: CompiledLayer
    in_grad_specs: list  # per graph input: the spec its gradient gets (None: no gradient / plain)
    in_grad_wide: list  # per graph input: its gradient leaves through its wide slot
    saved: tuple  # _saved_signature: what its backward reads from the forward
    # loaded from Inductor's cache, nothing traced (Note: [A kept compile restarts from Inductor's cache])
    restored: bool = False


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def _slots(example_inputs: Sequence[Any], out_vals: Sequence[Any]) -> tuple[list[Slot], list[Slot]] | Refusal:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from .._torch_compat import is_traceable_wrapper_subclass

    # The specs built here are given to every DTensor the border makes, so
    # their mesh must be the user's object: a traced value's mesh can be a
    # fake stand-in (FakeScriptObject), equal to it but not it.
    real = [m for v in example_inputs for m in (v.device_mesh if isinstance(v, DTensor) else v,)
            if isinstance(m, DeviceMesh)]

    def slot(v: Any, where: str) -> Slot | Refusal:
        if isinstance(v, DTensor):
            local = v._local_tensor
            if is_traceable_wrapper_subclass(local):
                return Refusal(BorderRefused.SUBCLASS, f"{where}: a DTensor over a {type(local).__name__}")
            if not (_static(v) and _static(local)):
                return Refusal(BorderRefused.SYMBOLIC, f"{where}: a DTensor with symbolic sizes")
            mesh = next((m for m in real if m is v.device_mesh), None) or next(
                (m for m in real if m == v.device_mesh), None)
            if mesh is None:
                return Refusal(BorderRefused.MESH, f"{where}: its mesh is no mesh among the inputs")
            return Slot(make_spec(mesh, v.placements, v.shape, v.stride(), v.dtype), tuple(v.shape))
        if is_traceable_wrapper_subclass(v):
            return Refusal(BorderRefused.SUBCLASS, f"{where}: a {type(v).__name__}")
        if isinstance(v, torch.Tensor) and not _static(v):
            return Refusal(BorderRefused.SYMBOLIC, f"{where}: a tensor with symbolic sizes")
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return Refusal(BorderRefused.SYMBOLIC, f"{where}: a symbolic scalar")
        return Slot(None)

    ins, outs = [], []
    for i, v in enumerate(example_inputs):
        s = slot(v, f"input {i}")
        if isinstance(s, Refusal):
            return s
        ins.append(s)
    for i, v in enumerate(out_vals):
        if not isinstance(v, torch.Tensor):
            return Refusal(BorderRefused.OUTPUT, f"output {i} is a {type(v).__name__}, not a tensor")
        s = slot(v, f"output {i}")
        if isinstance(s, Refusal):
            return s
        outs.append(s)
    if all(s.spec is None for s in (*ins, *outs)):
        return Refusal(BorderRefused.NO_DTENSOR, "no DTensor crosses the border")
    if all(s.spec is None for s in outs):
        # DTensors in, local tensors out: typically to_local views of the
        # inputs (a split frame's first piece), which AOTAutograd's metadata
        # would show as aliased outputs only after a wasted compile
        return Refusal(BorderRefused.NO_DTENSOR_OUT, "no output is a DTensor")
    return ins, outs


def _shared_storage(in_vals: Sequence[Any], out_vals: Sequence[Any]) -> str | None:
    """Which output is a view or shares storage with an input or an earlier output (traced values).

    AOTAutograd's metadata says so too, but only after a compile that the
    border would then throw away (a frame cut by a graph break returns a
    DTensor and its local tensor).
    """
    from ..analysis import storage_key

    seen = {k: f"input {i}" for i, k in enumerate(storage_key(v) for v in in_vals) if k is not None}
    for i, v in enumerate(out_vals):
        local = getattr(v, "_local_tensor", v)
        if isinstance(local, torch.Tensor) and local._is_view():
            # a view of an intermediate (from_local of a region's result):
            # AOTAutograd's runtime regenerates it, a CompiledLayer refuses it
            return f"output {i} is a view"
        k = storage_key(v)
        if k is None:
            continue
        if k in seen:
            return f"output {i} shares storage with {seen[k]}"
        seen[k] = f"output {i}"
    return None


def _compile_planned(gm: fx.GraphModule, local_inputs: Sequence[Any], fake_mode: Any, compile_one: CompileOne,
                     inputs: Sequence[Slot], outputs: Sequence[Slot], example_inputs: Sequence[Any],
                     wide: Sequence[int], cache: bool = False) -> tuple[_Variant | Refusal, TangentPlan]:
    """The :class:`TangentPlan` and its first variant, compiled once (Note:
    [The gradient a stack sends back]).

    An output that feeds an input of the same spec in the next call (a
    stack's block) may be compiled for the guessed tangents
    (:func:`guessed_tangents`); eager DTensor run on the fakes for both
    (:func:`eager_runs`) says which (:func:`plan_tangents`).
    """
    default = tuple(None if s.spec is None else default_tangent(s.spec.placements) for s in outputs)
    chained = chained_outputs(inputs, outputs, example_inputs)
    guess = guessed_tangents(default, chained)
    if guess == default:
        plan = TangentPlan(default)
    else:
        try:
            runs = eager_runs(gm, local_inputs, fake_mode, inputs, outputs, (guess, default), wide)
        except Exception as e:  # noqa: BLE001  (any failure: the default, always correct, and the reason shown)
            plan = TangentPlan(default, unplanned=f"eager DTensor could not run the graph on fake values "
                                                   f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})")
        else:
            plan = plan_tangents(default, guess, chained, runs)
    # a stack's last block sends what the default assumes: its reduction is
    # the border's to skip (Note: [The tangent's all_reduce belongs to the border])
    return _compile_variant(gm, local_inputs, fake_mode, compile_one, inputs, outputs, plan.first, wide,
                            hoist=plan.first != default, cache=cache), plan


_SEEN = 16  # identities of arrived placements remembered per border


@dataclasses.dataclass(frozen=True)
class _Backward:
    """What a backward call reads for one tangent placement, built once (Note: [The border's hot path])."""

    variant: _Variant
    # per tangent: (output index, local size, stride, dtype, device)
    tangents: tuple[tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device], ...]
    # per DTensor input: (input index, where the backward returns its gradient,
    # the spec the gradient gets; None: its trace recorded none)
    wraps: tuple[tuple[int, int, Any], ...]
    # the gradients must first be redistributed to the first variant's placements
    redistribute: bool
    # with redistribute: per DTensor output whose gradient arrives in other
    # placements, (output index, its conversion to the first variant's)
    to_first: tuple[tuple[int, Conversion], ...] = ()
    # per input gradient then redistributed: input index -> its conversion to
    # the placements the arriving tangents give it in eager (Note: [The
    # gradient a stack sends back])
    regrad: dict[int, Conversion] = dataclasses.field(default_factory=dict)
    # per reduction hoisted out of the backward (Note: [The tangent's all_reduce
    # belongs to the border]): (tangent position, output index, the reduction,
    # whether the gradient that arrived is its result already)
    reductions: tuple[tuple[int, int, TangentReduction, bool], ...] = ()

    @staticmethod
    def of(variant: _Variant, inputs: Sequence[Slot], wide: Sequence[int], redistribute: bool,
           to_first: Sequence[tuple[int, Conversion]] = (), regrad: dict[int, Conversion] | None = None) -> _Backward:
        layer = variant.layer
        tangents = tuple((i, torch.Size(size), stride, dtype, device) for i, (size, stride), (dtype, device)
                         in zip(layer.differentiable, layer.tangent_layouts, layer.tangent_types))
        slot = {i: len(inputs) + k for k, i in enumerate(wide)}
        wraps = tuple((i, slot[i] if is_wide else i, spec) for i, (spec, is_wide, s)
                      in enumerate(zip(variant.in_grad_specs, variant.in_grad_wide, inputs)) if s.spec is not None)
        converts = dict(to_first)
        reductions = tuple(
            (r.tangent, layer.differentiable[r.tangent], r,
             (c := converts.get(layer.differentiable[r.tangent])) is not None and c.undone_by(r.reduce_op, r.group_name))
            for r in layer.reductions)
        return _Backward(variant, tangents, wraps, redistribute, tuple(to_first), dict(regrad or {}), reductions)


class DTensorBorder:
    """A compiled graph run between DTensors (Note: [A backward per tangent placement])."""

    def __init__(self, gm: fx.GraphModule, local_inputs: list, fake_mode: Any, compile_one: CompileOne,
                 inputs: Sequence[Slot], outputs: Sequence[Slot], first: _Variant, wide: tuple[int, ...] = (),
                 wide_values: tuple[torch.Tensor, ...] = (), plan: TangentPlan | None = None,
                 cache: bool = False) -> None:
        self._gm = gm
        self._cache = cache  # Note: [A kept compile restarts from Inductor's cache]
        self._local_inputs = local_inputs
        # Note: [A gradient wider than its input]: the inputs with a wide slot,
        # and what the compiled forward is given there (never read)
        self.wide = wide
        self._wide_values = wide_values
        # Note: [The gradient a stack sends back]: which tangents first is
        # compiled for, and what the border knows of the others
        self.plan = plan if plan is not None else TangentPlan(first.tangents)
        self._fake_mode = fake_mode
        self._compile_one = compile_one
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.first = first
        # tangent placements -> a variant whose backward reads first's saved values, or None
        # (its forward differs: such gradients are redistributed to first's placements)
        self.variants: dict[tuple, _Variant | None] = {first.tangents: first}
        # Note: [The border's hot path]: everything a call reads, built once
        self._in_checks = _input_checks(inputs)
        self._dt_inputs = tuple(i for i, s in enumerate(inputs) if s.spec is not None)
        self._out_specs = tuple((i, s.spec) for i, s in enumerate(outputs) if s.spec is not None)
        layer = first.layer
        self._non_differentiable = tuple(i for i in range(layer.n_outputs) if i not in layer.differentiable)
        # the forward's saved values are all tensors: save_for_backward alone
        self._tensors_only = not (layer.n_opaque or layer.n_symints)
        self._dt_grads = tuple(i for i in layer.differentiable if outputs[i].spec is not None)
        # tangent placements -> its _Backward; by the identity of the placements
        # tuples that arrived (a spec the border or DTensor's sharding
        # propagation reuses): (those tuples, kept alive, and the _Backward)
        self._backwards: dict[tuple, _Backward] = {}
        self._seen: dict[tuple[int, ...], tuple[tuple, _Backward]] = {}

    def text(self) -> str:
        seen = ", ".join(self._variant_text(t, v) for t, v in self.variants.items())
        return f"DTensor border: {sum(s.spec is not None for s in self.inputs)} DTensor inputs, " \
               f"{sum(s.spec is not None for s in self.outputs)} DTensor outputs; backward for tangents {seen} " \
               f"(planned: {self.plan.text()})"

    def _variant_text(self, tangents: tuple, variant: _Variant | None) -> str:
        """``(P)`` (``(P) restored``: from Inductor's cache), or ``(P) (redistributed:
        P->R@tp:all_reduce; input 3: S(0)->P@tp:embed)`` for a converted one."""
        if variant is not None:
            return placements_text(tangents) + (" restored" if variant.restored else "")
        bw = self._backwards.get(tangents)
        steps = [] if bw is None else [c.text() for _, c in bw.to_first] + [
            f"input {i}: {c.text()}" for i, c in bw.regrad.items()]
        return f"{placements_text(tangents)} (redistributed{': ' + '; '.join(steps) if steps else ''})"

    def __call__(self, *args: Any) -> tuple:
        check_inputs(self._in_checks, args)
        return _BorderFunction.apply(self, *args)

    def backward_for(self, grads: Sequence[Any]) -> _Backward:
        """The backward for the placements of ``grads`` (one per graph output)."""
        arrived: list[Placements | None] = []
        for i in self._dt_grads:
            g = grads[i]
            if g is None:
                arrived.append(None)
                continue
            check_grad(i, g)
            arrived.append(g.placements)
        key = tuple(map(id, arrived))
        hit = self._seen.get(key)
        if hit is not None:
            return hit[1]
        seen = list(self.first.tangents)
        for i, p in zip(self._dt_grads, arrived):
            if p is not None:
                seen[i] = p
        tangents = tuple(seen)
        bw = self._backwards.get(tangents)
        if bw is None:
            if tangents in self.plan.converted or tangents != self.first.tangents and all(
                    a is None or t is None or converts_locally(a, t) for a, t in zip(tangents, self.first.tangents)):
                # Note: [The gradient a stack sends back]: converted, not compiled for
                self.variants.setdefault(tangents, None)
            variant = self.variant_for(tangents)
            bw = _Backward.of(variant if variant is not None else self.first, self.inputs, self.wide,
                              redistribute=variant is None, **(self._conversions(tangents) if variant is None else {}))
            self._backwards[tangents] = bw
        if len(self._seen) >= _SEEN:
            # fresh placements every step (a gradient built anew each time): start over
            self._seen.clear()
        self._seen[key] = (tuple(arrived), bw)
        return bw

    def _conversions(self, tangents: tuple) -> dict:
        """A converted gradient's conversions, planned once (Note: [The gradient
        a stack sends back]): to the first variant's tangents, and of the input
        gradients whose placements eager gives otherwise for ``tangents``."""
        to_first = tuple((i, plan_conversion(_respec(s.spec, a), _respec(s.spec, t)))
                         for i, (s, a, t) in enumerate(zip(self.outputs, tangents, self.first.tangents))
                         if s.spec is not None and a is not None and t is not None and tuple(a) != tuple(t))
        wanted = dict(self.plan.traced).get(tangents, ())
        return {"to_first": to_first, "regrad": regrad_conversions(wanted, self.first.in_grad_specs)}

    def variant_for(self, tangents: tuple) -> _Variant | None:
        """The variant for gradients in ``tangents`` (compiled at the first call), None if unusable."""
        if tangents in self.variants:
            return self.variants[tangents]
        v = _compile_variant(self._gm, self._local_inputs, self._fake_mode, self._compile_one,
                             self.inputs, self.outputs, tangents, self.wide, cache=self._cache)
        first = self.first.layer
        usable = (not isinstance(v, Refusal) and v.saved == self.first.saved
                  and (v.layer.n_outputs, v.layer.n_opaque, v.layer.n_symints)
                  == (first.n_outputs, first.n_opaque, first.n_symints)
                  and v.layer.differentiable == first.differentiable)
        self.variants[tangents] = v if usable and not isinstance(v, Refusal) else None
        return self.variants[tangents]


def _input_checks(inputs: Sequence[Slot]) -> tuple:
    """Per DTensor input: (index, traced placements, traced shape), what a call checks."""
    return tuple((i, s.spec.placements, torch.Size(s.shape)) for i, s in enumerate(inputs) if s.spec is not None)


def check_inputs(checks: tuple, args: Sequence[Any]) -> None:
    """Raise when an input is not the DTensor ``checks`` (:func:`_input_checks`) traced."""
    for i, placements, shape in checks:
        a = args[i]
        if type(a) is not DTensor or a.placements != placements or a.shape != shape:
            got = f"{type(a).__name__} {getattr(a, 'placements', '')} {tuple(getattr(a, 'shape', ()))}"
            raise RuntimeError(
                f"localmap_fx: input {i} of a compiled graph is {got}, traced as DTensor {placements} "
                f"{tuple(shape)}; the compiled code would misread it")


def check_grad(i: int, g: Any) -> None:
    """Raise when the gradient ``g`` arriving at DTensor output ``i`` is no DTensor."""
    if not isinstance(g, DTensor):
        raise RuntimeError(
            f"localmap_fx: the gradient of output {i} of a compiled graph is a {type(g).__name__}, "
            f"not a DTensor like the output")


def regrad_conversions(wanted: Sequence[Any], got: Sequence[Any]) -> dict[int, Conversion]:
    """Input -> the conversion of its gradient: where eager gives placements
    ``wanted[i]`` other than the traced spec ``got[i]`` (Note: [The gradient
    a stack sends back])."""
    return {i: plan_conversion(g, _respec(g, tuple(w))) for i, (w, g) in enumerate(zip(wanted, got))
            if w is not None and g is not None and tuple(w) != tuple(g.placements)}


def _local_examples(example_inputs: Sequence[Any], inputs: Sequence[Slot], fake_mode: Any) -> list:
    """Fake values for the wrapper's placeholders: a DTensor's local tensor, requiring grad as the DTensor does.

    Dynamo hands real tensors (AOTAutograd fakes them); the border keeps
    fakes only, for the variants it compiles later.
    """
    out = []
    for v, s in zip(example_inputs, inputs):
        t = v._local_tensor if s.spec is not None else v
        if isinstance(t, torch.Tensor):
            if not isinstance(t, FakeTensor):
                t = fake_mode.from_tensor(t, static_shapes=True)
            with fake_mode:
                t = t.detach().requires_grad_(v.requires_grad)
        out.append(t)
    return out


def _compile_variant(gm: fx.GraphModule, local_inputs: Sequence[Any], fake_mode: Any, compile_one: CompileOne,
                     inputs: Sequence[Slot], outputs: Sequence[Slot], tangents: tuple,
                     wide: Sequence[int] = (), hoist: bool = False, cache: bool = False) -> _Variant | Refusal:
    """``gm``'s wrapper for ``tangents`` compiled by ``compile_one`` with its AOT graphs; ``hoist``: its
    backward's all_reduce of a tangent left to the border (Note: [The tangent's all_reduce belongs to the border]);
    ``cache``: restored from, and saved to, Inductor's cache (Note: [A kept compile restarts from Inductor's cache])."""
    from . import layer_cache

    records: list[list] = [[] for _ in inputs]
    wrapped = wrapper_graph(gm, inputs, outputs, tangents, records, wide)
    about = _variant_about(inputs, outputs, tangents, wide, hoist) if cache else None
    key = layer_cache.layer_key(wrapped, local_inputs, about) if about is not None else None
    if key is not None:
        restored = _restored_variant(layer_cache.load_layer(key, fake_mode), inputs, tangents)
        if restored is not None:
            return restored
    compiled, fw_metadata = compile_with_metadata(compile_one, wrapped, list(local_inputs), True, fake_mode,
                                                  (hoist_tangent_reductions,) if hoist else ())
    layer = compiled_layer(compiled.aot_graphs, fw_metadata)
    if isinstance(layer, Refusal):
        return layer
    variant = _Variant(tangents, layer, [r[0] if r else None for r in records], [bool(r and r[1]) for r in records],
                       _saved_signature(compiled.aot_graphs))
    grads = encode_records(records)
    if key is not None and grads is not None:
        layer_cache.save_layer(key, compiled.aot_graphs, layer, {"grads": grads, "saved": _saved_json(variant.saved)})
    return variant


def _variant_about(inputs: Sequence[Slot], outputs: Sequence[Slot], tangents: tuple, wide: Sequence[int],
                   hoist: bool) -> list | None:
    """What a variant's wrapper code does not say (its closures' specs), as
    JSON for its cache key; None when a mesh or placement has no text."""
    from . import cache_keys

    def slot(s: Slot) -> list | None:
        if s.spec is None:
            return None
        mesh, placements = cache_keys.portable_mesh_key(s.spec.mesh), encode_placements(s.spec.placements)
        if mesh is None or placements is None:
            raise ValueError
        meta = s.spec.tensor_meta
        return [mesh, placements, list(meta.shape), list(meta.stride), str(meta.dtype), list(s.shape)]

    try:
        about = [[slot(s) for s in inputs], [slot(s) for s in outputs], list(wide), hoist]
        texts = [None if t is None else encode_placements(t) for t in tangents]
    except ValueError:
        return None
    if any(t is None and p is not None for t, p in zip(texts, tangents)):
        return None
    return [*about, texts]


def _saved_json(saved: tuple) -> list:
    return [[name, layout if isinstance(layout, str) else [list(layout[0]), list(layout[1]), str(layout[2])]]
            for name, layout in saved]


def _saved_from_json(entries: list) -> tuple:
    """:func:`_saved_signature`'s tuple from :func:`_saved_json`'s list."""
    out: list[tuple] = []
    for name, layout in entries:
        if isinstance(layout, str):
            out.append((name, layout))
            continue
        shape, stride, dtype = layout
        dt = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"no dtype {dtype!r}")
        out.append((name, (tuple(shape), tuple(stride), dt)))
    return tuple(out)


def _restored_variant(restored: tuple[CompiledLayer, Any] | None, inputs: Sequence[Slot],
                      tangents: tuple) -> _Variant | None:
    """The variant of a layer restored from the cache (its record: input gradients, saved signature)."""
    if restored is None:
        return None
    layer, record = restored
    try:
        records = decode_records(record["grads"], [s.spec.mesh if s.spec is not None else None for s in inputs])
        saved = _saved_from_json(record["saved"])
    except (KeyError, TypeError, ValueError):
        return None
    if records is None:
        return None
    return _Variant(tangents, layer, [r[0] if r else None for r in records], [bool(r and r[1]) for r in records],
                    saved, restored=True)


def _wrapper_examples(example_inputs: Sequence[Any], inputs: Sequence[Slot], fake_mode: Any) -> tuple[list, tuple]:
    """The wrapper's example inputs (local fakes, then one per wide slot) and
    the inputs with a wide slot (Note: [A gradient wider than its input])."""
    wide = _wide_inputs(example_inputs, inputs)
    local_inputs = _local_examples(example_inputs, inputs, fake_mode)
    with fake_mode:
        local_inputs += [_wide_value(example_inputs[i]).requires_grad_() for i in wide]
    return local_inputs, wide


def _fake_mode_of(example_inputs: Sequence[Any], inputs: Sequence[Slot]) -> Any:
    """The fake mode of the examples' (local) tensors, else the tracing context's (None outside Dynamo)."""
    from .._torch_compat import detect_fake_mode

    # the examples' own mode first: a piece's examples are fakes of a mode
    # other than the tracing context's
    return next((t.fake_mode for v, s in zip(example_inputs, inputs)
                 for t in (v._local_tensor if s.spec is not None else v,) if isinstance(t, FakeTensor)),
                None) or detect_fake_mode([v for v in example_inputs if isinstance(v, torch.Tensor)])


def _wide_inputs(example_inputs: Sequence[Any], inputs: Sequence[Slot]) -> tuple[int, ...]:
    """The DTensor inputs that require grad and whose local tensor is smaller than
    the DTensor (Note: [A gradient wider than its input])."""
    return tuple(i for i, (v, s) in enumerate(zip(example_inputs, inputs))
                 if s.spec is not None and v.requires_grad and tuple(v._local_tensor.shape) != s.shape)


def _wide_value(v: Any) -> torch.Tensor:
    """A wide slot's value: the DTensor's global shape over one element (nothing reads it)."""
    return torch.empty((), dtype=v.dtype, device=v._local_tensor.device).expand(v.shape).detach()


def _saved_signature(aot_graphs: Sequence[AotGraph]) -> tuple:
    """What the backward reads from the forward: its saved placeholders' names and layouts.

    Every variant traces the same forward first (a tangent enters only
    backward nodes), so a name means the same forward value in each; the
    placeholders are what Inductor's passes leave untouched.
    """
    bw_gm = next(a.graph for a in aot_graphs if a.kind == "backward")
    sig = []
    for n in bw_gm.graph.find_nodes(op="placeholder"):
        if n.name.startswith("tangents") or REDUCTION in n.meta:
            continue
        v = n.meta.get("val")
        layout = (tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        sig.append((n.name, layout))
    return tuple(sig)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What the border learns of a graph before compiling it (:func:`prepare`)."""

    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    fake_mode: Any
    local_inputs: list  # the wrapper's example inputs (:func:`_wrapper_examples`)
    wide: tuple[int, ...]  # the inputs with a wide slot (Note: [A gradient wider than its input])


def prepare(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Prepared | Refusal:
    """The slots and examples of ``gm``'s wrapper, or why no DTensor border can run it."""
    from ..graph_utils import node_value

    if not torch.is_grad_enabled():
        return Refusal(BorderRefused.NO_GRAD, "compiled under no_grad: AOTAutograd's inference runtime is already lean")
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return Refusal(BorderRefused.ATTRIBUTES, "the graph holds parameters or buffers")
    for n in gm.graph.find_nodes(op="get_attr"):
        v = getattr(gm, str(n.target), None)
        if isinstance(v, torch.Tensor):
            return Refusal(BorderRefused.ATTRIBUTES, f"the graph reads tensor attribute {n.target}")
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)) or not all(isinstance(o, fx.Node) for o in outs):
        return Refusal(BorderRefused.OUTPUT, "the graph's outputs are not a flat tuple of values")
    out_vals = [node_value(o) for o in outs]
    slots = _slots(example_inputs, out_vals)
    if isinstance(slots, Refusal):
        return slots
    shared = _shared_storage([node_value(p) for p in gm.graph.find_nodes(op="placeholder")], out_vals)
    if shared is not None:
        return Refusal(BorderRefused.ALIAS, shared)
    inputs, outputs = slots
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in example_inputs):
        return Refusal(BorderRefused.NO_GRAD, "no input requires grad")
    fake_mode = _fake_mode_of(example_inputs, inputs)
    if fake_mode is None:
        return Refusal(BorderRefused.NO_FAKE_MODE, "compiled outside Dynamo (no fake mode)")
    local_inputs, wide = _wrapper_examples(example_inputs, inputs, fake_mode)
    return Prepared(tuple(inputs), tuple(outputs), fake_mode, local_inputs, tuple(wide))


def dtensor_border(gm: fx.GraphModule, example_inputs: Sequence[Any], compile_one: CompileOne,
                   prepared: Prepared | None = None, cache: bool = False) -> DTensorBorder | Refusal:
    """Compile ``gm`` behind a lean DTensor border, or say why it keeps AOTAutograd's runtime.

    ``compile_one`` is :func:`localmap_fx.compiler.inner.inner_compiler`'s
    (it must keep the AOT graphs: inductor or aot_eager); ``prepared``:
    :func:`prepare`'s answer, if already asked; ``cache``: its compiles are
    restored from and saved to Inductor's cache (Note: [A kept compile
    restarts from Inductor's cache]: torch's caches are on and nobody asked
    for the AOT graphs).
    """
    p = prepared if prepared is not None else prepare(gm, example_inputs)
    if isinstance(p, Refusal):
        return p
    first, plan = _compile_planned(gm, p.local_inputs, p.fake_mode, compile_one, p.inputs, p.outputs,
                                   example_inputs, p.wide, cache)
    if isinstance(first, Refusal):
        return first
    return DTensorBorder(gm, p.local_inputs, p.fake_mode, compile_one, p.inputs, p.outputs, first, p.wide,
                         tuple(_wide_value(example_inputs[i]) for i in p.wide), plan, cache)


_TENSOR = object()

_DONATED = (
    "This backward function was compiled with non-empty donated buffers which requires "
    "create_graph=False and retain_graph=False. Please keep backward(create_graph=False, "
    "retain_graph=False) across all backward() function calls, or set "
    "torch._functorch.config.donated_buffer=False to disable donated buffer."
)


class _BorderFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, border: DTensorBorder, *args: Any):
        layer = border.first.layer
        local = list(args)
        for i in border._dt_inputs:
            local[i] = local[i]._local_tensor
        local += border._wide_values
        flat = layer.forward(local)
        n = layer.n_outputs
        outs = list(flat[:n])
        for i, spec in border._out_specs:
            outs[i] = _new_dtensor(outs[i], spec)
        results = tuple(outs)
        if border._non_differentiable:
            ctx.mark_non_differentiable(*(results[i] for i in border._non_differentiable))
        if border._tensors_only:
            ctx.save_for_backward(*flat[n:])
            ctx.others = None
        else:
            _, saved = layer.split(flat)
            ctx.save_for_backward(*(v for v in saved if isinstance(v, torch.Tensor)))
            ctx.others = [_TENSOR if isinstance(v, torch.Tensor) else v for v in saved]
        ctx.border = border
        ctx.set_materialize_grads(False)
        return results

    # Note: [A compiled backward is no frame for Dynamo]
    #     The autograd engine runs this on the thread that called backward(),
    #     and a backward() that a compiled frame graph-broke on (a whole
    #     training step compiled) runs with Dynamo's frame hook still set:
    #     Dynamo then traced this code and Inductor's output code under it
    #     (a graph of its in-place all_reduce_, which AOTAutograd refuses).
    #     AOTAutograd's own runtime lives in torch files Dynamo skips.
    @staticmethod
    @torch.compiler.disable(reason="a compiled graph's backward runs as compiled")
    def backward(ctx, *grads: Any):
        if torch.is_grad_enabled():
            # create_graph=True: the compiled backward has no backward of its
            # own, and gradients that silently stop here would be misread
            # (AOTAutograd raises the same when the double backward runs)
            raise RuntimeError("torch.compile with aot_autograd does not currently support double backward")

        border: DTensorBorder = ctx.border
        bw = border.backward_for(grads)
        arrived = grads
        if bw.redistribute:
            # Note: [A backward per tangent placement]: AOTAutograd's way
            converted = list(grads)
            for i, convert in bw.to_first:
                g = converted[i]
                if g is not None:
                    converted[i] = convert(g._local_tensor)
            grads = tuple(converted)
        layer = bw.variant.layer
        if layer.donates_buffers and get_current_graph_task_keep_graph():
            raise RuntimeError(_DONATED)
        if ctx.others is None:
            args = list(ctx.saved_tensors)
        else:
            tensors = iter(ctx.saved_tensors)
            args = [next(tensors) if v is _TENSOR else v for v in ctx.others]
            del tensors
        ctx.maybe_clear_saved_tensors()
        first_tangent = len(args)
        for i, size, stride, dtype, device in bw.tangents:
            g = grads[i]
            if g is None:
                args.append(torch.empty_strided(size, stride, dtype=dtype, device=device).zero_())
                continue
            args.append(_local_tangent(i, g, size, stride))
        for k, i, r, arrived_reduced in bw.reductions:
            # Note: [The tangent's all_reduce belongs to the border]
            g = arrived[i]
            if arrived_reduced and g is not None:
                _, size, stride, _, _ = bw.tangents[k]
                args.append(r.viewed(_local_tangent(i, g, size, stride)))
            else:
                args.append(r.reduce(args[first_tangent + k]))
        out = list(layer.backward(args))
        n = len(border.inputs)
        for i, at, spec in bw.wraps:
            g = out[at]
            if g is not None:
                if spec is None:
                    raise AssertionError("a DTensor input got a gradient its trace did not record")
                regrad = bw.regrad.get(i) if bw.regrad else None
                out[i] = _new_dtensor(g, spec) if regrad is None else regrad(g)
        return (None, *out[:n])


def _local_tangent(i: int, g: Any, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """The local tensor of output ``i``'s gradient ``g``, in the layout its backward was traced with."""
    if isinstance(g, DTensor):
        g = g._local_tensor
    if g.shape != size:
        raise RuntimeError(
            f"localmap_fx: the gradient of output {i} of a compiled graph has local shape "
            f"{tuple(g.shape)}, its backward was compiled for {tuple(size)}")
    return g if g.stride() == stride or g.numel() <= 1 else _as_traced(g, (size, stride))


def _respec(spec: Any, placements: Placements) -> Any:
    """``spec`` with other placements (same mesh, global shape, stride, dtype)."""
    meta = spec.tensor_meta
    return make_spec(spec.mesh, placements, meta.shape, meta.stride, meta.dtype)
