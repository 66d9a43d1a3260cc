"""Cache keys that a new process computes again: the mesh leaves the graph's inputs.

Note: [The mesh out of the cache key]
    Dynamo hands a ``DeviceMesh`` to the backend as a graph input (an opaque
    object).  AOTAutogradCache and Inductor's FX graph cache pickle their
    example inputs for the key, and torch 2.14.1 pickles a mesh's
    ``__dict__`` there, ``_hash`` included: the hash of a tuple holding
    ``None``, which Python 3.11 derives from an address.  So no key of a
    DTensor program is the same in two processes, and a warm restart never
    hits either cache (``tests/compile/test_warm_restart.py`` pins this on
    torch's own ``local_map`` and ``backend="inductor"``).

    The backend owns the graph and the example inputs it gives AOTAutograd,
    so before Inductor each mesh placeholder becomes a call
    ``mesh_constant("<key>")`` whose argument is text made of the mesh's
    public, process-independent description (device type, ranks, dimension
    names, process group names, and this process's coordinate in it: Note:
    [A trace belongs to its rank]).  The call is traced away: AOTAutograd's
    graphs already hold the collectives' group names, not the mesh, so the
    compiled code is the same and its keys are stable.  ``mesh_constant`` is
    declared cacheable through Inductor's ``unsafe_marked_cacheable_functions``
    (a scoped ``config.patch``), which AOTAutogradCache reads to accept a
    call it does not know; the version there is part of every key.  At run
    time :func:`without_meshes` drops the mesh arguments Dynamo still passes.
    A mesh whose description cannot be built (no process group yet) stays an
    input, as before.

    The price, and why it is opt-in (``stable_cache_keys=True``): with the
    mesh a graph input, AOTAutograd reuses it for the mesh every DTensor input
    carries; without it, each DTensor input's mesh becomes an AOT input of
    its own, saved for the backward and given a None gradient, every call
    (16-layer TP stack, B 16 D 32 H 64, fake process group, CPU: 2.47 ms step
    against 2.40 ms, +3%).  That price belongs to AOTAutograd's subclass
    runtime; where the backend's own runtime takes the DTensors, the lift is
    free and always on (Note: [Stable keys behind the border]).

Note: [A trace belongs to its rank]
    AOTAutogradCache keys the graph *before* it is traced, and a DTensor
    trace bakes in this process's coordinate in the mesh (the offset of a
    ``Replicate -> Shard`` chunk in a backward, which rank keeps a
    ``Partial``'s value).  Ranks on one host share the cache folder
    (``/tmp/torchinductor_<user>`` by default), so a key without the rank let
    rank 1 load rank 0's artifact: the forward right, every gradient wrong
    (2 gloo ranks, a column/row stack with a ``Shard(1)`` input: relative
    errors 0.34-0.76 on the second run, found by
    ``tests/distributed/test_models.py::test_inductor_gradients_after_reduce_scatter``
    once whole models hit AOTAutogradCache by default).  Upstream never hits,
    so never met it.  The mesh's key says where this process sits in it
    (``at (1,)``), so every key that holds ``mesh_constant`` is per rank.
    Inductor's FX graph cache keys the traced graph, whose constants already
    differ by rank.

Note: [Stable keys behind the border]
    The key Inductor's FX graph cache computes pickles the forward graph's
    example inputs; torch 2.14.1 replaces a real opaque object there by an
    ordinal, but AOTAutograd hands it a ``FakeScriptObject`` of the mesh, whose
    ``real_obj`` (``__dict__``, ``_hash`` included) is pickled whole.  (The
    per-line "FX graph cache hash details" look alike in both processes
    because the mesh is by then in the pickler's memo; the final key differs.)
    With default options two kinds of graph keep their AOT graphs and run on
    the backend's runtime, so their meshes leave by default:

    * a graph compiled behind the lean DTensor border (whole model,
      regional block, a layer piece that DTensor weights enter, such as the
      marked attention stack's block): ``compile_one`` (compiler/inner.py)
      lifts the graph with :func:`lift_meshes` before ``dtensor_border`` wraps it, and
      Dynamo's mesh arguments are dropped by :func:`without_meshes`, when
      every mesh input is also a DTensor input's mesh (``carried_only``:
      the border takes the user's mesh objects for its specs from the
      inputs, and would refuse the graph otherwise).  The border's specs
      carry the user's mesh, so AOTAutograd gets no mesh input at all (the compiled graphs are the same less that input:
      no step cost; one TP block's callable, B 16 D 32 H 64, fake process
      group: 176.6 against 175.8 µs per call, paired medians, within noise);
    * a shared layer piece of a split frame (``share_layers``, marked
      blocks): ``layer_sharing/piece_meshes.lift_piece_meshes``, a stage of
      the pipeline, and the outer graph stops passing the mesh.

    Both keep AOTAutogradCache off (kept graphs), so no cacheability
    declaration is needed; Inductor's FX graph cache hits in a new process.
    (A whole model under Inductor takes the border torch's caches serve
    instead, which declares ``mesh_constant`` and its own calls cacheable:
    Note: [A border torch's caches can serve] in cacheable_border.py.)
    Still missing: a piece that runs on AOTAutograd's runtime (the border
    refused it): its AOT and FX keys still hold the mesh, and lifting it
    fails in AOTAutograd's partitioner (:func:`find_mesh_inputs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from ..debug.logs import LOG_NAME
from ..passes import PassResult

log = logging.getLogger(f"{LOG_NAME}.caches")

__all__ = [
    "CacheCounts",
    "MESH_CONSTANT",
    "MeshInput",
    "marked_cacheable",
    "dynamo_graph_copy",
    "find_mesh_inputs",
    "keep_mesh",
    "log_counts",
    "log_lifted",
    "lift_mesh_inputs",
    "lift_meshes",
    "mesh_constant",
    "mesh_inputs",
    "portable_mesh_key",
    "without_meshes",
]

# what unsafe_marked_cacheable_functions calls mesh_constant
MESH_CONSTANT = f"{__name__}.mesh_constant"
# enters every key that holds mesh_constant: bump it when the lifted graph changes meaning
KEY_VERSION = "2"

# key -> a live mesh of that description, for tracing in this process; weak so
# that compiling never keeps a mesh (and its process groups) alive.
_MESHES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def portable_mesh_key(mesh: Any) -> str | None:
    """A process-independent description of ``mesh`` as this rank sees it,
    None if it has no process groups.  Not :func:`localmap_fx.analysis.mesh_key`,
    a tuple for structural keys within one process (no coordinate).

    Two meshes with one key use the same ranks, dimension names and process
    groups, and this process has the same coordinate in both, so tracing
    with either gives the same graph (Note: [A trace belongs to its rank]).
    """
    try:
        groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
    except (RuntimeError, ValueError, AttributeError):
        return None
    return (f"{mesh.device_type}|{tuple(mesh.shape)}|{mesh.mesh.flatten().tolist()}|"
            f"{mesh.mesh_dim_names}|{groups}|at {mesh.get_coordinate()}")


def keep_mesh(mesh: Any) -> str | None:
    """``mesh``'s key (:func:`portable_mesh_key`), registered for :func:`mesh_constant`; None if it has none."""
    key = portable_mesh_key(mesh)
    if key is not None:
        _MESHES[key] = mesh
    return key


def mesh_constant(key: str) -> Any:
    """The mesh of ``key`` (:func:`portable_mesh_key`); runs only while AOTAutograd traces."""
    mesh = _MESHES.get(key)
    if mesh is None:
        raise RuntimeError(f"localmap_fx: no live DeviceMesh has the description {key!r}")
    return mesh


def marked_cacheable(lifted: bool) -> contextlib.AbstractContextManager:
    """While compiling a lifted graph: :func:`mesh_constant` is in Inductor's
    ``unsafe_marked_cacheable_functions`` (so in every key of that compile)."""
    if not lifted:
        return contextlib.nullcontext()
    from .._torch_compat import inductor_config as config

    return config.patch(unsafe_marked_cacheable_functions={
        **config.unsafe_marked_cacheable_functions, MESH_CONSTANT: KEY_VERSION})


@dataclasses.dataclass(frozen=True)
class MeshInput:
    """Placeholder ``name`` at input ``position`` is a mesh described by ``key``."""

    position: int
    name: str
    key: str


def find_mesh_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     behind_border: bool = False) -> tuple[MeshInput, ...]:
    """The mesh inputs of Dynamo's graph ``gm`` that can be lifted; () when any cannot.

    ``behind_border``: ``gm`` is compiled behind the lean DTensor border,
    where a piece of a split frame is lifted too."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # only Dynamo's own graph under AOTAutograd's runtime: AOTAutograd fails
    # on a lifted piece of a split frame (layer_sharing/compile.py), e.g. the
    # tail of a 4-layer TP stack under share_layers=True, from_local of a plain
    # input: "Node tangents_2 was invalid, but is output" in the partitioner;
    # not yet understood (layer_sharing/piece_meshes.py lifts shared layer
    # pieces, which keep their AOT graphs).  Behind the lean border
    # AOTAutograd traces the local-level wrapper, the mesh a constant in it
    # (a layer piece a DTensor enters: the marked attention stack's block).
    if (not behind_border and "dynamo_compile_id" not in gm.meta) or len(placeholders) != len(example_inputs):
        return ()
    return mesh_inputs(placeholders, example_inputs)


def mesh_inputs(placeholders: Sequence[fx.Node], values: Sequence[Any]) -> tuple[MeshInput, ...]:
    """The placeholders whose values are meshes that can be lifted; () when any cannot.

    All or none: a mesh left as an input keeps the key unstable anyway.
    """
    from torch.distributed.device_mesh import DeviceMesh

    found = []
    for i, (node, value) in enumerate(zip(placeholders, values)):
        if not isinstance(value, DeviceMesh):
            continue
        key = portable_mesh_key(value)
        # a mesh returned by the graph must stay the object Dynamo passes
        if key is None or any(u.op == "output" for u in node.users):
            return ()
        found.append(MeshInput(i, node.name, key))
    return tuple(found)


def dynamo_graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module to edit.

    Dynamo derives the arguments it passes at run time from the placeholders
    of the module it gave the backend: erasing one there would drop that
    argument from every call, whatever was compiled.  The copy keeps what
    AOTAutograd reads from a Dynamo module (``meta``, ``_param_name_to_source``).
    """
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copied))
    copy = fx.GraphModule(gm, graph, gm.__class__.__name__)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    # torch's Note [Assumption on Dynamo Metadata] (aot_autograd frontend_utils):
    # a module derived from Dynamo's carries each placeholder's source over.
    for old in gm.graph.find_nodes(op="placeholder"):
        if hasattr(old, "_dynamo_source"):
            copied[old]._dynamo_source = old._dynamo_source
    return copy


def lift_mesh_inputs(gm: fx.GraphModule, found: Sequence[MeshInput],
                     example_inputs: Sequence[Any]) -> PassResult:
    """Each mesh placeholder of ``found`` becomes a ``mesh_constant(key)`` call.

    ::

        before                                   after
        ------                                   -----
        def forward(self, x, mesh):              def forward(self, x):
                                                     mesh = mesh_constant("cpu|(2,)|[0, 1]|('tp',)|('0',)|at (0,)")
            y = from_local(x, mesh, ...)             y = from_local(x, mesh, ...)
    """
    if not found:
        return PassResult(gm)
    by_name = {m.name: m for m in found}
    placeholders = [n for n in gm.graph.find_nodes(op="placeholder") if n.name in by_name]
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in placeholders:
        m = by_name[node.name]
        _MESHES[m.key] = example_inputs[m.position]
        with gm.graph.inserting_before(anchor):
            call = gm.graph.call_function(mesh_constant, (m.key,))
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    return PassResult.of(gm, [gm])


def lift_meshes(gm: fx.GraphModule, example_inputs: Sequence[Any], carried_only: bool = False,
                ) -> tuple[fx.GraphModule, list[Any], tuple[MeshInput, ...]]:
    """(module, example inputs, lifted) to hand AOTAutograd: Dynamo's ``gm`` and
    ``example_inputs`` as they are when no mesh can be lifted, else a copy with
    every mesh input lifted (call the result through :func:`without_meshes`).

    ``carried_only``: lift only when every mesh input is also the mesh of a
    DTensor input (the lean border finds the user's meshes there).
    """
    from torch.distributed.tensor import DTensor

    from ..passes import apply

    found = find_mesh_inputs(gm, example_inputs, behind_border=carried_only)
    carried = [v.device_mesh for v in example_inputs if isinstance(v, DTensor)]
    if carried_only and not all(any(example_inputs[m.position] == c for c in carried) for m in found):
        found = ()
    if not found:
        return gm, list(example_inputs), ()
    lifted = apply(lambda g: lift_mesh_inputs(g, found, example_inputs), dynamo_graph_copy(gm))
    dropped = {m.position for m in found}
    return lifted, [v for i, v in enumerate(example_inputs) if i not in dropped], found


def without_meshes(compiled: Any, found: Sequence[MeshInput], n_inputs: int) -> Callable:
    """``compiled`` called with Dynamo's arguments less the lifted meshes
    (``inspect.unwrap`` gives ``compiled`` back).

    Dynamo calls what a backend returns with unpacked arguments.
    """
    dropped = {m.position for m in found}
    kept = [i for i in range(n_inputs) if i not in dropped]

    def run(*args: Any) -> Any:
        return compiled(*[args[i] for i in kept])

    run.__wrapped__ = compiled  # type: ignore[attr-defined]
    return run


_COUNTERS = (("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
             ("aot_autograd", "autograd_cache_bypass"), ("inductor", "fxgraph_cache_hit"),
             ("inductor", "fxgraph_cache_miss"), ("inductor", "fxgraph_cache_bypass"))


@dataclasses.dataclass(frozen=True)
class CacheCounts:
    """torch's cache counters (``torch._dynamo.utils.counters``) over one compile."""

    aot_hit: int = 0
    aot_miss: int = 0
    aot_bypass: int = 0
    fx_hit: int = 0
    fx_miss: int = 0
    fx_bypass: int = 0

    @classmethod
    def now(cls) -> CacheCounts:
        from .._torch_compat import dynamo_counters as counters

        return cls(*(counters[group][name] for group, name in _COUNTERS))

    def since(self, before: CacheCounts) -> CacheCounts:
        return CacheCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(before))))

    def text(self) -> str:
        return (f"AOTAutogradCache hit {self.aot_hit} miss {self.aot_miss} bypass {self.aot_bypass}; "
                f"FX graph cache hit {self.fx_hit} miss {self.fx_miss} bypass {self.fx_bypass}")


def log_counts(what: str, before: CacheCounts, lifted: Sequence[MeshInput]) -> CacheCounts:
    """Log (``TORCH_LOGS=localmap_fx``) what torch's caches did for one compile; returns it."""
    counts = CacheCounts.now().since(before)
    if log.isEnabledFor(logging.INFO):
        log.info("%s: %s%s", what, counts.text(),
                 f" ({len(lifted)} mesh input(s) lifted out of the key)" if lifted else "")
    return counts


def log_lifted(what: str, lifted: Sequence[MeshInput]) -> None:
    """Log (``TORCH_LOGS=localmap_fx``) the meshes lifted out of a graph before it is compiled."""
    if lifted:
        log.info("%s: %d mesh input(s) lifted out of the graph it compiles", what, len(lifted))
