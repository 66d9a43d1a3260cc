"""Compiled layers a new process loads from Inductor's cache without tracing them.

Note: [A kept compile restarts from Inductor's cache]
    The lean DTensor border keeps the AOT forward and backward it compiles
    (it runs them itself, as a :class:`~localmap_fx.layer_sharing.runtime.CompiledLayer`),
    so AOTAutogradCache, which hands back AOTAutograd's runtime and no
    graphs, is kept off for it.  Each new process then traced and
    partitioned every block again before Inductor's FX graph cache served
    the compiled code: a warm regional TP stack (16 layers, 2 CPUs) spent
    4.0 of its 4.5 s there: importing ``compile_fx`` 1.3 s, Inductor's
    joint-graph pattern set-up 0.8 s, the FX cache keys 0.7 s (hashing
    torch's and triton's sources), AOTAutograd's trace and partition, and
    only 0.24 s loading what the cache held.

    So after a compile whose two graphs went through Inductor's FX graph
    cache, the border writes what it read off them, beside torch's caches
    (``<inductor cache dir>/localmap_fx/layers/<key>.json``): the two FX
    graph cache keys (what AOTAutogradCache stores too), the graphs' input
    layouts, the :class:`CompiledLayer`'s calling convention, and the
    caller's own record (the border's input-gradient placements and
    saved-value signature).  A later compile with the same key loads the two
    graphs by their FX keys (``FxGraphCache.load_with_key`` and
    ``post_compile``, as AOTAutogradCache does on a hit) and traces nothing.

    The key is everything the AOT trace depends on: the code of the graph
    and of every module under it, non-tensor attributes, its inputs'
    layouts, the caller's description of what the code does not say (the
    DTensor specs the border's closures carry: meshes by
    :func:`~localmap_fx.compiler.cache_keys.portable_mesh_key`, so the rank's
    coordinate too, Note: [A trace belongs to its rank]), Inductor's and
    AOTAutograd's configuration, grad and autocast modes, deterministic
    algorithms, the torch version and the source of this package.  A graph
    calling a Python function defined outside torch and this package (its
    code could change under the same name) or an operator outside torch's
    namespaces is not cached.  A missing FX entry, an unreadable file or a
    different layout is a miss: the layer is compiled as before, never
    guessed.  Nothing is cached under cudagraphs (their set-up is part of
    the compile) or when the caller wants the AOT graphs (the dump).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..layer_sharing.runtime import CompiledLayer
from ..passes.hoist_tangent_reductions import TangentReduction
from . import cache_keys

__all__ = ["LayerCounts", "cacheable_graph", "counts", "layer_key", "load_layer", "save_layer"]

# enters every key: bump it when what an entry means changes
KEY_VERSION = "1"
# the operator namespaces whose code is torch's (keyed by its version)
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "higher_order"})

log = cache_keys.log


@dataclasses.dataclass
class LayerCounts:
    """This process's hits, misses and saves (``TORCH_LOGS=localmap_fx`` logs each)."""

    hit: int = 0
    miss: int = 0
    saved: int = 0


_COUNTS = LayerCounts()


def counts() -> LayerCounts:
    """A copy of this process's counts."""
    return dataclasses.replace(_COUNTS)


# --- the key --------------------------------------------------------------------------

@functools.cache
def _package_version() -> str:
    """A hash of this package's source: an edit must not let a cache serve a layer its old code traced."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _is_ours_or_torchs(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "localmap_fx", "_operator", "operator", "builtins", "math")


def cacheable_graph(gm: fx.GraphModule) -> str | None:
    """Why a compile of ``gm`` must not be cached (None: it may be).

    A call of an operator outside torch's namespaces, or of a Python
    function defined outside torch and this package, runs code the key
    cannot see."""
    from .._torch_compat import HigherOrderOperator, OpOverload, OpOverloadPacket

    for m in gm.modules():
        if not isinstance(m, fx.GraphModule):
            continue
        for n in m.graph.nodes:
            if n.op != "call_function":
                continue
            t = n.target
            if isinstance(t, (OpOverload, OpOverloadPacket)):
                ns = t.namespace if isinstance(t, OpOverload) else t._qualified_op_name.split("::")[0]
                if ns not in _TORCH_NAMESPACES:
                    return f"it calls operator {t} (namespace {ns!r})"
            elif isinstance(t, HigherOrderOperator):
                continue
            elif not _is_ours_or_torchs(t):
                return f"it calls {getattr(t, '__qualname__', t)!r} of module {getattr(t, '__module__', '?')!r}"
    return None


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ["tensor", list(v.shape), list(v.stride()), str(v.dtype), str(v.device), bool(v.requires_grad)]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return ["value", repr(v)]
    return ["object", type(v).__qualname__]


def _environment() -> list:
    from .._torch_compat import functorch_config, inductor_config

    return [KEY_VERSION, torch.__version__, str(torch.version.git_version), _package_version(),
            repr(sorted(inductor_config.save_config_portable().items())),
            repr(sorted(functorch_config.save_config_portable().items())),
            torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
            torch.are_deterministic_algorithms_enabled()]


def layer_key(gm: fx.GraphModule, example_inputs: Sequence[Any], caller: Any) -> str | None:
    """The key of ``gm`` compiled for ``example_inputs``; ``caller``: JSON
    values saying what the graph's code does not (its closures' constants).
    None when it must not be cached (:func:`cacheable_graph`)."""
    reason = cacheable_graph(gm)
    if reason is not None:
        log.info("compiled layer: not restored in a new process: %s", reason)
        return None
    codes = [(name, m.code) for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)]
    attrs = sorted((str(n.target), repr(getattr(m, str(n.target), None)))
                   for m in gm.modules() if isinstance(m, fx.GraphModule)
                   for n in m.graph.find_nodes(op="get_attr")
                   if not isinstance(getattr(m, str(n.target), None), torch.nn.Module))
    text = json.dumps([_environment(), codes, attrs, [_layout(v) for v in example_inputs], caller])
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> str:
    from .._torch_compat import inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "localmap_fx", "layers", f"{key}.json")


def _cudagraphs() -> bool:
    from .._torch_compat import inductor_config

    return bool(inductor_config.triton.cudagraphs)


# --- saving -----------------------------------------------------------------------------

def _graph_entry(graph: fx.GraphModule, compiled: Any) -> dict | None:
    from .._torch_compat import FakeTensor

    key = getattr(compiled, "_fx_graph_cache_key", None)
    if not isinstance(key, str):
        return None  # Inductor's FX graph cache did not take it (off, or bypassed)
    inputs = []
    for n in graph.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if not isinstance(v, FakeTensor) or not all(isinstance(s, int) for s in (*v.shape, *v.stride())):
            return None
        inputs.append([list(v.shape), list(v.stride()), str(v.dtype).removeprefix("torch."), str(v.device)])
    return {"key": key, "debug_lines": list(getattr(compiled, "_fx_graph_cache_debug_lines", None) or []),
            "guards_expr": getattr(compiled, "guards_expr", None), "inputs": inputs}


def save_layer(key: str, aot_graphs: Sequence[Any], layer: CompiledLayer, record: Any) -> bool:
    """Write ``layer``'s entry (its graphs' FX keys, its calling convention,
    the caller's JSON ``record``); False when it cannot be restored so."""
    if _cudagraphs() or layer.n_opaque or layer.n_symints:
        return False
    graphs = {}
    for a in aot_graphs:
        entry = _graph_entry(a.graph, a.compiled)
        if entry is None:
            return False
        graphs[a.kind] = entry
    if set(graphs) != {"forward", "backward"}:
        return False
    entry = {
        "forward": graphs["forward"], "backward": graphs["backward"],
        "n_outputs": layer.n_outputs,
        "tangent_layouts": [[list(s), list(st)] for s, st in layer.tangent_layouts],
        "tangent_types": [[str(d).removeprefix("torch."), str(dev)] for d, dev in layer.tangent_types],
        "tangent_outputs": None if layer.tangent_outputs is None else list(layer.tangent_outputs),
        "donates_buffers": layer.donates_buffers,
        "reductions": [dataclasses.astuple(r) for r in layer.reductions],
        "record": record,
    }
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError:
        return False  # a read-only cache: the next process traces again
    _COUNTS.saved += 1
    log.info("compiled layer %s: saved for a new process", key[:12])
    return True


# --- loading ----------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"no dtype {name!r}")
    return dt


def _load_graph(entry: dict, is_backward: bool, fake_mode: Any) -> Callable | None:
    from .._torch_compat import BoxedBool, CompiledFxGraphConstants, CompiledTritonKernels, FxGraphCache

    with fake_mode:
        examples = [torch.empty_strided(shape, stride, dtype=_dtype(dt), device=dev)
                    for shape, stride, dt, dev in entry["inputs"]]
    guards = entry["guards_expr"]
    constants = CompiledFxGraphConstants()
    CompiledTritonKernels.cache_clear()  # as AOTAutogradCache does before it loads
    graph, _ = FxGraphCache.load_with_key(
        entry["key"], list(entry["debug_lines"]), examples, local=True, remote_cache=None,
        is_backward=is_backward, constants=constants,
        # the entry saved is the one compiled then: its guards exactly
        evaluate_guards=lambda expr, _hints: expr == guards)
    if graph is None:
        return None
    graph.post_compile(examples, constants, {"cudagraphs": BoxedBool(False), "is_backward": is_backward,
                                             "boxed_forward_device_index": None})
    return graph


def load_layer(key: str, fake_mode: Any) -> tuple[CompiledLayer, Any] | None:
    """The layer saved under ``key`` and the caller's record, or None (a miss)."""
    from .._torch_compat import FakeTensorMode, TracingContext, tracing

    if _cudagraphs():
        return None
    try:
        with open(_path(key)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        _COUNTS.miss += 1
        return None
    if getattr(fake_mode, "shape_env", None) is None:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    try:
        # Inductor's cache reads the ShapeEnv of the tracing context
        with tracing(TracingContext(fake_mode)):
            fw = _load_graph(entry["forward"], False, fake_mode)
            bw = _load_graph(entry["backward"], True, fake_mode) if fw is not None else None
        layer = None if fw is None or bw is None else CompiledLayer(
            fw, bw, int(entry["n_outputs"]),
            tuple((tuple(s), tuple(st)) for s, st in entry["tangent_layouts"]),
            tuple((_dtype(d), torch.device(dev)) for d, dev in entry["tangent_types"]),
            0, 0, None if entry["tangent_outputs"] is None else tuple(entry["tangent_outputs"]),
            bool(entry["donates_buffers"]),
            tuple(TangentReduction(int(t), str(op), str(g), None if s is None else tuple(s))
                  for t, op, g, s in entry["reductions"]))
    except (KeyError, TypeError, ValueError) as e:
        log.info("compiled layer %s: unreadable entry (%s), compiled again", key[:12], e)
        layer = None
    if layer is None:
        log.info("compiled layer %s: its graphs are no longer in Inductor's cache, compiled again", key[:12])
        _COUNTS.miss += 1
        return None
    _COUNTS.hit += 1
    log.info("compiled layer %s: restored from Inductor's cache (forward and backward by their FX keys), "
             "nothing traced", key[:12])
    return layer, entry.get("record")
