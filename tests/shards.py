"""Split the suite into shards that run at once (``scripts/test.sh`` runs one per CPU).

``--shard K/N`` keeps the test modules of shard ``K`` (1-based) of ``N``.
Whole modules go to a shard, so a module-scoped fixture is built once.
Modules are dealt out longest first, each to the shard with the least time
so far (longest-processing-time order), by the seconds each module took in a
measured run (``tests/module_seconds.json``); a module missing there is
weighed by its number of tests at the median seconds per test of the others.
Every shard collects the same tests, so each computes the same split.

``--module-seconds-out FILE`` writes the seconds each module of this run
took (setup, call and teardown of its tests): ``scripts/test.sh
--update-times`` merges the shards' files into ``tests/module_seconds.json``.
A stale table only unbalances the shards; it never changes what runs.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Mapping, Sequence

import pytest

TIMES = pathlib.Path(__file__).with_name("module_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only shard K of N (whole test modules, balanced by tests/module_seconds.json)")
    parser.addoption("--module-seconds-out", default=None, metavar="FILE",
                     help="write the seconds each test module took in this run to FILE (JSON)")


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3); raises ``pytest.UsageError`` naming the option otherwise."""
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {text!r}: expected K/N with 1 <= K <= N, e.g. --shard 1/2")
    return k, n


def deal(counts: Mapping[str, int], seconds: Mapping[str, float], n: int) -> dict[str, int]:
    """Module -> its shard (0-based) of ``n``: longest first, each to the least loaded shard.

    ``counts``: the collected tests per module; ``seconds``: measured module
    times (a module absent there weighs its count times the median seconds
    per test of the measured ones).  Ties break by module name, so the
    deal depends on nothing but its arguments.
    """
    per_test = [seconds[m] / c for m, c in counts.items() if m in seconds and c]
    rate = statistics.median(per_test) if per_test else 1.0
    weight = {m: seconds.get(m, c * rate) for m, c in counts.items()}
    loads = [0.0] * n
    out: dict[str, int] = {}
    for m in sorted(weight, key=lambda m: (-weight[m], m)):
        k = min(range(n), key=lambda s: (loads[s], s))
        out[m] = k
        loads[k] += weight[m]
    return out


def _module(item, root: pathlib.Path) -> str:
    path = pathlib.Path(str(item.path))
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def _read_times() -> dict[str, float]:
    try:
        data = json.loads(TIMES.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # trylast: after conftest's own selection (--quick), so every shard deals
    # out the same tests
    text = config.getoption("--shard")
    if text is None:
        return
    k, n = parse_shard(text)
    root = pathlib.Path(str(config.rootpath))
    counts: dict[str, int] = {}
    for it in items:
        m = _module(it, root)
        counts[m] = counts.get(m, 0) + 1
    shard_of = deal(counts, _read_times(), n)
    kept = [it for it in items if shard_of[_module(it, root)] == k - 1]
    dropped = [it for it in items if shard_of[_module(it, root)] != k - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


class _Recorder:
    """Adds each test phase's duration to its module's total."""

    def __init__(self, config) -> None:
        self.root = pathlib.Path(str(config.rootpath))
        self.seconds: dict[str, float] = {}
        self.out = config.getoption("--module-seconds-out")

    def pytest_runtest_logreport(self, report) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self, session) -> None:
        pathlib.Path(self.out).write_text(json.dumps(dict(sorted(self.seconds.items())), indent=1) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    if session.config.getoption("--module-seconds-out"):
        session.config.pluginmanager.register(_Recorder(session.config), "localmap_fx_module_seconds")


def merge_times(old: Mapping[str, float], runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``old`` with every module measured in ``runs`` replaced by its new time (rounded to 0.1 s)."""
    out = dict(old)
    for run in runs:
        out.update({m: round(s, 1) for m, s in run.items()})
    return dict(sorted(out.items()))
