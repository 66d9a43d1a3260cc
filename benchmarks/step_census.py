"""What one training step of a deep stack runs, per way of compiling it: collectives and CPU time.

    python -m benchmarks.step_census                              # module and attention stacks, 16 layers
    python -m benchmarks.step_census --styles attention --layers 16 64
    python -m benchmarks.step_census --quick                      # every code path once; numbers mean nothing

One process, a fake process group of 2 (a collective costs nothing, so the
step time is the work of the step itself, Python included), the stacks and
ways of :mod:`benchmarks.depth_bench` (``upstream_whole``,
``upstream_regional``, ``ours_whole``, ``ours_regional``, ``ours_marked``)
at its steady-step :data:`~benchmarks.depth_bench.SHAPES`.  Per way:

* the collectives of one step by kind, from the torch profiler's
  process-group ops (``c10d::allreduce_``, ``c10d::allgather_into_tensor_coalesced_``,
  ...), which every way's collectives go through, compiled or eager;
* the step's CPU time, paired interleaved rounds (:mod:`benchmarks.timing`),
  and its ratio to ``upstream_whole``.

On 2 gloo ranks a collective costs 0.6–0.7 ms on a 2-CPU machine, so the
count explains most of the gloo figures of ``depth_bench``; the CPU time is
what the way costs beside its collectives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter

import torch

from .depth_bench import MARKED, QUICK, SHAPES, STYLE_COLUMNS, build

__all__ = ["WAYS", "collectives_per_step", "census", "main"]

WAYS = ("upstream_whole", "upstream_regional", "ours_whole", "ours_regional", MARKED)


def collectives_per_step(step, zero, steps: int = 2) -> dict[str, float]:
    """The process-group collectives ``step()`` issues, by kind, per step (profiled over ``steps``)."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(steps):
            step()
            zero()
    counts: Counter = Counter()
    for e in prof.key_averages():
        if e.key.startswith("c10d::") and "barrier" not in e.key:
            counts[e.key.removeprefix("c10d::").rstrip("_")] += e.count
    return {k: v / steps for k, v in sorted(counts.items())}


def census(mesh, style: str, n: int, rounds: int, calls: int, shape: dict, ways=WAYS) -> dict:
    from .timing import time_paired

    sides, out = {}, {}
    for way in ways:
        torch._dynamo.reset()
        step, zero, _ = build(mesh, style, way, n, **shape)
        for _ in range(3):  # compile, then a step that runs what the first compiled
            step()
            zero()
        out[way] = {"collectives": collectives_per_step(step, zero)}

        def timed(step=step, zero=zero):
            step()
            zero()

        sides[way] = timed
    paired = time_paired(sides, rounds, calls, warmup=1, cpu_clock="process_cpu")
    for way in ways:
        out[way]["cpu_ms"] = statistics.median(paired.per_call(way, "cpu")) * 1e3
        out[way]["cpu_vs_upstream_whole"] = statistics.median(paired.ratios(way, ways[0], "cpu"))
    return out


def _table(results: dict) -> str:
    lines = ["| style | layers | way | collectives per step | CPU ms per step (fake group) | ÷ upstream whole |",
             "|---|---|---|---|---|---|"]
    for key, ways in results.items():
        style, n = key.split("/")
        for way, r in ways.items():
            kinds = ", ".join(f"{k} {v:g}" for k, v in r["collectives"].items()) or "none"
            total = sum(r["collectives"].values())
            lines.append(f"| {style} | {n} | {way} | {total:g} ({kinds}) | {r['cpu_ms']:.2f} | "
                         f"{r['cpu_vs_upstream_whole']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--styles", nargs="+", default=["module", "attention"], choices=sorted(SHAPES))  # the styles with steady-step shapes
    p.add_argument("--layers", nargs="+", type=int, default=[16])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    a = p.parse_args(argv)
    from .compile_time import _init_fake_pg

    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    results = {}
    for style in a.styles:
        ways = tuple(w for w in WAYS if w in STYLE_COLUMNS[style])
        for n in ([2] if a.quick else a.layers):
            shape = (QUICK["shapes"] if a.quick else SHAPES)[style]
            results[f"{style}/{n}"] = census(mesh, style, n, 1 if a.quick else a.rounds,
                                             1 if a.quick else a.calls, shape, ways)
    print(json.dumps(results, indent=1) if a.json else _table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
