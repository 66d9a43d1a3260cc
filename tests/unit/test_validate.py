"""Unit tests of :mod:`localmap_fx.validate`: exception types, torch's text
first, then a hint that names the offending argument."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from localmap_fx import _torch_compat, validate

from helpers import full_text, mesh_1d

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.fixture
def dt():
    return DTensor.from_local(torch.ones(2, 8), mesh_1d(), [S0], run_check=False)


def test_as_placements():
    assert validate.as_placements(None) is None
    spec = (S0,)
    assert validate.as_placements(spec) is spec
    assert validate.as_placements([S0, R]) == (S0, R)
    with pytest.raises(TypeError):
        validate.as_placements(S0)  # torch does tuple(spec) too


def test_normalize_specs():
    assert validate.normalize_out_specs(None) == (None,)
    assert validate.normalize_out_specs([S0]) == ([S0],)
    assert validate.normalize_out_specs(([S0], None)) == ([S0], None)


def test_check_in_count():
    validate.check_in_count(None, 3)
    validate.check_in_count(([S0], None), 2)
    with pytest.raises(AssertionError) as e:
        validate.check_in_count(([S0],), 2)
    assert str(e.value).startswith(
        "in_placements length 1 does not match the number of input args 2!"
    )
    assert str(e.value) == "in_placements length 1 does not match the number of input args 2!"
    assert e.value.__notes__[0].startswith("[localmap_fx] Give one entry per flattened")


def test_check_dtensor_in_spec(dt):
    assert validate.check_dtensor_in_spec(dt, 0, [S0], False) is False
    assert validate.check_dtensor_in_spec(dt, 0, (S0,), True) is False
    assert validate.check_dtensor_in_spec(dt, 0, [R], True) is True
    with pytest.raises(ValueError) as e:
        validate.check_dtensor_in_spec(dt, 3, [R], False)
    msg = full_text(e.value)
    assert "in local_map has a mismatched placements: arg placements is (Shard(dim=0),)" in msg
    assert "set redistribute_inputs=True to local_map." in msg
    assert "in_placements[3]" in msg
    with pytest.raises(AssertionError) as e:
        validate.check_dtensor_in_spec(dt, 2, None, True)
    assert "expects placements but received None!" in full_text(e.value)
    assert "in_placements[2]" in full_text(e.value)


def test_check_dtensor_grad_spec(dt):
    assert validate.check_dtensor_grad_spec(dt, 0, [P]) == (P,)
    with pytest.raises(AssertionError) as e:
        validate.check_dtensor_grad_spec(dt, 5, None)
    assert "expects in grad placements but received None!" in full_text(e.value)
    assert "in_grad_placements[5]" in full_text(e.value)


def test_check_non_tensor_input():
    validate.check_non_tensor_input(3, 0, None)
    with pytest.raises(AssertionError) as e:
        validate.check_non_tensor_input("tag", 4, [R])
    msg = full_text(e.value)
    assert msg.startswith("Non-Tensor input tag expects None placements but received [Replicate()]!")
    assert "in_placements[4]" in msg and "str" in msg


def test_check_out_count():
    validate.check_out_count(2, ([S0], None))
    with pytest.raises(AssertionError) as e:
        validate.check_out_count(2, ([S0],))
    assert str(e.value).startswith(
        "local_map requires one PlacementType be provided for each output value, "
        "received 1 out_placements but 2 is expected!"
    )


def test_check_output_value(dt):
    validate.check_output_value(torch.ones(2), 0, [S0])
    validate.check_output_value(torch.ones(2), 0, None)  # torch wraps it as Replicate
    validate.check_output_value(3, 1, None)
    with pytest.raises(AssertionError) as e:
        validate.check_output_value(3, 1, [R])
    assert str(e.value).startswith("Non-tensor output 3 expects None placements but received")
    assert "out_placements[1]" in full_text(e.value)
    with pytest.raises(AssertionError) as e:
        validate.check_output_value(dt, 2, [S0])
    assert "torch.Tensor output expected but received" in full_text(e.value)
    assert "output 2" in full_text(e.value)


def test_check_spmd_types_available(monkeypatch):
    validate.check_spmd_types_available()
    monkeypatch.setattr(_torch_compat, "is_spmd_types_available", lambda: False)
    with pytest.raises(RuntimeError, match="requires the spmd_types package"):
        validate.check_spmd_types_available()


def test_placement_problem():
    assert validate.placement_problem((S0, R), 2, 2) is None
    assert validate.placement_problem((Shard(-2),), 1, 2) is None
    assert validate.placement_problem([S0], 1, 2) is None
    few = validate.placement_problem((S0,), 2, 2)
    assert few is not None and few.kind == validate.TOO_FEW
    assert few.text == (
        "has 1 placements but the device mesh has 2 dimensions: give one Placement per mesh dimension"
    )
    many = validate.placement_problem((S0, R), 1)
    assert many is not None and many.kind == validate.TOO_MANY
    assert many.text.startswith("has 2 placements but the device mesh has 1 dimension:")
    entry = validate.placement_problem((R, "x"), 2)
    assert entry is not None and (entry.kind, entry.entry, entry.position) == (validate.NOT_PLACEMENT, "x", 1)
    assert entry.text.startswith("contains 'x', which is not a Placement")
    # the entries are checked before the length
    assert validate.placement_problem(("x",), 2).kind == validate.NOT_PLACEMENT
    dim = validate.placement_problem((R, Shard(2)), 2, 2)
    assert dim is not None and (dim.kind, dim.entry, dim.position) == (validate.SHARD_DIM, Shard(2), 1)
    assert dim.text == "shards dimension 2 of a 2-d tensor: use a dim in [-2, 2)"
    # without the tensor's rank, Shard dims are not checked
    assert validate.placement_problem((Shard(5),), 1) is None
    seq = validate.placement_problem(S0, 1)
    assert seq is not None and seq.kind == validate.NOT_SEQUENCE
    assert seq.text == "is Shard(dim=0), not a sequence of placements"


def _offender_lines(call) -> list[str]:
    """The lines of a ValueError that name an argument (not the hints)."""
    with pytest.raises(ValueError) as e:
        call()
    return [line for line in str(e.value).splitlines() if line.startswith(("in_", "out_"))]


def _eager_and_compiled(fn, *args) -> list[list[str]]:
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    return [_offender_lines(lambda: fn(*args)), _offender_lines(lambda: compiled(*args))]


def test_our_errors_list_every_offending_argument(dt):
    """In the checks torch does not make, one error names every bad argument,
    in eager and compiled mode alike."""
    from localmap_fx import local_map

    mesh = dt.device_mesh
    grads = local_map(
        lambda a, b, c: a + b + c,
        out_placements=[S0],
        in_placements=([S0], None, [S0]),
        in_grad_placements=([S0, R], None, [Shard(5)]),
        device_mesh=mesh,
    )
    for lines in _eager_and_compiled(grads, dt, 1.0, dt):
        assert lines == [
            "in_grad_placements[0] = (Shard(dim=0), Replicate()) has 2 placements but the device "
            "mesh has 1 dimension: give one Placement per mesh dimension.",
            "in_grad_placements[2] = (Shard(dim=5),) shards dimension 5 of a 2-d tensor: use a dim in [-2, 2).",
        ]
    outs = local_map(
        lambda a: (a, a * 2, a * 3),
        out_placements=((S0, R), [S0], None),
        in_placements=([S0],),
        device_mesh=mesh,
    )
    for lines in _eager_and_compiled(outs, dt):
        assert lines == [
            "out_placements[0] = (Shard(dim=0), Replicate()) has 2 placements but the device mesh has 1 dimensions.",
            "out_placements[2] is None but output 2 of the body is a Tensor.",
        ]
    targets = local_map(
        lambda a, b: a + b,
        out_placements=[S0],
        in_placements=((S0, R), (R, S0)),
        redistribute_inputs=True,
        device_mesh=mesh,
    )
    for lines in _eager_and_compiled(targets, dt, dt):
        assert lines == [
            "in_placements[0] = (Shard(dim=0), Replicate()) has 2 placements but the device mesh has 1 dimension.",
            "in_placements[1] = (Replicate(), Shard(dim=0)) has 2 placements but the device mesh has 1 dimension.",
        ]
