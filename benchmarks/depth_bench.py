"""Deep models: compile time, step time and warm restart against depth, whole / regional / marked.

    python -m benchmarks.depth_bench                 # issue 27's figures (~35 min on 2 CPUs)
    python -m benchmarks.depth_bench --full          # every style and depth, 8 16 32 64
    python -m benchmarks.depth_bench --quick         # every code path once; numbers mean nothing
    python -m benchmarks.depth_bench --only warm     # one measurement: cold, steady or warm

Model styles:

* ``module``: :class:`localmap_fx.testing.models.TPStack`, ``nn.Module``
  tensor-parallel blocks with DTensor ``nn.Parameter``\\ s, two regions per
  block (column ``relu(x @ w1)`` ``[R],[S(1)] -> [S(1)]`` with in_grad
  ``([P],[S(1)])``, row ``y @ w2`` ``[S(1)],[S(0)] -> [P]``) and a residual
  (``row(col(x, w1), w2).redistribute(mesh, [R]) + x``), loss ``(h * h).sum()``;
* ``attention``: :class:`localmap_fx.testing.attention_stack.AttnStack`,
  torchtitan-style attention blocks: DTensor q/k/v/o projections around one
  ``local_map``-ed inner attention (SDPA, heads sharded), residual;
* ``functional``: :func:`benchmarks.models.build_tp_stack` (weights passed as
  lists, no residual);
* ``module_real`` / ``attention_real``: ``module`` / ``attention`` at real
  layer sizes (:data:`COLD_SHAPES`: 67 and 671 MFLOP per rank per layer
  forward), cold compile of the two whole-model columns only.

Columns (:data:`STYLE_COLUMNS` says which each style has), interleaved in one run:

* ``upstream_whole``: torch's ``local_map``, ``torch.compile(model, backend="inductor")``;
* ``upstream_regional``: torch's ``local_map``, each block compiled on its
  own (``block.compile()``; Dynamo compiles the block's code once and reuses it);
* ``ours_whole``: ``localmap_fx.local_map``, ``backend="localmap_fx"`` with
  the default options;
* ``ours_regional``: ``block.compile(backend="localmap_fx")``;
* ``ours_marked``: each block's ``forward`` under
  ``torch.compiler.nested_compile_region``, the model compiled whole with
  ``backend="localmap_fx"``;
* ``ours_shared``: ``share_layers=True`` (each distinct layer compiled once,
  called once per layer), so the compile time it saves and the run-time price
  per layer it costs against ``ours_whole`` come from the same run.

Cold compile: first forward + backward, one fresh process for all of them on
a fake process group of 2 (graph-level work only), every cache cold as in
:mod:`benchmarks.compile_time` (its :func:`~benchmarks.compile_time.cold_caches`,
per-phase breakdown included; :data:`COLD_SHAPES`).  A compile that took
under :data:`REPEAT_COLD_UNDER_S` is measured a second time in a second pass
over the columns (reversed order) and the faster of the two kept: one
measurement of a 2 s compile swings ±15 % (a 0.9 s Dynamo phase once,
against 0.13–0.15 s in five other measurements of the same cell), and the
rule is the same for every column.
Steady step: 2 gloo ranks, :data:`SHAPES`, paired interleaved rounds
(:mod:`benchmarks.timing`), wall clock.
Warm restart: :mod:`benchmarks.warm_restart` (a fresh process fills an empty
cache folder, a second fresh process reuses it), default options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

__all__ = ["COLUMNS", "STYLES", "cold_worker", "steady_ranks", "run", "main"]

STYLES = ("module", "attention", "functional", "module_real", "attention_real")
COLUMNS = ("upstream_whole", "upstream_regional", "ours_whole", "ours_regional")
EXTRA = "ours_shared"  # share_layers=True: one compiled piece per layer, called per layer
MARKED = "ours_marked"  # nested_compile_region on each block, the model compiled whole
# the columns each style is measured in (functional blocks are no modules to mark;
# module_real is the module style at real layer sizes, whole-model compiles only)
STYLE_COLUMNS = {
    "module": (*COLUMNS, EXTRA, MARKED),
    "attention": (*COLUMNS, MARKED),
    "functional": (*COLUMNS, EXTRA),
    "module_real": ("upstream_whole", "ours_whole"),
    "attention_real": ("upstream_whole", "ours_whole"),
}

DEFAULT = {  # issue 27's figures: both stacks at 16 and 64 layers
    "cold": {"module": [16, 64], "attention": [16, 64], "module_real": [64], "attention_real": [64]},
    "steady": {"module": [16, 64], "attention": [16, 64]},
    "warm": {"module": [16, 64], "attention": [16]},
    "warm_modes": ("whole", "regional", "marked"),
    "rounds": 6,
    "calls": 3,
}
FULL = {
    "cold": {"module": [8, 16, 32, 64], "attention": [8, 16, 32, 64], "functional": [8, 16, 32, 64],
             "module_real": [16, 64], "attention_real": [16, 64]},
    "steady": {"module": [8, 16, 32, 64], "attention": [8, 16, 32, 64], "functional": [8, 16, 32, 64]},
    "warm": {"module": [16, 64], "attention": [16, 64]},
    "rounds": 12,
    "calls": 3,
}
QUICK = {
    "cold": {"module": [2], "attention": [2], "functional": [2], "module_real": [2], "attention_real": [2]},
    "steady": {"module": [2], "attention": [2], "functional": [2]},
    "warm": {"module": [2]},
    "rounds": 1,
    "calls": 1,
    "shapes": {"module": {"batch": 8, "d": 16, "hidden": 32}, "functional": {"batch": 8, "d": 16, "hidden": 32},
               "attention": {"batch": 2, "seq": 8, "d": 16, "n_heads": 4}},
}
# steady step shapes per style; cold compiles use COLD_SHAPES (graph-level work only)
SHAPES = {
    "module": {"batch": 32, "d": 128, "hidden": 256},
    "functional": {"batch": 32, "d": 128, "hidden": 256},
    "attention": {"batch": 4, "seq": 32, "d": 128, "n_heads": 8},
}
COLD_SHAPES = {
    "module": {"batch": 16, "d": 32, "hidden": 64},
    "functional": {"batch": 16, "d": 32, "hidden": 64},
    "attention": {"batch": 2, "seq": 16, "d": 32, "n_heads": 4},
    # 67 MFLOP per rank per layer forward (2 ranks): the "real layer sizes"
    "module_real": {"batch": 32, "d": 1024, "hidden": 1024},
    # projections 4 * 2 * 160 tokens * 1024 * 512 = 671 MFLOP per rank per layer forward
    "attention_real": {"batch": 2, "seq": 80, "d": 1024, "n_heads": 16},
}
SHAPE = SHAPES["module"]
# the step ratios reported (those whose two columns a style has)
RATIOS = (("ours_whole", "upstream_whole"), ("ours_whole", "upstream_regional"),
          ("ours_regional", "upstream_whole"), ("ours_regional", "upstream_regional"),
          (MARKED, "upstream_whole"), (EXTRA, "upstream_whole"), ("upstream_regional", "upstream_whole"))


def _backend(column: str):
    if column.startswith("upstream"):
        return "inductor"
    if column == EXTRA:
        import localmap_fx

        return localmap_fx.backend(share_layers=True)
    return "localmap_fx"


def build(mesh, style: str, column: str, n: int, backend=None, **shape):
    """(step, zero, leaves): ``step()`` runs forward + backward and returns the loss.

    ``shape``: the style's sizes (:data:`SHAPES`); ``backend``: instead of the column's."""
    from torch.distributed.tensor import Replicate

    impl = "torch" if column.startswith("upstream") else "ours"
    regional = column.endswith("regional")
    backend = backend if backend is not None else _backend(column)
    if style in ("module", "module_real", "attention", "attention_real"):
        if style.startswith("attention"):
            from localmap_fx.testing.attention_stack import AttnStack, attn_stack_input

            model: torch.nn.Module = AttnStack(mesh, n, d=shape["d"], n_heads=shape["n_heads"], impl=impl,
                                               marked=column == MARKED)
            x = attn_stack_input(mesh, shape["batch"], shape["seq"], shape["d"])
        else:
            from localmap_fx.testing.models import TPStack, tp_stack_input

            model = TPStack(mesh, n, d=shape["d"], hidden=shape["hidden"], impl=impl, marked=column == MARKED)
            x = tp_stack_input(mesh, shape["batch"], shape["d"])
        if regional:
            for block in model.blocks:  # type: ignore[union-attr]  # both stacks hold .blocks
                block.compile(backend=backend)
            return module_step(model, model, x)
        return module_step(torch.compile(model, backend=backend), model, x)
    if style == "functional":
        from .models import build_tp_stack, tp_regions

        whole, st = build_tp_stack(mesh, impl, n_blocks=n, **shape)
        leaves = [st["x"], *st["w1"], *st["w2"]]
        if regional:
            col, row = tp_regions(impl, mesh)

            def block(h, w1, w2):
                return row(col(h, w1), w2).redistribute(mesh, [Replicate()])

            cblock = torch.compile(block, backend=backend)

            def fn(x, w1s, w2s):
                h = x
                for w1, w2 in zip(w1s, w2s):
                    h = cblock(h, w1, w2)
                return (h * h).sum()
        else:
            fn = torch.compile(whole, backend=backend)

        def step():
            loss = fn(st["x"], st["w1"], st["w2"])
            loss.backward()
            return loss
    else:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return step, _zero_grads(leaves), leaves


def module_step(fn, model, x):
    """(step, zero, leaves) of a stack ``model`` (``forward(x) -> loss``) run as ``fn`` (compiled, or its
    blocks compiled)."""
    leaves = [x, *model.parameters()]

    def step():
        loss = fn(x)
        loss.backward()
        return loss

    return step, _zero_grads(leaves), leaves


def _zero_grads(leaves):
    def zero():
        for t in leaves:
            t.grad = None

    return zero


def values_match(got, ref) -> bool:
    """Loss and gradients (full tensors) of two sides agree to benchmark tolerance."""
    if not all(bool(torch.isfinite(t).all()) for t in (*got, *ref)):
        return False  # a side that overflowed is reported, not compared
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * (1 + b.abs().max().item())) for a, b in zip(got, ref))


# --- cold compile ------------------------------------------------------------

def _measure_cold(mesh, style: str, column: str, n: int) -> dict:
    from .compile_time import cold_caches

    torch._dynamo.reset()
    step, _, _ = build(mesh, style, column, n, **COLD_SHAPES[style])
    frames_before = dict(torch._dynamo.utils.counters["stats"])
    with cold_caches() as stats:
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before.get("unique_graphs", 0)
    torch._dynamo.reset()
    return {"total_s": total, **stats, "graphs": frames}


# compiles faster than this are measured twice (module docstring)
REPEAT_COLD_UNDER_S = 10.0


def cold_worker(plan: dict[str, list[int]]) -> dict:
    """In a fresh process: every (style, column, depth) once, columns
    interleaved; then, in reverse order, once more each one under
    :data:`REPEAT_COLD_UNDER_S`, keeping the faster (``measurements_s`` has both)."""
    from .compile_time import _init_fake_pg, _warm_up

    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    _warm_up(mesh)
    cells = [(style, column, n) for style, depths in plan.items() for n in depths
             for column in (STYLE_COLUMNS[style] if n % 16 else tuple(reversed(STYLE_COLUMNS[style])))]
    out: dict = {}
    for style, column, n in cells:
        m = _measure_cold(mesh, style, column, n)
        out[f"{style}/{column}/{n}"] = {**m, "measurements_s": [m["total_s"]]}
    for style, column, n in reversed(cells):
        key = f"{style}/{column}/{n}"
        first = out[key]
        if first["total_s"] >= REPEAT_COLD_UNDER_S:
            continue
        m = _measure_cold(mesh, style, column, n)
        kept = m if m["total_s"] < first["total_s"] else first
        out[key] = {**kept, "measurements_s": [first["total_s"], m["total_s"]]}
    return out


# --- steady step ---------------------------------------------------------------

def steady_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .timing import pin_rank, summary, time_paired

    torch.set_num_threads(1)
    pinned = pin_rank(rank, world_size) if cfg.get("pin", True) else None
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    shapes = cfg.get("shapes", SHAPES)
    out: dict = {}
    for style, depths in cfg["steady"].items():
        shape = shapes[style]
        for n in depths:
            sides = {}
            first: dict = {}
            ref = None
            match = {}
            for column in STYLE_COLUMNS[style]:
                step, zero, leaves = build(mesh, style, column, n, **shape)
                dist.barrier()
                t0 = time.perf_counter()
                loss = step()
                first[column] = time.perf_counter() - t0
                # full tensors: sides may leave a gradient Partial or Replicate
                got = [loss.full_tensor()] + [t.grad.full_tensor() for t in leaves]
                if ref is None:
                    ref = got
                match[column] = values_match(got, ref)
                zero()

                def timed(step=step, zero=zero):
                    step()
                    zero()

                sides[column] = timed
            paired = time_paired(sides, cfg["rounds"], cfg["calls"], warmup=1, sync=dist.barrier,
                                 cpu_clock="process_cpu")
            key = f"{style}/{n}"
            out[key] = {
                "pinned_cpu": pinned,
                "first_call_s": first,
                "numerics_match": match,
                "step_us": {c: {n_: summary(paired.per_call(n_, c)) for n_ in sides} for c in ("wall", "cpu")},
                "ratios": {
                    clock: {
                        f"{a}/{b}": paired.ratios(a, b, clock)
                        for a, b in RATIOS if a in sides and b in sides
                    }
                    for clock in ("wall", "cpu")
                },
                "price_per_layer_us": {
                    clock: [x / n * 1e6 for x in paired.extras(EXTRA, "ours_whole", clock)] for clock in ("wall", "cpu")
                } if EXTRA in sides else {},
            }
            del sides
            torch._dynamo.reset()
    return out


# --- warm restart --------------------------------------------------------------

WARM_MODES = {"whole": "ours_whole", "regional": "ours_regional", "marked": MARKED,
              "upstream_whole": "upstream_whole", "upstream_regional": "upstream_regional"}


def warm_restarts(plan: dict[str, list[int]], log=print, modes=None) -> dict:
    """Cold then warm first step in fresh processes (:func:`benchmarks.warm_restart.warm_restart`),
    per style, depth and mode (``modes``: of :data:`WARM_MODES`, all by default); keys
    ``style/column/layers``."""
    from .warm_restart import MODES, warm_restart

    out: dict = {}
    for style, depths in plan.items():
        for n in depths:
            for mode, column in WARM_MODES.items():
                if mode not in MODES or column not in STYLE_COLUMNS[style] or (modes and mode not in modes):
                    continue
                r = warm_restart(mode, n, style=style)
                out[f"{style}/{column}/{n}"] = r
                log(f"[depth]   {style} {column} {n}: cold {r['cold']['seconds']:.1f} s, "
                    f"warm {r['warm']['seconds']:.1f} s ({r['ratio']:.2f})")
    return out


# --- driver ----------------------------------------------------------------------

def run(cfg: dict, only: set[str] | None = None, log=print) -> dict:
    from localmap_fx.testing.dist import run_ranks

    from .run import _in_fresh_process, _loadavg

    res: dict = {"config": cfg, "load_start": _loadavg()}
    t0 = time.perf_counter()
    if only is None or "cold" in only:
        log("[depth] cold compile ...")
        res["cold"] = _in_fresh_process(cold_worker, cfg["cold"])
        res["cold_s"] = time.perf_counter() - t0
    if only is None or "steady" in only:
        log("[depth] steady step (2 gloo ranks) ...")
        t1 = time.perf_counter()
        per_rank = run_ranks(steady_ranks, world_size=2, timeout=3000, args=(cfg,))
        res["steady"] = per_rank[0]
        res["steady_rank1"] = per_rank[1]
        res["steady_s"] = time.perf_counter() - t1
    if cfg.get("warm") and (only is None or "warm" in only):
        log("[depth] warm restart (fresh processes) ...")
        t2 = time.perf_counter()
        res["warm"] = warm_restarts(cfg["warm"], log, cfg.get("warm_modes"))
        res["warm_s"] = time.perf_counter() - t2
    res["load_end"] = _loadavg()
    res["run_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    from .depth_report import write

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="every depth (8, 16, 32, 64) for both measurements")
    p.add_argument("--quick", action="store_true", help="2 layers, one round: a smoke test")
    p.add_argument("--only", default=None, help="cold,steady,warm")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--docs", default=None, help="also update DOCS/benchmarks.md and DOCS/benchmarks_depth.png")
    p.add_argument("--no-pin", action="store_true", help="leave the gloo ranks unpinned (timing.pin_rank)")
    a = p.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL if a.full else DEFAULT, pin=not a.no_pin)
    only = set(a.only.split(",")) if a.only else None
    res = run(cfg, only)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "depth.json"), "w") as f:
        json.dump(res, f, indent=1)
    write(res, a.out, a.docs)
    print(f"[depth] wrote {a.out}/depth.json, depth.md, depth.png in {res['run_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
