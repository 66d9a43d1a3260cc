"""Regional compilation's DTensor border: step time with and without the lean border.

    python -m benchmarks.border_bench                    # 2 gloo ranks, 16 layers
    python -m benchmarks.border_bench --fake 16          # one process, fake process group
    python -m benchmarks.border_bench --per-call         # one block's callable, no Dynamo frame
    python -m benchmarks.border_bench --quick            # every code path once; numbers mean nothing

The ``nn.Module`` TP stack of :mod:`benchmarks.depth_bench` (B 32, D 128,
H 256), five sides interleaved in one run (:mod:`benchmarks.timing`):
``upstream_whole`` / ``upstream_regional`` (torch's ``local_map``, inductor),
``ours_whole`` (``backend="localmap_fx"``), ``ours_regional``
(``block.compile(backend="localmap_fx")``: the lean DTensor border,
:mod:`localmap_fx.compiler.dtensor_border`) and ``ours_regional_before``
(the same with ``lean_border=False``: AOTAutograd's subclass runtime).
Prints median step times, the median per-round ratios the issue's targets
name, and the border's cost per block call (regional − whole) / layers.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys

import torch

from .depth_bench import module_step

__all__ = ["SIDES", "measure", "main"]

SIDES = ("upstream_whole", "upstream_regional", "ours_whole", "ours_regional", "ours_regional_before")
RATIOS = (("ours_regional", "upstream_whole"), ("ours_regional", "upstream_regional"),
          ("ours_regional_before", "upstream_whole"), ("ours_regional_before", "upstream_regional"),
          ("ours_regional", "ours_regional_before"), ("upstream_regional", "upstream_whole"))


def _build(mesh, side: str, n: int, shape: dict):
    from .depth_bench import build

    if side != "ours_regional_before":
        return build(mesh, "module", side, n, **shape)
    import localmap_fx
    from localmap_fx.testing.models import TPStack, tp_stack_input

    model = TPStack(mesh, n, d=shape["d"], hidden=shape["hidden"])
    x = tp_stack_input(mesh, shape["batch"], shape["d"])
    be = localmap_fx.backend(lean_border=False)  # one object: Dynamo guards on the backend's identity
    for block in model.blocks:
        block.compile(backend=be)
    return module_step(model, model, x)


def measure(mesh, n: int, rounds: int, calls: int, shape: dict, sync=None) -> dict:
    from .timing import time_paired

    sides = {}
    for side in SIDES:
        torch._dynamo.reset()
        step, zero, _ = _build(mesh, side, n, shape)
        # the border compiles a backward per tangent placement at the first
        # backward that sees it; Dynamo may add a frame at the second step
        for _ in range(3):
            step()
            zero()

        def timed(step=step, zero=zero):
            step()
            zero()

        sides[side] = timed
    paired = time_paired(sides, rounds, calls, warmup=1, sync=sync, cpu_clock="process_cpu")
    out: dict = {"layers": n}
    for clock in ("wall", "cpu"):
        med = {s: statistics.median(paired.per_call(s, clock)) * 1e3 for s in SIDES}
        out[clock] = {
            "step_ms": med,
            "ratios": {f"{a}/{b}": statistics.median(paired.ratios(a, b, clock)) for a, b in RATIOS},
            "border_us_per_block": {
                s: statistics.median(paired.extras(s, w, clock)) / n * 1e6
                for s, w in (("ours_regional", "ours_whole"), ("ours_regional_before", "ours_whole"),
                             ("upstream_regional", "upstream_whole"))
            },
        }
    return out


def per_call(mesh, rounds: int, calls: int, shape: dict) -> dict:
    """One block's compiled callable called directly (no Dynamo frame), forward +
    backward with a Partial gradient, as in a regional stack: behind the lean
    border, behind AOTAutograd's runtime, behind one bare autograd node around
    the same compiled graphs (``node``: :func:`_node_border`), and the compiled
    forward and backward alone (the floor).  Returns µs per call, each side's
    cost over the floor, and the lean border's over the node."""
    from torch.distributed.tensor import DTensor, Partial

    from localmap_fx.compiler.options import BackendOptions
    from localmap_fx.compiler.pipeline import compile_graph
    from localmap_fx.testing.models import TPStack, tp_stack_input

    from .timing import time_paired

    model = TPStack(mesh, 1, d=shape["d"], hidden=shape["hidden"])
    block = model.blocks[0]
    x = tp_stack_input(mesh, shape["batch"], shape["d"])
    fns = {}
    for name, lean in (("lean", True), ("aot", False)):
        torch._dynamo.reset()
        got: dict = {}

        def backend(gm, example_inputs, lean=lean, got=got):
            got["fn"] = compile_graph(gm, example_inputs, BackendOptions(lean_border=lean))
            got["n"] = len(example_inputs)
            return got["fn"]

        torch.compile(block, backend=backend)(x)
        fns[name] = got["fn"]
    # Dynamo's argument order for this block: (w1, mesh, x, w2)
    args = (block.w1, mesh, x, block.w2)
    out = fns["lean"](*args)[0]
    grad = DTensor.from_local(torch.ones_like(out.to_local()), mesh, [Partial()], run_check=False)
    # the border behind what drops the mesh argument (Note: [Stable keys behind the border])
    border = inspect.unwrap(fns["lean"])
    layer = border.first.layer
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args if a is not mesh]
    if len(local) != len(border.inputs):
        raise AssertionError(f"the border takes {len(border.inputs)} inputs, not {len(local)}")

    def side(fn):
        def run():
            (y,) = fn(*args)
            y.backward(grad)
            for t in (x, block.w1, block.w2):
                t.grad = None
        return run

    def floor():
        # as inside the border's autograd.Function: no grad mode
        with torch.no_grad():
            outs, saved = layer.split(layer.forward(list(local)))
            layer.backward(saved + [grad.to_local()])

    for _ in range(3):
        side(fns["lean"])()
        side(fns["aot"])()
    node = side(_node_border(border, args))
    node()
    sides = {"lean": side(fns["lean"]), "aot": side(fns["aot"]), "node": node, "floor": floor}
    paired = time_paired(sides, rounds, calls, cpu_clock="process_cpu")
    us = {k: statistics.median(paired.per_call(k, "cpu")) * 1e6 for k in sides}
    return {"cpu_us_per_call": us,
            "border_us": {k: statistics.median(paired.extras(k, "floor", "cpu")) * 1e6 for k in ("lean", "aot", "node")},
            "lean_over_node_us": statistics.median(paired.extras("lean", "node", "cpu")) * 1e6}


def _node_border(border, args):
    """What any border built on one autograd node pays, and no more: the
    border's compiled graphs (its ``Partial`` variant's backward) in one
    ``autograd.Function`` that unwraps and wraps with nothing checked or
    looked up (its specs and argument positions fixed here), then the engine
    and the accumulation of the DTensor gradients.  A reference for
    ``--per-call``, valid for this block only."""
    from torch.distributed.tensor import DTensor, Partial

    first = border.first.layer
    variant = next(v for t, v in border.variants.items() if t == ((Partial(),),))
    bw = variant.layer.backward
    dt_in = [i for i, a in enumerate(args) if isinstance(a, DTensor)]
    (out_spec,) = [s.spec for s in border.outputs]
    wraps = [(i, variant.in_grad_specs[i]) for i in dt_in]
    n = first.n_outputs

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *a):
            local = list(a)
            for i in dt_in:
                local[i] = local[i]._local_tensor
            flat = first.forward(local)
            ctx.save_for_backward(*flat[n:])
            return DTensor.__new__(DTensor, flat[0], out_spec, requires_grad=False)

        @staticmethod
        def backward(ctx, g):
            out = list(bw([*ctx.saved_tensors, g._local_tensor]))
            for i, spec in wraps:
                out[i] = DTensor.__new__(DTensor, out[i], spec, requires_grad=False)
            return tuple(out)

    return lambda *a: (Node.apply(*a),)


def _gloo_rank(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp",))
    return measure(mesh, cfg["layers"], cfg["rounds"], cfg["calls"], cfg["shape"], sync=dist.barrier)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layers", nargs="?", type=int, default=16)
    p.add_argument("--fake", action="store_true", help="one process, fake process group (no collectives)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--per-call", action="store_true",
                   help="one block's compiled callable, called directly (fake process group)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    shape = {"batch": 32, "d": 128, "hidden": 256}
    cfg = {"layers": a.layers, "rounds": a.rounds, "calls": a.calls, "shape": shape}
    if a.quick:
        cfg.update(layers=2, rounds=1, calls=1, shape={"batch": 8, "d": 16, "hidden": 32})
    if a.per_call:
        from .compile_time import _init_fake_pg

        torch.set_num_threads(1)
        res = per_call(_init_fake_pg(), cfg["rounds"] * 4, cfg["calls"] * 10, cfg["shape"])
    elif a.fake:
        from .compile_time import _init_fake_pg

        torch.set_num_threads(1)
        res = measure(_init_fake_pg(), cfg["layers"], cfg["rounds"], cfg["calls"], cfg["shape"])
    else:
        from localmap_fx.testing.dist import run_ranks

        res = run_ranks(_gloo_rank, world_size=2, timeout=3000, args=(cfg,))[0]
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
