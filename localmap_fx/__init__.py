"""localmap_fx: per-shard code in DTensor programs, eager and compiled.

Pipeline: capture (:mod:`.capture`) -> region IR (:mod:`.region`) ->
passes (:mod:`.passes`, :mod:`.lowering`; SPMD checks in :mod:`.spmd`) ->
compiler (:mod:`.compiler`; its stages in :mod:`.compiler.pipeline`).

Note: [Lazy public names]
    ``import localmap_fx`` imports no submodule: each public name is loaded
    on first access (PEP 562 ``__getattr__``), so a program pays for DTensor
    and the compiler stack only when it uses them, and the ``localmap-fx``
    CLI reads dumps without importing torch.  ``benchmarks/startup.py``
    measures it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import LocalMap, local_map
    from .capture.reuse import region_reuse
    from .compiler import BackendOptions, backend
    from .lowering import lower
    from .region import Region, RegionSpec, find_regions

__all__ = [
    "local_map",
    "LocalMap",
    "backend",
    "BackendOptions",
    "find_regions",
    "lower",
    "Region",
    "RegionSpec",
    "region_reuse",
]
__version__ = "0.1.0"

# public name -> the submodule defining it
_HOME = {
    "local_map": "api",
    "LocalMap": "api",
    "backend": "compiler",
    "BackendOptions": "compiler",
    "find_regions": "region",
    "lower": "lowering",
    "Region": "region",
    "RegionSpec": "region",
    "region_reuse": "capture.reuse",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'localmap_fx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _register_backend() -> None:
    # After `pip install` the "torch_dynamo_backends" entry point provides the
    # name "localmap_fx" (Dynamo loads it on first lookup); from a source
    # checkout that is not installed, register it here instead, which imports
    # Dynamo (slow: install the package to keep `import localmap_fx` fast).
    from importlib.metadata import entry_points

    if any(ep.name == "localmap_fx" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from ._torch_compat import register_backend, registered_backends
    from .compiler import localmap_fx_backend

    if "localmap_fx" not in registered_backends:
        register_backend(name="localmap_fx")(localmap_fx_backend)


_register_backend()
