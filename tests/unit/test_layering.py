"""The package's imports form a DAG in the documented layers (docs/design.md).

Every ``import`` of a localmap_fx module by another, at module level or inside
a function, must go from a higher layer to a strictly lower one.  Imports
under ``if TYPE_CHECKING:`` are annotations only and are not counted.  A new
module must be given a layer here.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "localmap_fx")

# Top first.  A module may import only modules of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("localmap_fx.testing.moe",),
    ("localmap_fx.__main__", "localmap_fx.testing.graphs", "localmap_fx.testing.dist", "localmap_fx.testing.llama",
     "localmap_fx.testing.attention_stack"),
    ("localmap_fx.testing.models", "localmap_fx.testing.parallel"),
    ("localmap_fx", "localmap_fx.testing", "localmap_fx.debug"),
    ("localmap_fx.api",),
    ("localmap_fx.compiler",),
    ("localmap_fx.compiler.pipeline",),
    ("localmap_fx.debug.dump", "localmap_fx.debug.cli", "localmap_fx.layer_sharing.compile", "localmap_fx.compiler.inner"),
    ("localmap_fx.layer_sharing.runs",),
    ("localmap_fx.compiler.cacheable_border",),
    ("localmap_fx.compiler.dtensor_border", "localmap_fx.layer_sharing.piece_meshes"),
    ("localmap_fx.compiler.tangent_plan",),
    ("localmap_fx.compiler.layer_cache", "localmap_fx.layer_sharing.whole_gradients",
     "localmap_fx.compiler.border_wrapper"),
    (
        "localmap_fx.passes.outline_regions",
        "localmap_fx.passes.fuse_boundaries",
        "localmap_fx.passes.hoist_subgraph_views",
        "localmap_fx.passes.lone_ops",
        "localmap_fx.layer_sharing.find",
        "localmap_fx.layer_sharing.decide",
        "localmap_fx.layer_sharing.borders",
        "localmap_fx.layer_sharing.split",
        "localmap_fx.layer_sharing.runtime",
        "localmap_fx.layer_sharing.unwrap",
        "localmap_fx.compiler.cache_keys",
        "localmap_fx.compiler.conversions",
        "localmap_fx.compiler.specs",
        "localmap_fx.lowering",
        "localmap_fx.debug.layout",
    ),
    ("localmap_fx.passes.inline_marked_blocks", "localmap_fx.passes.hoist_tangent_reductions",
     "localmap_fx.passes.late_decompositions", "localmap_fx.passes.matmul_accumulation",
     "localmap_fx.passes.attention_layouts"),
    (
        "localmap_fx.debug.collectives",
        "localmap_fx.debug.region_graph",
        "localmap_fx.debug.compare",
        "localmap_fx.debug.draw",
        "localmap_fx.lowering.boundaries",
        "localmap_fx.passes.inline_shared_bodies",
    ),
    (
        "localmap_fx.eager",
        "localmap_fx.capture.call",
        "localmap_fx.debug.tables",
        "localmap_fx.debug.report",
        "localmap_fx.lowering.plan",
        "localmap_fx.spmd.check",
    ),
    ("localmap_fx.spmd.global_check",),
    ("localmap_fx.spmd.types", "localmap_fx.capture.plan", "localmap_fx.capture.reuse"),
    ("localmap_fx.boundary",),
    (
        "localmap_fx.validate",
        "localmap_fx.region",
        "localmap_fx.spmd.rules",
        "localmap_fx.spmd.global_oracle",
        "localmap_fx.spmd.global_rules",
    ),
    ("localmap_fx.analysis",),
    (
        "localmap_fx.argtree",
        "localmap_fx.below_autograd",
        "localmap_fx.graph_utils",
        "localmap_fx.spmd.functions",
        "localmap_fx.testing.teardown",
        "localmap_fx.meshcache",
        "localmap_fx._pytree",
        "localmap_fx.errors",
        "localmap_fx.shapes",
        "localmap_fx.debug.atomic",
        "localmap_fx.debug.formatting",
        "localmap_fx.debug.logs",
        "localmap_fx.compiler.options",
        "localmap_fx.compiler.observe",
        "localmap_fx.layer_sharing",
        "localmap_fx.layer_sharing.plan",
        "localmap_fx.capture.handoff",
        "localmap_fx.capture",
        "localmap_fx.spmd",
        "localmap_fx.passes",
        "localmap_fx.spmd.global_state",
    ),
    # every private torch symbol goes through it, so it imports nothing of ours
    ("localmap_fx._torch_compat",),
]
RANK = {m: len(LAYERS) - i for i, layer in enumerate(LAYERS) for m in layer}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                out[_module_name(os.path.join(d, f))] = os.path.join(d, f)
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(name: str, path: str, known: set[str]) -> set[tuple[str, int]]:
    """(imported localmap_fx module, line) for each runtime import in ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = _type_checking_lines(tree)
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            if t in known and t != name:
                found.add((t, node.lineno))
    return found


def _graph() -> dict[str, set[tuple[str, int]]]:
    mods = _modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(RANK))
    assert not missing, f"give these modules a layer in tests/unit/test_layering.py: {missing}"


def test_imports_only_go_down():
    upward = []
    for name, deps in sorted(_graph().items()):
        for dep, line in sorted(deps):
            if RANK.get(dep, 0) >= RANK.get(name, 0):
                upward.append(f"{name}:{line} imports {dep}")
    assert not upward, "imports that do not go to a lower layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = {n: {d for d, _ in deps} for n, deps in _graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_checker_sees_function_level_and_relative_imports(tmp_path):
    # The checker itself: an import inside a function and a parent-relative
    # import are both found (a checker that finds nothing would always pass).
    f = tmp_path / "mod.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..api import LocalMap\n"
        "def g():\n    from ..capture import call_captured\n"
        "from ..region import META_SPEC\n"
        "from . import validate\n"
    )
    known = {"localmap_fx.api", "localmap_fx.capture", "localmap_fx.region", "localmap_fx.lowering.validate"}
    got = imports_of("localmap_fx.lowering.mod", str(f), known)
    assert {d for d, _ in got} == {"localmap_fx.capture", "localmap_fx.region", "localmap_fx.lowering.validate"}


def _modules_after(code: str) -> set[str]:
    import json
    import subprocess
    import sys

    root = os.path.dirname(ROOT)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, env=env, cwd=root, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_public_names_do_not_import_the_compiler():
    # Dynamo/Inductor load when a backend compiles a graph, not before
    # (startup time is measured in benchmarks/startup.py).
    mods = _modules_after("import torch, localmap_fx\nfrom localmap_fx import local_map, backend, BackendOptions")
    assert "localmap_fx.api" in mods and "localmap_fx.compiler" in mods
    assert not {"torch._dynamo", "torch._inductor"} & mods


def test_cli_does_not_import_torch():
    mods = _modules_after("import localmap_fx.debug.cli, localmap_fx.debug.draw, localmap_fx.debug.compare")
    assert "localmap_fx.debug.report" in mods
    assert "torch" not in mods
