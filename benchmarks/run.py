"""Run every benchmark and write results.json, results.md and results.png.

    python -m benchmarks.run                      # everything, CPU + gloo (and CUDA/NCCL if 2 GPUs)
    python -m benchmarks.run --quick              # a few iterations of every code path
    python -m benchmarks.run --docs docs          # also update docs/benchmarks.md and docs/benchmarks.png

Each group runs in fresh processes: P1/P2 and P3/P4/P7/memory on 2 ranks of
a real process group (``localmap_fx.testing.dist.run_ranks``), P5 and P6 in one
spawned process each, on a fake process group (graph-level measurements).
See docs/benchmarks.md for what each figure means.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["main", "run_all", "TARGETS"]

# id -> (what, target, direction); ratio targets are upper bounds
TARGETS = {
    "P1_fwd": ("eager per call / torch local_map, forward", 0.60),
    "P1_fwd_bwd": ("eager per call / torch local_map, forward+backward", 0.75),
    "P1_spmd_fwd": ("eager spmd_types=True per call / torch's, forward", 0.60),
    "P2": ("eager spmd_types=True extra cost / torch's extra cost", 0.50),
    "P3": ("compiled step / hand-written local tensors + funcol (inductor)", 1.10),
    "P4": ("compiled step / upstream torch.compile of torch local_map", 1.00),
    "P5_ratio": ("cold compile, 64-layer TP stack / upstream", 0.50),
    "P5_ratio_layer": ("cold compile, 64-layer one-region stack / upstream", 0.50),
    "P5_growth": ("our cold compile time, 64 layers / 8 layers", 1.50),
    "P6_collectives": ("collectives per redistribute / DTensor planner", 1.00),
    "P6_bytes": ("bytes per redistribute / DTensor planner", 1.00),
    "P6_redundant": ("redundant collectives + round trips between matching regions", 0),
    "P7": ("compiled with static type check / without", 1.02),
    "memory": ("peak step memory, compiled / upstream compiled", None),
    "warm_start": ("warm start (second process, caches on) / upstream warm start", None),
    "S1": ("`import localmap_fx` after `import torch`, seconds", 0.30),
    "S2": ("`python -m localmap_fx inspect DIR` on a 2-region dump, seconds", 1.00),
}

# P4 needs >= 4 TP layers (issue #10); with fewer than AUTO_MIN_LAYERS the
# default share_layers="auto" compiles them as one graph.
DEFAULTS = {
    "eager": {"batch": 64, "d": 64, "hidden": 128, "rounds": 60, "calls": 40},
    "compiled": {"n_blocks": 4, "batch": 32, "d": 128, "hidden": 256, "rounds": 60, "calls": 10},
    "compile_time": {"plan": {"tp": [8, 16, 32, 64], "layer": [8, 64]}, "repeats": 2},
    "warm_start": {"model": "tp", "layers": 16},
    "startup": {"repeats": 7},
}
QUICK = {
    "eager": {"batch": 16, "d": 16, "hidden": 32, "rounds": 2, "calls": 2},
    "compiled": {"n_blocks": 2, "batch": 8, "d": 16, "hidden": 32, "rounds": 2, "calls": 1},
    "compile_time": {"plan": {"tp": [2, 4], "layer": [2, 4]}, "repeats": 1},
    "warm_start": {"model": "tp", "layers": 2},
    "startup": {"repeats": 1},
}


def _in_fresh_process(fn, *args):
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args).result()


def _machine() -> dict:
    import torch

    try:
        from importlib.metadata import version

        spmd_version = version("spmd-types")
    except Exception:  # noqa: BLE001
        spmd_version = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            if m:
                cpu = m.group(1).strip()
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "spmd_types": spmd_version,
        "platform": platform.platform(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if info["cuda_devices"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def run_all(out_dir: str, quick: bool = False, only: set[str] | None = None, log=print) -> dict:
    """Run the selected groups ("eager", "compiled", "compile_time", "redistribute", "startup", "models")."""
    import torch

    from localmap_fx.testing.dist import run_ranks

    from .compile_time import compile_time_worker, warm_start_worker
    from .compiled_bench import compiled_ranks
    from .eager_bench import eager_ranks
    from .redistribute_bench import redistribute_worker
    from .startup import startup_worker

    cfg = QUICK if quick else DEFAULTS
    groups = only or {"eager", "compiled", "compile_time", "redistribute", "startup", "models"}
    devices = [("cpu", "gloo")]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        devices.append(("cuda", "nccl"))
    results: dict = {
        "machine": _machine(),
        "quick": quick,
        "config": cfg,
        "loadavg_start": _loadavg(),
        "seconds": {},
    }

    def timed(name, fn, *args, **kw):
        log(f"[benchmarks] {name} ...")
        t0 = time.perf_counter()
        r = fn(*args, **kw)
        results["seconds"][name] = round(time.perf_counter() - t0, 1)
        log(f"[benchmarks] {name} done in {results['seconds'][name]} s")
        return r

    for device, backend in devices:
        if "eager" in groups:
            ranks = timed(
                f"eager_{device}",
                run_ranks,
                eager_ranks,
                2,
                backend=backend,
                device=device,
                timeout=600,
                args=(cfg["eager"],),
            )
            results[f"eager_{device}"] = {"rank0": ranks[0], "rank1": ranks[1]}
        if "compiled" in groups:
            ranks = timed(
                f"compiled_{device}",
                run_ranks,
                compiled_ranks,
                2,
                backend=backend,
                device=device,
                timeout=900,
                args=(cfg["compiled"],),
            )
            results[f"compiled_{device}"] = {"rank0": ranks[0], "rank1": ranks[1]}
    if "compile_time" in groups:
        ct = cfg["compile_time"]
        results["compile_time"] = timed(
            "compile_time", _in_fresh_process, compile_time_worker, ct["plan"], ct["repeats"]
        )
        ws = cfg["warm_start"]
        results["warm_start"] = timed(
            "warm_start", _in_fresh_process, warm_start_worker, ws["model"], ws["layers"]
        )
    if "redistribute" in groups:
        results["redistribute"] = timed(
            "redistribute", _in_fresh_process, redistribute_worker, quick
        )
    if "startup" in groups:
        # subprocesses of its own: nothing else runs meanwhile
        results["startup"] = timed("startup", startup_worker, cfg["startup"]["repeats"])
    if "models" in groups:
        # Llama / MoE compile and step time vs upstream (benchmarks/model_bench.py)
        from . import model_bench

        results["models"] = timed("models", model_bench.run, quick)
    results["loadavg_end"] = _loadavg()
    results["figures"] = figures(results)
    return results


# --------------------------------------------------------------------------- #
# Figures: one row per target
# --------------------------------------------------------------------------- #


def _row(fid, value, lo, hi, detail, clock=None, device="cpu", what=None):
    what = what or TARGETS[fid][0]
    target = TARGETS[fid][1]
    met = None if target is None else value <= target
    return {
        "id": fid,
        "device": device,
        "what": what,
        "value": value,
        "min": lo,
        "max": hi,
        "target": target,
        "met": met,
        "clock": clock,
        "detail": detail,
    }


def figures(results: dict) -> list[dict]:
    rows: list[dict] = []
    for device in ("cpu", "cuda"):
        eager = results.get(f"eager_{device}")
        if eager:
            r = eager["rank0"]
            clock = "cpu"
            for fid in ("P1_fwd", "P1_fwd_bwd", "P1_spmd_fwd"):
                f = r[fid][clock]
                rows.append(
                    _row(
                        fid,
                        f["ratio"]["median"],
                        f["ratio"]["min"],
                        f["ratio"]["max"],
                        f"ours {f['ours_us']['median']:.1f} µs, torch {f['torch_us']['median']:.1f} µs "
                        f"per step of 2 calls; wall-clock ratio {r[fid]['wall']['ratio']['median']:.2f}; "
                        f"results equal: {r['results_equal']}",
                        clock,
                        device,
                    )
                )
            f = r["P2"][clock]
            rows.append(
                _row(
                    "P2",
                    f["ratio"]["median"],
                    f["ratio"]["min"],
                    f["ratio"]["max"],
                    f"extra per step of 2 calls: ours {f['ours_extra_us']['median']:.1f} µs, "
                    f"torch {f['torch_extra_us']['median']:.1f} µs; wall-clock ratio "
                    f"{r['P2']['wall']['ratio']['median']:.2f}",
                    clock,
                    device,
                )
            )
        comp = results.get(f"compiled_{device}")
        if comp:
            r = comp["rank0"]
            clock = "wall"
            for fid, num, den in (("P3", "ours", "hand"), ("P4", "ours", "torch"), ("P7", "ours_spmd", "ours_spmd_off")):
                f = r[fid][clock]
                rows.append(
                    _row(
                        fid,
                        f["ratio"]["median"],
                        f["ratio"]["min"],
                        f["ratio"]["max"],
                        f"{num} {f[num + '_us']['median']:.0f} µs, {den} {f[den + '_us']['median']:.0f} µs "
                        f"per step; CPU-time ratio {r[fid]['cpu']['ratio']['median']:.2f}; "
                        f"numerics match: {r['numerics_match'][num] and r['numerics_match'][den]}"
                        + (
                            f"; graphs given to inductor identical: {r['P7_graphs_identical']}"
                            if fid == "P7"
                            else ""
                        )
                        + "".join(
                            f"; {label} {r['step_us'][clock][v]['median']:.0f} µs"
                            for v, label in (("ours_outlined", "ours with share_layers=False (bodies outlined)"),
                                             ("ours_shared", "ours with share_layers=True (one piece per layer)"))
                            if fid == "P4" and v in r.get("step_us", {}).get(clock, {})
                        ),
                        clock,
                        device,
                    )
                )
            mem = r["memory_bytes"]
            ratio = mem["ours"] / mem["torch"] if mem["torch"] else float("nan")
            rows.append(
                _row(
                    "memory",
                    ratio,
                    ratio,
                    ratio,
                    "peak bytes above step start: "
                    + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in mem.items()),
                    None,
                    device,
                )
            )
    ct = results.get("compile_time")
    if ct:
        rows += _compile_time_rows(ct, results.get("warm_start"))
    rd = results.get("redistribute")
    if rd:
        c, b = rd["collectives"], rd["bytes"]
        cr = c["ours"] / c["dtensor"] if c["dtensor"] else 1.0
        br = b["ours"] / b["dtensor"] if b["dtensor"] else 1.0
        worst = max(
            (
                r["ours"]["collectives"] / max(1, r["dtensor"]["collectives"])
                for r in rd["transitions"]
                if "ok" in r
            ),
            default=1.0,
        )
        rows.append(
            _row(
                "P6_collectives",
                cr,
                cr,
                worst,
                f"{rd['n_measured']} transitions ({rd['n_skipped']} refused by DTensor), "
                f"{rd['n_ok']} with ours <= DTensor; {c['ours']} vs {c['dtensor']} collectives",
                None,
            )
        )
        rows.append(_row("P6_bytes", br, br, br, f"{b['ours']} vs {b['dtensor']} bytes", None))
        rows.append(
            _row(
                "P6_redundant",
                rd["adjacent_redundant"],
                rd["adjacent_redundant"],
                rd["adjacent_redundant"],
                f"{len(rd['adjacent'])} adjacent region pairs with matching placements",
                None,
            )
        )
    st = results.get("startup")
    if st:
        imp = st["import_s"]
        s1 = imp["localmap_fx"]
        rows.append(
            _row(
                "S1",
                s1["median"],
                s1["min"],
                s1["max"],
                f"import torch {imp['torch']['median']:.2f} s; after it, `from localmap_fx import local_map` "
                f"{imp['local_map']['median']:.2f} s and `backend` {imp['backend']['median']:.2f} s "
                f"(import torch.distributed.tensor alone {imp['dtensor']['median']:.2f} s); Dynamo/Inductor "
                f"imported by any: {any(v for k, v in st['imports_compiler'].items() if k != 'dtensor')}; "
                f"{st['repeats']} fresh interpreters each",
                "wall",
            )
        )
        cli = st["cli_s"]
        rows.append(
            _row(
                "S2",
                cli["median"],
                cli["min"],
                cli["max"],
                f"whole command, interpreter start included; imports torch: {st['cli_imports_torch']}",
                "wall",
            )
        )
    return rows


def _ct_series(ct: dict, model: str) -> dict[tuple[str, int], list[dict]]:
    out = {}
    for k, v in ct.items():
        m, rest = k.split("/", 1) if "/" in k else ("layer", k)
        if m == model:
            impl, n = rest.rsplit("_", 1)
            out[(impl, int(n))] = v
    return out


def _compile_time_rows(ct: dict, warm: dict | None) -> list[dict]:
    rows = []
    for model, fid, label in (("tp", "P5_ratio", "TP stack"), ("layer", "P5_ratio_layer", "one-region stack")):
        series = _ct_series(ct, model)
        if not series:
            continue
        layers = sorted({n for _, n in series})
        lo_n, hi_n = layers[0], layers[-1]
        ours_hi = [m["total_s"] for m in series[("ours", hi_n)]]
        torch_hi = [m["total_s"] for m in series[("torch", hi_n)]]
        ratios = [a / b for a, b in zip(ours_hi, torch_hi)]
        o = series[("ours", hi_n)][0]
        rows.append(
            _row(
                fid,
                statistics.median(ratios),
                min(ratios),
                max(ratios),
                f"{hi_n} layers: ours {statistics.median(ours_hi):.1f} s, upstream "
                f"{statistics.median(torch_hi):.1f} s ({len(ratios)} cold compiles each); "
                f"AOT forward graphs ours {o.get('aot_forward_graphs')}, kernels ours {o['kernels']} "
                f"vs upstream {series[('torch', hi_n)][0]['kernels']}",
                "wall",
                what=f"cold compile (fwd+bwd), {label} of {hi_n} layers / upstream",
            )
        )
        if model != "tp" and "P5_growth" in {r["id"] for r in rows}:
            continue
        ours_lo = [m["total_s"] for m in series[("ours", lo_n)]]
        torch_lo = [m["total_s"] for m in series[("torch", lo_n)]]
        growth = [a / b for a, b in zip(ours_hi, ours_lo)]
        t_growth = statistics.median(torch_hi) / statistics.median(torch_lo)
        rows.append(
            _row(
                "P5_growth",
                statistics.median(growth),
                min(growth),
                max(growth),
                f"ours {statistics.median(ours_lo):.1f} s -> {statistics.median(ours_hi):.1f} s; "
                f"upstream {statistics.median(torch_lo):.1f} s -> {statistics.median(torch_hi):.1f} s "
                f"(x{t_growth:.2f})",
                "wall",
                what=f"our cold compile time, {label}, {hi_n} layers / {lo_n} layers",
            )
        )
    if warm:
        r = warm["ours"]["warm_s"] / warm["torch"]["warm_s"]
        rows.append(
            _row(
                "warm_start",
                r,
                r,
                r,
                f"second process, caches on: ours {warm['ours']['warm_s']:.1f} s (cold {warm['ours']['cold_s']:.1f} s), "
                f"upstream {warm['torch']['warm_s']:.1f} s (cold {warm['torch']['cold_s']:.1f} s)",
                "wall",
                what="warm start (first fwd+bwd, caches filled by a first process) / upstream",
            )
        )
    return rows


BREAKDOWN = ("dynamo_s", "aot_s", "inductor_s", "cpp_compile_s")


def breakdown_markdown(ct: dict, model: str = "tp") -> str:
    """Per side and layer count: median seconds of each compile phase."""
    series = _ct_series(ct, model)
    if not series:
        return ""
    lines = [
        "| side | layers | total | Dynamo | AOT | Inductor | C++ compile (summed over threads) | C++ files | kernels | AOT fw graphs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (impl, n) in sorted(series, key=lambda k: (k[1], k[0])):
        ms = series[(impl, n)]

        def med(k, ms=ms):
            vals = [m[k] for m in ms if m.get(k) is not None]
            return statistics.median(vals) if vals else None

        cells = [impl, n, med("total_s"), *(med(k) for k in BREAKDOWN), med("cpp_files"), med("kernels"),
                 med("aot_forward_graphs") if impl == "ours" else None]
        lines.append("| " + " | ".join("-" if c is None else _fmt(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def breakdown_png(ct: dict, model: str = "tp") -> bytes | None:
    from .png import Bar, bar_chart_png

    series = _ct_series(ct, model)
    if not series:
        return None
    bars = []
    for (impl, n) in sorted(series, key=lambda k: (k[1], k[0])):
        ms = series[(impl, n)]
        # on a ratio axis: seconds / upstream's total at the same layer count
        ref = statistics.median(m["total_s"] for m in series[("torch", n)])
        for k in ("total_s",) + BREAKDOWN:
            v = statistics.median(m[k] for m in ms)
            name = k[:-2].replace("_", " ").upper()
            bars.append(Bar(f"{impl.upper()} {n} {name}", v / ref, v / ref, v / ref, None, None, f"{v:.1f} S"))
    return bar_chart_png(
        bars,
        f"COLD COMPILE PER PHASE / UPSTREAM TOTAL, {model.upper()} STACK",
        x_max=1.5,
        footer="OURS = LOCALMAP_FX, TORCH = UPSTREAM LOCAL_MAP + INDUCTOR; TEXT: SECONDS",
    )


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "| figure | device | what | median | min | max | target | met | details |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["figures"]:
        target = "report" if r["target"] is None else f"≤ {_fmt(r['target'])}"
        met = "–" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(
            f"| {r['id']} | {r['device']} | {r['what']} | {_fmt(r['value'])} | {_fmt(r['min'])} | "
            f"{_fmt(r['max'])} | {target} | {met} | {r['detail']} |"
        )
    total = sum(results["seconds"].values())
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, Python {m['python']}, torch {m['torch']}, "
        f"spmd-types {m['spmd_types']}, {m['platform']}"
        + (f", {m['cuda_devices']}× {m.get('gpu')}" if m["cuda_devices"] else "")
        + f". Load average at start {results['loadavg_start']}, at end {results['loadavg_end']}. "
        f"Run time {total:.0f} s ({', '.join(f'{k} {v} s' for k, v in results['seconds'].items())})"
        + (" — QUICK RUN, not a measurement" if results["quick"] else "")
        + ".",
    ]
    ct = results.get("compile_time")
    if ct and _ct_series(ct, "tp"):
        lines += ["", "Cold compile breakdown, TP stack (seconds, median; plot: `benchmarks_compile.png`):", ""]
        lines.append(breakdown_markdown(ct, "tp").rstrip("\n"))
    return "\n".join(lines) + "\n"


def png(results: dict) -> bytes:
    from .png import Bar, bar_chart_png

    bars = []
    for r in results["figures"]:
        if r["id"] == "P6_redundant" or r["id"].startswith("S"):
            continue  # not ratios (startup figures are seconds)
        label = r["id"].replace("_", " ") + ("" if r["device"] == "cpu" else " CUDA")
        tgt = "" if r["target"] is None else f" (<= {r['target']:.2f})"
        bars.append(Bar(label, r["value"], r["min"], r["max"], r["target"], r["met"], f"{r['value']:.2f}{tgt}"))
    top = max((b.value for b in bars), default=1.0)
    return bar_chart_png(
        bars,
        "LOCALMAP_FX / BASELINE, MEDIAN RATIO (LOWER IS BETTER)",
        x_max=2.0 if top <= 1.9 else 3.0,
        footer="GREEN MET, RED MISSED, BLUE NO TARGET; ORANGE TARGET; WHISKER MIN-MAX",
    )


def write(results: dict, out_dir: str, docs: str | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = markdown(results)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, "results.png"), "wb") as f:
        f.write(png(results))
    ct_png = breakdown_png(results["compile_time"]) if results.get("compile_time") else None
    if ct_png is not None:
        with open(os.path.join(out_dir, "compile_breakdown.png"), "wb") as f:
            f.write(ct_png)
    if docs and "models" in results:
        from .model_bench import markdown as models_markdown
        from .model_bench import write_docs

        write_docs(models_markdown(results["models"], "See the main table's machine line.", results["quick"]), docs)
    if docs:
        shutil.copyfile(os.path.join(out_dir, "results.png"), os.path.join(docs, "benchmarks.png"))
        if ct_png is not None:
            shutil.copyfile(os.path.join(out_dir, "compile_breakdown.png"), os.path.join(docs, "benchmarks_compile.png"))
        from .doc_sections import replace_section

        replace_section(os.path.join(docs, "benchmarks.md"), "<!-- results:begin -->", "<!-- results:end -->", md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    p.add_argument("--docs", default=None, help="also update DOCS/benchmarks.md and DOCS/benchmarks.png")
    p.add_argument("--quick", action="store_true", help="a few iterations only (smoke test)")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated groups: eager, compiled, compile_time, redistribute, startup, models",
    )
    a = p.parse_args(argv)
    only = set(a.only.split(",")) if a.only else None
    t0 = time.perf_counter()
    results = run_all(a.out, quick=a.quick, only=only)
    write(results, a.out, a.docs)
    print(markdown(results))
    print(f"[benchmarks] wrote {a.out}/results.json, results.md, results.png in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
