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
                         to split (share_layers True/"auto")
    split_layers         one piece per layer, pieces with one key compiled once
    inner compiler       inductor | aot_eager | eager (compiler/inner.py), per piece
                         or whole; under inductor each AOT graph first goes through
                         hoist_subgraph_views

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

import torch.fx as fx

from ..lowering import lower_boundaries as _lower_boundaries
from ..passes import Pass, PassResult, run_passes
from ..passes.fuse_boundaries import fuse_boundaries
from ..passes.inline_shared_bodies import inline_shared_bodies
from ..passes.outline_regions import outline_regions
from .inner import inner_compiler
from .options import BackendOptions

__all__ = ["STAGES", "Stage", "graph_passes", "compile_graph", "layer_sharing_decision", "AUTO_MIN_LAYERS"]


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
#     Every shared piece costs a call through AOTAutograd's runtime wrappers
#     and a DTensor unwrap/wrap of its inputs and outputs, and kernels no
#     longer fuse across a layer border; it saves the AOT trace and the
#     kernel compilation of every repeat.  "auto" shares when the graph has
#     at least AUTO_MIN_LAYERS layers with one key (numbers:
#     docs/benchmarks.md, "Layer sharing").
AUTO_MIN_LAYERS = 8


def layer_sharing_decision(plan, share_layers: bool | str) -> str | None:
    """None to split ``plan`` into shared pieces, else why the graph stays whole."""
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
    return None


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable:
    """Run :data:`STAGES` on a Dynamo graph; returns the compiled callable."""
    from ..debug.dump import inspector_for
    from ..passes.share_layers import (
        LayerPlan,
        apply_plain_borders,
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
        return compile_one(gm, list(example_inputs))
    try:
        plan = find_layer_spans(gm)
    except KeyError as e:
        # A safety net, no known case: the graph is valid, so compile it whole and say why.
        plan = LayerPlan(0, 0, (), f"regions not recoverable ({e!r})")
    why_whole = layer_sharing_decision(plan, opts.share_layers)
    if why_whole is None:
        # Note: [A DTensor at a layer border costs a collective]
        borders = find_plain_borders(gm, plan)
        if borders.steps:
            gm = apply_plain_borders(gm, borders)
            plan = find_layer_spans(gm)
            why_whole = layer_sharing_decision(plan, opts.share_layers)
    if why_whole is not None:
        if inspector is not None:
            inspector.pieces(plan, None, why_whole)
        return compile_one(gm, list(example_inputs))
    outer = split_layers(gm, plan)
    if opts.on_stage is not None:
        opts.on_stage("split_layers", outer)
    outer, reports = compile_pieces(outer, compile_one)
    if inspector is not None:
        inspector.pieces(plan, reports, None)
    return outer.forward
