"""What a regionally compiled block costs per call beside its own work: torch's frame, measured.

    python -m benchmarks.regional_floor                     # TP stack, 16 and 64 layers
    python -m benchmarks.regional_floor --layers 64 --rounds 21
    python -m benchmarks.regional_floor --quick             # every code path once; numbers mean nothing

One process, a fake process group of 2 (a collective costs nothing, so a step
is its own work, Python included), the ``module`` (TP) stack of
:mod:`benchmarks.depth_bench` at its steady-step shapes.  Ways, timed in
paired interleaved rounds of CPU time (:mod:`benchmarks.timing`):

* ``upstream_whole``, ``ours_whole``, ``ours_regional``, ``upstream_regional``:
  as in ``depth_bench`` (regional = ``block.compile(backend=...)`` per block);
* ``ours_direct`` and ``upstream_direct``: the same regional step with torch's
  frame left out.  The first block is compiled once through a backend that
  keeps what the real backend returned; every block then calls that function
  itself, with its own parameters where Dynamo's frame would have passed
  them.  What is left out is exactly what each block call pays before the
  compiled function runs: ``nn.Module.__call__``, Dynamo's frame entry, its
  guards on the block's DTensor parameters and mesh, and the transformed
  bytecode.  The direct step's loss and gradients are checked against the
  regional step's (bitwise: the same compiled code on the same values).

Derived, per block call: ``frame_us = (regional - direct) / layers``, torch's;
``border_us = (direct - ours_whole) / layers``, ours (the DTensor border, the
block's autograd node, one compiled call instead of a stretch of one graph).
``floor = (ours_whole + layers * frame_us) / upstream_whole`` is the regional
step's ratio to upstream whole-model compilation if the border cost nothing:
issue 27 asks for at most 1.00, and at these layer sizes torch's frame alone
is about a fifth of a whole-model step (docs/benchmarks.md, "Regional
compilation's floor").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from .depth_bench import QUICK, SHAPES, build

__all__ = ["WAYS", "direct_step", "floor_report", "main"]

WAYS = ("upstream_whole", "ours_whole", "ours_regional", "ours_direct", "upstream_regional", "upstream_direct")


def direct_step(mesh, impl: str, n: int, backend, **shape):
    """(step, zero, leaves) of a TP stack whose blocks each call the compiled
    function the backend returned for the first block, torch's frame left out.

    ``impl``: "ours" or "torch" (whose ``local_map`` the blocks use);
    ``backend``: the block's backend (a name or callable ``torch.compile``
    takes)."""
    from torch.distributed.device_mesh import DeviceMesh

    from localmap_fx.testing.models import TPStack, tp_stack_input

    kept: list = []

    def keeping(gm, example_inputs):
        inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        fn = inner(gm, example_inputs)
        kept.append((fn, list(example_inputs)))
        return fn

    model = TPStack(mesh, n, d=shape["d"], hidden=shape["hidden"], impl=impl)
    x = tp_stack_input(mesh, shape["batch"], shape["d"])
    first = model.blocks[0]
    torch.compile(first, backend=keeping)(x)
    if len(kept) != 1:
        raise RuntimeError(f"the first block compiled to {len(kept)} graphs; a direct call needs exactly one")
    fn, example_inputs = kept[0]
    # which block input each compiled-function argument is: the block's input,
    # one of its parameters (by name), or the mesh, the same object in every block
    by_id = {id(p): name for name, p in first.named_parameters()}
    slots: list = []
    for e in example_inputs:
        if e is x:
            slots.append(("input", None))
        elif id(e) in by_id:
            slots.append(("param", by_id[id(e)]))
        elif isinstance(e, DeviceMesh):
            slots.append(("const", e))
        else:
            raise RuntimeError(f"a compiled-block argument that is neither the input, a parameter nor the mesh: "
                               f"{type(e).__name__}")
    block_params = [dict(b.named_parameters()) for b in model.blocks]
    leaves = [x, *model.parameters()]

    def step():
        h = x
        for params in block_params:
            args = [h if kind == "input" else params[v] if kind == "param" else v for kind, v in slots]
            out = fn(*args)
            h = out[0] if isinstance(out, (list, tuple)) else out
        loss = (h * h).sum()
        loss.backward()
        return loss

    def zero():
        for t in leaves:
            t.grad = None

    return step, zero, leaves


def _values(step, zero, leaves) -> list[torch.Tensor]:
    loss = step()
    got = [loss.full_tensor()] + [t.grad.full_tensor() for t in leaves]
    zero()
    return got


def floor_report(mesh, n: int, rounds: int, calls: int, shape: dict, backend=None) -> dict:
    """The ways' CPU ms per step and the derived per-block figures (module docstring)."""
    from .timing import time_paired

    sides: dict[str, Callable[[], None]] = {}
    values: dict[str, list[torch.Tensor]] = {}
    for way in WAYS:
        torch._dynamo.reset()
        impl = "torch" if way.startswith("upstream") else "ours"
        if way.endswith("direct"):
            blocks_backend = backend if backend is not None and impl == "ours" else (
                "inductor" if impl == "torch" else "localmap_fx")
            step, zero, leaves = direct_step(mesh, impl, n, blocks_backend, **shape)
        else:
            step, zero, leaves = build(mesh, "module", way, n, backend=backend if impl == "ours" else None, **shape)
        values[way] = _values(step, zero, leaves)
        _values(step, zero, leaves)  # the step after the first, as every timed one

        def timed(step=step, zero=zero) -> None:
            step()
            zero()

        sides[way] = timed
    for direct, regional in (("ours_direct", "ours_regional"), ("upstream_direct", "upstream_regional")):
        if not all(torch.equal(a, b) for a, b in zip(values[direct], values[regional])):
            raise RuntimeError(f"{direct}'s loss or gradients differ from {regional}'s: the direct call is wrong")
    paired = time_paired(sides, rounds, calls, warmup=1, cpu_clock="thread_cpu")
    ms = {w: statistics.median(paired.per_call(w, "cpu")) * 1e3 for w in WAYS}
    ratio = {w: statistics.median(paired.ratios(w, "upstream_whole", "cpu")) for w in WAYS}

    def per_block_us(a: str, b: str) -> float:
        return statistics.median(paired.extras(a, b, "cpu")) / n * 1e6

    frame_us = per_block_us("ours_regional", "ours_direct")
    return {
        "layers": n,
        "cpu_ms": ms,
        "vs_upstream_whole": ratio,
        "frame_us": frame_us,
        "upstream_frame_us": per_block_us("upstream_regional", "upstream_direct"),
        "border_us": per_block_us("ours_direct", "ours_whole"),
        "floor": (ms["ours_whole"] + n * frame_us / 1e3) / ms["upstream_whole"],
    }


def _table(reports: list[dict]) -> str:
    lines = ["| layers | upstream whole ms | ours whole | ours regional | regional, frame left out | "
             "torch's frame µs per block (ours / upstream's) | our border µs per block | floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        ms, v = r["cpu_ms"], r["vs_upstream_whole"]
        lines.append(
            f"| {r['layers']} | {ms['upstream_whole']:.2f} | {ms['ours_whole']:.2f} ({v['ours_whole']:.2f}) | "
            f"{ms['ours_regional']:.2f} ({v['ours_regional']:.2f}) | {ms['ours_direct']:.2f} ({v['ours_direct']:.2f}) | "
            f"{r['frame_us']:.0f} / {r['upstream_frame_us']:.0f} | {r['border_us']:.0f} | {r['floor']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", type=int, default=[16, 64])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    a = p.parse_args(argv)
    from .compile_time import _init_fake_pg

    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    shape: dict = (QUICK["shapes"] if a.quick else SHAPES)["module"]  # type: ignore[index]  # QUICK is a dict of dicts
    reports = [floor_report(mesh, n, 1 if a.quick else a.rounds, 1 if a.quick else a.calls, shape)
               for n in ([2] if a.quick else a.layers)]
    print(json.dumps(reports, indent=1) if a.json else _table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
