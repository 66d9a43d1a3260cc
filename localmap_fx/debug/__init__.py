"""Inspecting what the localmap_fx backend compiled: dumps, tables, drawings.

* :mod:`.dump` - one folder per compiled frame (``dump_dir=`` /
  ``$LOCALMAP_FX_DUMP_DIR``), atomic writes, and the same artifacts through
  ``TORCH_TRACE``;
* :mod:`.tables` (regions, redistributes), :mod:`.collectives` (collectives
  and their attribution to regions), :mod:`.region_graph` (data for
  drawing) - pure functions of graphs to ``summary.json`` values;
* :mod:`.formatting` (text of those values, no torch) and :mod:`.report`,
  their Markdown form;
* :mod:`.draw` - the region graph as Graphviz DOT (and SVG through ``dot``);
* :mod:`.compare` - what changed between two dumps;
* :mod:`.cli` - ``python -m localmap_fx inspect DIR [--svg OUT] [--diff DIR2]``.

See ``docs/debugging.md``.
"""

from .dump import ENV_VAR, DumpDirError

__all__ = ["ENV_VAR", "DumpDirError"]
