"""Errors raised while compiling a region.

A backend's exceptions normally reach the user wrapped in Dynamo's
``BackendCompilerFailed``.  A region error must instead keep the exception
type eager raises (``ValueError`` for a mistyped body, say), so the error we
raise at compile time is an instance of a subclass of *both* the eager type
and Dynamo's ``ShortenTraceback`` (which Dynamo re-raises untouched).

These errors only arise while compiling, so Dynamo is imported here on first
use, never when localmap_fx is imported (see benchmarks/startup.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._dynamo.exc import ShortenTraceback

__all__ = ["region_error", "compile_time"]


def _shorten_traceback() -> type[ShortenTraceback]:
    from torch._dynamo.exc import ShortenTraceback

    return ShortenTraceback


_ERROR_TYPES: dict[type[BaseException], type[BaseException]] = {}


def _compile_error_type(base: type[BaseException]) -> type[BaseException]:
    """``Region<base>``, a subclass of ``base`` and ShortenTraceback (made once per base)."""
    cls = _ERROR_TYPES.get(base)
    if cls is None:
        try:
            # The message is the eager str() plus the call site: a base type's own
            # __str__ (SpmdTypeError appends its ``context``) must not redo it.
            ns = {"__module__": __name__, "__str__": BaseException.__str__}
            cls = type(f"Region{base.__name__}", (base, _shorten_traceback()), ns)
        except TypeError:
            # Layout conflict with an exotic exception type: keep the base type.
            cls = base
        _ERROR_TYPES[base] = cls
    return cls


def _bare(cls: type[ShortenTraceback], *args: object) -> ShortenTraceback:
    """An instance of ``cls`` with ``args``, without running the eager type's __init__."""
    err = cls.__new__(cls)
    BaseException.__init__(err, *args)
    err.first_useful_frame = None
    return err


def region_error(exc: BaseException, where: str) -> BaseException:
    """``exc`` re-created with ``where`` (the region's call site) appended."""
    msg = f"{exc}\n[localmap_fx] in {where}"
    cls = _compile_error_type(type(exc))
    try:
        if issubclass(cls, _shorten_traceback()):
            err = _bare(cls, msg)
            err.__dict__.update(getattr(exc, "__dict__", {}))  # e.g. SpmdTypeError.context
            err.first_useful_frame = None
            return err
        return cls(msg)
    except Exception:
        exc.add_note(f"[localmap_fx] in {where}")
        return exc


def compile_time(exc: BaseException) -> BaseException:
    """``exc`` as raised at compile time: same type and text, passed through by Dynamo."""
    cls = _compile_error_type(type(exc))
    if not issubclass(cls, _shorten_traceback()):
        return exc
    return _bare(cls, *exc.args)
