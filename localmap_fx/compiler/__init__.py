"""The ``localmap_fx`` Dynamo backend: options, pipeline, observers, inner compilers.

``localmap_fx.backend(...)`` builds a backend from :class:`BackendOptions`;
the name ``"localmap_fx"`` is :func:`localmap_fx_backend` (the defaults).
The stages a frame goes through are listed in :mod:`.pipeline`; sharing a
repeated layer is :mod:`localmap_fx.layer_sharing`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .options import INNER_COMPILERS, BackendOptions
from .pipeline import STAGES, compile_graph

__all__ = [
    "BackendOptions",
    "INNER_COMPILERS",
    "STAGES",
    "backend",
    "compile_graph",
    "localmap_fx_backend",
    "options_from",
]


# Note: [One backend object per options]
#     Dynamo keeps, with every compiled frame, the backend that compiled it,
#     and reuses the frame only under that same object (its BACKEND_MATCH
#     check compares the callables, torch/_dynamo/guards.py).  Code that
#     writes ``block.compile(backend=localmap_fx.backend(...))`` per block
#     builds one backend per block; were each a new function, every block
#     would recompile the frame the previous block compiled.  So ``backend``
#     returns the same object for equal options (BackendOptions is a frozen
#     dataclass: equal fields, equal options; callbacks compare by
#     identity).  The table holds its backends weakly: Dynamo's caches keep a
#     backend in use alive, and a dropped one is built again on demand.
_BACKENDS: weakref.WeakValueDictionary[BackendOptions, Callable] = weakref.WeakValueDictionary()


def backend(inner: str = "inductor", **options: Any) -> Callable:
    """A Dynamo backend: ``torch.compile(model, backend=localmap_fx.backend(...))``.

    ``options`` are the fields of :class:`BackendOptions`.  Equal options
    give the same backend object (Note: [One backend object per options]),
    so frames compiled with one are reused with the other.
    """
    try:
        opts = BackendOptions(inner=inner, **options)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(BackendOptions)]
        raise TypeError(f"{e}; localmap_fx.backend accepts {fields}") from None
    try:
        made = _BACKENDS.get(opts)
    except TypeError:  # an option value that cannot be hashed: a backend of its own
        return _make_backend(opts)
    if made is None:
        made = _BACKENDS[opts] = _make_backend(opts)
    return made


def _make_backend(opts: BackendOptions) -> Callable:
    def localmap_fx(gm: fx.GraphModule, example_inputs: Sequence[Any]):
        return compile_graph(gm, example_inputs, opts)

    localmap_fx.options = opts  # type: ignore[attr-defined]
    return localmap_fx


def options_from(options: dict[str, Any] | None) -> BackendOptions:
    """The :class:`BackendOptions` of ``torch.compile(..., options=options)``.

    The keys are the keyword arguments of :func:`backend`; any other key is
    a ValueError (torch.compile would otherwise drop it silently).
    """
    if not options:
        return BackendOptions()
    fields = [f.name for f in dataclasses.fields(BackendOptions)]
    unknown = sorted(set(options) - set(fields), key=str)
    if unknown:
        raise ValueError(
            f"torch.compile(backend='localmap_fx', options=...) got unknown option(s) "
            f"{unknown}: the valid keys are {fields} (those of localmap_fx.backend)."
        )
    return BackendOptions(**options)


def localmap_fx_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict[str, Any] | None = None
):
    """The backend registered as ``"localmap_fx"``.

    ``torch.compile(model, backend="localmap_fx", options={...})`` hands
    ``options`` here; without it the defaults apply (inner = inductor).
    """
    try:
        opts = options_from(options)
    except (ValueError, TypeError) as e:
        # a ValueError at the torch.compile call, not a BackendCompilerFailed
        from ..errors import compile_time

        raise compile_time(e) from None
    return compile_graph(gm, example_inputs, opts)
