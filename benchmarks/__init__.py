"""Benchmarks of localmap_fx against torch 2.14.1 (see docs/benchmarks.md).

Run everything with ``bash benchmarks/run.sh`` or ``python -m benchmarks.run``.
"""
