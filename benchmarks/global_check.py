"""Cost of the global SPMD check (``spmd_types="global"`` / ``typecheck="global"``).

    python -m benchmarks.global_check            # prints a JSON report
    python -m benchmarks.global_check --quick    # fewer rounds (smoke)

Two figures, both ratios measured side by side on the same machine:

* **G1, eager per call**: the tensor-parallel MLP block of P2 (column region
  ``relu(x @ w1)``, row region ``y @ w2``; :func:`benchmarks.models.tp_regions`)
  forward, ``local_map(spmd_types="global")`` ÷ ``spmd_types=True``, on 2
  gloo ranks (paired rounds, CPU time of the calling thread, median).
  Steady state: the oracle's answers are cached per op and shape, so this is
  the per-op bookkeeping, not DTensor's propagation.
* **G2, cold compile**: one forward+backward of the Llama example model
  (2 layers, every region ``spmd_types=True``, 1-D mesh of 2 on a fake
  process group) compiled with ``localmap_fx.backend(inner=..., typecheck=
  "global")`` ÷ ``typecheck="regions"``.  Each compile runs in a fresh
  process (cold Dynamo, AOT and oracle caches; inductor gets an empty cache
  directory); the two settings alternate, and the ratio of medians is
  reported on the process's CPU time (the machine may be shared; inductor's
  C++ compile workers are other processes, not counted) and on wall time,
  with the CPU time of the compile-time check itself (``check_cpu``).  The global check runs once per region body (bodies shared by
  several calls are checked once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

__all__ = ["eager_ranks", "compile_once", "main"]


def eager_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from .models import tp_regions, tp_stack_tensors
    from .timing import ratio_stats, summary, time_paired

    torch.set_num_threads(1)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    full = tp_stack_tensors(1, cfg["batch"], cfg["d"], cfg["hidden"])
    x = distribute_tensor(full["x"], mesh, [Replicate()])
    w1 = distribute_tensor(full["w1"][0], mesh, [Shard(1)])
    w2 = distribute_tensor(full["w2"][0], mesh, [Shard(0)])
    fns = {mode: tp_regions("ours", mesh, mode) for mode in (True, "global")}

    def fwd(mode):
        col, row = fns[mode]
        return lambda: row(col(x, w1), w2)

    same = torch.equal(fwd(True)().to_local(), fwd("global")().to_local())
    p = time_paired({"true": fwd(True), "global": fwd("global")}, cfg["rounds"], cfg["calls"])
    return {
        "same_values": same,
        "us_per_call_true": summary(p.per_call("true", "cpu")),
        "us_per_call_global": summary(p.per_call("global", "cpu")),
        "ratio_cpu": ratio_stats(p.ratios("global", "true", "cpu")),
        "ratio_wall": ratio_stats(p.ratios("global", "true", "wall")),
    }


def compile_once(typecheck: str, inner: str) -> dict:
    """In a fresh process: seconds for the first compiled forward+backward of the Llama model."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmfx_global_bench_")
    import torch
    import torch.distributed as dist

    import localmap_fx
    from localmap_fx.testing.llama import Llama, LlamaConfig

    from .compile_time import _init_fake_pg

    torch.set_num_threads(1)
    mesh = _init_fake_pg(2)

    def lm(*args, **kwargs):
        return localmap_fx.local_map(*args, **kwargs, spmd_types=True)

    model = Llama(LlamaConfig(), mesh, local_map=lm, typed_tables=True)
    tokens, targets = model.make_inputs(4, 8)
    # CPU seconds of the compile-time SPMD check itself (local, or local + global):
    # this child process times the lowering pass's call of it
    from localmap_fx.lowering import boundaries

    check_cpu = [0.0]
    check = boundaries.out_grad_placements_for

    def timed_check(*a, **k):
        c = time.process_time()
        try:
            return check(*a, **k)
        finally:
            check_cpu[0] += time.process_time() - c

    boundaries.out_grad_placements_for = timed_check
    compiled = torch.compile(model, backend=localmap_fx.backend(inner=inner, typecheck=typecheck), fullgraph=True)
    t0, c0 = time.perf_counter(), time.process_time()
    compiled(tokens, targets).backward()
    out = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "check_cpu": check_cpu[0]}
    dist.destroy_process_group()
    return out


def _cold_compile(typecheck: str, inner: str) -> dict:
    # One process per compile, the harness of the other cold-compile
    # benchmarks: Dynamo's, AOTAutograd's and the oracle's in-memory caches
    # start empty, and timed_check's rebinding dies with the process.
    from .run import _in_fresh_process

    return _in_fresh_process(compile_once, typecheck, inner)


def compile_report(inner: str, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"regions": [], "global": []}
    for r in range(repeats):
        for tc in (("regions", "global") if r % 2 == 0 else ("global", "regions")):
            runs[tc].append(_cold_compile(tc, inner))
    report: dict = {"runs": runs}
    for clock in ("cpu", "wall", "check_cpu"):
        med = {k: statistics.median(x[clock] for x in v) for k, v in runs.items()}
        report[clock] = {"median_s": med, "ratio": med["global"] / med["regions"]}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--inner", default="aot_eager,inductor")
    args = parser.parse_args(argv)
    from localmap_fx.testing.dist import run_ranks

    cfg = {"batch": 64, "d": 64, "hidden": 128, "rounds": 8 if args.quick else 40, "calls": 10 if args.quick else 40}
    eager = run_ranks(eager_ranks, world_size=2, timeout=900, args=(cfg,))[0]
    report = {"G1_eager": eager, "G2_compile": {}}
    for inner in filter(None, args.inner.split(",")):  # --inner "" : eager only
        report["G2_compile"][inner] = compile_report(inner, 1 if args.quick else 3)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
