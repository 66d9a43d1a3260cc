"""``passes/late_decompositions.py``: which ops AOTAutograd leaves whole under the
lone-op scope (finding), their decomposition inside the graph Inductor lowers
(rewriting), and the lone-op pass that uses both.

Graphs are traced with ``make_fx`` through the table AOTAutograd gets (the
held-back ops stay whole, as in the AOT graph), values checked against eager.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from localmap_fx._torch_compat import inductor_config, inductor_lowerings, select_decomp_table
from localmap_fx.passes import late_decompositions as late
from localmap_fx.passes.lone_ops import MARK, LoneOpsToAten, aot_decompositions, compiling_lone_ops_as_aten

aten = torch.ops.aten


def _aot_graph(f, *args) -> fx.GraphModule:
    return make_fx(f, late.aot_table(), tracing_mode="fake")(*args)


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in _calls(gm)]


def _tb(gm: fx.GraphModule) -> fx.Node:
    (tb,) = gm.graph.find_nodes(op="call_function", target=aten.threshold_backward.default)
    return tb


def test_activation_gradients_without_a_lowering_are_held_back():
    held = late.held_back_ops()
    for op in (aten.threshold_backward.default, aten.gelu_backward.default, aten.silu_backward.default,
               aten.tanh_backward.default, aten.sigmoid_backward.default):
        assert op in held, op
    for op in held:
        assert op in select_decomp_table() and op not in inductor_lowerings and not op._schema.is_mutable
        assert op._schema.name.split("::")[-1] in late.ACTIVATION_GRADIENTS


def test_forward_ops_dropout_and_ops_inductor_lowers_are_not_held_back():
    held = late.held_back_ops()
    # gelu: Inductor's CPU conv + gelu pattern matches its decomposition; dropout's backward:
    # the fused-attention patterns match it; relu, add: lowered; softmax: no activation gradient
    for op in (aten.gelu.default, aten.native_dropout_backward.default, aten.relu.default, aten.add.Tensor,
               aten.round.decimals, aten.clamp.default, aten._softmax.default, aten.native_layer_norm.default):
        assert op not in held, op


def test_the_aot_table_is_inductors_without_the_held_back_ops():
    table, full = late.aot_table(), select_decomp_table()
    assert set(table) == set(full) - late.held_back_ops()
    assert all(table[op] is full[op] for op in table)


def test_decompose_replaces_a_node_by_inductors_decomposition_with_equal_values():
    def f(g, x):
        return aten.threshold_backward(g, x, 0.0) * 2

    g, x = torch.randn(4, 8), torch.randn(4, 8)
    gm = _aot_graph(f, g, x)
    tb = _tb(gm)
    assert late.decompose(gm.graph, [tb]) == ()
    gm.recompile()
    gm.graph.lint()
    assert _targets(gm) == ["aten.le.Scalar", "aten.scalar_tensor.default", "aten.where.self", "aten.mul.Tensor"]
    # each new node carries its value and the op it came from (Inductor's kernel names)
    new = _calls(gm)[:3]
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in new)
    assert {n.meta["original_aten"] for n in new} == {aten.threshold_backward.default}
    torch.testing.assert_close(gm(g, x), f(g, x), rtol=0, atol=0)


def test_decompose_a_node_reading_one_input_twice():
    def f(x):
        return aten.tanh_backward(x, x) + 1

    x = torch.randn(3, 5)
    gm = _aot_graph(f, x)
    (tb,) = gm.graph.find_nodes(op="call_function", target=aten.tanh_backward.default)
    late.decompose(gm.graph, [tb])
    gm.recompile()
    assert "aten.tanh_backward.default" not in _targets(gm)
    torch.testing.assert_close(gm(x), f(x))


def test_the_pass_keeps_a_lone_held_back_op_whole_and_decomposes_the_others():
    def f(g, x, w1, w2, y):
        lone = aten.threshold_backward(g @ w2, x, 0.0) @ w1  # between two mm: lone
        fused = aten.gelu_backward(g @ w2, y) * 3  # feeds a mul: fuses
        return lone, fused

    args = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8))
    gm = _aot_graph(f, *args)
    assert {"aten.threshold_backward.default", "aten.gelu_backward.default"} <= set(_targets(gm))
    LoneOpsToAten()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert "aten.threshold_backward.default" in targets and "aten.gelu_backward.default" not in targets
    unmarked = [str(n.target) for n in _calls(gm) if MARK not in n.meta.get("custom", {})]
    assert unmarked == ["aten.threshold_backward.default"]
    for a, b in zip(gm(*args), f(*args)):
        torch.testing.assert_close(a, b)


def test_the_aot_decompositions_are_the_held_back_table_only_inside_the_scope():
    assert aot_decompositions() is None
    with compiling_lone_ops_as_aten():
        assert set(aot_decompositions()) == set(late.aot_table())
    with compiling_lone_ops_as_aten(on=False):
        assert aot_decompositions() is None
    with inductor_config.patch(use_post_grad_passes=False), compiling_lone_ops_as_aten():
        assert aot_decompositions() is None  # no pass would decompose them again


def test_the_pass_uuid_covers_every_file_the_pass_runs():
    from localmap_fx._torch_compat import get_hash_for_files
    from localmap_fx.passes import attention_layouts, lone_ops, matmul_accumulation

    assert LoneOpsToAten().uuid() == get_hash_for_files((
        lone_ops.__file__, late.__file__, matmul_accumulation.__file__, attention_layouts.__file__))


def test_a_node_without_example_values_is_left_whole():
    gm = _aot_graph(lambda g, x: aten.threshold_backward(g, x, 0.0) * 2, torch.randn(4, 8), torch.randn(4, 8))
    tb = _tb(gm)
    del tb.args[0].meta["val"]
    before = _targets(gm)
    assert late.decompose(gm.graph, [tb]) == (tb,)
    assert _targets(gm) == before


def test_a_decomposed_node_gives_the_ops_aot_autograd_would_have_traced():
    # the non-lone ops reach lowering as the same core ops as with Inductor's whole table
    def f(g, x):
        return aten.gelu_backward(g, x) * 3 + aten.silu_backward(g, x)

    args = (torch.randn(4, 8), torch.randn(4, 8))
    reference = make_fx(f, select_decomp_table(), tracing_mode="fake")(*args)
    gm = _aot_graph(f, *args)
    held = late.held_back_ops()
    late.decompose(gm.graph, [n for n in gm.graph.nodes if n.target in held])
    gm.recompile()
    assert _targets(gm) == _targets(reference)
    torch.testing.assert_close(gm(*args), reference(*args), rtol=0, atol=0)


def test_the_pass_leaves_a_held_back_op_it_cannot_decompose_unmarked():
    # not lone (it feeds a mul), but without an example value it cannot be traced: Inductor has no
    # lowering for it, so it must run through the fallback kernel, unmarked
    gm = _aot_graph(lambda g, x: aten.threshold_backward(g, x, 0.0) * 2, torch.randn(4, 8), torch.randn(4, 8))
    tb = _tb(gm)
    del tb.args[0].meta["val"]
    LoneOpsToAten()(gm.graph)
    assert MARK not in tb.meta.get("custom", {})
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    assert mul.meta["custom"][MARK]


def test_a_lone_held_back_op_stays_whole_only_next_to_a_matrix_product():
    from localmap_fx.passes.lone_ops import find_lone_ops, keeps_whole

    args = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8))
    between = _aot_graph(lambda g, x, w: aten.threshold_backward(g @ w, x, 0.0) @ w, *args)
    assert keeps_whole(find_lone_ops(between.graph)) == (_tb(between),)
    # only a subgraph's inputs and output around it (a flex-attention score_mod): lowered there,
    # where Inductor has no fallback kernel, so it is decomposed
    alone = _aot_graph(lambda g, x, w: aten.threshold_backward(g, x, 0.0), *args)
    assert find_lone_ops(alone.graph) == (_tb(alone),)
    assert keeps_whole(find_lone_ops(alone.graph)) == ()
    LoneOpsToAten()(alone.graph)
    alone.recompile()
    assert "aten.threshold_backward.default" not in _targets(alone)
    torch.testing.assert_close(alone(*args), aten.threshold_backward(args[0], args[1], 0.0), rtol=0, atol=0)


def test_a_held_back_op_the_user_marked_for_inductor_is_decomposed():
    from localmap_fx.passes.lone_ops import find_lone_ops, keeps_whole

    args = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 8))
    gm = _aot_graph(lambda g, x, w: aten.threshold_backward(g @ w, x, 0.0) @ w, *args)
    _tb(gm).meta["custom"] = {MARK: "user"}  # fx.traceback.annotate's form
    assert keeps_whole(find_lone_ops(gm.graph)) == ()
    LoneOpsToAten()(gm.graph)
    gm.recompile()
    assert "aten.threshold_backward.default" not in _targets(gm)
    # the decomposed nodes carry the user's mark
    (where,) = gm.graph.find_nodes(op="call_function", target=aten.where.self)
    assert where.meta["custom"][MARK]
