"""Boundary lowering: every region boundary made explicit in the graph.

Capture leaves gradient placements implicit (``to_local()`` and
``from_local(..., grad_placements=None)``) and cannot know the output grad
placements of ``spmd_types=True`` regions at all.  This pass writes them out,
so that the graph handed to AOTAutograd carries, per region::

    before                                   after
    ------                                   -----
    x_r = x.redistribute(placements=S(0))    x_r = x.redistribute(placements=S(0))   # meta: plan "R->S(0)@tp:local"
    l = x_r.to_local()                       l = x_r.to_local(grad_placements=(Shard(0),))
    o = body(l)                              o = body(l)
    y = from_local(o, mesh, [Partial()])     y = from_local(o, mesh, (Partial(),), run_check=False,
                                                            grad_placements=(Replicate(),))

Grad placements come from ``in_grad_placements`` when given, else DTensor's
defaults (what eager's ``to_local()`` / ``from_local()`` use); for
``spmd_types=True`` regions the outputs' are derived from the body's SPMD
types, checked on fake tensors at compile time.

:func:`find_boundaries` only reads the graph; :func:`rewrite_boundary` edits
one boundary; the pass :func:`lower_boundaries` runs both for every region,
and :func:`lower` (public) applies it and returns the recompiled module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from ..boundary import ArgBoundary, BoundaryPlan, OutBoundary, explicit_grad, input_grad
from ..graph_utils import is_from_local, is_redistribute, is_to_local, node_value
from ..passes import PassResult, apply
from ..region import META_LOWERED, META_PLAN, Region, find_regions, index_of
from ..spmd.check import out_grad_placements_for
from .plan import RedistributePlan, plan_redistribute

__all__ = ["Boundary", "find_boundaries", "boundary_plan", "rewrite_boundary", "lower_boundaries", "lower"]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One boundary node and the explicit form it must take."""

    kind: str  # "to_local" | "from_local" | "redistribute"
    node: fx.Node
    region: int
    index: int
    placements: tuple[Placement, ...]
    grad_placements: tuple[Placement, ...] | None
    plan: RedistributePlan | None = None


def _enter_boundaries(r_idx: int, region: Region, typecheck: str) -> list[Boundary]:
    out: list[Boundary] = []
    spec = region.spec
    for node in region.enter_nodes:
        if not (is_redistribute(node) or is_to_local(node)):
            continue
        idx = index_of(node)
        if is_redistribute(node):
            src_val, dst_val = node_value(node.args[0]), node_value(node)
            plan = plan_redistribute(
                dst_val.device_mesh,
                tuple(src_val.placements),
                tuple(dst_val.placements),
                tuple(dst_val.shape),
                dst_val.dtype,
            )
            out.append(
                Boundary("redistribute", node, r_idx, idx, tuple(dst_val.placements), None, plan)
            )
        elif is_to_local(node):
            src = node_value(node.args[0])
            placements = tuple(src.placements)
            given = spec.in_grad_placements[idx] if spec.in_grad_placements is not None else None
            # typed: the SPMD type's gradient (R -> Partial) unless given
            grad = input_grad(placements, given, bool(spec.spmd_types) and typecheck != "off")
            out.append(Boundary("to_local", node, r_idx, idx, placements, explicit_grad(placements, grad)))
    return out


def _exit_boundaries(r_idx: int, region: Region, typecheck: str) -> list[Boundary]:
    spec = region.spec
    derived = None
    if spec.spmd_types and typecheck != "off":
        # the global check: every spmd_types region with typecheck="global",
        # regions that asked for it (spmd_types="global") always
        derived = out_grad_placements_for(region, typecheck == "global" or spec.spmd_types == "global")
    elif typecheck == "all":
        out_grad_placements_for(region)
    out: list[Boundary] = []
    for node in region.exit_nodes:
        if not is_from_local(node):
            continue
        j = index_of(node)
        placements = tuple(node_value(node).placements)
        grad = derived[j] if derived is not None else None
        out.append(Boundary("from_local", node, r_idx, j, placements, explicit_grad(placements, grad)))
    return out


def find_boundaries(
    gm: fx.GraphModule, regions: list[Region] | None = None, typecheck: str = "regions"
) -> list[Boundary]:
    """Every boundary of every region, with its explicit target form.

    For ``spmd_types=True`` regions this type-checks the body (compile time)
    and raises the eager error, with the region's call site, if it is wrong.
    """
    if regions is None:
        regions = find_regions(gm)
    out: list[Boundary] = []
    for r_idx, region in enumerate(regions):
        out.extend(_enter_boundaries(r_idx, region, typecheck))
        out.extend(_exit_boundaries(r_idx, region, typecheck))
    return out


def boundary_plan(boundaries: Sequence[Boundary]) -> BoundaryPlan:
    """The :class:`localmap_fx.boundary.BoundaryPlan` one region's boundaries
    (as :func:`find_boundaries` gives them) render: per DTensor argument its
    placements, redistribute target and gradient placements, per output its
    placements, global shape and gradient placements."""
    targets = {b.index: b.placements for b in boundaries if b.kind == "redistribute"}
    args, outs = [], []
    for b in boundaries:
        if b.kind == "to_local":
            target = targets.get(b.index)
            source = b.placements
            if target is not None:
                source = tuple(node_value(b.node.args[0].args[0]).placements)  # type: ignore[union-attr]  # the redistribute's input
            args.append(ArgBoundary(b.index, source, target, b.grad_placements))
        elif b.kind == "from_local":
            shape = tuple(int(s) for s in node_value(b.node).shape)
            outs.append(OutBoundary(b.index, b.placements, shape, b.grad_placements))
    return BoundaryPlan(tuple(sorted(args, key=lambda a: a.index)), tuple(sorted(outs, key=lambda o: o.index)))


def rewrite_boundary(b: Boundary) -> None:
    """Write ``b``'s grad placements (or plan) into its node."""
    node = b.node
    if b.kind == "redistribute":
        node.meta[META_PLAN] = b.plan
    elif b.kind == "to_local":
        node.args = node.args[:1]
        node.kwargs = {"grad_placements": b.grad_placements}  # type: ignore[dict-item]  # fx accepts placements
    elif b.kind == "from_local":
        local, mesh = node.args[0], node.args[1]
        # fx stores any Python constant; its Argument type does not list Placement
        node.args = (local, mesh, b.placements)  # type: ignore[assignment]
        # shape/stride (uneven sharding, see localmap_fx.shapes) stay as captured
        node.kwargs = {**node.kwargs, "run_check": False, "grad_placements": b.grad_placements}  # type: ignore[dict-item]
    else:
        raise AssertionError(f"unknown boundary kind {b.kind}")
    node.meta[META_LOWERED] = True


def lower_boundaries(gm: fx.GraphModule, typecheck: str = "regions") -> PassResult:
    """The pass: make every region boundary of ``gm`` explicit (see module docstring).

    ``typecheck``: "regions" type-checks regions that asked for it
    (spmd_types=True or "global"), "all" checks every region, "global" is
    "regions" plus the global check of every spmd_types region, "off" none.
    """
    regions = find_regions(gm)
    boundaries = find_boundaries(gm, regions, typecheck=typecheck)
    for b in boundaries:
        rewrite_boundary(b)
    # regions inside nested subgraphs (checkpoint bodies...) live in submodules
    return PassResult.of(gm, (regions[b.region].owner or gm for b in boundaries))


def lower(gm: fx.GraphModule, typecheck: str = "regions") -> fx.GraphModule:
    """Make every region boundary of ``gm`` explicit; returns ``gm``, recompiled.

    :func:`lower_boundaries` run through :func:`localmap_fx.passes.apply`.
    """
    return apply(lambda g: lower_boundaries(g, typecheck), gm)
