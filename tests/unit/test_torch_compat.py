"""``localmap_fx._torch_compat`` is the one list of private torch symbols.

Every row resolves on the installed torch and names its version; no other
module of the package reaches a private torch name; every private attribute
the package reads on torch objects still exists.  A torch upgrade makes these
tests point at the rows to review.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from localmap_fx import _torch_compat as compat

from helpers import mesh_1d

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "localmap_fx")



def _torch_base_version() -> str:
    return torch.__version__.split("+")[0]


def test_every_symbol_resolves_and_names_this_torch():
    problems = []
    for row in compat.SYMBOLS:
        if row.checked != _torch_base_version():
            problems.append(f"{row.name}: checked against {row.checked}, installed {torch.__version__}")
        if row.needs and importlib.util.find_spec(row.needs) is None:
            with pytest.raises(ImportError):
                row.resolve()
            continue
        try:
            row.resolve()
        except (ImportError, AttributeError) as e:
            problems.append(f"{row.name}: {row.module}.{row.attr}: {e}")
    assert problems == []


def test_rows_are_unique_and_served_by_name():
    names = [row.name for row in compat.SYMBOLS]
    assert len(names) == len(set(names))
    assert set(names) <= set(compat.__all__)
    assert set(names) <= set(dir(compat))
    row = next(r for r in compat.SYMBOLS if r.name == "DTensorSpec")
    from localmap_fx._torch_compat import DTensorSpec

    assert DTensorSpec is row.resolve()
    assert vars(compat)["DTensorSpec"] is DTensorSpec  # cached: the next access skips __getattr__
    with pytest.raises(AttributeError, match="no attribute 'NotARow'"):
        compat.NotARow  # noqa: B018


def test_resolving_a_light_row_imports_no_compiler():
    code = (
        "import sys\n"
        "from localmap_fx._torch_compat import DTensorSpec, StridedShard\n"
        "import localmap_fx.eager\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'torch._functorch.aot_autograd')"
        " if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    parts = []
    n: ast.expr = node
    while isinstance(n, ast.Attribute):
        parts.append(n.attr)
        n = n.value
    return n, parts[::-1]


def private_torch_uses(source: str) -> list[str]:
    """Private torch imports and ``torch._x`` chains (``torch.ops.*`` names are ops, not symbols)."""
    tree = ast.parse(source)
    _mark_parents(tree)  # only the longest chain is reported, not its prefixes
    # names bound to torch modules (``import torch.distributed as dist``) reach private names too
    roots = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("torch", "functorch"):
                    roots[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "functorch"):
            for a in node.names:
                if _private(node.module) or _private(a.name):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("torch", "functorch") and _private(a.name):
                    found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            base, parts = _chain(node)
            if not isinstance(base, ast.Name) or base.id not in roots:
                continue
            dotted = ".".join([roots[base.id], *parts])
            if dotted.startswith("torch.ops."):
                continue
            if _private(dotted):
                found.append(f"line {node.lineno}: {dotted}")
    return found


def _mark_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]


def test_the_scan_sees_what_it_must():
    src = (
        "import torch\nimport torch.utils._pytree as pt\nimport torch.distributed as dist\n"
        "from torch._guards import detect_fake_mode\nfrom torch.overrides import _is_torch_function_mode_enabled\n"
        "torch._C.DisableTorchFunction\ndist._functional_collectives.wait_tensor\n"
        "torch.ops._c10d_functional.wait_tensor\ntorch.ops.aten._scaled_dot_product_flash_attention.default\n"
        "torch.utils.checkpoint.checkpoint\ntorch.__version__\n"
    )
    assert private_torch_uses(src) == [
        "line 2: import torch.utils._pytree",
        "line 4: from torch._guards import detect_fake_mode",
        "line 5: from torch.overrides import _is_torch_function_mode_enabled",
        "line 6: torch._C.DisableTorchFunction",
        "line 7: torch.distributed._functional_collectives.wait_tensor",
    ]


def _package_files() -> list[str]:
    out = []
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), ROOT))
    return sorted(out)


def test_no_private_torch_name_outside_torch_compat():
    found = {}
    for rel in _package_files():
        if rel == "_torch_compat.py":
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            uses = private_torch_uses(f.read())
        if uses:
            found[rel] = uses
    assert found == {}


def _owner(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _Subclass(torch.Tensor):
    pass


# Owners whose private attribute is set per instance: one instance each.
_INSTANCES = {
    "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
    "torch._ops.OpOverloadPacket": lambda: torch.ops.aten.add,
    # a subclass instance, as a DTensor weight is (a plain tensor's Parameter has no flag)
    "torch.nn.Parameter": lambda: torch.nn.Parameter(torch.zeros(1).as_subclass(_Subclass)),
    "torch.distributed.device_mesh.DeviceMesh": mesh_1d,
}


def test_every_private_attribute_exists_on_its_owner():
    missing = []
    for row in compat.PRIVATE_ATTRIBUTES:
        if row.checked != _torch_base_version():
            missing.append(f"{row.owner}.{row.name}: checked against {row.checked}")
        owner = _owner(row.owner)
        if hasattr(owner, row.name):
            continue
        if row.owner in _INSTANCES and hasattr(_INSTANCES[row.owner](), row.name):
            continue
        missing.append(f"{row.owner}.{row.name}")
    assert missing == []
