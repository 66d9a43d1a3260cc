"""Stable cache keys for shared layer pieces: their mesh inputs become constants.

A piece of a split frame receives the DeviceMesh from the outer graph as an
input, and AOTAutograd hands it on to Inductor in the forward graph's
example inputs, which Inductor's FX graph cache key pickles: a key that no
new process computes again (Note: [The mesh out of the cache key] in
:mod:`localmap_fx.compiler.cache_keys`).  :func:`lift_piece_meshes` makes
the mesh a ``mesh_constant(key)`` call inside each shared layer piece, as the
lean border does for a graph compiled whole.  A shared layer piece keeps its
AOT graphs (AOTAutogradCache is off for it), so no cacheability declaration
is needed, and its callers (the outer graph, a LayerRun) pass one argument
less.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from ..compiler.cache_keys import MeshInput, lift_mesh_inputs, mesh_inputs
from ..graph_utils import node_value
from ..passes import PassResult
from .split import META_PIECE, pieces_of

__all__ = ["lift_piece_meshes"]


def _piece(outer: fx.GraphModule, call: fx.Node) -> fx.GraphModule:
    sub = outer.get_submodule(str(call.target))
    if not isinstance(sub, fx.GraphModule):
        raise AssertionError(f"{call.target} is a {type(sub).__name__}, not a piece's graph")
    return sub


def _piece_meshes(call: fx.Node, sub: fx.GraphModule) -> tuple[MeshInput, ...]:
    """The mesh inputs of one piece call that can be lifted; () when any cannot, or when a
    DTensor enters the piece (AOTAutograd's subclass runtime would then take each
    DTensor's mesh as an input of its own, and the lifted piece of a split frame
    is what its partitioner fails on: compiler/cache_keys.find_mesh_inputs)."""
    from torch.distributed.tensor import DTensor

    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    values = [node_value(a) for a in call.args]
    if call.kwargs or len(placeholders) != len(values) or any(isinstance(v, DTensor) for v in values):
        return ()
    return mesh_inputs(placeholders, values)


def _where(found: Sequence[MeshInput]) -> list[tuple[int, str]]:
    return [(m.position, m.key) for m in found]


def lift_piece_meshes(outer: fx.GraphModule) -> PassResult:
    """In every shared layer piece of a split frame, each mesh input becomes a
    ``mesh_constant(key)`` call, and the outer graph stops passing it.

    Only pieces with a layer key whose calls all lift the same meshes at the
    same positions (the piece is compiled once for all of them) and into
    which no DTensor enters (a plain layer border)::

        before                                          after
        ------                                          -----
        piece_1 = self.piece_1(x, mesh, w1, w2)         piece_1 = self.piece_1(x, w1, w2)

        piece_1:                                        piece_1:
        def forward(self, in0, in1_mesh, in2, in3):     def forward(self, in0, in2, in3):
                                                            in1_mesh = mesh_constant("cpu|(2,)|...")
            dt = from_local(in0, in1_mesh, ...)             dt = from_local(in0, in1_mesh, ...)
    """
    by_key: dict[tuple, list[tuple[fx.Node, tuple[MeshInput, ...]]]] = {}
    for call in pieces_of(outer):
        key = call.meta[META_PIECE].key
        if key is not None:
            by_key.setdefault(key, []).append((call, _piece_meshes(call, _piece(outer, call))))
    changed: list[fx.GraphModule] = []
    for calls in by_key.values():
        first = calls[0][1]
        if not first or any(_where(found) != _where(first) for _, found in calls):
            continue
        for call, found in calls:
            sub = _piece(outer, call)
            lift_mesh_inputs(sub, found, [node_value(a) for a in call.args])
            dropped = {m.position for m in found}
            call.args = tuple(a for i, a in enumerate(call.args) if i not in dropped)
            changed.append(sub)
    if not changed:
        return PassResult(outer)
    return PassResult.of(outer, [outer, *changed])
