"""Consecutive layer calls of a split frame become one :class:`~.runtime.LayerRun`.

:func:`find_layer_runs` finds them (read-only); :func:`chain_layer_runs`
rewrites them (a ``PassResult`` pass, run by
:func:`localmap_fx.passes.run_passes`).  See Note: [A run of layers] in
:mod:`.runtime`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..graph_utils import getitem_users
from ..passes import PassResult
from .runtime import CompiledLayer, LayerRun, RunStep, Source
from .whole_gradients import whole_gradient_of

__all__ = ["find_layer_runs", "chain_layer_runs", "runs_of"]


def find_layer_runs(outer: fx.GraphModule, is_layer: Callable[[fx.Node], bool],
                    alone: Callable[[fx.Node], bool] = lambda call: False) -> list[list[fx.Node]]:
    """Maximal runs (two or more) of consecutive piece calls that ``is_layer`` accepts.

    Only ``getitem`` nodes of a run's calls may sit between them.  A call
    ``alone`` accepts is a run even by itself (an output whose gradient
    arrives whole needs its run: Note: [The last layer's gradient arrives
    whole] in :mod:`.whole_gradients`).
    """

    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []

    def close() -> None:
        if len(current) >= 2 or (current and alone(current[0])):
            runs.append(list(current))
        current.clear()

    for n in outer.graph.nodes:
        if n.op == "call_module" and is_layer(n):
            current.append(n)
            continue
        if n.op == "call_function" and n.target is operator.getitem and current and n.args[0] in current:
            continue
        close()
    close()
    return runs


def chain_layer_runs(outer: fx.GraphModule, runs: Sequence[Sequence[fx.Node]],
                     layer_of: Callable[[fx.Node], CompiledLayer]) -> PassResult:
    """Replace each run of layer calls by one call to a :class:`LayerRun` (``run_<i>``).

    before::

        (a,) = piece_1(x, mesh, w0)            # CompiledLayer K
        (b,) = piece_2(a, mesh, w1)            # CompiledLayer K
        loss = tail(b)

    after::

        (b,) = run_0(x, mesh, w0, w1)          # LayerRun: piece_1, piece_2
        loss = tail(b)
    """

    for r, calls in enumerate(runs):
        members = set(calls)
        inputs: list[fx.Node] = []
        index: dict[fx.Node, int] = {}
        produced: dict[fx.Node, tuple[int, int]] = {}  # getitem node -> (step, output)
        steps = []
        for j, call in enumerate(calls):
            srcs: list[Source] = []
            for a in call.args:
                if not isinstance(a, fx.Node):
                    raise AssertionError(f"layer call {call.name} has a constant argument {a!r}")
                if a in produced:
                    srcs.append(("out", *produced[a]))
                else:
                    if a not in index:
                        index[a] = len(inputs)
                        inputs.append(a)
                    srcs.append(("in", index[a]))
            whole = tuple((k, w) for k, o in sorted(getitem_users(call).items())
                          if (w := whole_gradient_of(o)) is not None)
            steps.append(RunStep(str(call.target), layer_of(call), tuple(srcs), whole))
            for u in call.users:
                if u.op != "call_function" or u.target is not operator.getitem:
                    raise AssertionError(f"layer call {call.name} is used by {u.format_node()}")
                k = u.args[1]
                if not isinstance(k, int):
                    raise AssertionError(f"layer call {call.name} is indexed by {k!r}")
                produced[u] = (j, k)
        leaving = [g for g in produced if any(u not in members and u not in produced for u in g.users)]
        run = LayerRun(tuple(steps), len(inputs), tuple(produced[g] for g in leaving))
        name = f"run_{r}"
        outer.add_submodule(name, _RunModule(run))
        with outer.graph.inserting_before(calls[0]):
            new = outer.graph.call_module(name, tuple(inputs))
            outs = []
            for i, g in enumerate(leaving):
                o = outer.graph.call_function(operator.getitem, (new, i))
                o.meta = dict(g.meta)
                outs.append(o)
        for g, o in zip(leaving, outs):
            g.replace_all_uses_with(o)
        for call in reversed(calls):
            for g in [u for u in call.users]:
                outer.graph.erase_node(g)
            outer.graph.erase_node(call)
    return PassResult(outer, (outer,) if runs else ())


class _RunModule(torch.nn.Module):
    def __init__(self, run: LayerRun) -> None:
        super().__init__()
        self.run = run

    def forward(self, *inputs: Any) -> tuple:
        return self.run(*inputs)


def runs_of(outer: fx.GraphModule) -> dict[str, str]:
    """Piece name -> the ``run_<i>`` submodule that now calls it (read-only)."""
    return {step.piece: name for name, m in outer.named_children() if isinstance(m, _RunModule)
            for step in m.run.steps}
