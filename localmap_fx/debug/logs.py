"""The inspection artifacts through torch's own logging.

* ``TORCH_TRACE=/some/dir``: every artifact of a dump (graphs, regions,
  ``summary.json``, ``summary.md``) is also written with
  ``torch._logging.trace_structured("artifact", ...)`` under the name
  ``localmap_fx_<file stem>``, so tlparse lists them next to Dynamo's and
  Inductor's graphs for the same compile id.
* ``TORCH_LOGS=localmap_fx_regions``: prints the regions of each compiled
  frame (the artifact is registered by :mod:`_localmap_fx_logs`, which torch
  calls while it imports; see that module for why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._torch_compat import getArtifactLogger, trace_structured

try:
    from _localmap_fx_logs import LOG_NAME, REGIONS_ARTIFACT, register
except ImportError:  # an install older than that module: `pip install -e .` again
    LOG_NAME, REGIONS_ARTIFACT = "localmap_fx", "localmap_fx_regions"

    def register() -> None:
        from .._torch_compat import log_registry, register_artifact, register_log

        if not log_registry.is_log(LOG_NAME):
            register_log(LOG_NAME, LOG_NAME)
        if not log_registry.is_artifact(REGIONS_ARTIFACT):
            register_artifact(REGIONS_ARTIFACT, "localmap_fx regions", off_by_default=True)


__all__ = ["REGIONS_ARTIFACT", "LOG_NAME", "tracing", "regions_logging", "trace_artifact", "log_regions"]

# Without the entry point (a source checkout that was not pip-installed, or
# TORCH_DEVICE_BACKEND_AUTOLOAD=0) registering now still lets
# torch._logging.set_logs(modules={"localmap_fx_regions": True}) enable it.
register()
_regions_log = getArtifactLogger(f"{LOG_NAME}.debug", REGIONS_ARTIFACT)


def tracing() -> bool:
    """True when ``TORCH_TRACE`` (structured trace) output is being written."""
    try:
        from .._torch_compat import trace_log
    except ImportError:  # pragma: no cover - torch moved it; trace_structured still works
        return True
    # pytest's log capture attaches itself to every logger it sees, torch's
    # trace log included: that is not a trace anybody reads.
    return any(not type(h).__module__.startswith("_pytest") for h in trace_log.handlers)


def regions_logging() -> bool:
    return _regions_log.isEnabledFor(logging.DEBUG)


def trace_artifact(name: str, payload: Callable[[], str], encoding: str = "string") -> None:
    """One ``trace_structured`` artifact; ``payload`` runs only when tracing."""
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"localmap_fx_{name}", "encoding": encoding},
        payload_fn=payload,
    )


def log_regions(text: Callable[[], str]) -> None:
    if regions_logging():
        _regions_log.debug("%s", text())
