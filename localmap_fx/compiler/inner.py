"""Inner compilers: what receives the lowered graph (or each compiled piece).

:data:`INNER` is the table; :func:`inner_compiler` returns the compile
function for a :class:`BackendOptions`.  Every AOT-based entry reports its
forward and backward graphs (and Inductor its compiled modules) to the
compile's :class:`~localmap_fx.compiler.observe.Observer`.

``compile_one(gm, example_inputs, aot_graphs=True)`` returns, beside the
callable, the forward and backward AOT graphs with their compiled callables
(:class:`AotGraph`), and compiles the backward at once (not at the first
backward call): :mod:`localmap_fx.layer_sharing.runtime` calls them directly.
``as_is=True`` compiles the graph as it is, never behind a DTensor border.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .observe import Observer
from .options import INNER_COMPILERS, BackendOptions

__all__ = ["INNER", "AotGraph", "Compiled", "CompileOne", "caches_serve", "inner_compiler"]


@dataclasses.dataclass(frozen=True)
class AotGraph:
    """One AOTAutograd graph as the inner compiler received it, and its compiled callable."""

    kind: str  # "forward" | "backward"
    graph: fx.GraphModule
    compiled: Callable


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What ``compile_one`` returns: the callable running the graph and, when
    asked for (``aot_graphs=True``), its AOT graphs in the order compiled."""

    fn: Callable
    aot_graphs: tuple[AotGraph, ...] = ()


# AOTAutograd hands its graphs to callbacks; the compile function appends
# them here (None: not asked for)
Kept = list[AotGraph] | None
# compile_one(gm, example_inputs, aot_graphs=False, as_is=False, backward_passes=()) -> Compiled
CompileOne = Callable[..., Compiled]
# passes run on the AOT backward graph before it is compiled (kept graphs only)
Passes = Sequence[Callable[[fx.GraphModule], Any]]


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, observer: Observer,
           keep: Kept = None, backward_passes: Passes = ()):
    return gm.forward


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, observer: Observer,
               keep: Kept = None, backward_passes: Passes = ()):
    import torch
    from functorch.compile import make_boxed_func

    from .._torch_compat import aot_module_simplified
    from ..passes import run_passes

    def recorder(kind: str):
        # Note: [A lazy backward compile is no frame for Dynamo]
        #     AOTAutograd compiles a backward at its first call: inside a
        #     backward() that a compiled step graph-broke on, Dynamo's frame
        #     hook is still set and traced this callback (a graph break in it).
        @torch.compiler.disable(reason="compiling a graph is no user code")
        def compile_graph(g: fx.GraphModule, _inputs):
            if kind == "backward":
                g = run_passes(g, backward_passes)
            observer.aot_graph(kind, g)
            compiled = make_boxed_func(g.forward)
            if keep is not None:
                keep.append(AotGraph(kind, g, compiled))
            return compiled

        return compile_graph

    with _backward_now(keep):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=recorder("forward"), bw_compiler=recorder("backward")
        )


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, observer: Observer,
              keep: Kept = None, backward_passes: Passes = ()):
    import torch

    from .._torch_compat import compile_fx, compile_fx_inner, functorch_config, select_decomp_table
    from ..graph_utils import calls_invoke_subgraph
    from ..passes import run_passes
    from ..passes.hoist_subgraph_views import hoist_subgraph_views
    from ..passes.lone_ops import aot_decompositions, compiling_lone_ops_as_aten
    from . import cache_keys

    @torch.compiler.disable(reason="compiling a graph is no user code")  # Note: [A lazy backward compile is no frame for Dynamo]
    def inner_compile(g: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        # The AOT-graph stage of the pipeline (see compiler.pipeline.STAGES):
        # Inductor plans buffers as if subgraph outputs never alias inputs;
        # a caller's backward passes (a DTensor border's) come after.
        g = run_passes(g, [hoist_subgraph_views, *(backward_passes if kind == "backward" else ())])
        # a backward pass may add placeholders after the others (hoist_tangent_reductions): their examples
        inputs = [*inputs, *(n.meta["val"] for n in list(g.graph.find_nodes(op="placeholder"))[len(inputs):])]
        observer.aot_graph(kind, g)
        # Note: [A lone op runs as its ATen op] (passes/lone_ops.py)
        with compiling_lone_ops_as_aten(opts.lone_ops_as_aten):
            # Inductor's own decomposition getter for its own tracing (patterns, fallbacks):
            # the FX graph cache pickles it, and a table of functions is no stable key (a
            # bypass); the table AOTAutograd got already shaped the graph hashed here
            kwargs = {**kwargs, "get_decomp_fn": select_decomp_table} if "get_decomp_fn" in kwargs else kwargs
            compiled = compile_fx_inner(g, inputs, **kwargs)
        observer.inner_output(kind, compiled)
        if keep is not None:
            keep.append(AotGraph(kind, g, compiled))
        return compiled

    # AOTAutograd's cache is keyed on this graph, not on inner_compile: a hit could
    # serve an artifact compiled without hoist_subgraph_views, and it never calls
    # inner_compile, so nothing would be kept.  Inductor's own cache stays on (it
    # keys on the graph after the pass).
    no_aot_cache = keep is not None or calls_invoke_subgraph(gm)
    # Note: [The mesh out of the cache key] (cache_keys.py); a kept piece's
    # callers index its inputs, so it keeps them.
    gm, inputs, lifted = (cache_keys.lift_meshes(gm, example_inputs) if keep is None and opts.stable_cache_keys
                          else (gm, list(example_inputs), ()))
    before = cache_keys.CacheCounts.now()
    # also around AOTAutograd, whose cache key then holds the switch and the pass's
    # uuid; inner_compile sets it again for a backward compiled lazily, later
    with _backward_now(keep), functorch_config.patch(
            enable_autograd_cache=functorch_config.enable_autograd_cache and not no_aot_cache), \
            cache_keys.marked_cacheable(bool(lifted)), compiling_lone_ops_as_aten(opts.lone_ops_as_aten):
        compiled = compile_fx(gm, inputs, inner_compile=inner_compile, decompositions=aot_decompositions())
    cache_keys.log_counts(f"graph of {len(inputs)} inputs", before, lifted)
    return cache_keys.without_meshes(compiled, lifted, len(example_inputs)) if lifted else compiled


def caches_serve(opts: BackendOptions, observer: Observer) -> bool:
    """Would torch's caches serve a graph compiled now, with nobody asking for
    its AOT graphs (Notes: [A border torch's caches can serve], [A kept
    compile restarts from Inductor's cache])?"""
    return _torch_caches_on(opts) and not observer.wants_aot_graphs


def _torch_caches_on(opts: BackendOptions) -> bool:
    from .._torch_compat import functorch_config, inductor_config

    return (opts.inner == "inductor" and bool(functorch_config.enable_autograd_cache)
            and bool(inductor_config.fx_graph_cache) and not inductor_config.force_disable_caches)


def _backward_now(keep: Kept):
    import contextlib

    from .._torch_compat import functorch_config

    if keep is None:
        return contextlib.nullcontext()
    # AOTAutograd compiles a backward lazily, at its first call; a kept one is
    # called directly, so it must exist when compile_one returns.
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


INNER: dict[str, Callable[..., Callable]] = {
    "inductor": _inductor,
    "aot_eager": _aot_eager,
    "eager": _eager,
}
if tuple(INNER) != INNER_COMPILERS:
    raise AssertionError(f"inner compiler table {tuple(INNER)} != BackendOptions' names {INNER_COMPILERS}")


def inner_compiler(opts: BackendOptions, observer: Observer | None = None) -> CompileOne:
    """``compile_one(gm, example_inputs, aot_graphs=False) -> Compiled`` for ``opts.inner``."""
    compile_fn = INNER[opts.inner]
    watch = observer if observer is not None else Observer()

    def compile_one(gm: fx.GraphModule, example_inputs: list[Any], aot_graphs: bool = False,
                    as_is: bool = False, backward_passes: Passes = ()) -> Compiled:
        if not aot_graphs and not as_is and opts.uses_lean_border:
            # a DTensor graph compiled whole: see compiler/dtensor_border.py.  The
            # border keeps its AOT graphs, which an AOTAutogradCache hit cannot
            # give back: stable_cache_keys=True asks for that cache too, so it
            # goes without the border (whose graphs hit Inductor's cache anyway).
            from . import cache_keys
            from .cacheable_border import CacheableBorder, border_for
            from .dtensor_border import DTensorBorder

            # Note: [Stable keys behind the border] (cache_keys.py)
            lifted_gm, inputs, lifted = cache_keys.lift_meshes(gm, example_inputs, carried_only=True)
            border = border_for(lifted_gm, inputs, compile_one,
                                cacheable=caches_serve(opts, watch))
            watch.border(border.text() if isinstance(border, (DTensorBorder, CacheableBorder))
                         else f"not used, AOTAutograd's runtime instead: {border.text}")
            if isinstance(border, (DTensorBorder, CacheableBorder)):
                cache_keys.log_lifted("DTensor border", lifted)
                return Compiled(cache_keys.without_meshes(border, lifted, len(example_inputs)) if lifted else border)
        keep: Kept = [] if aot_graphs else None
        if backward_passes and keep is None:
            raise ValueError("backward_passes need aot_graphs=True: the caller runs the backward it rewrote")
        fn = compile_fn(gm, example_inputs, opts, watch, keep, backward_passes)
        return Compiled(fn, tuple(keep) if keep is not None else ())

    return compile_one
