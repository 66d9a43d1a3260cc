"""A CPU attention input Inductor would copy to a contiguous layout gets an ATen ``clone``
instead (Note: [Attention's layout copy runs as its ATen op]): which inputs are found, and
what the rewrite leaves, on graphs traced by ``make_fx`` (ATen, fake values)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from localmap_fx.passes.attention_layouts import _innermost_last, copy_by_aten, find_layout_copies
from localmap_fx.passes.lone_ops import find_lone_ops, made_by_inductor

aten = torch.ops.aten
B, H, S, D = 2, 2, 16, 8


def _backward(grad, q, k, v, out, lse):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(grad, q, k, v, out, lse, 0.0, True)


def _inputs(lse):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    out, fwd_lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    return (torch.randn(B, H, S, D, generator=g), q, k, v, out, lse(fwd_lse))


def _trace(f, args):
    return make_fx(f, tracing_mode="fake")(*args)


def test_the_stride_order_test_is_inductors():
    # the last dimension must come first in the stride order; a tie goes to the later one
    # (get_stride_order([16, 0, 1, 0]) == [3, 1, 2, 0])
    assert _innermost_last(torch.empty(2, 2, 16))
    assert not _innermost_last(torch.empty(2, 16, 2).transpose(1, 2))
    assert _innermost_last(torch.empty(4, 1))  # strides (1, 1)
    assert _innermost_last(torch.empty(2, 1, 16, 1).expand(2, 3, 16, 4))  # strides (16, 0, 1, 0)
    assert not _innermost_last(torch.empty(4, 1, 3).expand(4, 5, 3)[:, :, :1])  # strides (3, 0, 1)


def test_a_transposed_saved_logsumexp_is_found_and_a_contiguous_one_is_not():
    # the CPU kernel's logsumexp, (B, H, S) laid out (B, S, H), as the forward saves it
    saved = _inputs(lambda lse: lse.transpose(1, 2).contiguous().transpose(1, 2))
    gm = _trace(_backward, saved)
    found = find_layout_copies(gm.graph, made_by_inductor)
    assert [(c.attention.target, c.key) for c in found] == [
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 5)]
    assert find_layout_copies(_trace(_backward, _inputs(lambda lse: lse.contiguous())).graph, made_by_inductor) == ()


def test_an_input_a_fusible_op_makes_is_left_to_inductor():
    args = _inputs(lambda lse: lse.transpose(1, 2).contiguous().transpose(1, 2))

    def g(grad, q, k, v, out, lse):
        # made by a pointwise op (which Inductor can write in any layout), then transposed
        return _backward(grad, q, k, v, out, (lse.transpose(1, 2) * 1.5).transpose(1, 2))

    assert find_layout_copies(_trace(g, args).graph, made_by_inductor) == ()


def test_the_copy_is_a_lone_clone_and_the_values_are_the_same():
    args = _inputs(lambda lse: lse.transpose(1, 2).contiguous().transpose(1, 2))
    gm = _trace(_backward, args)
    copy_by_aten(gm.graph, find_layout_copies(gm.graph, made_by_inductor))
    gm.graph.lint()
    gm.recompile()
    clones = [n for n in gm.graph.nodes if n.target == aten.clone.default]
    assert len(clones) == 1
    assert clones[0].kwargs == {"memory_format": torch.contiguous_format}
    assert clones[0].meta["val"].is_contiguous()
    assert find_lone_ops(gm.graph) == (clones[0],)
    for got, want in zip(gm(*args), _backward(*args)):
        assert torch.equal(got, want)


def test_a_transposed_mask_given_by_keyword_is_copied_too():
    # Inductor constrains the keyword arguments as well (sdpa_constraint): a mask whose last
    # dimension is not innermost got a copy kernel of its own
    def f(q, k, v, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    mask = torch.randn(S, S, generator=g).t()
    gm = _trace(f, (q, k, v, mask))
    found = find_layout_copies(gm.graph, made_by_inductor)
    assert [c.key for c in found] == ["attn_mask"]
    copy_by_aten(gm.graph, found)
    gm.recompile()
    (call,) = [n for n in gm.graph.nodes if n.target == aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert call.kwargs["attn_mask"].target == aten.clone.default
    for got, want in zip(gm(q, k, v, mask), f(q, k, v, mask)):
        assert torch.equal(got, want)
