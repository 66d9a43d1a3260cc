"""``torch.compile(model, backend="localmap_fx")``: every stage a frame goes through.

:data:`STAGES` lists them in order; :func:`compile_graph` runs them, the dump
(:mod:`localmap_fx.debug.dump`) names its files after them and
``docs/design.md`` draws them::

    captured             the Dynamo graph: DTensor level, regions annotated (capture/)
    bodies               outline_regions        share_layers=False and outline=True
                         inline_shared_bodies   otherwise (bodies stay inline)
    lower_boundaries     explicit to_local/from_local, redistribute plans, grad
                         placements, compile-time SPMD check (lowering/, spmd/)
    fuse_boundaries      drop from_local -> to_local pairs between regions (if on)
    plan_layers          find repeated layers; layer_sharing_decision says whether
                         to split (share_layers True/"auto"; under inductor "auto"
                         weighs the run-time price of pieces, layer_cost)
    plain_borders        a Replicate DTensor crossing a layer border travels as
                         its region's local tensor (when the plan shares)
    split_layers         one piece per layer, pieces with one key compiled once
    inner compiler       inductor | aot_eager | eager (compiler/inner.py), per piece
                         or whole; under inductor each AOT graph first goes through
                         hoist_subgraph_views; consecutive shared layers then run
                         as one LayerRun (compiler/layer_runtime.py)

Note: [Outline or inline, decided once]
    A shared layer piece is compiled once anyway, and an outlined body is a
    kernel border and a call at run time (outline=False ran at 0.97-1.00x
    upstream, outlined at 1.08x).  So bodies are outlined only when the
    frame is never split into layers (``share_layers=False``); otherwise the
    bodies capture shared are inlined at the start and never outlined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..lowering import lower_boundaries as _lower_boundaries
from ..passes import Pass, PassResult, run_passes
from ..passes.fuse_boundaries import fuse_boundaries
from ..passes.inline_shared_bodies import inline_shared_bodies
from ..passes.outline_regions import outline_regions
from .inner import inner_compiler
from .options import BackendOptions

__all__ = [
    "STAGES",
    "Stage",
    "graph_passes",
    "compile_graph",
    "layer_sharing_decision",
    "layer_cost",
    "LayerCost",
    "AUTO_MIN_LAYERS",
    "AUTO_MAX_OVERHEAD",
]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its name, what it does, when it runs."""

    name: str
    what: str
    runs_when: str


STAGES: tuple[Stage, ...] = (
    Stage("captured", "the graph Dynamo captured", "always"),
    Stage("outline_regions", "region bodies become shared invoke_subgraph calls", "share_layers=False, outline=True"),
    Stage("inline_shared_bodies", "bodies capture shared are put back inline", "otherwise"),
    Stage("lower_boundaries", "explicit boundaries, redistribute plans, grad placements", "always"),
    Stage("fuse_boundaries", "from_local -> to_local pairs between regions dropped", "fuse_boundaries=True"),
    Stage("plan_layers", "repeated layers found; split or keep whole", "share_layers True or 'auto'"),
    Stage("plain_borders", "a Replicate DTensor crosses layer borders as a local tensor", "the plan shares"),
    Stage("split_layers", "one piece per layer; one compile per layer key", "the plan shares"),
    Stage("inner", "the inner compiler, per piece or whole", "always"),
)


def _outlines(opts: BackendOptions) -> bool:
    # Note: [Outline or inline, decided once]
    return opts.outline and opts.share_layers is False


def graph_passes(opts: BackendOptions) -> list[Pass]:
    """The graph-to-graph stages of :data:`STAGES` that ``opts`` turns on, in order."""

    def lower_boundaries(gm: fx.GraphModule) -> PassResult:
        return _lower_boundaries(gm, typecheck=opts.typecheck)

    ps: list[Pass] = [outline_regions if _outlines(opts) else inline_shared_bodies, lower_boundaries]
    if opts.fuse_boundaries:
        ps.append(fuse_boundaries)
    return ps


# Note: [When "auto" shares layers]
#     A shared layer saves the AOT trace and the kernel compilation of every
#     repeat.  At run time the layers of a frame are one LayerRun (Note: [A
#     run of layers] in compiler/layer_runtime.py): the compiled forward and
#     backward of the layer called once per layer, no per-layer autograd
#     node or DTensor wrapping.  What is left is two calls into compiled
#     code per layer and no kernel fusion across a layer border, a price per
#     layer that one graph never pays (measured: about 15 us per layer per
#     step on a CPU, fake process group, 64-layer TP stack; it was ~80 us
#     through AOTAutograd's runtime wrappers per piece).  A default may never
#     make the compiled step slower than upstream torch.compile, so under
#     inductor "auto" shares only when that price is lost in the layer's own
#     compute: at least AUTO_MIN_LAYERS layers *and* PIECE_OVERHEAD_S[device]
#     at most AUTO_MAX_OVERHEAD of the layer's estimated forward + backward
#     time (3x the forward FLOPs of its matrix products at
#     ASSUMED_FLOPS[device]).  The estimate errs towards one graph: only
#     matrix products count and the assumed throughput is high.  It assumes
#     the layer runs as a CompiledLayer; one that needs AOTAutograd's runtime
#     (compiled_layer says why, the dump shows it) pays the old price.  Under
#     aot_eager / eager (not run-time modes) the count alone decides.
AUTO_MIN_LAYERS = 8
AUTO_MAX_OVERHEAD = 0.01
# seconds per layer call, forward + backward, in a LayerRun (CPU:
# 64-layer nn.Module TP stack, fake process group, shared vs one graph;
# other devices: the same Python work, kernel launches are asynchronous)
PIECE_OVERHEAD_S = {"cpu": 1.5e-5, "cuda": 1.5e-5}
# FLOP/s assumed for the layer's matrix products (high on purpose)
ASSUMED_FLOPS = {"cpu": 1e11, "cuda": 1e14}


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one shared layer would compute next to what its piece call costs."""

    flops: int  # forward FLOPs of the layer's matrix products
    device: str

    @property
    def layer_s(self) -> float:
        return 3 * self.flops / ASSUMED_FLOPS.get(self.device, ASSUMED_FLOPS["cuda"])

    @property
    def overhead_s(self) -> float:
        return PIECE_OVERHEAD_S.get(self.device, PIECE_OVERHEAD_S["cuda"])

    @property
    def worth_sharing(self) -> bool:
        return self.overhead_s <= AUTO_MAX_OVERHEAD * self.layer_s

    def text(self) -> str:
        return (f"a layer computes ~{self.flops / 1e6:.3g} MFLOP forward (~{self.layer_s * 1e3:.3g} ms fwd+bwd "
                f"at {ASSUMED_FLOPS.get(self.device, ASSUMED_FLOPS['cuda']):.0e} FLOP/s on {self.device}), "
                f"a piece call costs ~{self.overhead_s * 1e3:.2g} ms "
                f"({self.overhead_s / max(self.layer_s, 1e-12):.0%} of it, limit {AUTO_MAX_OVERHEAD:.0%})")


def layer_cost(gm: fx.GraphModule, plan) -> LayerCost | None:
    """The :class:`LayerCost` of ``plan``'s first shared layer, None if none."""
    from ..graph_utils import node_value
    from ..passes.share_layers import compute_nodes, span_flops

    if not plan.shared:
        return None
    span = plan.shared[0]
    nodes = compute_nodes(gm, plan.hoisted)[span.start:span.stop]
    device = "cpu"
    for n in nodes:
        v = node_value(n)
        if isinstance(v, torch.Tensor):
            device = v.device.type
            break
    return LayerCost(span_flops(nodes), device)


def layer_sharing_decision(plan, share_layers: bool | str, cost: LayerCost | None = None,
                           dtensor_borders: Sequence[str] = ()) -> str | None:
    """None to split ``plan`` into shared pieces, else why the graph stays whole.

    ``cost`` (given under inductor) makes "auto" weigh run time too (Note:
    [When "auto" shares layers]); ``dtensor_borders`` names DTensors that
    would cross layer borders (Note: [No DTensor at an automatic border]).
    """
    if share_layers is False:
        return "share_layers=False"
    if not plan.shared:
        return plan.reason or "no two layers share a key"
    if share_layers == "auto":
        # layers found (the last one may be its own piece: Note: [Where layers are cut])
        most = len(plan.spans)
        if most < AUTO_MIN_LAYERS:
            return (f"share_layers='auto': {most} repeats of a layer < {AUTO_MIN_LAYERS}; "
                    "one graph fuses across layer borders")
        if dtensor_borders:
            shown = ", ".join(dtensor_borders[:3]) + (", ..." if len(dtensor_borders) > 3 else "")
            return (f"share_layers='auto': {most} layers, but DTensors would cross the layer borders ({shown}): "
                    "each layer would unwrap and wrap them and turn their gradients into the traced "
                    "placements every step, summing gradients in another order than one graph "
                    "(share_layers=True shares anyway)")
        if cost is not None and not cost.worth_sharing:
            return (f"share_layers='auto': {most} layers, but pieces would run slower than one graph: "
                    f"{cost.text()}")
    return None


# Note: [No DTensor at an automatic border]
#     A layer whose border a DTensor crosses (weights used as DTensors outside
#     the layer's regions, a residual the plain borders cannot pass) runs
#     through AOTAutograd's runtime: subclass unwrap/wrap per layer and step,
#     and a gradient coerced to the traced tangent placements at every border
#     (an all_reduce where the layer produces Partial), so it is slower than
#     one graph and its aot_eager gradients differ from eager in the last bits
#     as regional compilation's do (found on a torchtitan-shaped attention
#     stack: 1.1e-8 off eager at 8 layers, where one graph is bitwise).  "auto"
#     keeps such a frame whole; share_layers=True still shares it.


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable:
    """Run :data:`STAGES` on a Dynamo graph; returns the compiled callable."""
    from ..debug.dump import inspector_for
    from ..passes.share_layers import (
        LayerPlan,
        apply_plain_borders,
        dtensors_at_borders,
        find_layer_spans,
        find_plain_borders,
        split_layers,
    )
    from .pieces import compile_pieces

    # Dumps / TORCH_TRACE / TORCH_LOGS=localmap_fx_regions: observe every stage
    # through the same hooks, before the user's (see localmap_fx.debug).
    inspector = inspector_for(opts)
    if inspector is not None:
        opts = inspector.wrap(opts)
    if opts.on_stage is not None:
        opts.on_stage("captured", gm)
    gm = run_passes(gm, graph_passes(opts), opts.on_stage)
    if inspector is not None:
        inspector.lowered(gm)
    compile_one = inner_compiler(opts, inspector.on_inner_output if inspector is not None else None)
    if opts.share_layers is False:
        return compile_one(gm, list(example_inputs), None)
    try:
        plan = find_layer_spans(gm)
    except KeyError as e:
        # A safety net, no known case: the graph is valid, so compile it whole and say why.
        plan = LayerPlan(0, 0, (), f"regions not recoverable ({e!r})")
    # Note: [When "auto" shares layers]
    cost = layer_cost(gm, plan) if opts.inner == "inductor" and opts.share_layers == "auto" else None
    why_whole = layer_sharing_decision(plan, opts.share_layers, cost)
    if why_whole is None:
        # Note: [A DTensor at a layer border costs a collective]
        borders = find_plain_borders(gm, plan)
        if opts.share_layers == "auto":
            # Note: [No DTensor at an automatic border]
            why_whole = layer_sharing_decision(plan, "auto", cost, dtensors_at_borders(gm, plan, borders))
        if why_whole is None and borders.steps:
            gm = apply_plain_borders(gm, borders)
            plan = find_layer_spans(gm)
            why_whole = layer_sharing_decision(plan, opts.share_layers, cost)
    if why_whole is not None:
        if inspector is not None:
            inspector.pieces(plan, None, why_whole)
        return compile_one(gm, list(example_inputs), None)
    outer = split_layers(gm, plan)
    if opts.on_stage is not None:
        opts.on_stage("split_layers", outer)
    outer, reports = compile_pieces(outer, compile_one)
    if inspector is not None:
        inspector.pieces(plan, reports, None)
    return outer.forward
