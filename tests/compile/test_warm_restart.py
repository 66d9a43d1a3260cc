"""A second process hits torch's caches that a first one filled (Note: [The mesh out of the cache key]).

Each compile runs in a fresh Python process (``_worker``) on a fake process
group, with ``TORCHINDUCTOR_CACHE_DIR`` pointing at the test's folder, and
reports torch's cache counters, the loss and the gradients.  With the default
options a whole model runs behind the border torch's caches serve, and both
caches hit (Note: [A border torch's caches can serve]); a regional block keeps
its AOT graphs behind the lean border (no AOTAutogradCache), and Inductor's FX
graph cache hits (Note: [Stable keys behind the border]); with
``stable_cache_keys=True`` both caches hit for both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(mode: str, n_layers: int, steps: int, save: str, load: str, stable: bool = True,
            style: str = "module", lone: bool = True) -> None:
    """One compile of the TP stack (``style="attention"``: the attention stack)
    in this (fresh) process; prints a JSON line."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import localmap_fx
    from localmap_fx.testing.models import TPStack, tp_stack_input

    torch.set_num_threads(1)
    if load:
        with open(load, "rb") as fh:
            torch.compiler.load_cache_artifacts(fh.read())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    impl = "torch" if mode == "upstream" else "ours"
    model: Any
    if style == "attention":
        from localmap_fx.testing.attention_stack import AttnStack, attn_stack_input

        model = AttnStack(mesh, n_layers, d=16, n_heads=4, impl=impl, marked=mode == "marked")
        x = attn_stack_input(mesh, 2, 8, 16)
    else:
        model = TPStack(mesh, n_layers, d=16, hidden=32, impl=impl, marked=mode == "marked")
        x = tp_stack_input(mesh, batch=8, d=16)
    f: Any
    be = localmap_fx.backend(stable_cache_keys=stable, share_layers=True if mode == "shared" else "auto",
                             lone_ops_as_aten=lone)
    if mode == "regional":
        for block in model.blocks:
            block.compile(backend=be)  # one backend object: Dynamo guards on its identity
        f = model
    elif mode == "upstream":
        f = torch.compile(model, backend="inductor")
    else:
        f = torch.compile(model, backend=be)
    losses = []
    for _ in range(steps):
        loss = f(x)
        loss.backward()
        losses.append(loss.to_local().item())
    if save:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            raise RuntimeError("save_cache_artifacts returned nothing")
        with open(save, "wb") as f_out:
            f_out.write(artifacts[0])
    grads = [p.grad.to_local().double().norm().item() for p in model.parameters()]  # type: ignore[union-attr]
    from localmap_fx.compiler import layer_cache

    print(json.dumps({
        "layers": dataclasses.asdict(layer_cache.counts()),
        "aot": dict(counters["aot_autograd"]),
        "inductor": dict(counters["inductor"]),
        "frames": counters["stats"]["unique_graphs"],
        "losses": losses,
        "grads": grads,
    }))


def _run(mode: str, cache_dir: str, n_layers: int = 2, steps: int = 1, save: str = "", load: str = "",
         stable: bool = True, style: str = "module", lone: bool = True) -> dict:
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests', 'compile')!r})\n"
            "from test_warm_restart import _worker\n"
            f"_worker({mode!r}, {n_layers}, {steps}, {save!r}, {load!r}, {stable!r}, {style!r}, {lone!r})\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _same_numbers(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["grads"] == b["grads"]


# Runs that several tests read are made once per module (a process pair costs
# about 20 s here): a cold process that fills a cache folder (and, for the
# whole model, writes the mega-cache), and a warm one on the same folder.


@dataclasses.dataclass(frozen=True)
class _Pair:
    cache: str  # the folder the cold process filled
    artifacts: str  # its mega-cache (whole-model pairs), else ""
    cold: dict
    warm: dict


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(mode, stable)``: the pair of that mode and ``stable_cache_keys``,
    made on first use (a whole-model pair's cold process also writes the mega-cache)."""
    made: dict[tuple[str, bool], _Pair] = {}

    def get(mode: str, stable: bool) -> _Pair:
        if (mode, stable) not in made:
            root = tmp_path_factory.mktemp(f"{mode}_{'stable' if stable else 'default'}")
            cache = str(root / "cache")
            artifacts = str(root / "artifacts.bin") if mode == "whole" else ""
            cold = _run(mode, cache, n_layers=3, save=artifacts, stable=stable)
            made[mode, stable] = _Pair(cache, artifacts, cold, _run(mode, cache, n_layers=3, stable=stable))
        return made[mode, stable]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "regional"])
def test_a_new_process_hits_both_caches(pairs, mode):
    pair = pairs(mode, stable=True)
    cold, warm = pair.cold, pair.warm
    # the first process found an empty cache and filled it
    assert cold["aot"].get("autograd_cache_miss", 0) >= 1 and cold["aot"].get("autograd_cache_saved", 0) >= 1
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1, warm
    assert warm["aot"].get("autograd_cache_miss", 0) == 0, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    _same_numbers(cold, warm)


@pytest.mark.slow
def test_default_options_hit_the_fx_graph_cache_in_a_new_process(pairs):
    """Default options, regional blocks: the graph behind the lean border has
    no mesh input, so every Inductor compile of the first process is an FX
    graph cache hit in the second (before, the forward graph, whose inputs
    held the mesh, missed)."""
    pair = pairs("regional", stable=False)
    cold, warm = pair.cold, pair.warm
    compiles = cold["inductor"].get("fxgraph_cache_miss", 0) + cold["inductor"].get("fxgraph_cache_hit", 0)
    # a forward and a backward at least
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2, cold
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == compiles, warm
    # the lean border keeps its AOT graphs: AOTAutogradCache is not asked
    assert not any(k.startswith("autograd_cache") for k in warm["aot"]), warm
    _same_numbers(cold, warm)


@pytest.mark.slow
def test_default_options_regional_blocks_restart_without_tracing(pairs):
    """Default options, regional blocks: the first process writes what the
    border read off its compile beside the caches, and the second loads the
    block's forward and backward by their FX keys and traces nothing (Note:
    [A kept compile restarts from Inductor's cache]); the same numbers."""
    pair = pairs("regional", stable=False)
    cold, warm = pair.cold, pair.warm
    # one variant compiled, for the Partial gradient a stack sends; the last
    # block's Replicate gradient is converted, not compiled for
    assert cold["layers"] == {"hit": 0, "miss": 1, "saved": 1}, cold
    assert warm["layers"] == {"hit": 1, "miss": 0, "saved": 0}, warm
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == 2 and "fxgraph_cache_miss" not in warm["inductor"], warm
    assert len(os.listdir(os.path.join(pair.cache, "localmap_fx", "layers"))) == 1
    _same_numbers(cold, warm)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["fx_cache_gone", "entry_garbled"])
def test_a_restored_layer_without_its_fx_graphs_or_readable_entry_compiles_again(pairs, tmp_path, damage):
    """The entry names FX graph cache keys: with Inductor's cache emptied, or
    the entry garbled, the second process compiles the block again (a miss,
    then a fresh entry): the same numbers, never a guess."""
    import shutil

    pair = pairs("regional", stable=False)
    cache = tmp_path / "cache"
    shutil.copytree(pair.cache, cache)  # what the cold process left (the warm one wrote nothing)
    if damage == "fx_cache_gone":
        shutil.rmtree(cache / "fxgraph")
    else:
        (entry,) = (cache / "localmap_fx" / "layers").iterdir()
        entry.write_text(entry.read_text()[:-40])
    warm = _run("regional", str(cache), n_layers=3, stable=False)
    assert warm["layers"] == {"hit": 0, "miss": 1, "saved": 1}, warm
    _same_numbers(pair.cold, warm)


@pytest.mark.slow
def test_default_options_hit_both_caches_for_a_whole_model_in_a_new_process(pairs):
    """Default options, the whole model compiled: the border torch's caches
    serve (Note: [A border torch's caches can serve]); the second process
    traces nothing, reads the input gradients' placements from the file the
    first wrote, and gives the same numbers."""
    pair = pairs("whole", stable=False)
    cold, warm = pair.cold, pair.warm
    assert cold["aot"].get("autograd_cache_saved", 0) == 1, cold
    assert warm["aot"].get("autograd_cache_hit", 0) == 1 and warm["aot"].get("autograd_cache_miss", 0) == 0, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert len(os.listdir(os.path.join(pair.cache, "localmap_fx", "border_grads"))) == 1
    _same_numbers(cold, warm)


@pytest.mark.slow
def test_a_process_without_lone_ops_as_aten_is_not_served_their_compile(tmp_path):
    """The lone-op switch and pass are in AOTAutogradCache's key (Note: [A lone
    op runs as its ATen op]): over a copy of a folder a default process filled,
    a process with ``lone_ops_as_aten=False`` misses and compiles its own, where
    a default one hits.  One block compiled whole: no repeated layers, so its
    lone ops run as ATen ops by default (Note: [Repeated layers in one graph
    keep their kernels])."""
    import shutil

    cache, copy = str(tmp_path / "cache"), str(tmp_path / "copy")
    cold = _run("whole", cache, n_layers=1, stable=False)
    shutil.copytree(cache, copy)
    other = _run("whole", copy, n_layers=1, stable=False, lone=False)
    assert other["aot"].get("autograd_cache_hit", 0) == 0 and other["aot"].get("autograd_cache_miss", 0) >= 1, other
    same = _run("whole", cache, n_layers=1, stable=False)
    assert same["aot"].get("autograd_cache_hit", 0) == 1, same
    assert other["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    assert other["grads"] == pytest.approx(cold["grads"], rel=1e-5)


@pytest.mark.slow
def test_default_options_mega_cache_without_the_gradient_file_compiles_again(pairs, tmp_path):
    """The mega-cache holds torch's caches, not the border's gradient file: a
    process that loads it into another folder hits AOTAutogradCache, finds no
    file, and compiles again with AOTAutogradCache off (Inductor's cache still
    hits): the same numbers, never a guess."""
    pair = pairs("whole", stable=False)
    warm = _run("whole", str(tmp_path / "b"), n_layers=3, load=pair.artifacts, stable=False)
    assert warm["aot"].get("autograd_cache_hit", 0) == 1, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert len(os.listdir(tmp_path / "b" / "localmap_fx" / "border_grads")) == 1
    _same_numbers(pair.cold, warm)


@pytest.mark.slow
def test_a_marked_blocks_layer_hits_the_fx_graph_cache_in_a_new_process(tmp_path):
    """Default options, marked blocks: the shared layer piece's mesh input is a
    constant in it (``lift_piece_meshes``), so its forward and backward hit
    Inductor's FX graph cache in a new process (before, its forward missed)."""
    cold = _run("marked", str(tmp_path / "cache"), n_layers=3, stable=False)
    warm = _run("marked", str(tmp_path / "cache"), n_layers=3, stable=False)
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2, cold
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 2, warm
    # the layer piece is restored without a trace (Note: [A kept compile
    # restarts from Inductor's cache]); the loss piece is AOTAutograd's alone
    assert cold["layers"] == {"hit": 0, "miss": 1, "saved": 1}, cold
    assert warm["layers"] == {"hit": 1, "miss": 0, "saved": 0}, warm
    _same_numbers(cold, warm)


@pytest.mark.slow
def test_a_marked_layer_that_dtensor_weights_enter_hits_the_fx_graph_cache_in_a_new_process(tmp_path):
    """Default options, the attention stack's marked blocks: DTensor weights
    enter the shared layer piece, so it runs behind the lean DTensor border,
    which lifts the piece's mesh input too (``lift_meshes(...,
    carried_only=True)``).  Every Inductor compile of the first process is an
    FX graph cache hit in the second (before, the layer's forward, whose
    inputs held the mesh, missed: its key pickled the mesh's address-based
    ``_hash``)."""
    cold = _run("marked", str(tmp_path / "cache"), n_layers=2, stable=False, style="attention")
    warm = _run("marked", str(tmp_path / "cache"), n_layers=2, stable=False, style="attention")
    compiles = cold["inductor"].get("fxgraph_cache_miss", 0) + cold["inductor"].get("fxgraph_cache_hit", 0)
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2, cold
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == compiles, warm
    # restored behind the lean border, nothing traced
    assert warm["layers"]["hit"] >= 1 and warm["layers"]["miss"] == 0, warm
    _same_numbers(cold, warm)


@pytest.mark.slow
def test_mega_cache_artifacts_load_into_another_cache_dir(pairs, tmp_path):
    """``torch.compiler.save_cache_artifacts`` in one process, ``load_cache_artifacts``
    in a second with an empty cache folder of its own: the second hits."""
    pair = pairs("whole", stable=True)
    warm = _run("whole", str(tmp_path / "b"), n_layers=3, load=pair.artifacts)
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1, warm
    assert warm["aot"].get("autograd_cache_miss", 0) == 0, warm
    _same_numbers(pair.cold, warm)


@pytest.mark.slow
def test_torch_never_hits_in_a_new_process_for_dtensor_programs(tmp_path):
    """Upstream (torch 2.14.1): torch's ``local_map`` under ``backend="inductor"``
    misses both caches in a second process, because the cache-key picklers
    pickle the DeviceMesh input's ``__dict__`` with ``_hash`` (address-based
    on Python 3.11).  When this fails, torch fixed it: the lifting in
    compiler/cache_keys.py may go."""
    cold = _run("upstream", str(tmp_path / "cache"))
    warm = _run("upstream", str(tmp_path / "cache"))
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1
    assert warm["aot"].get("autograd_cache_hit", 0) == 0, warm
    assert warm["aot"].get("autograd_cache_miss", 0) >= 1, warm
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == 0, warm


def test_mesh_inputs_leave_a_copy_of_dynamos_graph():
    """In process: the mesh placeholder becomes ``mesh_constant(key)`` in a copy;
    Dynamo's module keeps its inputs (Dynamo passes arguments by them)."""
    import torch
    import torch.fx as fx

    from localmap_fx.compiler import cache_keys

    from helpers import mesh_1d

    mesh = mesh_1d()
    g = fx.Graph()
    x, m = g.placeholder("x"), g.placeholder("mesh")
    g.output((g.call_function(getattr, (m, "ndim")), x))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta["dynamo_compile_id"] = "0/0"  # as Dynamo marks its graphs
    t = torch.ones(2)

    lifted, inputs, found = cache_keys.lift_meshes(gm, [t, mesh])
    assert found == (cache_keys.MeshInput(1, "mesh", cache_keys.portable_mesh_key(mesh)),)
    assert [n.name for n in lifted.graph.find_nodes(op="placeholder")] == ["x"]
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x", "mesh"]
    assert len(inputs) == 1 and inputs[0] is t
    assert """mesh_constant("cpu|(4,)|[0, 1, 2, 3]|('tp',)|""" in lifted.code
    ndim, out = cache_keys.without_meshes(lifted.forward, found, 2)(t, mesh)
    assert ndim == 1 and out is t

    # behind the lean border only a mesh that a DTensor input also carries
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert cache_keys.lift_meshes(gm, [t, mesh], carried_only=True)[2] == ()
    d = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    assert cache_keys.lift_meshes(gm, [d, mesh], carried_only=True)[2] == found

    # a graph that returns its mesh keeps it as an input
    g2 = fx.Graph()
    g2.output((g2.placeholder("x"), g2.placeholder("mesh")))
    gm2 = fx.GraphModule(torch.nn.Module(), g2)
    gm2.meta["dynamo_compile_id"] = "0/0"
    assert cache_keys.find_mesh_inputs(gm2, [t, mesh]) == ()
    # not Dynamo's graph (a piece of a split frame): left alone
    del gm.meta["dynamo_compile_id"]
    assert cache_keys.find_mesh_inputs(gm, [t, mesh]) == ()
