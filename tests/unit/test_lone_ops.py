"""``passes/lone_ops.py``: which ops of an AOT graph have nothing to fuse with
(finding), and the marks that keep every other op in Inductor (rewriting).

Graphs are traced with ``make_fx`` at the ATen level, as AOTAutograd hands
them to Inductor; the collective graph is built by hand (no process group).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from localmap_fx.passes.lone_ops import MARK, find_lone_ops, lone_ops_to_aten, mark_for_inductor


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
    mark_for_inductor(gm, lone)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        assert (MARK in n.meta.get("custom", {})) == (n not in lone), n
    assert mm.meta["custom"]["user"] == 1


def test_subgraph_nodes_are_marked_too():
    # an invoke_subgraph body is lowered under the same fallback switch
    outer = make_fx(lambda x, w1, w2: torch.relu(x @ w1) @ w2 + x)(*_x())
    body = make_fx(lambda a: (a * 2).sin())(torch.randn(3))
    outer.add_submodule("body", body)
    lone = frozenset(find_lone_ops(outer.graph))
    mark_for_inductor(outer, lone)
    assert all(MARK in n.meta.get("custom", {}) for n in body.graph.nodes if n.op == "call_function")


def test_a_graph_without_lone_ops_is_left_unmarked():
    gm = make_fx(lambda x, w1, w2: (torch.relu(x @ w1) * 2) @ w2)(*_x())
    out, lone = lone_ops_to_aten(gm)
    assert out is gm and lone == ()
    assert not any("custom" in n.meta for n in gm.graph.nodes)


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
