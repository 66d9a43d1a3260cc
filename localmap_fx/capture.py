"""How a local_map call becomes a region under Dynamo (placeholder)."""

from __future__ import annotations

from .eager import call_eager


def call_captured(lm, args, kwargs):
    return call_eager(lm, args, kwargs)
