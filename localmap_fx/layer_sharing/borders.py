"""Plain tensors at layer borders: which DTensors cross a shared layer's
border, and the pass that lets Replicate ones cross as local tensors.

:func:`find_plain_borders` plans (read-only), :func:`apply_plain_borders`
rewrites along the plan (a ``PassResult`` pass, run by
:func:`localmap_fx.passes.run_passes`), :func:`dtensors_at_borders` lists what
would still cross as a DTensor (Note: [No DTensor at an automatic border] in
:mod:`.decide`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from ..analysis import mesh_key, span_io
from ..graph_utils import is_to_local, node_value
from ..passes import PassResult
from .plan import LayerPlan

__all__ = ["PlainBorderStep", "PlainBorderPlan", "find_plain_borders", "apply_plain_borders", "dtensors_at_borders"]


@dataclasses.dataclass(frozen=True)
class PlainBorderStep:
    """Pass ``value`` (a Replicate DTensor that enters a layer) to it as the
    local tensor of its ``to_local`` user (``grad_placements``), and rebuild
    the DTensor its other users read with ``from_local(..., grad_placements)``."""

    value: fx.Node
    to_local: fx.Node | None  # None: the last layer's output, a to_local is added (Note: [The last layer's border])
    grad_placements: tuple
    mesh: fx.Node  # the graph input holding the value's DeviceMesh

    def text(self) -> str:
        tl = self.to_local.name if self.to_local is not None else "(new)"
        return f"{self.value.name}: to_local {tl} at the border, from_local(grad={self.grad_placements!r}) after it"


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

    steps: list[PlainBorderStep] = []
    seen: set[fx.Node] = set()
    for span in plan.shared:
        inputs, _ = span_io(plan.nodes_of(span))
        inside = set(plan.nodes_of(span))
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
            steps.append(PlainBorderStep(v, tls[0], grad, mesh))
    steps += _last_layer_borders(gm, plan, seen)
    return PlainBorderPlan(tuple(steps))


def dtensors_at_borders(plan: LayerPlan, border_plan: PlainBorderPlan | None = None) -> tuple[str, ...]:
    """The DTensors that would enter or leave a shared layer once ``border_plan`` is applied.

    Read-only.  A value a border step passes as its local tensor does not
    count (Note: [A DTensor at a layer border costs a collective]); the
    to_local / from_local pair that step adds stays inside the layers.
    """
    from torch.distributed.tensor import DTensor

    passed = {s.value for s in border_plan.steps} if border_plan is not None else set()
    seen: set[fx.Node] = set()
    names: list[str] = []
    for span in plan.shared:
        inputs, outputs = span_io(plan.nodes_of(span))
        for v in (*inputs, *outputs):
            if isinstance(node_value(v), DTensor) and v not in passed and v not in seen:
                seen.add(v)
                names.append(v.name)
    return tuple(names)


def _last_layer_borders(gm: fx.GraphModule, plan: LayerPlan, seen: set[fx.Node]) -> list[PlainBorderStep]:
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
        That division the layer's backward then summed back, until the stage
        after the split let the gradient arrive whole (Note: [The last
        layer's gradient arrives whole] in :mod:`.whole_gradients`).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if len(plan.spans) < 2:
        return []
    prev, last = plan.spans[-2], plan.spans[-1]
    nodes = plan.nodes
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
        out.append(PlainBorderStep(u, None, tuple(grad), mesh))
    return out


def apply_plain_borders(gm: fx.GraphModule, border_plan: PlainBorderPlan) -> PassResult:
    """Rewrite ``gm`` in place along ``border_plan`` (Note: [A DTensor at a layer
    border costs a collective]); find_layer_spans must run again afterwards.

    before (a residual ``x`` entering a layer)::

        t = x.to_local(grad_placements=(Partial(),))     # inside the layer
        y = add(x, f(t))                                 # inside the layer

    after::

        t = x.to_local(grad_placements=(Partial(),))     # before the border
        x2 = from_local(t, mesh, (Replicate(),), grad_placements=(Partial(),))
        y = add(x2, f(t))                                # the layer reads t, a plain tensor
    """
    from .._torch_compat import dtensor_from_local

    if not border_plan.steps:
        return PassResult(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for step in border_plan.steps:
        v, mesh = step.value, step.mesh
        if step.to_local is None:
            # Note: [The last layer's border]
            with gm.graph.inserting_after(v):
                tl = gm.graph.call_method("to_local", (v,), {"grad_placements": step.grad_placements})
            tl.meta = {k: val for k, val in v.meta.items() if k in ("stack_trace",)}
            local = node_value(v).to_local()
            tl.meta["example_value"] = local
        else:
            tl = step.to_local
        others = [u for u in v.users if u is not tl]
        # right after the value (after the last placeholder for an input), so
        # the layer border can fall between the local tensor and its DTensor
        anchor = placeholders[-1] if v.op == "placeholder" else v
        anchor.append(tl)
        with gm.graph.inserting_after(tl):
            dt = gm.graph.call_function(
                dtensor_from_local, (tl, mesh, tuple(node_value(v).placements)),
                {"run_check": False, "grad_placements": step.grad_placements},
            )
        dt.meta = {k: val for k, val in v.meta.items() if k in ("example_value", "val", "tensor_meta", "stack_trace")}
        for u in others:
            u.replace_input_with(v, dt)
    return PassResult(gm, (gm,))

