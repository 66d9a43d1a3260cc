"""Run a shared layer as its compiled forward and backward, nothing else.

A shared piece (:mod:`.compile`) is compiled once per layer key and called
once per layer.  Through AOTAutograd's runtime every call pays for its
wrappers: subclass flattening, alias and mutation bookkeeping, RNG and
effect-token handling, tangent checks, where one whole-model graph pays
them once (the measured prices, per layer, are in Note: [When "auto"
shares layers] in :mod:`.decide`).  A layer piece needs none of it: plain
border tensors in, plain tensors out (Note: [A DTensor at a layer border
costs a collective] in :mod:`.borders`), no mutation, no alias.  So when
AOTAutograd's own metadata says so, the piece runs as a
:class:`CompiledLayer`, called in a :class:`LayerRun`: one lean
``autograd.Function`` that calls the compiled forward, saves what the
backward graph reads, and calls the compiled backward::

    AOTAutograd runtime (per layer)             LayerRun (per run of layers)
    -------------------------------             ----------------------------
    RuntimeWrapper -> EffectTokens ->           _RunFunction.apply
    FunctionalizedRng -> AOTDispatchSubclass      forward: outs, saved = fw(args) per layer
    -> CompiledFunction.apply(fw)                 backward: grads = bw(saved, tangents) per layer
    -> alias / mutation epilogue

Anything else (a piece AOTAutograd had to give a mutation epilogue, an
aliased output, tokens, symbolic sizes saved for backward, subclass
outputs) keeps AOTAutograd's runtime: :func:`compiled_layer` returns a
:class:`Refusal` instead of a layer, and the dump shows its text.

Note: [What a CompiledLayer relies on]
    AOTAutograd's partitioned graphs have a fixed calling convention:
    ``fw(*primals) -> (*outputs, *tensors, *objects, *sizes)`` and
    ``bw(*sizes, *tensors, *objects, *tangents) -> (grad per primal)``
    (objects: opaque values such as a process group; sizes: SymInts); the
    backward's placeholders are the saved values then one ``tangents_<i>``
    per differentiable output.  :func:`compiled_layer` reads the split from
    the backward graph and refuses a piece unless every output is a fresh
    tensor that gets a tangent, and no input is written.  Tangents are
    given the strides the backward was traced with (AOTAutograd does the
    same), so a non-contiguous incoming gradient is still valid.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._torch_compat import get_current_graph_task_keep_graph

if TYPE_CHECKING:
    import torch.fx as fx

    from ..compiler.inner import AotGraph, Compiled, CompileOne
    from .whole_gradients import WholeGradient

__all__ = ["CompiledLayer", "compiled_layer", "compile_with_metadata", "Refusal", "Refused", "LayerRun", "RunStep"]


class Refused(enum.Enum):
    """Why a compiled piece keeps AOTAutograd's runtime (:func:`compiled_layer`)."""

    SUBCLASS_AT_BORDER = "subclass_at_border"
    NO_BACKWARD = "no_backward"
    NO_METADATA = "no_metadata"
    WRITES_INPUT = "writes_input"
    ALIASED_OUTPUT = "aliased_output"
    EFFECTS = "effects"
    SUBCLASS_OUTPUT = "subclass_output"
    RNG = "rng"
    UNCHECKED_SAVED = "unchecked_saved"
    CALLING_CONVENTION = "calling_convention"
    SYMBOLIC_TANGENT = "symbolic_tangent"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A graph that cannot run as a :class:`CompiledLayer` (or behind the
    lean DTensor border): the code to branch on, and the text the dump shows."""

    code: enum.Enum  # Refused here; compiler.dtensor_border.BorderRefused for its own checks
    text: str


@dataclasses.dataclass(frozen=True)
class CompiledLayer:
    """One distinct layer's compiled forward and backward (boxed callables)."""

    forward: Callable[[list], Any]
    backward: Callable[[list], Any]
    n_outputs: int
    # per tangent: the (size, stride) the backward graph was traced with, and dtype / device
    tangent_layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    tangent_types: tuple[tuple[torch.dtype, torch.device], ...]
    # of the saved values: opaque objects (a process group, a mesh) and sizes, which
    # the forward returns after the tensors and the backward reads as
    # (*sizes, *tensors, *objects)
    n_opaque: int = 0
    n_symints: int = 0
    # the output each tangent belongs to; the others are not differentiable
    # (None: one tangent per output, in order)
    tangent_outputs: tuple[int, ...] | None = None
    # the backward may reuse saved buffers (AOTAutograd's bw_donated_idxs):
    # it must not run twice on one forward (retain_graph=True)
    donates_buffers: bool = False
    # tangent reductions taken out of the backward (passes/hoist_tangent_reductions):
    # it reads their values after the tangents, and its caller computes them
    reductions: tuple[Any, ...] = ()

    @functools.cached_property
    def differentiable(self) -> tuple[int, ...]:
        # read per call by the runs and the DTensor border: built once
        return self.tangent_outputs if self.tangent_outputs is not None else tuple(range(self.n_outputs))

    def split(self, flat: Sequence[Any]) -> tuple[tuple, list]:
        """The forward's flat result as (outputs, saved values in the backward's order)."""
        outs = tuple(flat[: self.n_outputs])
        saved = list(flat[self.n_outputs:])
        if self.n_opaque or self.n_symints:
            n_t = len(saved) - self.n_opaque - self.n_symints
            saved = saved[n_t + self.n_opaque:] + saved[:n_t] + saved[n_t:n_t + self.n_opaque]
        return outs, saved

    def __call__(self, *args: Any) -> tuple:
        """One call outside a run: a run of this one layer."""
        step = RunStep("layer", self, tuple(("in", i) for i in range(len(args))))
        return LayerRun((step,), len(args), tuple((0, k) for k in range(self.n_outputs)))(*args)


def _mark_non_differentiable(ctx, outs: Sequence[Any], differentiable: Sequence[int]) -> None:
    keep = set(differentiable)
    others = [o for i, o in enumerate(outs) if i not in keep and isinstance(o, torch.Tensor)]
    if others:
        ctx.mark_non_differentiable(*others)


def _as_traced(grad: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    size, stride = layout
    if tuple(grad.stride()) == stride or grad.numel() <= 1:
        return grad
    out = torch.empty_strided(size, stride, dtype=grad.dtype, device=grad.device)
    out.copy_(grad)
    return out


def _static(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int) for v in values)


def compile_with_metadata(compile_one: CompileOne, gm: fx.GraphModule, example: list[Any], aot_graphs: bool,
                          fake_mode: Any = None, backward_passes: Sequence[Callable] = ()) -> tuple[Compiled, Any]:
    """``compile_one`` under a TracingContext of its own; also returns the
    forward metadata AOTAutograd left there, which :func:`compiled_layer`
    reads (Note: [One TracingContext per piece] in :mod:`.compile`).

    ``fake_mode``: the examples' fake mode when the caller knows it (it is
    detected from ``example`` otherwise); ``backward_passes``: rewrites of
    the AOT backward graph before it is compiled (``compile_one``'s).  The
    one place that reads AOTAutograd's metadata back from a TracingContext."""
    from .._torch_compat import TracingContext, detect_fake_mode, tracing

    extra = {"backward_passes": tuple(backward_passes)} if backward_passes else {}
    fake_mode = fake_mode if fake_mode is not None else detect_fake_mode(example)
    if fake_mode is None:
        return compile_one(gm, example, aot_graphs, **extra), None
    context = TracingContext(fake_mode)
    # a graph may be compiled inside a backward (the lean border's variants), where grad mode is off
    with tracing(context), torch.enable_grad():
        compiled = compile_one(gm, example, aot_graphs, **extra)
    return compiled, context.fw_metadata


def subclasses_crossing(border: Sequence[Any]) -> tuple[str, ...]:
    """The tensor subclasses (by name) among a piece's (fake) input and output values."""
    from .._torch_compat import is_traceable_wrapper_subclass

    return tuple(sorted({type(v).__name__ for v in border if is_traceable_wrapper_subclass(v)}))


def compiled_layer(aot_graphs: Sequence[AotGraph], fw_metadata: Any,
                   border: Sequence[Any] = ()) -> CompiledLayer | Refusal:
    """The :class:`CompiledLayer` of one AOT-compiled piece, or why it needs AOTAutograd's runtime.

    ``aot_graphs`` are what ``compile_one(..., aot_graphs=True)`` returned
    (forward and backward graph with their compiled callables), ``fw_metadata``
    AOTAutograd's ``ViewAndMutationMeta`` for the piece, ``border`` the
    (fake) values of its inputs and outputs: a tensor subclass among them
    (a DTensor crossing the border) is flattened and rebuilt by
    AOTAutograd's runtime, so such a piece keeps it.
    """
    from .._torch_compat import OutputType, PlainTensorMeta, functorch_config
    from ..passes.hoist_tangent_reductions import reductions_of

    crossing = subclasses_crossing(border)
    if crossing:
        return Refusal(Refused.SUBCLASS_AT_BORDER, f"a {', '.join(crossing)} crosses its border")
    graphs = {g.kind: (g.graph, g.compiled) for g in aot_graphs}
    if "forward" not in graphs or "backward" not in graphs:
        return Refusal(Refused.NO_BACKWARD, "AOTAutograd compiled no backward for it (no input requires grad)")
    if fw_metadata is None:
        return Refusal(Refused.NO_METADATA, "no AOTAutograd metadata")
    md = fw_metadata
    if any(i.mutates_data or i.mutates_metadata or i.mutates_storage_metadata for i in md.input_info):
        return Refusal(Refused.WRITES_INPUT, "it writes to an input")
    if any(o.output_type != OutputType.non_alias for o in md.output_info) or md.num_intermediate_bases:
        return Refusal(Refused.ALIASED_OUTPUT, "an output aliases an input or another output")
    if md.tokens or md.num_backward_tokens or md.num_graphsafe_rng_states:
        return Refusal(Refused.EFFECTS, "it has effect tokens or RNG state")
    if not all(isinstance(m, PlainTensorMeta) for m in md.subclass_fw_graph_out_meta):
        return Refusal(Refused.SUBCLASS_OUTPUT, "an output is a tensor subclass")
    if getattr(md, "is_rng_op_functionalized", False):
        return Refusal(Refused.RNG, "its RNG is functionalized")
    if md.num_tensors_saved_with_no_vc_check:
        # a run version-checks every saved tensor (save_for_backward)
        return Refusal(Refused.UNCHECKED_SAVED, "it saves tensors AOTAutograd does not version-check")
    fw_gm, fw = graphs["forward"]
    bw_gm, bw = graphs["backward"]
    bw_inputs = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
    tangents = [n for n in bw_inputs if n.name.startswith("tangents")]
    reductions = reductions_of(bw_gm)
    n_saved = len(bw_inputs) - len(tangents) - len(reductions)
    fw_out = next(n for n in reversed(fw_gm.graph.nodes) if n.op == "output").args[0]
    n_outputs = len(fw_out) - n_saved
    if n_outputs != len(md.output_info):
        return Refusal(Refused.CALLING_CONVENTION, f"{n_outputs} forward outputs for {len(md.output_info)} outputs")
    owners = _tangent_owners(md, len(tangents))
    if isinstance(owners, Refusal):
        return owners
    layouts, types = [], []
    for t in tangents:
        val = t.meta.get("val")
        if not isinstance(val, torch.Tensor) or not _static(val.shape) or not _static(val.stride()):
            return Refusal(Refused.SYMBOLIC_TANGENT, "a tangent has a symbolic size")
        layouts.append((tuple(val.shape), tuple(val.stride())))
        types.append((val.dtype, val.device))
    return CompiledLayer(fw, bw, n_outputs, tuple(layouts), tuple(types),
                         md.num_opaque_objects_saved_for_bw or 0, md.num_symints_saved_for_bw or 0,
                         None if owners == tuple(range(n_outputs)) else owners,
                         bool(md.bw_donated_idxs) and functorch_config.donated_buffer, reductions)


def _tangent_owners(md: Any, n_tangents: int) -> tuple[int, ...] | Refusal:
    """Which output each tangent of the backward belongs to.

    AOTAutograd traces a tangent for every tensor output it must
    differentiate (``requires_grad_for_backward``), in output order; with no
    input mutation and no intermediate base (refused above) those are all.
    """
    owners = tuple(i for i, o in enumerate(md.output_info)
                   if isinstance(o.raw_type, type) and issubclass(o.raw_type, torch.Tensor)
                   and o.requires_grad_for_backward)
    if len(owners) != n_tangents:
        return Refusal(Refused.CALLING_CONVENTION, f"{n_tangents} tangents for {len(owners)} differentiable outputs")
    return owners


# --- runs of layers: one autograd node for many layers -------------------------

# Where a step's argument comes from: ("in", i) is the run's input i,
# ("out", j, k) output k of step j.
Source = tuple


@dataclasses.dataclass(frozen=True)
class RunStep:
    """One layer of a run: its compiled layer and where each argument comes from."""

    piece: str
    layer: CompiledLayer = dataclasses.field(compare=False, repr=False)
    args: tuple[Source, ...]
    # (output, how) for each output whose gradient arrives whole (Note: [The
    # last layer's gradient arrives whole] in .whole_gradients)
    whole: tuple[tuple[int, WholeGradient], ...] = ()

    def text(self) -> str:
        def src(s: Source) -> str:
            return f"in{s[1]}" if s[0] == "in" else f"{s[1]}.{s[2]}"

        whole = "".join(f" [output {k} {w.text()}]" for k, w in self.whole)
        return f"{self.piece}({', '.join(src(a) for a in self.args)}){whole}"

    def backward_args(self, tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        """The layer's tangents, then the reductions taken out of its backward.

        A reduction of a tangent that arrived whole over its group is that
        tangent (the sum was taken before it arrived), and the tangent's
        other uses read its Partial form; any other reduction is the
        all_reduce the graph would have run (Note: [The last layer's
        gradient arrives whole]).
        """
        layer = self.layer
        if not self.whole:
            return tangents + [r.reduce(tangents[r.tangent]) for r in layer.reductions]
        whole = dict(self.whole)
        at = {i: pos for pos, i in enumerate(layer.differentiable)}
        reduced = []
        for r in layer.reductions:
            w = whole.get(layer.differentiable[r.tangent])
            taken = w is not None and r.reduce_op == "sum" and r.group_name == w.group_name
            reduced.append(r.viewed(tangents[r.tangent]) if taken else None)
        parts = list(tangents)
        for i, w in self.whole:
            if i in at:
                parts[at[i]] = w.partial(tangents[at[i]])
        return parts + [r.reduce(parts[r.tangent]) if got is None else got
                        for r, got in zip(layer.reductions, reduced)]


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Consecutive layer calls run as one ``autograd.Function`` (Note: [A run of layers]).

    ``outputs`` are the step outputs used after the run, in order.
    """

    steps: tuple[RunStep, ...]
    n_inputs: int
    outputs: tuple[tuple[int, int], ...]

    def text(self) -> str:
        body = "; ".join(f"{j}: {s.text()}" for j, s in enumerate(self.steps))
        outs = ", ".join(f"{j}.{k}" for j, k in self.outputs)
        return f"run of {len(self.steps)} layers [{body}] -> ({outs})"

    def __call__(self, *inputs: Any) -> tuple:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in inputs):
            return _RunFunction.apply(self, *inputs)
        outs, _ = _run_forward(self, inputs, keep_saved=False)
        return tuple(outs[j][k] for j, k in self.outputs)


def _run_forward(run: LayerRun, inputs: Sequence[Any], keep_saved: bool):
    outs: list[tuple] = []
    saved: list[list] = []
    for step in run.steps:
        args = [inputs[s[1]] if s[0] == "in" else outs[s[1]][s[2]] for s in step.args]
        step_outs, step_saved = step.layer.split(step.layer.forward(args))
        outs.append(step_outs)
        saved.append(step_saved if keep_saved else [])
    return outs, saved


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


_TENSOR = object()  # where a saved tensor sits among a layer's saved values


class _RunFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: LayerRun, *inputs: Any):
        outs, saved = _run_forward(run, inputs, keep_saved=True)
        results = tuple(outs[j][k] for j, k in run.outputs)
        _mark_non_differentiable(ctx, results, [i for i, (j, k) in enumerate(run.outputs)
                                                if k in run.steps[j].layer.differentiable])
        # Tensors go through save_for_backward, as AOTAutograd's do: version
        # checked, and a saved result is no reference cycle.  Sizes and opaque
        # objects are kept beside them.
        ctx.save_for_backward(*(v for step_saved in saved for v in step_saved if isinstance(v, torch.Tensor)))
        ctx.others = [[_TENSOR if isinstance(v, torch.Tensor) else v for v in step_saved] for step_saved in saved]
        ctx.run = run
        ctx.set_materialize_grads(False)
        return results

    @staticmethod
    # Note: [A compiled backward is no frame for Dynamo] (compiler/dtensor_border.py)
    @torch.compiler.disable(reason="a compiled graph's backward runs as compiled")
    def backward(ctx, *grads: torch.Tensor | None):
        run: LayerRun = ctx.run
        retain = get_current_graph_task_keep_graph()
        if retain and any(step.layer.donates_buffers for step in run.steps):
            raise RuntimeError(
                "This backward function was compiled with non-empty donated buffers which requires "
                "create_graph=False and retain_graph=False. Please keep backward(create_graph=False, "
                "retain_graph=False) across all backward() function calls, or set "
                "torch._functorch.config.donated_buffer=False to disable donated buffer."
            )
        tensors = iter(ctx.saved_tensors)
        saved = [[next(tensors) if v is _TENSOR else v for v in step_others] for step_others in ctx.others]
        del tensors
        # ctx lets go of its references (unless retain_graph), so each layer's
        # saved values are freed once its backward ran, as in one graph
        ctx.maybe_clear_saved_tensors()
        in_grads: list[torch.Tensor | None] = [None] * run.n_inputs
        out_grads: list[list[torch.Tensor | None]] = [[None] * s.layer.n_outputs for s in run.steps]
        for (j, k), g in zip(run.outputs, grads):
            out_grads[j][k] = _add(out_grads[j][k], g)
        for j in reversed(range(len(run.steps))):
            step = run.steps[j]
            layer = step.layer
            step_saved, saved[j] = saved[j], []
            if all(out_grads[j][i] is None for i in layer.differentiable):
                # not on the way to anything differentiated: autograd would not
                # run this layer's backward either
                continue
            tangents = [
                torch.empty_strided(size, stride, dtype=dtype, device=device).zero_() if g is None
                else _as_traced(g, (size, stride))
                for g, (size, stride), (dtype, device) in zip((out_grads[j][i] for i in layer.differentiable),
                                                              layer.tangent_layouts, layer.tangent_types)
            ]
            out_grads[j] = []
            arg_grads = layer.backward(step_saved + step.backward_args(tangents))
            for src, g in zip(step.args, arg_grads):
                if g is None:
                    continue
                if src[0] == "in":
                    in_grads[src[1]] = _add(in_grads[src[1]], g)
                else:
                    out_grads[src[1]][src[2]] = _add(out_grads[src[1]][src[2]], g)
        return (None, *in_grads)


# Note: [A run of layers]
#     Each layer as its own autograd.Function still costs an autograd node,
#     a ctx and a Python backward per layer per step.
#     Consecutive layer calls whose arguments come from before the run or
#     from earlier layers of it are one LayerRun: one node; its forward
#     calls the compiled forwards in order, its backward the compiled
#     backwards in reverse, summing gradients of values several layers read.
