"""``passes/lone_ops.py``: which ops of a graph Inductor lowers have nothing to
fuse with (finding), the marks that keep every other op in Inductor
(rewriting), and the scope that installs the pass.

Graphs are traced with ``make_fx`` at the ATen level, as Inductor lowers
them; the collective graph is built by hand (no process group).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from localmap_fx._torch_compat import inductor_config
from localmap_fx.passes.lone_ops import (
    MARK,
    LoneOpsToAten,
    compiling_lone_ops_as_aten,
    find_lone_ops,
    mark_for_inductor,
)


def _x():
    return torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)


def _lone(f, *args) -> list[str]:
    gm = make_fx(f)(*args)
    return [str(n.target) for n in find_lone_ops(gm.graph)]


def test_ops_between_matrix_products_and_graph_inputs_are_lone():
    # a TP block's forward: relu between two mm, the residual add after the second
    assert _lone(lambda x, w1, w2: torch.relu(x @ w1) @ w2 + x, *_x()) == ["aten.relu.default", "aten.add.Tensor"]


def test_ops_that_feed_each_other_are_not_lone():
    # relu -> mul fuse into one kernel; the add after the mm is still alone
    assert _lone(lambda x, w1, w2: (torch.relu(x @ w1) * 2) @ w2 + x, *_x()) == ["aten.add.Tensor"]


def test_a_view_between_two_ops_does_not_separate_them():
    def f(x, w1, w2):
        h = torch.relu(x @ w1)
        return (h.t() * 3).t() @ w2

    assert _lone(f, *_x()) == []


def test_a_multi_output_op_and_its_readers_fuse():
    def f(x, w1, w2):
        var, mean = torch.var_mean(x @ w1, dim=-1, keepdim=True)
        return (x @ w1 - mean) @ w2

    # var_mean's mean read through getitem by the sub: neither is lone
    lone = _lone(f, *_x())
    assert "aten.var_mean.correction" not in lone and "aten.sub.Tensor" not in lone


def test_random_and_in_place_ops_are_never_lone():
    def rand(x, w1, w2):
        return torch.rand_like(x @ w1) @ w2

    def inplace(x, w1, w2):
        h = x @ w1
        h.relu_()
        return h @ w2

    assert _lone(rand, *_x()) == []
    assert _lone(inplace, *_x()) == []


def test_a_collective_is_no_fusion_partner():
    # mm -> relu -> all_reduce -> wait -> add(input): relu and add are lone
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    relu = g.call_function(torch.ops.aten.relu.default, (mm,))
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (relu, "sum", "0"))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    add = g.call_function(torch.ops.aten.add.Tensor, (wait, x))
    g.output(add)
    for n in (mm, relu, ar, wait, add):
        n.meta["val"] = torch.empty(4, 4)
    assert find_lone_ops(g) == (relu, add)


def test_a_node_without_a_tensor_value_is_not_lone():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    relu = g.call_function(torch.ops.aten.relu.default, (mm,))  # no meta["val"]: unknown result
    g.output(g.call_function(torch.ops.aten.mm.default, (relu, w)))
    assert find_lone_ops(g) == ()


def test_every_other_node_is_marked_and_existing_marks_kept():
    gm = make_fx(lambda x, w1, w2: torch.relu(x @ w1) @ w2 + x)(*_x())
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    mm.meta["custom"] = {"user": 1}
    lone = frozenset(find_lone_ops(gm.graph))
    mark_for_inductor(gm.graph, lone)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        assert (MARK in n.meta.get("custom", {})) == (n not in lone), n
    assert mm.meta["custom"]["user"] == 1


def test_the_pass_marks_a_graph_without_lone_ops_whole():
    # under fallback_by_default an unmarked op would run as ATen: every op is marked
    gm = make_fx(lambda x, w1, w2: (torch.relu(x @ w1) * 2) @ w2)(*_x())
    LoneOpsToAten()(gm.graph)
    assert all(MARK in n.meta["custom"] for n in gm.graph.nodes if n.op == "call_function")


def test_the_pass_has_a_stable_cache_uuid():
    assert LoneOpsToAten().uuid() == LoneOpsToAten().uuid() is not None


def test_the_scope_keeps_a_users_post_grad_pass_and_restores_the_config():
    def users_pass(graph):
        pass

    before = (inductor_config.fallback_by_default, inductor_config.post_grad_custom_post_pass)
    with inductor_config.patch(post_grad_custom_post_pass=users_pass):
        with compiling_lone_ops_as_aten():
            passes = inductor_config.post_grad_custom_post_pass
            assert inductor_config.fallback_by_default is True
            assert passes[0] is users_pass and isinstance(passes[1], LoneOpsToAten)
    assert (inductor_config.fallback_by_default, inductor_config.post_grad_custom_post_pass) == before


def test_the_scope_nested_adds_the_pass_once():
    with compiling_lone_ops_as_aten(), compiling_lone_ops_as_aten():
        passes = inductor_config.post_grad_custom_post_pass
        assert sum(isinstance(p, LoneOpsToAten) for p in passes) == 1


def test_the_scope_turned_off_switches_nothing():
    with compiling_lone_ops_as_aten(False):
        assert inductor_config.fallback_by_default is False
        assert not any(isinstance(p, LoneOpsToAten) for p in (inductor_config.post_grad_custom_post_pass or ()))


def test_without_post_grad_passes_nothing_is_switched():
    # no pass would mark a node, and every op would run as ATen
    with inductor_config.patch(use_post_grad_passes=False), compiling_lone_ops_as_aten():
        assert inductor_config.fallback_by_default is False


def test_getitem_is_looked_through():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    pair = g.call_function(torch.ops.aten.var_mean.correction, (x,), {"dim": [1], "keepdim": True})
    mean = g.call_function(operator.getitem, (pair, 1))
    sub = g.call_function(torch.ops.aten.sub.Tensor, (x, mean))
    g.output(g.call_function(torch.ops.aten.mm.default, (sub, w)))
    for n in (pair, sub):
        n.meta["val"] = torch.empty(4, 4)
    assert find_lone_ops(g) == ()


def test_every_extern_name_is_an_aten_op():
    # a name torch renamed would silently count its op as fusible (the safe side), and
    # its neighbours would keep their kernels: a torch upgrade shows it here
    from localmap_fx.passes.lone_ops import _EXTERN_ATEN

    assert [n for n in sorted(_EXTERN_ATEN) if not hasattr(torch.ops.aten, n)] == []
