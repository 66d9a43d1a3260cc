"""Region IR: the frozen ``RegionSpec`` and :func:`find_regions`.

A *region* is one call of a ``local_map`` function inside a captured graph.
In the graph a backend receives it is a run of annotated nodes (see
:mod:`localmap_fx.capture.call`)::

    enter   redistribute / to_local of each DTensor argument   (role "enter")
    body    the user's function at local shapes                 (role "body")
    exit    from_local of each tensor output                   (role "exit")

After the ``outline_regions`` pass the body is one ``invoke_subgraph`` node
whose ``meta[META_REGION]`` holds the :class:`RegionSpec`.  :func:`find_regions`
understands both forms and never mutates the graph.

Note: [Regions inside nested subgraphs]
    Dynamo traces some calls into a subgraph of a higher-order op: the body
    of ``torch.utils.checkpoint`` (``tag_activation_checkpoint``), a
    ``nested_compile_region`` (``invoke_subgraph``), control flow
    (``cond``'s branches).  A region called there has its nodes in that
    subgraph, not in the root graph.  :func:`find_regions` therefore walks
    every subgraph a higher-order op of the graph calls (once per subgraph,
    at its first call, in program order) and returns its regions too, with
    ``Region.owner`` (the ``GraphModule`` that holds the nodes) and
    ``Region.scope`` (its dotted path, ``""`` for the root graph).  A
    higher-order op that is itself part of a region (a checkpoint inside a
    body) belongs to that region's body and is not walked.

Note: [A region's spec travels as a key]
    Dynamo reads an ``annotate`` argument as a Python constant, and every
    tuple, dict and placement inside it becomes a source of its own.  Inside
    a ``nested_compile_region`` each stamped call of the block clones and
    compares every source the first call read (torch 2.14.1,
    ``invoke_subgraph.is_reusable``): with the spec dict in the annotation a
    column/row TP block read 148 sources, 100 of them the spec's, and the
    check took about 15 ms a call under a profiler.  So the annotation holds
    a short text key (:func:`register_spec`), made from the spec's content, so that
    equal specs get one key and a new process the same one, and the spec
    itself is registered here; :func:`spec_of` reads it back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from . import graph_utils
from .analysis import copy_nodes, span_io
from .graph_utils import call_site_of, custom_meta, fetch_attr, node_value

__all__ = [
    "RegionSpec",
    "Region",
    "find_regions",
    "shared_body_call",
    "META_SPEC",
    "META_ROLE",
    "META_INDEX",
    "META_REGION",
    "META_PLAN",
    "META_LOWERED",
    "META_REGION_ID",
    "spec_annotation",
    "register_spec",
    "spec_of",
    "leaf_spec_key",
    "placements_str",
    "role_of",
    "index_of",
]

META_SPEC = "localmap_fx.spec"
META_ROLE = "localmap_fx.role"
META_INDEX = "localmap_fx.index"
# node.meta key (not under "custom") that passes put on outlined region nodes.
META_REGION = "localmap_fx.region"
# node.meta keys lowering puts on boundary nodes: the redistribute plan of an
# entry, and "grad placements are explicit" (see lowering.boundaries).
META_PLAN = "localmap_fx.plan"
META_LOWERED = "localmap_fx.lowered"
# node.meta["custom"] key the dumper adds to each region's nodes ("r0", ...;
# see debug.dump.tag_regions); AOTAutograd carries it to derived nodes.
META_REGION_ID = "localmap_fx.region_id"

ROLE_ENTER = {META_ROLE: "enter"}
ROLE_BODY = {META_ROLE: "body"}
ROLE_EXIT = {META_ROLE: "exit"}

PlacementsT = tuple[Placement, ...] | None


def _tuple_or_none(spec: Any) -> Any:
    if isinstance(spec, list):
        return tuple(spec)
    return spec


def definition_site(code: Any) -> str:
    """``file:first line`` of a code object: where a region's function is defined."""
    return f"{code.co_filename}:{code.co_firstlineno}"


def spec_annotation(
    *,
    func: Any,
    in_placements: Any,
    out_specs: tuple,
    in_grad_placements: Any,
    device_mesh: DeviceMesh | None,
    redistribute_inputs: bool,
    spmd_types: bool | str,
    identity: tuple[str, str] | None = None,
    body_key: int | None = None,
    register: Callable[[dict], str] | None = None,
) -> dict:
    """The constant dict capture puts in ``node.meta["custom"]``:
    ``{META_SPEC: key}`` of the registered spec (Note: [A region's spec
    travels as a key]).

    Built once per ``local_map`` function, normally outside traced code:
    Dynamo only accepts annotation values it can read as Python constants.
    ``identity`` = ``(name, definition site)`` of ``func`` when the caller
    already has them as constants (a ``local_map`` built while Dynamo traces);
    ``register``: what registers the spec there (one Dynamo does not trace),
    else :func:`register_spec`.
    """
    if identity is not None:
        name, site = identity
    else:
        code = getattr(func, "__code__", None)
        site = definition_site(code) if code is not None else "<unknown>"
        name = getattr(func, "__qualname__", type(func).__name__)

    def norm(specs: Any) -> Any:
        # Bad values are kept as given: validation reports them at call time,
        # where torch does.
        if not isinstance(specs, (list, tuple)):
            return specs
        return tuple(_tuple_or_none(s) for s in specs)

    spec = {
        "func": name,
        "func_site": site,
        "in": norm(in_placements),
        "out": norm(out_specs),
        "in_grad": norm(in_grad_placements),
        "redistribute_inputs": bool(redistribute_inputs),
        # True, False or "global" (see spmd.global_check)
        "spmd_types": spmd_types if spmd_types == "global" else bool(spmd_types),
        "has_mesh": device_mesh is not None,
        # spmd_types=True: finds the body at compile time (spmd.functions)
        "body": body_key,
    }
    return {META_SPEC: (register or register_spec)(spec)}


# key -> (the text the key was made from, the spec)
_SPECS: dict[str, tuple[str, dict]] = {}


def register_spec(spec: dict) -> str:
    """The key of ``spec`` (registered on first sight): the function's name and
    a digest of the spec's text, the same for equal specs and in every process."""
    content = repr(sorted((k, repr(v)) for k, v in spec.items()))
    key = f"{spec.get('func')}@{hashlib.sha1(content.encode()).hexdigest()[:12]}"
    while key in _SPECS and _SPECS[key][0] != content:
        key += "'"  # a digest collision: never two specs on one key
    _SPECS.setdefault(key, (content, spec))
    return key


def spec_of(value: Any) -> dict | None:
    """The spec an annotation's ``META_SPEC`` value names (None for None)."""
    if value is None:
        return None
    try:
        return _SPECS[value][1]
    except KeyError:
        raise KeyError(f"no local_map spec is registered under {value!r}") from None


def leaf_spec_key(key: str, in_specs: tuple, in_grads: tuple | None) -> str:
    """The key of ``key``'s spec with per-leaf input placements (a call whose
    ``in_placements`` mirror nested arguments records one entry per leaf)."""
    return register_spec({**_SPECS[key][1], "in": in_specs, "in_grad": in_grads})


def placements_str(placements: Sequence[Placement] | None) -> str:
    """Short text form: ``S(0)``, ``R``, ``P``; ``(S(0),R)`` for 2-D."""
    if placements is None:
        return "None"
    parts = []
    for p in placements:
        name = type(p).__name__
        if name == "Shard":
            parts.append(f"S({getattr(p, 'dim', '?')})")
        elif name == "Replicate":
            parts.append("R")
        elif name == "Partial":
            op = getattr(p, "reduce_op", "sum")
            parts.append("P" if op == "sum" else f"P({op})")
        else:
            parts.append(repr(p))
    return parts[0] if len(parts) == 1 else "(" + ",".join(parts) + ")"


@dataclasses.dataclass(frozen=True)
class RegionSpec:
    """Placement metadata of one region (one local_map call)."""

    func: str
    in_placements: tuple[PlacementsT, ...] | None
    out_placements: tuple[PlacementsT, ...]
    in_grad_placements: tuple[PlacementsT, ...] | None
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    redistribute_inputs: bool
    spmd_types: bool | str  # True, False or "global"
    call_site: str
    call_function: str
    func_site: str
    mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False, hash=False)
    body_key: int | None = dataclasses.field(default=None, compare=False, hash=False)

    def text(self) -> str:
        ins = "None" if self.in_placements is None else ", ".join(
            placements_str(p) for p in self.in_placements
        )
        outs = ", ".join(placements_str(p) for p in self.out_placements)
        s = f"{self.func}: in=[{ins}] out=[{outs}]"
        if self.in_grad_placements is not None:
            s += " in_grad=[" + ", ".join(placements_str(p) for p in self.in_grad_placements) + "]"
        dims = graph_utils.mesh_dim_names(self)
        s += " mesh=" + "x".join(f"{n}:{k}" for n, k in zip(dims, self.mesh_shape))
        if self.redistribute_inputs:
            s += " redistribute_inputs"
        if self.spmd_types == "global":
            s += " spmd_types=global"
        elif self.spmd_types:
            s += " spmd_types"
        return s


@dataclasses.dataclass
class RegionInput:
    """One input of a region's subgraph: a user argument or a captured value."""

    kind: str  # "arg" (flattened user argument index) or "captured"
    index: int | None
    node: fx.Node


@dataclasses.dataclass
class Region:
    """One region found in a graph.

    ``node`` is the outlined ``invoke_subgraph`` call when the region has been
    outlined, else the first node of its body.  ``subgraph`` is the body at
    local shapes; its placeholders follow ``inputs`` (user arguments in the
    order written, then values the body closed over) and its outputs follow
    ``outputs``.
    """

    node: fx.Node
    spec: RegionSpec
    # the body, or (graph, owner) to build it from on first use: building a
    # GraphModule generates and compiles its code, about 1 ms per region, and
    # most passes only read the graph; None when find_regions was asked for
    # no bodies (Note: [Bodies are built on demand])
    _body: fx.GraphModule | tuple[fx.Graph, torch.nn.Module] | None
    enter_nodes: list[fx.Node]
    body_nodes: list[fx.Node]
    exit_nodes: list[fx.Node]
    inputs: list[RegionInput]
    outputs: list[fx.Node]
    outlined: bool
    # the GraphModule whose graph holds the nodes, and its dotted path
    # ("" = the root graph; see Note: [Regions inside nested subgraphs])
    owner: fx.GraphModule | None = None
    scope: str = ""

    # Note: [Bodies are built on demand]
    #     find_regions runs several times per compile (each pass, the layer
    #     finder) over every region; only the regions a pass rewrites or
    #     interprets need their body as a GraphModule, and the layer finder
    #     and inline_shared_bodies need none: they ask for no copy of the
    #     bodies (about 0.4 ms a region, 0.16 s of a 64-layer marked stack's
    #     compile).
    def _copied(self) -> fx.GraphModule | tuple[fx.Graph, torch.nn.Module]:
        if self._body is None:
            raise ValueError(f"region at {self.node.name} was found without its body "
                             "(find_regions(..., bodies=False)); find it with bodies=True to read it")
        return self._body

    @property
    def subgraph(self) -> fx.GraphModule:
        """The body at local shapes as a ``GraphModule`` (see the class docstring)."""
        body = self._copied()
        if not isinstance(body, fx.GraphModule):
            graph, owner = body
            self._body = body = fx.GraphModule(owner, graph, class_name="region_body")
        return body

    @property
    def body_graph(self) -> fx.Graph:
        """The body's graph, without building its module."""
        body = self._copied()
        return body.graph if isinstance(body, fx.GraphModule) else body[0]

    @property
    def body_owner(self) -> torch.nn.Module:
        """The module holding the body's ``get_attr`` targets (for
        ``fx.Interpreter(owner, graph=...)``), without building the body."""
        body = self._copied()
        return body if isinstance(body, fx.GraphModule) else body[1]


def index_of(node: fx.Node) -> int:
    """``META_INDEX`` of an enter or exit node (argument or output index)."""
    idx = custom_meta(node).get(META_INDEX)
    if not isinstance(idx, int):
        raise AssertionError(f"boundary node {node.name} has no {META_INDEX}")
    return idx


def role_of(node: fx.Node) -> str | None:
    if node.op in ("placeholder", "output"):
        return None
    return custom_meta(node).get(META_ROLE)


def _mesh_of(enter: Sequence[fx.Node], exits: Sequence[fx.Node]) -> DeviceMesh | None:
    for n in exits:
        val = node_value(n)
        if val is not None and hasattr(val, "device_mesh"):
            return val.device_mesh
    for n in enter:
        for a in n.all_input_nodes:
            val = node_value(a)
            if val is not None and hasattr(val, "device_mesh"):
                return val.device_mesh
    return None


def build_spec(ann: dict, enter, body, exits, mesh: DeviceMesh | None = None) -> RegionSpec:
    if mesh is None:
        mesh = _mesh_of(enter, exits)
    site, fn = call_site_of(list(enter) + list(body) + list(exits))
    return RegionSpec(
        func=ann["func"],
        in_placements=ann["in"],
        out_placements=ann["out"],
        in_grad_placements=ann["in_grad"],
        mesh_shape=tuple(mesh.shape) if mesh is not None else (),
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh is not None and mesh.mesh_dim_names else None,
        redistribute_inputs=ann["redistribute_inputs"],
        spmd_types=ann["spmd_types"],
        call_site=site,
        call_function=fn,
        func_site=ann["func_site"],
        mesh=mesh,
        body_key=ann.get("body"),
    )


def _group_runs(gm: fx.GraphModule) -> list[tuple[dict | None, list[fx.Node]]]:
    """Split annotated nodes into per-call runs (enter* body* exit*)."""
    runs: list[tuple[dict | None, list[fx.Node]]] = []
    cur: list[fx.Node] = []
    cur_ann: dict | None = None
    last_role = None
    symbolic: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _symbolic_only(node, symbolic):
            # Note: [Size arithmetic is not part of a region]
            #     With dynamic shapes Dynamo emits scalar arithmetic on the
            #     shape symbols (``s0 * 4``, ``s0 // 2``) wherever a size is
            #     needed, annotated or not, and reuses one such node in later
            #     calls (two layers' bodies read the same ``mul``).  It depends
            #     on nothing but symbols, so it stays outside every region:
            #     bodies take it as an input and no call owns it.
            continue
        role = role_of(node)
        if role is None and META_REGION not in node.meta:
            if node.op in ("placeholder", "get_attr"):
                continue
            if cur and node.op == "call_function" and node.target is operator.getitem and all(
                a in cur for a in node.all_input_nodes
            ):
                # getitem of a multi-output body op belongs to the body
                cur.append(node)
                continue
            if cur and graph_utils.is_size_computation(node):
                # an unannotated size of a tensor between a call's nodes: part
                # of the body when it reads the call's tensors, else outside
                if any(a in cur for a in node.all_input_nodes):
                    cur.append(node)
                continue
            if cur:
                runs.append((cur_ann, cur))
            cur, cur_ann, last_role = [], None, None
            continue
        ann = spec_of(custom_meta(node).get(META_SPEC))
        if META_REGION in node.meta and role is None:
            role = "body"
        new_call = (
            not cur
            or ann is not cur_ann and ann != cur_ann
            or (role == "enter" and last_role in ("body", "exit"))
            or (role == "body" and last_role == "exit")
            # two outlined bodies are two calls even with no boundary between
            # them (fuse_boundaries removed it)
            or (META_REGION in node.meta and any(META_REGION in n.meta for n in cur))
        )
        if new_call and cur:
            runs.append((cur_ann, cur))
            cur = []
        if new_call:
            cur_ann = ann
        cur.append(node)
        last_role = role
    if cur:
        runs.append((cur_ann, cur))
    return runs


def _symbolic_only(node: fx.Node, symbolic: set[fx.Node]) -> bool:
    """Whether ``node`` is size arithmetic on shape symbols alone (see the
    Note in :func:`_group_runs`); ``symbolic`` holds those found so far."""
    if not graph_utils.is_size_computation(node):
        return False
    if all(a in symbolic or (a.op == "placeholder" and not isinstance(node_value(a), torch.Tensor))
           for a in node.all_input_nodes):
        symbolic.add(node)
        return True
    return False


def _local_of_enter(enter: list[fx.Node], idx: int) -> fx.Node | None:
    last = None
    for n in enter:
        if custom_meta(n).get(META_INDEX) == idx:
            last = n
    return last


def _extract(
    gm: fx.GraphModule, enter: list[fx.Node], body: list[fx.Node], exits: list[fx.Node], copy: bool = True
) -> tuple[tuple[fx.Graph, torch.nn.Module] | None, list[RegionInput], list[fx.Node]]:
    body_set = set(body)
    # Inputs: user arguments first, in the order the user wrote them.
    arg_locals: dict[fx.Node, int] = {}
    for n in enter:
        idx = custom_meta(n).get(META_INDEX)
        if idx is not None and _local_of_enter(enter, idx) is n:
            arg_locals[n] = idx
    inputs: list[RegionInput] = [
        RegionInput("arg", i, n) for n, i in sorted(arg_locals.items(), key=lambda kv: kv[1])
    ]
    seen = {i.node for i in inputs}
    read, leaving = span_io(body)
    for a in read:
        if a not in seen:
            seen.add(a)
            inputs.append(RegionInput("captured", None, a))
    for e in exits:
        src = e.args[0] if e.args else None
        if isinstance(src, fx.Node) and src not in body_set and src not in seen:
            # the body ran in an earlier graph (a graph break inside it): its
            # result enters this graph as an input and leaves unchanged
            seen.add(src)
            inputs.append(RegionInput("captured", None, src))
    # Outputs: values leaving the body, exit order first.
    outputs: list[fx.Node] = []
    for e in sorted(exits, key=lambda n: custom_meta(n).get(META_INDEX, 0)):
        src = e.args[0] if e.args else None
        if isinstance(src, fx.Node) and src not in outputs:
            outputs.append(src)
    outputs += [n for n in leaving if n not in outputs]
    n_args = sum(1 for i in inputs if i.kind == "arg")  # user arguments come first
    if not copy:
        return None, inputs, outputs
    names = [f"arg{i.index}" if i.kind == "arg" else f"captured{k - n_args}" for k, i in enumerate(inputs)]
    sub, owner = copy_nodes(body, [i.node for i in inputs], outputs, functools.partial(fetch_attr, gm), names)
    return (sub, owner), inputs, outputs


def find_regions(gm: fx.GraphModule, bodies: bool = True) -> list[Region]:
    """The regions of ``gm`` in program order (read-only), nested subgraphs included.

    ``bodies=False``: for a caller that reads specs and nodes only, no body
    is copied (Note: [Bodies are built on demand]); asking such a region for
    its body raises.
    """
    found: list[tuple[tuple[int, ...], Region]] = []
    # a region's own subgraphs are its body, not graphs holding regions
    for g in graph_utils.nested_graphs(gm, lambda node: role_of(node) is None and META_REGION not in node.meta):
        position = {n: k for k, n in enumerate(g.module.graph.nodes)}
        for region in _regions_of_graph(g.module, bodies):
            region.owner, region.scope = g.module, g.scope
            first = min(position[n] for n in (*region.enter_nodes, *region.body_nodes, *region.exit_nodes))
            found.append(((*g.at, first), region))
    return [r for _, r in sorted(found, key=lambda t: t[0])]


def _regions_of_graph(gm: fx.GraphModule, bodies: bool = True) -> list[Region]:
    """The regions whose nodes are in ``gm.graph`` itself."""
    regions: list[Region] = []
    for ann, nodes in _group_runs(gm):
        outlined = [n for n in nodes if META_REGION in n.meta]
        if outlined:
            node = outlined[0]
            rmeta = node.meta[META_REGION]
            enter = [n for n in nodes if role_of(n) == "enter"]
            exits = [n for n in nodes if role_of(n) == "exit"]
            body = [n for n in nodes if n not in enter and n not in exits]
            body_attr = node.args[0]
            if not isinstance(body_attr, fx.Node):
                raise AssertionError(f"outlined region {node.name} has no subgraph attribute")
            sub = fetch_attr(gm, body_attr.target)
            regions.append(
                Region(
                    node=node,
                    spec=rmeta["spec"],
                    _body=sub,
                    enter_nodes=enter,
                    body_nodes=body,
                    exit_nodes=exits,
                    inputs=rmeta["inputs"],
                    outputs=rmeta["outputs"],
                    outlined=True,
                )
            )
            continue
        if ann is None:
            continue
        enter = [n for n in nodes if role_of(n) == "enter"]
        exits = [n for n in nodes if role_of(n) == "exit"]
        body = [n for n in nodes if n not in enter and n not in exits]
        sub, inputs, outputs = _extract(gm, enter, body, exits, bodies)
        spec = build_spec(ann, enter, body, exits)
        node = body[0] if body else (exits[0] if exits else enter[-1])
        regions.append(
            Region(
                node=node,
                spec=spec,
                _body=sub,
                enter_nodes=enter,
                body_nodes=body,
                exit_nodes=exits,
                inputs=inputs,
                outputs=outputs,
                outlined=False,
            )
        )
    return regions


def shared_body_call(region: Region) -> fx.Node | None:
    """The ``invoke_subgraph`` node when the body is exactly one Dynamo-made call.

    (Plus its ``get_attr`` and ``getitem`` nodes.)  Capture makes such bodies
    for repeated calls (:mod:`localmap_fx.capture.reuse`).
    """
    if region.outlined:
        return None
    calls = [n for n in region.body_nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    if len(calls) != 1:
        return None
    call = calls[0]
    for n in region.body_nodes:
        if n is call or (n.op == "get_attr" and n is call.args[0]):
            continue
        if not (n.op == "call_function" and n.target is operator.getitem and n.args[0] is call):
            return None
    return call
