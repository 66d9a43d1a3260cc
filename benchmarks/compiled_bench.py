"""P3, P4, P7 and peak memory: compiled training steps on a real process group.

Every rank builds the tensor-parallel stack (:mod:`benchmarks.models`) six
ways and compiles each step (forward + backward) with inductor:

=================  ==========================================================
``ours``           ``localmap_fx.local_map`` regions, ``backend="localmap_fx"``
``ours_outlined``  the same, ``localmap_fx.backend(share_layers=False)``
                   (bodies outlined into ``invoke_subgraph``; reported)
``ours_shared``    the same, ``localmap_fx.backend(share_layers=True)`` (one
                   compiled piece per layer, called per layer; reported:
                   the run-time price of layer sharing)
``torch``          torch's ``local_map``, ``torch.compile(backend="inductor")``
``hand``           plain local tensors + funcol collectives, inductor
``ours_spmd``      ``spmd_types=True`` regions, ``localmap_fx.backend()``
                   (regions type-checked at compile time)
``ours_spmd_off``  the same model, ``localmap_fx.backend(typecheck="off")``
=================  ==========================================================

* P3 = ours ÷ hand, P4 = ours ÷ torch, P7 = ours_spmd ÷ ours_spmd_off, per
  round (interleaved), wall clock; the loss and every gradient are checked
  to agree across the six first, and for P7 whether the graphs the two
  spmd variants hand to inductor are identical.
* Memory: the peak of bytes allocated during one step above the bytes live
  before it (CPU: the profiler's allocator events; CUDA:
  ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .models import build_handwritten, build_tp_stack, grads_of, zero_grads
from .timing import ratio_stats, summary, time_paired

__all__ = ["compiled_ranks", "peak_step_bytes"]


def peak_step_bytes(fn, device: str) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was live before."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _recorder(store: dict, name: str):
    """Records the graph each stage of the pipeline hands on (the last stage's
    graph is what the inner compiler receives)."""

    def on_stage(stage, gm):
        store.setdefault(name, {})[stage] = gm.code

    return on_stage


def compiled_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import localmap_fx

    torch.set_num_threads(1)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    shape = {k: cfg[k] for k in ("n_blocks", "batch", "d", "hidden")}

    stage_code: dict = {}
    variants = {
        "ours": (build_tp_stack(mesh, "ours", device=device, **shape), "localmap_fx"),
        # what outlined bodies / shared layer pieces cost at run time
        "ours_outlined": (
            build_tp_stack(mesh, "ours", device=device, **shape),
            localmap_fx.backend(share_layers=False),
        ),
        "ours_shared": (
            build_tp_stack(mesh, "ours", device=device, **shape),
            localmap_fx.backend(share_layers=True),
        ),
        "torch": (build_tp_stack(mesh, "torch", device=device, **shape), "inductor"),
        "hand": (build_handwritten(mesh, device=device, **shape), "inductor"),
        "ours_spmd": (
            build_tp_stack(mesh, "ours", spmd_types=True, device=device, **shape),
            localmap_fx.backend(typecheck="regions", on_stage=_recorder(stage_code, "ours_spmd")),
        ),
        "ours_spmd_off": (
            build_tp_stack(mesh, "ours", spmd_types=True, device=device, **shape),
            localmap_fx.backend(typecheck="off", on_stage=_recorder(stage_code, "ours_spmd_off")),
        ),
    }
    steps = {}
    compile_s = {}
    losses = {}
    grads = {}
    for name, ((step, state), backend) in variants.items():
        compiled = torch.compile(step, backend=backend)

        def run(compiled=compiled, state=state):
            loss = compiled(state["x"], state["w1"], state["w2"])
            loss.backward()
            return loss

        dist.barrier()
        t0 = time.perf_counter()
        loss = run()
        compile_s[name] = time.perf_counter() - t0
        losses[name] = loss.to_local() if hasattr(loss, "to_local") else loss
        grads[name] = grads_of(state)
        zero_grads(state)

        def timed(run=run, state=state):
            run()
            zero_grads(state)

        steps[name] = timed

    ref = "torch"
    numerics = {}
    for name in variants:
        ok = torch.allclose(losses[name], losses[ref], rtol=1e-4, atol=1e-4) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(grads[name], grads[ref])
        )
        numerics[name] = bool(ok)

    sync = torch.cuda.synchronize if device == "cuda" else None
    paired = time_paired(
        steps, cfg["rounds"], cfg["calls"], sync=dist.barrier, end=sync, cpu_clock="process_cpu"
    )

    memory = {}
    for name, fn in steps.items():
        dist.barrier()
        memory[name] = statistics.median(peak_step_bytes(fn, device) for _ in range(5))
    dist.barrier()

    def pair(num, den):
        return {
            clock: {
                "ratio": ratio_stats(paired.ratios(num, den, clock)),
                f"{num}_us": summary(paired.per_call(num, clock)),
                f"{den}_us": summary(paired.per_call(den, clock)),
            }
            for clock in ("wall", "cpu")
        }

    return {
        "numerics_match": numerics,
        "first_call_s": compile_s,
        "step_us": {
            clock: {n: summary(paired.per_call(n, clock)) for n in steps} for clock in ("wall", "cpu")
        },
        "P3": pair("ours", "hand"),
        "P4": pair("ours", "torch"),
        "P7": pair("ours_spmd", "ours_spmd_off"),
        "shared_vs_torch": pair("ours_shared", "torch"),
        "outlined_vs_torch": pair("ours_outlined", "torch"),
        "memory_bytes": memory,
        # the type check runs at compile time only: the graph handed to
        # inductor is the same either way
        "P7_graphs_identical": bool(stage_code.get("ours_spmd"))
        and stage_code.get("ours_spmd") == stage_code.get("ours_spmd_off"),
    }
