"""The pytree flavour torch's local_map uses, plus a fast path for flat args.

Torch flattens ``args`` with ``torch.utils._cxx_pytree`` when optree is
installed and ``torch.utils._pytree`` otherwise; we pick the same one so that
leaves are counted identically.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from ._torch_compat import cxx_pytree as pytree
except ImportError:  # optree is not installed
    from ._torch_compat import pytree  # type: ignore[no-redef]

__all__ = ["pytree", "flatten_args", "unflatten_args"]

# Types that are pytree leaves in both flavours; checking them by exact type
# lets the common call (a handful of tensors) skip building a TreeSpec.
_LEAF_TYPES = frozenset({int, float, bool, str, type(None), torch.Tensor})


_Tensor = torch.Tensor


def flatten_args(args: tuple) -> tuple[list, Any]:
    """(leaves, spec); spec is None when ``args`` was already flat."""
    for a in args:
        t = type(a)
        if t not in _LEAF_TYPES and not issubclass(t, _Tensor):
            return pytree.tree_flatten(args)
    return list(args), None


def unflatten_args(leaves: list, spec: Any) -> Any:
    if spec is None:
        return tuple(leaves)
    return pytree.tree_unflatten(leaves, spec)
