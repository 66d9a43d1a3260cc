"""Fixtures every test gets: Dynamo reset after each test, no unwaited collectives.

The fake process group (world size 4) and its meshes are functions in
``tests/helpers.py`` (one per session).  Single-process tests build meshes on
it; numerics use ``LocalTensorMode`` so every rank runs in this process.
Multi-process (gloo) tests spawn their own processes and never touch this
group.
"""

from __future__ import annotations

import pytest
import torch


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

