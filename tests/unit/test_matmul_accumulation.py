"""A matrix product read by an ``add`` alone accumulates into the addend, through reshapes
(Note: [A sum of matrix products accumulates in the library call]): which adds are found,
and what the rewrite leaves, on graphs traced by ``make_fx`` (ATen, fake values)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from localmap_fx.passes.matmul_accumulation import accumulate_into_addmm, find_accumulations

aten = torch.ops.aten


def _trace(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _gradient_sum(t, a1, b1, a2, b2, a3, b3):
    # the attention block's input gradient: residual / 2 plus three projections' products
    s = t / 2 + (a1 @ b1).view(2, 16, 32)
    s = s + (a2 @ b2).view(2, 16, 32)
    return s + (a3 @ b3).view(2, 16, 32)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, 16, 32, generator=g)
    return (t, *(torch.randn(*s, generator=g) for _ in range(3) for s in ((32, 16), (16, 32))))


def test_each_add_of_a_product_read_through_a_view_is_found():
    gm = _trace(_gradient_sum, *_inputs())
    found = find_accumulations(gm.graph)
    adds = [n for n in gm.graph.nodes if n.target == aten.add.Tensor]
    mms = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    assert [a.add for a in found] == adds
    assert [a.mm for a in found] == mms
    assert all(len(a.views) == 1 and a.views[0].target == aten.view.default for a in found)


def test_the_rewrite_leaves_a_chain_of_addmm_and_the_same_values():
    args = _inputs()
    gm = _trace(_gradient_sum, *args)
    accumulate_into_addmm(gm.graph, find_accumulations(gm.graph))
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    assert aten.add.Tensor not in targets and aten.mm.default not in targets
    assert targets.count(aten.addmm.default) == 3
    assert targets.count(aten.div.Tensor) == 1
    # each addmm accumulates into the previous one's sum
    addmms = [n for n in gm.graph.nodes if n.target == aten.addmm.default]
    for prev, nxt in zip(addmms, addmms[1:]):
        assert nxt.args[0] is prev
    torch.testing.assert_close(gm(*args), _gradient_sum(*args), rtol=1e-6, atol=1e-6)
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in gm.graph.nodes if n.op == "call_function")


def test_a_two_dimensional_sum_needs_no_reshape():
    def f(c, a, b):
        return c + a @ b

    args = (torch.randn(4, 6), torch.randn(4, 5), torch.randn(5, 6))
    gm = _trace(f, *args)
    accumulate_into_addmm(gm.graph, find_accumulations(gm.graph))
    gm.recompile()
    assert _targets(gm) == [aten.addmm.default]
    torch.testing.assert_close(gm(*args), f(*args))


def test_a_product_read_elsewhere_too_is_left():
    def f(c, a, b):
        p = a @ b
        return c + p, p * 2

    gm = _trace(f, torch.randn(4, 6), torch.randn(4, 5), torch.randn(5, 6))
    assert find_accumulations(gm.graph) == ()


def test_a_broadcast_bias_is_left_to_inductor():
    gm = _trace(lambda bias, a, b: a @ b + bias, torch.randn(6), torch.randn(4, 5), torch.randn(5, 6))
    assert find_accumulations(gm.graph) == ()


def test_alpha_type_promotion_and_a_transposed_addend_are_left():
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    assert find_accumulations(_trace(lambda c, a, b: torch.add(c, a @ b, alpha=2), torch.randn(4, 6), a, b).graph) == ()
    assert find_accumulations(_trace(lambda c, a, b: c + a @ b, torch.randn(4, 6, dtype=torch.float64), a, b).graph) == ()
    assert find_accumulations(_trace(lambda c, a, b: c.t() + a @ b, torch.randn(6, 4), a, b).graph) == ()


def test_a_product_added_to_itself_is_left():
    def f(a, b):
        p = (a @ b).view(2, 2, 6)
        return p + p

    gm = _trace(f, torch.randn(4, 5), torch.randn(5, 6))
    assert find_accumulations(gm.graph) == ()


def test_a_graph_off_the_cpu_is_left():
    # meta tensors stand in for a GPU's here: only CPU graphs are rewritten
    def f(c, a, b):
        return c + a @ b

    gm = make_fx(f)(*(torch.empty(s, device="meta") for s in ((4, 6), (4, 5), (5, 6))))
    assert find_accumulations(gm.graph) == ()


def test_symbolic_sizes_are_left():
    def f(c, a, b):
        return c + (a @ b).view(c.shape)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(2, 4, 6), torch.randn(8, 5), torch.randn(5, 6))
    assert find_accumulations(gm.graph) == ()



def test_a_broadcast_product_is_left():
    # the add broadcasts a (16, 32) product over a (2, 16, 32) addend: no addmm computes that
    gm = _trace(lambda x, a, w: x * 2 + a @ w, torch.randn(2, 16, 32), torch.randn(16, 8), torch.randn(8, 32))
    assert find_accumulations(gm.graph) == ()
    gm = _trace(lambda x, a, w: x + (a @ w).view(1, 16, 32), torch.randn(2, 16, 32), torch.randn(16, 8),
                torch.randn(8, 32))
    assert find_accumulations(gm.graph) == ()


def test_a_low_precision_sum_is_left():
    # a bf16 chain would round each link's sum; Inductor's fused kernel sums in fp32 and rounds once
    args = [t.to(torch.bfloat16) for t in _inputs()]
    assert find_accumulations(_trace(_gradient_sum, *args).graph) == ()
