"""Caches never keep a destroyed mesh alive, nor leak between LocalMaps.

See Note: [Caches keyed on a mesh] (localmap_fx/meshcache.py).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

import localmap_fx
from localmap_fx.lowering.plan import plan_redistribute
from localmap_fx.meshcache import MeshCache

from helpers import WORLD_SIZE, ensure_fake_pg, mesh_1d


def _fresh_mesh() -> DeviceMesh:
    ensure_fake_pg()
    return DeviceMesh("cpu", list(range(WORLD_SIZE)), mesh_dim_names=("fresh",))


def _collected(make_and_use) -> bool:
    ref = make_and_use()
    # torch's own planner cache keeps every mesh it planned for (pinned below)
    clear_redistribute_planner_cache()
    gc.collect()
    return ref() is None


def test_torch_planner_cache_keeps_the_mesh():
    """Upstream (torch 2.14.1): ``_planner_cache`` is keyed on a weakref of the
    mesh but its planner holds the mesh, so the mesh lives until the cache is
    cleared.  When this fails, torch fixed it: drop the clearing in _collected."""
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._redistribute import get_redistribute_planner

    def use():
        m = _fresh_mesh()
        get_redistribute_planner(m, TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32))
        return weakref.ref(m)

    ref = use()
    gc.collect()
    assert ref() is not None
    clear_redistribute_planner_cache()
    gc.collect()
    assert ref() is None


def test_mesh_cache_holds_meshes_weakly_by_identity():
    cache = MeshCache()

    def use():
        m = _fresh_mesh()
        cache.set(m, "v")
        assert cache.get(m) == "v" and len(cache) == 1
        assert cache.get(_fresh_mesh()) is None  # equal mesh, other object
        return weakref.ref(m)

    assert _collected(use)
    assert len(cache) == 0


def test_redistribute_plans_do_not_keep_the_mesh():
    def use():
        m = _fresh_mesh()
        p = plan_redistribute(m, (Shard(0),), (Replicate(),), (8, 4), torch.float32)
        assert p.steps and p.steps[0].collective == "all_gather"
        return weakref.ref(m)

    assert _collected(use)


def _double(x):
    return x * 2


def test_eager_caches_do_not_keep_the_mesh():
    """A LocalMap without device_mesh takes the mesh of its inputs; its
    per-function caches (layouts, SPMD plans) must let that mesh go."""
    lm_plain = localmap_fx.local_map(_double, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    lm_spmd = localmap_fx.local_map(
        _double, out_placements=[Shard(0)], in_placements=([Shard(0)],), spmd_types=True
    )

    def use(lm):
        def run():
            m = _fresh_mesh()
            x = distribute_tensor(torch.randn(8, 4), m, [Shard(0)])
            out = lm(x)
            torch.testing.assert_close(out.to_local(), x.to_local() * 2)
            return weakref.ref(m)

        return run

    assert _collected(use(lm_plain))
    assert _collected(use(lm_spmd))


def test_nested_local_map_has_its_own_eager_plan():
    """An outer local_map over an inner one that already ran: the outer's
    eager state is its own (update_wrapper copies the inner's __dict__)."""
    mesh = mesh_1d()
    inner = localmap_fx.local_map(_double, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    inner(x)
    assert inner._eager_plan is not None
    outer = localmap_fx.local_map(inner, out_placements=[Replicate()], in_placements=([Replicate()],), device_mesh=mesh)
    assert outer._eager_plan is None
    xr = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
    # the outer region hands inner a plain tensor: inner runs its body as is
    out = outer(xr)
    torch.testing.assert_close(out.to_local(), xr.to_local() * 2)
    assert outer._eager_plan is not inner._eager_plan
    assert outer._eager_plan.in_specs == ((Replicate(),),)
    assert inner._eager_plan.in_specs == ((Shard(0),),)


def test_compiled_regions_do_not_keep_user_functions_alive():
    """Capture's registries (shared bodies of repeated regions, constants
    handed to the trace, per-trace verdicts) hold neither a user's function
    nor what its closure holds (Note: [Shared bodies do not keep the user's
    function alive], capture/reuse.py)."""
    from localmap_fx.capture import reuse

    mesh = mesh_1d()

    def make_and_use():
        big = torch.ones(256, 1024)  # held only by body's closure

        def body(x):
            return x * big[0, :4]

        lm = localmap_fx.local_map(body, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)

        def f(x):
            return lm(lm(lm(x)))  # the second and third calls share one body

        shared_before = set(vars(reuse._SHARED))
        x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        out = torch.compile(f, backend="eager", fullgraph=True)(x)
        torch.testing.assert_close(out.to_local(), x.to_local())
        assert set(vars(reuse._SHARED)) - shared_before, "no shared body was made"
        return weakref.ref(big), weakref.ref(body), shared_before

    big_ref, body_ref, shared_before = make_and_use()
    # Dynamo's own caches hold the compiled frame's guards and code, which
    # reference lm and body for as long as the frame may run again; reset()
    # drops them, as a process does when it no longer calls f.  What is left
    # must be ours.
    torch._dynamo.reset()
    gc.collect()
    assert body_ref() is None
    assert big_ref() is None
    assert set(vars(reuse._SHARED)) == shared_before


def test_mesh_key_is_made_once_per_mesh_and_lets_it_go():
    """analysis.mesh_key is cached per mesh object (the layer search reads it
    for every DTensor value): the same key for the same mesh, an equal one for
    another object over the same ranks and names, a different one for other
    names, and the cache never keeps a mesh alive."""
    from localmap_fx.analysis import mesh_key

    ensure_fake_pg()
    a = DeviceMesh("cpu", list(range(WORLD_SIZE)), mesh_dim_names=("k",))
    b = DeviceMesh("cpu", list(range(WORLD_SIZE)), mesh_dim_names=("k",))
    c = DeviceMesh("cpu", list(range(WORLD_SIZE)), mesh_dim_names=("other",))
    assert mesh_key(a) is mesh_key(a)
    assert mesh_key(a)[:4] == mesh_key(b)[:4] and mesh_key(a)[1] == tuple(range(WORLD_SIZE))
    assert mesh_key(a) != mesh_key(c)

    def make_and_use():
        m = _fresh_mesh()
        mesh_key(m)
        return weakref.ref(m)

    assert _collected(make_and_use)
