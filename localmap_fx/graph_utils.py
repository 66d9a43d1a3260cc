"""Small read-only helpers on FX graphs, shared by every stage of the pipeline.

One definition each of: a node's value (:func:`node_value`), the region
annotation dict (:func:`custom_meta`), functional collectives
(:func:`collective_name`, :func:`is_collective`), the DTensor boundary
operations (:func:`is_to_local`, :func:`is_from_local`,
:func:`is_redistribute`), mesh dimension names (:func:`mesh_dim_names`),
``get_attr`` targets (:func:`fetch_attr`), the subgraphs a higher-order op
calls (:func:`subgraph_calls`) and the walk over every nested graph
(:func:`nested_graphs`), an op's arguments by schema name
(:func:`schema_args`) and the frames of a node's ``stack_trace``
(:func:`stack_frames`, :func:`call_site_of`).  Analyses of whole graphs
(structural keys, writes and aliases) are in :mod:`localmap_fx.analysis`.

Nothing here mutates a graph.  This module sits at the bottom of the package
(it imports only torch), so capture, passes, lowering and debug all use it.

Note: [A node's value: example_value vs val]
    Dynamo stores the fake value of each node of the graph it captures under
    ``meta["example_value"]``; AOTAutograd and ``make_fx`` graphs store it
    under ``meta["val"]``.  Passes run on Dynamo graphs, the summaries on
    both kinds, so one reader prefers ``example_value`` and falls back to
    ``val``.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ._torch_compat import OpOverload, OpOverloadPacket

__all__ = [
    "calls_invoke_subgraph",
    "is_input_to_local",
    "node_value",
    "binds_unbacked_symbols",
    "custom_meta",
    "CARRIED_META",
    "carried_meta",
    "FUNCOL_NAMESPACES",
    "NON_COLLECTIVE_OPS",
    "funcol_op",
    "collective_name",
    "is_collective",
    "is_collective_op",
    "is_method",
    "is_to_local",
    "is_redistribute",
    "is_from_local",
    "mesh_dim_names",
    "fetch_attr",
    "subgraph_attr",
    "subgraph_calls",
    "NestedGraph",
    "nested_graphs",
    "schema_args",
    "getitem_users",
    "Frame",
    "stack_frames",
    "WRAPPER_FILES",
    "is_wrapper_frame",
    "call_site_of",
    "CUSTOM",
]

# node.meta key under which torch.fx.traceback.annotate stores annotations.
CUSTOM = "custom"


def node_value(node: Any) -> Any:
    """The (fake) value of ``node``: ``example_value``, else ``val``; None for non-nodes."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    val = meta.get("example_value")
    return val if val is not None else meta.get("val")


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic(value: Any) -> bool:
    """A symbolic scalar, or a tensor with a symbolic size or stride."""
    if isinstance(value, _SYMBOLIC):
        return True
    return isinstance(value, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())
    )


def binds_unbacked_symbols(nodes: Iterable[fx.Node]) -> fx.Node | None:
    """The first of ``nodes`` that binds an unbacked symbol (``.item()``,
    ``.tolist()``, a data-dependent output size), or None."""
    for n in nodes:
        if n.meta.get("unbacked_bindings"):
            return n
    return None


def is_size_computation(node: fx.Node) -> bool:
    """Whether ``node`` computes a (symbolic) scalar, e.g. ``sym_size`` or
    ``s0 // 2``: Dynamo emits these unannotated wherever a size is needed."""
    if node.op not in ("call_function", "call_method"):
        return False
    value = node_value(node)
    if isinstance(value, (tuple, list)):  # x.size(), torch.Size
        return bool(value) and all(isinstance(v, (int, *_SYMBOLIC)) for v in value) and any(
            isinstance(v, _SYMBOLIC) for v in value
        )
    return isinstance(value, _SYMBOLIC)


def custom_meta(node: fx.Node) -> dict:
    """The annotations ``torch.fx.traceback.annotate`` put on ``node`` (maybe empty)."""
    return node.meta.get(CUSTOM) or {}


# --- functional collectives -------------------------------------------------------

FUNCOL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
# ops of those namespaces that move no data: they pass their input through
NON_COLLECTIVE_OPS = ("wait_tensor", "_wrap_tensor_autograd")


# meta a node made in another's place takes from it: its provenance, and the user's
# annotations (fx.traceback.annotate: a compile_with_inductor mark among them)
CARRIED_META = ("stack_trace", "custom", "nn_module_stack", "seq_nr")


def carried_meta(node: fx.Node, annotations: bool = True) -> dict:
    """The meta of ``node`` that a node made in its place carries (:data:`CARRIED_META`);
    ``annotations=False`` leaves out the user's (``custom``)."""
    return {k: node.meta[k] for k in CARRIED_META if k in node.meta and (annotations or k != "custom")}


def funcol_op(target: Any) -> tuple[str, str] | None:
    """``(namespace, name)`` of a functional-collective op (overload or packet), else None.

    Ops that move no data (:data:`NON_COLLECTIVE_OPS`) are included: the SPMD
    rules need them; :func:`is_collective` leaves them out.
    """
    if isinstance(target, OpOverload):
        qualified = target._schema.name
    elif isinstance(target, OpOverloadPacket):
        qualified = target._qualified_op_name
    else:
        return None
    ns, _, name = qualified.partition("::")
    return (ns, name) if ns in FUNCOL_NAMESPACES else None


def collective_name(target: Any) -> str | None:
    """``"all_reduce"`` for a functional-collective op, else None (see :func:`funcol_op`)."""
    op = funcol_op(target)
    return None if op is None else op[1]


def is_collective_op(target: Any) -> bool:
    """``target`` is a functional collective that moves data (not ``wait_tensor``)."""
    name = collective_name(target)
    return name is not None and name not in NON_COLLECTIVE_OPS


def is_collective(node: fx.Node) -> bool:
    """``node`` runs a functional collective that moves data (not ``wait_tensor``)."""
    return node.op == "call_function" and is_collective_op(node.target)


# --- DTensor boundary operations (Dynamo graphs) ----------------------------------


def is_method(node: fx.Node, name: str) -> bool:
    return node.op == "call_method" and node.target == name


def is_to_local(node: fx.Node) -> bool:
    return is_method(node, "to_local")


def is_input_to_local(node: fx.Node) -> bool:
    """``to_local`` of one of the graph's own inputs (a placeholder)."""
    return is_to_local(node) and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"


def is_redistribute(node: fx.Node) -> bool:
    return is_method(node, "redistribute")


def is_from_local(node: fx.Node) -> bool:
    """``DTensor.from_local`` (Dynamo records either the method or ``_api.from_local``)."""
    if node.op != "call_function":
        return False
    from torch.distributed.tensor import DTensor

    from ._torch_compat import dtensor_from_local

    return node.target in (DTensor.from_local, dtensor_from_local)


# --- meshes and modules -----------------------------------------------------------


def mesh_dim_names(mesh: Any) -> tuple[str, ...]:
    """Dimension names of a DeviceMesh or RegionSpec; ``"0"``, ``"1"``... when unnamed."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names:
        return tuple(names)
    ndim = len(mesh.mesh_shape) if hasattr(mesh, "mesh_shape") else mesh.ndim
    return tuple(str(i) for i in range(ndim))


def calls_invoke_subgraph(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls ``invoke_subgraph`` (AOTAutogradCache is kept off
    for such a graph: compiler/inner.py)."""
    import torch

    return bool(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))


def subgraph_attr(call: fx.Node) -> fx.Node:
    """The ``get_attr`` node naming the subgraph a higher-order op (``invoke_subgraph``) calls."""
    attr = call.args[0] if call.args else None
    if not (isinstance(attr, fx.Node) and attr.op == "get_attr"):
        raise AssertionError(f"{call.name} does not call a subgraph attribute (args[0] = {attr!r})")
    return attr


def subgraph_calls(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, fx.GraphModule]]:
    """``(target, module)`` of every subgraph the higher-order op ``node`` calls
    (``get_attr`` arguments of ``gm`` that are ``GraphModule`` objects)."""
    if node.op != "call_function":
        return []
    out = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, fx.Node) and a.op == "get_attr":
            try:
                mod = fetch_attr(gm, a.target)
            except AttributeError:
                continue
            if isinstance(mod, fx.GraphModule):
                out.append((str(a.target), mod))
    return out


@dataclasses.dataclass(frozen=True)
class NestedGraph:
    """A graph module reached from the root through higher-order ops."""

    module: fx.GraphModule
    scope: str  # dotted path of get_attr targets from the root ("" = the root)
    # where it sits in program order: per enclosing graph, the calling node's
    # position and the subgraph's index among that node's subgraphs
    at: tuple[int, ...]


def nested_graphs(gm: fx.GraphModule, enter: Callable[[fx.Node], bool] = lambda node: True) -> list[NestedGraph]:
    """``gm`` and every subgraph module its higher-order ops call, at any depth
    (those of nodes ``enter`` accepts), each module once, depth first in
    program order.  The one walk over nested graphs."""
    out: list[NestedGraph] = []
    walked: set[int] = set()

    def walk(m: fx.GraphModule, scope: str, at: tuple[int, ...]) -> None:
        walked.add(id(m))
        out.append(NestedGraph(m, scope, at))
        for k, node in enumerate(m.graph.nodes):
            if not enter(node):
                continue
            for j, (target, sub) in enumerate(subgraph_calls(m, node)):
                if id(sub) not in walked:
                    walk(sub, f"{scope}.{target}" if scope else target, (*at, k, j))

    walk(gm, "", ())
    return out


def schema_args(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``name -> value`` of the arguments of a call of the ATen op ``op`` (an
    overload, or a packet: its ``default`` schema), named by the op's schema."""
    schema = op._schema if isinstance(op, OpOverload) else op.default._schema
    bound: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
    return bound


def getitem_users(call: fx.Node) -> dict[int, fx.Node]:
    """``index -> node`` for every ``operator.getitem(call, index)`` user of ``call``."""
    out: dict[int, fx.Node] = {}
    for user in call.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            out[user.args[1]] = user
    return out


def fetch_attr(gm: fx.GraphModule, target: object) -> Any:
    """``gm.<target>`` for a dotted ``get_attr`` target; AttributeError if missing."""
    if not isinstance(target, str):
        raise AssertionError(f"get_attr target {target!r} is not a string")
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --- stack traces -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a ``node.stack_trace``."""

    file: str
    line: int
    function: str
    code: str

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"


# a traceback frame, with the source line that follows it when there is one
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)(?:\n(?![ \t]*File ")[ \t]+([^\n]*))?')

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames of these files sit between the user's call and the region's body.
WRAPPER_FILES = frozenset(os.path.join(_PKG_DIR, f) for f in ("api.py", os.path.join("capture", "call.py")))


def stack_frames(trace: str | None) -> list[Frame]:
    """The frames of a formatted stack trace, outermost first."""
    return [Frame(f, int(line), fn, code.strip()) for f, line, fn, code in _FRAME_RE.findall(trace or "")]


def is_wrapper_frame(frame: Frame) -> bool:
    """A frame of localmap_fx's own call of a region (``api.py`` / ``capture/call.py``)."""
    return os.path.abspath(frame.file) in WRAPPER_FILES


def call_site_of(nodes: Sequence[fx.Node]) -> tuple[str, str]:
    """``(file:line, function)`` of the user code that called the region of ``nodes``.

    The last frame before localmap_fx's own, of the first node that has a
    stack trace; ``("<unknown>", "<unknown>")`` when none has one.
    """
    for node in nodes:
        best = None
        for frame in stack_frames(node.meta.get("stack_trace")):
            if is_wrapper_frame(frame):
                break
            best = (frame.site, frame.function)
        if best is not None:
            return best
    return ("<unknown>", "<unknown>")
