"""in_placements that mirror nested arguments, name parameters, or cover kwargs.

Rules (docs/user-guide.md, "Placements for nested arguments"): torch's flat
form wins whenever its length matches the number of flattened leaves;
otherwise a tuple with one entry per positional argument mirrors each
argument (an entry may be one spec for a whole container), and a dict maps
parameter names (positional or keyword) to such entries.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard

import localmap_fx

from helpers import WORLD_SIZE, full_text, ltm_mesh_for, rank_dtensor

S0, R = [Shard(0)], [Replicate()]


def _body(d, ws, scale, bias=None):
    out = d["q"] * d["k"] + (d["q"] @ ws[0]) @ ws[1] * scale
    return out if bias is None else out + bias


def _fulls():
    # outside LocalTensorMode: one tensor, not one per rank
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(8, 4, generator=g) for k in ("q", "k", "bias")}
    return full, [torch.randn(4, 4, generator=g) / 4 for _ in range(2)]


FULL, WS = _fulls()


def _inputs(mesh):
    full, ws = FULL, WS
    d = {k: rank_dtensor(full[k], mesh, S0) for k in ("q", "k")}
    return d, [rank_dtensor(w, mesh, R) for w in ws], rank_dtensor(full["bias"], mesh, S0), full, ws


FORMS = {
    "mirrored": dict(in_placements=({"q": S0, "k": S0}, R, None)),
    "mirrored_broadcast": dict(in_placements=(S0, [R, R], None)),
    "by_name": dict(in_placements={"d": S0, "ws": R}),
    # a list reads as a tuple, eager and compiled alike (issue #12)
    "mirrored_list": dict(in_placements=[{"q": S0, "k": S0}, R, None]),
    "mirrored_broadcast_list": dict(in_placements=[S0, [R, R], None]),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nested_forms_match_single_device_math(form, compiled):
    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(1)
        d, ws, _, full, wfull = _inputs(mesh)
        fn = localmap_fx.local_map(_body, out_placements=S0, **FORMS[form])
        call = (lambda d, ws: fn(d, ws, 2.0))
        if compiled:
            call = torch.compile(call, backend=localmap_fx.backend("aot_eager", outline=False), fullgraph=True)
        out = call(d, ws)
        got = out.full_tensor()._local_tensors[0]
    want = full["q"] * full["k"] + (full["q"] @ wfull[0]) @ wfull[1] * 2.0
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_keyword_argument_with_placements(compiled):
    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(1)
        d, ws, bias, full, wfull = _inputs(mesh)
        fn = localmap_fx.local_map(_body, out_placements=S0, in_placements={"d": S0, "ws": R, "bias": S0})
        call = lambda d, ws, b: fn(d, ws, 2.0, bias=b)  # noqa: E731
        if compiled:
            call = torch.compile(call, backend=localmap_fx.backend("aot_eager", outline=False), fullgraph=True)
        out = call(d, ws, bias)
        got = out.full_tensor()._local_tensors[0]
    want = full["q"] * full["k"] + (full["q"] @ wfull[0]) @ wfull[1] * 2.0 + full["bias"]
    torch.testing.assert_close(got, want)


def test_flat_form_keeps_torch_meaning():
    """A flat in_placements whose length matches the leaves is torch's form."""
    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(1)
        d, ws, _, full, wfull = _inputs(mesh)
        fn = localmap_fx.local_map(_body, out_placements=S0, in_placements=(S0, S0, R, R, None))
        out = fn(d, ws, 2.0)
        got = out.full_tensor()._local_tensors[0]
    torch.testing.assert_close(got, full["q"] * full["k"] + (full["q"] @ wfull[0]) @ wfull[1] * 2.0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_errors_name_the_argument_path(compiled):
    with LocalTensorMode(WORLD_SIZE):
        mesh = ltm_mesh_for(1)
        d, ws, _, _, _ = _inputs(mesh)
        cases = [
            (({"q": S0}, R, None), ValueError, "args[0]['k']"),  # missing entry
            (({"q": S0, "k": {"x": S0}}, R, None), ValueError, "args[0]['k']"),  # not a spec
            (({"q": S0, "k": None}, R, None), AssertionError, "args[0]['k']"),  # DTensor with None
            (({"q": S0, "k": R}, R, None), ValueError, "args[0]['k']"),  # mismatch
            (({"q": S0, "k": S0}, R, S0), AssertionError, "args[2]"),  # non-tensor with placements
            ({"d": S0, "nope": R}, ValueError, "nope"),  # unknown name
        ]
        for spec, exc, path in cases:
            fn = localmap_fx.local_map(_body, out_placements=S0, in_placements=spec)
            call = lambda d, ws, fn=fn: fn(d, ws, 2.0)  # noqa: E731
            if compiled:
                call = torch.compile(call, backend=localmap_fx.backend("aot_eager", outline=False), fullgraph=True)
            with pytest.raises(exc) as info:
                call(d, ws)
            assert path in full_text(info.value), (spec, full_text(info.value))
            assert "[localmap_fx]" in full_text(info.value), (spec, full_text(info.value))  # the fix
            torch._dynamo.reset()
