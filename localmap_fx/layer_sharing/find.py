"""Find repeated layers in a captured graph and split it into shared pieces.

A model that repeats one layer N times reaches the backend as one flat
Dynamo graph in which the layer's nodes (regions, redistributes, residuals,
norms) appear N times.  This module finds those repeats and cuts the graph
into *pieces* so that the backend compiles each distinct layer once::

    before (one graph)                          after (outer graph + pieces)
    ------------------                          ----------------------------
    x, w0, w1, w2 = inputs                      x, w0, w1, w2 = inputs
    a0 = to_local(x); ... h0 = redistribute()   (h0,) = piece_layer_0(x, w0)      # key K
    a1 = to_local(h0); ... h1 = redistribute()  (h1,) = piece_layer_1(h0, w1)     # key K: same compiled code
    a2 = to_local(h1); ... h2 = redistribute()  (h2,) = piece_layer_2(h1, w2)     # key K
    loss = (h2 * h2).sum()                      (loss,) = piece_tail(h2)

Finding (:func:`find_layer_spans`) and rewriting (:func:`split_layers`) are
separate.  Compiling the pieces, once per key, is the backend's job
(:func:`localmap_fx.compiler.pieces.compile_pieces`).

Note: [Layer spans and their key]
    Regions are the anchors: the sequence of region kinds (function and
    placements, not the call site) has a period ``p`` over ``k >= 2``
    repeats.  Layer ``i`` is the run of graph nodes from the first node of
    region ``s + i*p`` up to the first node of region ``s + (i+1)*p``; the
    last layer takes as many nodes as the one before it.  A span's key is
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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..analysis import Effects, copy_nodes, find_effects, mesh_key, span_io, structural_key
from ..graph_utils import fetch_attr, is_symbolic, is_to_local, node_value
from ..region import find_regions

__all__ = [
    "LayerSpan",
    "LayerPlan",
    "find_layer_spans",
    "span_key",
    "split_layers",
    "dtensors_at_borders",
    "META_PIECE",
]

# node.meta key on the outer graph's call_module nodes (see split_layers)
META_PIECE = "localmap_fx.piece"


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """Nodes ``[start, stop)`` of the graph's compute nodes form layer ``index``.

    ``key`` is None when the span cannot be shared; ``reason`` says why.
    """

    index: int
    start: int
    stop: int
    key: tuple | None
    reason: str | None = None

    @property
    def digest(self) -> str:
        return _digest(self.key) if self.key is not None else "-"


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
    # [Weights enter as local tensors]); spans index compute_nodes(gm, hoisted)
    hoisted: tuple[fx.Node, ...] = dataclasses.field(default=(), compare=False)

    @property
    def shared(self) -> tuple[LayerSpan, ...]:
        return tuple(s for s in self.spans if s.key is not None)

    def text(self) -> str:
        if not self.spans:
            return f"no repeated layers: {self.reason}"
        lines = [f"{len(self.spans)} layers of {self.period} region(s), from region {self.first_region}"]
        for s in self.spans:
            what = f"key {s.digest}" if s.key is not None else f"inline: {s.reason}"
            lines.append(f"  layer {s.index}: nodes [{s.start}, {s.stop}) {what}")
        return "\n".join(lines)


def _digest(key: Any) -> str:
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


def _region_kind(spec) -> tuple:
    # the call site differs between unrolled copies of one layer: not part of the kind
    return (spec.func, spec.func_site, repr(spec.in_placements), repr(spec.out_placements),
            repr(spec.in_grad_placements), spec.mesh_shape, spec.redistribute_inputs)


def _best_period(kinds: Sequence[tuple]) -> tuple[int, int, int] | None:
    """(start, period, repeats) covering the most regions with >= 2 repeats."""
    best = None
    n = len(kinds)
    for p in range(1, n // 2 + 1):
        for s in range(0, p):
            k = 1
            while s + (k + 1) * p <= n and kinds[s + k * p : s + (k + 1) * p] == kinds[s : s + p]:
                k += 1
            if k >= 2 and (best is None or k * p > best[2] * best[1]):
                best = (s, p, k)
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


def _reads_placeholder(n: fx.Node) -> bool:
    return is_to_local(n) and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"


def find_layer_spans(gm: fx.GraphModule) -> LayerPlan:
    """Find the repeated layers of ``gm`` (read-only).  See Note: [Layer spans and their key]."""
    # layers are runs of the root graph; regions inside a nested subgraph
    # (a checkpointed block) travel with the higher-order op that holds them
    regions = [r for r in find_regions(gm) if not r.scope]
    if len(regions) < 2:
        return LayerPlan(0, 0, (), "fewer than 2 local_map regions in the root graph")
    best = _best_period([_region_kind(r.spec) for r in regions])
    if best is None:
        return LayerPlan(0, 0, (), "the sequence of regions does not repeat")
    s, p, k = best
    nodes = compute_nodes(gm)
    pos = {n: i for i, n in enumerate(nodes)}

    def first_node(r) -> int:
        cand = r.enter_nodes + r.body_nodes + r.exit_nodes + ([r.node] if r.outlined else [])
        first = min(pos[n] for n in cand)
        # the get_attr of an outlined body sits just before it
        while first > 0 and nodes[first - 1].op == "get_attr":
            first -= 1
        return first

    starts = [first_node(regions[s + i * p]) for i in range(k)]
    stops = starts[1:] + [min(len(nodes), starts[-1] + (starts[-1] - starts[-2]))]
    bounds = list(zip(starts, stops))
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
            key, reason = None, "no other layer has the same key (code, placements, mesh, shapes, dtypes or requires_grad differ)"
        if key is None and reason is not None and reason.startswith("no other layer") and i == len(keys) - 1 and shift:
            reason = "last layer: the border lies after the next layer's first nodes, which it lacks (Note: [Where layers are cut])"
        spans.append(LayerSpan(i, a, b, key, reason))
    return LayerPlan(p, s, tuple(spans), hoisted=tuple(hoisted))


def _best_cut(nodes: Sequence[fx.Node], bounds: Sequence[tuple[int, int]]) -> int:
    """How far to move every layer border forward.

    Note: [Where layers are cut]
        A DTensor crossing a piece border costs at run time: AOTAutograd
        unwraps and wraps it on every call, and checks (and redistributes)
        its gradient against the placements it traced, where a plain tensor
        passes as is (measured: about half of the per-layer price of
        sharing).  So borders move to where the fewest DTensors cross them;
        in a TP stack that is right after the next layer's ``to_local``.
        The last layer then lacks those first nodes of a next layer and is
        compiled as a piece of its own (one extra layer compile).
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
        rel = {j for j in range(b - a) if _reads_placeholder(nodes[a + j])}
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


def _copy_span(gm: fx.GraphModule, nodes: Sequence[fx.Node], inputs, outputs, name: str) -> fx.GraphModule:
    names = [f"in{i}_{a.name}" for i, a in enumerate(inputs)]
    graph, owner = copy_nodes(nodes, inputs, outputs, functools.partial(fetch_attr, gm), names)
    return fx.GraphModule(owner, graph, class_name=name)


_Cut = tuple[int, int, tuple[LayerSpan, ...]]


def _cuts(plan: LayerPlan, n_nodes: int) -> list[_Cut]:
    """Node ranges in program order: each layer span, and what lies between."""
    cuts: list[_Cut] = []
    at = 0
    for span in plan.spans:
        if span.start > at:
            cuts.append((at, span.start, ()))
        cuts.append((span.start, span.stop, (span,)))
        at = span.stop
    if at < n_nodes:
        cuts.append((at, n_nodes, ()))
    return cuts


def merge_unshared(cuts: Sequence[_Cut]) -> list[_Cut]:
    """Join neighbouring cuts that no other cut shares into one.

    Note: [Unshared neighbours are one piece]
        Every piece is a separate forward and backward compile, and on CPU
        each distinct kernel is a separate C++ compile; a piece compiled for
        one use buys nothing by standing alone.  So the prefix, an unshared
        first or last layer and the tail, when adjacent, go to the inner
        compiler together (where Inductor can also fuse across the old
        border), e.g. the last layer of a TP stack with the loss after it.
    """
    out: list[_Cut] = []
    for a, b, spans in cuts:
        unshared = all(s.key is None for s in spans)
        if out and unshared and all(s.key is None for s in out[-1][2]):
            a0, _, spans0 = out[-1]
            out[-1] = (a0, b, spans0 + spans)
        else:
            out.append((a, b, spans))
    return out


def _piece_reason(spans: Sequence[LayerSpan], a: int, b: int, n_nodes: int) -> str | None:
    if len(spans) == 1 and spans[0].key is not None:
        return None
    parts = [f"layer {s.index}: {s.reason}" if len(spans) > 1 else str(s.reason) for s in spans]
    if spans and (a < spans[0].start or b > spans[-1].stop):
        ends = [w for w, yes in (("prefix", a == 0 and a < spans[0].start),
                                 ("tail", b == n_nodes and b > spans[-1].stop)) if yes]
        parts.append("with the " + " and ".join(ends or ["nodes between layers"]))
    return "; ".join(parts) if parts else None


def split_layers(gm: fx.GraphModule, plan: LayerPlan) -> fx.GraphModule:
    """Cut ``gm`` into pieces along ``plan``: one submodule per shared layer
    span; neighbouring unshared nodes (before the first layer, after the
    last, unshared layers) form one submodule each (Note: [Unshared
    neighbours are one piece]).

    The returned outer graph keeps ``gm``'s placeholders and output and calls
    ``piece_<i>`` submodules; each call node carries ``meta[META_PIECE] =
    {"name", "layer", "key", "reason"}`` (layer None for prefix / tail).
    Spans with equal keys get structurally identical submodules (same input
    order, same outputs), so one compiled callable serves them all.
    """
    nodes = compute_nodes(gm, plan.hoisted)
    cuts = merge_unshared(_cuts(plan, len(nodes)))

    outer = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = outer.node_copy(n)
    n_piece = 0
    for a, b, piece_spans in cuts:
        piece_span = piece_spans[0] if piece_spans else None
        piece_nodes = nodes[a:b]
        inputs, outputs = span_io(piece_nodes)
        if not outputs:
            # nothing leaves it: only dead code or get_attrs
            if any(n.op == "call_function" or n.op == "call_method" for n in piece_nodes):
                raise AssertionError(f"piece of nodes [{a}, {b}) has effects but no outputs")
            continue
        name = f"piece_{n_piece}"
        n_piece += 1
        sub = _copy_span(gm, piece_nodes, inputs, outputs, name)
        root.add_module(name, sub)
        call = outer.call_module(name, tuple(env[i] for i in inputs))
        call.meta[META_PIECE] = {
            "name": name,
            "layer": piece_span.index if piece_span is not None else None,
            "key": piece_span.key if piece_span is not None else None,
            "reason": _piece_reason(piece_spans, a, b, len(nodes)),
            "nodes": (a, b),
            "inputs": [i.name for i in inputs],
        }
        for j, o in enumerate(outputs):
            g = outer.call_function(operator.getitem, (call, j))
            g.meta = dict(o.meta)
            env[o] = g
    for n in gm.graph.nodes:
        if n.op == "output":
            outer.node_copy(n, lambda x: env[x])
    out = fx.GraphModule(root, outer, class_name="localmap_fx_layers")
    out.graph.lint()
    return out


def pieces_of(outer: fx.GraphModule) -> list[fx.Node]:
    return [n for n in outer.graph.nodes if META_PIECE in n.meta]


# --- plain tensors at layer borders ------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlainBorderStep:
    """Pass ``value`` (a Replicate DTensor that enters a layer) to it as the
    local tensor of its ``to_local`` user (``grad_placements``), and rebuild
    the DTensor its other users read with ``from_local(..., grad_placements)``."""

    value: str
    to_local: str | None  # None: the last layer's output, a to_local is added (Note: [The last layer's border])
    grad_placements: tuple
    mesh: str

    def text(self) -> str:
        tl = self.to_local if self.to_local is not None else "(new)"
        return f"{self.value}: to_local {tl} at the border, from_local(grad={self.grad_placements!r}) after it"


@dataclasses.dataclass(frozen=True)
class PlainBorderPlan:
    steps: tuple[PlainBorderStep, ...]

    def text(self) -> str:
        return "\n".join(s.text() for s in self.steps) or "no DTensor to pass as a local tensor"


def _mesh_placeholder(gm: fx.GraphModule, mesh: Any) -> fx.Node | None:
    from torch.distributed.device_mesh import DeviceMesh

    want = mesh_key(mesh)
    for n in gm.graph.find_nodes(op="placeholder"):
        v = node_value(n)
        if isinstance(v, DeviceMesh) and mesh_key(v) == want:
            return n
    return None


def find_plain_borders(gm: fx.GraphModule, plan: LayerPlan) -> PlainBorderPlan:
    """Which DTensors entering a shared layer can cross its border as plain tensors.

    Note: [A DTensor at a layer border costs a collective]
        A residual stream (``block(x) + x``) enters every layer as a
        Replicate DTensor and also feeds the layer's first region
        (``to_local(grad_placements=[Partial()])``).  Crossing a piece border
        as a DTensor, AOTAutograd traces its tangent as Replicate
        (``__coerce_tangent_metadata__``) while the layer's backward produces
        a Partial gradient, so every step redistributes it (an all_reduce per
        layer, measured 1 ms per layer on gloo, where the whole graph needs
        none) and unwraps/wraps it.  Passing the region's local tensor instead
        and rebuilding the DTensor after the border with
        ``from_local(grad_placements=<the region's>)`` keeps the gradient
        Partial across the border, as the whole graph does.  Both ops are the
        identity in forward; in backward ``from_local`` turns the residual's
        gradient into the region's placements (Replicate -> Partial is a local
        division) before the two are summed, where the whole graph lets DTensor
        do the same conversion in the sum.  Only Replicate DTensors whose
        to_local asks for Replicate or Partial gradients are rewritten: those
        conversions never need a collective.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    nodes = compute_nodes(gm, plan.hoisted)
    steps: list[PlainBorderStep] = []
    seen: set[fx.Node] = set()
    for span in plan.shared:
        inputs, _ = span_io(nodes[span.start:span.stop])
        inside = set(nodes[span.start:span.stop])
        for v in inputs:
            val = node_value(v)
            if v in seen or not isinstance(val, DTensor):
                continue
            if not all(isinstance(p, Replicate) for p in val.placements):
                continue
            tls = [u for u in v.users if is_to_local(u) and u.kwargs.get("grad_placements") is not None]
            others = [u for u in v.users if u not in tls]
            if len(tls) != 1 or not others or tls[0] not in inside:
                continue
            g = tls[0].kwargs["grad_placements"]
            if not isinstance(g, (tuple, list)):
                continue
            grad = tuple(g)
            if len(grad) != len(val.placements) or not all(isinstance(p, (Replicate, Partial)) for p in grad):
                continue
            mesh = _mesh_placeholder(gm, val.device_mesh)
            if mesh is None:
                continue
            seen.add(v)
            steps.append(PlainBorderStep(v.name, tls[0].name, grad, mesh.name))
    steps += _last_layer_borders(gm, nodes, plan, seen)
    return PlainBorderPlan(tuple(steps))


def dtensors_at_borders(gm: fx.GraphModule, plan: LayerPlan,
                        border_plan: PlainBorderPlan | None = None) -> tuple[str, ...]:
    """The DTensors that would enter or leave a shared layer once ``border_plan`` is applied.

    Read-only.  A value a border step passes as its local tensor does not
    count (Note: [A DTensor at a layer border costs a collective]); the
    to_local / from_local pair that step adds stays inside the layers.
    """
    from torch.distributed.tensor import DTensor

    passed = {s.value for s in border_plan.steps} if border_plan is not None else set()
    nodes = compute_nodes(gm, plan.hoisted)
    names: list[str] = []
    for span in plan.shared:
        inputs, outputs = span_io(nodes[span.start:span.stop])
        for v in (*inputs, *outputs):
            if isinstance(node_value(v), DTensor) and v.name not in passed and v.name not in names:
                names.append(v.name)
    return tuple(names)


def _last_layer_borders(gm: fx.GraphModule, nodes: Sequence[fx.Node], plan: LayerPlan,
                        seen: set[fx.Node]) -> list[PlainBorderStep]:
    """Note: [The last layer's border]
        A layer hands its output to the next layer's ``to_local`` (and, with
        the border steps above, as a local tensor); the last layer hands it
        to the tail (the loss) as a DTensor.  So the last layer differed from
        the others by that one to_local and was compiled with the tail, a
        second copy of the layer.  Giving its output the same ``to_local`` /
        ``from_local`` pair (with the grad_placements of the next layer's
        to_local) makes it one more call of the shared layer and leaves the
        tail its own ops.  Both are the identity in forward; in backward
        from_local turns the tail's gradient into those placements (only
        Replicate / Partial targets: no collective), as the other borders do.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if len(plan.spans) < 2:
        return []
    prev, last = plan.spans[-2], plan.spans[-1]
    if prev.key is None or prev.stop - prev.start != last.stop - last.start:
        return []
    prev_nodes = nodes[prev.start:prev.stop]
    offset = {n: i for i, n in enumerate(prev_nodes)}
    inside = {n for s in plan.spans for n in nodes[s.start:s.stop]}
    out: list[PlainBorderStep] = []
    done: set[fx.Node] = set()
    # the to_locals that read the layer before's output: in that layer's span
    # when the border was moved past them (Note: [Where layers are cut]), else
    # at the start of the next one
    for tl in nodes[prev.start:last.stop]:
        v = tl.args[0] if is_to_local(tl) else None
        if not isinstance(v, fx.Node) or v not in offset:
            continue
        grad = tl.kwargs.get("grad_placements")
        if not isinstance(grad, (tuple, list)) or not all(isinstance(p, (Replicate, Partial)) for p in grad):
            continue
        j = offset[v]
        if last.start + j >= last.stop:
            continue
        u = nodes[last.start + j]
        val = node_value(u)
        if u in done or u in seen or u.op != v.op or u.target != v.target or not isinstance(val, DTensor):
            continue
        if len(grad) != len(val.placements) or not all(isinstance(p, Replicate) for p in val.placements):
            continue
        # nodes of the last span from the to_local's place on are the tail's
        # (the span is as long as the one before it)
        tail = set(nodes[last.start + offset[tl]:last.stop]) if tl in offset else set()
        if not u.users or any((w in inside and w not in tail) or is_to_local(w) for w in u.users):
            continue
        mesh = _mesh_placeholder(gm, val.device_mesh)
        if mesh is None:
            continue
        done.add(u)
        out.append(PlainBorderStep(u.name, None, tuple(grad), mesh.name))
    return out


def apply_plain_borders(gm: fx.GraphModule, border_plan: PlainBorderPlan) -> fx.GraphModule:
    """Rewrite ``gm`` in place along ``border_plan`` (Note: [A DTensor at a layer
    border costs a collective]); find_layer_spans must run again afterwards."""
    from torch.distributed.tensor._api import from_local

    if not border_plan.steps:
        return gm
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for step in border_plan.steps:
        v, mesh = by_name[step.value], by_name[step.mesh]
        if step.to_local is None:
            # Note: [The last layer's border]
            with gm.graph.inserting_after(v):
                tl = gm.graph.call_method("to_local", (v,), {"grad_placements": step.grad_placements})
            tl.meta = {k: val for k, val in v.meta.items() if k in ("stack_trace",)}
            local = node_value(v).to_local()
            tl.meta["example_value"] = local
        else:
            tl = by_name[step.to_local]
        others = [u for u in v.users if u is not tl]
        # right after the value (after the last placeholder for an input), so
        # the layer border can fall between the local tensor and its DTensor
        anchor = placeholders[-1] if v.op == "placeholder" else v
        anchor.append(tl)
        with gm.graph.inserting_after(tl):
            dt = gm.graph.call_function(
                from_local, (tl, mesh, tuple(node_value(v).placements)),
                {"run_check": False, "grad_placements": step.grad_placements},
            )
        dt.meta = {k: val for k, val in v.meta.items() if k in ("example_value", "val", "tensor_meta", "stack_trace")}
        for u in others:
            u.replace_input_with(v, dt)
    gm.graph.lint()
    gm.recompile()
    return gm


# --- what one layer computes -------------------------------------------------

_MATMUL_OPS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "__matmul__"})


def _op_name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def span_flops(nodes: Sequence[fx.Node]) -> int:
    """Forward FLOPs of the matrix products in ``nodes`` (2 * output elements *
    contraction length, from the fake values; other ops count as 0, so the
    estimate errs low)."""
    total = 0
    for n in nodes:
        if n.op not in ("call_function", "call_method") or _op_name(n) not in _MATMUL_OPS:
            continue
        out, a = node_value(n), node_value(n.args[1] if _op_name(n) in ("addmm", "baddbmm") else n.args[0])
        if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor) or a.dim() == 0:
            continue
        if any(isinstance(d, torch.SymInt) for d in (*out.shape, a.shape[-1])):
            continue
        from torch.distributed.tensor import DTensor

        if isinstance(out, DTensor):
            out, a = out._local_tensor, a._local_tensor if isinstance(a, DTensor) else a
        total += 2 * out.numel() * int(a.shape[-1])
    return total
