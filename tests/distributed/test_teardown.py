"""localmap_fx.testing.teardown: programs end with no unwaited collectives, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.dist import run_ranks
from localmap_fx.testing.teardown import unwaited_collectives, wait_all

from helpers import mesh_1d

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wait_all_drains_a_dropped_result():
    mesh = mesh_1d()
    before = unwaited_collectives()
    y = funcol.all_reduce(torch.ones(4), "sum", mesh)
    assert unwaited_collectives() == before + 1
    wait_all([y])
    assert unwaited_collectives() == before


def _returns_collective(x):
    return funcol.all_gather_tensor(x, 0, (mesh_1d(), 0))


def test_region_output_left_unread_is_waited():
    """A region returning a collective's result, never read: nothing pending."""
    mesh = mesh_1d()
    f = localmap_fx.local_map(
        _returns_collective, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh
    )
    before = unwaited_collectives()
    f(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    assert unwaited_collectives() == before


def test_rejected_body_leaves_nothing_pending():
    """The SPMD checker rejects all_reduce of an already reduced value: no
    collective is issued, and one issued before the rejection is waited."""
    import spmd_types as spmd
    from torch.distributed.tensor import Partial, Replicate

    mesh = mesh_1d()

    def twice(x):
        y = funcol.all_reduce(x, "sum", (mesh, 0))
        return funcol.all_reduce(y, "sum", (mesh, 0))

    f = localmap_fx.local_map(
        twice, out_placements=[Replicate()], in_placements=([Partial()],), device_mesh=mesh,
        spmd_types=True,
    )
    x = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]).redistribute(mesh, [Replicate()])
    x = x.__class__.from_local(x.to_local(), mesh, [Partial()], run_check=False)
    before = unwaited_collectives()
    try:
        f(x)
    except spmd.SpmdTypeError:
        pass
    else:
        raise AssertionError("accepted")
    assert unwaited_collectives() == before


def _pending_then_exit(rank, world_size, device):
    y = funcol.all_reduce(torch.ones(2), "sum", torch.distributed.group.WORLD)
    wait_all([y])
    return unwaited_collectives()


def test_harness_ranks_end_clean():
    assert run_ranks(_pending_then_exit, world_size=2) == [0, 0]


def test_main_guard_exits_with_mains_code():
    code = (
        "from localmap_fx.testing.teardown import main_guard\n"
        "def main():\n    print('ran', flush=True)\n    return 3\n"
        "main_guard(main)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 3 and "ran" in r.stdout, r
