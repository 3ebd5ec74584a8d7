"""A tensor parallel colocated worker over real Ray: each worker is a group of two ranks (the
actor's process and a follower it starts), served through gRPC. Greedy output equals the
offline engine; a killed rank takes its worker down as one and the pool replaces it with a
whole new group; the requests that met the broken group move to it, no token lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from pdserve.engine.tensor_parallel.group import FOLLOWER_MODULE
from pdserve.router.config import RouterConfig

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


def _followers() -> set[int]:
    out = subprocess.run(["pgrep", "-f", FOLLOWER_MODULE], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    before = _followers()
    c = start_cluster(model_dir, colocated=True, num_decode=1,
                      engine=dict(num_kv_blocks=256, tensor_parallel_size=2, device="cpu"))
    c.followers_before = before
    yield c
    c.stop()


def test_tp2_worker_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(0, 6)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, MAX_TOKENS)
    assert len(_followers() - cluster.followers_before) == 1  # one follower for one worker


def test_status_shows_each_worker_as_a_group(cluster, capsys):
    from pdserve.cli.main import main

    assert main(["status", "--target", cluster.target, "--json"]) == 0
    [worker] = json.loads(capsys.readouterr().out)["workers"]
    assert (worker["role"], worker["tensor_parallel_size"]) == ("colocated", 2)
    assert main(["status", "--target", cluster.target]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith(worker["worker_id"]))
    assert "cpu x1 TP2" in row


def test_a_killed_rank_restarts_its_worker_as_one_group(cluster, model_dir, e2e):
    [victim] = _followers() - cluster.followers_before
    [old] = [w.worker_id for w in cluster.refresh_workers() if w.state != "dead"]
    os.kill(victim, signal.SIGKILL)
    # the first step fails on the broken group; the requests move to the replacement
    during = e2e.prompts(1, 2)
    results = e2e.generate_all(cluster.target, during, MAX_TOKENS)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, during, MAX_TOKENS)
    e2e.wait_for(lambda: {w.worker_id for w in cluster.refresh_workers()
                          if w.state == "ready"} - {old},
                 what="a new tensor parallel worker in place of the one whose rank died")
    prompts = e2e.prompts(2, 4)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, MAX_TOKENS)
    new = _followers() - cluster.followers_before
    assert len(new) == 1 and victim not in new


@pytest.mark.parametrize(("prefill_ranks", "decode_ranks"), [(2, 1), (1, 2)])
def test_disaggregated_pools_of_different_group_sizes(start_cluster, model_dir, e2e,
                                                      prefill_ranks, decode_ranks):
    """P TP=2 -> D TP=1 and P TP=1 -> D TP=2: every decode rank receives exactly its K/V
    heads from the prefill ranks that hold them; greedy equals the offline engine. Prompts
    that extend earlier ones find their leading blocks in the decode worker's prefix cache
    (on every rank) and are sent only the rest."""
    cluster = start_cluster(model_dir, num_prefill=1, num_decode=1,
                            prefill_tensor_parallel_size=prefill_ranks,
                            decode_tensor_parallel_size=decode_ranks,
                            router=RouterConfig(disaggregation="always"),  # KV always moves
                            engine=dict(num_kv_blocks=256, device="cpu"))
    try:
        prompts = e2e.prompts(3, 6, low=12)
        results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
        assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, MAX_TOKENS)
        hits = cluster.worker_stats()["decode-0"].prefix_hit_tokens
        longer = [p + tail for p, tail in zip(prompts, e2e.prompts(4, 6), strict=True)]
        results = e2e.generate_all(cluster.target, longer, MAX_TOKENS)
        assert [r.token_ids for r in results] == e2e.reference(model_dir, longer, MAX_TOKENS)
        assert cluster.worker_stats()["decode-0"].prefix_hit_tokens - hits >= 6 * 8
        assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def split_pools(start_cluster, model_dir):
    """1P+1D, each worker a group of two ranks."""
    before = _followers()
    c = start_cluster(model_dir, num_prefill=1, num_decode=1, prefill_tensor_parallel_size=2,
                      decode_tensor_parallel_size=2,
                      router=RouterConfig(disaggregation="always"),
                      engine=dict(num_kv_blocks=256, device="cpu"))
    c.followers_before = before
    yield c
    c.stop()


def _follower_of(cluster, role: str) -> int:
    """The follower process of the ready ``role`` worker (a child of its actor's process)."""
    import psutil

    [pid] = [w.pid for w in cluster.refresh_workers() if w.role == role and w.state == "ready"]
    [child] = [p.pid for p in psutil.Process(pid).children()
               if FOLLOWER_MODULE in " ".join(p.cmdline())]
    return child


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_rank_of_a_split_pool_loses_no_request(split_pools, model_dir, e2e, role):
    """A follower rank killed: its worker fails its next step, the pool replaces the whole
    group, and the requests move on with their tokens intact."""
    victim = _follower_of(split_pools, role)
    os.kill(victim, signal.SIGKILL)
    prompts = e2e.prompts(7, 4)
    results = e2e.generate_all(split_pools.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, MAX_TOKENS)
    e2e.wait_for(lambda: _follower_of(split_pools, role) != victim,
                 what=f"a new {role} group in place of the one whose rank died")
    results = e2e.generate_all(split_pools.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == e2e.reference(model_dir, prompts, MAX_TOKENS)
