"""The boundary plan (localmap_fx/boundary.py): gradient placements derived in
one place, the mesh ruling's loop, and the plan's text form."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from localmap_fx.boundary import (
    ArgBoundary,
    BoundaryPlan,
    OutBoundary,
    check_arg_meshes,
    explicit_grad,
    input_grad,
)

from helpers import mesh_1d, mesh_2d

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.mark.parametrize(
    "placements,given,typed,expected",
    [
        ((S0,), None, False, None),  # DTensor's default
        ((R,), None, False, None),
        ((R,), None, True, (P,)),  # the SPMD type's: R -> Partial
        ((S0, R), None, True, (S0, P)),
        ((S0,), None, True, None),  # nothing differs from the default
        ((P,), None, True, None),
        ((R,), [R], True, (R,)),  # given wins, as a tuple
        ((R,), (P,), False, (P,)),
    ],
)
def test_input_grad(placements, given, typed, expected):
    assert input_grad(placements, given, typed) == expected


def test_explicit_grad_is_dtensors_default():
    assert explicit_grad((P, S0), None) == (R, S0)  # Partial -> Replicate
    assert explicit_grad((R,), None) == (R,)
    assert explicit_grad((R,), [P]) == (P,)


def test_text_writes_every_gradient_out():
    plan = BoundaryPlan(
        (ArgBoundary(0, (R,), None, (P,)), ArgBoundary(2, (S0,), (S1,), None)),
        (OutBoundary(0, (P,), (8, 8), None),),
    )
    assert plan.text() == "in[0] R grad P; in[2] S(0)->S(1) grad S(1); out[0] P shape (8, 8) grad R"
    assert BoundaryPlan(()).text() == "no boundary"


def test_check_arg_meshes_ruling():
    m = mesh_1d()
    same_shape = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("tp",))
    other = DeviceMesh("cpu", list(reversed(range(dist.get_world_size()))), mesh_dim_names=("tp",))
    t = torch.arange(8.0).reshape(8, 1)
    args = [distribute_tensor(t, m, [S0]), 3, distribute_tensor(t, same_shape, [S0])]
    check_arg_meshes(args, m)  # the same shape over the same ranks is accepted
    check_arg_meshes(args + [distribute_tensor(t, other, [S0])], None)  # no device_mesh: nothing to check
    with pytest.raises(ValueError, match="args leaf 3 is a DTensor on"):
        check_arg_meshes(args + [distribute_tensor(t, other, [S0])], m)
    with pytest.raises(ValueError, match="args leaf 0 is a DTensor on"):
        check_arg_meshes([distribute_tensor(torch.ones(4, 4), mesh_2d(), [S0, S1])], m)
