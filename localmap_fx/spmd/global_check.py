"""The global SPMD check: does a body compute, on global tensors, what its placements claim?

``local_map(..., spmd_types="global")`` runs everything ``spmd_types=True``
checks and, on top, this check.  Each local tensor of the body carries a
:data:`~.global_state.GlobalState` (one state per mesh dimension: replicated,
a shard of tensor dim ``d``, a pending reduction, stacked blocks, or
opaque).  Inputs start from ``in_placements``; every op the body calls is
seen by :class:`_GlobalMode` (a ``TorchFunctionMode`` entered *above*
spmd_types' checker, so spmd_types' verdict on each op comes first) which
runs it, then derives the outputs' states:

* collectives (:func:`.global_rules.collective_of`) check their operand:
  ``all_reduce(op)`` needs a pending ``op`` reduction, ``all_gather`` a shard
  of the gathered dim, ``reduce_scatter`` turns a pending reduction into a
  shard; ``all_to_all`` makes the layout opaque;
* a whole-dimension op (:data:`.global_rules.WHOLE_DIM_OPS`) on a shard of a
  dimension it needs whole is an error;
* any other op asks DTensor (:func:`.global_oracle.propagate`): a
  redistribution *from or to* a pending reduction means the op is not
  linear in it, an error; any other redistribution, or no sharding
  strategy at all, makes the outputs opaque (no verdict, no false alarm);
  otherwise the outputs' placements are their states.

Outputs are then compared with ``out_placements``.  Every error is an
:class:`SpmdGlobalError` (an ``spmd_types.SpmdTypeError``) naming the op, the
body line, the mesh dimension, the state and the fix.

The eager path (``spmd_types="global"``) and the compile-time check (the
region body run on fake tensors, see :mod:`localmap_fx.spmd.check`) use the
same :class:`GlobalCheck`; only where a line of the body comes from differs
(the Python stack vs the node's ``stack_trace``), and both name the same
line.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import spmd_types as spmd
import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._torch_compat import DisableTorchFunction, OpOverload, pytree
from . import global_oracle, global_rules
from .global_state import (
    REPLICATED,
    DimState,
    GlobalState,
    Opaque,
    Pending,
    Sharded,
    Site,
    Stacked,
    states_of_placements,
)

__all__ = ["SpmdGlobalError", "GlobalCheck", "run_eager", "eager_site", "node_site", "STATE_ATTR"]

#: attribute of a local tensor holding its GlobalState (like spmd_types' ``_local_type``)
STATE_ATTR = "_localmap_fx_global"
#: attribute of a chunk: (tensor dim, index, count, id of the chunked tensor, its state,
#: its GATHER_ATTR)
BLOCK_ATTR = "_localmap_fx_block"
#: attribute of an all_gather's output: {mesh dim: tensor dim the gathered shards were split on}
GATHER_ATTR = "_localmap_fx_gathered"


class SpmdGlobalError(spmd.SpmdTypeError):
    """A body that is well typed per rank but computes something else than its placements claim.

    An ``spmd_types.SpmdTypeError`` (a ``RuntimeError``), so code that catches
    the checker's errors catches it too.  Its text is complete (op, body line,
    mesh dimension, state, fix): no checker hint or traceback note is added.
    """

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        # no traceback note (spmd.check._as_eager_text), no checker hint (spmd.types.explain)
        self.__dict__["_localmap_fx_rule"] = True
        self.__dict__["_localmap_fx_global"] = True


# --- where in the body --------------------------------------------------------------

_LIB_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, spmd.__file__)
)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PKG_USER = (os.path.join(_PKG, "testing") + os.sep,)  # example models: user code
_IS_LIB: dict[str, bool] = {}


def _is_library(path: str) -> bool:
    hit = _IS_LIB.get(path)
    if hit is None:
        p = os.path.abspath(path)
        hit = p.startswith(_LIB_DIRS) or (p.startswith(_PKG) and not p.startswith(_PKG_USER))
        hit = hit or path.startswith("<")
        _IS_LIB[path] = hit
    return hit


def eager_site() -> Site | None:
    """The innermost frame of user code on the Python stack (the body line running now)."""
    f: Any = sys._getframe(1)
    while f is not None:
        if not _is_library(f.f_code.co_filename):
            return Site(f.f_code.co_filename, f.f_lineno)
        f = f.f_back
    return None


def node_site(node: Any) -> Site | None:
    """The body line of an FX node of a captured region (from its ``stack_trace``)."""
    from ..graph_utils import stack_frames

    if node is None:
        return None
    frames = [f for f in stack_frames(node.meta.get("stack_trace")) if not _is_library(f.file)]
    if not frames:
        return None
    f = frames[-1]
    return Site(f.file, f.line, f.code)


# --- op names as users write them ----------------------------------------------------

_DUNDER = {
    "matmul": "@", "add": "+", "radd": "+", "iadd": "+", "sub": "-", "rsub": "-", "isub": "-",
    "mul": "*", "rmul": "*", "imul": "*", "truediv": "/", "rtruediv": "/", "itruediv": "/",
    "pow": "**", "rpow": "**", "neg": "-", "getitem": "[]", "setitem": "[]=",
}


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if isinstance(func, OpOverload):
        name = func._schema.name.split("::")[-1]
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        return _DUNDER.get(core, core)
    return name


# --- the check -----------------------------------------------------------------------


# Note: [Combined per-shard statistics]
#     A non-linear op on a pending reduction is an error: ``relu(x @ w)``
#     before the all-reduce, ``mean + eps`` over a sharded hidden dim, a
#     bias added to a partial sum.  One pattern is not: a value made of
#     *several* statistics of the local shard (``sum``/``mean``/``amax``
#     over a sharded dim) combined non-linearly, e.g. DeepSeek-V3's
#     sequence-wise balance loss ``(counts * mean_probs).sum()`` per data
#     shard, returned Partial.  It is per-shard by design (the loss is
#     defined per shard), and DTensor cannot tell it from a bug.  So when
#     every pending input of a non-linear op is such a statistic, and there
#     are two or more, the result is opaque (no verdict).  A contraction's
#     summand (``x @ w``, ``einsum``) or a Partial input is never excused.
#
# Note: [Index bookkeeping]
#     A whole-dimension op on an integer or bool tensor over a shard
#     (``one_hot(idx).cumsum(0)`` for dispatch slots, ``argsort`` of expert
#     ids) computes per-rank positions for local dispatch, not model math:
#     its result is opaque rather than an error.


class GlobalCheck:
    """The global check of one region body on one mesh (reusable across calls)."""

    def __init__(self, mesh: Any, body_name: str = "the body") -> None:
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(
                'local_map(spmd_types="global") needs a DeviceMesh with mesh_dim_names '
                "(init_device_mesh(..., mesh_dim_names=(...)))"
            )
        self.mesh = mesh
        self.names: tuple[str, ...] = tuple(names)
        self.sizes: tuple[int, ...] = tuple(mesh.size(k) for k in range(mesh.ndim))
        self.body_name = body_name
        self._submeshes: dict[int, Any] = {}
        self._group_dims: dict[Any, int] = {}

    def submesh(self, k: int) -> Any:
        """The 1-D mesh of dimension ``k`` (sliced only when the oracle misses its cache)."""
        sub = self._submeshes.get(k)
        if sub is None:
            sub = self._submeshes[k] = self.mesh if self.mesh.ndim == 1 else self.mesh[self.names[k]]
        return sub

    # --- states ---------------------------------------------------------------------

    def state(self, t: torch.Tensor) -> GlobalState:
        s = getattr(t, STATE_ATTR, None)
        return s if s is not None else (REPLICATED,) * len(self.names)

    def _stamp(self, t: torch.Tensor, s: GlobalState) -> None:
        try:
            setattr(t, STATE_ATTR, s)
            elem = getattr(t, "elem", None)  # AsyncCollectiveTensor: .wait() returns elem
            if isinstance(elem, torch.Tensor):
                setattr(elem, STATE_ATTR, s)
        except (AttributeError, RuntimeError):  # pragma: no cover - exotic tensors
            pass

    def annotate_inputs(self, flat_local: Sequence[Any], in_specs: Sequence[Any] | None) -> None:
        """Give each region input the state of its in_placements (``None``: replicated)."""
        for i, t in enumerate(flat_local):
            if not isinstance(t, torch.Tensor):
                continue
            spec = None if in_specs is None else in_specs[i]
            if spec is None:
                s: GlobalState = (REPLICATED,) * len(self.names)
            else:
                s = _input_states(i, tuple(spec), t.ndim)
            self._stamp(t, s)

    def mode(self, site: Callable[[], Site | None] = eager_site) -> _GlobalMode:
        return _GlobalMode(self, site)

    # --- outputs --------------------------------------------------------------------

    def check_outputs(self, flat_out: Sequence[Any], out_specs: Sequence[Any]) -> None:
        for j, (o, spec) in enumerate(zip(flat_out, out_specs)):
            if spec is None or not isinstance(o, torch.Tensor):
                continue
            state = self.state(o)
            for k, p in enumerate(spec):
                if k < len(state):
                    self._check_output(j, k, p, state[k], o.ndim)

    def _check_output(self, j: int, k: int, p: Placement, s: DimState, ndim: int) -> None:
        if isinstance(s, Opaque):
            return
        what = f"output {j} of {self.body_name}, declared {p!r} on mesh dimension {self.names[k]!r} (out_placements[{j}][{k}])"
        fix = ""
        if isinstance(p, Replicate):
            if s == REPLICATED:
                return
            if isinstance(s, Pending):
                fix = f"all-reduce it before returning it (funcol.all_reduce(y, {s.op!r}, group)), or declare it Partial({s.op!r})"
            elif isinstance(s, Sharded):
                fix = f"all_gather it (gather_dim={s.dim}) before returning it, or declare it Shard({s.dim})"
            elif isinstance(s, Stacked):
                fix = f"all_gather along the sharded dim: funcol.all_gather_tensor(x, gather_dim={s.dim}, group)"
        elif isinstance(p, Shard):
            d = p.dim % ndim if ndim else p.dim
            if isinstance(s, Sharded) and s.dim == d:
                return
            if isinstance(s, Pending):
                fix = f"reduce_scatter it along dim {d} (funcol.reduce_scatter_tensor(y, {s.op!r}, {d}, group)), or declare it Partial({s.op!r})"
            elif isinstance(s, Sharded):
                fix = f"declare it Shard({s.dim}), or redistribute it inside the body"
            elif s == REPLICATED:
                fix = "declare it Replicate(), or return this rank's block of it"
            else:
                fix = f"all_gather along the sharded dim (gather_dim={s.dim}) first" if isinstance(s, Stacked) else ""
        elif isinstance(p, Partial):
            op = str(p.reduce_op)
            if isinstance(s, Pending) and s.op == op:
                return
            if isinstance(s, Pending):
                fix = f"declare it Partial({s.op!r}), or compute a pending {op} (e.g. a sum over the local shard divided by the global count instead of a mean)"
            elif s == REPLICATED:
                fix = f"declare it Replicate(): as Partial({op!r}) every rank's copy is reduced, counting it {self.sizes[k]} times"
            elif isinstance(s, Sharded):
                fix = f"declare it Shard({s.dim}): as Partial({op!r}) the shards are reduced elementwise"
            else:
                fix = "declare the placement the value has"
        else:
            return
        raise SpmdGlobalError(
            f'local_map(spmd_types="global"): {what}, but it is {s} over {self.names[k]!r}. Fix: {fix}.'
        )

    # --- one op ---------------------------------------------------------------------

    def _dim_of_group(self, group: Any) -> int | None:
        if group is None:
            return None
        try:
            key = group if isinstance(group, (str, int)) else id(group)
            hit = self._group_dims.get(key)
            if hit is not None:
                return hit
            from .rules import axis_of_group

            axis = axis_of_group(group)
            for k in range(len(self.names)):
                if spmd.MeshAxis.of(self.mesh.get_group(k)) == axis:
                    self._group_dims[key] = k
                    return k
        except Exception:  # noqa: BLE001 - a group outside the mesh: no verdict
            return None
        return None

    def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any, site: Callable[[], Site | None]) -> None:
        """Derive and attach the states of ``out`` (raise on a wrong op)."""
        outs = tensors_in(out)
        if not outs:
            if op_name(func) == "[]=" and args and isinstance(args[0], torch.Tensor):
                self._after_setitem(args)
            return
        ins = tensors_in(args) + tensors_in(kwargs)
        in_states = [self.state(t) for t in ins]
        if func not in _CAT_OPS and all(s == REPLICATED for st in in_states for s in st):
            for o in outs:  # e.g. an in-place op on a fresh tensor, or a chunk
                if getattr(o, STATE_ATTR, None) is not None:
                    self._stamp(o, (REPLICATED,) * len(self.names))
            if func in _CHUNK_OPS:
                self._tag_chunks(func, args, kwargs, outs, in_states[0] if in_states else None)
            return
        per_dim = [self._dim(k, func, args, kwargs, ins, in_states, outs, site) for k in range(len(self.names))]
        for i, o in enumerate(outs):
            self._stamp(o, tuple(per_dim[k][i] for k in range(len(self.names))))
        if func in _CHUNK_OPS and ins:
            self._tag_chunks(func, args, kwargs, outs, in_states[0])

    def _after_setitem(self, args: tuple) -> None:
        x, v = args[0], args[2] if len(args) > 2 else None
        sx = self.state(x)
        sv = self.state(v) if isinstance(v, torch.Tensor) else (REPLICATED,) * len(self.names)
        new = tuple(a if a == b else Opaque("a value of another layout written into it") for a, b in zip(sx, sv))
        if new != sx:
            self._stamp(x, new)

    def _dim(self, k, func, args, kwargs, ins, in_states, outs, site) -> list[DimState]:
        n_out = len(outs)
        states = [st[k] for st in in_states]
        name = op_name(func)
        if func in _CAT_OPS:
            stacked = self._cat_blocks(k, args, kwargs, name, site)
            if stacked is not None:
                return [stacked] * n_out
        if all(s == REPLICATED for s in states):
            return [REPLICATED] * n_out
        # before the opaque shortcut: the target of a loss may be opaque, its input not
        whole = global_rules.whole_dims(func, args, kwargs)
        if whole is not None:
            rule, x, dims = whole
            sx = self.state(x)[k]
            if isinstance(sx, Sharded) and sx.dim in dims:
                if x.dtype in _INDEX_DTYPES:  # Note: [Index bookkeeping]
                    return [Opaque(f"`{name}` of integer data over a shard")] * n_out
                raise self._whole_dim_error(k, name, rule, sx, site)
        opaque = next((s for s in states if isinstance(s, Opaque)), None)
        if opaque is not None:
            return [opaque] * n_out
        if any(isinstance(s, Stacked) for s in states):
            return [Opaque(f"`{name}` of gathered blocks")] * n_out
        prop = global_oracle.propagate(func, args, kwargs, lambda t: self.state(t)[k], lambda: self.submesh(k), self.sizes[k])
        if any(r.from_pending or r.to_pending for r in prop.redistributions):
            pending = [s for s in states if isinstance(s, Pending)]
            if len(pending) > 1 and all(p.statistic for p in pending):
                # Note: [Combined per-shard statistics]
                return [Opaque(f"`{name}` combines per-shard statistics")] * n_out
            r = next(r for r in prop.redistributions if r.from_pending or r.to_pending)
            raise self._nonlinear_error(k, name, r, states, site)
        if prop.redistributions:
            return [Opaque(f"`{name}` needs {prop.redistributions[0]}")] * n_out
        if prop.failure or len(prop.outputs) != n_out:
            return [Opaque(f"no DTensor sharding for `{name}`")] * n_out
        pend_in = next((s for s in states if isinstance(s, Pending)), None)
        result: list[DimState] = []
        for p, o in zip(prop.outputs, outs):
            if type(p) is Shard:
                result.append(Sharded(p.dim % o.ndim if o.ndim else p.dim))
            elif isinstance(p, Replicate):
                result.append(REPLICATED)
            elif isinstance(p, Partial):
                op = str(p.reduce_op)
                if pend_in is not None and pend_in.op == op:
                    result.append(pend_in)  # a linear op passes the pending reduction on
                else:
                    result.append(Pending(op, site(), name, statistic=func not in _CONTRACTIONS))
            else:
                result.append(Opaque(f"`{name}` gives {p}"))
        return result

    # --- chunk / cat: the blocks of all_gather(dim != 0) and reduce_scatter(dim != 0) ---

    def _tag_chunks(self, func, args, kwargs, outs, src_state) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or src_state is None:
            return
        if func in (torch.chunk, torch.Tensor.chunk):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        else:
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        dim = int(dim) % x.ndim if x.ndim else 0
        gathered = getattr(x, GATHER_ATTR, None)
        for i, o in enumerate(outs):
            try:
                setattr(o, BLOCK_ATTR, (dim, i, len(outs), id(x), src_state, gathered))
            except (AttributeError, RuntimeError):  # pragma: no cover
                return

    def _cat_blocks(self, k, args, kwargs, name, site) -> DimState | None:
        tensors = args[0] if args else kwargs.get("tensors")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != self.sizes[k] or not tensors:
            return None
        tags: list[Any] = [getattr(t, BLOCK_ATTR, None) for t in tensors]
        if any(t is None for t in tags):
            return None
        first = tags[0]
        if any(t[3] != first[3] or t[1] != i or t[2] != len(tensors) for i, t in enumerate(tags)):
            return None
        chunk_dim, src = first[0], first[4][k]
        ndim = tensors[0].ndim
        dim = int(dim) % ndim if ndim else 0
        gathered = (first[5] or {}).get(k)
        if src == REPLICATED and gathered is not None and chunk_dim == 0 and dim != gathered:
            src = Stacked(gathered)  # the all_gather's blocks, glued along another dim
        if isinstance(src, Stacked) and src.inner == REPLICATED and chunk_dim == 0:
            if dim == src.dim:
                return REPLICATED
            raise SpmdGlobalError(
                f'local_map(spmd_types="global"): `{name}` at {site()} reassembles an all_gather '
                f"of a shard of tensor dim {src.dim} over {self.names[k]!r} along dim {dim}: the "
                f"blocks are glued along the wrong dimension. Fix: use all_gather(dim={src.dim}) "
                f"(funcol.all_gather_tensor(x, gather_dim={src.dim}, group))."
            )
        if dim == 0 and chunk_dim != 0 and not isinstance(src, (Stacked, Opaque)):
            return Stacked(chunk_dim, src)
        return None

    # --- collectives --------------------------------------------------------------------

    def before_collective(self, call: global_rules.CollectiveCall, site) -> list[GlobalState]:
        """The states of the collective's outputs (one per tensor); raise if its operand is wrong."""
        out: list[GlobalState] = []
        k = None if call.kind == "identity" else self._dim_of_group(call.group)
        for x in call.tensors:
            st = list(self.state(x))
            if call.kind == "identity":
                out.append(tuple(st))
                continue
            if k is None:
                out.append(tuple(Opaque("a collective over a group outside the mesh") for _ in st))
                continue
            st[k] = self._collective_dim(call, k, st[k], site)
            out.append(tuple(st))
        return out

    def _mark_gathered(self, call, x: torch.Tensor, o: torch.Tensor) -> None:
        """Remember which shards an all_gather glued along dim 0 (see _cat_blocks)."""
        if call.kind == "identity":
            tag = getattr(x, GATHER_ATTR, None)
        elif call.kind == "all_gather":
            k = self._dim_of_group(call.group)
            s = self.state(x)[k] if k is not None else None
            tag = {k: s.dim} if isinstance(s, Sharded) else None
        else:
            tag = None
        if tag is None:
            return
        for t in (o, getattr(o, "elem", None)):
            if isinstance(t, torch.Tensor):
                setattr(t, GATHER_ATTR, tag)

    def _collective_dim(self, call, k, s: DimState, site) -> DimState:
        kind, name = call.kind, self.names[k]
        label = f"{kind}({call.reduce_op!r})" if call.reduce_op else kind
        if kind == "all_to_all":
            return Opaque("all_to_all")
        if kind == "broadcast":
            return REPLICATED
        if isinstance(s, Opaque):
            return REPLICATED if kind in ("all_reduce", "all_gather") else s
        fix = ""
        if kind == "all_reduce":
            if isinstance(s, Pending) and s.op == call.reduce_op:
                return REPLICATED
            if isinstance(s, Pending):
                fix = f"reduce it with {s.op!r} (all_reduce(x, {s.op!r}, group))"
            elif isinstance(s, Sharded):
                fix = (
                    f"to assemble the shards use all_gather(dim={s.dim}); summing shards adds "
                    "different blocks of the tensor elementwise"
                )
            elif s == REPLICATED:
                if call.reduce_op != "sum":
                    return REPLICATED  # avg/max/min of equal copies is the value (spmd_types' rules decide)
                fix = f"drop it: the value is already the same on every rank (a sum of {self.sizes[k]} copies)"
            elif isinstance(s, Stacked):
                return Opaque("all_reduce of gathered blocks")
        elif kind == "all_gather":
            if isinstance(s, Sharded):
                return REPLICATED if s.dim == call.dim else Stacked(s.dim)
            if isinstance(s, Pending):
                fix = f"reduce it first (all_reduce(x, {s.op!r}) or reduce_scatter)"
            else:
                return Opaque(f"all_gather of {s}")
        elif kind == "reduce_scatter":
            if isinstance(s, Stacked) and isinstance(s.inner, Pending) and s.inner.op == call.reduce_op:
                return Sharded(s.dim)
            if isinstance(s, Pending) and s.op == call.reduce_op:
                return Sharded(call.dim)
            if isinstance(s, Pending):
                fix = f"reduce it with {s.op!r}"
            elif isinstance(s, Sharded):
                fix = f"to assemble the shards use all_gather(dim={s.dim})"
            else:
                return Opaque(f"reduce_scatter of {s}")
        raise SpmdGlobalError(
            f'local_map(spmd_types="global"): `{label}` at {site()} over {name!r} gets {s} over '
            f"{name!r}. Fix: {fix}."
        )

    # --- errors ---------------------------------------------------------------------

    def _whole_dim_error(self, k, name, rule, s: Sharded, site) -> SpmdGlobalError:
        return SpmdGlobalError(
            f'local_map(spmd_types="global"): `{name}` at {site()} needs all of tensor dim '
            f"{s.dim}, which is sharded over mesh dimension {self.names[k]!r}: each rank "
            f"computes it on its own shard only. Fix: {rule.fix.format(d=s.dim)}."
        )

    def _nonlinear_error(self, k, name, r, states, site) -> SpmdGlobalError:
        pend = next((s for s in states if isinstance(s, Pending)), None)
        if r.to_pending:
            why = (
                f"it combines {pend} over {self.names[k]!r} with a value that is the same on every "
                f"rank, which every rank adds in (counted {self.sizes[k]} times after the reduction)"
            )
            fix = f"all-reduce before `{name}`, or apply `{name}` after the reduction"
        else:
            why = (
                f"it is not linear in {pend} over {self.names[k]!r}: each rank applies it to its "
                "own summand instead of to their reduction"
            )
            op = pend.op if pend is not None else "sum"
            fix = (
                f"all-reduce before `{name}` (funcol.all_reduce(y, {op!r}, group)), or "
                f"reduce_scatter to a shard first"
            )
        return SpmdGlobalError(f'local_map(spmd_types="global"): `{name}` at {site()}: {why}. Fix: {fix}.')


_INDEX_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)
# ops whose Partial output is a summand of a contraction over a sharded dim
_CONTRACTIONS = frozenset(
    {
        torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
        torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.einsum, torch.tensordot,
        torch.addmm, torch.baddbmm, torch.nn.functional.linear, torch.Tensor.__rmatmul__,
    }
)
_CAT_OPS = frozenset({torch.cat, torch.concat, torch.concatenate})
_CHUNK_OPS = frozenset({torch.chunk, torch.Tensor.chunk, torch.split, torch.Tensor.split})


@functools.lru_cache(maxsize=1024)
def _input_states(i: int, spec: tuple, ndim: int) -> GlobalState:
    """The states of region input ``i`` placed ``spec`` (made once per input and spec)."""
    return states_of_placements(spec, ndim, Site("", 0, what=f"in_placements[{i}] = {_fmt(spec)}"))


def _fmt(spec: Any) -> str:
    return "[" + ", ".join(str(p) for p in spec) + "]"


# --- the mode ----------------------------------------------------------------------------


class _GlobalMode(torch.overrides.TorchFunctionMode):
    """Sees every torch call of the body first; lets spmd_types check it, then tracks states."""

    def __init__(self, check: GlobalCheck, site: Callable[[], Site | None]) -> None:
        super().__init__()
        self.check = check
        self.site = site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from .rules import _next_mode

        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__" or func in _PASSTHROUGH:
            return _next_mode(func, args, kwargs)
        # The bookkeeping reads shapes and dtypes: with torch functions off, so
        # that spmd_types' checker below does not see (and pay for) each read.
        with _NO_TORCH_FUNCTION():
            call = global_rules.collective_of(func, args, kwargs)
            states = None if call is None else self.check.before_collective(call, self.site)
        out = _next_mode(func, args, kwargs)
        with _NO_TORCH_FUNCTION():
            if call is None:
                self.check.after_op(func, args, kwargs, out, self.site)
                return out
            for x, o, s in zip(call.tensors, tensors_in(out), states or ()):
                self.check._stamp(o, s)
                self.check._mark_gathered(call, x, o)
        return out


_NO_TORCH_FUNCTION = DisableTorchFunction


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or result (tuples, lists, dicts), in pytree order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    if isinstance(obj, (tuple, list)):
        for x in obj:
            out.extend(tensors_in(x))
    elif isinstance(obj, dict):
        for x in obj.values():
            out.extend(tensors_in(x))
    return out


_PASSTHROUGH = frozenset(
    {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
        torch.Tensor.is_contiguous, torch.Tensor.__len__, torch.Tensor.item, torch.Tensor.tolist,
        torch.Tensor.__bool__, torch.Tensor.__format__, torch.Tensor.__repr__,
        torch.Tensor.backward, torch.Tensor.register_hook, torch.Tensor.data_ptr,
        torch.Tensor.untyped_storage, torch.Tensor.element_size,
    }
)


# --- eager entry point ---------------------------------------------------------------------


def run_eager(
    func: Callable,
    local_args: tuple,
    kwargs: dict,
    flat_local: Sequence[Any],
    in_specs: Sequence[Any] | None,
    out_specs: Sequence[Any],
    mesh: Any,
    checking: Callable[[], Any],
) -> Any:
    """Run an eager ``spmd_types="global"`` body: spmd_types' check (``checking()``), then ours.

    The inputs already carry their SPMD types; they get their global states
    here.  spmd_types' errors keep the hint ``spmd_types=True`` gives them;
    :class:`SpmdGlobalError` is raised as it is (its text names the fix).
    """
    from . import types

    check = GlobalCheck(mesh, _body_name(func))
    check.annotate_inputs(flat_local, in_specs)
    try:
        with checking(), check.mode():
            out = func(*local_args, **kwargs)
    except SpmdGlobalError:
        raise
    except spmd.SpmdTypeError as e:
        raise types.explain(e, mesh) from None
    flat_out = pytree.tree_leaves(out)
    if len(flat_out) == len(out_specs):  # else wrap_outputs raises torch's count error
        check.check_outputs(flat_out, out_specs)
    return out


def _body_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or type(func).__name__
    return f"`{name}`"
