"""No false alarm of the global SPMD check on the example models (Llama, MoE).

Every region of ``localmap_fx.testing.llama`` and ``.moe`` is built with
``spmd_types="global"`` (eager) or compiled with ``typecheck="global"``, on a
1-D and a 2 x 2 mesh, and one training step (forward and backward) runs
without an error.  The verdicts depend on shapes and placements only, so a
fake process group is enough (the models' numbers are tested on gloo in
``test_models.py``).  A negative control puts the classic bug (``relu``
before the row-parallel reduction) into one Llama region and must be caught,
eager and compiled, so a check that silently did nothing would fail here.
"""

from __future__ import annotations

import functools

import pytest
import torch

import localmap_fx
from localmap_fx.spmd.global_check import SpmdGlobalError

from helpers import ensure_fake_pg

CASES = [("llama", 1), ("llama", 2), ("moe", 1), ("moe", 2)]


def _mesh(which: str, ndim: int):
    from torch.distributed.device_mesh import init_device_mesh

    dim = "tp" if which == "llama" else "ep"
    if ndim == 2:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", dim))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rest", dim))[dim]


def _model(which: str, mesh, local_map):
    if which == "llama":
        from localmap_fx.testing.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(), mesh, local_map=local_map, typed_tables=True)
    from localmap_fx.testing.moe import MoE, MoEConfig

    return MoE(MoEConfig(), mesh, local_map=local_map)


def _step(model, fn=None) -> None:
    out = (model if fn is None else fn)(*model.make_inputs(4, 8))
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()


class _Recording:
    """A local_map factory that builds every region with ``spmd_types`` and counts them."""

    def __init__(self, spmd_types, swap=None) -> None:
        self.spmd_types, self.swap, self.built = spmd_types, swap or {}, 0

    def __call__(self, fn, *args, **kwargs):
        self.built += 1
        fn = self.swap.get(fn, fn)
        return localmap_fx.local_map(fn, *args, **kwargs, spmd_types=self.spmd_types)


@pytest.mark.parametrize("which,ndim", CASES)
def test_eager_every_region_global(which, ndim):
    ensure_fake_pg()
    factory = _Recording("global")
    model = _model(which, _mesh(which, ndim), factory)
    assert factory.built >= 4
    _step(model)


@pytest.mark.parametrize("which,ndim", CASES)
def test_compiled_typecheck_global(which, ndim):
    ensure_fake_pg()
    model = _model(which, _mesh(which, ndim), _Recording(True))
    compiled = torch.compile(model, backend=localmap_fx.backend(inner="eager", typecheck="global"), fullgraph=True)
    _step(model, compiled)


def _relu_row(x, w):
    return torch.relu(x @ w)


def _bugged_llama_factory():
    from localmap_fx.testing import llama

    return functools.partial(_Recording, swap={llama._linear: _relu_row})


def test_negative_control_eager():
    ensure_fake_pg()
    model = _model("llama", _mesh("llama", 1), _bugged_llama_factory()("global"))
    with pytest.raises(SpmdGlobalError, match="all-reduce before `relu`"):
        _step(model)


def test_negative_control_compiled():
    ensure_fake_pg()
    model = _model("llama", _mesh("llama", 1), _bugged_llama_factory()(True))
    compiled = torch.compile(model, backend=localmap_fx.backend(inner="eager", typecheck="global"), fullgraph=True)
    with pytest.raises(SpmdGlobalError, match="all-reduce before `relu`"):
        _step(model, compiled)
