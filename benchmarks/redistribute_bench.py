"""P6: collectives per redistribute, ours vs DTensor's planner (graph level).

Single process on a fake process group of 4 ranks: a 1-D mesh (4,) and a
2-D mesh (2, 2).  Counts come from traced graphs, not from running them.

For every transition ``src -> dst`` (and tensor shape, even and uneven):

* **ours**: a region ``local_map(lambda a: a * 2, in_placements=(dst,),
  out_placements=dst, redistribute_inputs=True)`` called on a DTensor placed
  ``src``, compiled with ``localmap_fx.backend(inner="aot_eager")``; the
  collectives of the AOT forward graph are counted.
* **dtensor**: ``redistribute_local_tensor(local, src_spec, dst_spec)`` (the
  function ``DTensor.redistribute`` runs) traced with ``make_fx``.

A collective is a ``_c10d_functional`` node other than ``wait_tensor``; its
bytes are those of its input tensor (rank 0's shapes).  Transitions DTensor
refuses are listed as skipped.

Adjacent regions: for each placement ``p`` a region returning ``p`` feeds a
region taking ``p`` (same gradient placements).  After the backend's passes
no ``from_local -> to_local`` pair may remain between them, and the AOT
forward graph may hold no collective.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["redistribute_worker"]


def _collectives(gm) -> tuple[int, int, list[str]]:
    from localmap_fx.graph_utils import collective_name, is_collective, node_value

    n = nbytes = 0
    names = []
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        n += 1
        names.append(collective_name(node.target))
        val = node_value(node.args[0]) if node.args else None
        if isinstance(val, torch.Tensor):
            nbytes += val.numel() * val.element_size()
        elif isinstance(val, (list, tuple)):
            nbytes += sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return n, nbytes, names


def _pstr(placements) -> str:
    from localmap_fx.region import placements_str

    return placements_str(tuple(placements))


def _make_input(mesh, src, shape):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, src)
    stride = torch.empty(shape).stride()
    return DTensor.from_local(
        torch.randn(local_shape), mesh, src, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _dtensor_plan(mesh, src, dst, shape) -> tuple[int, int, list[str]]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    x = _make_input(mesh, src, shape)
    x.redistribute(mesh, dst)  # raises for transitions DTensor refuses
    meta = TensorMeta(torch.Size(shape), x.stride(), x.dtype)
    s = DTensorSpec(mesh, tuple(src), tensor_meta=meta)
    d = DTensorSpec(mesh, tuple(dst), tensor_meta=meta)
    gm = make_fx(lambda t: redistribute_local_tensor(t, s, d))(x.to_local())
    return _collectives(gm)


def _ours(mesh, src, dst, shape) -> tuple[int, int, list[str]]:
    import localmap_fx

    graphs = {}

    def on_aot_graph(kind, gm):
        graphs.setdefault(kind, gm)

    fn = localmap_fx.local_map(
        lambda a: a * 2,
        out_placements=list(dst),
        in_placements=(list(dst),),
        redistribute_inputs=True,
        device_mesh=mesh,
    )
    x = _make_input(mesh, src, shape)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a: fn(a).to_local(),
        backend=localmap_fx.backend(inner="aot_eager", on_aot_graph=on_aot_graph),
        fullgraph=True,
    )
    compiled(x)
    return _collectives(graphs["forward"])


def _adjacent(mesh, p) -> dict:
    """Region A returns ``p``, region B takes ``p``: what is left between them."""
    import localmap_fx
    from localmap_fx.graph_utils import is_from_local, is_to_local
    from localmap_fx.region import role_of

    stages = {}
    graphs = {}

    def on_stage(name, gm):
        if name == "fuse_boundaries":
            pairs = sum(
                1
                for n in gm.graph.nodes
                if is_from_local(n)
                and any(is_to_local(u) and role_of(u) == "enter" for u in n.users)
            )
            stages["round_trips"] = pairs

    def on_aot_graph(kind, gm):
        graphs.setdefault(kind, gm)

    a = localmap_fx.local_map(
        lambda t: t * 2, out_placements=list(p), in_placements=(list(p),), device_mesh=mesh
    )
    b = localmap_fx.local_map(
        lambda t: t + 1, out_placements=list(p), in_placements=(list(p),), device_mesh=mesh
    )
    x = _make_input(mesh, p, (8, 12))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: b(a(t)).to_local(),
        backend=localmap_fx.backend(inner="aot_eager", on_stage=on_stage, on_aot_graph=on_aot_graph),
        fullgraph=True,
    )
    compiled(x)
    n, nbytes, _ = _collectives(graphs["forward"])
    return {"placements": _pstr(p), "round_trips": stages["round_trips"], "collectives": n, "bytes": nbytes}


def redistribute_worker(quick: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    one = [Shard(0), Shard(1), Replicate(), Partial()]
    cases = []
    for shape in ((8, 12), (6, 10)):
        for s, d in itertools.product(one, one):
            cases.append((mesh1, (s,), (d,), shape))
    two = list(itertools.product(one, one))
    dsts2 = [(Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1))]
    for s in two:
        for d in dsts2:
            cases.append((mesh2, s, d, (8, 12)))
    if quick:
        cases = cases[::12]

    rows = []
    for mesh, src, dst, shape in cases:
        row = {
            "mesh": "x".join(str(k) for k in mesh.shape),
            "src": _pstr(src),
            "dst": _pstr(dst),
            "shape": list(shape),
        }
        try:
            d_n, d_b, d_names = _dtensor_plan(mesh, src, dst, shape)
        except Exception as e:  # noqa: BLE001 - DTensor refuses this transition
            row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            continue
        o_n, o_b, o_names = _ours(mesh, src, dst, shape)
        row.update(
            dtensor={"collectives": d_n, "bytes": d_b, "ops": d_names},
            ours={"collectives": o_n, "bytes": o_b, "ops": o_names},
            ok=o_n <= d_n and o_b <= d_b,
        )
        rows.append(row)

    adj_placements = [(p,) for p in one] + [
        (Shard(0), Replicate()),
        (Replicate(), Shard(1)),
        (Shard(0), Shard(1)),
        (Partial(), Shard(1)),
    ]
    if quick:
        adj_placements = adj_placements[:2]
    adjacent = []
    for p in adj_placements:
        mesh = mesh1 if len(p) == 1 else mesh2
        r = _adjacent(mesh, p)
        r["mesh"] = "x".join(str(k) for k in mesh.shape)
        adjacent.append(r)

    measured = [r for r in rows if "ok" in r]
    torch._dynamo.reset()
    return {
        "transitions": rows,
        "n_measured": len(measured),
        "n_skipped": len(rows) - len(measured),
        "n_ok": sum(1 for r in measured if r["ok"]),
        "collectives": {
            "ours": sum(r["ours"]["collectives"] for r in measured),
            "dtensor": sum(r["dtensor"]["collectives"] for r in measured),
        },
        "bytes": {
            "ours": sum(r["ours"]["bytes"] for r in measured),
            "dtensor": sum(r["dtensor"]["bytes"] for r in measured),
        },
        "adjacent": adjacent,
        "adjacent_redundant": sum(r["round_trips"] + r["collectives"] for r in adjacent),
    }
