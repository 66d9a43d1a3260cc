"""benchmarks.timing: paired rounds and pinning a rank to a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.timing import pin_rank, time_paired

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_paired_rounds_time_every_side_per_call():
    calls = {"a": 0, "b": 0}

    def side(name):
        def run():
            calls[name] += 1

        return run

    paired = time_paired({"a": side("a"), "b": side("b")}, rounds=4, calls=3, warmup=1)
    assert calls == {"a": 13, "b": 13}  # one warm-up call, then 4 rounds of 3
    assert len(paired.per_call("a", "wall")) == 4
    assert len(paired.ratios("a", "b", "cpu")) == 4


def test_the_calling_thread_is_pinned_to_a_cpu_of_its_own():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this platform cannot pin a process to a CPU (no os.sched_setaffinity)")
    allowed = sorted(os.sched_getaffinity(0))
    # in a child: pinning this process would pin the rest of the suite
    code = ("import os; from benchmarks.timing import pin_rank; "
            "print(pin_rank(1, 2), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    if len(allowed) < 2:
        assert out.stdout.split()[0] == "None"
    else:
        assert out.stdout.strip() == f"{allowed[1]} [{allowed[1]}]"


def test_more_ranks_than_cpus_are_left_unpinned():
    assert pin_rank(0, 10**6) is None
