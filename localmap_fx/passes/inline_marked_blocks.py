"""Inline the blocks the user marked with ``torch.compiler.nested_compile_region``.

Dynamo traces a marked block once and stamps out its other calls as
``invoke_subgraph`` of one subgraph.  Torch 2.14.1's AOTAutograd cannot take
such a call with DTensor operands: it re-traces the body on unwrapped
FakeTensors (``'FakeTensor' object has no attribute 'to_local'``).  So every
call is put back inline here, at the start of the pipeline, and each copied
node records which call of which block it came from
(``meta[META_MARKED]``, a :class:`MarkedCall`).  Layer finding then takes the
marked calls as the layers (:func:`localmap_fx.layer_sharing.find.find_layer_spans`)
and compiles one block key once::

    before                                                after
    ------                                                -----
    sub = self.subgraph_0                                 local = x.to_local(...)   # marked (subgraph_0, 0)
    c0 = invoke_subgraph(sub, "subgraph_0", x, w1, m, w2)  ...
    x1 = c0[0]                                            x1 = add(..., x)          # marked (subgraph_0, 0)
    sub_1 = self.subgraph_0                               local_4 = x1.to_local(...) # marked (subgraph_0, 1)
    c1 = invoke_subgraph(sub_1, "subgraph_0", x1, ...)     ...
    x2 = c1[0]

Note: [A stamped call's placements]
    Torch 2.14.1's Dynamo stamps out a call when its operands' tensor
    metadata matches the traced one, without the DTensor placements: a block
    traced on a Replicate input is stamped for the Shard(0) output of its
    previous call, and a stamped call's outputs are plain FakeTensors to
    Dynamo (a DTensor method on them, e.g. ``redistribute``, fails in
    Dynamo).  The stamped body was traced for other placements; once inline
    its DTensor ops dispatch on the real placements, but what the trace fixed
    in Python (a region's ``to_local``, local shapes) would be silently
    wrong.  So each call's DTensor operands (whose metadata is right once the
    calls before it are inline) must have the placements, global shape and
    dtype its body was traced with, else :class:`MarkedBlockError`.

Note: [A stamped call's outputs are plain to Dynamo]
    Dynamo records a stamped call's outputs as plain FakeTensors, and so
    every value the code after it computes from them (the glue between
    blocks, the loss after the last): ``(x * x).sum()`` of a DTensor ``x``
    is recorded as a plain tensor though it runs as a DTensor.  Once the
    calls are inline their nodes hold the body's values, which are right
    (checked above); the nodes after them are computed again on those
    values (fake, under the graph's fake mode), so that the pieces cut
    later know their DTensor outputs, e.g. the loss piece runs behind the
    lean DTensor border (``compiler/dtensor_border.py``) instead of
    AOTAutograd's subclass runtime.  A node that cannot be run again keeps
    Dynamo's value.

No ``invoke_subgraph`` of a marked block reaches AOTAutograd or Inductor, so
neither the DTensor failure above nor Inductor's buffer reuse across a
subgraph's views (Note in :mod:`.hoist_subgraph_views`) can occur.  Calls
inside other higher-order ops' subgraphs (a checkpointed block) are left
alone; a call inside a marked block is inlined with it and keeps the outer
block's mark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..graph_utils import fetch_attr, node_value, subgraph_attr
from ..region import META_REGION, role_of
from . import PassResult
from .inline_shared_bodies import splice_subgraph_call

__all__ = ["META_MARKED", "MarkedBlockError", "MarkedCall", "find_marked_calls", "inline_marked_blocks",
           "marked_calls_of"]

# node.meta key: the MarkedCall a node was inlined from
META_MARKED = "localmap_fx.marked"


@dataclasses.dataclass(frozen=True)
class MarkedCall:
    """Call ``index`` (program order) of the marked block ``block`` (its subgraph's name)."""

    block: str
    index: int


class MarkedBlockError(RuntimeError):
    """A marked block's call was stamped out for DTensors it was not traced with."""


def _dtensor_meta(v: object) -> tuple | None:
    from torch.distributed.tensor import DTensor

    if not isinstance(v, DTensor):
        return None
    return tuple(v.placements), tuple(v.shape), v.dtype


def _check_operands(gm: fx.GraphModule, call: fx.Node) -> None:
    """Note: [A stamped call's placements]."""
    body = fetch_attr(gm, subgraph_attr(call).target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, call.args[2:]):
        if not isinstance(arg, fx.Node):
            continue
        want, got = _dtensor_meta(node_value(ph)), _dtensor_meta(node_value(arg))
        if want is not None and got is not None and got != want:
            raise MarkedBlockError(
                f"nested_compile_region: call {call.name} of {subgraph_attr(call).target} gets {arg.name} as a "
                f"DTensor {got[0]} of shape {list(got[1])} ({got[2]}), but Dynamo stamped out the body it traced "
                f"for {want[0]} of shape {list(want[1])} ({want[2]}); torch 2.14.1's Dynamo does not tell such "
                "calls apart.  Give the block the same placements on every call, or do not mark it."
            )


def find_marked_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The root graph's ``invoke_subgraph`` calls of user-marked blocks (read-only).

    Capture's own calls (a region body traced once, :mod:`localmap_fx.capture.reuse`)
    carry a region role and are not marks.
    """
    return [
        n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        if role_of(n) is None and META_REGION not in n.meta
    ]


def inline_marked_blocks(gm: fx.GraphModule) -> PassResult:
    """Splice every marked block's call inline and mark its nodes (see module docstring)."""
    counts: dict[str, int] = {}
    changed = False
    calls = find_marked_calls(gm)
    while calls:
        for call in calls:
            mark = call.meta.get(META_MARKED)
            if mark is None:
                block = str(subgraph_attr(call).target)
                mark = MarkedCall(block, counts.get(block, 0))
                counts[block] = mark.index + 1
            _check_operands(gm, call)
            before = set(gm.graph.nodes)
            splice_subgraph_call(gm, call)
            for n in gm.graph.nodes:
                if n not in before:
                    # a nested mark's copies keep the outer block's mark
                    n.meta[META_MARKED] = mark
            changed = True
        calls = find_marked_calls(gm)
    if changed:
        _refresh_values_after_marked_calls(gm)
    return PassResult(gm, (gm,) if changed else ())


def _is_dtensor_tree(v: object) -> object:
    from torch.distributed.tensor import DTensor

    if isinstance(v, (tuple, list)):
        return tuple(_is_dtensor_tree(x) for x in v)
    return isinstance(v, DTensor)


def _fake_mode_of(values: Sequence[object]) -> object | None:
    """The fake mode of the first fake tensor among ``values`` (a DTensor's local tensor counts)."""
    from .._torch_compat import FakeTensor

    for v in values:
        t = getattr(v, "_local_tensor", v)
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def _refresh_values_after_marked_calls(gm: fx.GraphModule) -> None:
    """Note: [A stamped call's outputs are plain to Dynamo]."""
    refreshed: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if META_MARKED in n.meta or n.op not in ("call_function", "call_method") or "example_value" not in n.meta:
            continue
        inputs = n.all_input_nodes
        if not any(META_MARKED in a.meta or a in refreshed for a in inputs):
            continue
        # the values a body's nodes hold may belong to another fake mode than
        # the tracing context's: run in theirs
        fake_mode = _fake_mode_of([node_value(a) for a in inputs])
        if fake_mode is None:
            continue
        args, kwargs = fx.map_arg((n.args, n.kwargs), node_value)
        try:
            # leaves, as Dynamo's values are (a graph's meta must deep-copy)
            with fake_mode, torch.no_grad():  # type: ignore[attr-defined]
                value = (n.target(*args, **kwargs) if n.op == "call_function"
                         else getattr(args[0], str(n.target))(*args[1:], **kwargs))
        except Exception:  # noqa: BLE001 - Dynamo's value stays (see the Note)
            continue
        old = n.meta["example_value"]
        if _is_dtensor_tree(value) != _is_dtensor_tree(old):
            n.meta["example_value"] = _requiring_grad_as(value, old)
            refreshed.add(n)


def _requiring_grad_as(value: object, old: object) -> object:
    """``value`` whose tensors require grad where ``old``'s (Dynamo's value) do."""
    if isinstance(value, (tuple, list)) and isinstance(old, (tuple, list)) and len(value) == len(old):
        return type(value)(_requiring_grad_as(v, o) for v, o in zip(value, old))
    if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and old.requires_grad:
        value.requires_grad_(True)
    return value


def marked_calls_of(nodes: Sequence[fx.Node]) -> dict[MarkedCall, list[int]]:
    """Positions in ``nodes`` of each marked call's nodes, in program order of first node."""
    out: dict[MarkedCall, list[int]] = {}
    for i, n in enumerate(nodes):
        mark = n.meta.get(META_MARKED)
        if isinstance(mark, MarkedCall):
            out.setdefault(mark, []).append(i)
    return out
