"""DTensor specs: built from their parts, and written as text a new process reads back.

The borders build every spec they hand out with :func:`make_spec`.  What a
trace recorded of its input gradients (``border_wrapper.Enter``'s records: per input, the
gradient's spec and whether it left through the input's wide slot) is
written beside torch's caches as JSON (:func:`encode_records`) and read back
by a process that did not trace (:func:`decode_records`): the border torch's
caches serve, and compiled layers restored from Inductor's cache
(:mod:`.layer_cache`).  A placement written here is read back as the same
placement or not at all.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["decode_placements", "decode_records", "encode_placements", "encode_records", "make_spec"]


def make_spec(mesh: Any, placements: Sequence[Any], shape: Sequence[int], stride: Sequence[int],
              dtype: torch.dtype) -> Any:
    """A ``DTensorSpec`` with its tensor metadata."""
    from .._torch_compat import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def encode_placements(placements: Sequence[Any]) -> str | None:
    """``"S(0),R,P(sum)"`` for (Shard(0), Replicate(), Partial("sum")),
    ``SS(0,2)`` for a ``_StridedShard``; None for a placement of another kind
    (a norm Partial): such a graph keeps the lean border."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from .._torch_compat import StridedShard

    out = []
    for p in placements:
        if type(p) is StridedShard:
            out.append(f"SS({p.dim},{p.split_factor})")
        elif type(p) is Shard:
            out.append(f"S({p.dim})")
        elif type(p) is Replicate:
            out.append("R")
        elif type(p) is Partial and isinstance(p.reduce_op, str) and p.reduce_op.isidentifier():
            out.append(f"P({p.reduce_op})")
        else:
            return None
    return ",".join(out)


def decode_placements(text: str) -> tuple:
    """The placements :func:`encode_placements` wrote."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from .._torch_compat import StridedShard

    items = re.findall(r"[A-Z]+\([^)]*\)|R", text)
    if ",".join(items) != text:
        raise ValueError(f"localmap_fx: {text!r} is no placements text this border wrote")
    out: list[Any] = []
    for item in items:
        if item.startswith("SS(") and item.endswith(")"):
            dim, factor = item[3:-1].split(",")
            out.append(StridedShard(int(dim), split_factor=int(factor)))
        elif item == "R":
            out.append(Replicate())
        elif item.startswith("S(") and item.endswith(")"):
            out.append(Shard(int(item[2:-1])))
        elif item.startswith("P(") and item.endswith(")"):
            out.append(Partial(item[2:-1]))
        else:
            raise ValueError(f"localmap_fx: {item!r} is no placement this border wrote")
    return tuple(out)


def encode_records(records: Sequence[list]) -> list | None:
    """Per input, ``[spec, wide]`` (or ``[]``: no gradient) as JSON entries; None if one cannot be written."""
    out: list = []
    for r in records:
        if not r:
            out.append(None)
            continue
        spec, wide = r
        text = encode_placements(spec.placements)
        if text is None:
            return None
        meta = spec.tensor_meta
        out.append([text, list(meta.shape), list(meta.stride), str(meta.dtype).removeprefix("torch."), bool(wide)])
    return out


def decode_records(entries: Any, meshes: Sequence[Any]) -> list[list] | None:
    """The records :func:`encode_records` wrote, each spec on the input's mesh
    (``meshes``, per input; None for a plain input); None when ``entries`` are
    not such records for these inputs."""
    if not isinstance(entries, list) or len(entries) != len(meshes):
        return None
    out: list[list] = []
    for e, mesh in zip(entries, meshes):
        if e is None:
            out.append([])
            continue
        if mesh is None:
            return None
        try:
            text, shape, stride, dtype, wide = e
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                return None
            out.append([make_spec(mesh, decode_placements(text), shape, stride, dt), bool(wide)])
        except (TypeError, ValueError, AttributeError):
            return None
    return out
