"""The one interface through which a compile is watched.

Every stage of :data:`localmap_fx.compiler.pipeline.STAGES` reports to an
:class:`Observer` (as Inductor's ``GraphTransformObserver`` sees every pass):
the graph after each stage, the graph handed to the inner compiler, the
layer decision, the lean DTensor border (or why not), the AOT graphs and
what the inner compiler produced.  The
dump (:class:`localmap_fx.debug.dump.FrameInspector`, which also feeds
``TORCH_TRACE`` and ``TORCH_LOGS=localmap_fx_regions``) is one observer;
the user's ``on_stage`` / ``on_aot_graph`` options are another
(:class:`UserHooks`); :class:`Observers` calls several in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

__all__ = ["Observer", "Observers", "UserHooks"]


class Observer:
    """Hooks called while a frame compiles; each does nothing unless overridden."""

    # an observer that reads AOT graphs: a graph is then compiled where they
    # exist (an AOTAutogradCache hit has none; Note: [A border torch's caches
    # can serve] in compiler/cacheable_border.py)
    wants_aot_graphs: bool = False

    def stage(self, name: str, gm: fx.GraphModule) -> None:
        """``gm`` after the stage ``name`` (code up to date); ``"captured"`` first."""

    def lowered(self, gm: fx.GraphModule) -> None:
        """The graph the inner compiler receives whole, or the one cut into pieces."""

    def layers(self, plan: Any, decision: Any, pieces: Sequence[Any] | None) -> None:
        """The layer plan, the share-or-not :class:`~localmap_fx.layer_sharing.decide.Decision`
        and, when the frame was split, one report per compiled piece."""

    def border(self, text: str) -> None:
        """How a graph compiled whole runs: behind the lean DTensor border (its
        text, with the tangent plan) or, with the reason, on AOTAutograd's runtime."""

    def aot_graph(self, kind: str, gm: fx.GraphModule) -> None:
        """An AOTAutograd ``"forward"`` / ``"backward"`` graph (inner = inductor or aot_eager)."""

    def inner_output(self, kind: str, compiled: Any) -> None:
        """What the inner compiler produced for an AOT graph (Inductor's compiled module)."""


class Observers(Observer):
    """Several observers, called in the order given."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self.wants_aot_graphs = any(o.wants_aot_graphs for o in self.observers)

    def stage(self, name: str, gm: fx.GraphModule) -> None:
        for o in self.observers:
            o.stage(name, gm)

    def lowered(self, gm: fx.GraphModule) -> None:
        for o in self.observers:
            o.lowered(gm)

    def layers(self, plan: Any, decision: Any, pieces: Sequence[Any] | None) -> None:
        for o in self.observers:
            o.layers(plan, decision, pieces)

    def border(self, text: str) -> None:
        for o in self.observers:
            o.border(text)

    def aot_graph(self, kind: str, gm: fx.GraphModule) -> None:
        for o in self.observers:
            o.aot_graph(kind, gm)

    def inner_output(self, kind: str, compiled: Any) -> None:
        for o in self.observers:
            o.inner_output(kind, compiled)


class UserHooks(Observer):
    """The backend options ``on_stage`` / ``on_aot_graph`` as an observer."""

    def __init__(self, on_stage: Callable[[str, fx.GraphModule], None] | None,
                 on_aot_graph: Callable[[str, fx.GraphModule], None] | None) -> None:
        self.on_stage, self.on_aot_graph = on_stage, on_aot_graph
        self.wants_aot_graphs = on_aot_graph is not None

    def stage(self, name: str, gm: fx.GraphModule) -> None:
        if self.on_stage is not None:
            self.on_stage(name, gm)

    def aot_graph(self, kind: str, gm: fx.GraphModule) -> None:
        if self.on_aot_graph is not None:
            self.on_aot_graph(kind, gm)
