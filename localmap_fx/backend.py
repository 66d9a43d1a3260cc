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
    """

    inner: str = "inductor"
    outline: bool = True
    fuse_boundaries: bool = True
    typecheck: str = "regions"
    on_stage: Callable[[str, fx.GraphModule], None] | None = None
    on_aot_graph: Callable[[str, fx.GraphModule], None] | None = None
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(
                f"backend(inner={self.inner!r}) is not supported: use one of {INNER_COMPILERS}."
            )
        if self.typecheck not in ("regions", "all", "off"):
            raise ValueError(
                f"backend(typecheck={self.typecheck!r}) is not supported: use "
                "'regions', 'all' or 'off'."
            )

    def passes(self) -> list[Pass]:
        from .passes.fuse_boundaries import fuse_boundaries

        ps: list[Pass] = []
        if self.outline:
            ps.append(outline_regions)
        else:
            from .passes.inline_shared_bodies import inline_shared_bodies

            ps.append(inline_shared_bodies)  # bodies Dynamo shared (localmap_fx.reuse)
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


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions):
    """Run the pipeline on a Dynamo graph and hand it to the inner compiler."""
    from .debug.dump import inspector_for

    # Dumps / TORCH_TRACE / TORCH_LOGS=localmap_fx_regions: observe every stage
    # through the same hooks, before the user's (see localmap_fx.debug).
    inspector = inspector_for(opts)
    if inspector is not None:
        opts = inspector.wrap(opts)
    if opts.on_stage is not None:
        opts.on_stage("captured", gm)
    gm = run_passes(gm, opts.passes(), opts.on_stage)
    if inspector is not None:
        inspector.lowered(gm)
    if opts.inner == "eager":
        return gm.forward
    if opts.inner == "aot_eager":
        return _aot(gm, example_inputs, opts)
    return _inductor(gm, example_inputs, opts, inspector.on_inner_output if inspector is not None else None)


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
