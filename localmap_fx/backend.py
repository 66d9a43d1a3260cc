"""``torch.compile(model, backend="localmap_fx")``: the pipeline and its options.

    Dynamo graph --outline_regions--> --lower--> [fuse_boundaries] --> inner compiler
                                                                       (inductor | aot_eager | eager)

The pipeline is a list of passes composed from :class:`BackendOptions`; each
stage can be observed (``on_stage``) and, for AOT-based inner compilers, the
forward and backward graphs too (``on_aot_graph``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .lowering import lower
from .passes import Pass, outline_regions, run_passes

__all__ = ["BackendOptions", "backend", "localmap_fx_backend", "INNER_COMPILERS"]

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Options of the ``localmap_fx`` backend.

    Attributes:
        inner: the compiler that receives the lowered graph: ``"inductor"``
            (default), ``"aot_eager"`` (AOTAutograd, no codegen: bitwise equal
            to eager) or ``"eager"`` (run the lowered FX graph as is).
        outline: outline region bodies into shared ``invoke_subgraph`` calls
            so repeated regions compile once (default True).
        fuse_boundaries: drop ``from_local -> to_local`` pairs between
            adjacent regions whose placements and grad placements already
            match (default True).
        typecheck: ``"regions"`` checks regions with ``spmd_types=True`` at
            compile time, ``"off"`` skips it (the derived grad placements
            then fall back to DTensor defaults, as for spmd_types=False).
        on_stage: called as ``on_stage(stage_name, gm)`` after capture and
            after every pass.
        on_aot_graph: called as ``on_aot_graph("forward"|"backward", gm)``
            with the AOTAutograd graphs (inner = inductor or aot_eager).
        dump_dir: write every compiled frame's graphs, regions and
            collective tables under this folder (see ``docs/debugging.md``);
            ``None`` (default) reads ``$LOCALMAP_FX_DUMP_DIR``, unset = off.
        share_layers: compile a repeated layer (its regions and the DTensor
            code between them) once and call the compiled piece per layer
            (``True``); keep the whole frame one graph (``False``); or decide
            from the number of repeats (``"auto"``, default; see
            :func:`layer_sharing_decision` and ``docs/design.md``).
    """

    inner: str = "inductor"
    outline: bool = True
    fuse_boundaries: bool = True
    typecheck: str = "regions"
    on_stage: Callable[[str, fx.GraphModule], None] | None = None
    on_aot_graph: Callable[[str, fx.GraphModule], None] | None = None
    dump_dir: str | None = None
    share_layers: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(
                f"backend(inner={self.inner!r}) is not supported: use one of {INNER_COMPILERS}."
            )
        if self.share_layers not in (True, False, "auto"):
            raise ValueError(
                f"backend(share_layers={self.share_layers!r}) is not supported: use "
                "True, False or 'auto'."
            )
        if self.typecheck not in ("regions", "all", "off"):
            raise ValueError(
                f"backend(typecheck={self.typecheck!r}) is not supported: use "
                "'regions', 'all' or 'off'."
            )
        if self.inner == "inductor" and self.outline and self.share_layers is False:
            import warnings

            # hoist_subgraph_views repairs one such case; the residual case
            # (h = x + f(x); y = f(h)) is still wrong upstream.
            warnings.warn(
                "localmap_fx.backend(inner='inductor', share_layers=False, outline=True): "
                "torch 2.14.1's Inductor can give wrong gradients for a region body shared "
                "by several calls (pinned by tests/test_models.py::"
                "test_upstream_invoke_subgraph_twice_with_residual). Pass outline=False, or "
                "keep share_layers='auto'/True, for gradients you can trust.",
                UserWarning,
                stacklevel=3,
            )

    def passes(self) -> list[Pass]:
        from .passes.fuse_boundaries import fuse_boundaries
        from .passes.inline_shared_bodies import inline_shared_bodies

        ps: list[Pass] = []
        # bodies Dynamo traced once and shared (localmap_fx.reuse) are adopted
        # by outline_regions at the top level, inlined elsewhere
        if self.outline:
            ps.append(outline_regions)
        else:
            ps.append(inline_shared_bodies)
        ps.append(_lower_with(self.typecheck))
        if self.fuse_boundaries:
            ps.append(fuse_boundaries)
        return ps


def _lower_with(typecheck: str) -> Pass:
    def lower_boundaries(gm: fx.GraphModule) -> fx.GraphModule:
        return lower(gm, typecheck=typecheck)

    return lower_boundaries


def _aot(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def recorder(kind: str):
        def compile_graph(g: fx.GraphModule, _inputs):
            if opts.on_aot_graph is not None:
                opts.on_aot_graph(kind, g)
            return make_boxed_func(g.forward)

        return compile_graph

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=recorder("forward"), bw_compiler=recorder("backward")
    )


def _inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: BackendOptions,
    on_output: Callable[[str, Any], None] | None = None,
):
    import torch
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .passes.hoist_subgraph_views import hoist_subgraph_views

    def inner_compile(g: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        # Inductor plans buffers as if subgraph outputs never alias inputs (see the pass)
        g = hoist_subgraph_views(g)
        if opts.on_aot_graph is not None:
            opts.on_aot_graph(kind, g)
        compiled = compile_fx_inner(g, inputs, **kwargs)
        if on_output is not None:
            on_output(kind, compiled)
        return compiled

    if not any(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)
    # AOTAutograd's cache is keyed on this graph, not on inner_compile: a hit could
    # serve an artifact compiled without hoist_subgraph_views.  Inductor's own
    # cache stays on (it keys on the graph after the pass).
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


# Note: [When "auto" shares layers]
#     Every shared piece costs a call through AOTAutograd's runtime wrappers
#     and a DTensor unwrap/wrap of its inputs and outputs (about 0.1 ms per
#     layer, forward + backward, on CPU), and kernels no longer fuse across
#     a layer border; it saves the AOT trace and the kernel compilation of
#     every repeat.  "auto" shares when the graph has at least
#     AUTO_MIN_LAYERS layers with one key (numbers: docs/benchmarks.md,
#     "Layer sharing").  With share_layers True or "auto", outlined region
#     bodies are put back inline first: a shared layer is compiled once
#     anyway, and an outlined body is a kernel border and a call at run time
#     (outline=False ran at 0.97-1.00x upstream, outlined at 1.08x).  The
#     outline option keeps its meaning with share_layers=False.
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


def _compile_one(opts: BackendOptions, on_output):
    def compile_one(gm: fx.GraphModule, example_inputs: list[Any]):
        if opts.inner == "eager":
            return gm.forward
        if opts.inner == "aot_eager":
            return _aot(gm, example_inputs, opts)
        return _inductor(gm, example_inputs, opts, on_output)

    return compile_one


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions):
    """Run the pipeline on a Dynamo graph and hand it to the inner compiler."""
    from .compile_pieces import compile_pieces
    from .debug.dump import inspector_for
    from .passes.inline_bodies import inline_bodies
    from .passes.share_layers import LayerPlan, find_layer_spans, split_layers

    # Dumps / TORCH_TRACE / TORCH_LOGS=localmap_fx_regions: observe every stage
    # through the same hooks, before the user's (see localmap_fx.debug).
    inspector = inspector_for(opts)
    if inspector is not None:
        opts = inspector.wrap(opts)
    if opts.on_stage is not None:
        opts.on_stage("captured", gm)
    gm = run_passes(gm, opts.passes(), opts.on_stage)
    compile_one = _compile_one(opts, inspector.on_inner_output if inspector is not None else None)
    if opts.share_layers is False:
        if inspector is not None:
            inspector.lowered(gm)
        return compile_one(gm, list(example_inputs))
    # share_layers True / "auto": bodies go back inline (Note: [When "auto"
    # shares layers]); the layer finder works on that graph.
    gm = inline_bodies(gm)
    if inspector is not None:
        inspector.lowered(gm)
    try:
        plan = find_layer_spans(gm)
    except KeyError as e:
        # A safety net, no known case: find_regions once failed to regroup
        # inlined shared bodies (fixed: size arithmetic and pass-through
        # exits in region.py, nested regions skipped by find_layer_spans);
        # the inlined graph is valid, so compile it whole and say why.
        plan = LayerPlan(0, 0, (), f"regions not recoverable after inlining ({e!r})")
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


def backend(inner: str = "inductor", **options: Any) -> Callable:
    """A Dynamo backend: ``torch.compile(model, backend=localmap_fx.backend(...))``.

    ``options`` are the fields of :class:`BackendOptions`.
    """
    try:
        opts = BackendOptions(inner=inner, **options)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(BackendOptions)]
        raise TypeError(f"{e}; localmap_fx.backend accepts {fields}") from None

    def localmap_fx(gm: fx.GraphModule, example_inputs: Sequence[Any]):
        return compile_graph(gm, example_inputs, opts)

    localmap_fx.options = opts  # type: ignore[attr-defined]
    return localmap_fx


def localmap_fx_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """The default backend registered as ``"localmap_fx"`` (inner = inductor)."""
    return compile_graph(gm, example_inputs, BackendOptions())
