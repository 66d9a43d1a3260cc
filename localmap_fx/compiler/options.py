"""Options of the ``localmap_fx`` backend (:class:`BackendOptions`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx

__all__ = ["BackendOptions", "INNER_COMPILERS"]

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Options of the ``localmap_fx`` backend.

    Attributes:
        inner: the compiler that receives the lowered graph: ``"inductor"``
            (default), ``"aot_eager"`` (AOTAutograd, no codegen: bitwise equal
            to eager) or ``"eager"`` (run the lowered FX graph as is).
        outline: with ``share_layers=False``, outline region bodies into
            shared ``invoke_subgraph`` calls so a repeated body compiles once
            (default True).  With layer sharing on (``True`` / ``"auto"``)
            bodies always stay inline, whatever this says: a shared layer is
            compiled once anyway (Note: [Outline or inline, decided once] in
            :mod:`localmap_fx.compiler.pipeline`).
        fuse_boundaries: drop ``from_local -> to_local`` pairs between
            adjacent regions whose placements and grad placements already
            match (default True).
        typecheck: ``"regions"`` checks regions with ``spmd_types=True`` at
            compile time (``spmd_types="global"`` ones also globally),
            ``"all"`` checks every region's types, ``"global"`` checks every
            ``spmd_types`` region as ``spmd_types="global"`` does (at compile
            time, on fake tensors: the compiled program carries no checking),
            ``"off"`` skips it (the derived grad placements then fall back to
            DTensor defaults, as for spmd_types=False).
        on_stage: called as ``on_stage(stage_name, gm)`` after capture and
            after every pass.
        on_aot_graph: called as ``on_aot_graph("forward"|"backward", gm)``
            with the AOTAutograd graphs (inner = inductor or aot_eager).
        dump_dir: write every compiled frame's graphs, regions and
            collective tables under this folder (see ``docs/debugging.md``);
            ``None`` (default) reads ``$LOCALMAP_FX_DUMP_DIR``, unset = off.
        share_layers: compile a repeated layer (its regions and the DTensor
            code between them) once and call the compiled piece per layer
            (``True``); keep the whole frame one graph (``False``); or let
            :func:`localmap_fx.layer_sharing.decide.decide` choose (``"auto"``,
            default): at least 8 repeats, no DTensor left crossing a layer
            border, and under inductor a layer big enough that the per-layer
            call price is lost in its compute (see ``docs/design.md``).
        lean_border: a graph compiled whole whose inputs or outputs are
            DTensors (a block under regional compilation) runs behind one
            lean border instead of AOTAutograd's subclass runtime, with a
            backward compiled for the placements its gradients really have
            (default True; see :mod:`localmap_fx.compiler.dtensor_border`).
        stable_cache_keys: lift each DeviceMesh input out of the graph handed
            to AOTAutograd so its and Inductor's cache keys are the same in a
            new process (Note: [The mesh out of the cache key]).  Off by
            default: AOTAutograd then takes each DTensor input's mesh as an
            input of its own, which costs run time every call.
            It also turns ``lean_border`` off: the border compiles with
            its AOT graphs kept, which an AOTAutogradCache hit cannot return.
            Without it, the graphs behind the lean border and shared layer
            pieces still get stable Inductor FX graph cache keys, at no run
            time cost (Note: [Stable keys behind the border]).
        lone_ops_as_aten: under inductor, an op with nothing to fuse with
            (its neighbours are matrix products, attention, collectives or
            graph inputs and outputs) runs as its ATen op instead of a
            generated kernel, which would do the same work and cost a C++
            (or Triton) compile at cold start (default True; Note: [A lone
            op runs as its ATen op] in :mod:`localmap_fx.passes.lone_ops`).
    """

    inner: str = "inductor"
    outline: bool = True
    fuse_boundaries: bool = True
    typecheck: str = "regions"
    on_stage: Callable[[str, fx.GraphModule], None] | None = None
    on_aot_graph: Callable[[str, fx.GraphModule], None] | None = None
    dump_dir: str | None = None
    share_layers: bool | str = "auto"
    lean_border: bool = True
    stable_cache_keys: bool = False
    lone_ops_as_aten: bool = True

    @property
    def uses_lean_border(self) -> bool:
        """Does a graph compiled whole (a frame, a block, a layer piece) with
        DTensors at its border run behind the lean DTensor border?"""
        return self.lean_border and not self.stable_cache_keys and self.inner != "eager"

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(
                f"backend(inner={self.inner!r}) is not supported: use one of {INNER_COMPILERS}."
            )
        if self.share_layers not in (True, False, "auto"):
            raise ValueError(
                f"backend(share_layers={self.share_layers!r}) is not supported: use "
                "True, False or 'auto'."
            )
        if self.typecheck not in ("regions", "all", "global", "off"):
            raise ValueError(
                f"backend(typecheck={self.typecheck!r}) is not supported: use "
                "'regions', 'all', 'global' or 'off'."
            )
        if self.inner == "inductor" and self.outline and self.share_layers is False:
            import warnings

            # hoist_subgraph_views repairs one such case; the residual case
            # (h = x + f(x); y = f(h)) is still wrong upstream.
            warnings.warn(
                "localmap_fx.backend(inner='inductor', share_layers=False, outline=True): "
                "torch 2.14.1's Inductor can give wrong gradients for a region body shared "
                "by several calls (pinned by tests/distributed/test_models.py::"
                "test_upstream_invoke_subgraph_twice_with_residual). Pass outline=False, or "
                "keep share_layers='auto'/True, for gradients you can trust.",
                UserWarning,
                stacklevel=3,
            )
