"""localmap_fx: per-shard code in DTensor programs, eager and compiled.

Pipeline: capture (:mod:`.capture`) -> region IR (:mod:`.region`) ->
passes (:mod:`.passes`, :mod:`.lowering`) -> backend (:mod:`.backend`).
"""

from .api import LocalMap, local_map
from .backend import BackendOptions, backend
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
]
__version__ = "0.1.0"


def _register_backend() -> None:
    # After `pip install` the "torch_dynamo_backends" entry point provides the
    # name; from a source checkout on sys.path, register it here instead.
    from importlib.metadata import entry_points

    if any(ep.name == "localmap_fx" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends import registry

    from .backend import localmap_fx_backend

    if "localmap_fx" not in registry._BACKENDS:
        registry.register_backend(name="localmap_fx")(localmap_fx_backend)


_register_backend()
