"""Lone ops run as ATen ops under Inductor (Note: [A lone op runs as its ATen op]).

A TP stack's block is two matrix products, a collective and two ops with
nothing to fuse with (``relu`` between the products, the residual ``add``):
compiled with the default options its layer piece generates no kernel for
them, and its loss and gradients equal eager's (the ATen ops eager runs);
with ``lone_ops_as_aten=False`` Inductor generates their kernels as before.
The backward's ``threshold_backward`` (relu's gradient, between two matrix
products) is held back from AOTAutograd's decompositions and is lone too
(Note: [A pointwise op decomposes only where it fuses]).  Cold compile
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
    # the layer: forward relu + add, backward threshold_backward, all lone: no kernel (before:
    # one each, the backward's decomposed into le + where); the loss piece skips Inductor
    assert (kernels, kernels_before) == (0, 3)
    for a, b, r in zip(got, before, ref):
        torch.testing.assert_close(a.to_local(), r.to_local(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.to_local(), r.to_local(), rtol=1e-5, atol=1e-5)


def test_the_log_names_the_lone_ops(caplog):
    with caplog.at_level(logging.INFO, logger="localmap_fx.lone_ops"):
        _step({"share_layers": True}, True)
    lines = [r.getMessage() for r in caplog.records if r.name == "localmap_fx.lone_ops"]
    # the layer piece's forward (relu, add), then its backward (threshold_backward; its add
    # became an addmm in Inductor's post-grad passes, before the lone ops are found); the loss
    # piece skips Inductor
    assert lines == ["graph of 13 nodes: 2 lone op(s) run as ATen ops, no kernel generated: "
                     "aten.add.Tensor, aten.relu.default",
                     "graph of 13 nodes: 1 lone op(s) run as ATen ops, no kernel generated: "
                     "aten.threshold_backward.default"], lines


def _gelu_kernels(fused: bool, on: bool):
    """Kernel names and gradients of ``gelu`` between two matrix products (``fused``: times 2 after it)."""
    import re

    from torch._inductor.utils import fresh_cache, run_and_get_code

    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 32, generator=gen, requires_grad=True)
    w2 = torch.randn(32, 16, generator=gen, requires_grad=True)
    x = torch.randn(8, 16, generator=gen)

    def f(x):
        h = torch.nn.functional.gelu(x @ w1)
        return ((h * 2 if fused else h) @ w2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=localmap_fx.backend("inductor", lone_ops_as_aten=on))

    def step():
        compiled(x).backward()

    with fresh_cache():
        _, codes = run_and_get_code(step)
    got = [w1.grad, w2.grad]
    w1.grad = w2.grad = None
    f(x).backward()
    for a, b in zip(got, (w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return sorted(k for code in codes for k in re.findall(r"^(cpp_fused_\w+) = ", code, re.M))


def test_a_lone_activation_gradient_runs_as_its_aten_op():
    # gelu_backward has no Inductor lowering: held back from AOTAutograd, lone between the
    # backward's two mm, no kernel (Note: [A pointwise op decomposes only where it fuses]); the
    # forward's gelu is no gradient and keeps its decomposed kernel (Inductor's CPU patterns
    # match that form); the expand of the loss's gradient that an mm reads is materialized
    assert _gelu_kernels(fused=False, on=True) == ["cpp_fused_expand_mm_0", "cpp_fused_gelu_0"]
    assert "cpp_fused_gelu_gelu_backward_1" in _gelu_kernels(fused=False, on=False)


def test_a_held_back_op_that_fuses_is_decomposed_and_fused_as_before():
    # gelu * 2 and the backward's gelu_backward * 2 fuse: decomposed by the pass, one kernel
    # each, named after the ops they came from
    kernels = _gelu_kernels(fused=True, on=True)
    assert "cpp_fused_gelu_mul_0" in kernels and "cpp_fused_gelu_backward_mul_1" in kernels, kernels


def test_round_with_decimals_compiles_under_the_lone_op_scope():
    # Inductor's joint-graph no-op pass matches every aten.round overload and rejects
    # `decimals`: an op held back from AOTAutograd would reach it (only activation
    # gradients are held back)
    w = torch.randn(16, 16)
    x = torch.randn(8, 16)

    def f(x):
        return torch.round(x @ w, decimals=2) @ w

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend=localmap_fx.backend("inductor"))(x), f(x))


def test_an_activation_the_user_marked_for_inductor_compiles_with_its_gradient():
    # fx.traceback.annotate marks gelu; AOTAutograd copies the mark to gelu_backward, which
    # Inductor cannot lower whole: the pass decomposes it instead of keeping it whole
    import torch.fx.traceback as fx_traceback

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 16, generator=gen, requires_grad=True)

    def f(x):
        h = x @ w
        with fx_traceback.annotate({"compile_with_inductor": "user"}):
            g = torch.nn.functional.gelu(h)
        return (g @ w).sum()

    torch._dynamo.reset()
    torch.compile(f, backend=localmap_fx.backend("inductor"))(x).backward()
    got, w.grad = w.grad, None
    f(x).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-5, atol=1e-5)


def _attention(way: str, inner: str, opts: dict):
    """Kernel names and values (gradients) of a 2-layer attention stack's first step."""
    import re

    from torch._inductor.utils import fresh_cache, run_and_get_code

    from benchmarks.depth_bench import build

    torch._dynamo.reset()
    # 2 heads per rank of 4
    step, _, leaves = build(mesh_1d(), "attention", f"ours_{way}", 2, backend=localmap_fx.backend(inner, **opts),
                            batch=2, seq=16, d=32, n_heads=8)
    with fresh_cache():
        _, codes = run_and_get_code(step)
    values = [t.grad.to_local() for t in leaves]
    return sorted(k for code in codes for k in re.findall(r"^(cpp_fused_\w+) = ", code, re.M)), values


@pytest.mark.parametrize("way", ["regional", "marked"])
def test_an_attention_block_generates_no_kernel_and_gives_the_aot_graphs_values(way, caplog):
    # the backward's input gradient (residual / 2 + three products read through reshapes)
    # accumulates in addmm, and the saved logsumexp's transpose is an ATen clone (Note: [A sum
    # of matrix products accumulates in the library call], Note: [Attention's layout copy runs
    # as its ATen op]); the values are compared with aot_eager's, the same graphs unlowered (a
    # fake process group sums nothing, so eager, whose collectives differ, is no reference here)
    with caplog.at_level(logging.INFO, logger="localmap_fx.lone_ops"):
        kernels, got = _attention(way, "inductor", {})
    before, _ = _attention(way, "inductor", {"lone_ops_as_aten": False})
    _, ref = _attention(way, "aot_eager", {})
    assert kernels == [], kernels
    assert any("add_div" in k for k in before), before  # lone_ops_as_aten=False: Inductor fuses the sum
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if r.name == "localmap_fx.lone_ops"]
    assert any("3 matrix product(s) accumulate into their addend (addmm)" in line for line in lines), lines
    assert any("aten.clone.default" in line and "aten.div.Tensor" in line for line in lines), lines


def test_one_graph_of_repeated_layers_keeps_its_kernels(caplog):
    # Note: [Repeated layers in one graph keep their kernels]: the default keeps a small
    # 3-layer stack one graph, whose lone ops would be called once per layer for the C++
    # files of one; its kernels are those lone_ops_as_aten=False gives, and it says so
    with caplog.at_level(logging.INFO, logger="localmap_fx.lone_ops"):
        got, kernels, model, x = _step({}, marked=False)
    _, kernels_off, _, _ = _step({"lone_ops_as_aten": False}, marked=False)
    assert kernels == kernels_off > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "localmap_fx.lone_ops"]
    assert lines == ["one graph of 3 repeated layers: ops with nothing to fuse with keep their kernels"], lines
    for a, r in zip(got, _eager(model, x)):
        torch.testing.assert_close(a.to_local(), r.to_local(), rtol=1e-5, atol=1e-5)


def test_a_compiled_sum_with_dynamic_shapes_equals_eager():
    # Note: [A sum of matrix products accumulates in the library call]: symbolic sizes are left
    w1, w2 = torch.randn(16, 16), torch.randn(16, 16)

    def f(x):
        return x + (x.view(-1, 16) @ w1).view(x.shape) + (x.view(-1, 16) @ w2).view(x.shape)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=localmap_fx.backend("inductor"), dynamic=True)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 4, 16)
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-5, atol=1e-5)


def test_a_product_the_add_broadcasts_compiles_and_equals_eager():
    # a (16, 32) product added to a (2, 16, 32) tensor is no accumulation: it once crashed the
    # compile (a view of the product to the sum's shape)
    x, a, w = torch.randn(2, 16, 32), torch.randn(16, 8), torch.randn(8, 32)

    def f(x, a, w):
        return x * 2 + a @ w

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend=localmap_fx.backend("inductor"))(x, a, w), f(x, a, w))
