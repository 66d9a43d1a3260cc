"""The layer plan: which nodes of a graph form which layer (pure values).

:func:`localmap_fx.layer_sharing.find.find_layer_spans` builds a
:class:`LayerPlan`; :mod:`.decide` weighs it, :mod:`.borders` and
:mod:`.split` rewrite along it.  Nothing here reads or edits a graph beyond
listing its compute nodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

__all__ = ["LayerSpan", "LayerPlan", "compute_nodes", "digest"]


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """Nodes ``[start, stop)`` of its plan's ``nodes`` form layer ``index``.

    ``key`` is None when the span cannot be shared; ``reason`` says why.
    """

    index: int
    start: int
    stop: int
    key: tuple | None
    reason: str | None = None

    @property
    def digest(self) -> str:
        return digest(self.key) if self.key is not None else "-"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """The layers found in one graph, or why none were.

    ``period`` regions per layer, starting at region ``first_region``;
    ``spans`` in program order.  ``reason`` is set when no sharing is
    possible at all (the spans are then empty or all unshared).
    """

    period: int
    first_region: int
    spans: tuple[LayerSpan, ...]
    reason: str | None = None
    # to_local nodes of graph inputs moved into the prefix piece (Note:
    # [Weights enter as local tensors])
    hoisted: tuple[fx.Node, ...] = dataclasses.field(default=(), compare=False)
    # the graph's compute nodes in the order the spans index them
    # (compute_nodes(gm, hoisted)): the plan names nodes by reference only
    nodes: tuple[fx.Node, ...] = dataclasses.field(default=(), compare=False)

    @property
    def shared(self) -> tuple[LayerSpan, ...]:
        return tuple(s for s in self.spans if s.key is not None)

    def nodes_of(self, span: LayerSpan) -> tuple[fx.Node, ...]:
        """The nodes of ``span``, in program order."""
        return self.nodes[span.start:span.stop]

    def text(self) -> str:
        if not self.spans:
            return f"no repeated layers: {self.reason}"
        lines = [f"{len(self.spans)} layers of {self.period} region(s), from region {self.first_region}"]
        for s in self.spans:
            what = f"key {s.digest}" if s.key is not None else f"inline: {s.reason}"
            lines.append(f"  layer {s.index}: nodes [{s.start}, {s.stop}) {what}")
        return "\n".join(lines)


def digest(key: Any) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:10]


def compute_nodes(gm: fx.GraphModule, hoisted: Sequence[fx.Node] = ()) -> list[fx.Node]:
    """The nodes spans index into: everything but placeholders and the output,
    ``hoisted`` first.

    Note: [Weights enter as local tensors]
        A ``to_local`` of a graph input (a weight) found at the same place in
        every layer is moved to the front, into the prefix piece: layer
        pieces then receive weights as plain local tensors (no DTensor
        unwrapping per piece call at run time).  Only the split order
        changes; the graph itself is not touched.
    """
    first = set(hoisted)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and n not in first]
    return list(hoisted) + body

