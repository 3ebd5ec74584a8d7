"""Overload on real Ray, redis-server and gRPC: a burst whose KV exceeds the decode pool and
whose prefill queue outlasts the lease completes in full, in both modes, with the offline
engine's tokens; and with ``migration_limit 0`` a killed decode worker fails only its streams.

Each test starts its own small cluster: a decode pool of 40 blocks of 4 tokens holds about
two of the burst's requests at once, the lease (1 s) is shorter than a stalled prefill step
(1.5 s), and in colocated mode a stalled step (4 s) is longer than the registry TTL (3 s).
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.failover import (
    ChaosRequest,
    StreamRecord,
    reference_tokens,
    sigkill_busiest,
    stream_all,
    stream_one,
)
from pdserve.router.core import RouterConfig
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import async_wait_for

pytestmark = pytest.mark.e2e

SMALL_POOL = dict(num_kv_blocks=40, max_num_batched_tokens=16)


def burst(n: int = 10) -> list[ChaosRequest]:
    """Prompts of 48 tokens + 12 generated: 15 blocks each, ~2 fit a 40-block pool."""
    return [ChaosRequest(f"burst{i}", [(11 * i + 7 * j) % 390 + 5 for j in range(48)],
                         dict(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i in range(n)]


def run_burst(cluster, model_dir, stalled_role: str, stall_s: float):
    requests = burst()
    expected = reference_tokens(str(model_dir), requests, block_size=4, num_kv_blocks=512)
    cluster.refresh_workers()
    stalled = [w for w in cluster.workers if w.startswith(stalled_role)]

    def stall():
        for wid in stalled:
            cluster.workers[wid].inject_fault.remote("stall", stall_s)

    records, _ = asyncio.run(stream_all(cluster.target, requests, stall,
                                        fault_after_streams=0))
    return records, expected


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_burst_beyond_the_pool_and_the_lease_completes(start_cluster, model_dir, e2e, mode):
    if mode == "colocated":
        cluster = start_cluster(model_dir, colocated=True, num_decode=1, engine=SMALL_POOL)
        stalled_role, stall_s = "colocated", cluster.options.ttl_s + 1.0
    else:
        cluster = start_cluster(model_dir, num_prefill=1, num_decode=1, engine=SMALL_POOL,
                                lease_s=1.0)
        stalled_role, stall_s = "prefill", 1.5
    try:
        records, expected = run_burst(cluster, model_dir, stalled_role, stall_s)
        assert [r.error for r in records] == [None] * len(records)
        assert [r.token_ids for r in records] == expected
        assert not any(t.num_retries or t.num_migrations for t in cluster.traces())
        assert set(e2e.wait_idle(cluster).values()) == {0}
    finally:
        cluster.stop()


def test_migration_limit_zero_fails_only_streams_on_the_killed_worker(start_cluster,
                                                                       model_dir, e2e):
    from pdserve.bench.failover import chaos_requests

    cluster = start_cluster(model_dir, num_prefill=1, num_decode=2,
                            engine=dict(num_kv_blocks=512),
                            router=RouterConfig(migration_limit=0, stats_interval_s=0.1))
    try:
        requests = chaos_requests(16, seed=5, prefix="nomig")
        records, _ = asyncio.run(stream_all(cluster.target, requests,
                                            sigkill_busiest(cluster, "decode")))
        failed = [r for r in records if r.error]
        assert failed and {r.error for r in failed} == {"UNAVAILABLE"}
        served = [((q.prompt, q.sampling), r.token_ids)
                  for q, r in zip(requests, records, strict=True) if not r.error]
        assert draw_problems(str(model_dir), *zip(*served, strict=True)) == []
        cluster.wait_pools(120)
        assert set(e2e.wait_idle(cluster).values()) == {0}
    finally:
        cluster.stop()


async def big_first(target: str, big: ChaosRequest, normal: list[ChaosRequest]):
    """The big request streams first; the normal ones arrive once it is decoding."""
    from pdserve.api.client import AsyncPdserveClient

    records = [StreamRecord(r.request_id) for r in [big, *normal]]
    async with AsyncPdserveClient(target) as client:
        tasks = [asyncio.create_task(stream_one(client, big, records[0], 120))]
        await async_wait_for(lambda: records[0].token_ids, 60, "the big request decoding")
        tasks += [asyncio.create_task(stream_one(client, r, rec, 120))
                  for r, rec in zip(normal, records[1:], strict=True)]
        await asyncio.gather(*tasks)
    return records


def test_the_storm_one_huge_context_cannot_starve_normal_requests(start_cluster, model_dir,
                                                                  e2e):
    """The seed's incident: one request whose context fills most of the decode pool beside a
    stream of normal ones. With priority scheduling the big one (low priority) is bounced,
    never recomputed on the decode pool; every normal request completes with the offline
    tokens, and preemptions stay bounded (no eviction storm)."""
    cluster = start_cluster(model_dir, num_prefill=1, num_decode=1,
                            engine=dict(num_kv_blocks=96, scheduling_policy="priority"),
                            router=RouterConfig(scheduling_policy="priority",
                                                stats_interval_s=0.1))
    try:
        normal = [ChaosRequest(f"n{i}", [(13 * i + j) % 390 + 5 for j in range(16)],
                               dict(max_tokens=24, temperature=0.0, ignore_eos=True))
                  for i in range(12)]
        big = ChaosRequest("big", [(3 * j) % 390 + 5 for j in range(250)],
                           dict(max_tokens=90, temperature=0.0, ignore_eos=True, priority=5))
        requests = [big, *normal]
        expected = reference_tokens(str(model_dir), requests, block_size=4, num_kv_blocks=512)
        records = asyncio.run(big_first(cluster.target, big, normal))
        assert [r.error for r in records] == [None] * len(records)
        assert [r.token_ids for r in records] == expected
        stats = cluster.worker_stats()
        decode = next(s for s in stats.values() if s.role == "decode")
        assert decode.num_preemptions == decode.num_bounces  # never recomputed on decode
        assert 1 <= decode.num_bounces <= 2 * len(requests)  # it bit, and stayed bounded
        assert set(e2e.wait_idle(cluster).values()) == {0}
    finally:
        cluster.stop()
