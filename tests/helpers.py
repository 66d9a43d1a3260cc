"""Helpers shared by single-process tests: the fake process group and its
meshes (the one API for them; conftest.py has no mesh fixtures), rank-local
DTensors, waiting collectives."""

from __future__ import annotations

import contextlib
import functools

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 4


def ensure_fake_pg() -> None:
    """The session's fake process group (world size 4), made on first use.

    It is never destroyed: that would invalidate meshes other tests cached.
    """
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)


@functools.cache
def mesh_1d():
    ensure_fake_pg()
    return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))


@functools.cache
def mesh_2d():
    ensure_fake_pg()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def mesh_for(ndim: int):
    return mesh_1d() if ndim == 1 else mesh_2d()


@functools.cache
def ltm_mesh_for(ndim: int, owner: str = "ltm"):
    """A mesh for ``LocalTensorMode`` numerics only, never compiled on outside the mode.

    torch 2.14.1 keeps state per mesh that a Dynamo trace of a ``redistribute``
    outside the mode leaves wrong for the mode: eager gradients under it come
    out wrong afterwards, for torch's ``local_map`` too, on that mesh and no
    other (``tests/compile/test_upstream_local_tensor_mode.py``).  The
    session's meshes (:func:`mesh_for`) are compiled on by many modules, so
    tests that compare numerics under the mode use these, whose dimension
    names (``<owner>_tp``, ``<owner>_dp``) no other mesh shares.  The fuzz
    tier, which compiles hundreds of frames under the mode, and the eager
    parity suite have owners of their own: after the fuzz tier on a shared
    mesh, eager parity's DTensor ops ran about 2x slower (168 -> 365 s).
    """
    ensure_fake_pg()
    if ndim == 1:
        return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=(f"{owner}_tp",))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=(f"{owner}_dp", f"{owner}_tp"))


def rank_dtensor(full, mesh, placements, requires_grad=True):
    """``distribute_tensor`` under LocalTensorMode, with one tensor per rank.

    Fully replicated data stays one plain tensor under LocalTensorMode; real
    ranks each hold a copy, so give every rank its own (compiled backward
    relies on it).
    """
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, distribute_tensor

    dt = distribute_tensor(full.clone(), mesh, list(placements))
    local = dt._local_tensor
    if not isinstance(local, LocalTensor):
        local = LocalTensor({r: local.clone() for r in range(WORLD_SIZE)})
        dt = DTensor.from_local(local, mesh, list(placements), run_check=False, shape=dt.shape, stride=dt.stride())
    return dt.detach().requires_grad_(requires_grad)


@contextlib.contextmanager
def waiting_collectives():
    """Waits, on exit, every functional collective issued inside: eager funcol
    calls on the fake group whose results nothing reads (e.g. in a body a
    checker rejects halfway) would otherwise stay unwaited.  Yields the list
    of their op names (``"all_reduce.default"``...), filled as they run: the
    collectives a compiled backward or a run issues are counted too."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    wait = torch.ops._c10d_functional.wait_tensor.default
    issued: list = []
    names: list[str] = []

    class _Issued(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional" and func is not wait:
                issued.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                names.append(func.__name__)
            return out

    try:
        with _Issued():
            yield names
    finally:
        for t in issued:
            wait(t)


def grads_eager_outline_inline(step, full: list, placements: list, mesh, inner: str = "inductor") -> dict:
    """``{mode: full gradients}`` of ``step(*args).backward()``, args the
    DTensors of ``full`` with ``placements``, run eager and compiled with
    region bodies outlined and inline (``share_layers=False``: ``"auto"``
    would inline the bodies and skip the outlined path)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    import localmap_fx

    grads = {}
    for mode in ("eager", "outline", "inline"):
        torch._dynamo.reset()
        fn = step
        if mode != "eager":
            be = localmap_fx.backend(inner, outline=mode == "outline", share_layers=False)
            fn = torch.compile(step, backend=be, fullgraph=True)
        args = [distribute_tensor(t, mesh, p).requires_grad_() for t, p in zip(full, placements)]
        fn(*args).backward()
        grads[mode] = [a.grad.full_tensor() for a in args]
    return grads


def relative_errors(grads: dict) -> dict:
    """``{mode: [max |g - eager| / max |eager| per gradient]}`` of the compiled
    modes of :func:`grads_eager_outline_inline`."""
    eager = grads["eager"]
    return {
        mode: [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(gs, eager)]
        for mode, gs in grads.items()
        if mode != "eager"
    }


def full_text(e: BaseException) -> str:
    """An error as a traceback shows it: ``str(e)`` (torch's text) and its
    PEP 678 notes (localmap_fx's hints)."""
    return "\n".join([str(e), *getattr(e, "__notes__", ())])


def border_recording(inner: str = "inductor", **opts):
    """(backend, seen): a backend that keeps what ``compile_graph`` returned
    for each frame, the border itself behind what drops the mesh arguments
    (Note: [The mesh out of the cache key])."""
    import inspect

    from localmap_fx.compiler import BackendOptions
    from localmap_fx.compiler.pipeline import compile_graph

    options = BackendOptions(inner=inner, **opts)
    seen: list = []

    def backend(gm, example_inputs):
        fn = compile_graph(gm, example_inputs, options)
        seen.append(inspect.unwrap(fn))
        return fn

    return backend, seen


def seeded_dtensor(shape, placements, seed: int, requires_grad: bool = True, mesh=None):
    """A DTensor of a seeded random tensor (on ``mesh``, default :func:`mesh_1d`), a leaf."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    full = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return distribute_tensor(full, mesh or mesh_1d(), placements).detach().requires_grad_(requires_grad)


def col_row(x, w1, w2):
    """A TP block of DTensor ops, its weights outside any region: column then row, residual."""
    import torch
    from torch.distributed.tensor import Replicate

    h = torch.relu(x @ w1)                      # R @ S(1) -> S(1)
    y = h @ w2                                  # S(1) @ S(0) -> P
    return y.redistribute(x.device_mesh, [Replicate()]) + x
