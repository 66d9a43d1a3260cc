"""Run the test suite as shards at once, one pytest process per CPU.

``bash scripts/test.sh [ARGS]`` runs this.  The suite is mostly one busy
Python thread per test (tracing, compiling, FakeTensor propagation), so on a
machine with N CPUs N shards finish in about 1/N of the time.  Each shard is
``python -m pytest -q -rs --shard K/N ARGS`` (whole test modules, balanced by
measured times: ``tests/shards.py``); its lines are printed as they come,
prefixed ``[K/N]``, and each shard's summary is repeated at the end.

Options of this script (the rest goes to pytest):
  --jobs N        shards (default: the CPUs, at most 4; LOCALMAP_FX_TEST_JOBS
                  overrides); 1 runs plain pytest in this process's place
  --update-times  write the modules' measured seconds to tests/module_seconds.json

Exit status: pytest's, the first shard's that failed; 0 when every shard
passed or had nothing to run (a run that selects nothing anywhere exits 5).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def default_jobs() -> int:
    env = os.environ.get("LOCALMAP_FX_TEST_JOBS")
    if env:
        return int(env)
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def split_args(argv: list[str]) -> tuple[int, bool, list[str]]:
    """(jobs, update_times, pytest's arguments)."""
    jobs, update, rest = default_jobs(), False, []
    it = iter(argv)
    for a in it:
        if a == "--jobs" or a.startswith("--jobs="):
            value = a.partition("=")[2] if "=" in a else next(it, "")
            if not value.isdigit() or int(value) < 1:
                sys.exit(f"scripts/test.sh: --jobs takes a positive number of shards, got {value!r}")
            jobs = int(value)
        elif a == "--update-times":
            update = True
        else:
            rest.append(a)
    return jobs, update, rest


def combined_status(codes: list[int]) -> int:
    """One exit status for the shards' (see the module docstring)."""
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


def _pump(proc: subprocess.Popen, prefix: str, last: list[str], lock: threading.Lock) -> None:
    for line in proc.stdout or ():
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
        if line.strip():
            last[:] = [line.rstrip("\n")]


def run(jobs: int, update: bool, args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs"]
    if jobs == 1 and not update:
        os.chdir(ROOT)
        os.execv(sys.executable, [*pytest, *args])
    with tempfile.TemporaryDirectory(prefix="localmap_fx_shards_") as tmp:
        return _run_shards(jobs, update, pytest, args, pathlib.Path(tmp))


def _run_shards(jobs: int, update: bool, pytest: list[str], args: list[str], tmp: pathlib.Path) -> int:
    """``jobs`` pytest processes at once; ``tmp`` (removed after) holds their module times."""
    procs, threads, lasts = [], [], []
    lock = threading.Lock()
    start = time.monotonic()
    try:
        for k in range(1, jobs + 1):
            extra = [f"--shard={k}/{jobs}"]
            if update:
                extra.append(f"--module-seconds-out={tmp / f'{k}.json'}")
            # a session of its own: a shard and the ranks it spawns stop together.
            # The shards share the CPUs: a deadline of run_ranks (a guard against
            # a hang) stretches with their number
            env = {**os.environ, "LOCALMAP_FX_RANKS_TIMEOUT_SCALE": str(jobs)}
            proc = subprocess.Popen([*pytest, *extra, *args], cwd=ROOT, stdout=subprocess.PIPE, env=env,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
            last: list[str] = []
            t = threading.Thread(target=_pump, args=(proc, f"[{k}/{jobs}] ", last, lock), daemon=True)
            t.start()
            procs.append(proc)
            threads.append(t)
            lasts.append(last)
        codes = [p.wait() for p in procs]
        for t in threads:
            t.join()
    except BaseException:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        raise
    wall = time.monotonic() - start
    print(f"\n{jobs} shards, {wall:.0f} s in all:")
    for k, (code, last) in enumerate(zip(codes, lasts), 1):
        print(f"  [{k}/{jobs}] exit {code}: {last[0] if last else '(no output)'}")
    if update:
        _update_times(tmp, jobs)
    return combined_status(codes)


def _update_times(tmp: pathlib.Path, jobs: int) -> None:
    import json

    sys.path.insert(0, str(ROOT / "tests"))
    from shards import TIMES, merge_times

    runs = [json.loads(f.read_text()) for k in range(1, jobs + 1) if (f := tmp / f"{k}.json").exists()]
    old = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    TIMES.write_text(json.dumps(merge_times(old, runs), indent=1) + "\n")
    print(f"wrote {TIMES.relative_to(ROOT)} ({sum(map(len, runs))} modules measured)")


def main(argv: list[str]) -> int:
    jobs, update, args = split_args(argv)
    return run(jobs, update, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
