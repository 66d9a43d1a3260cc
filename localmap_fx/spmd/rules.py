"""SPMD typing rules for functional collectives inside ``spmd_types=True`` regions.

spmd_types 0.3.1 types its own collectives (``spmd.all_reduce(x, axis,
src=P, dst=R)``, ...) and raw ``torch.distributed`` calls, but not the
functional collectives users write inside ``local_map`` bodies
(``torch.distributed._functional_collectives``, which call the
``_c10d_functional`` ops).  Its checker treats those ops as unknown
non-linear ops: the output keeps the input type, so a body that reduces a
Partial with ``funcol.all_reduce`` fails (``P`` cannot pass a non-linear op)
and one that sums a Varying value keeps ``V`` and fails at the output.

This module types them, per mesh axis, from the table :data:`RULES`.

Note: [Why a rule table of our own]
    spmd_types' public extension points are for ``torch.autograd.Function``
    subclasses (``register_autograd_function``, ``register_decomposition``,
    ``register_local_autograd_function``).  The functional collectives are
    ``torch.library`` custom ops with autograd formulas registered by torch,
    not Functions, and the checker's op tables (``_SPMD_FUNCTION_DEFAULTS``,
    ``RAW_DIST_RULES``, ``_OP_REGISTRY``) are internal: adding entries to them
    would be patching spmd_types.  So :func:`rules` is a small
    ``TorchFunctionMode`` of ours, entered *inside* spmd_types'
    ``typecheck()`` (see :func:`localmap_fx.spmd.types.checking`).  Being the top
    mode it sees every torch call of the body first; for a functional
    collective it checks the input types against :data:`RULES`, runs the op
    with checking paused (``spmd.no_typecheck()``) and stamps the output
    type (``spmd.assert_type``); every other call goes on to spmd_types'
    checker untouched.  Nothing is registered globally and nothing of
    spmd_types or torch is modified.

Note: [What makes a rule right]
    A rule may only accept a body whose forward *and* gradients are right.
    The gradients are those torch 2.14.1 registers for the ops
    (``torch/distributed/_functional_collectives.py``), i.e. plain math:
    all_reduce <-> all_reduce (same op), all_gather <-> reduce_scatter(sum),
    all_to_all_single <-> all_to_all_single with the splits swapped;
    ``wait_tensor`` and ``_wrap_tensor_autograd`` are identities.  In SPMD
    types, the gradient of an ``R`` output arrives as ``P`` and the gradient
    of a ``P`` input must leave as ``R``; of ``V``, ``V``; of ``I``, ``I``.
    Checking each row against that:

    * all_reduce(sum), ``P -> R``: the grad ``P`` is summed into ``R``, the
      grad a ``P`` input needs.  ``V -> R`` (the per-rank values summed as a
      Partial) likewise.  ``P -> I`` is *not* a rule: ``I`` would take an
      ``I`` grad and the op would still sum it, giving ``n`` times the
      gradient (spmd.all_reduce(dst=I) has an identity backward instead).
      An ``R``/``I`` input is already reduced: summing it again multiplies
      it by the axis size.
    * all_reduce(avg): as sum, scaled by ``1/n`` both ways.
    * all_gather, ``V -> R``: the grad ``P`` is reduce-scattered, which is the
      shard of the summed gradient each rank's ``V`` input needs.
    * reduce_scatter(sum), ``P|V -> V``: the ``V`` grad is all-gathered into
      the full gradient, ``R`` for a ``P`` input.
    * all_to_all_single, ``V -> V``: its backward is its transpose.
    * max/min/product reductions, avg reduce_scatter and broadcast have no
      usable gradient (their backward raises or is not registered): they
      are accepted only on inputs that receive no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import spmd_types as spmd
import torch
from spmd_types import I, P, R, V

from .._torch_compat import DisableTorchFunction, FakeTensor, is_torch_function_mode_enabled, pytree
from ..graph_utils import NON_COLLECTIVE_OPS, funcol_op, schema_args

__all__ = [
    "CollectiveRule",
    "RULES",
    "axis_of_group",
    "rule_for",
    "rules",
    "rules_table_markdown",
]

@dataclasses.dataclass(frozen=True)
class CollectiveRule:
    """How one functional collective changes the SPMD type on its mesh axis.

    Attributes:
        op: the ``_c10d_functional`` op (``"all_reduce"``, ...).
        reduce_ops: the reduce ops this row covers, ``None`` when the op
            takes none, ``("*",)`` for every other reduce op.
        accepts: ``(input type, output type)`` pairs on the collective's axis.
        backward: the gradient torch computes, in words; ``None`` when it has
            none that is correct (then inputs must not receive a gradient).
        linear: the op is linear, so ``P`` on the *other* mesh axes passes
            through; a non-linear reduction rejects it.
        funcol: the ``torch.distributed._functional_collectives`` calls that
            reach this op (documentation).
    """

    op: str
    reduce_ops: tuple[str, ...] | None
    accepts: tuple[tuple[Any, Any], ...]
    backward: str | None
    linear: bool = True
    funcol: tuple[str, ...] = ()

    def output_type(self, t):
        for src, dst in self.accepts:
            if src is t:
                return dst
        return None

    @property
    def text(self) -> str:
        """``all_reduce(sum)`` or ``all_gather_into_tensor``."""
        if self.reduce_ops is None:
            return self.op
        if self.reduce_ops == ("*",):
            return f"{self.op}(max, min, product, ...)"
        return f"{self.op}({'|'.join(self.reduce_ops)})"


def _pairs(*pairs) -> tuple:
    return tuple(pairs)


#: The typing rules, one row per (op, class of reduce op).  See Note: [What
#: makes a rule right] for why each row is what it is.
RULES: tuple[CollectiveRule, ...] = (
    CollectiveRule(
        "all_reduce", ("sum",), _pairs((P, R), (V, R)),
        backward="all_reduce(sum) of the grad: P -> R",
        funcol=("all_reduce(x, 'sum', group)",),
    ),
    CollectiveRule(
        "all_reduce", ("avg",), _pairs((P, R), (V, R)),
        backward="all_reduce(avg) of the grad: P -> R",
        funcol=("all_reduce(x, 'avg', group)",),
    ),
    CollectiveRule(
        "all_reduce", ("*",), _pairs((V, R)), backward=None, linear=False,
        funcol=("all_reduce(x, 'max' | 'min' | 'product' | ..., group)",),
    ),
    CollectiveRule(
        "all_gather_into_tensor", None, _pairs((V, R)),
        backward="reduce_scatter(sum) of the grad: P -> V",
        funcol=(
            "all_gather_tensor(x, gather_dim, group)",
            "all_gather_single(x, gather_dim, group)",
            "all_gather_tensor_autograd / all_gather_single_autograd",
        ),
    ),
    CollectiveRule(
        "reduce_scatter_tensor", ("sum",), _pairs((P, V), (V, V)),
        backward="all_gather of the grad: V -> R",
        funcol=(
            "reduce_scatter_tensor(x, 'sum', scatter_dim, group)",
            "reduce_scatter_single(...)",
            "reduce_scatter_tensor_autograd / reduce_scatter_single_autograd",
        ),
    ),
    CollectiveRule(
        "reduce_scatter_tensor", ("avg",), _pairs((P, V), (V, V)), backward=None,
        funcol=("reduce_scatter_tensor(x, 'avg', scatter_dim, group)",),
    ),
    CollectiveRule(
        "reduce_scatter_tensor", ("*",), _pairs((V, V)), backward=None, linear=False,
        funcol=("reduce_scatter_tensor(x, 'max' | ..., scatter_dim, group)",),
    ),
    CollectiveRule(
        "all_to_all_single", None, _pairs((V, V)),
        backward="all_to_all_single of the grad, splits swapped: V -> V",
        funcol=("all_to_all_single(x, output_split_sizes, input_split_sizes, group)",
                "all_to_all_single_autograd(...)"),
    ),
    CollectiveRule(
        "broadcast", None, _pairs((V, R), (R, R), (I, R)), backward=None,
        funcol=("broadcast(x, src, group)",),
    ),
    # list forms: the same rule for every tensor of the list
    CollectiveRule(
        "all_reduce_coalesced", ("sum",), _pairs((P, R), (V, R)),
        backward="all_reduce_coalesced(sum) of the grads: P -> R",
        funcol=("all_reduce_coalesced([x, ...], 'sum', group)",),
    ),
    CollectiveRule(
        "all_reduce_coalesced", ("avg",), _pairs((P, R), (V, R)), backward=None,
        funcol=("all_reduce_coalesced([x, ...], 'avg', group)",),
    ),
    CollectiveRule(
        "all_reduce_coalesced", ("*",), _pairs((V, R)), backward=None, linear=False,
        funcol=("all_reduce_coalesced([x, ...], 'max' | ..., group)",),
    ),
    CollectiveRule(
        "all_gather_into_tensor_coalesced", None, _pairs((V, R)),
        backward="reduce_scatter_tensor_coalesced(sum) of the grads: P -> V",
        funcol=("all_gather_into_tensor_coalesced([x, ...], group)",),
    ),
    CollectiveRule(
        "reduce_scatter_tensor_coalesced", ("sum",), _pairs((P, V), (V, V)),
        backward="all_gather_into_tensor_coalesced of the grads: V -> R",
        funcol=("reduce_scatter_tensor_coalesced([x, ...], 'sum', [0, ...], group)",),
    ),
    CollectiveRule(
        "reduce_scatter_tensor_coalesced", ("avg",), _pairs((P, V), (V, V)), backward=None,
        funcol=("reduce_scatter_tensor_coalesced([x, ...], 'avg', [0, ...], group)",),
    ),
    CollectiveRule(
        "reduce_scatter_tensor_coalesced", ("*",), _pairs((V, V)), backward=None,
        linear=False,
        funcol=("reduce_scatter_tensor_coalesced([x, ...], 'max' | ..., [0, ...], group)",),
    ),
)

# ops that pass their input through unchanged (type included)
_IDENTITY_OPS = NON_COLLECTIVE_OPS

# argument names, per op, of the tensor(s), the reduce op and the group
_ARGS = {
    "all_reduce": ("input", "reduce_op", "group_name"),
    "all_reduce_coalesced": ("inputs", "reduce_op", "group_name"),
    "all_gather_into_tensor": ("input", None, "group_name"),
    "all_gather_into_tensor_coalesced": ("inputs", None, "group_name"),
    "reduce_scatter_tensor": ("input", "reduce_op", "group_name"),
    "reduce_scatter_tensor_coalesced": ("inputs", "reduce_op", "group_name"),
    "all_to_all_single": ("input", None, "group_name"),
    "broadcast": ("input", None, "group_name"),
}


def rule_for(op: str, reduce_op: str | None) -> CollectiveRule | None:
    """The row of :data:`RULES` for ``op`` (and ``reduce_op``), or None."""
    reduce_op = None if reduce_op is None else str(reduce_op).lower()
    fallback = None
    for rule in RULES:
        if rule.op != op:
            continue
        if rule.reduce_ops is None or reduce_op in rule.reduce_ops:
            return rule
        if rule.reduce_ops == ("*",):
            fallback = rule
    return fallback


# --- groups -> mesh axes -------------------------------------------------------


def axis_of_group(group: Any):
    """The spmd ``MeshAxis`` of a functional-collective ``group`` argument.

    Accepts what ``torch.distributed._functional_collectives`` accepts and
    passes on to its ops: a 1-D ``DeviceMesh``, ``(mesh, dim)``, a
    ``ProcessGroup`` or a group name.  A list of ranks is refused: it names
    no mesh dimension.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, spmd.MeshAxis):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a {group.ndim}-D DeviceMesh names no single mesh dimension; "
                "pass (mesh, dim) or mesh[name]"
            )
        return spmd.MeshAxis.of(group.get_group(0))
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return spmd.MeshAxis.of(group[0].get_group(group[1]))
    if isinstance(group, str):
        from .._torch_compat import resolve_process_group

        return spmd.MeshAxis.of(resolve_process_group(group))  # type: ignore[arg-type]  # GroupName is a str NewType
    if isinstance(group, dist.ProcessGroup):
        return spmd.MeshAxis.of(group)
    raise ValueError(
        f"cannot type a collective over group {group!r} ({type(group).__name__}): "
        "inside a local_map region pass a mesh dimension, as (mesh, dim), "
        "mesh[name], its ProcessGroup or its group name"
    )


def _collective_axes(axis, local_type: dict) -> list | None:
    """The axes of ``local_type`` the collective runs over, or None.

    ``[axis]`` when the tensor is typed on it; the typed sub-axes when
    ``axis`` is their flattening (a collective over several mesh
    dimensions at once); None otherwise.
    """
    if axis in local_type:
        return [axis]
    candidates = [a for a in local_type if a < axis]
    if not candidates:
        return None
    try:
        from spmd_types._mesh_axis import flatten_axes

        flat = flatten_axes(tuple(candidates))
    except Exception:  # noqa: BLE001 - not orthogonal: not a flattening
        return None
    return candidates if flat == axis else None


# --- the checking mode -------------------------------------------------------


def _type_name(t) -> str:
    return {R: "R (Replicate)", I: "I (Invariant)", V: "V (Varying)", P: "P (Partial)"}.get(
        t, repr(t)
    )


def _fix_for(rule: CollectiveRule, t) -> str:
    """How to fix an input of type ``t`` that ``rule`` refuses."""
    sums = rule.output_type(P) is not None  # a linear reduction
    if t in (R, I):
        if sums:
            return (
                "The value is already the same on every rank (reduced): "
                f"reducing it again multiplies it by the axis size. Remove this "
                f"{rule.op}, or reduce the Partial/Varying value it was computed from."
            )
        if not rule.linear:
            return f"The value is already the same on every rank: {rule.text} of it is itself."
        return (
            "The value is already the same on every rank: gathering or "
            "exchanging it repeats it once per rank. Use it as it is, or pass "
            "the sharded (Varying) value."
        )
    if t is P:
        if not rule.linear:
            return (
                f"{rule.text} of partial sums is not that of their sum: reduce "
                "with a sum first (all_reduce -> R, or reduce_scatter -> V)."
            )
        return (
            f"{rule.op} of partial sums does not sum them: reduce first "
            "(all_reduce -> R, or reduce_scatter -> V)."
        )
    return ""


def _type_error(msg: str) -> spmd.SpmdTypeError:
    """An ``SpmdTypeError`` of these rules (marked: see spmd_check._as_eager_text)."""
    e = spmd.SpmdTypeError(msg)
    e.__dict__["_localmap_fx_rule"] = True
    return e


def _check_tensor(rule: CollectiveRule, x: torch.Tensor, axis, what: str) -> dict | None:
    """The output type of ``rule`` applied to ``x`` over ``axis`` (or raise)."""
    from spmd_types._state import is_strict
    from spmd_types.types import format_axis

    SpmdTypeError = _type_error
    if not spmd.has_local_type(x):
        if is_strict():
            raise SpmdTypeError(
                f"{what}: the input has no SPMD type. Derive it from the region's "
                "inputs, or annotate it with spmd.assert_type()."
            )
        return None
    local_type = dict(spmd.get_local_type(x))
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if needs_grad and rule.backward is None:
        raise SpmdTypeError(
            f"{what}: its input requires grad, but torch has no correct gradient "
            f"for {rule.text} (its backward raises or is not registered). Run it on "
            "a tensor that needs no gradient (x.detach(), torch.no_grad()), or "
            "use a differentiable collective (sum/avg all_reduce, all_gather, "
            "sum reduce_scatter, all_to_all_single)."
        )
    if axis.size() == 1:
        return local_type  # singleton axes carry no type
    axes = _collective_axes(axis, local_type)
    if axes is None:
        if is_strict():
            raise SpmdTypeError(
                f"{what}: the input has no SPMD type on the collective's axis "
                f"{format_axis(axis)} (its types: "
                f"{_fmt_type(local_type)}). Inside a local_map region run "
                "collectives over a dimension of the region's mesh: group=(mesh, "
                "dim), mesh[name], its ProcessGroup or group name."
            )
        return local_type
    out = dict(local_type)
    for ax in axes:
        t = local_type[ax]
        dst = rule.output_type(t)
        if dst is None:
            allowed = ", ".join(f"{s.name} -> {d.name}" for s, d in rule.accepts)
            raise SpmdTypeError(
                f"{what}: expected its input to be "
                f"{' or '.join(_type_name(s) for s, _ in rule.accepts)} on axis "
                f"{format_axis(ax)}, got {_type_name(local_type[ax])}. "
                f"{_fix_for(rule, t)}".rstrip()
                + f"\n(rule {rule.text}: {allowed}; backward: {rule.backward or 'none'})"
            )
        out[ax] = dst
    if not rule.linear:
        others = [a for a in local_type if a not in axes and local_type[a] is P]
        if others:
            raise SpmdTypeError(
                f"{what}: the input is Partial on axis "
                f"{', '.join(format_axis(a) for a in others)}; {rule.text} is not "
                "linear, so a partial sum cannot pass through it. Reduce it over "
                "that axis first."
            )
    return out


def _fmt_type(t: dict) -> str:
    from spmd_types.types import format_axis

    if not t:
        return "none"
    return "{" + ", ".join(f"{format_axis(a)}: {v.name}" for a, v in t.items()) + "}"


def _run_unchecked(func, args, kwargs):
    with spmd.no_typecheck():
        return func(*args, **kwargs)


def _stamp(out, local_type: dict | None) -> None:
    if isinstance(out, torch.Tensor) and local_type is not None:
        spmd.assert_type(out, local_type)


def _apply_collective(func, op: str, args: tuple, kwargs: dict, mode=None):
    tensor_arg, reduce_arg, group_arg = _ARGS[op]
    bound = schema_args(func, args, kwargs)
    reduce_op = bound.get(reduce_arg) if reduce_arg else None
    rule = rule_for(op, reduce_op)
    if rule is None:  # pragma: no cover - every op in _ARGS has rows
        raise AssertionError(f"no rule for {op}({reduce_op})")
    group = bound[group_arg]
    try:
        axis = axis_of_group(group)
    except ValueError as e:
        raise _type_error(f"{rule.text}: {e}") from None
    what = f"{rule.text} over axis {spmd.types.format_axis(axis)}"
    # Types are checked before the collective runs: a rejected call issues
    # no collective (the verdict is the same on every rank, so no rank waits
    # for it) and leaves no unwaited work behind.
    inputs = bound[tensor_arg]
    if isinstance(inputs, torch.Tensor):
        out_type = _check_tensor(rule, inputs, axis, what)
        result = _run_unchecked(func, args, kwargs)
        _stamp(result, out_type)
        outs = [result]
    else:
        types = [
            _check_tensor(rule, x, axis, f"{what}, tensor {i}")
            for i, x in enumerate(inputs)
        ]
        result = _run_unchecked(func, args, kwargs)
        for out, t in zip(result, types, strict=True):
            _stamp(out, t)
        outs = list(result)
    if mode is not None:
        mode.issued.extend(o for o in outs if isinstance(o, torch.Tensor))
    return result


def _apply_identity(func, args: tuple, kwargs: dict, mode=None):
    x = args[0] if args else next(iter(kwargs.values()))
    result = _run_unchecked(func, args, kwargs)
    if isinstance(x, torch.Tensor) and spmd.has_local_type(x):
        _stamp(result, dict(spmd.get_local_type(x)))
    return result


def _unknown(name: str):
    raise _type_error(
        f"{name}: no SPMD typing rule for this functional collective. Typed "
        f"collectives: {', '.join(sorted({r.op for r in RULES}))}. Use one of "
        "them, or spmd_types' own collectives (spmd.all_reduce(x, axis, src=, dst=), ...)."
    )


@functools.lru_cache(maxsize=None)
def _handler(func):
    """What to do with ``func``: None (not ours), or a callable(func, args, kwargs)."""
    name = funcol_op(func)
    if name is None:
        return None
    ns, op = name
    if op in _IDENTITY_OPS:
        return _apply_identity
    if op in _ARGS:
        return functools.partial(_dispatch_collective, op)
    return functools.partial(_dispatch_unknown, f"{ns}.{op}")


def _dispatch_collective(op, func, args, kwargs, mode=None):
    return _apply_collective(func, op, args, kwargs, mode)


def _dispatch_unknown(name, func, args, kwargs, mode=None):
    _unknown(name)


class _FuncolRules(torch.overrides.TorchFunctionMode):
    """Types functional collectives; see Note: [Why a rule table of our own].

    When the checked code raises (a rejected body), the collectives it issued
    are waited for on the way out: their results are dropped with the
    exception, and unwaited work stays registered until the process exits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.issued: list = []  # collective results of the checked code

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None:
                _wait_issued(self.issued)
        finally:
            self.issued = []
        return super().__exit__(exc_type, exc, tb)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            handler = _handler(func)
        except TypeError:  # unhashable callable: not an op of ours
            handler = None
        if handler is None or not spmd.is_type_checking():
            return _next_mode(func, args, kwargs)
        return handler(func, args, kwargs, self)


def _wait_issued(results: list) -> None:
    wait = torch.ops._c10d_functional.wait_tensor
    with DisableTorchFunction():
        for t in results:
            if not isinstance(t, FakeTensor):
                try:
                    wait(t)
                except Exception:  # noqa: BLE001 - already waited or freed: nothing pending
                    pass


def _next_mode(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` as the mode below this one would get it.

    Note: [Calls that do not re-dispatch]
        Torch pops a mode off the stack while its ``__torch_function__``
        runs, so calling ``func`` from here normally reaches the next mode
        (spmd_types' checker) because ``func`` checks for torch-function
        overrides again.  Not every ``func`` does: for
        ``torch.autograd.Function.apply``, spmd_types routes the call through
        ``handle_torch_function`` itself and hands modes the *original*
        ``apply``, which runs the Function without asking any mode.  Calling
        it would skip spmd_types' rules for Functions
        (``register_local_autograd_function``, ``typecheck_forward``,
        ``spmd_typecheck``, unregistered Functions under strict checking).
        So every call that is not ours is dispatched to the next mode exactly
        as torch would have dispatched it had this mode not been there.
    """
    if is_torch_function_mode_enabled():
        return torch.overrides.handle_torch_function(func, _tensor_leaves(args, kwargs), *args, **kwargs)
    return func(*args, **kwargs)


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})


def _tensor_leaves(args: tuple, kwargs: dict) -> tuple:
    """The tensors among the pytree leaves of ``(args, kwargs)``, in leaf order.

    Most ops are called with tensors and scalars only: those are read
    directly; anything else (a list of sizes, a dict) goes through pytree.
    """
    if not kwargs:
        found = []
        for a in args:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif type(a) not in _SCALARS:
                break
        else:
            return tuple(found)
    return tuple(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))


def rules() -> torch.overrides.TorchFunctionMode:
    """A mode that types functional collectives; enter it inside ``typecheck()``."""
    return _FuncolRules()


# --- documentation -------------------------------------------------------------


def rules_table_markdown(rows: Iterable[CollectiveRule] = RULES) -> str:
    """:data:`RULES` as the markdown table in ``docs/user-guide.md``."""
    lines = [
        "| op | input -> output (collective axis) | backward (torch 2.14.1) | other axes |",
        "|---|---|---|---|",
    ]
    for r in rows:
        pairs = ", ".join(f"{s.name} -> {d.name}" for s, d in r.accepts)
        bw = r.backward or "none: inputs must not require grad"
        other = "unchanged" if r.linear else "unchanged, P rejected"
        lines.append(f"| `{r.text}` | {pairs} | {bw} | {other} |")
    return "\n".join(lines)
