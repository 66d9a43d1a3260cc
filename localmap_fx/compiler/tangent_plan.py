"""Which tangent placements a DTensor border compiles its graph for.

A plan, decided before the one compile from eager DTensor runs on the fake
examples, and its text form (``compile (P); convert (R)``) in the dump.

Note: [The gradient a stack sends back]
    Under regional compilation one border runs every block of a stack, and
    the gradient reaching a block's output is the gradient of the next
    block's input: for a Replicate-in, Replicate-out block (TP, attention)
    it is Partial, except at the last block, whose gradient comes from the
    loss as Replicate.  Compiling the first variant for the default
    (Replicate) and a second at the first Partial doubled the cold compile,
    and for the attention block the second could not be used (its forward
    saves other values), so each block ran an eager all_reduce.  So when an
    output feeds an input of the same spec (:func:`chained_outputs`), the border
    guesses that the stack sends Partial (:func:`guessed_tangents`) and plans before
    it compiles: eager DTensor runs the graph once on the fake examples and
    backpropagates the guess and the default (:func:`eager_runs`; nothing
    traced or compiled), counting the collectives each issues, forward and
    backward, and recording the placements each input's gradient gets.  The
    guess is compiled when it is a fixed point (the chained input's gradient
    is Partial too: :func:`sends`) and costs at most one collective per
    changed output more than its forward: a default variant cannot cost
    less than that forward, and converting Partial back to Replicate costs
    that one all_reduce.  Otherwise the default is compiled, unless the
    guess costs no more than it after all (:func:`plan_tangents`).  Either
    way one variant is compiled; the other is converted, never compiled
    (AOTAutograd coerces a tangent to its traced placements the same way),
    and its input gradients are redistributed to the placements eager
    gives them (the eager run's, the plan's ``traced``), so every gradient
    keeps eager's placements.  The counts are eager DTensor's and so the
    joint graph's: AOTAutograd traces the same sharding decisions, and a
    weight gathered only for a gradient is backward work in both.  The TP
    block compiles Partial and only its last block pays (a local
    division); the attention block's Partial backward gathers both weights
    and reduce-scatters, so Replicate is compiled, and each block converts
    its Partial gradient with one all_reduce.  An eager run on fakes costs
    about a third of an AOTAutograd trace; the plan used to trace the
    guess and read its joint graph, and for the attention block then trace
    the default too.  Values are eager's up to the order of summation
    (bitwise on 2 gloo ranks for the TP stack under aot_eager, where a sum
    of two halves is exact)::

        first:   compile (R), then (P) at the first inner block's backward
        then:    trace (P), read its joint: keep it, or stop and trace (R)
        now:     eager on fakes: forward, backward (P), backward (R); compile the winner once
        TP:      (P): 2 collectives, forward 1, x's gradient P -> compile (P);
                 the last block's R gradient: R -> P locally, not summed again
        attn:    (P): 4 collectives, forward 1; (R): 1 -> compile (R);
                 P -> R (all_reduce), wo's gradient S(0) -> P as eager
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from .._torch_compat import HigherOrderOperator, TorchDispatchMode
from ..graph_utils import is_collective_op
from .border_wrapper import Placements, Slot, wrapper_graph

__all__ = ["CountCollectives", "EagerRun", "TangentPlan", "chained_outputs", "converts_locally", "eager_grads",
           "eager_runs", "guessed_tangents", "placements_text", "plan_tangents", "sends"]


def converts_locally(arrived: Placements, traced: Placements) -> bool:
    """Whether a gradient in ``arrived`` becomes ``traced`` without communication
    (per mesh dimension: the same, or Replicate to Partial or to Shard)."""
    return len(arrived) == len(traced) and all(
        a == t or (a.is_replicate() and (t.is_partial() or t.is_shard())) for a, t in zip(arrived, traced))


def chained_outputs(inputs: Sequence[Slot], outputs: Sequence[Slot], example_inputs: Sequence[Any]) -> dict[int, int]:
    """Output -> the input it would feed if the graph were called on its own
    result (a block of a stack): same placements, shape and dtype, and the
    input requires grad; only outputs with one such input."""
    out: dict[int, int] = {}
    for o, so in enumerate(outputs):
        if so.spec is None:
            continue
        same = [i for i, (si, v) in enumerate(zip(inputs, example_inputs))
                if si.spec is not None and v.requires_grad and si.shape == so.shape
                and si.spec.placements == so.spec.placements
                and si.spec.tensor_meta.dtype == so.spec.tensor_meta.dtype]
        if len(same) == 1:
            out[o] = same[0]
    return out


@dataclasses.dataclass(frozen=True)
class TangentPlan:
    """Which tangents the first variant is compiled for, and what the border
    knows in advance of others (Note: [The gradient a stack sends back])."""

    first: tuple  # per output: placements (None: plain output)
    # other tangents traced: (tangents, per input the placements of its
    # gradient for them, None for no gradient)
    traced: tuple[tuple[tuple, tuple], ...] = ()
    # tangents known to cost more compiled than converted: never compiled
    converted: tuple = ()
    # why a stack's block was not planned (its guess not judged), if it was not
    unplanned: str = ""

    def text(self) -> str:
        out = f"compile {placements_text(self.first)}"
        out += "".join(f"; convert {placements_text(t)}" for t in self.converted)
        return out + (f" (not planned: {self.unplanned})" if self.unplanned else "")


def guessed_tangents(default: tuple, chained: dict[int, int]) -> tuple:
    """The tangents a stack's inner blocks are guessed to receive: a chained
    output's Replicate as Partial, the gradient a Replicate input gets where
    per-shard code reads it (its local gradients are partial sums)."""
    from torch.distributed.tensor import Partial

    return tuple(tuple(Partial() if p.is_replicate() else p for p in d) if o in chained and d is not None else d
                 for o, d in enumerate(default))


def _grads(records: Sequence[Sequence[Any]]) -> tuple:
    """Per input, the placements its gradient got in a trace (None: no gradient)."""
    return tuple(tuple(r[0].placements) if r else None for r in records)


def sends(records: Sequence[Sequence[Any]], tangents: tuple, chained: dict[int, int], default: tuple) -> bool:
    """Whether each chained input's gradient has the placements ``tangents``
    gives its output where they differ from the default (a stack of such
    blocks then sends each block what it was compiled for)."""
    return all(records[i] and not records[i][1] and tuple(records[i][0].placements) == tangents[o]
               for o, i in chained.items() if tangents[o] != default[o])


class CountCollectives(TorchDispatchMode):
    """Counts the functional collectives that move data, those DTensor's own
    dispatch issues included: declining DTensor operands, the mode sees the
    local ops DTensor then runs.  A higher-order op (an ``invoke_subgraph``
    call) runs with the mode set aside: its body's collectives are its own
    graph's, as they were not in the graph's joint either."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if is_collective_op(func):
            self.n += 1
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class EagerRun:
    """Eager DTensor run on the fake examples, its backward for one set of
    tangents (Note: [The gradient a stack sends back])."""

    records: tuple[tuple, ...]  # per input, what ``Enter`` recorded: (gradient spec, wide) or ()
    collectives: int  # forward and backward
    forward: int  # of them, those the forward issued

    @property
    def grads(self) -> tuple:
        """Per input, the placements of its gradient (None: no gradient)."""
        return _grads(self.records)


def _zero_gradient(out: Any, tangents: Placements | None) -> torch.Tensor:
    """A zero gradient for ``out`` in ``tangents`` (its local tensor's shape,
    as ``to_local(grad_placements=...)``'s backward builds it)."""
    if tangents is None or not isinstance(out, DTensor):
        return torch.zeros_like(out)
    return DTensor.from_local(torch.zeros_like(out._local_tensor), out.device_mesh, tangents,
                              shape=out.shape, stride=out.stride(), run_check=False)


def eager_runs(gm: fx.GraphModule, local_inputs: Sequence[Any], fake_mode: Any, inputs: Sequence[Slot],
               outputs: Sequence[Slot], tangent_sets: Sequence[tuple], wide: Sequence[int]) -> dict[tuple, EagerRun]:
    """Per set of tangents, what eager DTensor does with ``gm`` on the fake
    examples: one forward, then one backward per set (nothing traced, nothing
    compiled).  Raises what eager raises when it cannot run the graph on the
    fakes (say, an in-place write to a leaf that AOTAutograd would copy first)."""
    records: list[list] = [[] for _ in inputs]
    wrapped = wrapper_graph(gm, inputs, outputs, tuple(None for _ in outputs), records, wide)
    count = CountCollectives()
    runs: dict[tuple, EagerRun] = {}
    with fake_mode, count, torch.enable_grad():
        outs = wrapped(*local_inputs)
        forward = count.n
        diff = [t for t in local_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        for k, tangents in enumerate(tangent_sets):
            pairs = [(o, _zero_gradient(o, t)) for o, t in zip(outs, tangents)
                     if isinstance(o, torch.Tensor) and o.requires_grad]
            for r in records:
                r.clear()
            before = count.n
            torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True,
                                retain_graph=k + 1 < len(tangent_sets))
            runs[tuple(tangents)] = EagerRun(tuple(tuple(r) for r in records), forward + count.n - before,
                                              forward)
    return runs


def eager_grads(gm: fx.GraphModule, local_inputs: Sequence[Any], fake_mode: Any, inputs: Sequence[Slot],
                outputs: Sequence[Slot], tangents: tuple, wide: Sequence[int]) -> tuple:
    """Per input, the placements eager DTensor gives its gradient for
    ``tangents`` (None: no gradient); raises as :func:`eager_runs` does."""
    return eager_runs(gm, local_inputs, fake_mode, inputs, outputs, (tangents,), wide)[tuple(tangents)].grads


def plan_tangents(default: tuple, guess: tuple, chained: dict[int, int], runs: dict[tuple, EagerRun]) -> TangentPlan:
    """The :class:`TangentPlan` of a stack's block from eager runs for the
    default and the guessed tangents (Note: [The gradient a stack sends back]).

    The guess is compiled when it is a fixed point (:func:`sends`) and costs
    at most one collective per changed output more than the forward (no
    default could cost less than the forward), or when the default's
    gradient would convert to it and it costs no more than the default;
    otherwise the default is compiled.  The other is converted, its input
    gradients redistributed to eager's (``traced``); a guess costing more
    than the default plus its conversion is never compiled (``converted``).
    """
    g, d = runs.get(guess), runs.get(default)
    if g is None or d is None:
        return TangentPlan(default)
    changed = sum(a != b for a, b in zip(guess, default))
    sent = sends(g.records, guess, chained, default)
    if sent and (g.collectives <= g.forward + changed
                 or sends(d.records, guess, chained, default) and g.collectives <= d.collectives + changed):
        return TangentPlan(guess, traced=((default, d.grads),))
    costs_more = sent and g.collectives > d.collectives + changed
    return TangentPlan(default, traced=((guess, g.grads),), converted=(guess,) if costs_more else ())


def placements_text(t: tuple) -> str:
    """``(P, -)``: per output its tangent placements, ``-`` for a plain output."""
    return "(" + ", ".join("-" if p is None else "".join(str(x) for x in p) for p in t) + ")"
