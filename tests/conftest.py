"""Shared fixtures: one fake process group (world size 4) per test session.

Single-process tests build meshes on it; numerics use ``LocalTensorMode`` so
every rank runs in this process.  Multi-process (gloo) tests spawn their own
processes and never touch this group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 4


def _ensure_fake_pg() -> None:
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)


@pytest.fixture(scope="session")
def fake_pg():
    _ensure_fake_pg()
    yield
    # torch keeps the default group alive for the whole session on purpose:
    # destroying it would invalidate meshes cached by other tests.


@pytest.fixture(scope="session")
def mesh1d(fake_pg):
    return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))


@pytest.fixture(scope="session")
def mesh2d(fake_pg):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


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

