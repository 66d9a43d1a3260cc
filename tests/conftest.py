"""Fixtures every test gets, the suite's markers and its quick tier.

Fixtures: Dynamo reset after each test, no unwaited collectives.  The fake
process group (world size 4) and its meshes are functions in
``tests/helpers.py`` (one per session).  Single-process tests build meshes on
it; numerics use ``LocalTensorMode`` so every rank runs in this process.
Multi-process (gloo) tests spawn their own processes and never touch this
group.

Tiers: ``tests/unit`` (one process, no compiler or a hand-built graph),
``tests/compile`` (one process, ``torch.compile``), ``tests/distributed``
(mostly gloo ranks).  Markers (registered in pyproject.toml):

* ``gloo``: set here on every test whose code, fixtures or same-module
  helpers name ``run_ranks`` (the one way the suite starts ranks); a test
  that starts ranks another way says so with ``pytest.mark.gloo``;
* ``inductor``: set here on every case parametrized with ``"inductor"``,
  written on the others; a test that compiles with Inductor in this process
  without the marker fails (:func:`_inductor_marker_is_true`);
* ``slow``: written on the suite's longest tests: those that took 10 s or
  more in a measured run of the whole suite on a loaded 2-CPU machine (8 s
  or more in a quick-tier run, on the slower machine of session 13; 6.5 s
  or more on the slower still of session 18, where the quick tier had grown
  past 4 minutes), and every test sharing a module fixture with one of them
  (the fixture's cost goes to whichever test sets it up).  A long case of a
  parametrized test is left to the sampling, unless every case is long;
  ``test_teardown.py::test_harness_ranks_end_clean`` stays quick: it is the
  quick tier's one run of gloo ranks.

``--quick`` (``bash scripts/test.sh --quick``) deselects ``slow`` tests and
keeps a fixed sample of the cases of each parametrized test function
(:func:`_sample`).  ``--called-modules`` says, at the end,
which ``localmap_fx`` modules had none of their functions called in this
process (``sys.setprofile``: slow; for checking that a tier reaches every
module, e.g. ``--quick --called-modules``).
"""

from __future__ import annotations

import ast
import inspect
import math
import sys
import threading
import types
import zlib

import pytest
import torch

# --shard K/N and module times: tests/shards.py (scripts/test.sh runs shards at once)
pytest_plugins = ("shards",)

# Under --quick, a parametrized test function keeps QUICK_CASES of its
# cases or one in QUICK_SHARE, whichever is more.
QUICK_CASES = 3
QUICK_SHARE = 20


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the quick tier: no slow tests, parametrized cases sampled",
    )
    parser.addoption(
        "--called-modules",
        action="store_true",
        help="report the localmap_fx modules none of whose functions ran in this process (slow)",
    )


_CALLED_FILES: set[str] = set()


def _record_call(frame, event, arg):
    if event == "call" and frame.f_code.co_name != "<module>":
        _CALLED_FILES.add(frame.f_code.co_filename)


def pytest_sessionstart(session):
    if session.config.getoption("--called-modules"):
        sys.setprofile(_record_call)
        threading.setprofile(_record_call)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--called-modules"):
        return
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    import pathlib

    import localmap_fx

    root = pathlib.Path(localmap_fx.__file__).resolve().parent
    called = {pathlib.Path(f).resolve() for f in _CALLED_FILES}
    modules = [
        m
        for m in sorted(root.rglob("*.py"))
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(ast.parse(m.read_text())))
    ]
    missed = [str(m.relative_to(root.parent)) for m in modules if m not in called]
    terminalreporter.write_line(
        f"localmap_fx modules that define a function: {len(modules)}; with a function called: {len(modules) - len(missed)}"
    )
    if missed:
        terminalreporter.write_line("none called in: " + ", ".join(missed))


def _function(obj):
    return inspect.unwrap(getattr(obj, "__func__", obj)) if obj is not None else None


def _code_names(fns, module_names: set[str], target: str) -> bool:
    """Whether ``target`` is named by the code of ``fns``, their nested
    functions, or a module-level function of the suite they name."""
    seen: set = set()
    todo = [f for f in map(_function, fns) if isinstance(f, types.FunctionType)]
    while todo:
        fn = todo.pop()
        stack = [fn.__code__]
        while stack:
            code = stack.pop()
            if code in seen:
                continue
            seen.add(code)
            if target in code.co_names:
                return True
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in code.co_names:
                obj = fn.__globals__.get(name)
                if isinstance(obj, types.FunctionType) and obj.__module__ in module_names:
                    todo.append(obj)
    return False


def _starts_ranks(item) -> bool:
    fixturedefs = getattr(item, "_fixtureinfo", None)
    fixtures = [d.func for defs in (fixturedefs.name2fixturedefs.values() if fixturedefs else ()) for d in defs]
    own = {item.module.__name__, "helpers", "conftest"} if item.module is not None else {"helpers"}
    return _code_names([getattr(item, "obj", None), *fixtures], own, "run_ranks")


def _parametrized_with_inductor(item) -> bool:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    values = [v for p in callspec.params.values() for v in (p if isinstance(p, tuple) else (p,))]
    return any(isinstance(v, str) and v == "inductor" for v in values)


def _sample(items: list) -> tuple[list, list]:
    """(kept, dropped): of each test function parametrized with more than
    QUICK_CASES cases, QUICK_CASES or one in QUICK_SHARE of them, whichever
    is more, picked by a hash of the test id (the same cases every run, and
    no stride that could line up with a parameter grid)."""
    groups: dict[tuple, list] = {}
    for it in items:
        groups.setdefault((it.path, getattr(it, "originalname", it.name)), []).append(it)
    keep: set[int] = set()
    for cases in groups.values():
        n = max(QUICK_CASES, math.ceil(len(cases) / QUICK_SHARE))
        keep.update(id(c) for c in sorted(cases, key=lambda c: zlib.crc32(c.nodeid.encode()))[:n])
    return [it for it in items if id(it) in keep], [it for it in items if id(it) not in keep]


def pytest_collection_finish(session):
    # gloo tests fork their ranks from one server that imported torch; start it
    # now, in the session's environment (Note: [Ranks forked from a server
    # that imported torch] in localmap_fx/testing/dist.py)
    if any(it.get_closest_marker("gloo") for it in session.items):
        from localmap_fx.testing.dist import start_rank_server

        start_rank_server()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_ranks(item):
            item.add_marker(pytest.mark.gloo)
        if _parametrized_with_inductor(item):
            item.add_marker(pytest.mark.inductor)
    if not config.getoption("--quick"):
        return
    fast = [it for it in items if not it.get_closest_marker("slow")]
    kept, sampled_out = _sample(fast)
    dropped = [it for it in items if it.get_closest_marker("slow")]
    if dropped or sampled_out:
        config.hook.pytest_deselected(items=dropped + sampled_out)
    items[:] = kept


_FX_CACHE_KEYS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def _inductor_trail() -> tuple | None:
    """Where Inductor records its compiles: the ``compile_fx_inner`` timings
    and the FX graph cache counters, each as (the container, its size now).
    Tests and ``torch._dynamo.reset()`` clear both by replacing the container,
    so a later reading compares the old container and the new one."""
    if "torch._dynamo.utils" not in sys.modules:
        return None
    from torch._dynamo.utils import compilation_time_metrics, counters

    timings = compilation_time_metrics.get("compile_fx_inner")
    cache = counters["inductor"]
    return timings, len(timings or ()), cache, sum(cache[k] for k in _FX_CACHE_KEYS)


def _inductor_compiled_since(before: tuple | None) -> bool:
    after = _inductor_trail()
    if after is None:
        return False
    if before is None:
        before = (None, 0, None, 0)
    timings0, n0, cache0, c0 = before
    timings1, n1, cache1, c1 = after
    if timings1 is timings0 and n1 != n0 or timings1 is not timings0 and n1:
        return True
    if timings0 is not None and len(timings0) > n0:  # recorded, then cleared
        return True
    if cache1 is cache0:
        return c1 != c0
    return c1 > 0 or (cache0 is not None and sum(cache0[k] for k in _FX_CACHE_KEYS) > c0)


_TRAIL_BEFORE = pytest.StashKey[tuple | None]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # before any fixture: a module-scoped fixture that compiles counts for
    # the test that sets it up
    item.stash[_TRAIL_BEFORE] = _inductor_trail()
    yield


@pytest.fixture(autouse=True)
def _inductor_marker_is_true(request):
    """A test that compiles with Inductor here carries the ``inductor``
    marker, so ``-m "not inductor"`` really leaves Inductor out.  (Compiles
    in gloo children are not seen: those tests are marked by hand.)"""
    yield
    if request.node.get_closest_marker("inductor") is None and _inductor_compiled_since(
        request.node.stash.get(_TRAIL_BEFORE, None)
    ):
        pytest.fail("this test compiles with Inductor: mark it @pytest.mark.inductor", pytrace=False)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


def _registry_size() -> int:
    return int(torch._C._distributed_c10d._get_work_registry_size())


@pytest.fixture(autouse=True)
def _no_unwaited_collectives():
    """A test must wait every functional collective it issues: otherwise the
    suite ends with "there are still N unwaited collective calls"."""
    before = _registry_size()
    yield
    after = _registry_size()
    if after > before:
        pytest.fail(
            f"{after - before} functional collective result(s) never waited; wait them "
            "(localmap_fx.testing.teardown.wait_all) or use the waited_collectives fixture",
            pytrace=False,
        )


@pytest.fixture
def waited_collectives():
    """:func:`helpers.waiting_collectives` around the whole test (eager only:
    torch.compile refuses to run under a dispatch mode)."""
    from helpers import waiting_collectives

    with waiting_collectives():
        yield
