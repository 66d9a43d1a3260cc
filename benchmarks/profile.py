"""Where the time goes: the breakdowns quoted in docs/benchmarks.md.

    python -m benchmarks.profile

Single process, fake process group of 2 ranks (no collective runs), CPU time
of this thread, best of 15 blocks: per-call costs of the pieces the eager
path is made of (P1, P2) and per-step CPU time of the compiled variants (P3,
P4).  Prints markdown.
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


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.eager_bench import _regions
    from benchmarks.models import build_handwritten, build_tp_stack, zero_grads
    from localmap_fx.testing.models import _col

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]).requires_grad_()
    P, S = _regions("ours", mesh, False)[0].in_grad_placements
    col = {k: _regions(k, mesh, False)[0] for k in ("ours", "torch")}
    col_s = {k: _regions(k, mesh, True)[0] for k in ("ours", "torch")}
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
