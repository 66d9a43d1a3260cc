"""Helpers shared by single-process tests (fake process group, meshes)."""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 4


def ensure_fake_pg() -> None:
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
