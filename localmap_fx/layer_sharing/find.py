"""Find the repeated layers of a captured graph: :func:`find_layer_spans`.

A model that repeats one layer N times reaches the backend as one flat
Dynamo graph in which the layer's nodes (regions, redistributes, residuals,
norms) appear N times.  This module finds those repeats (read-only) and
returns a :class:`~.plan.LayerPlan`: the period search over region kinds,
each span's key, trimming to the common layer, weight hoisting and cut
shifting.  The package's ``__init__`` draws what the split makes of it.

Note: [Layer spans and their key]
    Regions are the anchors: the sequence of region kinds (function and
    placements, not the call site) has a period ``p`` over ``k >= 2``
    repeats from some start ``s`` (:func:`_best_period`).  Layer ``i`` is
    the run of graph nodes from the first node of region ``s + i*p`` up to
    the first node of region ``s + (i+1)*p``; the last layer takes as many
    nodes as the one before it.  A span's key is
    its op/target sequence, the wiring of every argument relative to the
    span (node inside, input number, or constant), the constants, which of
    its nodes are used outside it, and per input the value's metadata:
    DTensor placements, mesh identity, global and local shape, stride,
    dtype, device and ``requires_grad``.  Spans share one compiled piece only
    when their keys are equal; anything else stays a piece of its own.

Note: [When a layer is not shared]
    A span is compiled inline (as its own piece, or with the whole graph)
    and the reason recorded when it writes into any value (an aten op whose
    schema writes an argument: in-place, ``out=``, ``setitem``, ``copy_``),
    when one of its outputs is (a view of) one of its inputs -- both decided
    by running the span once on fresh fakes (Note: [Deciding that a body
    writes to or aliases an input] in :mod:`localmap_fx.analysis`), once per
    distinct key -- when its key differs from the other layers' (placements,
    mesh, shapes, dtypes, ``requires_grad``, code), or when shapes are
    symbolic.  Graph breaks need no rule: each Dynamo graph is split on its
    own, so a span never crosses one.

Note: [Marked blocks are the layers]
    When the user marked a block with ``torch.compiler.nested_compile_region``
    (inlined by :mod:`localmap_fx.passes.inline_marked_blocks`, each node
    recording its call), the calls of the block called most often are the
    layers: layer ``i`` starts at the first node of call ``i``, in place of
    the period search over regions.  The rest is as for found layers
    (stop at the next layer's start, keys, trimming, weight hoisting, cut
    shifting), so the glue between two calls travels with the layer before
    it and the glue after the last call with the tail piece.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch.fx as fx

from ..analysis import Effects, copy_nodes, find_effects, span_io, structural_key
from ..graph_utils import fetch_attr, is_input_to_local, is_symbolic, node_value
from ..passes.inline_marked_blocks import marked_calls_of
from ..region import find_regions
from .plan import LayerPlan, LayerSpan, compute_nodes

__all__ = ["find_layer_spans", "span_key"]

# why a layer whose key no other layer has is not shared
_LONE_KEY = "no other layer has the same key (code, placements, mesh, shapes, dtypes or requires_grad differ)"
_LONE_LAST = ("last layer: the border lies after the next layer's first nodes, which it lacks "
              "(Note: [Where layers are cut])")


def _region_kind(spec) -> tuple:
    # the call site differs between unrolled copies of one layer: not part of the kind
    return (spec.func, spec.func_site, repr(spec.in_placements), repr(spec.out_placements),
            repr(spec.in_grad_placements), spec.mesh_shape, spec.redistribute_inputs)


def _best_period(kinds: Sequence[tuple]) -> tuple[int, int, int] | None:
    """(start, period, repeats) covering the most regions with >= 2 repeats;
    on a tie the shortest period, then the earliest start.

    Any start, not only one below the period: regions before the layers that
    are no part of them (an embedding's) would otherwise turn a one-region
    layer into two (torchtitan's llama3 with only its inner attention a
    region: [embedding, attention x 8] was 4 layers of 2 blocks)."""
    best = None
    covered = 0
    n = len(kinds)
    for p in range(1, n // 2 + 1):
        for s in range(0, n - 2 * p + 1):
            if n - s <= covered:
                break  # no later start can cover more
            if kinds[s + p] != kinds[s]:
                continue
            k = 1
            while s + (k + 1) * p <= n and kinds[s + k * p : s + (k + 1) * p] == kinds[s : s + p]:
                k += 1
            if k >= 2 and k * p > covered:
                best, covered = (s, p, k), k * p
    return best


def _symbolic(nodes: Sequence[fx.Node]) -> str | None:
    for n in nodes:
        v = node_value(n)
        if any(is_symbolic(s) for s in (v if isinstance(v, (list, tuple)) else (v,))):
            return f"{n.name} has symbolic shapes"
    return None


@dataclasses.dataclass(frozen=True)
class _SpanEffects:
    """:func:`find_effects` of a span's copy; ``position`` maps a copied node's name to its index in the span."""

    effects: Effects
    position: dict[str, int]


def _span_effects(gm: fx.GraphModule, nodes: Sequence[fx.Node], inputs, outputs) -> _SpanEffects:
    graph, owner = copy_nodes(nodes, inputs, outputs, functools.partial(fetch_attr, gm),
                              [f"in{i}" for i in range(len(inputs))])
    copied = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    effects = find_effects(graph, owner, [node_value(a) for a in inputs])
    return _SpanEffects(effects, {n.name: j for j, n in enumerate(copied)})


def _unshareable(nodes: Sequence[fx.Node], inputs, outputs, found: _SpanEffects) -> str | None:
    """Why a span must not be shared, from its effects (Note: [Deciding that a
    body writes to or aliases an input] in localmap_fx.analysis), else None."""
    effects = found.effects
    if effects.error is not None:
        return f"writes and aliases unknown ({effects.error})"
    if effects.writes:
        w = effects.writes[0]
        return f"{nodes[found.position[w.node]].name} mutates a value in place ({w.op})"
    for j, o in enumerate(outputs):
        i = effects.aliased_input(j)
        if i is not None:
            return f"output {o.name} aliases input {inputs[i].name}"
    return None


def span_key(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], cache: dict[tuple, _SpanEffects] | None = None
) -> tuple[tuple | None, str | None]:
    """(key, None) for a shareable span, (None, reason) otherwise.

    ``cache`` keeps each key's effects for the next span with that key (equal
    keys: the same code on inputs with the same metadata, so the same effects).
    """
    inputs, outputs = span_io(nodes)
    reason = _symbolic(nodes)
    if reason is not None:
        return None, reason
    key = structural_key(nodes, functools.partial(fetch_attr, gm), inputs, set(outputs))
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _span_effects(gm, nodes, inputs, outputs)
    reason = _unshareable(nodes, inputs, outputs, cache[key])
    return (None, reason) if reason is not None else (key, None)


def _align_to_majority(gm, nodes, bounds, keys, cache):
    """Trim spans that are longer than the most common layer to its length.

    The first layer often starts with extra nodes (``to_local`` of the model
    input, which later layers receive already local after fuse_boundaries):
    dropping them from the front, or extra nodes from the back, lets the
    layer share; the dropped nodes join the piece before or after it.
    """
    counts: dict[tuple, int] = {}
    for key, _ in keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return bounds, keys
    major = max(counts, key=lambda k: counts[k])
    length = next(b - a for (a, b), (k, _) in zip(bounds, keys) if k == major)
    out_b, out_k = list(bounds), list(keys)
    for i, ((a, b), (key, _)) in enumerate(zip(bounds, keys)):
        if key == major or b - a <= length:
            continue
        for a2, b2 in ((b - length, b), (a, a + length)):
            k2, r2 = span_key(gm, nodes[a2:b2], cache)
            if k2 == major:
                out_b[i], out_k[i] = (a2, b2), (k2, r2)
                break
    return out_b, out_k


def find_layer_spans(gm: fx.GraphModule) -> LayerPlan:
    """Find the repeated layers of ``gm`` (read-only).  See Note: [Layer spans and their key]."""
    # layers are runs of the root graph; regions inside a nested subgraph
    # (a checkpointed block) travel with the higher-order op that holds them
    regions = [r for r in find_regions(gm, bodies=False) if not r.scope]
    nodes = compute_nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}
    marked = _marked_starts(nodes)
    if marked is not None:
        # Note: [Marked blocks are the layers]
        starts = marked
        inside = [r for r in regions
                  if starts[0] <= min(pos[n] for n in (*r.enter_nodes, *r.body_nodes, *r.exit_nodes)) < starts[1]]
        s, p = (regions.index(inside[0]), len(inside)) if inside else (0, 0)
        stops = starts[1:] + [min(len(nodes), starts[-1] + (starts[-1] - starts[-2]))]
        return _plan_from_bounds(gm, nodes, list(zip(starts, stops)), s, p)
    if len(regions) < 2:
        return LayerPlan(0, 0, (), "fewer than 2 local_map regions in the root graph")
    best = _best_period([_region_kind(r.spec) for r in regions])
    if best is None:
        return LayerPlan(0, 0, (), "the sequence of regions does not repeat")
    s, p, k = best

    def first_node(r) -> int:
        cand = r.enter_nodes + r.body_nodes + r.exit_nodes + ([r.node] if r.outlined else [])
        first = min(pos[n] for n in cand)
        # the get_attr of an outlined body sits just before it
        while first > 0 and nodes[first - 1].op == "get_attr":
            first -= 1
        return first

    starts = [first_node(regions[s + i * p]) for i in range(k)]
    stops = starts[1:] + [min(len(nodes), starts[-1] + (starts[-1] - starts[-2]))]
    return _plan_from_bounds(gm, nodes, list(zip(starts, stops)), s, p)


def _marked_starts(nodes: Sequence[fx.Node]) -> list[int] | None:
    """First node of each call of the marked block called most often (>= 2 calls), else None."""
    calls = marked_calls_of(nodes)
    per_block: dict[str, list[int]] = {}
    for mark, positions in calls.items():
        per_block.setdefault(mark.block, []).append(positions[0])
    if not per_block:
        return None
    block = max(per_block, key=lambda b: len(per_block[b]))
    starts = sorted(per_block[block])
    return starts if len(starts) >= 2 else None


def _plan_from_bounds(gm: fx.GraphModule, nodes: list[fx.Node], bounds: list[tuple[int, int]],
                      s: int, p: int) -> LayerPlan:
    """Keys, trimming, weight hoisting and cut shifting of the layers ``bounds``."""
    cache: dict = {}  # effects per key: each distinct span is run once
    keys = [span_key(gm, nodes[a:b], cache) for a, b in bounds]
    bounds, keys = _align_to_majority(gm, nodes, bounds, keys, cache)
    hoisted, nodes, bounds = _hoist_weights(nodes, bounds)
    shift = _best_cut(nodes, bounds)
    if hoisted or shift:
        bounds = [(a + shift, min(len(nodes), b + shift)) for a, b in bounds]
        keys = [span_key(gm, nodes[a:b], cache) for a, b in bounds]
    spans = []
    # A span shares only with another span of the same key.
    counts: dict[tuple, int] = {}
    for key, _ in keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    for i, ((a, b), (key, reason)) in enumerate(zip(bounds, keys)):
        if key is not None and counts[key] < 2:
            last_after_shift = i == len(keys) - 1 and shift
            key, reason = None, _LONE_LAST if last_after_shift else _LONE_KEY
        spans.append(LayerSpan(i, a, b, key, reason))
    return LayerPlan(p, s, tuple(spans), hoisted=tuple(hoisted), nodes=tuple(nodes))


def _best_cut(nodes: Sequence[fx.Node], bounds: Sequence[tuple[int, int]]) -> int:
    """How far to move every layer border forward.

    Note: [Where layers are cut]
        A DTensor crossing a piece border costs at run time: AOTAutograd
        unwraps and wraps it on every call, and checks (and redistributes)
        its gradient against the placements it traced, where a plain tensor
        passes as is (measured: about half of the per-layer price of
        sharing).  So borders move to where the fewest DTensors cross them;
        in a TP stack that is right after the next layer's ``to_local``.
        The last layer then lacks those first nodes of a next layer, so its
        key differs from the others'; the plain borders give its output the
        same ``to_local`` (Note: [The last layer's border] in
        :mod:`.borders`) and, found again, it is one more call of the shared
        layer.  Where they cannot, it stays unshared and is compiled with
        the tail (Note: [Unshared neighbours are one piece]).
    """
    from torch.distributed.tensor import DTensor

    if len(bounds) < 3:
        return 0
    a, b = bounds[1]
    best = None
    for r in range(b - a):
        _, outputs = span_io(nodes[a + r : b + r])
        cost = (sum(isinstance(node_value(o), DTensor) for o in outputs), len(outputs), r)
        if best is None or cost < best:
            best = cost
    return best[2] if best is not None else 0


def _hoist_weights(nodes: list[fx.Node], bounds: list[tuple[int, int]]):
    """(hoisted, new order, new bounds): Note: [Weights enter as local tensors]."""
    if not bounds:
        return [], nodes, bounds
    common = None
    for a, b in bounds:
        rel = {j for j in range(b - a) if is_input_to_local(nodes[a + j])}
        common = rel if common is None else common & rel
    if not common:
        return [], nodes, bounds
    hoisted = sorted((nodes[a + j] for a, b in bounds for j in common), key=nodes.index)
    hs = set(hoisted)
    order = hoisted + [n for n in nodes if n not in hs]
    pos = {n: i for i, n in enumerate(order)}
    new_bounds = []
    for a, b in bounds:
        kept = [n for n in nodes[a:b] if n not in hs]
        new_bounds.append((pos[kept[0]], pos[kept[0]] + len(kept)))
    return hoisted, order, new_bounds

