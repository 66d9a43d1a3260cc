"""Recording graphs at every stage of the pipeline, and printing them stably."""

from __future__ import annotations

import re
from collections import Counter

import torch.fx as fx

from ..compiler import backend
from ..graph_utils import collective_name, is_collective

__all__ = ["Recorder", "normalized", "model_sites", "collective_counts", "eager_collective_counts"]


class Recorder:
    """Wraps the localmap_fx backend; keeps each stage's graph (as text and module)."""

    def __init__(self, inner: str = "aot_eager", **options) -> None:
        self.stages: dict[str, list[fx.GraphModule]] = {}
        self.aot: dict[str, list[fx.GraphModule]] = {"forward": [], "backward": []}
        self.backend = backend(
            inner, on_stage=self._on_stage, on_aot_graph=self._on_aot, **options
        )

    def _on_stage(self, name: str, gm: fx.GraphModule) -> None:
        # Passes edit graphs in place: keep a printed snapshot and a deep copy.
        self.stages.setdefault(name, []).append(_snapshot(gm))

    def _on_aot(self, kind: str, gm: fx.GraphModule) -> None:
        self.aot[kind].append(gm)

    def stage(self, name: str, index: int = 0) -> fx.GraphModule:
        return self.stages[name][index]


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    import copy

    try:
        return copy.deepcopy(gm)
    except Exception:
        return gm


_ANNOT = re.compile(r"^\s*#")
_CLEANUP = re.compile(r";\s+(?:[A-Za-z_][\w]*\s*=\s*)+None\s*$")


def normalized(gm: fx.GraphModule) -> str:
    """``print_readable`` without comments, cleanup statements or blank lines."""
    text = gm.print_readable(
        print_output=False, include_stride=False, include_device=False, colored=False
    )
    lines = []
    for line in text.splitlines():
        if not line.strip() or _ANNOT.match(line):
            continue
        lines.append(_CLEANUP.sub("", line).rstrip())
    text = "\n".join(lines)
    text = text.replace("torch.distributed.tensor.placement_types.", "")
    return text + "\n"


_MODEL_SITE = re.compile(r"\bmodels\.py:(\d+)")


def model_sites(text: str) -> str:
    """``models.py:77`` -> ``models.py:_tp_mlp_step+3`` (line relative to its function).

    Pinned texts then survive edits elsewhere in :mod:`localmap_fx.testing.models`
    while still saying which line of which function a call site is.
    """
    from . import models

    starts = _function_starts(models.__file__)

    def sub(m: re.Match) -> str:
        line = int(m.group(1))
        name, first = max(((n, s) for n, s in starts if s <= line), key=lambda x: x[1], default=("?", 0))
        return f"models.py:{name}+{line - first}"

    return _MODEL_SITE.sub(sub, text)


def _function_starts(path: str) -> list[tuple[str, int]]:
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [(n.name, n.lineno) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def collective_counts(gms) -> Counter:
    """Functional collectives in AOT graphs (subgraphs included), by op name."""
    c: Counter = Counter()
    for gm in gms:
        for mod in gm.modules():
            if not isinstance(mod, fx.GraphModule):
                continue
            for n in mod.graph.nodes:
                if is_collective(n):
                    c[collective_name(n.target)] += 1
    return c


_EAGER_FUNCOLS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)


def eager_collective_counts(fn, *args) -> tuple[Counter, Counter]:
    """(forward, backward) collective counts of an eager run, via CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    def counts(mode) -> Counter:
        out: Counter = Counter()
        for op, k in mode.get_comm_counts().items():
            # CommDebugMode reports native funcol ops as the Python
            # functions of torch.distributed._functional_collectives
            name = collective_name(op) or getattr(op, "__name__", "")
            if name in _EAGER_FUNCOLS:
                out[name] += k
        return out

    with CommDebugMode() as fwd:
        loss = fn(*args)
    with CommDebugMode() as bwd:
        loss.backward()
    return counts(fwd), counts(bwd)
