"""The backend: registration, options, config hygiene, compile-time spmd errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import localmap_fx
from localmap_fx.testing.graphs import Recorder
from localmap_fx.testing.models import MODELS

from helpers import full_text, mesh_1d, mesh_for


@pytest.mark.slow
def test_entry_point_registers_backend_without_import():
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert 'localmap_fx' not in sys.modules\n"
        "fn = lookup_backend('localmap_fx')\n"
        "print(fn.__module__, fn.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["localmap_fx.compiler", "localmap_fx_backend"]


@pytest.mark.slow
@pytest.mark.inductor
def test_backend_by_name_compiles_with_inductor():
    m = MODELS["tp_mlp"]
    state = m.build(mesh_for(1), 0)
    loss = torch.compile(m.step, backend="localmap_fx", fullgraph=True)(state)
    loss.backward()
    assert state["w1"].grad.placements == (Shard(1),)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match=r"backend\(inner='tvm'\).*inductor"):
        localmap_fx.backend("tvm")
    with pytest.raises(ValueError, match=r"typecheck='some'"):
        localmap_fx.backend(typecheck="some")
    with pytest.raises(TypeError, match="accepts"):
        localmap_fx.backend(fast=True)


def test_options_by_name_reach_the_backend():
    """torch.compile(backend="localmap_fx", options={...}) configures the backend;
    an unknown key is a ValueError listing the valid ones."""
    m = MODELS["tp_mlp"]
    state = m.build(mesh_for(1), 0)
    stages: list[str] = []
    opts = {"inner": "eager", "on_stage": lambda name, gm: stages.append(name)}
    torch.compile(m.step, backend="localmap_fx", options=opts, fullgraph=True)(state).backward()
    assert stages[0] == "captured" and "lower_boundaries" in stages
    torch._dynamo.reset()
    with pytest.raises(ValueError) as info:
        torch.compile(m.step, backend="localmap_fx", options={"inner": "eager", "fast": True})(state)
    assert str(info.value).startswith(
        "torch.compile(backend='localmap_fx', options=...) got unknown option(s) ['fast']: the valid "
        "keys are ['inner', 'outline', 'fuse_boundaries', 'typecheck', 'on_stage', 'on_aot_graph',"
    )


def test_options_are_a_frozen_dataclass():
    opts = localmap_fx.backend("eager", outline=False).options
    assert isinstance(opts, localmap_fx.BackendOptions)
    assert (opts.inner, opts.outline, opts.fuse_boundaries) == ("eager", False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.inner = "inductor"


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_global_config_unchanged_by_compile(inner):
    before = (torch._dynamo.config.save_config(), torch._inductor.config.save_config())
    m = MODELS["loop3"]
    state = m.build(mesh_for(1), 0)
    torch.compile(m.step, backend=localmap_fx.backend(inner), fullgraph=True)(state).backward()
    after = (torch._dynamo.config.save_config(), torch._inductor.config.save_config())
    assert before == after


# --- spmd_types=True: checked once at compile time ---------------------------

def _bad_body(x, w):
    return x @ w  # V output, but out_placements asks Replicate: missing all-reduce


def _spmd_bad():
    return localmap_fx.local_map(
        _bad_body,
        out_placements=[Replicate()],
        in_placements=([Shard(1)], [Shard(0)]),
        device_mesh=mesh_1d(),
        spmd_types=True,
    )


def test_wrong_body_fails_compile_with_eager_error_and_call_site():
    fn = _spmd_bad()
    x = distribute_tensor(torch.randn(4, 8), mesh_1d(), [Shard(1)])
    w = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Shard(0)])
    with pytest.raises(Exception) as eager:
        fn(x, w)
    with pytest.raises(Exception) as compiled:
        torch.compile(lambda a, b: fn(a, b), backend=localmap_fx.backend("aot_eager"), fullgraph=True)(x, w)
    assert isinstance(compiled.value, type(eager.value))
    assert str(compiled.value).startswith(str(eager.value))  # Dynamo appends its hint
    # the call site is a note
    assert "test_backend.py" in full_text(compiled.value) and "_bad_body" in full_text(compiled.value)


def test_typecheck_off_skips_the_check():
    fn = _spmd_bad()
    x = distribute_tensor(torch.randn(4, 8), mesh_1d(), [Shard(1)])
    w = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Shard(0)])
    out = torch.compile(lambda a, b: fn(a, b), backend=localmap_fx.backend("aot_eager", typecheck="off"), fullgraph=True)(x, w)
    assert out.placements == (Replicate(),)


def test_typecheck_all_checks_regions_that_did_not_ask():
    fn = localmap_fx.local_map(
        _bad_body, out_placements=[Replicate()], in_placements=([Shard(1)], [Shard(0)]), device_mesh=mesh_1d()
    )
    x = distribute_tensor(torch.randn(4, 8), mesh_1d(), [Shard(1)])
    w = distribute_tensor(torch.randn(8, 4), mesh_1d(), [Shard(0)])
    torch.compile(lambda a, b: fn(a, b), backend=localmap_fx.backend("aot_eager"), fullgraph=True)(x, w)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="placement mismatch"):
        torch.compile(lambda a, b: fn(a, b), backend=localmap_fx.backend("aot_eager", typecheck="all"), fullgraph=True)(x, w)


def _good_col(x, w):
    return torch.relu(x @ w)


def _aot_text(spmd_types: bool) -> list[str]:
    import re

    mesh = mesh_1d()
    col = localmap_fx.local_map(
        _good_col, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]),
        device_mesh=mesh, spmd_types=spmd_types,
    )

    def step(x, w1):
        return col(x, w1).redistribute(mesh, [Replicate()]).sum()

    x = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()
    w1 = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]).requires_grad_()
    rec = Recorder("aot_eager")
    torch.compile(step, backend=rec.backend, fullgraph=True)(x, w1).backward()
    torch._dynamo.reset()
    texts = []
    for g in rec.aot["forward"] + rec.aot["backward"]:
        t = g.print_readable(print_output=False, include_stride=False, include_device=False)
        texts.append("\n".join(re.sub(r"\s*#.*", "", l) for l in t.splitlines() if l.strip() and not l.strip().startswith("#")))
    return texts


def test_spmd_check_leaves_no_work_in_the_compiled_graph():
    """With spmd_types=True the AOT graphs are those of spmd_types=False."""
    with_check, without = _aot_text(True), _aot_text(False)
    assert len(with_check) == 2
    assert with_check == without


@pytest.mark.parametrize(
    "options",
    [{}, {"share_layers": False}, {"share_layers": False, "outline": False}, {"fuse_boundaries": False},
     {"share_layers": True}],
    ids=["default", "no_sharing", "no_outline", "no_fuse", "shared"],
)
def test_observed_stages_are_the_pipeline_stages_in_order(options):
    # STAGES is the one list of what a frame goes through: every stage a
    # compile reports must be one of them, in that order.
    from localmap_fx.compiler.pipeline import STAGES

    m = MODELS["loop3"]
    rec = Recorder("aot_eager", **options)
    torch.compile(m.step, backend=rec.backend, fullgraph=True)(m.build(mesh_for(m.mesh_ndim), 0))
    order = [s.name for s in STAGES]
    seen = list(rec.stages)
    assert seen and set(seen) <= set(order), seen
    assert seen == sorted(seen, key=order.index), seen
    bodies = "outline_regions" if options.get("share_layers") is False and options.get("outline", True) else "inline_shared_bodies"
    assert bodies in seen and ({"outline_regions", "inline_shared_bodies"} - {bodies}).isdisjoint(seen)
    assert ("fuse_boundaries" in seen) == options.get("fuse_boundaries", True)
    # a split frame's rewrites are stages too
    assert ({"split_layers", "layer_runs"} <= set(seen)) == (options.get("share_layers") is True), seen
