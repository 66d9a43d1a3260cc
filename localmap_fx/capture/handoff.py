"""Dynamo-time state of capture: values handed from ``comptime`` back to the trace.

Capture decides some things in real Python while Dynamo traces
(:mod:`.plan`: a call's checks and plan; :mod:`.reuse`: whether a repeated
body is shared) and hands the result to the traced code.  Both use the one
slot here, and both read the traced frame's variables with :func:`local_vt`.

Note: [Handing a value from comptime back to the trace]
    A ``comptime`` function runs in real Python with the traced frame's
    variables but cannot return into the trace.  It puts its result in a
    one-entry slot (:func:`put`) that the very next traced statement takes
    through an ``assume_constant_result`` function (:func:`taken`), so the
    value enters the graph's Python as a constant.  Nothing runs in between,
    and a restarted trace reruns the comptime first, so the slot is never
    stale.  One slot serves every thread: Dynamo traces one frame at a time
    in a process (``torch._dynamo.convert_frame.compile_lock``, held around
    every trace), so no two traces ever share it at once.  An error found in
    comptime is handed over the same way
    (:class:`Raise`) and raised by :func:`taken`, with the type and text
    eager raises.
"""

from __future__ import annotations

from typing import Any

from .._torch_compat import assume_constant_result

__all__ = ["Raise", "put", "taken", "local_vt", "realized"]

_SLOT: list = []


class Raise:
    """An error for :func:`taken` to raise in the trace."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def put(value: Any) -> None:
    """Hand ``value`` (or a :class:`Raise`) to the next :func:`taken`."""
    _SLOT[:] = [value]


@assume_constant_result
def taken() -> Any:
    """The value the last comptime function put in the slot (see the Note)."""
    value = _SLOT.pop() if _SLOT else None
    if isinstance(value, Raise):
        raise value.error
    return value


def realized(vt):
    """A lazily built VariableTracker, built."""
    return vt.realize() if hasattr(vt, "realize") else vt


def local_vt(ctx, name: str):
    """The VariableTracker of the traced frame's local ``name`` (in comptime)."""
    return realized(ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker())
