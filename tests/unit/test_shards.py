"""The suite's shards (tests/shards.py) and the script that runs them at once (scripts/pytest_shards.py)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from shards import deal, merge_times, parse_shard

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _launcher():
    spec = importlib.util.spec_from_file_location("pytest_shards", ROOT / "scripts" / "pytest_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deal_puts_the_longest_module_alone_and_balances_the_rest():
    seconds = {"a": 100.0, "b": 60.0, "c": 30.0, "d": 20.0, "e": 5.0}
    got = deal({m: 1 for m in seconds}, seconds, 2)
    loads = [sum(s for m, s in seconds.items() if got[m] == k) for k in range(2)]
    assert got["a"] != got["b"]
    assert sorted(loads) == [105.0, 110.0]  # LPT: a | b c d ... -> 100+5, 60+30+20


def test_deal_weighs_an_unmeasured_module_by_its_tests():
    # measured: 1 s per test; "new" has 50 tests, so it weighs 50 s, as much as "big"
    got = deal({"big": 50, "small": 10, "new": 50}, {"big": 50.0, "small": 10.0}, 2)
    assert got["big"] != got["new"]


def test_every_module_gets_one_shard_and_the_deal_is_repeatable():
    counts = {f"tests/m{i}.py": i % 7 + 1 for i in range(40)}
    seconds = {f"tests/m{i}.py": float(i % 5) for i in range(0, 40, 3)}
    first = deal(counts, seconds, 3)
    assert set(first) == set(counts) and set(first.values()) == {0, 1, 2}
    assert deal(dict(reversed(list(counts.items()))), seconds, 3) == first


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_a_bad_shard_names_the_option(text):
    with pytest.raises(pytest.UsageError, match="--shard"):
        parse_shard(text)


def test_merge_keeps_old_times_of_modules_not_run():
    assert merge_times({"a": 1.0, "b": 2.0}, [{"b": 3.14159}, {"c": 0.04}]) == {"a": 1.0, "b": 3.1, "c": 0.0}


def test_exit_status_of_shards():
    combined = _launcher().combined_status
    assert combined([0, 0]) == 0
    assert combined([0, 5]) == 0  # one shard had nothing selected
    assert combined([5, 5]) == 5
    assert combined([5, 1]) == 1
    assert combined([2, 1]) == 2


def test_launcher_options_are_its_own_and_the_rest_goes_to_pytest(monkeypatch):
    launcher = _launcher()
    monkeypatch.setenv("LOCALMAP_FX_TEST_JOBS", "3")
    assert launcher.split_args(["-x", "--jobs", "2", "--quick"]) == (2, False, ["-x", "--quick"])
    assert launcher.split_args(["--jobs=1", "--update-times", "-k", "jobs"]) == (1, True, ["-k", "jobs"])
    assert launcher.split_args([]) == (3, False, [])
    with pytest.raises(SystemExit, match="--jobs"):
        launcher.split_args(["--jobs", "0"])


def test_two_shards_run_every_test_once_and_record_their_times(tmp_path):
    """A small suite in two shards through the real script: each test runs in
    exactly one shard, and --update-times writes the modules' times."""
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "scripts").mkdir()
    (suite / "scripts" / "pytest_shards.py").write_text((ROOT / "scripts" / "pytest_shards.py").read_text())
    (suite / "tests" / "shards.py").write_text((ROOT / "tests" / "shards.py").read_text())
    (suite / "tests" / "conftest.py").write_text('pytest_plugins = ("shards",)\n')
    (suite / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["tests"]\n')
    for m in range(4):
        (suite / "tests" / f"test_m{m}.py").write_text(
            "".join(f"def test_{m}_{i}():\n    print('ran {m}_{i}')\n" for i in range(m + 1)))
    proc = subprocess.run([sys.executable, "scripts/pytest_shards.py", "--jobs", "2", "--update-times", "-s"],
                          cwd=suite, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [line.split("ran ")[1].split()[0] for line in proc.stdout.splitlines() if "ran " in line]
    assert sorted(ran) == sorted(f"{m}_{i}" for m in range(4) for i in range(m + 1))
    shards = {line[:5] for line in proc.stdout.splitlines() if "ran " in line}
    assert shards == {"[1/2]", "[2/2]"}
    times = json.loads((suite / "tests" / "module_seconds.json").read_text())
    assert set(times) == {f"tests/test_m{m}.py" for m in range(4)}
