"""Run a function on ``world_size`` real processes joined by a process group.

Single-process tests (FakeStore, ``LocalTensorMode``) cover most numerics; this
harness is the small multi-process tier that runs real collectives (gloo on
CPU, NCCL on GPUs)::

    def _check(rank, world_size, device):      # module level: spawn pickles it
        mesh = init_device_mesh(device, (world_size,))
        ...
        return {"out": out.full_tensor()}      # anything picklable

    results = run_ranks(_check, world_size=2)  # [result of rank 0, rank 1, ...]

How it works:

* The parent hosts a ``TCPStore`` bound to port 0 on 127.0.0.1: the OS picks a
  free port and the parent keeps it open, so there is no race between picking
  a port and using it.  Children connect to it and call
  ``init_process_group(backend, store=..., rank, world_size, timeout)``.
* Children are forked from a ``forkserver`` that imported torch once (Note:
  [Ranks forked from a server that imported torch]), else started with the
  ``spawn`` context; either way no inherited CUDA or process-group state.
  They run ``fn(rank, world_size, device)``, always destroy
  the process group, and write ``{"ok": result}`` or ``{"error": ...}`` to a
  result file in a temporary directory.  Their stdout/stderr go to a log file
  per rank, whose tail is quoted when something goes wrong.
* The parent waits with a hard deadline.  When a rank fails, the others get a
  short grace period (they are usually blocked in a collective) and are then
  killed.  A child exception is re-raised in the parent (same type when it
  pickles) chained to a ``RankTraceback`` carrying the child's traceback text;
  a timeout or a crash raises ``RankFailure`` with every rank's log tail.

Each child imports the module defining ``fn``, and a spawned one torch too
(4 s of wall time and 7-8 s of CPU for two ranks on a slow 2-CPU machine), so
batch many checks into one ``fn`` rather than starting ranks per check.

Note: [Ranks forked from a server that imported torch]
    Importing torch costs a spawned rank about 3.5 s of CPU on a slow
    machine, and the suite starts ranks a few hundred times.  A
    ``forkserver`` (multiprocessing's: a fresh, single-threaded process
    started once per parent) imports torch, ``torch.distributed`` and
    ``torch.distributed.tensor`` once, and forks each rank from there: a
    no-op pair of ranks takes 0.1 s instead of 4 s.  What a fork would
    otherwise not see is handed over or avoided: multiprocessing gives each
    forked rank the parent's working directory, ``sys.path`` and main
    module of the moment, as it does a spawned one; the server keeps the
    environment it started with, so each rank gets the parent's
    environment at ``run_ranks`` time (set first thing in the child), and
    when what the server's torch read at import (the ``TORCH*``,
    ``PYTORCH*`` and thread-count variables, not the compiler's
    ``TORCHINDUCTOR_*``/``TORCHDYNAMO_*``, whose modules a rank imports
    itself) changed since the server started, the ranks are spawned as
    before.  The suite starts the server before its first test
    (:func:`start_rank_server`), so a test's own environment never becomes
    the server's.  ``LOCALMAP_FX_RANKS_START=spawn`` always spawns.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from .teardown import shutdown

__all__ = ["run_ranks", "free_port", "start_rank_server", "RankFailure", "RankTraceback"]

_LOG_TAIL_CHARS = 6000
_GRACE_S = 10.0
_POLL_S = 0.05


_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor")
# environment variables torch (or a library under it) may read at import ...
_IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "CUDA", "NCCL", "GLOO", "OMP_", "MKL_", "KMP_", "PYTHON")
# ... except those of the compiler, which the server does not import (a rank
# imports it itself); Inductor sets TORCHINDUCTOR_CACHE_DIR at its first compile
_RANK_IMPORTS_ENV = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE")
# what the forkserver started with, once started by run_ranks
_server_state: tuple | None = None


def _import_time_state() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items()
                        if k.startswith(_IMPORT_TIME_ENV) and not k.startswith(_RANK_IMPORTS_ENV)))


def _start_context() -> Any:
    """The multiprocessing context for the ranks (Note: [Ranks forked from a server that imported torch])."""
    global _server_state
    method = os.environ.get("LOCALMAP_FX_RANKS_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"LOCALMAP_FX_RANKS_START must be 'forkserver' or 'spawn', got {method!r}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    state = _import_time_state()
    if _server_state is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _server_state = state
        return ctx
    return mp.get_context("forkserver") if state == _server_state else mp.get_context("spawn")


def _timeout_scale() -> float:
    text = os.environ.get("LOCALMAP_FX_RANKS_TIMEOUT_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        scale = 0.0
    if scale <= 0:
        raise ValueError(f"LOCALMAP_FX_RANKS_TIMEOUT_SCALE must be a positive number, got {text!r}")
    return scale


def start_rank_server() -> None:
    """Start the server ranks are forked from now, if they will be (so its
    environment is this moment's: a test suite calls it before its first test)."""
    if _start_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class RankTraceback(Exception):
    """The traceback text of an exception raised in a child rank."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n" + self.tb


class RankFailure(RuntimeError):
    """A rank crashed, hung past the timeout, or raised an unpicklable error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0, read, close).

    ``run_ranks`` does not need it (its store keeps the port bound); it is
    here for callers that must pass ``init_method=f"tcp://{host}:{port}"``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _loopback_ifname() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _to_picklable(result: Any) -> Any:
    """Detach tensors and move them to CPU; refuse DTensors with a hint."""
    import torch
    from torch.distributed.tensor import DTensor

    from .._torch_compat import pytree

    def fix(x: Any) -> Any:
        if isinstance(x, DTensor):
            raise TypeError(
                "run_ranks: fn returned a DTensor, which cannot leave its "
                "process group; return x.to_local() or x.full_tensor() instead."
            )
        if isinstance(x, torch.Tensor):
            return x.detach().cpu()
        return x

    return pytree.tree_map(fix, result)


def _write(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _child_main(
    fn: Callable,
    rank: int,
    world_size: int,
    backend: str,
    device: str,
    port: int,
    timeout_s: float,
    workdir: str,
    args: tuple,
    env: dict[str, str] | None = None,
) -> None:
    if env is not None:
        # a forked rank: the parent's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(env)
    log_path = os.path.join(workdir, f"rank{rank}.log")
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    # Send this process's stdout/stderr (Python and C++ alike) to a log file.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)

    ifname = _loopback_ifname()
    if ifname is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)

    exit_code = 0
    try:
        import torch
        import torch.distributed as dist

        record: dict = {}
        try:
            if device == "cuda":
                torch.cuda.set_device(rank)
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            init_kwargs: dict[str, Any] = {}
            if device == "cuda":
                init_kwargs["device_id"] = torch.device("cuda", rank)
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                **init_kwargs,
            )
            result = _to_picklable(fn(rank, world_size, device, *args))
            record = {"ok": result}
            pickle.dumps(record)  # fail here, with a traceback, if unpicklable
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            failed_at = time.time()
            exit_code = 1
            tb = traceback.format_exc()
            try:
                exc_bytes = pickle.dumps(e)
                pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001
                exc_bytes = None
            record = {
                "error": tb,
                "exc": exc_bytes,
                "exc_type": f"{type(e).__module__}.{type(e).__qualname__}",
                "time": failed_at,
            }
        finally:
            # wait, barrier (only when this rank succeeded: a failed peer
            # would never reach it), destroy: see Note: [Tearing down in order]
            try:
                shutdown(barrier="ok" in record)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        _write(result_path, record)
    except BaseException:  # noqa: BLE001 - e.g. torch failed to import
        traceback.print_exc()
        exit_code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Skip interpreter teardown: nothing useful happens there, and
            # backends' atexit hooks can block on an abandoned peer.
            os._exit(exit_code)


def _tail(path: str, n: int = _LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "<no log>"
    if size > n:
        text = "...\n" + text
    return text.rstrip() or "<empty log>"


def _kill_all(procs: Sequence) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_ranks(
    fn: Callable,
    world_size: int = 2,
    backend: str = "gloo",
    device: str = "cpu",
    timeout: float = 120.0,
    args: tuple = (),
) -> list:
    """Run ``fn(rank, world_size, device, *args)`` on ``world_size`` processes.

    ``fn`` must be a module-level function (the spawn context pickles it by
    name) and return something picklable; tensors in the result are detached
    and moved to CPU (DTensors are refused: return ``to_local()`` or
    ``full_tensor()``).  ``device`` is the device type string ("cpu" or
    "cuda"); with "cuda" each rank first calls ``torch.cuda.set_device(rank)``.
    ``timeout`` (seconds) bounds the whole run and is also the process
    group's collective timeout; ``LOCALMAP_FX_RANKS_TIMEOUT_SCALE`` multiplies
    it (the test runner sets it to its number of shards, which share the CPUs).

    Returns the per-rank results, indexed by rank.  Raises the first failing
    rank's exception (chained to a :class:`RankTraceback` with the child's
    traceback), or :class:`RankFailure` on a crash or timeout.
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"run_ranks needs a module-level function (spawned children import "
            f"it by name), got {fn.__module__}.{qualname}: move it to module scope."
        )

    timeout *= _timeout_scale()
    ctx = _start_context()
    env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    workdir = tempfile.mkdtemp(prefix="localmap_fx_ranks_")
    # The parent hosts the rendezvous store: port 0 lets the OS pick a free
    # port, and keeping the server open means nobody else can take it.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    port = store.port
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child_main,
                args=(fn, rank, world_size, backend, device, port, timeout, workdir, args, env),
                name=f"rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        return _collect(procs, workdir, world_size, timeout)
    finally:
        _kill_all(procs)
        del store
        for name in os.listdir(workdir):
            try:
                os.remove(os.path.join(workdir, name))
            except OSError:
                pass
        try:
            os.rmdir(workdir)
        except OSError:
            pass


def _collect(procs: list, workdir: str, world_size: int, timeout: float) -> list:
    start = time.monotonic()
    deadline = start + timeout
    grace_started = False
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not grace_started:
            for p in procs:
                if not p.is_alive() and p.exitcode != 0:
                    grace_started = True
                    # Peers are likely blocked in a collective with it.
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                    break
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)

    timed_out = any(p.is_alive() for p in procs)
    _kill_all(procs)

    records: list[dict | None] = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"rank{rank}.pkl")
        try:
            with open(path, "rb") as f:
                records.append(pickle.load(f))
        except (OSError, EOFError, pickle.UnpicklingError):
            records.append(None)

    def logs() -> str:
        parts = []
        for rank, p in enumerate(procs):
            parts.append(
                f"--- rank {rank} (exitcode {p.exitcode}) log tail ---\n"
                + _tail(os.path.join(workdir, f"rank{rank}.log"))
            )
        return "\n".join(parts)

    # The rank that raised first is the root cause; peers usually fail after
    # it ("Connection closed by peer") because it left the process group.
    errors = sorted(
        (rec["time"], rank) for rank, rec in enumerate(records) if rec and "error" in rec
    )
    if errors:
        rank = errors[0][1]
        rec = records[rank]
        if rec is None:
            raise AssertionError(f"rank {rank} has an error but no record")
        header = f"rank {rank} of {world_size} raised {rec['exc_type']} first"
        others = [r for _, r in errors[1:]]
        if others:
            header += f" (ranks {others} failed after it)"
        exc = pickle.loads(rec["exc"]) if rec.get("exc") is not None else None
        if isinstance(exc, BaseException):
            raise exc from RankTraceback(f"{header}:\n{rec['error']}")
        raise RankFailure(f"{header}:\n{rec['error']}\n{logs()}")

    if timed_out:
        elapsed = time.monotonic() - start
        stuck = [r for r, p in enumerate(procs) if records[r] is None]
        raise RankFailure(
            f"run_ranks timed out after {elapsed:.1f}s (timeout={timeout}s); "
            f"ranks without a result: {stuck}; all ranks killed.\n{logs()}"
        )
    results: list = []
    missing: list[int] = []
    for r, rec in enumerate(records):
        if rec is None or "ok" not in rec:
            missing.append(r)
        else:
            results.append(rec["ok"])
    if missing:
        raise RankFailure(f"ranks {missing} exited without a result.\n{logs()}")
    return results
