"""Which ``torch.autograd.Function`` a traced ``autograd_function_apply`` is.

Note: [autograd.Function under the compile-time SPMD check]
    spmd_types types a ``Function.apply`` call by its class: a class
    registered with ``register_local_autograd_function`` is typed like an
    element-wise op, one with ``typecheck_forward`` / ``spmd_typecheck`` by
    its own rule, and an unregistered one is rejected under strict checking.
    Dynamo replaces the call by the ``autograd_function_apply`` higher-order
    op, whose forward and backward subgraphs keep no reference to the class.
    So the compile-time check (:mod:`localmap_fx.spmd.check`) asks
    the region's body instead: :func:`register_body` keeps a weak reference
    to each ``spmd_types=True`` body (keyed by a number stored in the region's
    spec annotation), and :func:`function_classes` lists the Function classes
    that body names (globals, closure cells, defaults; attributes of named
    modules and classes; functions it names, a few levels deep).  When
    exactly one candidate takes the traced tensors, the check calls
    ``cls.apply`` on them under the checker, which gives eager's verdict and
    text.  Otherwise it says it cannot tell (never a silent accept).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import itertools
import types
import weakref
from typing import Any

import torch

__all__ = ["register_body", "body_of", "function_classes", "apply_arity_matches"]

_BODIES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def register_body(func: Any) -> int | None:
    """A key for ``func`` (held weakly); None when it cannot be weakly referenced."""
    try:
        weakref.ref(func)
    except TypeError:
        return None
    key = next(_ids)
    _BODIES[key] = func
    return key


def body_of(key: int | None) -> Any:
    return None if key is None else _BODIES.get(key)


def _unwrap(obj: Any) -> Any:
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif hasattr(obj, "func") and type(obj).__name__ == "LocalMap":
            obj = obj.func
        else:
            return obj
    return obj


def _is_function_class(obj: Any) -> bool:
    return (
        isinstance(obj, type)
        and issubclass(obj, torch.autograd.Function)
        and obj is not torch.autograd.Function
    )


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def function_classes(func: Any, depth: int = 3) -> list[type]:
    """The ``torch.autograd.Function`` subclasses ``func`` names, in a stable order."""
    found: dict[type, None] = {}
    seen: set[int] = set()

    def visit(f: Any, level: int) -> None:
        f = _unwrap(f)
        if id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, torch.nn.Module):
            f = type(f).forward
        code = getattr(f, "__code__", None)
        if code is None:
            return
        names = _names(code)
        scope: dict[str, Any] = {}
        g = getattr(f, "__globals__", {})
        for n in names:
            if n in g:
                scope[n] = g[n]
            elif hasattr(builtins, n):
                continue
        for n, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                scope[n] = cell.cell_contents
            except ValueError:  # empty cell
                continue
        values = list(scope.values()) + list(getattr(f, "__defaults__", None) or ())
        for v in list(values):
            if isinstance(v, (types.ModuleType, type)):
                values += [getattr(v, n) for n in names if hasattr(v, n) and not n.startswith("__")]
        for v in values:
            if _is_function_class(v):
                found.setdefault(v, None)
            elif level > 0 and (inspect.isfunction(v) or isinstance(v, functools.partial)):
                visit(v, level - 1)

    visit(func, depth)
    return list(found)


def apply_arity_matches(cls: Any, n_tensors: int) -> bool:
    """``cls.apply`` takes exactly ``n_tensors`` positional arguments."""
    from .._torch_compat import is_setup_context_defined

    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if not is_setup_context_defined(cls.setup_context):
        params = params[1:]  # ctx
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return False
    return len(params) == n_tensors
