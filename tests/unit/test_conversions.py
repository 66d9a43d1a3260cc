"""A border's placement conversions, planned once (localmap_fx/compiler/conversions.py).

Each conversion is checked against DTensor's own ``redistribute_local_tensor``
on the same local tensor and specs: bitwise equal values, the same spec.  On
the fake process group a collective moves no data, so the values say what the
local arithmetic does; tests/distributed/test_conversions_gloo.py runs the
collectives on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import _MaskPartial

from localmap_fx.compiler.conversions import plan_conversion

from helpers import mesh_1d, mesh_2d


def _spec(mesh, placements, shape):
    stride = torch.empty(shape).stride()
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, torch.float32))


def _local(mesh, placements, shape, seed=0):
    """A local tensor of ``shape`` sharded by ``placements`` on this rank (rank 0 of the fake group)."""
    local = list(shape)
    for k, p in enumerate(placements):
        if isinstance(p, Shard):
            size, _ = Shard.local_shard_size_and_offset(local[p.dim], mesh.size(k), mesh.get_coordinate()[k])
            local[p.dim] = size
    g = torch.Generator().manual_seed(seed)
    # values with negative zeros: a conversion that copied instead of adding
    # to zeros (as DTensor does) would keep their sign
    t = torch.randn(local, generator=g)
    t.view(-1)[0] = -0.0
    return t


CASES = [
    # (mesh, src, dst, global shape, the step's text)
    ("1d", [Partial()], [Replicate()], (8, 6), "P->R@tp:all_reduce"),
    ("1d", [Partial("avg")], [Replicate()], (8, 6), "P(avg)->R@tp:all_reduce"),
    ("1d", [Partial("max")], [Replicate()], (8, 6), "P(max)->R@tp:all_reduce"),
    ("1d", [Replicate()], [Partial()], (8, 6), "R->P@tp:partition"),
    ("1d", [Replicate()], [Partial("avg")], (8, 6), "R->P(avg)@tp:partition"),
    ("1d", [Shard(0)], [Partial()], (8, 6), "S(0)->P@tp:embed"),
    ("1d", [Shard(1)], [Partial()], (8, 6), "S(1)->P@tp:embed"),
    ("1d", [Shard(0)], [Partial()], (9, 6), "S(0)->P@tp:embed"),  # uneven: 3, 2, 2, 2 rows
    ("2d", [Shard(0), Partial()], [Shard(0), Replicate()], (8, 6), "P->R@tp:all_reduce"),
    ("2d", [Partial(), Shard(1)], [Partial(), Partial()], (8, 6), "S(1)->P@tp:embed"),
    # DTensor's way kept: a change on two mesh dimensions, a shard of the
    # same tensor dimension on another mesh dimension, a gather
    ("2d", [Partial(), Partial()], [Replicate(), Replicate()], (8, 6), None),
    ("2d", [Shard(0), Shard(0)], [Shard(0), Partial()], (8, 6), None),
    ("1d", [Shard(0)], [Replicate()], (8, 6), None),
]


@pytest.mark.parametrize("mesh_kind,src,dst,shape,text", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_conversion_equals_dtensors_redistribute(mesh_kind, src, dst, shape, text, waited_collectives):
    mesh = mesh_1d() if mesh_kind == "1d" else mesh_2d()
    s, d = _spec(mesh, src, shape), _spec(mesh, dst, shape)
    conversion = plan_conversion(s, d)
    local = _local(mesh, src, shape)
    want = redistribute_local_tensor(local.clone(), s, d)
    got = conversion(local.clone())
    assert got._spec == d
    assert got._local_tensor.shape == want.shape
    # bitwise, negative zeros included
    assert torch.equal(got._local_tensor, want) and torch.equal(got._local_tensor.signbit(), want.signbit())
    if text is None:
        assert [type(step).__name__ for step in conversion.steps] == ["_Redistribute"]
    else:
        assert conversion.text() == text
        assert type(conversion.steps[0]).__name__ != "_Redistribute"


def test_a_placement_subclass_keeps_dtensors_way():
    mesh = mesh_1d()
    masked = _MaskPartial(offset_shape=torch.Size([8, 6]), offset_dim=0)
    conversion = plan_conversion(_spec(mesh, [masked], (8, 6)), _spec(mesh, [Replicate()], (8, 6)))
    assert [type(step).__name__ for step in conversion.steps] == ["_Redistribute"]


def test_no_change_is_no_step():
    mesh = mesh_1d()
    s = _spec(mesh, [Shard(0)], (8, 6))
    conversion = plan_conversion(s, s)
    assert conversion.steps == () and conversion.text() == "noop"
    local = _local(mesh, [Shard(0)], (8, 6))
    assert conversion(local)._local_tensor is local


def test_a_shard_of_another_size_is_refused():
    mesh = mesh_1d()
    conversion = plan_conversion(_spec(mesh, [Shard(0)], (8, 6)), _spec(mesh, [Partial()], (8, 6)))
    with pytest.raises(RuntimeError, match=r"has 3 rows on dimension 0, its placement says 2"):
        conversion(torch.zeros(3, 6))


def test_only_a_lone_partition_is_undone_by_its_groups_reduction():
    """What lets a border hand a Replicate gradient to a backward that sums its
    Partial share (Note: [The tangent's all_reduce belongs to the border])."""
    mesh, mesh2 = mesh_1d(), mesh_2d()
    group = mesh.get_group().group_name
    shape = (8, 6)
    partition = plan_conversion(_spec(mesh, [Replicate()], shape), _spec(mesh, [Partial()], shape))
    assert partition.undone_by("sum", group)
    assert not partition.undone_by("avg", group)
    assert not partition.undone_by("sum", "another group")
    avg = plan_conversion(_spec(mesh, [Replicate()], shape), _spec(mesh, [Partial("avg")], shape))
    assert avg.undone_by("avg", group) and not avg.undone_by("sum", group)
    assert not plan_conversion(_spec(mesh, [Partial()], shape), _spec(mesh, [Replicate()], shape)).undone_by(
        "sum", group)
    assert not plan_conversion(_spec(mesh, [Replicate()], shape), _spec(mesh, [Replicate()], shape)).undone_by(
        "sum", group)
    # two mesh dimensions at once: DTensor's way, never taken for a lone partition
    both = plan_conversion(_spec(mesh2, [Replicate(), Replicate()], shape), _spec(mesh2, [Partial(), Partial()], shape))
    assert not any(both.undone_by("sum", mesh2.get_group(k).group_name) for k in range(2))
