"""Graph passes over captured graphs, and the one runner that applies them.

Each pass is a function ``GraphModule -> PassResult`` in a module of its own
(the layer-sharing rewrites live in :mod:`localmap_fx.layer_sharing`)
(``find_*`` separate from rewriting, a before/after drawing in its
docstring).  A pass edits graphs only: it says which ``GraphModule`` objects it
edited (the root, and nested subgraph modules such as a checkpoint body) and
:func:`run_passes` lints and recompiles each of them once, after the pass
(as ``torch.fx.passes.infra``'s ``PassManager`` does with its
``PassResult``).  :func:`apply` runs a single pass the same way; tests and
``localmap_fx.lower`` use it.

Note: [Why passes do not recompile]
    ``GraphModule.recompile()`` regenerates and compiles the module's Python
    code (about a millisecond per graph).  When every pass recompiled what it
    touched, a graph was compiled once per pass, and nested subgraph modules
    were recompiled whether or not the pass had changed them.  Reporting the
    edited modules lets one place lint and recompile each exactly once, and
    only when something changed.  Until then ``gm.forward`` is stale: run a
    pass through :func:`apply` (or :func:`run_passes`), not by hand.

This package's ``__init__`` imports no pass, so lower layers (lowering) can
use the runner without importing the passes above them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch.fx as fx

__all__ = ["PassResult", "Pass", "run_passes", "apply"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass did (cf. ``torch.fx.passes.infra.pass_base.PassResult``).

    ``graph_module`` is the module the pass ran on (edited in place), or a
    new module it built (its code is generated when it is built);
    ``changed`` the graph modules whose graphs it edited, each once: ``graph_module``
    itself and/or nested subgraph modules.  Empty when it changed nothing.
    """

    graph_module: fx.GraphModule
    changed: tuple[fx.GraphModule, ...] = ()

    @classmethod
    def of(cls, gm: fx.GraphModule, changed: Iterable[fx.GraphModule]) -> PassResult:
        """``PassResult`` with ``changed`` deduplicated by identity, in first-seen order."""
        return cls(gm, tuple({id(m): m for m in changed}.values()))


Pass = Callable[[fx.GraphModule], PassResult]


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[Pass],
    after_each: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Run ``passes`` in order; after each, lint and recompile every graph it changed.

    ``after_each(name, gm)`` sees every stage (changed or not) with its code
    up to date.
    """
    for p in passes:
        result = p(gm)
        for m in result.changed:
            m.graph.lint()
            m.recompile()
        gm = result.graph_module
        if after_each is not None:
            after_each(getattr(p, "__name__", repr(p)), gm)
    return gm


def apply(p: Pass, gm: fx.GraphModule) -> fx.GraphModule:
    """Run the one pass ``p`` on ``gm`` as :func:`run_passes` does; returns the module."""
    return run_passes(gm, [p])
