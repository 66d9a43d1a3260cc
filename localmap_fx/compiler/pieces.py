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
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import node_value
from ..passes.share_layers import META_PIECE, pieces_of

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

    def row(self) -> tuple:
        return (self.name, "-" if self.layer is None else str(self.layer), self.compiled_as,
                self.key_digest, self.n_nodes, self.reason or "")


class _CompiledPiece(torch.nn.Module):
    def __init__(self, fn: Callable, name: str) -> None:
        super().__init__()
        self.fn = fn
        self.compiled_as = name

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _fake_mode(example_inputs: Sequence[Any]):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs)


def compile_pieces(
    outer: fx.GraphModule,
    compile_one: Callable[[fx.GraphModule, list[Any]], Callable],
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
            example = [node_value(a) for a in call.args]
            fake_mode = _fake_mode(example)
            if fake_mode is not None:
                with tracing(TracingContext(fake_mode)):
                    fn = compile_one(sub, example)
            else:
                fn = compile_one(sub, example)
            compiled = _CompiledPiece(fn, target)
            if key is not None:
                by_key[key] = compiled
        n_nodes = sum(1 for n in sub.graph.nodes if n.op not in ("placeholder", "output"))
        setattr(outer, target, compiled)
        reports.append(PieceReport(
            target, meta["layer"], compiled.compiled_as,
            _digest(key) if key is not None else "-", meta["reason"], n_nodes,
        ))
    # No recompile: the graph is unchanged, and its code looks each piece up
    # as ``self.piece_<i>`` when it runs, so it calls the compiled ones.
    return outer, reports
