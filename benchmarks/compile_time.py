"""P5: cold compile time of a stack of identical regions.

Single process on a fake process group (compile time does not depend on
real collectives).  A measurement compiles the forward and backward of
:func:`benchmarks.models.build_layer_stack` with ``n_layers`` identical
regions, with every cache cold: ``torch._dynamo.reset()`` and inductor's
``fresh_cache()`` (a new cache directory, in-memory caches cleared) with
``force_disable_caches`` patched on (and restored).  The process first
compiles a small, different model on both sides so one-time start-up costs
(imports, compiler detection) are not counted.

Sides: ``ours`` = ``backend="localmap_fx"`` (inductor inside),
``torch`` = torch's ``local_map`` with ``backend="inductor"``.

For the profile, each measurement also records Dynamo, AOTAutograd and
Inductor time (``torch._dynamo.utils.compilation_time_metrics``), the number
of kernels inductor generated, and, for ours, how many distinct region
subgraphs were compiled.
"""

from __future__ import annotations

import time

import torch

__all__ = ["compile_time_worker"]

_PHASES = {
    "dynamo_trace_s": ("bytecode_tracing",),
    "aot_s": ("create_aot_dispatcher_function",),
    "aot_joint_trace_s": ("aot_trace_joint_graph",),
    "inductor_codegen_s": ("GraphLowering.run", "Scheduler.__init__", "GraphLowering.codegen"),
    "cpp_compile_s": ("compile_file",),
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

    from .models import local_map_impl

    for impl, backend in (("ours", "localmap_fx"), ("torch", "inductor")):
        lm = local_map_impl(impl)
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


def _measure(mesh, impl: str, n_layers: int) -> dict:
    import torch._dynamo.utils as dutils
    from torch._inductor import config as iconfig
    from torch._inductor import metrics
    from torch._inductor.utils import fresh_cache

    from .models import build_layer_stack

    subgraphs: set = set()

    if impl == "ours":
        import localmap_fx

        def on_aot_graph(kind, gm):
            for node in gm.graph.nodes:
                if node.target is torch.ops.higher_order.invoke_subgraph:
                    subgraphs.add((kind, node.args[1]))

        backend = localmap_fx.backend(on_aot_graph=on_aot_graph)
    else:
        backend = "inductor"

    torch._dynamo.reset()
    step, state = build_layer_stack(mesh, impl, n_layers)
    with fresh_cache(), iconfig.patch(force_disable_caches=True):
        metrics.reset()
        dutils.compilation_time_metrics.clear()
        compiled = torch.compile(step, backend=backend)
        t0 = time.perf_counter()
        loss = compiled(state["x"], state["ws"])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        phases = {
            k: sum(sum(dutils.compilation_time_metrics.get(n, [])) for n in names)
            for k, names in _PHASES.items()
        }
        kernels = metrics.generated_kernel_count
    torch._dynamo.reset()
    return {
        "total_s": t2 - t0,
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        **phases,
        "kernels": kernels,
        "region_subgraphs": len({name for kind, name in subgraphs if kind == "forward"})
        if impl == "ours"
        else None,
    }


def compile_time_worker(layers: list[int], repeats: int) -> dict:
    """Run in a fresh process: every (side, n_layers) ``repeats`` times."""
    torch.set_num_threads(1)
    mesh = _init_fake_pg()
    _warm_up(mesh)
    configs = [(impl, n) for n in layers for impl in ("ours", "torch")]
    out: dict = {f"{impl}_{n}": [] for impl, n in configs}
    for r in range(repeats):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for impl, n in order:
            out[f"{impl}_{n}"].append(_measure(mesh, impl, n))
    return out
