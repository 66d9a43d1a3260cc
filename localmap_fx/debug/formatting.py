"""Text forms of ``summary.json`` values: pure Python, no torch.

The dump's readers (``report``, ``compare``, ``draw``, the CLI) format
the plain values the writers (:mod:`.tables`, :mod:`.collectives`) put in
``summary.json``; keeping this module free of torch keeps
``localmap-fx inspect`` fast to start.
"""

from __future__ import annotations

import os

__all__ = ["tensor_text", "short_site", "bytes_text"]


def tensor_text(desc: dict | None) -> str:
    """``f32[8, 16]`` for a :func:`.tables.tensor_desc`; ``-`` for None."""
    if desc is None:
        return "-"
    return f"{desc['dtype']}[{', '.join(str(s) for s in desc['shape'])}]"


def short_site(site: str | None) -> str:
    """``/long/path/models.py:77`` -> ``models.py:77``."""
    if not site:
        return "-"
    return os.path.basename(site)


def bytes_text(n: object) -> str:
    """``512 B``, ``1.5 KiB``...; a symbolic size (text) as ``<expr> B``."""
    if isinstance(n, int):
        value = float(n)
        for unit in ("B", "KiB", "MiB", "GiB"):
            if value < 1024 or unit == "GiB":
                return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1024
    return f"{n} B"
