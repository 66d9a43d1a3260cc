"""Paired timing: both sides in the same process, interleaved, as ratios.

Each *round* times a block of ``calls`` calls of every side, in an order that
rotates from round to round; the figure of a round is the ratio of its block
times.  Reporting the median of per-round ratios (with min/max) keeps a noisy
machine from favouring one side: a slow moment hits the sides of one round
alike.

Every block is timed on two clocks: wall time (``time.perf_counter``) and CPU
time (``time.thread_time`` of the calling thread, or ``time.process_time`` of
the whole process).  CPU time does not advance while the process waits to be
scheduled, so on a shared, loaded machine it measures the work itself; wall
time is what a user waits for, collectives included.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["Paired", "time_paired", "ratio_stats", "summary", "pin_rank", "CLOCKS"]

CLOCKS = {"thread_cpu": time.thread_time, "process_cpu": time.process_time}


def pin_rank(rank: int, world_size: int) -> int | None:
    """Pin the calling thread (a rank's Python thread) to a CPU of its own;
    returns it, or None where the process may use fewer CPUs than there are
    ranks (or cannot pin).  Threads started before (gloo's, which start with
    the process group) keep every CPU; threads started after inherit the pin.

    Why: with as many ranks as CPUs (2 gloo ranks on the 2-CPU machine), the
    scheduler moves the ranks' Python threads between the CPUs, and about
    half of an unpinned step is that (TP stack, 64 layers: upstream whole
    147 ms unpinned, 81-97 pinned); the ratios between ways moved little,
    but a pinned step measures the ways' work, as a job with one rank per
    device or socket runs.
    """
    import os

    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < world_size:
        return None
    cpu = cpus[rank]
    os.sched_setaffinity(0, {cpu})
    return cpu


@dataclasses.dataclass
class Paired:
    """Per-round seconds per call, by clock ("wall"/"cpu") and side name."""

    clocks: dict[str, dict[str, list[float]]]

    def per_call(self, name: str, clock: str) -> list[float]:
        return self.clocks[clock][name]

    def ratios(self, num: str, den: str, clock: str) -> list[float]:
        c = self.clocks[clock]
        return [a / b for a, b in zip(c[num], c[den])]

    def extras(self, a: str, b: str, clock: str) -> list[float]:
        c = self.clocks[clock]
        return [x - y for x, y in zip(c[a], c[b])]

    def extra_ratios(self, num: tuple[str, str], den: tuple[str, str], clock: str) -> list[float]:
        """Per round: (num[0] - num[1]) / (den[0] - den[1])."""
        return [
            x / y
            for x, y in zip(self.extras(*num, clock=clock), self.extras(*den, clock=clock))
        ]


def time_paired(
    sides: dict[str, Callable[[], None]],
    rounds: int,
    calls: int,
    warmup: int = 3,
    sync: Callable[[], None] | None = None,
    end: Callable[[], None] | None = None,
    cpu_clock: str = "thread_cpu",
) -> Paired:
    """Time ``calls`` calls of each side per round, ``rounds`` rounds.

    ``sync`` (e.g. a barrier) runs before each block starts; ``end`` (e.g.
    ``torch.cuda.synchronize``) runs before a block is stopped.
    """
    cpu = CLOCKS[cpu_clock]
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cput: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        for n in order:
            fn = sides[n]
            if sync is not None:
                sync()
            c0 = cpu()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if end is not None:
                end()
            t1 = time.perf_counter()
            c1 = cpu()
            wall[n].append((t1 - t0) / calls)
            cput[n].append((c1 - c0) / calls)
    return Paired({"wall": wall, "cpu": cput})


def ratio_stats(ratios: Sequence[float]) -> dict:
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "n": len(ratios),
    }


def summary(values: Sequence[float], scale: float = 1e6) -> dict:
    """median/min/max of ``values`` times ``scale`` (seconds -> µs by default)."""
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
        "n": len(values),
    }
