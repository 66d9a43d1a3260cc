"""How ``run_ranks`` starts its ranks (Note: [Ranks forked from a server that
imported torch] in ``localmap_fx/testing/dist.py``): forked from a server
that imported torch, with the parent's environment of the moment, or spawned
where a fork would see a stale one."""

from __future__ import annotations

import os

import pytest

from localmap_fx.testing import dist
from localmap_fx.testing.dist import run_ranks


def _what_a_rank_sees(rank, world_size, device, parent=None):
    # forked from the server: its parent is the server, not the test's process
    return {"env": os.environ.get("LOCALMAP_FX_TEST_MARK"), "cwd": os.getcwd(),
            "forked": parent is not None and os.getppid() != parent, "pid": os.getpid()}


def test_a_forked_rank_sees_the_environment_set_after_the_server_started(monkeypatch):
    run_ranks(_what_a_rank_sees, world_size=2)  # the server is up after this
    monkeypatch.setenv("LOCALMAP_FX_TEST_MARK", "set later")
    assert dist._start_context().get_start_method() == "forkserver"
    seen = run_ranks(_what_a_rank_sees, world_size=2, args=(os.getpid(),))
    assert [(s["env"], s["forked"]) for s in seen] == [("set later", True)] * 2
    assert [s["cwd"] for s in seen] == [os.getcwd()] * 2
    assert len({s["pid"] for s in seen}) == 2


def test_what_torch_reads_at_import_changed_means_spawn(monkeypatch):
    run_ranks(_what_a_rank_sees, world_size=2)
    monkeypatch.setenv("TORCH_LOCALMAP_FX_TEST_FLAG", "1")
    assert dist._start_context().get_start_method() == "spawn"


def test_the_compilers_environment_keeps_the_fork(monkeypatch, tmp_path):
    """Inductor sets TORCHINDUCTOR_CACHE_DIR at its first compile: every later
    run_ranks of a test process spawned its ranks, until the compiler's
    variables (read by modules the server does not import) were left out."""
    run_ranks(_what_a_rank_sees, world_size=2)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHDYNAMO_VERBOSE", "0")
    assert dist._start_context().get_start_method() == "forkserver"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = run_ranks(_what_a_rank_sees, world_size=2, args=(os.getpid(),))
    # the cwd of the moment, as multiprocessing gives a forked rank
    assert [(s["cwd"], s["forked"]) for s in seen] == [(str(tmp_path), True)] * 2


@pytest.mark.slow
def test_ranks_can_be_spawned_and_a_bad_start_method_is_named(monkeypatch):
    monkeypatch.setenv("LOCALMAP_FX_RANKS_START", "spawn")
    monkeypatch.setenv("LOCALMAP_FX_TEST_MARK", "spawned")
    seen = run_ranks(_what_a_rank_sees, world_size=2, args=(os.getpid(),))
    assert [(s["env"], s["forked"]) for s in seen] == [("spawned", False)] * 2
    monkeypatch.setenv("LOCALMAP_FX_RANKS_START", "fork")
    with pytest.raises(ValueError, match="LOCALMAP_FX_RANKS_START"):
        run_ranks(_what_a_rank_sees, world_size=2)


def test_deadlines_stretch_with_the_shards_sharing_the_cpus(monkeypatch):
    monkeypatch.setenv("LOCALMAP_FX_RANKS_TIMEOUT_SCALE", "2")
    assert dist._timeout_scale() == 2.0
    monkeypatch.setenv("LOCALMAP_FX_RANKS_TIMEOUT_SCALE", "0")
    with pytest.raises(ValueError, match="LOCALMAP_FX_RANKS_TIMEOUT_SCALE"):
        run_ranks(_what_a_rank_sees, world_size=2)
