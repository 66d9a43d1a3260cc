"""Compile the pieces of a split graph, once per distinct layer.

:func:`~.split.split_layers` turns one Dynamo graph into an outer graph
that calls ``piece_<i>`` submodules.  Here every piece is handed to the
inner compiler (AOTAutograd + Inductor, or AOTAutograd alone) with the fake
values Dynamo recorded for its inputs; pieces whose layer key is equal
reuse the first one's :class:`CompiledPiece`, so AOT tracing, partitioning,
code generation and C++/Triton compilation happen once per distinct layer.
The outer graph then runs as plain Python, calling the compiled pieces in
order (as DDPOptimizer does with its buckets); :func:`layer_runs` (a pass)
makes consecutive layers one :class:`~.runtime.LayerRun`.

Note: [One TracingContext per piece]
    Dynamo holds one TracingContext per frame; AOTAutograd stores the
    forward metadata of the graph it compiles there, and the lazily
    compiled backward reads it back.  With several AOT graphs per frame the
    last one would win, so each piece is compiled under a TracingContext of
    its own (sharing Dynamo's fake mode and shape environment).  That
    context is also the only place AOTAutograd leaves a piece's metadata
    (``fw_metadata``), which :func:`compiled_layer` needs: it is read back
    in one place, :func:`.runtime.compile_with_metadata`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..graph_utils import getitem_users, node_value
from ..passes import PassResult
from ..passes.hoist_tangent_reductions import reductions_of
from .plan import digest
from .runs import chain_layer_runs, find_layer_runs, runs_of
from .runtime import CompiledLayer, Refusal, Refused, compile_with_metadata, compiled_layer, subclasses_crossing
from .split import META_PIECE, PieceMeta, pieces_of
from .unwrap import Unwrap, unwrap_of
from .whole_gradients import convert_unheld, hoisted_keys, unheld_whole_gradients, whole_gradient_of

if TYPE_CHECKING:
    from ..compiler.inner import AotGraph, CompileOne

__all__ = ["CompiledPiece", "PieceReport", "compile_piece", "compile_pieces", "layer_runs"]


@dataclasses.dataclass(frozen=True)
class CompiledPiece:
    """One piece compiled by the inner compiler.

    ``layer`` is the :class:`CompiledLayer` the piece runs as, the
    :class:`Refusal` saying why it keeps AOTAutograd's runtime, or None for
    a piece compiled for one call (no layer key).
    """

    name: str  # the piece this was compiled from
    fn: Callable  # what a call of the piece runs
    aot_graphs: tuple[AotGraph, ...] = ()
    layer: CompiledLayer | Refusal | None = None

    @property
    def runtime(self) -> str:
        import inspect

        from ..compiler.dtensor_border import DTensorBorder

        if isinstance(self.fn, Unwrap):
            return self.fn.text()
        if isinstance(self.layer, CompiledLayer):
            return "layer"
        if isinstance(inspect.unwrap(self.fn), DTensorBorder):  # behind without_meshes, maybe
            return "DTensor border"
        return f"aot: {self.layer.text}" if isinstance(self.layer, Refusal) else "aot"


@dataclasses.dataclass(frozen=True)
class PieceReport:
    """One piece of a split frame: which compiled callable it runs."""

    name: str
    layer: int | None
    compiled_as: str  # name of the piece whose compiled callable it runs
    key_digest: str
    reason: str | None
    n_nodes: int
    # "layer" (a CompiledLayer), "layer in run_<i>", or why AOTAutograd's runtime wrappers run it
    runtime: str = "aot"

    def row(self) -> tuple:
        return (self.name, "-" if self.layer is None else str(self.layer), self.compiled_as,
                self.key_digest, self.n_nodes, self.reason or "")


class _PieceModule(torch.nn.Module):
    """A compiled piece where the outer graph's ``self.piece_<i>`` finds it."""

    def __init__(self, piece: CompiledPiece) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Any) -> Any:
        return self.piece.fn(*args)


def compile_piece(sub: fx.GraphModule, example: list[Any], compile_one: CompileOne, name: str,
                  as_layer: bool, cache: bool = False, hoist: bool = False) -> CompiledPiece:
    """Compile one piece; ``as_layer``: try to run it as a :class:`CompiledLayer`.

    A layer piece that DTensors cross is compiled as a graph of its own
    (``compile_one`` puts it behind the lean DTensor border where that is
    on: Note: [No DTensor at an automatic border]); AOTAutograd's subclass
    runtime runs it otherwise, as it runs every piece a CompiledLayer refuses.
    ``cache``: a layer is restored from, and saved to, Inductor's cache
    (Note: [A kept compile restarts from Inductor's cache]).  ``hoist``: its
    backward's tangent reductions are taken out, for its runs to supply
    (Note: [The last layer's gradient arrives whole]); a layer refused then
    is compiled again without (AOTAutograd's runtime gives no reduction).
    """
    from .._torch_compat import detect_fake_mode
    from ..compiler import layer_cache
    from ..passes.hoist_tangent_reductions import hoist_tangent_reductions

    # Note: [What a CompiledLayer relies on]
    out_node = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    border = [*example, *(node_value(o) for o in out_node.args[0])]
    crossing = subclasses_crossing(border) if as_layer else ()
    hoist = hoist and as_layer and not crossing
    caller = ["layer piece", "tangent reductions hoisted"] if hoist else ["layer piece"]
    key = layer_cache.layer_key(sub, example, caller) if cache and as_layer and not crossing else None
    if key is not None:
        restored = layer_cache.load_layer(key, detect_fake_mode(example))
        if restored is not None:
            return CompiledPiece(name, restored[0], (), restored[0])
    compiled, fw_metadata = compile_with_metadata(compile_one, sub, example, as_layer and not crossing,
                                                  backward_passes=(hoist_tangent_reductions,) if hoist else ())
    if not as_layer:
        return CompiledPiece(name, compiled.fn)
    if crossing:
        return CompiledPiece(name, compiled.fn, layer=Refusal(
            Refused.SUBCLASS_AT_BORDER, f"a {', '.join(crossing)} crosses its border"))
    layer = compiled_layer(compiled.aot_graphs, fw_metadata, border)
    if hoist and not isinstance(layer, CompiledLayer) and any(
            reductions_of(g.graph) for g in compiled.aot_graphs if g.kind == "backward"):
        return compile_piece(sub, example, compile_one, name, as_layer, cache)
    if key is not None and isinstance(layer, CompiledLayer):
        layer_cache.save_layer(key, compiled.aot_graphs, layer, None)
    fn = layer if isinstance(layer, CompiledLayer) else compiled.fn
    return CompiledPiece(name, fn, compiled.aot_graphs, layer)


# Note: [A piece without matrix products skips Inductor]
#     A piece used once (no layer key: the code before the first layer, an
#     unshared layer, the loss after the last) whose nodes hold no matrix
#     product is a handful of pointwise ops and reductions run once per
#     step, e.g. a TP stack's ``(h * h).sum()``.  Inductor would generate a
#     C++ (or Triton) file for its forward and one for its backward, each
#     compiled at cold start (about 0.5 CPU-s per file on the CPU stack), to
#     save a few microseconds per step; AOTAutograd alone (``small``: the
#     aot_eager inner compiler) traces it and runs its ATen ops.  A piece
#     with a matrix product (an unshared layer, an output projection) keeps
#     the inner compiler.
def skips_inductor(sub: fx.GraphModule) -> bool:
    """Is ``sub`` a piece without matrix products (Note: [A piece without matrix products skips Inductor])?"""
    from .decide import has_matmul

    return not has_matmul(sub.graph.nodes)


def compile_pieces(outer: fx.GraphModule, compile_one: CompileOne, small: CompileOne | None = None,
                   cache: bool = False) -> list[PieceReport]:
    """Give every piece of ``outer`` its compiled callable (one compile per key).

    A piece that only unwraps its DTensor inputs is no compile: it runs as an
    :class:`~.unwrap.Unwrap` (Note: [A piece that only unwraps runs as an
    Unwrap]); ``small`` compiles a piece used once that holds no matrix
    product (Note: [A piece without matrix products skips Inductor]),
    ``compile_one`` the others; ``cache``: :func:`compile_piece`'s.  The graph is not edited: its code looks
    each piece up as ``self.piece_<i>`` when it runs, so it calls the
    compiled ones.
    """
    by_key: dict[tuple, CompiledPiece] = {}
    reports: list[PieceReport] = []
    hoisted = hoisted_keys(outer)  # Note: [The last layer's gradient arrives whole]
    for call in pieces_of(outer):
        meta: PieceMeta = call.meta[META_PIECE]
        target = str(call.target)
        sub: Any = outer.get_submodule(target)
        compiled = by_key.get(meta.key) if meta.key is not None else None
        if compiled is None:
            unwrap = unwrap_of(sub) if meta.key is None else None
            if unwrap is not None:
                compiled = CompiledPiece(target, unwrap)
            else:
                example = [node_value(a) for a in call.args]
                one = small if small is not None and meta.key is None and skips_inductor(sub) else compile_one
                compiled = compile_piece(sub, example, one, target, meta.key is not None, cache and one is compile_one,
                                         hoist=meta.key in hoisted)
            if meta.key is not None:
                by_key[meta.key] = compiled
        n_nodes = sum(1 for n in sub.graph.nodes if n.op not in ("placeholder", "output"))
        setattr(outer, target, _PieceModule(compiled))
        reports.append(PieceReport(
            target, meta.layer, compiled.name,
            digest(meta.key) if meta.key is not None else "-", meta.reason, n_nodes, compiled.runtime,
        ))
    return reports


def _layer_of(outer: fx.GraphModule, call: fx.Node) -> CompiledLayer | Refusal | None:
    module = outer.get_submodule(str(call.target))
    return module.piece.layer if isinstance(module, _PieceModule) else None


def layer_runs(outer: fx.GraphModule) -> PassResult:
    """Consecutive compiled layers of ``outer`` run as one LayerRun (Note: [A run of layers])."""

    def layer(call: fx.Node) -> CompiledLayer:
        found = _layer_of(outer, call)
        if not isinstance(found, CompiledLayer):
            raise AssertionError(f"{call.target} does not run as a CompiledLayer")
        return found

    def is_layer(call: fx.Node) -> bool:
        return isinstance(_layer_of(outer, call), CompiledLayer)

    def takes_whole(call: fx.Node) -> bool:
        return any(whole_gradient_of(o) is not None for o in getitem_users(call).values())

    # Note: [The last layer's gradient arrives whole]: a layer that runs no
    # LayerRun gets its gradient divided by the outer graph instead
    converted = convert_unheld(outer, unheld_whole_gradients(outer, is_layer))
    runs = find_layer_runs(outer, is_layer, alone=takes_whole)
    chained = chain_layer_runs(outer, runs, layer)
    return PassResult.of(outer, [*converted.changed, *chained.changed])


def with_runs(reports: Sequence[PieceReport], outer: fx.GraphModule) -> list[PieceReport]:
    """``reports`` saying which run now calls each piece (after :func:`layer_runs`)."""
    run_of = runs_of(outer)
    return [dataclasses.replace(r, runtime=f"layer in {run_of[r.name]}") if r.name in run_of else r
            for r in reports]
