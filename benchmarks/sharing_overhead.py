"""The run-time price of layer sharing, per layer (input to the "auto" policy).

    python -m benchmarks.sharing_overhead 2 4 8 16                 # TP blocks per model
    python -m benchmarks.sharing_overhead --attention 16 64        # behind the lean DTensor border

Single process, fake process group of 2 (collectives are no-ops, so only
the framework and kernel costs are left), one CPU thread, process CPU time
per compiled step (forward + backward), medians of 20 interleaved blocks of
5 steps.  Variants of the TP stack (:func:`benchmarks.models.build_tp_stack`,
batch 32, d 128, hidden 256):

* ``shared``: ``localmap_fx.backend(share_layers=True)`` (one compiled piece
  per layer, called per layer);
* ``one_graph``: ``share_layers=False, outline=False``: one graph, bodies
  inline (what the default gives where it keeps one graph);
* ``outlined``: ``share_layers=False`` (one graph, bodies outlined);
* ``torch``: torch's ``local_map`` with ``backend="inductor"``.

Prints one markdown row per block count, with ``(shared - one_graph) /
blocks`` as the per-layer price (``PIECE_OVERHEAD_S`` in
:mod:`localmap_fx.layer_sharing.decide`).

``--attention``: the price of a layer that DTensors cross, which runs
behind the lean DTensor border (``BORDER_OVERHEAD_S``): the attention stack
of :mod:`benchmarks.depth_bench` (:class:`localmap_fx.testing.attention_stack.AttnStack`,
its steady-step shapes), the variants above (``one_graph``:
``share_layers=False, outline=False``; ``outlined``: ``share_layers=False``),
15 interleaved rounds of 5 steps.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _timed(runs: dict, rounds: int, calls: int) -> dict:
    """Median process CPU µs per call of each of ``runs``, interleaved rounds."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            t0 = time.process_time()
            for _ in range(calls):
                runs[name]()
            times[name].append((time.process_time() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _warmed(build: dict) -> dict:
    """Each variant built and run twice; Dynamo reset once before all of them,
    so that every variant's compiled code is still there when it is timed
    (each backend object is its own cache entry)."""
    torch._dynamo.reset()
    runs = {}
    for name, make in build.items():
        run = make()
        run()
        run()
        runs[name] = run
    return runs


def measure(n_blocks: int, rounds: int = 20, calls: int = 5) -> dict:
    import localmap_fx

    from .compile_time import _init_fake_pg
    from .models import build_tp_stack, zero_grads

    mesh = _init_fake_pg()
    variants = {
        "shared": ("ours", localmap_fx.backend(share_layers=True)),
        "one_graph": ("ours", localmap_fx.backend(share_layers=False, outline=False)),
        "outlined": ("ours", localmap_fx.backend(share_layers=False)),
        "torch": ("torch", "inductor"),
    }

    def make(impl, backend):
        step, st = build_tp_stack(mesh, impl, n_blocks=n_blocks, batch=32, d=128, hidden=256)
        compiled = torch.compile(step, backend=backend)

        def run():
            compiled(st["x"], st["w1"], st["w2"]).backward()
            zero_grads(st)

        return run

    return _timed(_warmed({k: (lambda v=v: make(*v)) for k, v in variants.items()}), rounds, calls)


def measure_attention(n_layers: int, rounds: int = 15, calls: int = 5) -> dict:
    import localmap_fx

    from .compile_time import _init_fake_pg
    from .depth_bench import SHAPES, build

    mesh = _init_fake_pg()
    variants = {
        "shared": ("ours_whole", localmap_fx.backend(share_layers=True)),
        "one_graph": ("ours_whole", localmap_fx.backend(share_layers=False, outline=False)),
        "outlined": ("ours_whole", localmap_fx.backend(share_layers=False)),
        "torch": ("upstream_whole", "inductor"),
    }

    def make(column, backend):
        step, zero, _ = build(mesh, "attention", column, n_layers, backend=backend, **SHAPES["attention"])

        def run():
            step()
            zero()

        return run

    return _timed(_warmed({k: (lambda v=v: make(*v)) for k, v in variants.items()}), rounds, calls)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    if "--attention" in argv:
        print("| attention layers | shared µs | one graph µs | outlined µs | upstream µs "
              "| shared − one graph per layer µs | shared − outlined per layer µs |")
        print("|---|---|---|---|---|---|---|")
        for n in [int(a) for a in argv if a != "--attention"] or [16, 64]:
            m = measure_attention(n)
            per, per_out = ((m["shared"] - m[k]) / n for k in ("one_graph", "outlined"))
            print(f"| {n} | {m['shared']:.0f} | {m['one_graph']:.0f} | {m['outlined']:.0f} | {m['torch']:.0f} "
                  f"| {per:.0f} | {per_out:.0f} |", flush=True)
        return 0
    blocks = [int(a) for a in argv] or [2, 4, 8, 16]
    print("| TP blocks | shared µs | one graph µs | outlined µs | upstream µs | shared − one graph per layer µs |")
    print("|---|---|---|---|---|---|")
    for n in blocks:
        m = measure(n)
        per = (m["shared"] - m["one_graph"]) / n
        print(f"| {n} | {m['shared']:.0f} | {m['one_graph']:.0f} | {m['outlined']:.0f} | {m['torch']:.0f} | {per:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
