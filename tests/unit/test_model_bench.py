"""The model benchmark's report and docs writer, on a synthetic record (no timing asserted)."""

from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import model_bench  # noqa: E402


def _record() -> dict:
    sides = ("ours", "ours_inline", "torch", "eager")
    stat = {"median": 2.0, "min": 1.5, "max": 3.0, "n": 2}
    return {
        "llama": {
            "sizes": {"dim": 16},
            "batch": 2,
            "seq": 8,
            "params": 1234,
            "compile_s": {"ours": 3.0, "ours_inline": 2.5, "torch": 2.0},
            "step_ms": {s: stat for s in sides},
            "step_ratio_vs_torch": {s: {**stat, "median": 1.1} for s in sides},
            "numerics_rel_err": {"ours": 0.1, "ours_inline": 1e-8, "torch": 0.0},
            "dynamic_seq": {"ours": "fails: KeyError: out_2", "ours_inline": "yes", "torch": "yes"},
        }
    }


def test_markdown_has_every_side_and_says_when_ours_fails():
    md = model_bench.markdown(_record(), "Machine: test", quick=True)
    assert '| ours, `backend="localmap_fx"` | 3.0 | 2.0 [1.5, 3.0] | 1.10 | 1.0e-01 | fails: KeyError: out_2 |' in md
    assert "| upstream: torch `local_map` + inductor | 2.0 |" in md
    assert "| ours, eager (not compiled) | – |" in md
    assert md.rstrip().endswith("QUICK RUN, not a measurement")


def test_write_docs_replaces_only_the_models_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"head\n{model_bench.BEGIN}\nold\n{model_bench.END}\ntail\n")
    model_bench.write_docs("new table\n", str(tmp_path))
    assert doc.read_text() == f"head\n{model_bench.BEGIN}\nnew table\n{model_bench.END}\ntail\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        model_bench.write_docs("x", str(tmp_path))
