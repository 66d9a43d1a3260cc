"""Checks shared by the eager fallback and the compiled path.

Every check here reproduces the exception type and text that torch 2.14.1's
``local_map`` raises for the same call, and attaches a hint that says how to
fix the call as an exception note (PEP 678).  The eager fallback (:mod:`localmap_fx.eager`) and capture
(:mod:`localmap_fx.capture.call`) both call these functions, so a bad call fails the
same way whether or not it runs under ``torch.compile``.

Note: [Why errors keep torch's wording]
    Users migrate from ``torch.distributed.tensor.experimental.local_map``; code
    and tests that match on torch's messages (``assertExpectedRaisesInline``
    compares ``str(e)`` exactly) must keep working.  So ``str(e)`` is
    torch's text byte for byte and our hint is a note (``e.add_note``),
    which every traceback prints under the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from . import argtree

__all__ = [
    "describe",
    "as_placements",
    "normalize_out_specs",
    "check_in_count",
    "check_dtensor_in_spec",
    "check_dtensor_grad_spec",
    "check_non_tensor_input",
    "check_spmd_types_available",
    "check_out_count",
    "check_output_value",
    "PlacementProblem",
    "placement_problem",
]


def as_placements(spec: Any) -> tuple[Placement, ...] | None:
    """A placements spec as torch compares it: a tuple, or None."""
    if spec is None or isinstance(spec, tuple):
        return spec
    return tuple(spec)


def normalize_out_specs(out_placements: Any) -> tuple:
    """out_placements as torch reads it: a tuple means one spec per output."""
    if isinstance(out_placements, tuple):
        return out_placements
    return (out_placements,)


def check_in_count(in_placements: Sequence | None, n_flat: int) -> None:
    if in_placements is not None and len(in_placements) != n_flat:
        raise with_hint(AssertionError(
            f"in_placements length {len(in_placements)} does not match the number "
            f"of input args {n_flat}!"
            ), "Give one entry per flattened positional argument "
            "(pytree leaves of args, in order), with None for non-tensor "
            "arguments."
        )


class PlacementsIndexError(ValueError, IndexError):
    """A placements argument with the wrong number of entries.

    A ``ValueError`` (bad argument) that is also the ``IndexError`` torch's
    ``local_map`` raises for it, so code catching torch's type still works.
    """


class PlacementsTypeError(ValueError, TypeError):
    """A placements entry of the wrong type (also torch's ``TypeError``)."""


def check_grad_count(in_grad_placements: Sequence | None, n_flat: int) -> None:
    """in_grad_placements needs one entry per flattened argument, like in_placements."""
    if in_grad_placements is None or len(in_grad_placements) == n_flat:
        return
    n = len(in_grad_placements)
    torch_text = "tuple index out of range: " if n < n_flat else ""
    raise with_hint(PlacementsIndexError(
        f"{torch_text}in_grad_placements has {n} entr{'y' if n == 1 else 'ies'} but the "
        f"function gets {n_flat} flattened argument{'s' if n_flat != 1 else ''}."
        ), "Give in_grad_placements one entry per flattened "
        f"positional argument ({n_flat}, in the order of in_placements), with None "
        "for non-tensor arguments; or pass in_grad_placements=None."
    )


def _mesh_ndim_of(arg: Any) -> int | None:
    n = getattr(arg, "mesh_ndim", None)
    if n is None and isinstance(arg, DTensor):
        n = arg.device_mesh.ndim
    return n


def check_dtensor_in_spec(
    arg: DTensor | Described, idx: int, spec: Any, redistribute_inputs: bool
) -> bool:
    """Check a DTensor argument against its in_placements entry.

    Returns True when the argument must be redistributed first.
    """
    if spec is None:
        raise with_hint(AssertionError(
            f"DTensor input {arg} expects placements but received {spec}!"
            ), f"in_placements[{idx}] is None but args leaf {idx} "
            "is a DTensor: give its placements, e.g. (Shard(0),)."
        )
    spec = _as_placements_for(spec, f"in_placements[{idx}]")
    if arg.placements != spec:
        if redistribute_inputs:
            return True
        mismatch = (
            f"arg {arg} in local_map has a mismatched placements: "
            f"arg placements is {arg.placements} but the input "
            f"placements is {spec}! "
            "If redistribute_inputs is wanted, set "
            "redistribute_inputs=True to local_map."
        )
        mesh_ndim = _mesh_ndim_of(arg)
        problem = None if mesh_ndim is None else placement_problem(spec, mesh_ndim)
        if problem is not None and problem.kind == TOO_MANY:
            # The real cause in the note: no redistribution can reach these.
            raise with_hint(
                ValueError(mismatch),
                f"in_placements[{idx}] = {spec} has {len(spec)} placements but the "
                f"argument's device mesh has {mesh_ndim} dimension"
                f"{'s' if mesh_ndim != 1 else ''}: give in_placements[{idx}] one Placement "
                f"per mesh dimension ({mesh_ndim}), or pass the DTensor on the mesh that "
                "in_placements describes.",
            )
        raise with_hint(ValueError(
            f"{mismatch}"
            ), f"in_placements[{idx}] = {spec} but the argument "
            f"is placed {arg.placements}."
        )
    return False


def same_mesh(a: Any, b: Any) -> bool:
    """Whether DTensors on ``a`` may enter a region on ``b``: the same mesh, or
    one of the same shape over the same ranks (rebuilt, or another object)."""
    return a is b or (tuple(a.shape) == tuple(b.shape) and torch.equal(a.mesh, b.mesh))


def check_arg_mesh(arg_mesh: Any, device_mesh: Any, idx: int) -> None:
    """A DTensor argument must live on ``device_mesh`` (see :func:`same_mesh`).

    Torch's ``local_map`` unwraps it anyway and wraps the outputs on
    ``device_mesh``, so shards of one mesh would be read as shards of another
    (a documented deviation: docs/user-guide.md, calls torch accepts silently).
    """
    if same_mesh(arg_mesh, device_mesh):
        return
    raise with_hint(
        ValueError(
            f"args leaf {idx} is a DTensor on {mesh_text(arg_mesh)} (ranks "
            f"{arg_mesh.mesh.tolist()}) but local_map's device_mesh is {mesh_text(device_mesh)} "
            f"(ranks {device_mesh.mesh.tolist()})."
        ),
        "pass the argument on device_mesh, or give device_mesh the argument's mesh: "
        "its shards would be read as shards of a mesh of another shape or other ranks.",
    )


def check_dtensor_grad_spec(arg: DTensor | Described, idx: int, spec: Any) -> tuple:
    if spec is None:
        raise with_hint(AssertionError(
            f"DTensor input {arg} expects in grad placements but received {spec}!"
            ), f"in_grad_placements[{idx}] is None for a DTensor "
            "argument: give the placements its gradient should have."
        )
    placements = _as_placements_for(spec, f"in_grad_placements[{idx}]")
    if placements is None:
        raise AssertionError(f"in_grad_placements[{idx}] normalised to None")
    return placements


def _as_placements_for(spec: Any, where: str) -> tuple | None:
    try:
        return as_placements(spec)
    except TypeError as e:
        raise with_hint(PlacementsTypeError(
            f"{e}"), f"{where} = {spec!r} must be a list of placements "
            f"(one per mesh dimension), e.g. [{spec!r}]."
        ) from None


def _type_name(x: Any) -> str:
    if type(x).__name__ == "Described":
        if x.kind == "value":
            return type(x.value).__name__
        return str(x.value)
    return type(x).__name__


def check_non_tensor_input(arg: Any, idx: int, spec: Any) -> None:
    if spec is not None:
        raise with_hint(AssertionError(
            f"Non-Tensor input {arg} expects None placements "
            f"but received {spec}!"
            ), f"set in_placements[{idx}] to None for this "
            f"{_type_name(arg)} argument."
        )


def check_spmd_types_available() -> None:
    """spmd_types=True with a DTensor argument needs the spmd_types package."""
    from ._torch_compat import is_spmd_types_available

    if not is_spmd_types_available():
        raise with_hint(RuntimeError(
            "spmd_types=True requires the spmd_types package to be installed"
            ), "install it (pip install spmd-types==0.3.1) or call "
            "local_map with spmd_types=False."
        )


def check_out_count(n_flat_out: int, out_specs: tuple) -> None:
    if n_flat_out != len(out_specs):
        raise with_hint(AssertionError(
            "local_map requires one PlacementType be provided for each output value,"
            f" received {len(out_specs)} out_placements but"
            f" {n_flat_out} is expected!"
            ), "give out_placements as a tuple with one entry per "
            "flattened output (None for non-tensor outputs)."
        )


def check_output_value(out: Any, idx: int, spec: Any) -> None:
    """Check one flattened output of the body against out_placements[idx]."""
    if isinstance(out, torch.Tensor):
        if isinstance(out, DTensor):
            raise with_hint(AssertionError(
                f"torch.Tensor output expected but received {type(out)}: {out}"
                ), f"output {idx} of the body is a DTensor; a "
                "local_map body works on local tensors: return "
                "out.to_local() or move the DTensor op outside the region."
            )
    elif spec is not None:
        raise with_hint(AssertionError(
            f"Non-tensor output {out} expects None placements but received {spec}!"
            ), f"set out_placements[{idx}] to None for this "
            f"{_type_name(out)} output."
        )


# --- Does a placements spec fit the mesh and the tensor? ---------------------
#
# Note: [One placement check, each caller's exception]
#     Four places ask whether a spec fits: a DTensor argument's
#     in_placements (too long for its mesh), a redistribution target,
#     in_grad_placements, out_placements.  :func:`placement_problem` answers
#     for all of them, in one order (not a sequence, an entry that is not a
#     Placement, the wrong length, a Shard dim outside the tensor); each
#     caller turns the problem into the exception torch raises at that point
#     (``DTensor.redistribute``, ``DTensor.from_local``) with torch's text, or,
#     where torch is silent, into a ValueError of ours.  Our own errors list
#     every offending argument (as JAX's shard_map does); where torch raises
#     on the first with its own text, so do we.

NOT_SEQUENCE = "not a sequence"
NOT_PLACEMENT = "not a Placement"
TOO_FEW = "too few"
TOO_MANY = "too many"
SHARD_DIM = "Shard dim out of range"


@dataclasses.dataclass(frozen=True)
class PlacementProblem:
    """The first way a placements spec does not fit (:func:`placement_problem`)."""

    kind: str  # one of the constants above
    text: str  # how our own messages say it, after "<where> = <spec> "
    entry: Any = None  # the offending entry (NOT_PLACEMENT, SHARD_DIM)
    position: int = -1  # its index in the spec


def placement_problem(spec: Any, mesh_ndim: int, ndim: int | None = None) -> PlacementProblem | None:
    """What is wrong with ``spec`` as placements on a ``mesh_ndim``-d mesh of a
    tensor with ``ndim`` dims (None: do not check Shard dims), or None."""
    if not isinstance(spec, (list, tuple)):
        return PlacementProblem(NOT_SEQUENCE, f"is {spec!r}, not a sequence of placements")
    for i, p in enumerate(spec):
        if not isinstance(p, Placement):
            return PlacementProblem(
                NOT_PLACEMENT,
                f"contains {p!r}, which is not a Placement (use Shard(d), Replicate() or Partial())",
                p,
                i,
            )
    if len(spec) != mesh_ndim:
        return PlacementProblem(
            TOO_FEW if len(spec) < mesh_ndim else TOO_MANY,
            f"has {len(spec)} placements but the device mesh has {mesh_ndim} "
            f"dimension{'s' if mesh_ndim != 1 else ''}: give one Placement per mesh dimension",
        )
    if ndim is not None:
        for i, p in enumerate(spec):
            if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                return PlacementProblem(
                    SHARD_DIM, f"shards dimension {p.dim} of a {ndim}-d tensor: use a dim in [{-ndim}, {ndim})", p, i
                )
    return None


def _offenders(first: tuple, later: Iterable[tuple], problem_of) -> list[tuple]:
    """``first`` and every entry of ``later`` (only read when there is an
    offender) for which ``problem_of(entry)`` is not None, as ``(entry, problem)``."""
    found = [first]
    for entry in later:
        problem = problem_of(entry)
        if problem is not None:
            found.append((entry, problem))
    return found


# --- Checks on descriptions of values (the compiled path) ---------------------
#
# Note: [Checking under torch.compile]
#     A ``raise`` in code Dynamo traces reaches the user as
#     ``Unsupported: Observed exception`` when ``fullgraph=True``.  Capture
#     therefore describes each argument with constants (``describe``) and runs
#     the checks below in real Python through
#     ``torch._dynamo.assume_constant_result``; a failure is re-raised as a
#     subclass of the eager exception type that Dynamo passes through
#     unchanged (:func:`localmap_fx.errors.compile_time`).  The checks are the
#     eager ones, applied to descriptions instead of values.


@dataclasses.dataclass(repr=False, eq=False)
class Described:
    """Stands for an argument or output in messages raised at compile time."""

    kind: str
    placements: Any = None
    ndim: int | None = None
    value: Any = None
    mesh_ndim: int | None = None
    mesh: str | None = None

    def __str__(self) -> str:
        if self.kind == "dtensor":
            mesh = "" if self.mesh is None else f", device_mesh={self.mesh}"
            return f"DTensor(ndim={self.ndim}, placements={self.placements}{mesh})"
        if self.kind == "tensor":
            return f"Tensor(ndim={self.ndim})"
        if self.kind == "value":
            return str(self.value)
        if self.kind == "number":
            return f"<{self.value}>"
        return f"<{self.value} object>"

    __repr__ = __str__


def mesh_text(mesh: Any) -> str:
    """``DeviceMesh((dp=2, tp=2), 'cpu')``: a mesh as messages name it."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n}={k}" for n, k in zip(names, mesh.shape))
    return f"DeviceMesh(({dims}), {mesh.device_type!r})"


def describe(x: Any) -> tuple:
    """A constant description of ``x``, made in real Python (eager, or capture's
    comptime planner); DTensors name their mesh, as eager messages do."""
    if isinstance(x, DTensor):
        return ("dtensor", x.placements, x.ndim, len(x.placements), mesh_text(x.device_mesh))
    if isinstance(x, torch.Tensor):
        return ("tensor", x.ndim)
    if isinstance(x, (int, float, bool, str, type(None))):
        return ("value", x)
    return ("object", type(x).__name__)


def describe_traced(x: Any) -> tuple:
    """:func:`describe` for code Dynamo traces: numbers without their value.

    An ``int``, ``float`` or ``bool`` there may be symbolic (a size under a
    dynamic shape, a ``.tolist()`` item), which ``assume_constant_result``
    cannot take as an argument, and Dynamo reports a ``SymInt`` as an
    ``int`` to ``isinstance``/``type``, so no traced test tells the two
    apart.  The checks only need the kind; messages name the type instead.
    A DTensor's mesh is not named either: Dynamo cannot build that string.
    """
    if isinstance(x, DTensor):
        return ("dtensor", x.placements, x.ndim, len(x.placements), None)
    if isinstance(x, torch.Tensor) or type(x) in (str, type(None)):
        return describe(x)
    if isinstance(x, (int, float, bool)):
        return ("number", type(x).__name__)
    return describe(x)


def described(desc: tuple) -> Described:
    """A :class:`Described` from a :func:`describe` tuple."""
    kind = desc[0]
    if kind == "dtensor":
        return Described("dtensor", tuple(desc[1]), desc[2], mesh_ndim=desc[3], mesh=desc[4])
    if kind == "tensor":
        return Described("tensor", ndim=desc[1])
    return Described(kind, value=desc[1])


def plan_inputs(
    descs: tuple,
    in_placements: Any,
    in_grad_placements: Any,
    redistribute_inputs: bool,
    labels: tuple | None = None,
) -> tuple:
    """Check every flattened argument; return what to do with each.

    One entry per leaf: ``None`` (pass through) or ``(redistribute_to, grad)``
    for a DTensor, where ``redistribute_to`` is None when no redistribution
    is needed and ``grad`` is the ``to_local`` grad placements (or None).
    """
    check_in_count(in_placements, len(descs))
    check_grad_count(in_grad_placements, len(descs))
    plan = []
    for idx in range(len(descs)):
        try:
            plan.append(_plan_leaf(idx, descs, in_placements, in_grad_placements, redistribute_inputs))
        except Exception as e:
            if labels is None:
                raise
            raise with_hint(e, f"flattened leaf {idx} is {labels[idx]}.") from None
    return tuple(plan)


def plan_nested_inputs(
    descs: tuple,
    paths: tuple,
    in_placements: Any,
    in_grad_placements: Any,
    redistribute_inputs: bool,
    param_names: tuple | None,
) -> tuple:
    """:func:`plan_inputs` for in_placements that mirror the arguments (see argtree).

    Returns ``(plan, flat in_placements, flat in_grad_placements)``.
    """
    specs = argtree.resolve(in_placements, list(paths), param_names)
    grads = in_grad_placements
    if grads is not None and (isinstance(grads, dict) or len(grads) != len(descs)):
        grads = argtree.resolve(grads, list(paths), param_names)
    labels = tuple(argtree.path_str(p) for p in paths)
    plan = plan_inputs(descs, specs, grads, redistribute_inputs, labels)
    return plan, specs, grads


def _later_dtensors(descs: tuple, specs: Any, idx: int) -> Iterable[tuple]:
    """``(index, spec, mesh ndim, ndim)`` of the DTensor arguments after ``idx``."""
    for j in range(idx + 1, len(descs)):
        arg = described(descs[j])
        if arg.kind == "dtensor" and arg.mesh_ndim is not None and arg.ndim is not None:
            yield j, specs[j], arg.mesh_ndim, arg.ndim


def _plan_leaf(idx, descs, in_placements, in_grad_placements, redistribute_inputs):
    """What to do with one flattened argument (see plan_inputs); raises if bad."""
    arg = described(descs[idx])
    if arg.kind == "dtensor":
        mesh_ndim, ndim = arg.mesh_ndim, arg.ndim
        if mesh_ndim is None or ndim is None:
            raise AssertionError(f"the description of DTensor argument {idx} lacks its ndim")
        target = None
        if in_placements is not None:
            spec = in_placements[idx]
            if check_dtensor_in_spec(arg, idx, spec, redistribute_inputs):
                check_redistribute_target(
                    spec, idx, mesh_ndim, ndim, _later_dtensors(descs, in_placements, idx)
                )
                target = as_placements(spec)
        grad = None
        if in_grad_placements is not None:
            grad = check_dtensor_grad_spec(arg, idx, in_grad_placements[idx])
            check_grad_spec_fits(grad, idx, mesh_ndim, ndim, _later_dtensors(descs, in_grad_placements, idx))
        return (target, grad)
    if in_placements is not None and arg.kind != "tensor":
        check_non_tensor_input(arg, idx, in_placements[idx])
    return None


def check_outputs(descs: tuple, out_specs: tuple, mesh_ndim: int) -> bool:
    """Check the body's flattened outputs against out_placements."""
    check_out_count(len(descs), out_specs)
    outs = [described(desc) for desc in descs]
    for idx, (out, spec) in enumerate(zip(outs, out_specs)):
        if out.kind == "tensor" and out.ndim is not None:
            later = (
                (j, out_specs[j])
                for j, o in enumerate(outs)
                if j > idx and o.kind == "tensor" and o.ndim is not None
            )
            check_out_spec_fits(spec, idx, mesh_ndim, later)
            check_from_local_spec(spec, idx, mesh_ndim, out.ndim)
        if out.kind == "dtensor":
            raise with_hint(AssertionError(
                f"torch.Tensor output expected but received {DTensor}: {out}"
                ), f"output {idx} of the body is a DTensor; a "
                "local_map body works on local tensors: return "
                "out.to_local() or move the DTensor op outside the region."
            )
        if out.kind != "tensor" and spec is not None:
            check_output_value(out, idx, spec)
    return True


def check_from_local_spec(spec: Any, idx: int, mesh_ndim: int, ndim: int) -> None:
    """What ``DTensor.from_local`` would reject, with torch's type and text
    (run after :func:`check_out_spec_fits`, which takes a wrong length)."""
    problem = placement_problem(spec, mesh_ndim, ndim)
    if problem is None or problem.kind in (TOO_FEW, TOO_MANY):
        return
    hint = f"out_placements[{idx}] = {spec!r}: give one Placement per mesh dimension."
    if problem.kind == NOT_SEQUENCE:
        raise with_hint(TypeError(f"'{type(spec).__name__}' object is not iterable"), hint)
    if problem.kind == NOT_PLACEMENT:
        raise with_hint(RuntimeError(f"{problem.entry!r} is not a Placement"), hint)
    raise with_hint(
        RuntimeError(
            f"Sharding dim {problem.entry.dim} greater than tensor ndim {ndim} for placement number {problem.position}"
        ),
        f"out_placements[{idx}] shards dimension {problem.entry.dim} of a {ndim}-d output.",
    )


# --- Checks torch 2.14.1 does not make -----------------------------------------
#
# Note: [Silent cases]
#     For these calls torch's local_map returns a malformed DTensor, or fails
#     only later in backward with an unrelated IndexError.  We raise at the
#     call, naming the argument and the fix.  They are the documented
#     deviations from torch (docs/user-guide.md, "Troubleshooting"); the
#     parity tests exclude exactly these cases.


class ShardDimError(IndexError, AssertionError):
    """A Shard dim outside the tensor (torch raises either type for it)."""


def _redistribute_hint(spec: Any, idx: int, mesh_ndim: int) -> str:
    return (
        f"in_placements[{idx}] = {spec!r}: redistribute_inputs=True moves args "
        f"leaf {idx} to these placements; give one Placement per mesh dimension "
        f"({mesh_ndim})."
    )


def _too_long_target(entry: tuple) -> PlacementProblem | None:
    j, spec, mesh_ndim = entry[:3]
    if not isinstance(spec, (list, tuple)):
        return None  # raises at its own turn, with torch's text
    problem = placement_problem(spec, mesh_ndim)
    return problem if problem is not None and problem.kind == TOO_MANY else None


def _raise_too_long_targets(spec: Any, idx: int, mesh_ndim: int, later: Iterable[tuple]) -> None:
    """The ValueError for in_placements longer than the mesh, which torch
    accepts silently: every such later DTensor argument is listed too."""
    found = _offenders(((idx, spec, mesh_ndim), None), later, _too_long_target)
    text = "\n".join(
        f"in_placements[{j}] = {s!r} has {len(s)} placements but the "
        f"device mesh has {m} dimension{'s' if m != 1 else ''}."
        for (j, s, m, *_), _ in found
    )
    raise with_hint(ValueError(text), _redistribute_hint(spec, idx, mesh_ndim))


def check_redistribute_target_length(
    spec: Any, idx: int, mesh_ndim: int, later: Iterable[tuple] = ()
) -> None:
    """Eager, before ``DTensor.redistribute``: in_placements[idx] longer than
    the mesh, which torch accepts silently, is a ValueError.  Every other bad
    target makes ``redistribute`` itself raise, with its own text.  ``later``:
    ``(index, spec, mesh ndim, ...)`` of the later DTensor arguments to be
    redistributed, listed too when they are as long."""
    problem = placement_problem(spec, mesh_ndim)
    if problem is not None and problem.kind == TOO_MANY:
        _raise_too_long_targets(spec, idx, mesh_ndim, later)


def check_redistribute_target(
    spec: Any, idx: int, mesh_ndim: int, ndim: int, later: Iterable[tuple] = ()
) -> None:
    """Compiled path: in_placements[idx] must be a valid target before
    redistributing to it.

    Where ``DTensor.redistribute`` itself would fail, the error has its type
    (and text); a spec longer than the mesh, which torch accepts silently,
    is a ValueError (see :func:`check_redistribute_target_length`).
    """
    problem = placement_problem(spec, mesh_ndim, ndim)
    if problem is None:
        return
    hint = _redistribute_hint(spec, idx, mesh_ndim)
    if problem.kind == NOT_SEQUENCE:
        raise with_hint(TypeError(f"'{type(spec).__name__}' object is not iterable"), hint)
    if problem.kind == NOT_PLACEMENT:
        raise with_hint(
            AttributeError(f"'{type(problem.entry).__name__}' object has no attribute 'is_partial'"), hint
        )
    if problem.kind == TOO_FEW:
        raise with_hint(IndexError("tuple index out of range"), hint)
    if problem.kind == TOO_MANY:
        _raise_too_long_targets(spec, idx, mesh_ndim, later)
    # DTensor.redistribute fails with IndexError or AssertionError
    # depending on the source placements; this error is both.
    dim = problem.entry.dim
    raise with_hint(
        ShardDimError(f"Sharding dim {dim} out of range for a {ndim}-d tensor"),
        f"{hint} Shard({dim}) on a {ndim}-d tensor.",
    )


def _spec_text(spec: Any) -> str:
    """A spec as the first offender's is printed (checked specs are tuples)."""
    return repr(tuple(spec) if isinstance(spec, list) else spec)


def _grad_problem(entry: tuple) -> PlacementProblem | None:
    _, spec, mesh_ndim, ndim = entry
    if not isinstance(spec, (list, tuple)):
        return None  # raises at its own turn, with torch's text
    return placement_problem(spec, mesh_ndim, ndim)


def check_grad_spec_fits(
    spec: Any, idx: int, mesh_ndim: int, ndim: int, later: Iterable[tuple] = ()
) -> None:
    """in_grad_placements[idx] must describe a gradient of args leaf ``idx``.

    ``later``: ``(index, grad spec, mesh ndim, ndim)`` of the later DTensor
    arguments, read only when this one fails: the error lists every offender.
    """
    problem = placement_problem(spec, mesh_ndim, ndim)
    if problem is not None:
        found = _offenders(((idx, spec, mesh_ndim, ndim), problem), later, _grad_problem)
        text = "\n".join(f"in_grad_placements[{j}] = {_spec_text(s)} {p.text}." for (j, s, *_), p in found)
        raise with_hint(ValueError(text), "torch would only fail later, in backward.")


def _out_problem(mesh_ndim: int):
    def problem_of(entry: tuple) -> tuple[str, str] | None:
        j, spec = entry
        if spec is None:
            return (
                f"out_placements[{j}] is None but output {j} of the body is a Tensor.",
                "give its placements, e.g. [Shard(0)]; None "
                "is for non-tensor outputs (torch would silently treat it as "
                "Replicate).",
            )
        problem = placement_problem(spec, mesh_ndim) if isinstance(spec, (list, tuple)) else None
        if problem is not None and problem.kind in (TOO_FEW, TOO_MANY):
            return (
                f"out_placements[{j}] = {spec!r} has {len(spec)} placements but "
                f"the device mesh has {mesh_ndim} dimensions.",
                "give one Placement per mesh dimension.",
            )
        return None

    return problem_of


def check_out_spec_fits(spec: Any, idx: int, mesh_ndim: int, later: Iterable[tuple] = ()) -> None:
    """out_placements[idx] must give a tensor output one placement per mesh
    dimension (and not be None); Shard dims are checked by
    :func:`check_from_local_spec`.

    ``later``: ``(index, spec)`` of the later tensor outputs, read only
    when this one fails: the error lists every offender.
    """
    problem_of = _out_problem(mesh_ndim)
    problem = problem_of((idx, spec))
    if problem is not None:
        found = _offenders(((idx, spec), problem), later, problem_of)
        exc: BaseException = ValueError("\n".join(text for _, (text, _) in found))
        for hint in dict.fromkeys(hint for _, (_, hint) in found):
            exc = with_hint(exc, hint)
        raise exc


def with_hint(exc: BaseException, hint: str) -> BaseException:
    """``exc`` with ``[localmap_fx] hint`` attached as a PEP 678 note.

    ``str(exc)`` is left as it is (torch's text); every traceback prints the
    note under it.
    """
    exc.add_note(f"[localmap_fx] {hint}")
    return exc
