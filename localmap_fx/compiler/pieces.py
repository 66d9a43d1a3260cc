"""Compile the pieces of a split graph, once per distinct layer.

:func:`localmap_fx.passes.share_layers.split_layers` turns one Dynamo graph
into an outer graph that calls ``piece_<i>`` submodules.  Here every piece
is handed to the inner compiler (AOTAutograd + Inductor, or AOTAutograd
alone) with the fake values Dynamo recorded for its inputs; pieces whose
layer key is equal reuse the first one's compiled callable, so AOT tracing,
partitioning, code generation and C++/Triton compilation happen once per
distinct layer.  The outer graph then runs as plain Python, calling the
compiled pieces in order (as DDPOptimizer does with its buckets).

Note: [One TracingContext per piece]
    Dynamo holds one TracingContext per frame; AOTAutograd stores the
    forward metadata of the graph it compiles there, and the lazily
    compiled backward reads it back.  With several AOT graphs per frame the
    last one would win, so each piece is compiled under a TracingContext of
    its own (sharing Dynamo's fake mode and shape environment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..graph_utils import is_to_local, node_value
from ..passes.share_layers import META_PIECE, pieces_of
from .layer_runtime import CompiledLayer, chain_layer_runs, compiled_layer, find_layer_runs

if TYPE_CHECKING:
    from .inner import CompileOne

__all__ = ["PieceReport", "compile_pieces"]


@dataclasses.dataclass(frozen=True)
class PieceReport:
    """One piece of a split frame: which compiled callable it runs."""

    name: str
    layer: int | None
    compiled_as: str  # name of the piece whose compiled callable it runs
    key_digest: str
    reason: str | None
    n_nodes: int
    # "layer" (a CompiledLayer), or why AOTAutograd's runtime wrappers run it
    runtime: str = "aot"

    def row(self) -> tuple:
        return (self.name, "-" if self.layer is None else str(self.layer), self.compiled_as,
                self.key_digest, self.n_nodes, self.reason or "")


class _CompiledPiece(torch.nn.Module):
    def __init__(self, fn: Callable, name: str, runtime: str) -> None:
        super().__init__()
        self.fn = fn
        self.compiled_as = name
        self.runtime = runtime

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _layer_of(outer: fx.GraphModule, call: fx.Node) -> CompiledLayer:
    fn = getattr(outer.get_submodule(str(call.target)), "fn", None)
    if not isinstance(fn, CompiledLayer):
        raise AssertionError(f"{call.target} does not run as a CompiledLayer")
    return fn


def _fake_mode(example_inputs: Sequence[Any]):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)


# --- Note: [A piece that only unwraps skips Inductor] (cache branch) ---
#     The prefix piece of a split frame is often only ``to_local`` of the
#     frame's DTensor inputs (the weights).  Inductor compiles its forward to
#     an empty graph that returns the weights' own local tensor objects, and
#     AOTAutograd's autograd.Function then gives those objects a grad_fn: the
#     parameter's ``_local_tensor`` turns requires_grad=True, Dynamo's guard
#     on it fails and the frame recompiles on the next step (and an empty
#     graph has no FX cache key, so it is never cached).  Run by AOTAutograd
#     without Inductor (as aot_eager), its graph returns aliases, new tensor
#     objects (16-layer TP stack on CPU: step 2.92 ms against 2.81-2.88 ms
#     with the Inductor prefix; eager ``to_local`` per weight was slower).
def _only_unwraps(sub: fx.GraphModule) -> bool:
    body = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    return bool(body) and all(is_to_local(n) and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
                              for n in body)


def _aot_only(gm: fx.GraphModule, example_inputs: list[Any], keep: Any = None) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def nop(gm, example_inputs):
        return make_boxed_func(gm.forward)

    return aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop)
# --- end cache branch ---


def compile_pieces(
    outer: fx.GraphModule,
    compile_one: CompileOne,
) -> tuple[fx.GraphModule, list[PieceReport]]:
    """Replace every piece of ``outer`` by its compiled callable (shared per key)."""
    from torch._guards import TracingContext, tracing

    from ..passes.share_layers import _digest

    by_key: dict[tuple, _CompiledPiece] = {}
    reports: list[PieceReport] = []
    for call in pieces_of(outer):
        meta = call.meta[META_PIECE]
        target = str(call.target)
        sub: Any = outer.get_submodule(target)
        key = meta["key"]
        compiled = by_key.get(key) if key is not None else None
        if compiled is None:
            # Note: [A piece that only unwraps skips Inductor]
            one = _aot_only if key is None and _only_unwraps(sub) else compile_one
            example = [node_value(a) for a in call.args]
            fake_mode = _fake_mode(example)
            keep: list | None = [] if key is not None else None
            context = TracingContext(fake_mode) if fake_mode is not None else None
            if context is not None:
                with tracing(context):
                    fn = one(sub, example, keep)
            else:
                fn = one(sub, example, keep)
            runtime = "aot"
            if keep is not None:
                # Note: [What a CompiledLayer relies on]
                out_node = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
                border = [*example, *(node_value(o) for o in out_node.args[0])]
                layer = compiled_layer(keep, context.fw_metadata if context is not None else None, border)
                if isinstance(layer, CompiledLayer):
                    fn, runtime = layer, "layer"
                else:
                    runtime = f"aot: {layer}"
            compiled = _CompiledPiece(fn, target, runtime)
            if key is not None:
                by_key[key] = compiled
        n_nodes = sum(1 for n in sub.graph.nodes if n.op not in ("placeholder", "output"))
        setattr(outer, target, compiled)
        reports.append(PieceReport(
            target, meta["layer"], compiled.compiled_as,
            _digest(key) if key is not None else "-", meta["reason"], n_nodes, compiled.runtime,
        ))
    # The graph is unchanged so far, and its code looks each piece up as
    # ``self.piece_<i>`` when it runs, so it calls the compiled ones.
    # Note: [A run of layers]
    runs = find_layer_runs(outer, lambda n: getattr(outer.get_submodule(str(n.target)), "runtime", "") == "layer")
    if runs:
        run_of = {str(c.target): f"run_{r}" for r, calls in enumerate(runs) for c in calls}
        outer = chain_layer_runs(outer, runs, lambda n: _layer_of(outer, n))
        reports = [dataclasses.replace(rep, runtime=f"layer in {run_of[rep.name]}") if rep.name in run_of else rep
                   for rep in reports]
    return outer, reports
