"""The training loop shared by ``llama_demo.py`` and ``moe_demo.py``.

Each rank: join the process group torchrun set up (NCCL on ``cuda:$LOCAL_RANK``
when CUDA is present, gloo on CPU otherwise), build the mesh, the model and
an optimizer, optionally ``torch.compile`` the model, and train a few steps on
random tokens.  The first step's loss and gradients are gathered and checked
against single-device reference code on rank 0; every rank exits with rank
0's verdict.  Nothing here assumes one host: ranks find each other through
torchrun's rendezvous, and each uses only its ``LOCAL_RANK`` device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

COMPILE_MODES = {
    "none": None,
    "aot_eager": lambda lfx: lfx.backend("aot_eager"),
    "inductor": lambda lfx: "localmap_fx",
    "inductor-inline": lambda lfx: lfx.backend("inductor", outline=False),
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dp", type=int, default=1, help="data-parallel size; >1 gives a 2-D (dp, model) mesh")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--checkpoint", choices=["none", "full", "selective"], default="none")
    p.add_argument("--compile", choices=sorted(COMPILE_MODES), default="none",
                   help="torch.compile the model: inductor = backend='localmap_fx'")
    return p


def main(args, model_dim: str, build: Callable, reference: Callable, name: str) -> int:
    if "LOCAL_RANK" not in os.environ:
        sys.exit(f"launch with torchrun, e.g.: torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
    import localmap_fx

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if world % args.dp:
            raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
        if args.dp > 1:
            mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", model_dim))
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(model_dim,))
        dtype = getattr(torch, args.dtype)
        ckpt = None if args.checkpoint == "none" else args.checkpoint
        model = build(args, mesh, dtype, ckpt)
        backend = COMPILE_MODES[args.compile]
        fn = model if backend is None else torch.compile(model, backend=backend(localmap_fx), fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tokens, targets = model.make_inputs(args.batch, args.seq)
        if rank == 0:
            n = sum(p.numel() for p in model.parameters())
            print(f"{name}: {world} ranks, mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} on {device.type}, "
                  f"{n / 1e6:.2f}M parameters, {args.dtype}, checkpoint={args.checkpoint}, compile={args.compile}",
                  flush=True)
        problems = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            out = fn(tokens, targets)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            if step == 0:
                problems = check_first_step(model, tokens, targets, loss, reference, dtype, rank)
            opt.step()
            if rank == 0:
                print(f"  step {step}: loss {loss.to_local().item():.5f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        flag = torch.tensor([float(bool(problems))], device=device)
        dist.broadcast(flag, src=0)
        return int(flag.item() != 0)
    finally:
        dist.destroy_process_group()


def check_first_step(model, tokens, targets, loss, reference, dtype, rank) -> list[str]:
    # full_tensor() is a collective: every rank gathers, rank 0 compares
    weights = {k: v.detach().full_tensor() for k, v in model.named_parameters()}
    grads = {k: v.grad.full_tensor() for k, v in model.named_parameters()}
    t, y = tokens.full_tensor(), targets.full_tensor()
    if rank != 0:
        return []
    w = {k: v.float().cpu().requires_grad_() for k, v in weights.items()}
    ref = reference(model, w, t.cpu(), y.cpu())
    ref.backward()
    tol = TOLERANCE[dtype]
    problems = []
    got = loss.to_local().float().item()
    if abs(got - ref.item()) > tol * (1 + abs(ref.item())):
        problems.append(f"loss {got:.6f} vs reference {ref.item():.6f}")
    worst = 0.0
    for k, g in grads.items():
        err = ((g.float().cpu() - w[k].grad).abs().max() / (1 + w[k].grad.abs().max())).item()
        worst = max(worst, err)
        if err > tol:
            problems.append(f"grad {k} (relative error {err:.2g})")
    verdict = "MISMATCH: " + ", ".join(problems) if problems else "yes"
    print(f"  step 0 loss and gradients match the single-device reference "
          f"(tolerance {tol:g}, worst {worst:.2g}): {verdict}", flush=True)
    return problems
