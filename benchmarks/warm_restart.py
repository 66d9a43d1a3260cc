"""Warm restart: the first forward + backward in a new process whose caches a first process filled.

    python -m benchmarks.warm_restart --layers 16 64 --modes whole regional marked

For each (mode, layers): a fresh process compiles a stack of
:mod:`benchmarks.depth_bench` (``--style module``: the ``nn.Module`` TP stack;
``attention``: the torchtitan-style attention stack; its ``COLD_SHAPES``; fake
process group of 2) with an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold), then a
second fresh process with the same folder (warm), back to back so both see
the same machine load.  Each reports the seconds of its first forward +
backward (wall, and CPU of the process and its compiler children: the steadier
figure on a shared machine) and torch's cache counters.  Target: warm / cold <= 0.25 (issue 27).
Ours use the default options (``--stable-cache-keys``:
``localmap_fx.backend(stable_cache_keys=True)``).  Modes (:data:`COLUMN`):
``whole`` (``torch.compile(model, backend=...)``), ``regional``
(``block.compile(backend="localmap_fx")`` per block), ``shared``
(``share_layers=True``), ``marked`` (``nested_compile_region`` blocks, whole
model compiled), ``upstream_whole`` / ``upstream_regional`` (torch's
``local_map``, ``backend="inductor"``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from typing import Any

__all__ = ["first_step", "warm_restart", "main"]

MODES = ("whole", "regional", "shared", "marked", "upstream_whole", "upstream_regional")
# the column of benchmarks.depth_bench each mode builds
COLUMN = {"whole": "ours_whole", "regional": "ours_regional", "shared": "ours_shared", "marked": "ours_marked",
          "upstream_whole": "upstream_whole", "upstream_regional": "upstream_regional"}
TARGET = 0.25


def _cpu() -> float:
    # this process and the compilers it ran (C++ compiles are child processes)
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def first_step(mode: str, n_layers: int, cache_dir: str, stable: bool = False, style: str = "module") -> dict:
    """In a fresh process: seconds of the first forward + backward, and the cache counters."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .depth_bench import COLD_SHAPES, build

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    backend: Any = None
    if stable and not mode.startswith("upstream"):
        import localmap_fx

        backend = localmap_fx.backend(stable_cache_keys=True, share_layers=True if mode == "shared" else "auto")
    step, _, _ = build(mesh, style, COLUMN[mode], n_layers, backend=backend, **COLD_SHAPES[style])
    t0, c0 = time.perf_counter(), _cpu()
    step()
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    from localmap_fx.compiler import layer_cache

    from .compile_time import _phases

    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        # no cache of torch's holds Dynamo's work: a warm process traces again
        "dynamo_s": _phases(torch._dynamo.utils.compilation_time_metrics)["dynamo_s"],
        # Note: [A kept compile restarts from Inductor's cache]
        "layers": {k: v for k, v in dataclasses.asdict(layer_cache.counts()).items() if v},
        "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
        "fx": {k: v for k, v in counters["inductor"].items() if "cache" in k},
    }


def warm_restart(mode: str, n_layers: int, stable: bool = False, style: str = "module") -> dict:
    """Cold then warm, each in its own spawned process, one fresh cache folder."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for _ in range(2):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
                runs.append(ex.submit(first_step, mode, n_layers, cache, stable, style).result())
    cold, warm = runs
    return {"mode": mode, "style": style, "layers": n_layers, "cold": cold, "warm": warm,
            "ratio": warm["seconds"] / cold["seconds"], "cpu_ratio": warm["cpu_seconds"] / cold["cpu_seconds"],
            "dynamo_ratio": warm["dynamo_s"] / cold["seconds"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[16])
    p.add_argument("--modes", nargs="+", choices=MODES, default=["whole", "regional", "marked"])
    p.add_argument("--style", default="module", choices=("module", "attention"))
    p.add_argument("--stable-cache-keys", action="store_true", help="ours with stable_cache_keys=True")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    results = []
    for n in args.layers:
        for mode in args.modes:
            r = warm_restart(mode, n, args.stable_cache_keys, args.style)
            results.append(r)
            print(f"{mode:>18} {n:3d} layers: cold {r['cold']['seconds']:6.2f} s, warm {r['warm']['seconds']:6.2f} s, "
                  f"warm/cold {r['ratio']:.2f} (target <= {TARGET}); CPU s: cold {r['cold']['cpu_seconds']:6.2f}, "
                  f"warm {r['warm']['cpu_seconds']:6.2f}, warm/cold {r['cpu_ratio']:.2f}; Dynamo in the warm process "
                  f"{r['warm']['dynamo_s']:.2f} s ({r['dynamo_ratio']:.2f} of cold); warm caches: aot {r['warm']['aot']}, "
                  f"fx {r['warm']['fx']}, restored layers {r['warm']['layers']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
