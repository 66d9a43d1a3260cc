"""The shared analyses of ``localmap_fx.analysis`` on hand-built graphs.

``find_effects`` is the one decision "does this code write to or alias an
input" behind capture's reuse probe, ``outline_regions`` and layer sharing
(Note: [Deciding that a body writes to or aliases an input]).  Each case
below is a small function traced with ``torch.fx.symbolic_trace`` and run on
plain CPU tensors (the analysis makes its own fakes).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from expecttest import assert_expected_inline
from torch.distributed.tensor import Shard, distribute_tensor

from localmap_fx.analysis import (
    Effects,
    Write,
    copy_nodes,
    find_effects,
    span_io,
    storage_key,
    structural_key,
)
from localmap_fx.testing.graphs import normalized

from helpers import mesh_1d


def _effects(fn, *values) -> Effects:
    gm = fx.symbolic_trace(fn)
    return find_effects(gm.graph, gm, list(values))


def _xw():
    return torch.randn(4, 3), torch.randn(4, 3)


def test_in_place_op_on_an_input():
    def f(x, w):
        x.add_(w)
        return x * 2

    assert _effects(f, *_xw()) == Effects(writes=(Write("add_", "add_", 0),))


def test_out_argument_writes_its_input():
    def f(x, w):
        torch.mul(w, 3.0, out=x)
        return w + 1

    effects = _effects(f, *_xw())
    assert effects.written_inputs() == [(0, "mul")]
    assert effects.output_aliases == ()


def test_view_returned_aliases_its_input():
    def f(x, w):
        return x.t(), w + 1

    assert _effects(f, *_xw()) == Effects(output_aliases=((0, "input", 0),))


def test_write_through_a_view_is_a_write_to_the_input():
    def f(x, w):
        x.view(-1)[:2].mul_(2.0)
        return w + 1

    assert _effects(f, *_xw()).written_inputs() == [(0, "mul_")]


def test_clean_body_has_no_effects():
    def f(x, w):
        return torch.relu(x @ w.t()) + 1

    assert _effects(f, *_xw()) == Effects()


def test_write_to_a_value_made_inside_is_not_an_input_write():
    def f(x, w):
        h = x * 2
        h.add_(w)
        return h

    effects = _effects(f, *_xw())
    assert effects.writes == (Write("add_", "add_", None),)
    assert effects.written_inputs() == [] and effects.output_aliases == ()


def test_temporaries_an_op_fills_itself_are_not_writes():
    # dropout on CPU is empty_like(x).bernoulli_(p) inside one node: no value of the graph is written
    def f(x, w):
        return torch.nn.functional.dropout(x, 0.5, training=True) + w

    assert _effects(f, *_xw()) == Effects()


def test_outputs_sharing_storage_are_reported():
    def f(x, w):
        y = x * w
        return y, y.view(-1)

    assert _effects(f, *_xw()) == Effects(output_aliases=((1, "output", 0),))


def test_reshape_aliases_only_when_it_is_a_view():
    # an op-name list cannot tell these apart; the storages after the run can
    def f(x):
        return x.reshape(-1)

    contiguous = torch.randn(4, 3)
    transposed = torch.randn(3, 4).t()
    assert _effects(f, contiguous) == Effects(output_aliases=((0, "input", 0),))
    assert _effects(f, transposed) == Effects()


def test_inputs_get_their_own_storage_even_when_the_values_share_one():
    # the analysis is about the code: tied values at a call site are the caller's check
    x = torch.randn(4, 3)

    def f(a, b):
        a.add_(1.0)
        return b * 2

    assert _effects(f, x, x).written_inputs() == [(0, "add_")]


def test_a_graph_that_cannot_run_reports_an_error():
    def f(x, w):
        return x @ w  # (4, 3) @ (4, 3): shapes do not match

    effects = _effects(f, *_xw())
    assert effects.error is not None and effects.error.startswith("not analyzable")
    assert effects.writes == () and effects.output_aliases == ()


def test_dtensor_inputs_get_fresh_local_tensors():
    mesh = mesh_1d()
    x = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])

    def writes(a, b):
        a.mul_(0.5)
        return a + b

    def views(a, b):
        return a.to_local(), b + 1

    assert _effects(writes, x, w).written_inputs() == [(0, "mul_")]
    assert _effects(views, x, w) == Effects(output_aliases=((0, "input", 0),))
    assert storage_key(x) == storage_key(x.to_local()) != storage_key(w)


def test_copy_nodes_and_structural_key_of_a_span():
    def f(x, w):
        a = (x * w).relu()
        b = (a * w).relu()
        return b + a

    gm = fx.symbolic_trace(f)
    x, w = _xw()
    for n in gm.graph.nodes:
        n.meta["val"] = x  # every value here is a (4, 3) float tensor
    attr = functools.partial(getattr, gm)
    nodes = list(gm.graph.nodes)  # x, w, mul, relu, mul_1, relu_1, add, output
    first, second, across = nodes[2:4], nodes[4:6], nodes[3:5]
    inputs, outputs = span_io(second)
    assert [n.name for n in inputs] == ["relu", "w"] and [n.name for n in outputs] == ["relu_1"]
    graph, owner = copy_nodes(second, inputs, outputs, attr, ["a", "w"])
    copied = fx.GraphModule(owner, graph)
    assert_expected_inline(normalized(copied), """\
class GraphModule(torch.nn.Module):
    def forward(self, a: "f32[4, 3]", w: "f32[4, 3]"):
        mul_1: "f32[4, 3]" = a * w
        relu_1: "f32[4, 3]" = mul_1.relu()
        return (relu_1,)
""")
    assert torch.equal(copied(x, w)[0], (x * w).relu())

    def key(span):
        ins, outs = span_io(span)
        return structural_key(span, attr, ins, outs)

    # the same code on inputs with the same metadata: equal keys; other code: not
    assert key(first) == key(second)
    assert key(across) != key(second)


def test_writes_inside_an_outlined_subgraph_are_found():
    body = fx.symbolic_trace(lambda x, w: (x.add_(w), w * 2))
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    sub = g.get_attr("body")
    call = g.call_function(torch.ops.higher_order.invoke_subgraph, (sub, "body", x, w))
    out = g.call_function(operator.getitem, (call, 1))
    g.output((out,))
    root = torch.nn.Module()
    root.body = body
    effects = find_effects(g, root, list(_xw()))
    assert effects.written_inputs() == [(0, "add_")]
    assert effects.writes[0].node == call.name
