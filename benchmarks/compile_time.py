"""P5: cold compile time of stacks of identical layers, and warm start.

Single process on a fake process group (compile time does not depend on
real collectives).  A measurement compiles the forward and backward of a
model with ``n_layers`` identical layers, with every cache cold:
``torch._dynamo.reset()`` and inductor's ``fresh_cache()`` (a new cache
directory, in-memory caches cleared) with ``force_disable_caches`` patched
on (and restored).  The process first compiles a small, different model on
both sides so one-time start-up costs (imports, compiler detection) are not
counted.

Models (:mod:`benchmarks.models`): ``tp`` = the tensor-parallel stack of
issue #10 (:func:`build_tp_stack`: per layer a column and a row region and a
redistribute + residual-free all-reduce), ``layer`` = the one-region stack
(:func:`build_layer_stack`).

Sides: ``ours`` = ``backend="localmap_fx"`` (inductor inside, default
options: layers shared when ``share_layers="auto"`` says so), ``torch`` =
torch's ``local_map`` with ``backend="inductor"``.

Each measurement also records the per-phase breakdown from
``torch._dynamo.utils.compilation_time_metrics``:

* ``dynamo_s``: Dynamo's own work (``_compile.compile_inner`` minus the
  backend call);
* ``aot_s``: AOTAutograd tracing and partitioning
  (``create_aot_dispatcher_function`` minus the forward inductor compile
  nested in it);
* ``inductor_s``: Inductor forward + backward (``compile_fx_inner``,
  including the wait for kernels compiled in worker threads);
* ``cpp_compile_s``: C++ compilation (``compile_file``, summed over the
  threads that ran it: it overlaps the other phases and can exceed them);

plus the number of kernels inductor generated and AOT graphs compiled.

Warm start (:func:`warm_start_worker`): a first process compiles with the
caches on (a fresh ``TORCHINDUCTOR_CACHE_DIR``), a second process with the
same cache folder measures its first forward + backward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

__all__ = ["compile_time_worker"]

def _phases(metrics: dict) -> dict:
    def t(name: str) -> float:
        return sum(metrics.get(name, []))

    backend = t("OutputGraph.call_user_compiler")
    fw_inductor = t("compile_fx.<locals>.fw_compiler_base")
    inductor = t("compile_fx_inner")
    cpp = t("compile_file")
    return {
        "dynamo_s": t("_compile.compile_inner") - backend,
        "aot_s": t("create_aot_dispatcher_function") - fw_inductor,
        "inductor_s": inductor,
        "cpp_compile_s": cpp,
        "cpp_files": len(metrics.get("compile_file", [])),
    }


def _init_fake_pg(world_size: int = 2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


def _warm_up(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from .models import local_map_of

    for impl, backend in (("ours", "localmap_fx"), ("torch", "inductor")):
        lm = local_map_of(impl)
        f = lm(
            lambda a: torch.sigmoid(a) * 3,
            out_placements=[Shard(0)],
            in_placements=([Shard(0)],),
            device_mesh=mesh,
        )
        x = distribute_tensor(torch.randn(6, 5), mesh, [Replicate()]).redistribute(
            mesh, [Shard(0)]
        )
        x.requires_grad_()
        torch.compile(lambda a: f(a).to_local().sum(), backend=backend)(x).backward()  # noqa: B023 - runs now
    torch._dynamo.reset()


def _build(mesh, model: str, impl: str, n_layers: int):
    """(step, args) of one benchmark model."""
    from .models import build_layer_stack, build_tp_stack

    if model == "tp":
        step, st = build_tp_stack(mesh, impl, n_blocks=n_layers, batch=16, d=32, hidden=64)
        return step, (st["x"], st["w1"], st["w2"])
    if model == "layer":
        step, st = build_layer_stack(mesh, impl, n_layers)
        return step, (st["x"], st["ws"])
    raise ValueError(f"model must be 'tp' or 'layer', got {model!r}")


def _backend(impl: str, on_aot_graph):
    if impl == "ours":
        import localmap_fx

        return localmap_fx.backend(on_aot_graph=on_aot_graph)
    return "inductor"


@contextlib.contextmanager
def cold_caches() -> Iterator[dict]:
    """Every compile cache cold inside the block: inductor's ``fresh_cache()``
    with ``force_disable_caches`` patched on (both restored on exit).  Yields
    a dict that, on exit, holds the block's per-phase breakdown
    (:func:`_phases`) and ``kernels``, the number inductor generated.  Callers
    reset Dynamo around it (the model must be built between the two)."""
    import torch._dynamo.utils as dutils
    from torch._inductor import config as iconfig
    from torch._inductor import metrics
    from torch._inductor.utils import fresh_cache

    stats: dict = {}
    with fresh_cache(), iconfig.patch(force_disable_caches=True):
        metrics.reset()
        dutils.compilation_time_metrics.clear()
        yield stats
        stats.update(_phases(dutils.compilation_time_metrics), kernels=metrics.generated_kernel_count)


def _measure(mesh, model: str, impl: str, n_layers: int) -> dict:
    aot_graphs: list[str] = []
    torch._dynamo.reset()
    step, args = _build(mesh, model, impl, n_layers)
    with cold_caches() as stats:
        compiled = torch.compile(step, backend=_backend(impl, lambda kind, gm: aot_graphs.append(kind)))
        t0 = time.perf_counter()
        loss = compiled(*args)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    torch._dynamo.reset()
    return {
        "total_s": t2 - t0,
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        **stats,
        # ours only (the hook sees our AOT graphs): pieces compiled, forward
        "aot_forward_graphs": aot_graphs.count("forward") if impl == "ours" else None,
    }


def compile_time_worker(plan: dict[str, list[int]], repeats: int) -> dict:
    """Run in a fresh process: every (model, side, n_layers) ``repeats`` times.

    ``plan`` maps a model ("tp", "layer") to its layer counts; results are
    keyed ``"<model>/<side>_<n>"``.
    """
    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    _warm_up(mesh)
    configs = [(model, impl, n) for model, layers in plan.items() for n in layers for impl in ("ours", "torch")]
    out: dict = {f"{model}/{impl}_{n}": [] for model, impl, n in configs}
    for r in range(repeats):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for model, impl, n in order:
            out[f"{model}/{impl}_{n}"].append(_measure(mesh, model, impl, n))
    return out


def _first_step(model: str, impl: str, n_layers: int) -> float:
    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    step, args = _build(mesh, model, impl, n_layers)
    compiled = torch.compile(step, backend=_backend(impl, None))
    t0 = time.perf_counter()
    compiled(*args).backward()
    return time.perf_counter() - t0


def warm_start_worker(model: str, n_layers: int) -> dict:
    """Seconds of the first forward + backward in a second process whose
    caches a first process filled, per side (each side its own cache dir)."""
    import concurrent.futures
    import multiprocessing
    import os
    import tempfile

    out = {}
    ctx = multiprocessing.get_context("spawn")
    for impl in ("ours", "torch"):
        with tempfile.TemporaryDirectory() as cache:
            old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                times = []
                for _ in range(2):  # cold (fills the cache), then warm
                    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
                        times.append(ex.submit(_first_step, model, impl, n_layers).result())
            finally:
                if old is None:
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        out[impl] = {"cold_s": times[0], "warm_s": times[1]}
    return out
