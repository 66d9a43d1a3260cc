"""Clean ends for multi-process programs: demos, examples and test harnesses.

Note: [Tearing down in order]
    A compiled 2-process run could abort at exit after correct output
    ("terminate called without an active exception", exit code 1), and runs
    ended with "there are still N unwaited collective calls".  Both come from
    what is left when the interpreter exits: work of functional collectives
    whose results were never waited for, a process group destroyed while a
    peer is still inside a collective, and native threads (gloo, compile
    workers) torn down by the interpreter's own shutdown.  So a program ends
    in this order:

    1. wait for the outstanding collective work it still holds
       (:func:`wait_all`, results of ``torch.distributed._functional_collectives``),
    2. ``barrier()``: no rank tears down while a peer still talks to it,
    3. ``destroy_process_group()``,
    4. flush stdout/stderr and leave with ``os._exit(code)``, skipping
       interpreter teardown (nothing useful happens there; native threads
       can abort it).

    :func:`main_guard` does all of it around a ``main() -> int``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

__all__ = ["wait_all", "unwaited_collectives", "shutdown", "exit_now", "main_guard", "distributed"]


def unwaited_collectives() -> int:
    """How many collective results this process issued and never waited for."""
    from .._torch_compat import get_work_registry_size

    return int(get_work_registry_size())


def wait_all(tensors: Iterable[Any] = ()) -> None:
    """Wait for the collectives producing ``tensors`` (any nesting; others ignored)."""
    import torch
    from torch.distributed.tensor import DTensor

    from .._torch_compat import AsyncCollectiveTensor, pytree

    for t in pytree.tree_leaves(list(tensors)):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, AsyncCollectiveTensor):
            t.wait()
        elif isinstance(t, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(t)


def shutdown(pending: Iterable[Any] = (), barrier: bool = True) -> None:
    """Wait ``pending``, barrier, destroy the process group (no-op when none).

    Pass ``barrier=False`` after an error: a peer may never reach the
    barrier, and waiting for it would hang until the group's timeout.
    """
    import torch.distributed as dist

    wait_all(pending)
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Flush and leave without interpreter teardown (see Note: [Tearing down in order])."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main_guard(main: Callable[[], int]) -> NoReturn:
    """Run ``main()``, tear down in order, exit with its code (1 if it raised).

    ``main`` may initialise the process group itself; whatever it leaves
    initialised is torn down here.  Use as ``main_guard(main)`` under
    ``if __name__ == "__main__":``.
    """
    import traceback

    code, ok = 1, False
    try:
        code = int(main() or 0)
        ok = True
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        ok = code == 0
    except BaseException:  # noqa: BLE001 - report, then still tear down
        traceback.print_exc()
        code = 1
    try:
        shutdown(barrier=ok)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    exit_now(code)


@contextlib.contextmanager
def distributed(backend: str = "gloo", **init_kwargs: Any):
    """``init_process_group`` on entry, :func:`shutdown` on exit."""
    import torch.distributed as dist

    dist.init_process_group(backend, **init_kwargs)
    ok = False
    try:
        yield dist.group.WORLD
        ok = True
    finally:
        shutdown(barrier=ok)
