"""S1/S2: how long localmap_fx takes to start.

    python -m benchmarks.startup            # prints JSON

Every figure is the median of ``repeats`` fresh interpreters (``sys.executable``
with this checkout first on ``PYTHONPATH``), measured side by side in one run:

* **S1** ``import localmap_fx`` after ``import torch``: seconds over ``import
  torch`` alone (target <= 0.3 s).  Also reported: ``from localmap_fx import
  local_map`` and ``backend`` (they import DTensor, which a local_map program
  imports anyway; compared with ``import torch.distributed.tensor``), and
  whether any of them imported Dynamo or Inductor.
* **S2** ``python -m localmap_fx inspect DIR`` on a small dump (the ``tp_mlp``
  model, 2 regions, written once before timing): seconds for the whole
  command (target <= 1 s), and whether it imported torch.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["startup_worker"]

# Each snippet prints the seconds its import statements took, after `pre`.
_IMPORT_SNIPPET = """
import sys, time
{pre}
t0 = time.perf_counter()
{stmt}
t1 = time.perf_counter()
print(t1 - t0, int("torch._dynamo" in sys.modules), int("torch._inductor" in sys.modules))
"""

_CASES = {
    # name: (already imported, statement timed)
    "torch": ("", "import torch"),
    "localmap_fx": ("import torch", "import localmap_fx"),
    "local_map": ("import torch", "from localmap_fx import local_map"),
    "backend": ("import torch", "from localmap_fx import backend; import localmap_fx.compiler"),
    "dtensor": ("import torch", "import torch.distributed.tensor"),
}

_DUMP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
import localmap_fx
from localmap_fx.testing.models import MODELS
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
m = MODELS["tp_mlp"]
state = m.build(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), 0)
backend = localmap_fx.backend("aot_eager", dump_dir=sys.argv[1])
torch.compile(m.step, backend=backend, fullgraph=True)(state).backward()
dist.destroy_process_group()
"""

_CLI_SNIPPET = """
import runpy, sys, time
t0 = time.perf_counter()
sys.argv = ["localmap-fx", "inspect", {dump!r}]
try:
    runpy.run_module("localmap_fx", run_name="__main__")
except SystemExit:
    pass
print(time.perf_counter() - t0, int("torch" in sys.modules), file=sys.stderr)
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("LOCALMAP_FX_DUMP_DIR", None)
    return env


def _python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"startup benchmark subprocess failed:\n{out.stderr[-3000:]}")
    return out


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def startup_worker(repeats: int = 5) -> dict:
    """Import times (seconds) and the CLI's wall time on a fresh small dump."""
    times: dict[str, list[float]] = {name: [] for name in _CASES}
    compiler: dict[str, bool] = {}
    for _ in range(repeats):
        # interleaved, so a load change affects every case alike
        for name, (pre, stmt) in _CASES.items():
            secs, dyn, ind = _python(_IMPORT_SNIPPET.format(pre=pre, stmt=stmt)).stdout.split()
            times[name].append(float(secs))
            compiler[name] = compiler.get(name, False) or bool(int(dyn) or int(ind))
    with tempfile.TemporaryDirectory(prefix="localmap_fx_startup_") as root:
        _python(_DUMP_SCRIPT, root)
        (frame,) = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
        dump = os.path.join(root, frame)
        cli: list[float] = []
        cli_torch = False
        for _ in range(repeats):
            # the whole command, interpreter start included
            t0 = time.perf_counter()
            err = _python(_CLI_SNIPPET.format(dump=dump)).stderr.strip().splitlines()[-1]
            cli.append(time.perf_counter() - t0)
            cli_torch = cli_torch or bool(int(err.split()[1]))
    return {
        "repeats": repeats,
        # "torch": import torch alone; every other case: seconds after import torch
        "import_s": {name: _summary(xs) for name, xs in times.items()},
        "imports_compiler": compiler,
        "cli_s": _summary(cli),
        "cli_imports_torch": cli_torch,
    }


if __name__ == "__main__":
    print(json.dumps(startup_worker(), indent=1))
