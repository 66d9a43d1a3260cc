"""Marked blocks (issue 27): ``nested_compile_region`` on the block, one ``torch.compile``.

    python -m benchmarks.marked_bench                    # 16 and 64 layers, cold + steady
    python -m benchmarks.marked_bench --depths 16 --only cold
    python -m benchmarks.marked_bench --quick            # every code path once; numbers mean nothing

Model: :class:`localmap_fx.testing.models.TPStack` (``nn.Module`` TP blocks,
DTensor parameters, col + row regions, residual).  Columns, interleaved in
one run (the order flips between depths):

* ``marked``: ``TPStack(marked=True)`` (``MarkedTPBlock.forward`` under
  ``torch.compiler.nested_compile_region``), ``torch.compile(model,
  backend="localmap_fx")`` with the default options;
* ``upstream_whole`` / ``upstream_regional`` / ``ours_whole``: as in
  :mod:`benchmarks.depth_bench` (whose ``build`` makes them);
* ``dynamo_only`` (cold only): the marked model under a backend that compiles
  nothing (it returns a callable that stops the step), so the column is
  Dynamo's own share of a marked compile: its trace, the stamping of every
  call after the first, its guards and bytecode.  The table's row *as fast as
  upstream* adds upstream regional's compile of its one block (its total less
  its Dynamo phase): what a marked compile would cost with a backend exactly
  as fast as upstream's own compile of the block (ours can be faster or
  slower; the row shows how much of the target Dynamo leaves).

Cold compile: the first forward + backward in one fresh process on a fake
process group of 2, every cache cold (:mod:`benchmarks.compile_time`'s
phases); wall and process CPU seconds (the machine is shared: CPU seconds are
the steadier figure).  Steady step: 2 gloo ranks, B 32, D 128, H 256, paired
interleaved rounds (:mod:`benchmarks.timing`).  Targets (issue 27): cold
``marked / upstream_regional <= 1.30`` at 64 layers, step
``marked / upstream_whole <= 1.00``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from .depth_bench import module_step, values_match

__all__ = ["COLD", "STEADY", "build", "cold_worker", "steady_ranks", "run", "main"]

COLD = ("marked", "upstream_regional", "ours_whole", "dynamo_only")
STEADY = ("marked", "upstream_whole", "ours_whole")
SHAPE = {"batch": 32, "d": 128, "hidden": 256}


class StoppedAfterDynamo(Exception):
    """Raised by the ``dynamo_only`` column's compiled code: Dynamo's work is done."""


def _stop(*args):
    raise StoppedAfterDynamo


def _compile_nothing(gm, example_inputs):
    return _stop


def build(mesh, column: str, n: int, batch: int, d: int, hidden: int):
    """(step, zero, leaves) of one column; ``step()`` runs forward + backward and returns the loss
    (``dynamo_only``: raises :class:`StoppedAfterDynamo` once Dynamo has compiled the frame)."""
    if column not in ("marked", "dynamo_only"):
        from .depth_bench import build as depth_build

        return depth_build(mesh, "module", column, n, batch=batch, d=d, hidden=hidden)
    from localmap_fx.testing.models import TPStack, tp_stack_input

    model = TPStack(mesh, n, d=d, hidden=hidden, marked=True)
    x = tp_stack_input(mesh, batch, d)
    backend = "localmap_fx" if column == "marked" else _compile_nothing
    return module_step(torch.compile(model, backend=backend), model, x)


def _children_cpu() -> float:
    # C++ compiles run in child processes: their CPU is not the process's own
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cold(mesh, column: str, n: int) -> dict:
    import torch._dynamo.utils as dutils
    from torch._inductor import config as iconfig
    from torch._inductor import metrics
    from torch._inductor.utils import fresh_cache

    from .compile_time import _phases

    torch._dynamo.reset()
    step, _, _ = build(mesh, column, n, batch=16, d=32, hidden=64)
    stats = dutils.counters["stats"]
    before = dict(stats)
    with fresh_cache(), iconfig.patch(force_disable_caches=True):
        metrics.reset()
        dutils.compilation_time_metrics.clear()
        k0, c0, t0 = _children_cpu(), time.process_time(), time.perf_counter()
        try:
            step()
        except StoppedAfterDynamo:
            pass
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        children = _children_cpu() - k0
        phases = _phases(dutils.compilation_time_metrics)
        kernels = metrics.generated_kernel_count
    graphs = stats["unique_graphs"] - before.get("unique_graphs", 0)
    torch._dynamo.reset()
    return {"total_s": total, "cpu_s": cpu, "children_cpu_s": children, **phases, "kernels": kernels, "graphs": graphs}


def cold_worker(depths: list[int], repeats: int) -> dict:
    """In a fresh process: every (column, depth) ``repeats`` times, columns interleaved."""
    from .compile_time import _init_fake_pg, _warm_up

    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    _warm_up(mesh)
    out: dict = {}
    for n in depths:
        for r in range(repeats):
            order = COLD if (n + r) % 2 else tuple(reversed(COLD))
            for column in order:
                out.setdefault(f"{column}/{n}", []).append(_cold(mesh, column, n))
    return out


def steady_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .timing import pin_rank, summary, time_paired

    torch.set_num_threads(1)
    pinned = pin_rank(rank, world_size) if cfg.get("pin", True) else None
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    out: dict = {}
    for n in cfg["depths"]:
        sides, ref, match = {}, None, {}
        for column in STEADY:
            step, zero, leaves = build(mesh, column, n, **cfg["shape"])
            dist.barrier()
            loss = step()
            got = [loss.full_tensor()] + [t.grad.full_tensor() for t in leaves]
            ref = got if ref is None else ref
            match[column] = values_match(got, ref)
            zero()

            def timed(step=step, zero=zero):
                step()
                zero()

            sides[column] = timed
        paired = time_paired(sides, cfg["rounds"], cfg["calls"], warmup=1, sync=dist.barrier,
                             cpu_clock="process_cpu")
        out[str(n)] = {
            "pinned_cpu": pinned,
            "numerics_match": match,
            "step_us": {c: {s: summary(paired.per_call(s, c)) for s in sides} for c in ("wall", "cpu")},
            "ratios": {c: {f"{a}/{b}": paired.ratios(a, b, c) for a, b in
                           (("marked", "upstream_whole"), ("marked", "ours_whole"))} for c in ("wall", "cpu")},
        }
        del sides
        torch._dynamo.reset()
    return out


def run(depths: list[int], repeats: int, rounds: int, calls: int, shape: dict, only: set[str] | None,
        log=print, pin: bool = True) -> dict:
    from localmap_fx.testing.dist import run_ranks

    from .run import _in_fresh_process, _loadavg

    res: dict = {"depths": depths, "load_start": _loadavg()}
    if only is None or "cold" in only:
        log("[marked] cold compile ...")
        res["cold"] = _in_fresh_process(cold_worker, depths, repeats)
    if only is None or "steady" in only:
        log("[marked] steady step (2 gloo ranks) ...")
        cfg = {"depths": depths, "rounds": rounds, "calls": calls, "shape": shape, "pin": pin}
        res["steady"] = run_ranks(steady_ranks, world_size=2, timeout=3000, args=(cfg,))[0]
    res["load_end"] = _loadavg()
    return res


def table(res: dict) -> str:
    """The figures as markdown: medians over repeats / rounds."""
    lines = []
    if "cold" in res:
        lines += ["| cold compile | layers | wall s | CPU s (own + children) | dynamo s | aot s | inductor s | graphs | "
                  "CPU (own + children) ÷ upstream_regional |", "|---|---|---|---|---|---|---|---|---|"]
        for n in res["depths"]:
            # the figure: the process and its C++ compile children together
            base = statistics.median(_cpu_with_children(r) for r in res["cold"][f"upstream_regional/{n}"])
            for column in COLD:
                if f"{column}/{n}" not in res["cold"]:
                    continue  # a result from before the column existed
                rs = res["cold"][f"{column}/{n}"]
                med = {k: statistics.median(r[k] for r in rs) for k in
                       ("total_s", "cpu_s", "children_cpu_s", "dynamo_s", "aot_s", "inductor_s", "graphs")}
                lines.append(f"| {column} | {n} | {med['total_s']:.2f} | {med['cpu_s']:.2f} + {med['children_cpu_s']:.2f} | {med['dynamo_s']:.2f} "
                             f"| {med['aot_s']:.2f} | {med['inductor_s']:.2f} | {med['graphs']:.0f} "
                             f"| {(med['cpu_s'] + med['children_cpu_s']) / base:.2f} |")
            if f"dynamo_only/{n}" in res["cold"]:
                lines.append(f"| as fast as upstream: dynamo_only + upstream_regional's block compile | {n} "
                             f"| | | | | | | {_as_fast_as_upstream(res['cold'], n):.2f} |")
    if "steady" in res:
        lines += ["", "| steady step (2 gloo ranks) | layers | wall ms | ÷ upstream_whole (wall, median of rounds) "
                  "| numerics match |", "|---|---|---|---|---|"]
        for n in res["depths"]:
            s = res["steady"][str(n)]
            for column in STEADY:
                ratio = (statistics.median(s["ratios"]["wall"]["marked/upstream_whole"]) if column == "marked"
                         else None)
                shown = f"{ratio:.3f}" if ratio is not None else ""
                lines.append(f"| {column} | {n} | {s['step_us']['wall'][column]['median'] / 1e3:.1f} | {shown} "
                             f"| {s['numerics_match'][column]} |")
    return "\n".join(lines)


def _cpu_with_children(r: dict) -> float:
    """One cold compile's CPU seconds: the process and its C++ compile children."""
    return r["cpu_s"] + r["children_cpu_s"]


def _as_fast_as_upstream(cold: dict, n: int) -> float:
    """Per repeat, (Dynamo's own CPU on the marked model + upstream regional's CPU less its Dynamo phase)
    ÷ upstream regional's CPU; the median.  Compile children (C++) count on both sides."""
    cpu = _cpu_with_children
    return statistics.median((cpu(d) + cpu(u) - u["dynamo_s"]) / cpu(u)
                             for d, u in zip(cold[f"dynamo_only/{n}"], cold[f"upstream_regional/{n}"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="16,64")
    p.add_argument("--repeats", type=int, default=2, help="cold compiles per column and depth")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--only", default=None, help="cold,steady")
    p.add_argument("--quick", action="store_true", help="2 layers, one round: a smoke test")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--no-pin", action="store_true", help="leave the gloo ranks unpinned (timing.pin_rank)")
    a = p.parse_args(argv)
    only = set(a.only.split(",")) if a.only else None
    if a.quick:
        res = run([2], 1, 1, 1, {"batch": 8, "d": 16, "hidden": 32}, only, pin=not a.no_pin)
    else:
        res = run([int(x) for x in a.depths.split(",")], a.repeats, a.rounds, a.calls, SHAPE, only, pin=not a.no_pin)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "marked.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
