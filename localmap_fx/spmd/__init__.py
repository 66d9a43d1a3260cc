"""SPMD typing of region bodies (spmd_types 0.3.1).

- :mod:`.types`: placements <-> SPMD types, the checker both modes run.
- :mod:`.rules`: typing rules of the functional collectives.
- :mod:`.check`: the compile-time check of a region body on fake tensors.
- :mod:`.functions`: which ``autograd.Function`` a traced apply is.

Submodules are imported on use: ``spmd_types`` loads only with ``spmd_types=True``.
"""
