"""DTensor's sharding propagation as the oracle for one op of a body, on one mesh dimension.

:func:`propagate` runs the op on meta DTensors built from the inputs' local
shapes and states, on the region's mesh dimension (a 1-D mesh), and reports
what DTensor did: the redistributions it needed and the placements of the
outputs.  The local tensors are ``meta`` tensors, so DTensor's collectives
(if a redistribution needs one) run their meta kernels: nothing is
communicated and nothing is allocated.

Note: [Recording DTensor's redistributions]
    DTensor announces every implicit redistribution of an op's argument to
    the active ``DebugMode`` (``record_redistribute_calls``, a context
    manager around the redistribution).  :class:`_Recorder` is a
    ``DebugMode`` that keeps only those (source and target placements) and
    otherwise lets every op through unrecorded; it is entered only around
    the meta run.  ``ExplicitRedistributionContext`` would raise on the
    first redistribution and hide the others.

Results are cached per (op, mesh dimension size, each argument's local
shape, dtype and state, other arguments' values): a body run again with the
same shapes costs one dictionary lookup per op and mesh dimension.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._torch_compat import DebugMode, DisableTorchFunction, TorchDispatchMode, pytree
from .global_state import REPLICATED, DimState, Pending, Sharded

__all__ = ["Redistribution", "Propagation", "propagate", "placement_of_state"]


@dataclasses.dataclass(frozen=True)
class Redistribution:
    """One implicit redistribution DTensor needed for the op: ``src -> dst``."""

    src: Placement
    dst: Placement

    @property
    def from_pending(self) -> bool:
        return isinstance(self.src, Partial)

    @property
    def to_pending(self) -> bool:
        return isinstance(self.dst, Partial) and not isinstance(self.src, Partial)

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclasses.dataclass(frozen=True)
class Propagation:
    """What DTensor did with the op: redistributions and output placements (or why it failed)."""

    redistributions: tuple[Redistribution, ...] = ()
    outputs: tuple[Placement | None, ...] = ()  # one per flat output leaf, None for non-DTensors
    failure: str = ""


class _Recorder(DebugMode):
    """Keeps DTensor's redistributions of op arguments; see Note: [Recording DTensor's redistributions]."""

    def __init__(self) -> None:
        # Not DebugMode.__init__: its first call imports torch._inductor (seconds)
        # to register a lowering for DebugMode's annotations, which a recorder
        # never makes.  Only what DebugMode.__enter__/__exit__ read is set.
        TorchDispatchMode.__init__(self)
        self.record_torchfunction = False
        self.record_nn_module = False
        self.record_stack_trace = False
        self.seen: list[Redistribution] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # let DTensor dispatch (and report to us)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def record_redistribute_calls(self, arg, src, dst, transform_info_str=None, is_explicit=False):
        # DTensor calls this twice per redistribution: with the argument's
        # index and specs (dispatch), then with the local tensor and placement
        # tuples (redistribute_local_tensor).  The first is enough.
        if isinstance(arg, int):
            self.seen.append(Redistribution(src.placements[0], dst.placements[0]))
        yield

    def record_output_placements(self, output_spec) -> None:
        return None


# recorders are reused (a list, so that a nested meta run takes another one)
_RECORDERS: list[_Recorder] = []


def _recorder() -> _Recorder:
    rec = _RECORDERS.pop() if _RECORDERS else _Recorder()
    rec.seen = []
    return rec


class _DropFakeTensorLogs(logging.Filter):
    """FakeTensor logs a traceback for every op whose meta kernel fails; for the
    oracle a failure is an answer ("no verdict"), not an error worth a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_DROP = _DropFakeTensorLogs()


def placement_of_state(s: DimState) -> Placement:
    if isinstance(s, Sharded):
        return Shard(s.dim)
    if isinstance(s, Pending):
        return Partial(s.op)
    return Replicate()


_CACHE: dict[tuple, Propagation] = {}
_CACHE_MAX = 4096


def _key(x: Any, state_of: Callable[[torch.Tensor], DimState]) -> Any:
    """A hashable description of an op argument; TypeError when there is none."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.is_contiguous(), state_of(x).key())
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_key(v, state_of) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _key(v, state_of)) for k, v in x.items()))
    hash(x)
    return (type(x), x)


def _symbolic(x: Any) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)


def propagate(
    func: Callable,
    args: tuple,
    kwargs: dict,
    state_of: Callable[[torch.Tensor], DimState],
    mesh_of: Callable[[], Any],
    size: int,
) -> Propagation:
    """Run ``func`` on meta DTensors of the 1-D mesh ``mesh_of()`` (``size`` ranks)
    whose placements are the inputs' states."""
    try:
        key: tuple | None = (func, size, _key(args, state_of), _key(kwargs, state_of))
        hit = _CACHE.get(key)  # type: ignore[arg-type]
        if hit is not None:
            return hit
    except TypeError:  # an unhashable argument (or a symbolic size): not cached
        key = None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if any(_symbolic(x) for x in leaves):
        return Propagation(failure="symbolic sizes")
    states = [state_of(x) if isinstance(x, torch.Tensor) else None for x in leaves]
    result = _run_meta(func, leaves, spec, states, mesh_of)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = result
    return result


def _run_meta(func, leaves, spec, states, mesh_of) -> Propagation:
    from .._torch_compat import disable_current_modes, maybe_disable_local_tensor_mode

    rec = _recorder()
    _FAKE_LOG.addFilter(_DROP)
    try:
        # no mode of the body's run (spmd_types' checker, FakeTensorMode, LocalTensorMode)
        # may see the meta run, nor the mesh slicing (tensor ops on the mesh's ranks)
        with maybe_disable_local_tensor_mode(), disable_current_modes(), DisableTorchFunction():
            mesh = mesh_of()
            meta_leaves = []
            for x, s in zip(leaves, states):
                if isinstance(x, torch.Tensor):
                    local = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                    if x.requires_grad and (x.is_floating_point() or x.is_complex()):
                        local.requires_grad_(True)
                    x = DTensor.from_local(local, mesh, [placement_of_state(s or REPLICATED)], run_check=False)
                meta_leaves.append(x)
            args, kwargs = pytree.tree_unflatten(meta_leaves, spec)
            try:
                with rec:
                    out = func(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - no strategy, local sizes...: no verdict
                return Propagation(tuple(rec.seen), failure=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        _FAKE_LOG.removeFilter(_DROP)
        _RECORDERS.append(rec)
    outs = tuple(
        o.placements[0] if isinstance(o, DTensor) else None
        for o in pytree.tree_leaves(out)
        if isinstance(o, torch.Tensor)
    )
    return Propagation(tuple(rec.seen), outs)

