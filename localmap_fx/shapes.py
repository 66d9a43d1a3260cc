"""Global shapes of region outputs, including uneven sharding, without a sync.

``DTensor.from_local(..., run_check=False)`` assumes even sharding: a local
shard of size 2 on a 4-way ``Shard(0)`` becomes a global size of 8 on every
rank, which is wrong when the input was 9 rows split 3/2/2/2 (torch 2.14.1's
local_map has this bug, pytorch #172812).  Asking the other ranks for their
sizes would cost a collective and a host sync on every call.

Instead the output inherits the global size of an input sharded the same way
on the same mesh dimension whose local size matches the output's: the body
kept that dimension, so its global size is the input's.  When no input
matches, the even assumption stands (it is then exact for even inputs).  The
rule only reads sizes the rank already has, so it works identically in eager
and under torch.compile (where sizes are known at trace time, or symbolic:
a data-dependent size that cannot be compared without a guard matches no
input).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement, Shard
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

__all__ = ["InputShape", "input_shapes", "output_global_shape", "contiguous_stride"]

# (placements, global shape, local shape) of one DTensor argument, after any
# redistribution.
InputShape = tuple[tuple[Placement, ...], tuple[int, ...], tuple[int, ...]]


def input_shapes(args: Sequence, plan: Sequence, locals_: Sequence) -> list[InputShape]:
    """:data:`InputShape` of each DTensor argument as the body saw it.

    ``plan`` has per argument None (not a DTensor) or a step whose first
    entry is the redistribution target (None: the argument's own placements);
    ``locals_`` are the tensors the body received.
    """
    shapes = []
    for arg, step, local in zip(args, plan, locals_):
        if step is None:
            continue
        placements = tuple(step[0]) if step[0] is not None else tuple(arg.placements)
        shapes.append((placements, tuple(arg.shape), tuple(local.shape)))
    return shapes


def _even_size(local: int, mesh_shape: Sequence[int], mesh_dims: Sequence[int]) -> int:
    size = local
    for k in mesh_dims:
        size = size * mesh_shape[k]
    return size


def output_global_shape(
    local_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    inputs: Sequence[InputShape],
) -> tuple[tuple[int, ...], bool]:
    """(global shape, whether it differs from the even-sharding assumption)."""
    ndim = len(local_shape)
    out = []
    uneven = False
    for d in range(ndim):
        mesh_dims = [
            k for k, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == d
        ]
        even = _even_size(local_shape[d], mesh_shape, mesh_dims)
        size = even
        if len(mesh_dims) == 1:
            (k,) = mesh_dims
            for in_placements, in_global, in_local in inputs:
                if k >= len(in_placements):
                    continue
                p = in_placements[k]
                if not isinstance(p, Shard):
                    continue
                if sum(1 for q in in_placements if isinstance(q, Shard) and q.dim == p.dim) != 1:
                    continue
                d_in = p.dim % len(in_global)
                # data-dependent sizes (an all_to_all with .tolist() splits)
                # cannot be compared: no match, the even assumption stands
                if guard_or_false(in_local[d_in] == local_shape[d]):
                    size = in_global[d_in]
                    break
        if not guard_or_true(size == even):
            uneven = True
        out.append(size)
    return tuple(out), uneven


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * max(s, 1)
    return tuple(reversed(stride))
