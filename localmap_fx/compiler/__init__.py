"""The ``localmap_fx`` Dynamo backend: options, pipeline, inner compilers, pieces.

``localmap_fx.backend(...)`` builds a backend from :class:`BackendOptions`;
the name ``"localmap_fx"`` is :func:`localmap_fx_backend` (the defaults).
The stages a frame goes through are listed in :mod:`.pipeline`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .options import INNER_COMPILERS, BackendOptions
from .pipeline import AUTO_MAX_OVERHEAD, AUTO_MIN_LAYERS, STAGES, LayerCost, compile_graph, layer_sharing_decision

__all__ = [
    "AUTO_MAX_OVERHEAD",
    "AUTO_MIN_LAYERS",
    "BackendOptions",
    "LayerCost",
    "INNER_COMPILERS",
    "STAGES",
    "backend",
    "compile_graph",
    "layer_sharing_decision",
    "localmap_fx_backend",
]


def backend(inner: str = "inductor", **options: Any) -> Callable:
    """A Dynamo backend: ``torch.compile(model, backend=localmap_fx.backend(...))``.

    ``options`` are the fields of :class:`BackendOptions`.
    """
    try:
        opts = BackendOptions(inner=inner, **options)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(BackendOptions)]
        raise TypeError(f"{e}; localmap_fx.backend accepts {fields}") from None

    def localmap_fx(gm: fx.GraphModule, example_inputs: Sequence[Any]):
        return compile_graph(gm, example_inputs, opts)

    localmap_fx.options = opts  # type: ignore[attr-defined]
    return localmap_fx


def localmap_fx_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """The default backend registered as ``"localmap_fx"`` (inner = inductor)."""
    return compile_graph(gm, example_inputs, BackendOptions())
