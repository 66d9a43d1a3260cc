"""Where the time goes: the breakdowns quoted in docs/benchmarks.md.

    python -m benchmarks.profile            # eager pieces, then compiled steps
    python -m benchmarks.profile --eager    # the eager per-call breakdown only

Single process, fake process group of 2 ranks (no collective runs), CPU time
of this thread, best of 15 blocks: per-call costs of the pieces the eager
path is made of (P1, P2) and per-step CPU time of the compiled variants (P3,
P4).  Prints markdown.

The eager breakdown (:func:`eager_breakdown`) times the P1 block
``row(col(x, w1), w2)`` whole, on each side, and the pieces no local_map can
avoid: ``to_local`` ×4, the bodies, ``from_local`` ×2.  The floor is the same
block written by hand, with the public methods (``to_local`` /
``from_local(run_check=False)``) and with the autograd Functions they call.
The rows are measured in rounds, each row once per round, and the best of
the rounds is kept, so that a loaded machine slows all rows alike.
"""

from __future__ import annotations

import sys
import time


def _best_us(fn, calls: int = 200, blocks: int = 15) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(blocks):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


def eager_breakdown(rounds: int = 3) -> dict[str, float]:
    """Per-call CPU µs of the P1 block and its pieces (see the module docstring)."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor

    from benchmarks.models import tp_regions
    from localmap_fx.eager import call_eager
    from localmap_fx.testing.models import _col, _row

    mesh = _fake_mesh()
    x = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()]).requires_grad_()
    w1 = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(128, 64), mesh, [Shard(0)]).requires_grad_()
    fns = {(k, s): tp_regions(k, mesh, s) for k in ("ours", "torch") for s in (False, True)}
    P, S1, S0, Pout = (Partial(),), (Shard(1),), (Shard(0),), (Partial(),)
    y0 = fns[("torch", False)][1](fns[("torch", False)][0](x, w1), w2)
    g = DTensor.from_local(torch.ones_like(y0.to_local()), mesh, [Replicate()])
    a, b, d = x.to_local(), w1.to_local(), w2.to_local()
    h = _col(a, b)
    y = _row(h, d)
    hs, ys = torch.Size((64, 128)), torch.Size((64, 64))

    def block(key):
        col, row = fns[key]
        return lambda: row(col(x, w1), w2)

    def full_path():
        col, row = fns[("ours", False)]
        return call_eager(row, (call_eager(col, (x, w1), {}), w2), {})

    def by_hand_public():
        hh = DTensor.from_local(_col(x.to_local(grad_placements=P), w1.to_local()), mesh, S1, run_check=False)
        return DTensor.from_local(_row(hh.to_local(), w2.to_local()), mesh, Pout, run_check=False)

    def by_hand_functions():
        hh = _FromTorchTensor.apply(
            _col(_ToTorchTensor.apply(x, P), _ToTorchTensor.apply(w1, S1)), mesh, S1, False, None, None, None
        )
        return _FromTorchTensor.apply(
            _row(_ToTorchTensor.apply(hh, S1), _ToTorchTensor.apply(w2, S0)), mesh, Pout, False, None, None, None
        )

    def with_backward(fn):
        def run():
            fn().backward(g)
            x.grad = w1.grad = w2.grad = None

        return run

    rows = {
        "torch local_map block (fwd)": (block(("torch", False)), 200),
        "ours block (fwd)": (block(("ours", False)), 200),
        "ours block, full path every call (fwd)": (full_path, 200),
        "floor: by hand, to_local / from_local(run_check=False)": (by_hand_public, 200),
        "floor: by hand, the autograd Functions they call": (by_hand_functions, 200),
        "  to_local ×4 (`_ToTorchTensor.apply`)": (
            lambda: (_ToTorchTensor.apply(x, P), _ToTorchTensor.apply(w1, S1),
                     _ToTorchTensor.apply(x, P), _ToTorchTensor.apply(w2, S0)), 200),
        "  bodies (relu(x @ w1), h @ w2)": (lambda: (_col(a, b), _row(h, d)), 200),
        "  from_local ×2 (`_FromTorchTensor.apply`)": (
            lambda: (_FromTorchTensor.apply(h, mesh, S1, False, None, None, None),
                     _FromTorchTensor.apply(y, mesh, Pout, False, None, None, None)), 200),
        "  from_local ×2, global shape and stride given": (
            lambda: (_FromTorchTensor.apply(h, mesh, S1, False, hs, (128, 1), None),
                     _FromTorchTensor.apply(y, mesh, Pout, False, ys, (64, 1), None)), 200),
        "torch block fwd+bwd": (with_backward(block(("torch", False))), 50),
        "ours block fwd+bwd": (with_backward(block(("ours", False))), 50),
        "floor: by hand fwd+bwd (autograd Functions)": (with_backward(by_hand_functions), 50),
        "torch spmd_types=True block (fwd)": (block(("torch", True)), 100),
        "ours spmd_types=True block (fwd)": (block(("ours", True)), 100),
    }
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, (fn, calls) in rows.items():
            best[name] = min(best.get(name, float("inf")), _best_us(fn, calls=calls, blocks=5))
    return best


def _fake_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _print_eager(best: dict[str, float]) -> None:
    pieces = sum(best[k] for k in best if k.startswith("  ") and "shape and stride" not in k)
    print("| P1 block `row(col(x, w1), w2)`, 2 calls | CPU µs (best of rounds) |")
    print("|---|---|")
    for k, v in best.items():
        print(f"| {k} | {v:.1f} |")
    t, o = best["torch local_map block (fwd)"], best["ours block (fwd)"]
    print(f"| ours ÷ torch (fwd) | {o / t:.2f} |")
    print(f"| floor (Functions) ÷ torch (fwd) | {best['floor: by hand, the autograd Functions they call'] / t:.2f} |")
    print(f"| ours bookkeeping: block − pieces | {o - pieces:.1f} |")
    print(f"| torch bookkeeping: block − pieces | {t - pieces:.1f} |")
    print(f"| ours ÷ torch (fwd+bwd) | {best['ours block fwd+bwd'] / best['torch block fwd+bwd']:.2f} |")
    spmd = best["ours spmd_types=True block (fwd)"] / best["torch spmd_types=True block (fwd)"]
    print(f"| ours ÷ torch (spmd_types=True fwd) | {spmd:.2f} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch

    torch.set_num_threads(1)
    _print_eager(eager_breakdown())
    print()
    if "--eager" in argv:
        return 0
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor

    from benchmarks.models import build_handwritten, build_tp_stack, tp_regions, zero_grads
    from localmap_fx.testing.models import _col

    mesh = _fake_mesh()
    x = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]).requires_grad_()
    P, S = tp_regions("ours", mesh, False)[0].in_grad_placements
    col = {k: tp_regions(k, mesh, False)[0] for k in ("ours", "torch")}
    col_s = {k: tp_regions(k, mesh, True)[0] for k in ("ours", "torch")}
    a = _ToTorchTensor.apply(x, tuple(P))
    b = _ToTorchTensor.apply(w, tuple(S))
    out = _col(a, b)
    y = col["torch"](x, w)
    g = DTensor.from_local(torch.ones_like(y.to_local()), mesh, y.placements)

    def bwd(k):
        def run():
            col[k](x, w).backward(g)
            x.grad = w.grad = None

        return run

    rows = {
        "torch local_map call (fwd)": _best_us(lambda: col["torch"](x, w)),
        "ours call (fwd)": _best_us(lambda: col["ours"](x, w)),
        "  _ToTorchTensor.apply (to_local) x2": 2 * _best_us(lambda: _ToTorchTensor.apply(x, tuple(P))),
        "  _FromTorchTensor.apply (from_local) x1": _best_us(
            lambda: _FromTorchTensor.apply(out, mesh, (Shard(1),), False, None, None, None)
        ),
        "  body relu(x @ w)": _best_us(lambda: _col(a, b)),
        "torch call fwd+bwd": _best_us(bwd("torch"), calls=50),
        "ours call fwd+bwd": _best_us(bwd("ours"), calls=50),
        "torch spmd_types=True call (fwd)": _best_us(lambda: col_s["torch"](x, w)),
        "ours spmd_types=True call (fwd)": _best_us(lambda: col_s["ours"](x, w)),
    }
    try:
        import spmd_types as spmd
        from spmd_types._checker import typecheck

        from localmap_fx.spmd import types as lspmd

        types = lspmd.placements_to_spmd_type((Replicate(),), tuple(P), mesh)
        types_w = lspmd.placements_to_spmd_type((Shard(1),), tuple(S), mesh)

        def annotated():
            aa, bb = a.view_as(a), b.view_as(b)
            spmd.assert_type(aa, dict(types))
            spmd.assert_type(bb, dict(types_w))
            return aa, bb

        aa, bb = annotated()

        def checked_body():
            with spmd.set_current_mesh(mesh), typecheck(strict_mode="strict"):
                return _col(aa, bb)

        def empty_ctx():
            with spmd.set_current_mesh(mesh), typecheck(strict_mode="strict"):
                pass

        plan = lspmd.SpmdPlan(mesh)

        def empty_plan_ctx():
            with plan.checking():
                pass

        rows.update(
            {
                "  spmd: view + assert_type x2": _best_us(annotated),
                "  spmd: set_current_mesh + typecheck, empty (torch)": _best_us(empty_ctx),
                "  spmd: SpmdPlan.checking, empty (ours)": _best_us(empty_plan_ctx),
                "  spmd: body under the checker (incl. context)": _best_us(checked_body),
            }
        )
    except ImportError:
        pass

    compiled = {}
    for name, (step, state), backend in (
        ("hand", build_handwritten(mesh), "inductor"),
        ("torch", build_tp_stack(mesh, "torch"), "inductor"),
        ("ours", build_tp_stack(mesh, "ours"), "localmap_fx"),
    ):
        c = torch.compile(step, backend=backend)

        def run(c=c, state=state):
            c(state["x"], state["w1"], state["w2"]).backward()
            zero_grads(state)

        compiled[name] = run
    import localmap_fx

    step, state = build_tp_stack(mesh, "ours")
    c = torch.compile(step, backend=localmap_fx.backend(outline=False))

    def run_inline():
        c(state["x"], state["w1"], state["w2"]).backward()
        zero_grads(state)

    compiled["ours outline=False"] = run_inline
    for name, fn in compiled.items():
        rows[f"compiled TP step (fwd+bwd), {name}"] = _best_us(fn, calls=20, blocks=10)

    print("| piece | CPU µs (best of 15 blocks) |")
    print("|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
