"""Smoke test of the benchmark code paths (1-2 iterations, no timing asserted).

Runs the eager (2 gloo processes) and redistribute groups for real in quick
mode, feeds the report writers a synthetic record of the compiled and
compile-time groups, and checks the files and fields the docs rely on.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch.distributed")

# benchmarks/ is a package next to tests/ (not installed): pytest puts the
# repository root on sys.path (pythonpath in pyproject.toml).
from benchmarks import run as bench

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


def _synthetic_compiled() -> dict:
    pair = {
        clock: {
            "ratio": {"median": 1.0, "min": 0.9, "max": 1.1, "n": 2},
            **{f"{n}_us": {"median": 10.0, "min": 9.0, "max": 11.0, "n": 2} for n in names},
        }
        for clock in ("wall", "cpu")
        for names in [("ours", "hand", "torch", "ours_spmd", "ours_spmd_off")]
    }
    return {
        "rank0": {
            "numerics_match": {n: True for n in ("ours", "torch", "hand", "ours_spmd", "ours_spmd_off")},
            "P3": pair,
            "P4": pair,
            "P7": pair,
            "P7_graphs_identical": True,
            "memory_bytes": {"ours": 100, "torch": 100, "hand": 90, "ours_spmd": 100, "ours_spmd_off": 100},
        }
    }


def _synthetic_compile_time() -> dict:
    m = {"total_s": 1.0, "kernels": 3, "aot_forward_graphs": 2, "dynamo_s": 0.1, "aot_s": 0.2,
         "inductor_s": 0.3, "cpp_compile_s": 0.4, "cpp_files": 2}
    return {f"{model}/{impl}_{n}": [m] for model in ("tp", "layer") for impl in ("ours", "torch") for n in (2, 4)}


def _synthetic_warm_start() -> dict:
    return {"ours": {"cold_s": 2.0, "warm_s": 1.0}, "torch": {"cold_s": 2.0, "warm_s": 1.0}}


def test_quick_run_writes_table_json_and_png(tmp_path):
    results = bench.run_all(str(tmp_path), quick=True, only={"eager", "redistribute"}, log=lambda *_: None)
    results["compiled_cpu"] = _synthetic_compiled()
    results["compile_time"] = _synthetic_compile_time()
    results["warm_start"] = _synthetic_warm_start()
    results["figures"] = bench.figures(results)

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("intro\n<!-- results:begin -->\nSTALE-TABLE\n<!-- results:end -->\nrest\n")
    bench.write(results, str(tmp_path / "out"), str(docs))

    data = json.loads((tmp_path / "out" / "results.json").read_text())
    ids = {f["id"] for f in data["figures"]}
    assert {
        "P1_fwd",
        "P1_fwd_bwd",
        "P1_spmd_fwd",
        "P2",
        "P3",
        "P4",
        "P5_ratio",
        "P5_ratio_layer",
        "P5_growth",
        "warm_start",
        "P6_collectives",
        "P6_bytes",
        "P6_redundant",
        "P7",
        "memory",
    } <= ids
    for f in data["figures"]:
        assert {"value", "min", "max", "target", "met", "detail"} <= f.keys()
    eager = data["eager_cpu"]["rank0"]
    assert eager["results_equal"] is True
    assert eager["P1_fwd"]["cpu"]["ratio"]["n"] >= 1
    red = data["redistribute"]
    assert red["n_measured"] >= 1 and red["n_ok"] == red["n_measured"]
    assert red["adjacent_redundant"] == 0

    png = (tmp_path / "out" / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert (docs / "benchmarks.png").read_bytes() == png
    md = (docs / "benchmarks.md").read_text()
    assert md.startswith("intro\n<!-- results:begin -->\n| figure |")
    assert "STALE-TABLE" not in md and md.endswith("<!-- results:end -->\nrest\n")
    assert os.path.exists(tmp_path / "out" / "results.md")
    # the compile-time breakdown: a table under the figures and its plot
    assert "| side | layers | total | Dynamo | AOT | Inductor | C++ compile (summed over threads) |" in md
    assert "| ours | 4 | 1.00 | 0.10 | 0.20 | 0.30 | 0.40 | 2 | 3 | 2 |" in md
    assert (docs / "benchmarks_compile.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_marked_bench_builds_every_column():
    """Its columns come from depth_bench's ``build``, whose signature moved
    once under it unnoticed: each column is built (compiled lazily, not run)."""
    from benchmarks import marked_bench

    from helpers import mesh_1d

    for column in sorted(set(marked_bench.COLD) | set(marked_bench.STEADY)):
        step, zero, leaves = marked_bench.build(mesh_1d(), column, 2, batch=4, d=8, hidden=16)
        assert callable(step) and callable(zero) and leaves, column


def test_marked_bench_adds_dynamo_to_upstreams_block_compile():
    """A marked compile with a backend as fast as upstream's: per repeat, the ``dynamo_only`` column's
    CPU plus upstream regional's CPU less its Dynamo phase, over upstream
    regional's CPU; the table prints it beside the target's column."""
    from benchmarks import marked_bench

    def rec(cpu, children, dynamo):
        return {"total_s": cpu, "cpu_s": cpu, "children_cpu_s": children, "dynamo_s": dynamo,
                "aot_s": 0.0, "inductor_s": 0.0, "graphs": 1}

    cold = {"upstream_regional/4": [rec(3.0, 1.0, 0.5), rec(2.0, 2.0, 1.0)],
            "dynamo_only/4": [rec(2.0, 0.0, 2.0), rec(1.0, 0.0, 1.0)],
            "marked/4": [rec(5.0, 1.0, 2.0)] * 2, "ours_whole/4": [rec(9.0, 1.0, 3.0)] * 2}
    # (2 + 4 - 0.5) / 4 = 1.375 and (1 + 4 - 1) / 4 = 1.0: median 1.1875
    assert marked_bench._as_fast_as_upstream(cold, 4) == pytest.approx(1.1875)
    text = marked_bench.table({"depths": [4], "cold": cold})
    assert "| as fast as upstream: dynamo_only + upstream_regional's block compile | 4 | | | | | | | 1.19 |" in text
    assert "| dynamo_only | 4 |" in text
