"""``torch.compile(model, backend="localmap_fx")``: every stage a frame goes through.

:data:`STAGES` lists them in order and :func:`compile_graph` runs exactly
that table; the dump (:mod:`localmap_fx.debug.dump`) names its files after
them and ``docs/design.md`` draws them.  Every stage reports to one
:class:`~localmap_fx.compiler.observe.Observer` (the dump, the logs and the
user's ``on_stage`` / ``on_aot_graph`` hooks), and every graph rewrite is a
``PassResult`` pass run by :func:`localmap_fx.passes.run_passes`::

    captured             the Dynamo graph: DTensor level, regions annotated (capture/)
    inline_marked_blocks the calls of blocks marked with nested_compile_region are
                         put inline, each node recording its call (the layers)
    bodies               outline_regions        share_layers=False and outline=True
                         inline_shared_bodies   otherwise (bodies stay inline)
    lower_boundaries     explicit to_local/from_local, redistribute plans, grad
                         placements, compile-time SPMD check (lowering/, spmd/)
    fuse_boundaries      drop from_local -> to_local pairs between regions (if on)
    plan_layers          find repeated layers; layer_sharing.decide.decide says
                         whether to split (share_layers True/"auto"; under
                         inductor "auto" weighs the run-time price of pieces)
    plain_borders        a Replicate DTensor crossing a layer border travels as
                         its region's local tensor (when the frame is split)
    split_layers         one piece per layer, pieces with one key compiled once
    lift_piece_meshes    a shared layer piece's mesh inputs become constants in it,
                         so its cache keys are the same in a new process
                         (layer_sharing/piece_meshes.py)
    whole_gradients      the tail reads the last layer's gradient whole (no
                         Replicate -> Partial division); that layer's
                         backward is compiled with its tangent all_reduce
                         taken out, which its run supplies, or skips where
                         the gradient arrives whole (layer_sharing/whole_gradients.py)
    inner                inductor | aot_eager | eager (compiler/inner.py), per piece
                         or whole; under inductor each AOT graph first goes through
                         hoist_subgraph_views (and a lean border's guessed variant's
                         backward through hoist_tangent_reductions); AOTAutograd
                         leaves the activation gradients Inductor cannot lower whole, and
                         Inductor's last post-grad pass turns a matrix product
                         added through a reshape into addmm, copies a CPU
                         attention input Inductor would copy with clone, finds
                         the ops with nothing to fuse with, which run as ATen
                         ops, no kernel generated, and decomposes the held-back
                         others (passes/lone_ops.py, passes/matmul_accumulation.py,
                         passes/attention_layouts.py, passes/late_decompositions.py);
                         a graph with DTensor inputs or
                         outputs compiled whole runs behind a DTensor border
                         unless it refuses: a frame with no output chained to
                         an input, under Inductor with torch's caches on, the
                         one AOTAutogradCache serves (compiler/cacheable_border.py),
                         else the lean one (compiler/dtensor_border.py); its
                         mesh inputs lifted out of the graph it compiles;
                         with stable_cache_keys (no border) the mesh inputs leave
                         the graph handed to AOTAutograd (compiler/cache_keys.py)
    layer_runs           consecutive shared layers run as one LayerRun
                         (layer_sharing/runs.py); a layer taking a whole
                         gradient runs in one even alone

Note: [Outline or inline, decided once]
    A shared layer piece is compiled once anyway, and an outlined body is a
    kernel border and a call at run time (outline=False ran at 0.97-1.00x
    upstream, outlined at 1.08x).  So bodies are outlined only when the
    frame is never split into layers (``share_layers=False``); otherwise the
    bodies capture shared are inlined at the start and never outlined.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ..debug.logs import LOG_NAME
from ..lowering import lower_boundaries as _lower_boundaries
from ..passes import Pass, PassResult, run_passes
from ..passes.fuse_boundaries import fuse_boundaries
from ..passes.inline_marked_blocks import find_marked_calls, inline_marked_blocks
from ..passes.inline_shared_bodies import inline_shared_bodies
from ..passes.outline_regions import outline_regions
from .inner import CompileOne, caches_serve, inner_compiler
from .observe import Observer, Observers, UserHooks
from .options import BackendOptions

if TYPE_CHECKING:
    from ..layer_sharing.borders import PlainBorderPlan
    from ..layer_sharing.compile import PieceReport
    from ..layer_sharing.decide import Decision
    from ..layer_sharing.plan import LayerPlan

__all__ = ["STAGES", "Stage", "FrameState", "compile_graph"]

log = logging.getLogger(f"{LOG_NAME}.lone_ops")


@dataclasses.dataclass
class FrameState:
    """One frame on its way through :data:`STAGES`: what the stages so far made of it."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    opts: BackendOptions
    observer: Observer
    compile_one: CompileOne
    plan: LayerPlan | None = None
    decision: Decision | None = None
    borders: PlainBorderPlan | None = None
    reports: list[PieceReport] | None = None
    compiled: Callable | None = None

    def run(self, name: str, p: Callable[..., PassResult], *args: Any) -> None:
        """Run the rewrite ``p(gm, *args)`` as the stage ``name``: through the runner, observed."""
        self.gm = run_passes(self.gm, [lambda gm: p(gm, *args)])
        self.observer.stage(name, self.gm)

    @property
    def split(self) -> bool:
        return self.decision is not None and self.decision.shares


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its name, what it does, when it runs, and the step itself."""

    name: str
    what: str
    runs_when: str
    when: Callable[[FrameState], bool]
    step: Callable[[FrameState], None]


def _outlines(opts: BackendOptions) -> bool:
    # Note: [Outline or inline, decided once]
    return opts.outline and opts.share_layers is False


def _lower(opts: BackendOptions) -> Pass:
    def lower_boundaries(gm: fx.GraphModule) -> PassResult:
        return _lower_boundaries(gm, typecheck=opts.typecheck)

    return lower_boundaries


def _plan_layers(f: FrameState) -> None:
    from ..layer_sharing.borders import dtensors_at_borders, find_plain_borders
    from ..layer_sharing.decide import decide, layer_cost
    from ..layer_sharing.find import find_layer_spans
    from ..layer_sharing.plan import LayerPlan
    from ..passes.inline_marked_blocks import META_MARKED

    share = f.opts.share_layers
    marked = any(META_MARKED in n.meta for n in f.gm.graph.nodes)
    try:
        plan = find_layer_spans(f.gm)
    except KeyError as e:
        # A safety net, no known case: the graph is valid, so compile it whole and say why.
        plan = LayerPlan(0, 0, (), f"regions not recoverable ({e!r})")
    # Note: [When "auto" shares layers]
    cost = layer_cost(plan) if f.opts.inner == "inductor" and share == "auto" and not marked else None
    # Note: [A DTensor at a layer border costs a collective]
    borders = find_plain_borders(f.gm, plan) if plan.shared else None
    # Note: [No DTensor at an automatic border]
    crossing = dtensors_at_borders(plan, borders) if share == "auto" and borders is not None else ()
    f.plan, f.borders, f.decision = plan, borders, decide(plan, share, cost, crossing, marked,
                                                          f.opts.uses_lean_border)


def _plain_borders(f: FrameState) -> None:
    from ..layer_sharing.borders import apply_plain_borders
    from ..layer_sharing.decide import no_shared_layer
    from ..layer_sharing.find import find_layer_spans

    f.run("plain_borders", apply_plain_borders, f.borders)
    # the rewrite moved nodes: the layers are found again on the new graph
    f.plan = find_layer_spans(f.gm)
    if not f.plan.shared:
        # a safety net, no known case: the rewrite is the identity in forward
        f.decision = no_shared_layer(f.plan)


def _split_layers(f: FrameState) -> None:
    from ..layer_sharing.split import split_layers

    f.observer.lowered(f.gm)
    f.run("split_layers", split_layers, f.plan)


def _lift_piece_meshes(f: FrameState) -> None:
    from ..layer_sharing.piece_meshes import lift_piece_meshes

    f.run("lift_piece_meshes", lift_piece_meshes)


def _whole_gradients(f: FrameState) -> None:
    from ..layer_sharing.whole_gradients import apply_whole_gradients, find_whole_gradients

    f.run("whole_gradients", apply_whole_gradients, find_whole_gradients(f.gm))


def _inner(f: FrameState) -> None:
    if not f.split:
        f.observer.lowered(f.gm)
        compile_one = f.compile_one
        if f.decision is not None:
            f.observer.layers(f.plan, f.decision, None)
            if f.plan is not None and f.plan.shared and f.opts.lone_ops_as_aten and f.opts.inner == "inductor":
                # Note: [Repeated layers in one graph keep their kernels]
                log.info("one graph of %d repeated layers: ops with nothing to fuse with keep their kernels",
                         len(f.plan.spans))
                compile_one = inner_compiler(dataclasses.replace(f.opts, lone_ops_as_aten=False), f.observer)
        f.compiled = compile_one(f.gm, f.example_inputs).fn
        return
    from ..layer_sharing.compile import compile_pieces

    # Note: [A piece without matrix products skips Inductor] in layer_sharing/compile.py
    small = (inner_compiler(dataclasses.replace(f.opts, inner="aot_eager"), f.observer)
             if f.opts.inner == "inductor" else None)
    f.reports = compile_pieces(f.gm, f.compile_one, small, cache=caches_serve(f.opts, f.observer))


def _layer_runs(f: FrameState) -> None:
    from ..layer_sharing.compile import layer_runs, with_runs

    f.run("layer_runs", layer_runs)
    f.reports = with_runs(f.reports or [], f.gm)
    f.observer.layers(f.plan, f.decision, f.reports)
    f.compiled = f.gm.forward


def _pass(name: str, p: Callable[[BackendOptions], Pass]) -> Callable[[FrameState], None]:
    return lambda f: f.run(name, p(f.opts))  # the pass is named by its stage


STAGES: tuple[Stage, ...] = (
    Stage("captured", "the graph Dynamo captured", "always",
          lambda f: True, lambda f: f.observer.stage("captured", f.gm)),
    Stage("inline_marked_blocks", "blocks marked with nested_compile_region put inline as layers",
          "the graph calls a marked block",
          lambda f: bool(find_marked_calls(f.gm)), _pass("inline_marked_blocks", lambda o: inline_marked_blocks)),
    Stage("outline_regions", "region bodies become shared invoke_subgraph calls", "share_layers=False, outline=True",
          lambda f: _outlines(f.opts), _pass("outline_regions", lambda o: outline_regions)),
    Stage("inline_shared_bodies", "bodies capture shared are put back inline", "otherwise",
          lambda f: not _outlines(f.opts), _pass("inline_shared_bodies", lambda o: inline_shared_bodies)),
    Stage("lower_boundaries", "explicit boundaries, redistribute plans, grad placements", "always",
          lambda f: True, _pass("lower_boundaries", _lower)),
    Stage("fuse_boundaries", "from_local -> to_local pairs between regions dropped", "fuse_boundaries=True",
          lambda f: f.opts.fuse_boundaries, _pass("fuse_boundaries", lambda o: fuse_boundaries)),
    Stage("plan_layers", "repeated layers found; decide() splits or keeps whole", "share_layers True or 'auto'",
          lambda f: f.opts.share_layers is not False, _plan_layers),
    Stage("plain_borders", "a Replicate DTensor crosses layer borders as a local tensor",
          "the frame is split and such a DTensor crosses",
          lambda f: f.split and f.borders is not None and bool(f.borders.steps), _plain_borders),
    Stage("split_layers", "one piece per layer; one compile per layer key", "the frame is split",
          lambda f: f.split, _split_layers),
    Stage("lift_piece_meshes", "mesh inputs of shared layer pieces become constants", "the frame is split",
          lambda f: f.split, _lift_piece_meshes),
    Stage("whole_gradients", "the tail takes a layer output's gradient whole; the layer's run supplies its sum",
          "the frame is split", lambda f: f.split, _whole_gradients),
    Stage("inner", "the inner compiler, per piece or whole", "always", lambda f: True, _inner),
    Stage("layer_runs", "consecutive compiled layers run as one LayerRun", "the frame is split",
          lambda f: f.split, _layer_runs),
)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable:
    """Run :data:`STAGES` on a Dynamo graph; returns the compiled callable."""
    from ..debug.dump import inspector_for

    # Dumps / TORCH_TRACE / TORCH_LOGS=localmap_fx_regions observe every
    # stage through the same interface, before the user's hooks.
    inspector = inspector_for(opts)
    user = UserHooks(opts.on_stage, opts.on_aot_graph)
    observer = Observers([inspector, user]) if inspector is not None else user
    frame = FrameState(gm, list(example_inputs), opts, observer, inner_compiler(opts, observer))
    for stage in STAGES:
        if stage.when(frame):
            stage.step(frame)
    if frame.compiled is None:
        raise AssertionError("the pipeline's stages compiled nothing")
    return frame.compiled
