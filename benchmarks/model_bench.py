"""Compile time and step time of the Llama and MoE models against upstream torch.compile.

    python -m benchmarks.model_bench                 # 2 gloo ranks, writes benchmarks/out/models.{json,md}
    python -m benchmarks.model_bench --quick         # tiny sizes, 2 rounds (smoke test; numbers mean nothing)
    python -m benchmarks.model_bench --docs docs     # also refresh the models section of docs/benchmarks.md

``python -m benchmarks.run`` runs it too (group ``models``).

Each rank builds every model (:mod:`localmap_fx.testing.llama`,
:mod:`localmap_fx.testing.moe`, 1-D mesh of 2 ranks) once per side:

===============  ============================================================
``ours``         ``localmap_fx.local_map`` regions, ``backend="localmap_fx"``
                 (inductor, region bodies outlined: the default)
``ours_inline``  the same, ``localmap_fx.backend(outline=False)``
``torch``        torch's ``local_map``, ``torch.compile(backend="inductor")``
``eager``        ``localmap_fx.local_map`` regions, not compiled
===============  ============================================================

* **Compile time**: wall time of the first training step (forward +
  backward) with every cache cold (``fresh_cache()``, inductor's caches
  disabled), after a warm-up compile of another model; one measurement per
  side, sides in turn.
* **Step time**: a training step (forward + backward, gradients zeroed)
  timed in interleaved rounds (:func:`benchmarks.timing.time_paired`), as
  the median of per-round ratios to ``torch``.
* **Numerics**: the first step's loss and gradients against ``eager``
  (max of |diff| / (1 + max |eager|)).
* **Dynamic sequence length**: whether the side compiles a second sequence
  length with ``mark_dynamic`` (aot_eager inner compiler, to keep it cheap);
  a failure is reported with its exception, never hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .doc_sections import replace_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["model_ranks", "DEFAULTS", "QUICK", "markdown", "write_docs", "main"]

DEFAULTS = {
    "llama": {"vocab": 512, "dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 384, "max_seq": 128},
    "moe": {"vocab": 512, "dim": 128, "n_layers": 4, "n_experts": 8, "top_k": 2, "moe_hidden": 128, "shared_hidden": 128},
    "batch": 4,
    "seq": 64,
    "rounds": 10,
    "calls": 3,
}
QUICK = {
    "llama": {"n_layers": 1},
    "moe": {"n_layers": 1},
    "batch": 2,
    "seq": 8,
    "rounds": 2,
    "calls": 1,
}
SIDES = ("ours", "ours_inline", "torch")
BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"


def _build(which: str, mesh, impl: str, sizes: dict):
    if which == "llama":
        from localmap_fx.testing.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(**sizes), mesh, local_map=impl)
    from localmap_fx.testing.moe import MoE, MoEConfig

    return MoE(MoEConfig(**sizes), mesh, local_map=impl)


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def _backend(side: str, inner: str = "inductor"):
    import localmap_fx

    if side == "ours":
        return "localmap_fx" if inner == "inductor" else localmap_fx.backend(inner)
    if side == "ours_inline":
        return localmap_fx.backend(inner, outline=False)
    return inner


def _impl(side: str) -> str:
    return "torch" if side == "torch" else "localmap_fx"


def _grads(model) -> dict:
    return {k: p.grad.to_local().clone() for k, p in model.named_parameters()}


def _rel_err(a: tuple, b: tuple) -> float:
    pairs = [(a[0], b[0])] + [(a[1][k], b[1][k]) for k in b[1]]
    return max(((x - y).abs().max() / (1 + y.abs().max())).item() for x, y in pairs)


def _warm_up(mesh) -> None:
    # imports, compiler detection: one-time costs not counted for any side
    for side in SIDES:
        torch._dynamo.reset()
        m = _build("llama", mesh, _impl(side), {"n_layers": 1, "dim": 16, "ffn_hidden": 32})
        tokens, targets = m.make_inputs(2, 8)
        _loss(torch.compile(m, backend=_backend(side), fullgraph=True)(tokens, targets)).backward()
    torch._dynamo.reset()


def _dynamic_ok(which, mesh, side, sizes, batch, seq) -> str:
    torch._dynamo.reset()
    m = _build(which, mesh, _impl(side), sizes)
    fn = torch.compile(m, backend=_backend(side, "aot_eager"), fullgraph=True)
    try:
        for s in (seq, 2 * seq):
            tokens, targets = m.make_inputs(batch, s)
            torch._dynamo.mark_dynamic(tokens, 1)
            torch._dynamo.mark_dynamic(targets, 1)
            _loss(fn(tokens, targets)).backward()
        return "yes"
    except Exception as e:  # noqa: BLE001 - reported in the table
        first = str(e).strip().splitlines()
        return f"fails: {type(e).__name__}: {first[0][:80] if first else ''}"
    finally:
        torch._dynamo.reset()


def model_ranks(rank: int, world_size: int, device: str, cfg: dict) -> dict:
    import tempfile

    import torch.distributed as dist
    from torch._inductor import config as iconfig
    from torch._inductor.utils import fresh_cache
    from torch.distributed.device_mesh import init_device_mesh

    from .timing import ratio_stats, summary, time_paired

    torch.set_num_threads(1)
    # a private inductor cache per rank: ranks compiling the same kernel at
    # once must not read each other's half-written files
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"model_bench_rank{rank}_")
    batch, seq = cfg["batch"], cfg["seq"]
    out: dict = {}
    log = cfg.get("log", False) and rank == 0
    for which in ("llama", "moe"):
        sizes = cfg[which]
        mesh = init_device_mesh(device, (world_size,), mesh_dim_names=("tp" if which == "llama" else "ep",))
        if which == "llama":
            if log:
                print("[model_bench] warm-up", flush=True)
            _warm_up(mesh)
        eager_m = _build(which, mesh, "localmap_fx", sizes)
        tokens, targets = eager_m.make_inputs(batch, seq)
        _loss(eager_m(tokens, targets)).backward()
        eager = (_loss(eager_m(tokens, targets)).to_local().detach(), _grads(eager_m))
        eager_m.zero_grad()

        models, fns, compile_s, err = {}, {}, {}, {}
        for side in SIDES:
            if log:
                print(f"[model_bench] {which}: cold compile {side}", flush=True)
            torch._dynamo.reset()
            m = _build(which, mesh, _impl(side), sizes)
            fn = torch.compile(m, backend=_backend(side), fullgraph=True)
            dist.barrier()
            with fresh_cache(), iconfig.patch(force_disable_caches=True):
                t0 = time.perf_counter()
                loss = _loss(fn(tokens, targets))
                loss.backward()
                compile_s[side] = time.perf_counter() - t0
            err[side] = _rel_err((loss.to_local().detach(), _grads(m)), eager)
            models[side], fns[side] = m, fn
        models["eager"], fns["eager"] = eager_m, eager_m

        def stepper(side, models=models, fns=fns, tokens=tokens, targets=targets):
            m, fn = models[side], fns[side]

            def step():
                m.zero_grad(set_to_none=True)
                _loss(fn(tokens, targets)).backward()

            return step

        if log:
            print(f"[model_bench] {which}: step time", flush=True)
        paired = time_paired(
            {s: stepper(s) for s in (*SIDES, "eager")},
            rounds=cfg["rounds"],
            calls=cfg["calls"],
            warmup=1,
            sync=dist.barrier,
        )
        clock = "wall"
        if log:
            print(f"[model_bench] {which}: dynamic sequence length", flush=True)
        out[which] = {
            "sizes": sizes,
            "batch": batch,
            "seq": seq,
            "params": sum(p.numel() for p in eager_m.parameters()),
            "compile_s": compile_s,
            "step_ms": {s: summary(paired.per_call(s, clock), 1e3) for s in (*SIDES, "eager")},
            "step_ratio_vs_torch": {s: ratio_stats(paired.ratios(s, "torch", clock)) for s in (*SIDES, "eager")},
            "numerics_rel_err": err,
            "dynamic_seq": {s: _dynamic_ok(which, mesh, s, sizes, batch, seq) for s in SIDES},
        }
        torch._dynamo.reset()
    return out


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #

_LABEL = {
    "ours": 'ours, `backend="localmap_fx"`',
    "ours_inline": "ours, `outline=False`",
    "torch": "upstream: torch `local_map` + inductor",
    "eager": "ours, eager (not compiled)",
}


def markdown(res: dict, machine: str = "", quick: bool = False) -> str:
    lines = []
    for which, r in res.items():
        sz = ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
        lines += [
            f"**{which}** ({r['params'] / 1e6:.2f}M parameters; {sz}; batch {r['batch']} x seq {r['seq']}; 2 gloo ranks)",
            "",
            "| side | cold compile (fwd+bwd), s | step, ms (median [min, max]) | step / upstream | "
            "first-step error vs eager | dynamic seq (mark_dynamic) |",
            "|---|---|---|---|---|---|",
        ]
        for s in (*SIDES, "eager"):
            ms = r["step_ms"][s]
            ratio = r["step_ratio_vs_torch"][s]
            comp = f"{r['compile_s'][s]:.1f}" if s in r["compile_s"] else "–"
            errv = r["numerics_rel_err"].get(s)
            errs = "reference" if s == "eager" else f"{errv:.1e}"
            dyn = r["dynamic_seq"].get(s, "–")
            lines.append(
                f"| {_LABEL[s]} | {comp} | {ms['median']:.1f} [{ms['min']:.1f}, {ms['max']:.1f}] | "
                f"{ratio['median']:.2f} | {errs} | {dyn} |"
            )
        lines.append("")
    if machine:
        lines.append(machine + (" — QUICK RUN, not a measurement" if quick else ""))
    return "\n".join(lines).rstrip() + "\n"


def write_docs(md: str, docs: str) -> None:
    replace_section(os.path.join(docs, "benchmarks.md"), BEGIN, END, md)


def run(quick: bool = False, device: str = "cpu", backend: str = "gloo", log: bool = False) -> dict:
    """Rank 0's measurements (``log``: rank 0 prints progress to its log file)."""
    from localmap_fx.testing.dist import run_ranks

    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    if quick:
        for k, v in QUICK.items():
            if isinstance(v, dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    cfg["log"] = log
    ranks = run_ranks(model_ranks, 2, backend=backend, device=device, timeout=3600, args=(cfg,))
    return ranks[0]


def _machine_line(seconds: float) -> str:
    import platform

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return (
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"load average at end {load}; run time {seconds:.0f} s."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    p.add_argument("--docs", default=None, help="also refresh the models section of DOCS/benchmarks.md")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    res = run(quick=a.quick)
    md = markdown(res, _machine_line(time.perf_counter() - t0), a.quick)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "models.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(a.out, "models.md"), "w") as f:
        f.write(md)
    if a.docs:
        write_docs(md, a.docs)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
