"""Pytree-aware placements: ``in_placements`` that mirror the arguments.

torch's ``local_map`` takes one entry per *flattened* leaf of ``args``.
localmap_fx also accepts (exact rules in docs/user-guide.md, "Placements for
nested arguments"):

* **mirrored**: a tuple with one entry per positional argument, each entry a
  tree shaped like that argument (or a prefix of it: one placement spec for a
  whole list/dict applies to every leaf under it);
* **by name**: a dict from parameter names to such entries; keyword
  arguments named in it are unwrapped too (torch passes kwargs untouched).

A *placement spec* (a tree leaf) is ``None`` or a list/tuple of Placements.
The flat torch form is used whenever its length matches the leaf count, so
every call torch accepts means the same thing here.

Leaves and paths come from :func:`flatten` (tuples, lists and dicts; dicts in
insertion order), used for both matching and rebuilding, in eager and under
Dynamo alike.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.placement_types import Placement

__all__ = ["flatten", "unflatten", "flatten_call", "wants_nested", "is_spec_leaf", "resolve", "path_str"]

Path = tuple  # of int | str keys


def is_spec_leaf(x: Any) -> bool:
    return x is None or (
        isinstance(x, (list, tuple)) and all(isinstance(p, Placement) for p in x) and len(x) > 0
    )


def flatten(obj: Any, path: Path = ()) -> tuple[list, list]:
    """(leaves, paths) of tuples, lists and dicts nested in ``obj``."""
    if type(obj) in (tuple, list):
        leaves, paths = [], []
        for i, x in enumerate(obj):
            lv, ps = flatten(x, path + (i,))
            leaves += lv
            paths += ps
        return leaves, paths
    if type(obj) is dict:
        leaves, paths = [], []
        for k, x in obj.items():
            lv, ps = flatten(x, path + (k,))
            leaves += lv
            paths += ps
        return leaves, paths
    return [obj], [path]


def unflatten(like: Any, leaves: list) -> Any:
    """``like`` rebuilt with ``leaves`` in :func:`flatten` order."""
    it = iter(leaves)

    def build(x):
        if type(x) in (tuple, list):
            return type(x)(build(v) for v in x)
        if type(x) is dict:
            return {k: build(v) for k, v in x.items()}
        return next(it)

    return build(like)


def path_str(path: Path) -> str:
    head, rest = path[0], path[1:]
    s = f"args[{head}]" if isinstance(head, int) else f"kwargs[{head!r}]"
    for k in rest:
        s += f"[{k!r}]"
    return s


def _lookup(tree: Any, full_path: Path, where: str) -> Any:
    """The spec that applies to the leaf at ``full_path`` (below its argument)."""
    node = tree
    for key in full_path[1:]:
        if is_spec_leaf(node):
            return node
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"{where} has no entry for {path_str(full_path)}: "
                "a mirrored in_placements must follow the structure of the "
                "arguments (or give one spec for a whole container)."
                "\n[localmap_fx] add the missing entry (None for non-tensors)."
            ) from None
    if not is_spec_leaf(node):
        raise ValueError(
            f"{where} at {path_str(full_path)} is {node!r}, not a placement spec: use "
            "a list of Placements, or None for a non-tensor."
        )
    return node


def resolve(in_placements: Any, paths: list, param_names: tuple | None) -> tuple:
    """One placement spec per leaf path, from a mirrored or by-name in_placements.

    ``paths`` start with the positional index (int) or keyword name (str).
    ``param_names`` are the function's positional parameter names (needed for
    the by-name form).
    """
    out: list = []
    if isinstance(in_placements, dict):
        unknown = set(in_placements) - set(param_names or ()) - {p[0] for p in paths if isinstance(p[0], str)}
        if unknown:
            raise ValueError(
                f"in_placements names {sorted(unknown)}, which are not parameters of "
                f"the function ({list(param_names or ())}).\n[localmap_fx] use the "
                "function's parameter names as keys."
            )
        for path in paths:
            head = path[0]
            name = head if isinstance(head, str) else (
                param_names[head] if param_names and head < len(param_names) else None
            )
            if name is None or name not in in_placements:
                out.append(None)
                continue
            out.append(_lookup(in_placements[name], path, f"in_placements[{name!r}]"))
        return tuple(out)
    for path in paths:
        head = path[0]
        if not isinstance(head, int):
            out.append(None)
            continue
        out.append(_lookup(in_placements[head], path, f"in_placements[{head}]"))
    return tuple(out)


def wants_nested(in_placements: Any, n_flat: int, n_args: int) -> bool:
    """True when in_placements is not torch's flat form but a mirrored/by-name one."""
    if isinstance(in_placements, dict):
        return True
    if not isinstance(in_placements, (list, tuple)) or len(in_placements) == n_flat:
        return False
    return len(in_placements) == n_args


def flatten_call(in_placements: Any, args: tuple, kwargs: dict) -> tuple:
    """Leaves and paths of a call whose in_placements mirrors or names its arguments.

    Returns ``(leaves, paths, n_positional, kw_tree)``: positional leaves come
    first, then those of the keyword arguments named in a by-name
    in_placements (``kw_tree``).
    """
    kw_tree = {}
    if isinstance(in_placements, dict):
        kw_tree = {k: v for k, v in kwargs.items() if k in in_placements}
    leaves, paths = flatten(args)
    kw_leaves, kw_paths = flatten(kw_tree)
    return leaves + kw_leaves, tuple(paths + kw_paths), len(leaves), kw_tree
