"""Graph analyses shared by capture and the passes: one definition each.

* :func:`storage_key` -- which storage a (fake) tensor lives in;
* :func:`value_key`, :func:`structural_key` -- when two runs of nodes
  compute the same thing (outlining shares one subgraph, layer sharing one
  compiled piece, between equal keys);
* :func:`span_io`, :func:`copy_nodes` -- what a list of nodes reads and
  gives out, and the nodes copied out into a graph of its own (a region's
  body, a layer's piece, a body Dynamo just traced);
* :func:`find_effects` -- what a graph does to its inputs: which aten ops
  write into them, and which outputs are (views of) inputs or of each other.

Nothing here edits the graph it is given.  Helpers that read one node
(its value, subgraph calls, schema arguments) are in :mod:`.graph_utils`.

Note: [Deciding that a body writes to or aliases an input]
    Capture (``capture/reuse.py``, before tracing a repeated body once),
    ``outline_regions`` (before moving a body into a subgraph) and layer
    sharing (before compiling a layer once) all need to know whether code
    writes into its inputs or returns one of them, or a view of one.  Op
    names do not tell: a name ending in ``_`` misses ``out=`` arguments,
    ``setitem`` and ``operator.iadd`` and does not say which value is
    written (``x[0].add_(1)`` writes ``x``); a list of "view" names is wrong
    for ``reshape``, ``contiguous`` or ``to``, which alias only sometimes.
    The ATen schemas tell (``alias_info``, as ``torch.fx.passes.reinplace``'s
    ``_is_view_op`` reads them), but these are Dynamo graphs of torch
    functions and methods, not ATen ops.  So
    :func:`find_effects` runs the graph once on fresh fake tensors shaped
    like its inputs (each in its own storage; a DTensor gets a fresh local
    tensor) and reads the aten ops that really run: every op whose schema
    marks an argument as written (``alias_info.is_write``: in-place,
    ``out=``, ``copy_``, ``index_put_``...) is recorded with the storage it
    wrote, and after the run each output's storage is compared with the
    inputs' and the other outputs'.  Fake tensors keep views in their base's
    storage, so a view of an input, however made, is found.  A graph that
    cannot be run that way reports ``error``; callers then assume the worst
    (keeping code inline is always right).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx as fx

from ._torch_compat import TorchDispatchMode
from .graph_utils import node_value, schema_args
from .meshcache import MeshCache

__all__ = [
    "storage_key",
    "mesh_key",
    "value_key",
    "structural_key",
    "span_io",
    "copy_nodes",
    "Write",
    "Effects",
    "find_effects",
]


# --- storage identity ------------------------------------------------------------


def storage_key(t: Any) -> object | None:
    """A hashable identity of the storage of tensor ``t`` (a DTensor: of its
    local tensor); None for a non-tensor or a tensor without storage."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # DTensor
    if isinstance(local, torch.Tensor):
        t = local
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage())
    except Exception:  # noqa: BLE001 - no storage (sparse, other subclasses): unique
        return None


# --- structural keys -------------------------------------------------------------


def mesh_key(mesh: Any) -> tuple:
    """Equal for meshes over the same ranks, dims and process groups (Dynamo's
    fake DTensors may hold different DeviceMesh objects for one mesh).  For
    one process; a cache key that a new process must compute again uses
    :func:`localmap_fx.compiler.cache_keys.portable_mesh_key`."""
    # made once per mesh object: structural keys read it for every DTensor
    # value of a graph (about 0.2 ms a call, most of the layer search of a
    # deep marked stack), and nothing it reads changes after a mesh is made
    return _MESH_KEYS.get_or_make(mesh, lambda: _mesh_key(mesh))


_MESH_KEYS = MeshCache()


def _mesh_key(mesh: Any) -> tuple:
    return (
        mesh.device_type,
        tuple(mesh.mesh.flatten().tolist()),
        tuple(mesh.mesh.shape),
        tuple(mesh.mesh_dim_names or ()),
        tuple(getattr(mesh, "_dim_group_names", ()) or ()),
    )


def value_key(v: Any) -> Any:
    """What of a node's value a structural key compares: a tensor's shape,
    stride, dtype, device and ``requires_grad`` (a DTensor's placements, mesh
    and local shape too), a constant's value, a mesh's :func:`mesh_key`; any
    other object by identity."""
    if isinstance(v, torch.Tensor):
        from torch.distributed.tensor import DTensor

        # str(): sizes may be SymInts (dynamic shapes), which do not hash
        base = (str(tuple(v.shape)), str(tuple(v.stride())), v.dtype, str(v.device), v.requires_grad)
        if isinstance(v, DTensor):
            loc = v._local_tensor
            return ("dtensor", base, tuple(v.placements), mesh_key(v.device_mesh),
                    str(tuple(loc.shape)), str(tuple(loc.stride())))
        return ("tensor", base)
    if isinstance(v, (int, float, bool, str, type(None))):
        return ("const", repr(v))
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(v, DeviceMesh):
        return ("mesh", mesh_key(v))
    return ("object", type(v).__name__, id(v))


def _target_key(n: fx.Node) -> Any:
    if isinstance(n.target, str):
        return n.target
    return (getattr(n.target, "__module__", None), getattr(n.target, "__qualname__", None), id(n.target))


def _arg_key(a: Any, local: dict[fx.Node, Any]) -> Any:
    if isinstance(a, fx.Node):
        return local[a]
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg_key(x, local) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(v, local)) for k, v in a.items()))
    if isinstance(a, torch.Tensor):
        return ("tensor", id(a))
    return ("const", type(a).__name__, repr(a))


def structural_key(
    nodes: Sequence[fx.Node],
    attr: Callable[[str], Any],
    inputs: Sequence[fx.Node] = (),
    used_outside: Collection[fx.Node] = (),
) -> tuple:
    """Equal keys mean the two runs of nodes compute the same thing on equal inputs.

    ``nodes`` in program order (a whole graph's nodes, placeholders and
    output included, or a span of one); ``inputs`` are the nodes outside
    them they read, in a fixed order; ``attr`` reads a ``get_attr`` target.
    The key holds every op and target, every argument as "input *i*", "node
    *j*" or a constant, each input's and placeholder's :func:`value_key`,
    ``get_attr`` values by identity, and which nodes are ``used_outside``.
    """
    local: dict[fx.Node, Any] = {}
    parts: list[Any] = []
    for i, a in enumerate(inputs):
        local[a] = ("in", i)
        parts.append(("in", value_key(node_value(a))))
    for j, n in enumerate(nodes):
        local[n] = ("n", j)
        if n.op == "placeholder":
            parts.append(("ph", value_key(node_value(n))))
        elif n.op == "get_attr":
            parts.append(("attr", id(attr(str(n.target)))))
        else:
            parts.append((n.op, _target_key(n), _arg_key(n.args, local), _arg_key(n.kwargs, local),
                          n in used_outside))
    return tuple(parts)


# --- copying nodes out -----------------------------------------------------------


def span_io(nodes: Sequence[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs, outputs) of a span: outside nodes it reads, in first-use order;
    its nodes read outside it, in program order."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in seen:
                seen.add(a)
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return inputs, outputs


def copy_nodes(
    nodes: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    attr: Callable[[str], Any],
    names: Sequence[str],
) -> tuple[fx.Graph, torch.nn.Module]:
    """``nodes`` copied into a new graph: ``(graph, owner)``.

    One placeholder per input (named ``names[i]``, with the input's meta),
    the nodes in order (meta kept), and an output returning the tuple of
    ``outputs`` (nodes of ``nodes`` or inputs).  ``get_attr`` values, read
    with ``attr``, are put on ``owner`` (a plain module: build the
    ``GraphModule`` only when its code is needed) under their target with
    dots replaced.
    """
    if len(names) != len(inputs):
        raise AssertionError(f"{len(names)} names for {len(inputs)} inputs")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name, a in zip(names, inputs):
        ph = graph.placeholder(name)
        ph.meta = dict(a.meta)
        env[a] = ph
    owner = torch.nn.Module()
    for n in nodes:
        if n.op == "get_attr":
            local_name = str(n.target).replace(".", "_")
            setattr(owner, local_name, attr(str(n.target)))
            env[n] = graph.get_attr(local_name)
            env[n].meta = dict(n.meta)
            continue
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return graph, owner


# --- writes and aliases ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Write:
    """Node ``node`` (a name in the analysed graph) ran aten op ``op``, which
    wrote into input ``input``'s storage (None: an earlier node's value)."""

    node: str
    op: str
    input: int | None


@dataclasses.dataclass(frozen=True)
class Effects:
    """What a graph does to its inputs (Note: [Deciding that a body writes to or aliases an input]).

    ``writes``: every write into a value of the graph (an input, or what an
    earlier node returned), in program order; ``output_aliases`` holds ``(j, "input", i)``
    when output ``j`` shares storage with input ``i`` and ``(j, "output", k)``
    when with an earlier output ``k``.  ``error`` says why the graph could
    not be run (then nothing else is known).
    """

    writes: tuple[Write, ...] = ()
    output_aliases: tuple[tuple[int, str, int], ...] = ()
    error: str | None = None

    def written_inputs(self) -> list[tuple[int, str]]:
        """``(input index, aten op)`` of every write into an input, in program order."""
        return [(w.input, w.op) for w in self.writes if w.input is not None]

    def aliased_input(self, j: int) -> int | None:
        """The input output ``j`` shares storage with, else None."""
        return next((i for o, kind, i in self.output_aliases if o == j and kind == "input"), None)


class _WriteRecorder(TorchDispatchMode):
    """Records every aten op whose schema writes an argument living in a
    ``known`` storage (an input's or an earlier node's value), with that storage.

    Writes into temporaries a node makes and fills itself (``dropout`` on CPU
    is ``empty_like(x).bernoulli_(p)``) are how the op is implemented, not a
    write the graph can see, and are left out.
    """

    def __init__(self, known: set) -> None:
        super().__init__()
        self.node: str = "?"
        self.known = known
        self.writes: list[tuple[str, str, object]] = []  # (node, op, storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            bound = schema_args(func, args, kwargs)
            for a in schema.arguments:
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                v = bound.get(a.name)
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    key = storage_key(t)
                    if key is not None and key in self.known:
                        self.writes.append((self.node, str(func.overloadpacket.__name__), key))
        return func(*args, **kwargs)


class _Runner(fx.Interpreter):
    """Tells the recorder which node runs and which storages the graph's values hold."""

    def __init__(self, owner: torch.nn.Module, graph: fx.Graph, recorder: _WriteRecorder) -> None:
        # every value stays alive until the end: a freed storage's identity
        # could otherwise come back for a temporary
        super().__init__(owner, graph=graph, garbage_collect_values=False)
        self.recorder = recorder

    def run_node(self, n: fx.Node) -> Any:
        self.recorder.node = n.name
        out = super().run_node(n)
        for v in out if isinstance(out, (list, tuple)) else (out,):
            key = storage_key(v)
            if key is not None:
                self.recorder.known.add(key)
        return out

    def call_function(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        # A higher-order op has no dispatch rule for our recorder mode; the two
        # that capture and outlining put in graphs only call their subgraph, so
        # call it here (its writes are recorded under this node).  Any other
        # higher-order op fails the run: effects unknown.
        if target is torch.ops.higher_order.invoke_subgraph:
            sub, _identifier, *operands = args
            return sub(*operands)
        if target is torch.ops.higher_order.tag_activation_checkpoint:
            sub, *operands = args  # kwargs: checkpoint options, nothing to compute
            return sub(*operands)
        return super().call_function(target, args, kwargs)


def _fresh(v: Any) -> Any:
    """A new fake value with ``v``'s metadata in a storage of its own (under a fake mode)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        loc = v._local_tensor
        fresh = torch.empty_strided(loc.shape, loc.stride(), dtype=loc.dtype, device=loc.device)
        return DTensor.from_local(fresh, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    return v


def find_effects(graph: fx.Graph, owner: torch.nn.Module, values: Sequence[Any]) -> Effects:
    """Run ``graph`` once on fresh fakes like ``values`` (one per placeholder)
    and report its :class:`Effects` (Note: [Deciding that a body writes to or
    aliases an input]).  ``owner`` holds its ``get_attr`` targets."""
    from ._torch_compat import FakeTensorMode, detect_fake_mode

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(tensors) or FakeTensorMode(allow_non_fake_inputs=True)
    # At trace time the mode is Dynamo's: sizes the run makes up (.tolist(),
    # all_to_all splits) must not become unbacked symbols the graph owes it.
    fresh_symbols_dropped = (
        mode.shape_env.ignore_fresh_unbacked_symbols() if mode.shape_env is not None else contextlib.nullcontext()
    )
    try:
        with mode, torch.no_grad(), fresh_symbols_dropped:
            fakes = [_fresh(v) for v in values]
            in_keys = [storage_key(f) for f in fakes]
            recorder = _WriteRecorder({k for k in in_keys if k is not None})
            with recorder:
                out = _Runner(owner, graph, recorder).run(*fakes)
    except Exception as e:  # noqa: BLE001 - cannot tell: the caller assumes the worst
        return Effects(error=f"not analyzable: {type(e).__name__}")
    index = {k: i for i, k in reversed(list(enumerate(in_keys))) if k is not None}
    writes = tuple(Write(node, op, index.get(key)) for node, op, key in recorder.writes)
    aliases: list[tuple[int, str, int]] = []
    seen: dict[object, int] = {}
    for j, o in enumerate(out if isinstance(out, (list, tuple)) else (out,)):
        key = storage_key(o)
        if key is None:
            continue
        if key in index:
            aliases.append((j, "input", index[key]))
        elif key in seen:
            aliases.append((j, "output", seen[key]))
        seen.setdefault(key, j)
    return Effects(writes, tuple(aliases))
