"""Share the layers of a frame or keep it one graph: :func:`decide`.

The one place the share-or-not decision is made.  :func:`decide` weighs a
:class:`~.plan.LayerPlan` against the ``share_layers`` option, the layers'
cost (:class:`LayerCost`, under inductor) and the DTensors that would still
cross a layer border, and returns a frozen :class:`Decision`: a
:class:`Reason` code (what the pipeline acts on) and a text (what the dump
and the logs show).

Note: [When "auto" shares layers]
    A shared layer saves the AOT trace and the kernel compilation of every
    repeat.  At run time the layers of a frame are one LayerRun (Note: [A
    run of layers] in :mod:`.runtime`): the compiled forward and backward of
    the layer called once per layer, no per-layer autograd node or DTensor
    wrapping.  What is left is two calls into compiled code per layer and no
    kernel fusion across a layer border, a price per layer that one graph
    never pays: :data:`PIECE_OVERHEAD_S` (measured on a CPU, fake process
    group, 64-layer TP stack: about 15 us per layer per step in a LayerRun,
    ~80 us through AOTAutograd's runtime wrappers per piece;
    ``benchmarks/sharing_overhead.py`` measures it).  This is the one
    statement of that price; other comments and docs refer here.  A default
    may never make the compiled step slower than upstream torch.compile, so
    under inductor "auto" shares only when that price is lost in the layer's
    own compute: at least AUTO_MIN_LAYERS layers *and* PIECE_OVERHEAD_S at
    most AUTO_MAX_OVERHEAD of the layer's estimated forward + backward time
    (3x the forward FLOPs of its matrix products at ASSUMED_FLOPS[device]).
    The estimate errs towards one graph: only matrix products count and the
    assumed throughput is high.  It assumes the layer runs as a
    CompiledLayer; one that needs AOTAutograd's runtime (compiled_layer
    says why, the dump shows it) pays the higher price.  Under aot_eager /
    eager (not run-time modes) the count alone decides.

Note: [No DTensor at an automatic border]
    A layer whose border a DTensor crosses (weights used as DTensors outside
    the layer's regions, as torchtitan's attention does; a residual the
    plain borders cannot pass) cannot run as a CompiledLayer.  Behind the
    lean DTensor border (:mod:`localmap_fx.compiler.dtensor_border`, on by
    default) its piece is one autograd.Function per layer call: specs fixed
    at compile time, and a backward compiled per tangent placement, so a
    Partial gradient is reduced in compiled code in eager's order (aot_eager
    stays bitwise eager).  That costs more per layer than a LayerRun step:
    :data:`BORDER_OVERHEAD_S`, which "auto" weighs the same way.  Measured
    like :data:`PIECE_OVERHEAD_S`, on the torchtitan-style attention stack
    (``python -m benchmarks.sharing_overhead --attention``), shared minus
    one graph per layer is +4 / -29 µs of CPU at 16 / 64 layers, and +36 /
    +30 against one graph with its bodies outlined (+52 in an earlier
    run): the border's work is
    about what the pieces save in collectives (their backward sums a
    layer's gradient in one all_reduce where one graph, like eager, issues
    a reduce_scatter and two all_gathers: 31 collectives a step against 61
    at 16 layers); the price is the highest measurement.
    Without the lean border (``lean_border=False``, ``stable_cache_keys=True``,
    ``inner="eager"``) such a piece would go through AOTAutograd's subclass
    runtime: DTensors unwrapped and wrapped per layer and step, gradients
    coerced to the traced tangent placements at every border (an all_reduce
    outside compiled code where the layer produces Partial, and aot_eager
    gradients off eager in the last bits: 1.1e-8 at 8 layers), so "auto"
    then keeps the frame whole; share_layers=True still shares it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx

from ..graph_utils import node_value
from .plan import LayerPlan

__all__ = [
    "AUTO_MAX_OVERHEAD",
    "AUTO_MIN_LAYERS",
    "ASSUMED_FLOPS",
    "BORDER_OVERHEAD_S",
    "PIECE_OVERHEAD_S",
    "Decision",
    "LayerCost",
    "Reason",
    "decide",
    "has_matmul",
    "layer_cost",
    "no_shared_layer",
    "span_flops",
]

AUTO_MIN_LAYERS = 8
AUTO_MAX_OVERHEAD = 0.01
# seconds per layer call, forward + backward, in a LayerRun (CPU:
# 64-layer nn.Module TP stack, fake process group, shared vs one graph;
# other devices: the same Python work, kernel launches are asynchronous)
PIECE_OVERHEAD_S = {"cpu": 1.5e-5, "cuda": 1.5e-5}
# seconds per layer call, forward + backward, behind the lean DTensor border
# (Note: [No DTensor at an automatic border]; 2e-4 until session 22 measured it again)
BORDER_OVERHEAD_S = {"cpu": 5e-5, "cuda": 5e-5}
# FLOP/s assumed for the layer's matrix products (high on purpose)
ASSUMED_FLOPS = {"cpu": 1e11, "cuda": 1e14}


class Reason(enum.Enum):
    """Why the frame is split into shared layers, or kept one graph."""

    SHARE = "share"  # split: the layers share compiled pieces
    OFF = "off"  # share_layers=False
    NO_SHARED_LAYER = "no_shared_layer"  # no two layers share a key (or none were found)
    FEW_LAYERS = "few_layers"  # "auto": fewer than AUTO_MIN_LAYERS layers
    DTENSOR_AT_BORDER = "dtensor_at_border"  # "auto": Note: [No DTensor at an automatic border]
    NOT_WORTH_IT = "not_worth_it"  # "auto" under inductor: Note: [When "auto" shares layers]
    MARKED = "marked"  # split: the user marked the block (Note: [Marked blocks are shared])


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded: ``reason`` to act on, ``text`` to show."""

    reason: Reason
    text: str

    @property
    def shares(self) -> bool:
        return self.reason in (Reason.SHARE, Reason.MARKED)

    @property
    def why_whole(self) -> str | None:
        """The text when the frame stays one graph, None when it is split."""
        return None if self.shares else self.text


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one shared layer would compute next to what its piece call costs."""

    flops: int  # forward FLOPs of the layer's matrix products
    device: str
    border: bool = False  # a DTensor crosses the layer border: it runs behind the lean DTensor border

    @property
    def layer_s(self) -> float:
        return 3 * self.flops / ASSUMED_FLOPS.get(self.device, ASSUMED_FLOPS["cuda"])

    @property
    def overhead_s(self) -> float:
        price = BORDER_OVERHEAD_S if self.border else PIECE_OVERHEAD_S
        return price.get(self.device, price["cuda"])

    @property
    def worth_sharing(self) -> bool:
        return self.overhead_s <= AUTO_MAX_OVERHEAD * self.layer_s

    def text(self) -> str:
        return (f"a layer computes ~{self.flops / 1e6:.3g} MFLOP forward (~{self.layer_s * 1e3:.3g} ms fwd+bwd "
                f"at {ASSUMED_FLOPS.get(self.device, ASSUMED_FLOPS['cuda']):.0e} FLOP/s on {self.device}), "
                f"a piece call{' behind the DTensor border' if self.border else ''} costs "
                f"~{self.overhead_s * 1e3:.2g} ms "
                f"({self.overhead_s / max(self.layer_s, 1e-12):.0%} of it, limit {AUTO_MAX_OVERHEAD:.0%})")


def decide(plan: LayerPlan, share_layers: bool | str, cost: LayerCost | None = None,
           dtensor_borders: Sequence[str] = (), marked: bool = False, lean_border: bool = False) -> Decision:
    """Split ``plan`` into shared pieces, or keep the graph whole, and why.

    ``cost`` (given under inductor) makes "auto" weigh run time too (Note:
    [When "auto" shares layers]); ``dtensor_borders`` names DTensors that
    would still cross layer borders after the plain borders (Note: [No
    DTensor at an automatic border]); ``marked``: the layers are blocks the
    user marked (Note: [Marked blocks are shared]); ``lean_border``: a
    piece that DTensors cross runs behind the lean DTensor border.

    Note: [Marked blocks are shared]
        ``nested_compile_region`` on a block is the user asking for it to
        be compiled once, and Dynamo already traced it once; one graph
        would give back the compile time the mark bought.  So a marked
        frame is split whenever two layers share a key, under "auto" as
        under True; only ``share_layers=False`` keeps it whole.  A DTensor
        still crossing the border is named in the text: those layers run
        through AOTAutograd's runtime (Note: [No DTensor at an automatic
        border]).
    """
    if share_layers is False:
        return Decision(Reason.OFF, "share_layers=False")
    if not plan.shared:
        return no_shared_layer(plan)
    # layers found (the last one may be its own piece: Note: [Where layers are cut])
    most = len(plan.spans)
    shown = ", ".join(dtensor_borders[:3]) + (", ..." if len(dtensor_borders) > 3 else "")
    runtime = "the lean DTensor border" if lean_border else "AOTAutograd's runtime"
    if marked:
        crossing = f"; DTensors cross the layer borders ({shown}): those layers use {runtime}" if dtensor_borders else ""
        return Decision(Reason.MARKED, f"marked by the user (nested_compile_region): {len(plan.shared)} of {most} "
                                       f"layers shared{crossing}")
    if share_layers == "auto":
        if most < AUTO_MIN_LAYERS:
            return Decision(Reason.FEW_LAYERS, f"share_layers='auto': {most} repeats of a layer < {AUTO_MIN_LAYERS}; "
                                               "one graph fuses across layer borders")
        if dtensor_borders and not lean_border:
            return Decision(Reason.DTENSOR_AT_BORDER,
                            f"share_layers='auto': {most} layers, but DTensors would cross the layer borders "
                            f"({shown}) without the lean DTensor border: each layer would unwrap and wrap them and "
                            "turn their gradients into the traced placements every step, summing gradients in "
                            "another order than one graph (share_layers=True shares anyway)")
        if cost is not None and dtensor_borders:
            cost = dataclasses.replace(cost, border=True)
        if cost is not None and not cost.worth_sharing:
            return Decision(Reason.NOT_WORTH_IT, f"share_layers='auto': {most} layers, but pieces would run slower "
                                                 f"than one graph: {cost.text()}")
    crossing = f"; DTensors cross the layer borders ({shown}): the lean DTensor border" if dtensor_borders else ""
    return Decision(Reason.SHARE, f"share_layers={share_layers!r}: {len(plan.shared)} of {most} layers shared"
                                  f"{crossing}")


def no_shared_layer(plan: LayerPlan) -> Decision:
    """The decision for a plan in which no two layers share a key."""
    return Decision(Reason.NO_SHARED_LAYER, plan.reason or "no two layers share a key")


def layer_cost(plan: LayerPlan) -> LayerCost | None:
    """The :class:`LayerCost` of ``plan``'s first shared layer, None if none."""
    if not plan.shared:
        return None
    span = plan.shared[0]
    nodes = plan.nodes_of(span)
    device = "cpu"
    for n in nodes:
        v = node_value(n)
        if isinstance(v, torch.Tensor):
            device = v.device.type
            break
    return LayerCost(span_flops(nodes), device)



_MATMUL_OPS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "__matmul__"})


def _op_name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def has_matmul(nodes: Iterable[fx.Node]) -> bool:
    """Does any of ``nodes`` compute a matrix product (the ops :func:`span_flops` counts)?"""
    return any(n.op in ("call_function", "call_method") and _op_name(n) in _MATMUL_OPS for n in nodes)


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
