"""localmap_fx: per-shard code in DTensor programs, eager and compiled."""

from .api import LocalMap, local_map

__all__ = ["local_map", "LocalMap"]
__version__ = "0.1.0"
