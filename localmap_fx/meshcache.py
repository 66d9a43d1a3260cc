"""Caches keyed on a ``DeviceMesh`` that never keep the mesh alive.

Note: [Caches keyed on a mesh]
    A mesh owns process groups.  A module-level cache holding a mesh (as a
    key, or in a cached value) keeps it and its groups alive for the life of
    the process, even after the program destroyed them.  :class:`MeshCache`
    holds each mesh weakly, by identity (two meshes that compare equal may
    still own different process groups), and drops the entry when the mesh
    is collected.  Values must not refer to the mesh strongly (hold a
    ``weakref`` instead), or the entry can never go.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["MeshCache"]


class MeshCache:
    """``{mesh: value}``, the mesh held weakly and compared by identity."""

    __slots__ = ("_entries", "__weakref__")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, mesh: Any, default: Any = None) -> Any:
        hit = self._entries.get(id(mesh))
        if hit is not None and hit[0]() is mesh:
            return hit[1]
        return default

    def set(self, mesh: Any, value: Any) -> Any:
        key = id(mesh)
        owner = weakref.ref(self)  # the callback must not keep the cache alive

        def drop(ref: weakref.ref, key: int = key) -> None:
            cache = owner()
            if cache is not None:
                hit = cache._entries.get(key)
                if hit is not None and hit[0] is ref:
                    del cache._entries[key]

        self._entries[key] = (weakref.ref(mesh, drop), value)
        return value

    def get_or_make(self, mesh: Any, make: Callable[[], Any]) -> Any:
        hit = self._entries.get(id(mesh))
        if hit is not None and hit[0]() is mesh:
            return hit[1]
        return self.set(mesh, make())

    def __len__(self) -> int:
        return sum(1 for r, _ in self._entries.values() if r() is not None)

    def clear(self) -> None:
        self._entries.clear()
