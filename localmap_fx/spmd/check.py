"""Compile-time SPMD type checking of a region body (spmd_types=True).

The body's subgraph runs once, on fresh fake tensors typed from the region's
placements exactly as the eager path types them, under the strict checker
with the functional-collective rules (:func:`localmap_fx.spmd.types.checking`).
Its verdict and messages are the eager ones, followed by the region's call
site and the body line of the op that failed; the output types give the
output grad placements.  Nothing of the check stays in the compiled program.

Grad mode is the one the region was compiled under (Dynamo compiles a frame
per grad mode), so rules that depend on whether an input receives a gradient
decide as eagerly.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import FakeTensorMode, detect_fake_mode
from ..errors import region_error
from ..graph_utils import Frame, is_wrapper_frame, node_value, stack_frames
from ..region import Region, index_of
from . import functions
from . import types as spmd

__all__ = ["out_grad_placements_for", "typed_in_grad_placements"]

typed_in_grad_placements = spmd.typed_in_grad_placements


class _CheckInterpreter(fx.Interpreter):
    """Runs the body; remembers the node being run, adds nothing to errors.

    ``fx.Interpreter`` would splice "While executing ..." into the exception's
    first argument, inside the eager text (``SpmdTypeError`` prints its
    operator context after that argument); the failing node is reported
    after the eager message instead (see :func:`out_grad_placements_for`).
    """

    def __init__(self, gm: fx.GraphModule, body: Any = None) -> None:
        super().__init__(gm)
        self.extra_traceback = False
        self.node: fx.Node | None = None
        self.body = body

    def run_node(self, n: fx.Node):
        self.node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.higher_order.autograd_function_apply:
            return _apply_function(self.body, args)
        return super().call_function(target, args, kwargs)


def _apply_function(body: Any, args: tuple):
    """The traced ``autograd_function_apply(fwd, bwd, *tensors)``, as its class's ``apply``.

    See Note: [autograd.Function under the compile-time SPMD check].
    """
    tensors = args[2:]
    candidates = [] if body is None else functions.function_classes(body)
    fits = [c for c in candidates if functions.apply_arity_matches(c, len(tensors))]
    if len(fits) != 1:
        names = ", ".join(c.__qualname__ for c in candidates) or "none found"
        raise spmd.spmd.SpmdTypeError(
            "the compile-time SPMD check cannot tell which torch.autograd.Function "
            "this call applies (Dynamo keeps only its traced forward and backward; "
            f"Function classes the body names: {names}), so it cannot give "
            "spmd_types' verdict on it. Call the Function's apply directly in the "
            "local_map body with tensor arguments only (one Function class per "
            "body), or run this region eagerly to have it checked."
        )
    out = fits[0].apply(*tensors)  # type: ignore[attr-defined]
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fresh_fake(mode: FakeTensorMode, val):
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    t = mode.from_tensor(t)
    if val.requires_grad:
        t.requires_grad_(True)
    return t


def _run_checked(region: Region, global_check: bool = False) -> tuple:
    spec = region.spec
    mesh = spec.mesh
    if mesh is None:
        raise AssertionError(f"region {spec.func} has no device mesh")
    vals = [node_value(i.node) for i in region.inputs]
    mode = detect_fake_mode(vals) or FakeTensorMode()
    with mode:
        fakes = [_fresh_fake(mode, v) for v in vals]
    flat_args: list = []
    in_specs: list = []
    in_grads: list = []
    for inp, fake in zip(region.inputs, fakes):
        if inp.kind == "arg" and inp.index is not None:
            flat_args.append(fake)
            in_specs.append(spec.in_placements[inp.index] if spec.in_placements else None)
            in_grads.append(
                spec.in_grad_placements[inp.index] if spec.in_grad_placements else None
            )
    spmd.annotate_inputs(
        flat_args,
        tuple(in_specs) if spec.in_placements is not None else None,
        tuple(in_grads) if spec.in_grad_placements is not None else None,
        mesh,
    )
    interp = _CheckInterpreter(region.subgraph, functions.body_of(spec.body_key))
    gcheck = None
    tracking: Any = contextlib.nullcontext()
    if global_check:
        from .global_check import GlobalCheck, node_site

        gcheck = GlobalCheck(mesh, f"`{spec.func}`")
        gcheck.annotate_inputs(flat_args, tuple(in_specs) if spec.in_placements is not None else None)
        # body lines from the node being run: the lines eager finds on its stack
        tracking = gcheck.mode(lambda: node_site(interp.node))
    try:
        with mode, spmd.checking(mesh), tracking:
            outs = interp.run(*fakes)
    except Exception as e:
        e.__dict__["_localmap_fx_node"] = interp.node
        raise
    by_node: dict[Any, Any] = dict(zip(region.outputs, outs))
    flat_out: list = []
    exit_by_index = {index_of(x): x for x in region.exit_nodes}
    for j in range(len(spec.out_placements)):
        x = exit_by_index.get(j)
        if x is None:
            flat_out.append(_NON_TENSOR)
        else:
            flat_out.append(by_node[x.args[0]])
    grads = spmd.out_grad_placements(flat_out, spec.out_placements, mesh)
    if gcheck is not None:
        gcheck.check_outputs(flat_out, spec.out_placements)
    return grads


class _NonTensor:
    def __repr__(self) -> str:
        return "<non-tensor output>"


_NON_TENSOR = _NonTensor()


def out_grad_placements_for(region: Region, global_check: bool = False) -> tuple:
    """Type-check the body; return one grad placement spec per output.

    ``global_check``: also run the global check (:mod:`.global_check`), as
    eager ``spmd_types="global"`` does.
    """
    try:
        return _run_checked(region, global_check)
    except Exception as e:
        where = (
            f"local_map region {region.spec.func} called at "
            f"{region.spec.call_site} ({region.spec.call_function})"
        )
        node = e.__dict__.pop("_localmap_fx_node", None)
        _as_eager_text(e)
        if isinstance(e, (ValueError, spmd.spmd.SpmdTypeError)) and not getattr(e, "_localmap_fx_global", False):
            spmd.explain(e, region.spec.mesh)
        line = _body_line(node)
        err = region_error(e, where)
        if line:
            err.add_note(f"[localmap_fx] failing body op: {line}")
        raise err from e


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (getattr(m, "__file__", None) for m in (torch, spmd.spmd))
    if path
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def _body_line(node: fx.Node | None) -> str:
    """``file:line (function): code`` of the body line that created ``node``.

    The innermost frame of the user's body (after localmap_fx's own call of
    it, outside torch and spmd_types); the node itself when the body is a
    library function (``local_map(torch.relu, ...)``); "" for no node.
    """
    if node is None or node.op in ("placeholder", "output"):
        return ""
    body: list[Frame] = []
    for frame in stack_frames(node.stack_trace):
        if is_wrapper_frame(frame):
            body = []  # frames after the call of the body
            continue
        body.append(frame)
    user = [f for f in body if not os.path.abspath(f.file).startswith(_LIBRARY_DIRS)]
    if not user:
        return node.format_node() or node.name
    f = user[-1]
    where = f"{f.site} ({f.function})"
    return f"{where}: {f.code}" if f.code else where


_TRACEBACK_NOTE = (
    "\n\nSet SPMD_TYPES_TRACEBACK_FILTERING=off to see the full, unfiltered traceback."
)


def _as_eager_text(e: BaseException) -> None:
    """Give ``e`` the text eager shows for it.

    In eager, spmd_types' checker appends a note about traceback filtering
    to its errors (outside pytest and IPython); it skips that while
    ``torch.compiler.is_compiling()``, which holds during the compile-time
    check.  Errors of our collective rules never get it.
    """
    spmd_types = spmd.spmd
    if spmd_types is None or not isinstance(e, spmd_types.SpmdTypeError):
        return
    if getattr(e, "_localmap_fx_rule", False):
        return
    try:
        from spmd_types import _traceback

        mode = _traceback._resolve_mode(_traceback._FILTERING)
    except Exception:  # noqa: BLE001 - private API moved: keep the text as is
        return
    if mode in ("quiet_remove_frames", "remove_frames") and e.args and isinstance(e.args[0], str):
        if not e.args[0].endswith(_TRACEBACK_NOTE):
            e.args = (e.args[0] + _TRACEBACK_NOTE,) + e.args[1:]
