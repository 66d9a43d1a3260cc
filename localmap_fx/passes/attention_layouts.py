"""An input CPU attention needs in another layout is copied by ``clone``, an ATen op, not a kernel.

Runs inside Inductor as part of the lone-op pass (``lone_ops.py``), before it
looks for lone ops.

Note: [Attention's layout copy runs as its ATen op]
    Inductor's lowering of the CPU flash-attention ops requires each tensor
    input to keep its last dimension innermost, and copies one that does not
    into a contiguous buffer (``sdpa_constraint`` in Inductor's lowering).
    The attention backward reads the forward's ``logsumexp``, which the CPU
    kernel returns as ``(B, H, S)`` laid out ``(B, S, H)``: a saved
    activation, so the copy fuses with nothing, and Inductor generates a
    transpose kernel for it, a C++ file at cold start (0.6 CPU-s here), the
    attention block's last one.  Made explicit in the graph, the copy is
    ``clone(x, memory_format=torch.contiguous_format)``, a lone op (Note: [A
    lone op runs as its ATen op]): it runs as its ATen op, and its result
    already has the layout Inductor asks for, so Inductor copies nothing::

        before                                        after
        ------                                        -----
        bw = _sdpa_for_cpu_backward(.., lse, ..)      c = clone(lse, memory_format=contiguous)   # ATen
          # Inductor: cpp_fused_..._transpose_0        bw = _sdpa_for_cpu_backward(.., c, ..)

    Only an input that Inductor would copy on its own (its last dimension not
    the innermost, and not contiguous already) and that no fusible op produces (a graph input or a library
    call's result, through views): a fusible producer writes the layout in its
    own kernel, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx

from .._torch_compat import detect_fake_mode
from ..graph_utils import carried_meta, node_value

__all__ = ["LayoutCopy", "copy_by_aten", "find_layout_copies"]

aten = torch.ops.aten
# the CPU attention ops whose lowering copies such an input (Inductor's sdpa_constraint)
_CPU_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


@dataclasses.dataclass(frozen=True)
class LayoutCopy:
    """Argument ``key`` of the attention call ``attention`` (a position, or a keyword such as
    ``attn_mask``) is copied to a contiguous layout."""

    attention: fx.Node
    key: int | str

    def arg(self) -> object:
        return self.attention.args[self.key] if isinstance(self.key, int) else self.attention.kwargs[self.key]

    def __str__(self) -> str:
        return f"{self.attention.name}: argument {self.key} ({self.arg()}) made contiguous"


def _innermost_last(value: torch.Tensor) -> bool:
    """Is the last dimension first in ``value``'s stride order (Inductor's ``get_stride_order``:
    a tie goes to the later dimension)?  Symbolic strides: yes (left to Inductor)."""
    strides = value.stride()
    if not strides or not all(isinstance(s, int) for s in strides):
        return True
    return all(strides[-1] <= s for s in strides[:-1])


def find_layout_copies(graph: fx.Graph, made_by_inductor: Callable[[fx.Node], bool]) -> tuple[LayoutCopy, ...]:
    """The inputs of ``graph``'s CPU attention calls that Inductor would copy with a kernel
    of its own (Note: [Attention's layout copy runs as its ATen op]);
    ``made_by_inductor(arg)``: are ``arg``'s values, seen through views, made by code
    Inductor generates (``lone_ops.made_by_inductor``, the lone-op pass's test)."""
    found: list[LayoutCopy] = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _CPU_ATTENTION:
            continue
        for key, arg in (*enumerate(n.args), *n.kwargs.items()):
            value = node_value(arg) if isinstance(arg, fx.Node) else None
            if (isinstance(arg, fx.Node) and isinstance(value, torch.Tensor) and value.device.type == "cpu"
                    and not _innermost_last(value) and not value.is_contiguous() and not made_by_inductor(arg)):
                found.append(LayoutCopy(n, key))
    return tuple(found)


def copy_by_aten(graph: fx.Graph, copies: tuple[LayoutCopy, ...]) -> None:
    """Give each of ``copies`` a ``clone(arg, memory_format=torch.contiguous_format)`` of its own
    (in place: Inductor's interface for a post-grad pass)."""
    for copy in copies:
        arg = copy.arg()
        if not isinstance(arg, fx.Node):
            raise TypeError(f"copy_by_aten: {copy} is not a node")
        value = node_value(arg)
        fake_mode = detect_fake_mode((value,))
        with graph.inserting_before(copy.attention):
            clone = graph.call_function(aten.clone.default, (arg,), {"memory_format": torch.contiguous_format})
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            clone.meta["val"] = aten.clone.default(value, memory_format=torch.contiguous_format)
        # not the user's annotations: a compile_with_inductor mark would make the copy a kernel again
        clone.meta.update(carried_meta(copy.attention, annotations=False))
        if isinstance(copy.key, int):
            args = list(copy.attention.args)
            args[copy.key] = clone
            copy.attention.args = tuple(args)
        else:
            copy.attention.kwargs = {**copy.attention.kwargs, copy.key: clone}
