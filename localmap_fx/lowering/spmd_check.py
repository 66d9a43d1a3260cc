"""Compile-time SPMD type checking of a region body (spmd_types=True).

The body's subgraph runs once, on fresh fake tensors typed from the region's
placements exactly as the eager path types them, under the strict checker.
Its verdict and messages are the eager ones; the output types give the
output grad placements.  Nothing of the check stays in the compiled program.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import spmd
from ..errors import region_error
from ..region import Region

__all__ = ["check_region", "out_grad_placements_for"]


def _fresh_fake(mode: FakeTensorMode, val):
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    t = mode.from_tensor(t)
    if val.requires_grad:
        t.requires_grad_(True)
    return t


def _run_checked(region: Region) -> tuple:
    spec = region.spec
    mesh = spec.mesh
    if mesh is None:
        raise AssertionError(f"region {spec.func} has no device mesh")
    vals = [i.node.meta.get("example_value") for i in region.inputs]
    mode = detect_fake_mode(vals) or FakeTensorMode()
    with mode:
        fakes = [_fresh_fake(mode, v) for v in vals]
    flat_args: list = []
    in_specs: list = []
    in_grads: list = []
    for inp, fake in zip(region.inputs, fakes):
        if inp.kind == "arg":
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
    with mode, spmd.checking(mesh):
        outs = fx.Interpreter(region.subgraph).run(*fakes)
    by_node = dict(zip(region.outputs, outs))
    flat_out = []
    exit_by_index = {e.meta["custom"]["localmap_fx.index"]: e for e in region.exit_nodes}
    for j, s in enumerate(spec.out_placements):
        e = exit_by_index.get(j)
        if e is None:
            flat_out.append(_NON_TENSOR)
        else:
            flat_out.append(by_node[e.args[0]])
    return spmd.out_grad_placements(flat_out, spec.out_placements, mesh)


class _NonTensor:
    def __repr__(self) -> str:
        return "<non-tensor output>"


_NON_TENSOR = _NonTensor()


def out_grad_placements_for(region: Region) -> tuple:
    """Type-check the body; return one grad placement spec per output."""
    try:
        return _run_checked(region)
    except Exception as e:
        where = (
            f"local_map region {region.spec.func} called at "
            f"{region.spec.call_site} ({region.spec.call_function})"
        )
        raise region_error(e, where) from e


def check_region(region: Region) -> None:
    out_grad_placements_for(region)
