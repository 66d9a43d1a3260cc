"""How ``run_ranks`` starts its ranks (Note: [Ranks forked from a server that
imported torch] in ``localmap_fx/testing/dist.py``): forked from a server
that imported torch, with the parent's environment of the moment, or spawned
where a fork would see a stale one."""

from __future__ import annotations

import os
import sys

import pytest

from localmap_fx.testing import dist
from localmap_fx.testing.dist import run_ranks


def _what_a_rank_sees(rank, world_size, device):
    return {"env": os.environ.get("LOCALMAP_FX_TEST_MARK"), "cwd": os.getcwd(),
            "torch_preloaded": "torch.distributed.tensor" in sys.modules, "pid": os.getpid()}


def test_a_forked_rank_sees_the_environment_set_after_the_server_started(monkeypatch):
    run_ranks(_what_a_rank_sees, world_size=2)  # the server is up after this
    monkeypatch.setenv("LOCALMAP_FX_TEST_MARK", "set later")
    assert dist._start_context().get_start_method() == "forkserver"
    seen = run_ranks(_what_a_rank_sees, world_size=2)
    assert [s["env"] for s in seen] == ["set later", "set later"]
    assert [s["cwd"] for s in seen] == [os.getcwd()] * 2
    assert len({s["pid"] for s in seen}) == 2


def test_what_torch_reads_at_import_changed_means_spawn(monkeypatch):
    run_ranks(_what_a_rank_sees, world_size=2)
    monkeypatch.setenv("TORCH_LOCALMAP_FX_TEST_FLAG", "1")
    assert dist._start_context().get_start_method() == "spawn"
    monkeypatch.delenv("TORCH_LOCALMAP_FX_TEST_FLAG")
    monkeypatch.syspath_prepend(os.path.dirname(__file__) + "/no_such_dir")
    assert dist._start_context().get_start_method() == "spawn"


def test_ranks_can_be_spawned_and_a_bad_start_method_is_named(monkeypatch):
    monkeypatch.setenv("LOCALMAP_FX_RANKS_START", "spawn")
    monkeypatch.setenv("LOCALMAP_FX_TEST_MARK", "spawned")
    assert [s["env"] for s in run_ranks(_what_a_rank_sees, world_size=2)] == ["spawned", "spawned"]
    monkeypatch.setenv("LOCALMAP_FX_RANKS_START", "fork")
    with pytest.raises(ValueError, match="LOCALMAP_FX_RANKS_START"):
        run_ranks(_what_a_rank_sees, world_size=2)
