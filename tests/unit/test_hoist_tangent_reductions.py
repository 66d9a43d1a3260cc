"""``passes/hoist_tangent_reductions``: finding a backward graph's all_reduce of a
tangent, and making its result a placeholder (hand-built backward graphs)."""

from __future__ import annotations

import torch
import torch.fx as fx
from expecttest import TestCase

from localmap_fx.passes import apply
from localmap_fx.passes.hoist_tangent_reductions import (
    TangentReduction,
    find_tangent_reductions,
    hoist_tangent_reductions,
    reductions_of,
)
from localmap_fx.testing.graphs import normalized

ops = torch.ops._c10d_functional
aten = torch.ops.aten


def _backward(view: bool = True, second_use: bool = True, group: str = "0") -> fx.GraphModule:
    """``saved_0 @ reduce(tangents_1)`` (+ ``tangents_1`` itself), as AOTAutograd partitions a TP block's backward."""
    g = fx.Graph()
    saved, tangent = g.placeholder("saved_0"), g.placeholder("tangents_1")
    src = g.call_function(aten.view.default, (tangent, [4, 8])) if view else tangent
    reduced = g.call_function(ops.wait_tensor.default, (g.call_function(ops.all_reduce.default, (src, "sum", group)),))
    out = g.call_function(aten.mm.default, (reduced, saved))
    if second_use:
        out = (out, g.call_function(aten.add.Tensor, (src, src)))
    else:
        out = (out,)
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    for n, v in zip(g.find_nodes(op="placeholder"), (torch.randn(8, 3), torch.randn(4, 8))):
        n.meta["val"] = v
    for n in g.nodes:
        if n.target is ops.wait_tensor.default:
            n.meta["val"] = torch.empty(4, 8)
    return gm


class TestHoistTangentReductions(TestCase):
    def test_finds_the_all_reduce_of_a_view_of_a_tangent(self):
        assert find_tangent_reductions(_backward()) == (TangentReduction(0, "sum", "0", (4, 8)),)
        assert find_tangent_reductions(_backward(view=False)) == (TangentReduction(0, "sum", "0", None),)

    def test_finds_nothing_where_no_tangent_is_reduced(self):
        g = fx.Graph()
        saved, tangent = g.placeholder("saved_0"), g.placeholder("tangents_1")
        reduced = g.call_function(ops.wait_tensor.default, (g.call_function(ops.all_reduce.default, (saved, "sum", "0")),))
        g.output((g.call_function(aten.mm.default, (reduced, tangent)),))
        assert find_tangent_reductions(fx.GraphModule(torch.nn.Module(), g)) == ()

    def test_the_reduction_becomes_a_placeholder_after_the_tangents(self):
        gm = apply(hoist_tangent_reductions, _backward())
        self.assertExpectedInline(normalized(gm), """\
class GraphModule(torch.nn.Module):
    def forward(self, saved_0: "f32[8, 3]", tangents_1: "f32[4, 8]", reduced_tangents_1: "f32[4, 8]"):
        view_default = torch.ops.aten.view.default(tangents_1, [4, 8])
        mm_default = torch.ops.aten.mm.default(reduced_tangents_1, saved_0)
        add_tensor = torch.ops.aten.add.Tensor(view_default, view_default)
        return (mm_default, add_tensor)
""")
        assert reductions_of(gm) == (TangentReduction(0, "sum", "0", (4, 8)),)

    def test_a_view_read_by_nothing_else_goes_with_the_reduction(self):
        gm = apply(hoist_tangent_reductions, _backward(second_use=False))
        self.assertExpectedInline(normalized(gm), """\
class GraphModule(torch.nn.Module):
    def forward(self, saved_0: "f32[8, 3]", tangents_1: "f32[4, 8]", reduced_tangents_1: "f32[4, 8]"):
        mm_default = torch.ops.aten.mm.default(reduced_tangents_1, saved_0)
        return (mm_default,)
""")

    def test_rewritten_graph_given_the_reduction_computes_what_the_graph_did(self):
        """Run on a one-rank group's stand-in (the all_reduce of one rank is the
        value): the rewritten graph fed the reduction the caller computes
        returns the original graph's outputs."""
        before = _backward()
        saved, tangent = torch.randn(8, 3), torch.randn(4, 8)
        stand_in = {ops.all_reduce.default: lambda t, op, group: t.clone(), ops.wait_tensor.default: lambda t: t}

        def run(gm, *args):
            env, it = {}, iter(args)
            for n in gm.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(it)
                elif n.op == "call_function":
                    fn = stand_in.get(n.target, n.target)
                    env[n] = fn(*fx.node.map_arg(n.args, env.__getitem__))
                elif n.op == "output":
                    return fx.node.map_arg(n.args[0], env.__getitem__)

        want = run(before, saved, tangent)
        after = apply(hoist_tangent_reductions, _backward())
        (r,) = reductions_of(after)
        got = run(after, saved, tangent, tangent.view(r.shape).clone())
        for a, b in zip(want, got):
            assert torch.equal(a, b)

    def test_one_reduction_per_tangent(self):
        """A tangent reduced twice (say over two groups) keeps its second
        all_reduce in the graph: the border computes one value per tangent."""
        gm = _backward(group="0")
        g = gm.graph
        tangent = next(n for n in g.find_nodes(op="placeholder") if n.name == "tangents_1")
        out = next(n for n in g.nodes if n.op == "output")
        with g.inserting_before(out):
            again = g.call_function(ops.wait_tensor.default, (g.call_function(ops.all_reduce.default,
                                                                               (tangent, "sum", "1")),))
        out.args = ((*out.args[0], again),)
        gm.recompile()
        assert find_tangent_reductions(gm) == (TangentReduction(0, "sum", "0", (4, 8)),)
        after = apply(hoist_tangent_reductions, gm)
        assert sum(n.target is ops.all_reduce.default for n in after.graph.nodes) == 1
