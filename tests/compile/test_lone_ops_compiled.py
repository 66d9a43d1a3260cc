"""Lone ops run as ATen ops under Inductor (Note: [A lone op runs as its ATen op]).

A TP stack's block is two matrix products, a collective and two ops with
nothing to fuse with (``relu`` between the products, the residual ``add``):
compiled with the default options its layer piece generates no kernel for
them, and its loss and gradients equal eager's (the ATen ops eager runs);
with ``lone_ops_as_aten=False`` Inductor generates their kernels as before.
The backward's ``threshold_backward`` reaches Inductor decomposed into a
group that fuses (``le``, ``where``), so it keeps its kernel.  Cold compile
times live in ``benchmarks/marked_bench.py`` and ``benchmarks/depth_bench.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import localmap_fx

from helpers import mesh_1d

pytestmark = pytest.mark.inductor


def _step(opts: dict, marked: bool):
    from torch._inductor import metrics

    from localmap_fx.testing.models import TPStack, tp_stack_input

    torch._dynamo.reset()
    model = TPStack(mesh_1d(), 3, d=16, hidden=32, marked=marked)
    x = tp_stack_input(mesh_1d(), 8, 16)
    metrics.reset()
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        loss = torch.compile(model, backend=localmap_fx.backend("inductor", **opts))(x)
        loss.backward()
    kernels = metrics.generated_kernel_count
    return [loss, x.grad, *(p.grad for p in model.parameters())], kernels, model, x


def _eager(model, x):
    for t in (x, *model.parameters()):
        t.grad = None
    loss = model(x)
    loss.backward()
    return [loss, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("marked", [False, True], ids=["found_layers", "marked"])
def test_lone_ops_generate_no_kernel_and_give_eager_values(marked):
    got, kernels, model, x = _step({"share_layers": True}, marked)
    before, kernels_before, _, _ = _step({"share_layers": True, "lone_ops_as_aten": False}, marked)
    ref = _eager(model, x)
    # the layer: forward relu + add (lone: no kernel), backward the threshold_backward group
    # (fused: one kernel); the loss piece skips Inductor (no matrix product)
    assert (kernels, kernels_before) == (1, 3)
    for a, b, r in zip(got, before, ref):
        torch.testing.assert_close(a.to_local(), r.to_local(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.to_local(), r.to_local(), rtol=1e-5, atol=1e-5)


def test_the_log_names_the_lone_ops(caplog):
    with caplog.at_level(logging.INFO, logger="localmap_fx.lone_ops"):
        _step({"share_layers": True}, True)
    lines = [r.getMessage() for r in caplog.records if r.name == "localmap_fx.lone_ops"]
    # the layer piece's forward (relu, add); its backward's add became an addmm in Inductor's
    # post-grad passes, before the lone ops are found; the loss piece skips Inductor
    assert lines == ["graph of 13 nodes: 2 lone op(s) run as ATen ops, no kernel generated: "
                     "aten.add.Tensor, aten.relu.default"], lines
