"""Inner compilers: what receives the lowered graph (or each compiled piece).

:data:`INNER` is the table; :func:`inner_compiler` returns the compile
function for a :class:`BackendOptions`.  Every AOT-based entry reports its
forward and backward graphs through ``opts.on_aot_graph``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .options import INNER_COMPILERS, BackendOptions

__all__ = ["INNER", "CompileOne", "inner_compiler"]

# compile_one(gm, example_inputs) -> a callable running gm
CompileOne = Callable[[fx.GraphModule, list[Any]], Callable]
OnOutput = Callable[[str, Any], None] | None


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, on_output: OnOutput):
    return gm.forward


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, on_output: OnOutput):
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


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, on_output: OnOutput):
    import torch
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from ..passes import apply
    from ..passes.hoist_subgraph_views import hoist_subgraph_views

    def inner_compile(g: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        # The AOT-graph stage of the pipeline (see compiler.pipeline.STAGES):
        # Inductor plans buffers as if subgraph outputs never alias inputs.
        g = apply(hoist_subgraph_views, g)
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


INNER: dict[str, Callable[..., Callable]] = {
    "inductor": _inductor,
    "aot_eager": _aot_eager,
    "eager": _eager,
}
if tuple(INNER) != INNER_COMPILERS:
    raise AssertionError(f"inner compiler table {tuple(INNER)} != BackendOptions' names {INNER_COMPILERS}")


def inner_compiler(opts: BackendOptions, on_output: OnOutput = None) -> CompileOne:
    """``compile_one(gm, example_inputs)`` for ``opts.inner``."""
    compile_fn = INNER[opts.inner]

    def compile_one(gm: fx.GraphModule, example_inputs: list[Any]):
        return compile_fn(gm, example_inputs, opts, on_output)

    return compile_one
