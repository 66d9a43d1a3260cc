"""Registers localmap_fx's names with ``torch._logging`` while torch imports.

torch 2.14.1 parses and validates ``TORCH_LOGS`` once, during ``import torch``,
and rejects names it does not know.  It first calls the ``torch.backends``
entry points ("so backends can register their log names before TORCH_LOGS is
parsed", ``torch/__init__.py``); setup.py points one at :func:`register`.

This module is deliberately outside the ``localmap_fx`` package: importing the
package would import ``torch.distributed`` and Dynamo in the middle of
``import torch``.  It imports nothing but ``torch._logging`` and never raises,
since an exception here would make ``import torch`` fail.
"""

from __future__ import annotations

LOG_NAME = "localmap_fx"
REGIONS_ARTIFACT = "localmap_fx_regions"
REGIONS_DESCRIPTION = (
    "localmap_fx: every local_map region of each compiled frame (placements, call site, "
    "local shapes, body graph)."
)


def register() -> None:
    """Make ``TORCH_LOGS=localmap_fx`` and ``TORCH_LOGS=localmap_fx_regions`` valid."""
    try:
        from torch._logging._internal import log_registry, register_artifact, register_log

        if not log_registry.is_log(LOG_NAME):
            register_log(LOG_NAME, LOG_NAME)
        if not log_registry.is_artifact(REGIONS_ARTIFACT):
            register_artifact(REGIONS_ARTIFACT, REGIONS_DESCRIPTION, off_by_default=True)
    except Exception:  # noqa: BLE001 - must never break `import torch`
        pass
