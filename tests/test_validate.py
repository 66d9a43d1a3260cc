"""Unit tests of :mod:`localmap_fx.validate`: exception types, torch's text
first, then a hint that names the offending argument."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from localmap_fx import validate

from helpers import full_text

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.fixture
def dt(mesh1d):
    return DTensor.from_local(torch.ones(2, 8), mesh1d, [S0], run_check=False)


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
    monkeypatch.setattr(torch.distributed, "_is_spmd_types_available", lambda: False)
    with pytest.raises(RuntimeError, match="requires the spmd_types package"):
        validate.check_spmd_types_available()


def test_check_spec_fits_mesh():
    validate.check_spec_fits_mesh((S0, R), 2, "in_placements[0]", 2)
    validate.check_spec_fits_mesh((Shard(-2),), 1, "in_placements[0]", 2)
    with pytest.raises(ValueError, match=r"in_placements\[1\] has 1 placements but the device mesh has 2"):
        validate.check_spec_fits_mesh((S0,), 2, "in_placements[1]", 2)
    with pytest.raises(ValueError, match=r"out_placements\[0\] contains 'x'"):
        validate.check_spec_fits_mesh(("x",), 1, "out_placements[0]", None)
    with pytest.raises(ValueError, match=r"shards dimension 2 but the tensor has 2 dimensions"):
        validate.check_spec_fits_mesh((Shard(2),), 1, "in_placements[0]", 2)
    # grads: no tensor rank to check against
    validate.check_spec_fits_mesh((Shard(5),), 1, "in_grad_placements[0]", None)
    with pytest.raises(ValueError, match=r"in_grad_placements\[0\] has 2 placements"):
        validate.check_spec_fits_mesh((S0, R), 1, "in_grad_placements[0]", None)
