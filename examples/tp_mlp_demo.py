"""A tensor-parallel MLP written with ``localmap_fx.local_map``, on CPU/gloo.

Run it on 2 processes (``bash scripts/demo.sh`` does this)::

    torchrun --standalone --nproc-per-node 2 examples/tp_mlp_demo.py

The model is the Megatron-style pair of linears on a 1-D mesh ``("tp",)``::

    h = relu(x @ w1.T + b1)      column-parallel region: w1, b1 Shard(0) -> h Shard(1)
    y = h @ w2.T                 row-parallel region:    w2 Shard(1)     -> y Partial
    z = y.redistribute(R) + b2   one all_reduce, then the replicated bias

Each region is a function decorated with ``@localmap_fx.local_map``: its body
sees local shards only.  The script runs one forward + backward, then gathers
everything and recomputes the same math on full tensors on rank 0; it prints
a short report and exits non-zero (on every rank) if anything differs.

``build_model(mesh)`` and ``run_step(model, x)`` are kept separate so that the
model can be wrapped by ``torch.compile(model, backend="localmap_fx")``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.teardown import main_guard, unwaited_collectives

DIM, HIDDEN, BATCH = 16, 64, 8
RTOL, ATOL = 1e-5, 1e-5


# --- the two regions ---------------------------------------------------------
# out_placements is a list: a *tuple* would mean "one entry per output".


@localmap_fx.local_map(
    out_placements=[Shard(1)],
    in_placements=([Replicate()], [Shard(0)], [Shard(0)]),
    # x is replicated, but each rank only sees half of w1, so the gradient
    # each rank computes for x is a partial sum: say so, or x.grad is wrong.
    in_grad_placements=([Partial()], [Shard(0)], [Shard(0)]),
)
def column_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w.t() + b)  # local: (batch, hidden / tp)


@localmap_fx.local_map(
    out_placements=[Partial()],
    in_placements=([Shard(1)], [Shard(1)]),
)
def row_parallel(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h @ w.t()  # local: (batch, dim), this rank's share of the sum


# --- the model -----------------------------------------------------------------


class TPMLP(nn.Module):
    """``relu(x W1^T + b1) W2^T + b2`` with W1/b1 column- and W2 row-sharded."""

    def __init__(self, mesh: DeviceMesh, dim: int = DIM, hidden: int = HIDDEN, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # same full weights on every rank
        full = {
            "w1": torch.randn(hidden, dim, generator=g) / dim**0.5,
            "b1": torch.randn(hidden, generator=g) * 0.1,
            "w2": torch.randn(dim, hidden, generator=g) / hidden**0.5,
            "b2": torch.randn(dim, generator=g) * 0.1,
        }
        placements = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [Replicate()]}
        for name, t in full.items():
            self.register_parameter(name, nn.Parameter(distribute_tensor(t, mesh, placements[name])))

    def forward(self, x: DTensor) -> DTensor:
        h = column_parallel(x, self.w1, self.b1)
        y = row_parallel(h, self.w2)
        return y.redistribute(placements=[Replicate()]) + self.b2


def build_model(mesh: DeviceMesh) -> TPMLP:
    return TPMLP(mesh)


def make_input(mesh: DeviceMesh, seed: int = 1) -> DTensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, DIM, generator=g)
    return distribute_tensor(x, mesh, [Replicate()]).requires_grad_()


def run_step(model: nn.Module, x: DTensor) -> tuple[DTensor, DTensor]:
    """One forward + backward; returns (output, loss)."""
    out = model(x)
    loss = (out * out).mean()
    loss.backward()
    return out, loss


# --- checking against single-device math ------------------------------------


def reference(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model on full tensors: output and gradients."""
    t = {k: v.detach().clone().requires_grad_() for k, v in full.items()}
    out = torch.relu(t["x"] @ t["w1"].t() + t["b1"]) @ t["w2"].t() + t["b2"]
    (out * out).mean().backward()
    return {"out": out.detach(), **{f"grad_{k}": v.grad for k, v in t.items()}}


def _fmt(placements) -> str:
    return ",".join(str(p) for p in placements)


def compare_compiled(mesh: DeviceMesh, x_eager: DTensor, out_eager: DTensor, eager: dict, rank: int) -> list[str]:
    """Compile the same model with backend="localmap_fx"; compare with eager bitwise-or-1e-6."""
    # The regions Dynamo captured, as any backend sees them.
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    probe = build_model(mesh)
    torch.compile(probe, backend=record, fullgraph=True)(make_input(mesh))
    torch._dynamo.reset()

    model = torch.compile(build_model(mesh), backend="localmap_fx", fullgraph=True)
    x = make_input(mesh)
    out, _ = run_step(model, x)
    compiled = {"x": x, **{k.removeprefix("_orig_mod."): v for k, v in model.named_parameters()}}

    problems = []
    pairs = [("out", out_eager, out)] + [(f"grad_{k}", eager[k].grad, compiled[k].grad) for k in eager]
    worst = 0.0
    for key, a, b in pairs:
        if a.placements != b.placements:
            problems.append(f"compiled {key} placements {b.placements} != eager {a.placements}")
            continue
        diff = (a.to_local() - b.to_local()).abs().max().item()
        worst = max(worst, diff)
        if not torch.allclose(a.to_local(), b.to_local(), rtol=1e-6, atol=1e-6):
            problems.append(f"compiled {key} (max |diff| {diff:.3g})")
    if rank == 0:
        regions = [r for g in graphs for r in localmap_fx.find_regions(g)]
        print(f"  torch.compile(backend='localmap_fx') captured {len(regions)} regions:")
        for r in regions:
            print(f"    {r.spec.text()}  (called at {os.path.basename(r.spec.call_site)})")
        verdict = "MISMATCH: " + ", ".join(problems) if problems else "yes"
        print(f"  compiled output and gradients match eager (inductor, rtol=1e-6, max |diff| {worst:.2g}): {verdict}", flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile(backend='localmap_fx') run",
    )
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # main_guard tears the group down (see Note: [Tearing down in order])
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = build_model(mesh)
    x = make_input(mesh)
    out, loss = run_step(model, x)

    tensors = {"x": x, **dict(model.named_parameters())}
    # full_tensor() is a collective: every rank gathers, rank 0 compares.
    full = {k: v.full_tensor() for k, v in tensors.items()}
    full_grads = {k: v.grad.full_tensor() for k, v in tensors.items()}
    full_out = out.full_tensor()

    mismatches: list[str] = []
    if rank == 0:
        ref = reference(full)
        got = {"out": full_out, **{f"grad_{k}": g for k, g in full_grads.items()}}
        lines = [
            f"localmap_fx TP MLP demo: world_size={world_size}, backend=gloo, "
            f"mesh={mesh.mesh.tolist()} {mesh.mesh_dim_names}"
        ]
        for k, v in tensors.items():
            lines.append(
                f"  {k:<3} global {tuple(v.shape)!s:<9} {_fmt(v.placements):<13} "
                f"local {tuple(v.to_local().shape)!s:<9} grad {_fmt(v.grad.placements)}"
            )
        lines.append(
            f"  out global {tuple(out.shape)} {_fmt(out.placements)}; "
            f"loss {loss.full_tensor().item():.6f}; checksum(out) {full_out.sum().item():.6f}"
        )
        worst = 0.0
        for key, want in ref.items():
            diff = (got[key] - want).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(got[key], want, rtol=RTOL, atol=ATOL):
                mismatches.append(f"{key} (max |diff| {diff:.3g})")
        verdict = "MISMATCH: " + ", ".join(mismatches) if mismatches else "yes"
        lines.append(
            f"  output and gradients match single-device math "
            f"(rtol={RTOL}, atol={ATOL}, max |diff| {worst:.2g}): {verdict}"
        )
        print("\n".join(lines), flush=True)

    if not args.no_compile:
        mismatches += compare_compiled(mesh, x, out, tensors, rank)

    leaked = unwaited_collectives()
    if leaked:
        print(f"rank {rank}: {leaked} collective calls never waited for", flush=True)
        mismatches.append("unwaited collectives")
    # Every rank exits with rank 0's verdict.
    flag = torch.tensor([float(bool(mismatches))])
    dist.broadcast(flag, src=0)
    return int(flag.item() != 0)


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        sys.exit("launch with: torchrun --standalone --nproc-per-node 2 examples/tp_mlp_demo.py")
    main_guard(main)
