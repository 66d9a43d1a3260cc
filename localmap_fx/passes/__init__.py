"""Graph passes over captured graphs; each is ``GraphModule -> GraphModule``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx as fx

from .outline_regions import outline_regions

__all__ = ["Pass", "run_passes", "outline_regions"]

Pass = Callable[[fx.GraphModule], fx.GraphModule]


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[Pass],
    after_each: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Run ``passes`` in order; ``after_each(name, gm)`` sees every stage."""
    for p in passes:
        gm = p(gm)
        if after_each is not None:
            after_each(getattr(p, "__name__", repr(p)), gm)
    return gm
