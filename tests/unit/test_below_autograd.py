"""``below_autograd``: the all_reduce between graphs called beneath autograd's
dispatch when nothing is differentiated (Note: [A collective with nothing to
differentiate skips autograd's Python])."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  # registers the collectives' autograd (DTensor imports it)

from localmap_fx.below_autograd import all_reduce_waited
from localmap_fx.testing.dist import run_ranks

from helpers import mesh_1d

ops = torch.ops._c10d_functional


def _python_autograd_kernel_ran(fn) -> bool:
    """Did ``fn()`` enter the Python autograd kernel torch registers for the functional collectives?"""
    entered = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "autograd_impl" and "_library" in frame.f_code.co_filename:
            entered.append(frame.f_code.co_filename)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return bool(entered)


def _group() -> str:
    return mesh_1d().get_group().group_name


def test_torch_runs_a_python_autograd_kernel_for_every_functional_all_reduce():
    """Pins torch 2.14.1: even with grad mode off, ``all_reduce`` and
    ``wait_tensor`` reach a Python kernel (``torch.library.register_autograd``).
    When this fails, torch moved it out of Python and the note's reason is gone."""
    x = torch.ones(4, requires_grad=True)
    with torch.no_grad():
        assert _python_autograd_kernel_ran(lambda: ops.wait_tensor(ops.all_reduce(x, "sum", _group())))


@pytest.mark.parametrize("grad_mode, requires_grad", [(False, True), (True, False), (False, False)])
def test_nothing_to_differentiate_skips_the_python_kernel(grad_mode, requires_grad):
    x = torch.ones(4, requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_mode):
        assert not _python_autograd_kernel_ran(lambda: all_reduce_waited(x, "sum", _group()))
        assert all_reduce_waited(x, "sum", _group()).grad_fn is None


def test_an_input_that_requires_grad_keeps_the_autograd_path():
    x = torch.ones(4, requires_grad=True)
    out: list[torch.Tensor] = []
    assert _python_autograd_kernel_ran(lambda: out.append(all_reduce_waited(x, "sum", _group())))
    assert out[0].grad_fn is not None


def _ranks(rank, world_size, device):
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + 0.25
    report = {}
    for op in ("sum", "avg"):
        with torch.no_grad():
            report[op] = (all_reduce_waited(x, op, group), ops.wait_tensor(ops.all_reduce(x, op, group)))
    # grad mode on, an input that requires grad: the autograd path, its backward an all_reduce too
    w = x.clone().requires_grad_()
    all_reduce_waited(w, "sum", group).mul(rank + 1).sum().backward()
    report["grad"] = w.grad
    return report


def test_on_gloo_the_values_are_the_functional_all_reduces():
    reports = run_ranks(_ranks, world_size=2, timeout=300)
    for r in reports:
        for op in ("sum", "avg"):
            got, want = r[op]
            assert torch.equal(got, want), op
        # d/dx of sum_r (r + 1) * all_reduce(x): the all_reduce of each rank's (r + 1)
        assert torch.equal(r["grad"], torch.full((2, 3), 3.0))
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(reports[0]["sum"][0], 3 * a + 0.5)  # (a + 0.25) + (2a + 0.25)
    assert torch.equal(reports[0]["avg"][0], (3 * a + 0.5) / 2)
