"""Inspecting what the localmap_fx backend compiled: dumps, tables, drawings.

Writers (run while compiling, read graphs):

* :mod:`.dump` - one folder per compiled frame (``dump_dir=`` /
  ``$LOCALMAP_FX_DUMP_DIR``), atomic writes, and the same artifacts through
  ``TORCH_TRACE``;
* :mod:`.tables` (regions, redistributes), :mod:`.collectives` (collectives
  and their attribution to regions), :mod:`.region_graph` (data for
  drawing) - pure functions of graphs to ``summary.json`` values.

Readers (pure Python, no torch; the CLI imports only these):

* :mod:`.formatting` and :mod:`.report` - text and Markdown of those values;
* :mod:`.draw` - the region graph as SVG/PNG (own layout) or Graphviz DOT;
* :mod:`.compare` - what changed between two dumps;
* :mod:`.cli` - ``localmap-fx inspect DIR [--svg OUT] [--diff DIR2]``.

See ``docs/debugging.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dump import ENV_VAR, DumpDirError

__all__ = ["ENV_VAR", "DumpDirError"]


def __getattr__(name: str) -> Any:
    # Lazy: `import localmap_fx.debug.cli` must not import torch (see the
    # Note in localmap_fx/__init__.py).
    if name in __all__:
        from . import dump

        return getattr(dump, name)
    raise AttributeError(f"module 'localmap_fx.debug' has no attribute {name!r}")
