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
    from ._torch_compat import ShortenTraceback

__all__ = ["region_error", "compile_time"]


def _shorten_traceback() -> type[ShortenTraceback]:
    from ._torch_compat import ShortenTraceback

    return ShortenTraceback


_ERROR_TYPES: dict[type[BaseException], type[BaseException]] = {}


def _compile_error_type(base: type[BaseException]) -> type[BaseException]:
    """``Region<base>``, a subclass of ``base`` and ShortenTraceback (made once per base)."""
    cls = _ERROR_TYPES.get(base)
    if cls is None:
        try:
            # The message is the eager str() (made once, in region_error): a
            # base type's own __str__ (SpmdTypeError appends its ``context``)
            # must not redo it.
            ns = {"__module__": __name__, "__str__": BaseException.__str__}
            shorten = _shorten_traceback()
            # RuntimeError is already a base of Dynamo's exceptions
            bases = (shorten,) if issubclass(shorten, base) else (base, shorten)
            cls = type(f"Region{base.__name__}", bases, ns)
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


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", ()))


def region_error(exc: BaseException, where: str) -> BaseException:
    """``exc`` as raised at compile time, with a note naming the region's call site.

    ``str()`` stays the eager text (Note: [Why errors keep torch's wording]
    in :mod:`localmap_fx.validate`); the call site is a PEP 678 note.
    """
    cls = _compile_error_type(type(exc))
    err: BaseException = exc
    try:
        if issubclass(cls, _shorten_traceback()):
            # str(exc), not exc.args: a type's own __str__ (SpmdTypeError adds
            # its operator context) is not run on the compiled error
            shortened = _bare(cls, str(exc))
            shortened.__dict__.update(getattr(exc, "__dict__", {}))  # e.g. SpmdTypeError.context
            shortened.first_useful_frame = None
            err = shortened
        else:
            err = cls(*exc.args)
    except Exception:  # noqa: BLE001 - an exception type we cannot rebuild: keep it
        err = exc
    if err is not exc:
        err.__notes__ = _notes(exc)
    err.add_note(f"[localmap_fx] in {where}")
    return err


def compile_time(exc: BaseException) -> BaseException:
    """``exc`` as raised at compile time: same type, text and notes, passed through by Dynamo."""
    cls = _compile_error_type(type(exc))
    if not issubclass(cls, _shorten_traceback()):
        return exc
    err = _bare(cls, *exc.args)
    err.__dict__.update(getattr(exc, "__dict__", {}))
    err.first_useful_frame = None
    if hasattr(exc, "__notes__"):
        err.__notes__ = _notes(exc)
    return err
