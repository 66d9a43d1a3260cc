"""Take a backward graph's all_reduce of a tangent out of the graph: its caller runs it, or skips it.

Runs on the backward graph of a lean DTensor border's variant, just before the
inner compiler (Note: [The tangent's all_reduce belongs to the border] in
:mod:`localmap_fx.compiler.dtensor_border`).

Note: [Why a tangent's all_reduce is hoisted]
    A TP block compiled for the Partial gradient that the next block of a
    stack sends starts its backward by summing that gradient over the mesh
    (``Partial -> Replicate``).  The last block's gradient comes from the
    loss, already Replicate: converted to Partial (``g / n``), the compiled
    backward all_reduced it back to ``g``, one collective per step that eager
    DTensor and upstream ``torch.compile`` do not issue.  With the
    collective's result a placeholder of its own, the border sums a Partial
    gradient itself (the same functional all_reduce, so the same values) and
    hands a Replicate one over as it is::

        before                                         after
        ------                                         -----
        def backward(saved_0, ..., tangents_1):        def backward(saved_0, ..., tangents_1, reduced_tangents_1):
            v = view(tangents_1, [8, 16])                  v = view(tangents_1, [8, 16])
            r = all_reduce(v, "sum", "0")                  mm_2 = mm(t, reduced_tangents_1)
            w = wait_tensor(r)                             ...
            mm_2 = mm(t, w)                                add_1 = add(v, mm_5)   # tangents_1 as before
            ...
            add_1 = add(v, mm_5)

    Each new placeholder follows the tangents, in tangent order, and carries
    :data:`REDUCTION` in its meta: a :class:`TangentReduction` saying which
    tangent it sums, how, over which group, and the view its value has.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..below_autograd import all_reduce_waited
from . import PassResult

__all__ = ["REDUCTION", "TangentReduction", "find_tangent_reductions", "hoist_tangent_reductions", "reductions_of"]

# the meta key of a hoisted reduction's placeholder
REDUCTION = "localmap_fx_tangent_reduction"


@dataclasses.dataclass(frozen=True)
class TangentReduction:
    """``wait_tensor(all_reduce(tangent.view(shape), reduce_op, group_name))``.

    ``tangent`` is the position of the tangent among the backward's tangent
    placeholders; ``shape`` the view the graph took of it first (None: the
    tangent itself).
    """

    tangent: int
    reduce_op: str
    group_name: str
    shape: tuple[int, ...] | None

    def text(self) -> str:
        view = "" if self.shape is None else f".view{list(self.shape)}"
        return f"tangent {self.tangent}{view}: all_reduce({self.reduce_op}) over group {self.group_name}"

    def viewed(self, tangent: torch.Tensor) -> torch.Tensor:
        """The tangent as the graph viewed it before the reduction."""
        return tangent if self.shape is None else tangent.view(self.shape)

    def reduce(self, tangent: torch.Tensor) -> torch.Tensor:
        """What the graph computed here: the same functional all_reduce, then waited (the same values)."""
        return all_reduce_waited(self.viewed(tangent), self.reduce_op, self.group_name)


@dataclasses.dataclass(frozen=True)
class _Found:
    reduction: TangentReduction
    wait: fx.Node


def _tangents(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]


def _from_tangent(node: object, tangents: list[fx.Node]) -> tuple[int, tuple[int, ...] | None] | None:
    """(tangent position, view shape) when ``node`` is a tangent or one ``aten.view`` of it to a constant shape."""
    shape = None
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.ops.aten.view.default:
        size = node.args[1]
        if not isinstance(size, (list, tuple)) or not all(isinstance(s, int) for s in size):
            return None
        shape, node = tuple(size), node.args[0]
    if isinstance(node, fx.Node) and node in tangents:
        return tangents.index(node), shape
    return None


def _find(gm: fx.GraphModule) -> list[_Found]:
    tangents = _tangents(gm)
    found: list[_Found] = []
    seen: set[int] = set()
    for ar in gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default):
        source = _from_tangent(ar.args[0], tangents)
        op, group = ar.args[1], ar.args[2]
        users = list(ar.users)
        if (source is None or source[0] in seen or not isinstance(op, str) or not isinstance(group, str)
                or len(users) != 1 or users[0].target is not torch.ops._c10d_functional.wait_tensor.default):
            continue
        seen.add(source[0])
        found.append(_Found(TangentReduction(source[0], op, group, source[1]), users[0]))
    return sorted(found, key=lambda f: f.reduction.tangent)


def find_tangent_reductions(gm: fx.GraphModule) -> tuple[TangentReduction, ...]:
    """Each all_reduce (then waited) of a tangent, or of one view of it, in tangent order (at most one per tangent)."""
    return tuple(f.reduction for f in _find(gm))


def hoist_tangent_reductions(gm: fx.GraphModule) -> PassResult:
    """Make each found reduction's result a placeholder after the tangents (see the note above)."""
    found = _find(gm)
    if not found:
        return PassResult.of(gm, [])
    graph = gm.graph
    anchor = list(graph.find_nodes(op="placeholder"))[-1]
    for f in found:
        tangent = _tangents(gm)[f.reduction.tangent]
        with graph.inserting_after(anchor):
            placeholder = graph.placeholder(f"reduced_{tangent.name}")
        placeholder.meta["val"] = f.wait.meta.get("val")
        placeholder.meta[REDUCTION] = f.reduction
        reduce = f.wait.args[0]
        f.wait.replace_all_uses_with(placeholder)
        graph.erase_node(f.wait)
        if isinstance(reduce, fx.Node):
            view = reduce.args[0]
            graph.erase_node(reduce)
            if isinstance(view, fx.Node) and view.op == "call_function" and not view.users:
                graph.erase_node(view)
        anchor = placeholder
    return PassResult.of(gm, [gm])


def reductions_of(gm: fx.GraphModule) -> tuple[TangentReduction, ...]:
    """The reductions :func:`hoist_tangent_reductions` took out of ``gm``, in placeholder order."""
    return tuple(n.meta[REDUCTION] for n in gm.graph.find_nodes(op="placeholder") if REDUCTION in n.meta)
