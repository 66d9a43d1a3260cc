"""Rules of the global SPMD check that are not DTensor's: whole-dimension ops and collectives.

Whole-dimension ops
    An op that needs every element of a tensor dimension (a softmax, a norm,
    a variance, a sort, a scan, a loss over classes) computes something else
    on a shard of that dimension: each rank normalises, sorts or scans its
    own block.  DTensor would gather the shard first; in a body nobody does.
    :data:`WHOLE_DIM_OPS` names these ops and which tensor dimensions of
    their input they need whole.  Any other op for which DTensor would
    gather a shard (``q @ k.T`` on two sequence shards in ring attention,
    indexing a local expert) is legitimate per-block work: the check loses
    track of the layout there but raises nothing.

Collectives
    :func:`collective_of` maps a functional collective (the
    ``_c10d_functional`` ops that ``torch.distributed._functional_collectives``
    calls, as in :mod:`localmap_fx.spmd.rules`) or an spmd_types collective
    to a :class:`CollectiveCall`: which reduction, which tensor dimension,
    which group.  The global check decides on its operand's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..graph_utils import funcol_op, schema_args

__all__ = ["WholeDimOp", "WHOLE_DIM_OPS", "whole_dims", "CollectiveCall", "collective_of"]


@dataclasses.dataclass(frozen=True)
class WholeDimOp:
    """An op that needs whole tensor dimensions of its first input.

    ``dims(args, kwargs, ndim)`` gives those dimensions; ``fix`` how to write
    it on a shard.
    """

    family: str
    dims: Callable[[tuple, dict, int], set[int]]
    fix: str


def _dim_arg(pos: int, default: Any, name: str = "dim") -> Callable[[tuple, dict, int], set[int]]:
    def dims(args: tuple, kwargs: dict, ndim: int) -> set[int]:
        d = kwargs.get(name, args[pos] if len(args) > pos else default)
        if d is None or isinstance(d, bool):  # var(x, unbiased) / argmax(x): every dim
            return set(range(ndim))
        if isinstance(d, (list, tuple)):
            return {int(x) % ndim for x in d}
        return {int(d) % ndim} if ndim else set()

    return dims


def _last_dims(pos: int) -> Callable[[tuple, dict, int], set[int]]:
    def dims(args: tuple, kwargs: dict, ndim: int) -> set[int]:
        shape = kwargs.get("normalized_shape", args[pos] if len(args) > pos else ())
        n = 1 if isinstance(shape, int) else len(shape)
        return set(range(ndim - n, ndim))

    return dims


def _all_but_batch(args: tuple, kwargs: dict, ndim: int) -> set[int]:
    return set(range(1, ndim))


def _class_dim(args: tuple, kwargs: dict, ndim: int) -> set[int]:
    return {1 if ndim >= 2 else 0}


_SOFTMAX_FIX = (
    "normalise with the all-reduced statistics: m = x.amax(dim, keepdim=True) then "
    "all_reduce(m, 'max'); s = exp(x - m).sum(dim, keepdim=True) then all_reduce(s, 'sum'); "
    "or all_gather the shard (gather_dim={d}) first"
)
_NORM_FIX = (
    "normalise with the all-reduced statistics: all_reduce(x.sum(dim), 'sum') and "
    "all_reduce((x * x).sum(dim), 'sum'), divided by the global size of the dimension; "
    "or all_gather the shard (gather_dim={d}) first"
)
_ORDER_FIX = "all_gather the shard (gather_dim={d}) first"

_softmax = WholeDimOp("softmax", _dim_arg(1, None), _SOFTMAX_FIX)
_norm = WholeDimOp("norm", _last_dims(1), _NORM_FIX)
_stat = WholeDimOp("statistic", _dim_arg(1, None), _NORM_FIX)
_order = WholeDimOp("order", _dim_arg(1, -1), _ORDER_FIX)
_scan = WholeDimOp("scan", _dim_arg(1, None), _ORDER_FIX)
_arg = WholeDimOp("order", _dim_arg(1, None), _ORDER_FIX)
_loss = WholeDimOp("softmax", _class_dim, _SOFTMAX_FIX)

#: op (as the body calls it, i.e. as a TorchFunctionMode sees it) -> rule
WHOLE_DIM_OPS: dict[Any, WholeDimOp] = {
    F.softmax: _softmax, F.log_softmax: _softmax,
    torch.softmax: _softmax, torch.log_softmax: _softmax,
    torch.Tensor.softmax: _softmax, torch.Tensor.log_softmax: _softmax,
    F.layer_norm: _norm, torch.layer_norm: _norm,
    F.rms_norm: _norm, torch.rms_norm: _norm,
    F.group_norm: WholeDimOp("norm", _all_but_batch, _NORM_FIX),
    F.normalize: WholeDimOp("norm", _dim_arg(2, 1), _NORM_FIX),
    torch.var: _stat, torch.std: _stat, torch.var_mean: _stat, torch.std_mean: _stat,
    torch.Tensor.var: _stat, torch.Tensor.std: _stat,
    torch.topk: WholeDimOp("order", _dim_arg(2, -1), _ORDER_FIX),
    torch.Tensor.topk: WholeDimOp("order", _dim_arg(2, -1), _ORDER_FIX),
    torch.sort: _order, torch.Tensor.sort: _order,
    torch.argsort: _order, torch.Tensor.argsort: _order,
    torch.argmax: _arg, torch.argmin: _arg, torch.Tensor.argmax: _arg, torch.Tensor.argmin: _arg,
    torch.cumsum: _scan, torch.cumprod: _scan, torch.logcumsumexp: _scan,
    torch.Tensor.cumsum: _scan, torch.Tensor.cumprod: _scan,
    F.cross_entropy: _loss, F.nll_loss: _loss,
}


def _max_with_dim(args: tuple, kwargs: dict, ndim: int) -> set[int]:
    d = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return {int(d) % ndim} if isinstance(d, int) and not isinstance(d, bool) else set()


# max(x, dim) / min(x, dim) return indices too; max(x) alone is a reduction DTensor handles
for _f in (torch.max, torch.min, torch.Tensor.max, torch.Tensor.min):
    WHOLE_DIM_OPS[_f] = WholeDimOp("order", _max_with_dim, _ORDER_FIX)


def whole_dims(func: Any, args: tuple, kwargs: dict) -> tuple[WholeDimOp, torch.Tensor, set[int]] | None:
    """``(rule, input, dims it needs whole)`` when ``func`` is a whole-dimension op."""
    rule = WHOLE_DIM_OPS.get(func)
    if rule is None:
        return None
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return None
    dims = rule.dims(args, kwargs, x.ndim)
    return (rule, x, dims) if dims else None


# --- collectives -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """A collective as the global check sees it.

    kind: ``"all_reduce"``, ``"all_gather"`` (along ``dim``), ``"reduce_scatter"``
    (along ``dim``), ``"all_to_all"``, ``"broadcast"`` or ``"identity"``
    (``wait_tensor``); ``reduce_op`` for reductions; ``group`` as passed.
    """

    kind: str
    tensors: tuple[torch.Tensor, ...]
    reduce_op: str | None
    group: Any
    dim: int = 0


_FUNCOL_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "wait_tensor": "identity",
    "_wrap_tensor_autograd": "identity",
}


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(t for t in x if isinstance(t, torch.Tensor))


def collective_of(func: Any, args: tuple, kwargs: dict) -> CollectiveCall | None:
    """The collective ``func(*args, **kwargs)`` issues, or None for any other op."""
    op = funcol_op(func)
    if op is not None:
        kind = _FUNCOL_KINDS.get(op[1])
        if kind is None:
            return CollectiveCall("all_to_all", _tensors(args[0]) if args else (), None, None)
        if kind == "identity":
            return CollectiveCall(kind, _tensors(args[0]) if args else (), None, None)
        bound = schema_args(func, args, kwargs)
        tensors = bound.get("input", bound.get("inputs", ()))
        reduce_op = bound.get("reduce_op")
        return CollectiveCall(
            kind, _tensors(tensors), None if reduce_op is None else str(reduce_op).lower(), bound.get("group_name")
        )
    return _spmd_collective(func, args, kwargs)


_SPMD_KINDS: dict[Any, str] = {}


def _spmd_kinds() -> dict[Any, str]:
    if not _SPMD_KINDS:
        import spmd_types as spmd

        _SPMD_KINDS.update(
            {
                spmd.all_reduce: "all_reduce",
                spmd.all_gather: "all_gather",
                spmd.reduce_scatter: "reduce_scatter",
                spmd.all_to_all: "all_to_all",
            }
        )
    return _SPMD_KINDS


def _spmd_collective(func: Any, args: tuple, kwargs: dict) -> CollectiveCall | None:
    """spmd_types' own collectives (``spmd.all_reduce(x, axis, src=P, dst=R)``, ...)."""
    kind = _spmd_kinds().get(func)
    if kind is None:
        return None
    import spmd_types as spmd

    x = args[0] if args else kwargs.get("x")
    axis = args[1] if len(args) > 1 else kwargs.get("axis")
    src, dst = kwargs.get("src"), kwargs.get("dst")
    dim = 0
    shard = dst if kind == "reduce_scatter" else src
    if isinstance(shard, spmd.types.Shard):
        dim = shard.dim
    if kind == "all_reduce" and src is not spmd.P:
        # V -> R sums per-rank values: no claim about a global tensor, but the
        # result is the same on every rank
        kind = "broadcast"
    return CollectiveCall(kind, _tensors(x), "sum" if kind in ("all_reduce", "reduce_scatter") else None, axis, dim)
