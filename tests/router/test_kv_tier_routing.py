"""KV tiers in the routers' cost: a prompt's leading blocks a worker holds below its pool
count as cached blocks weighed by their load cost against computing them, so a pool hit beats
a host hit beats a disk hit beats nothing, for prefill and decode ranking and for conditional
disaggregation, and a tier slower than computing counts as nothing; the tiers' series in
/metrics follow each worker's stats."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import generate_latest

from pdserve.router.config import RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import (
    PrefillRouting,
    PrefixHit,
    WorkerLoad,
    chained_block_hashes,
    prefill_location,
    rank_decode,
    rank_prefill,
    tier_weights,
)
from pdserve.router.workers import Workers
from pdserve.worker_api import (
    KV_TIER_DISK,
    KV_TIER_HOST,
    KV_TIER_POOL,
    KVEvents,
    KVSnapshot,
    WorkerStats,
)

SALT = b"cluster-salt"
BLOCK_BYTES = 16 * 4096  # 16 tokens of 4 KiB of KV each
PROMPT = list(range(100, 164)) + [1, 2]  # 4 full blocks of 16


def load(worker_id: str, role: str = "prefill", **kv) -> WorkerLoad:
    stats = WorkerStats(worker_id, role, 128, 100, 28, 0, 0, 0, 10, 0, 0, 0,
                        kv_bytes_per_block=BLOCK_BYTES)
    return WorkerLoad(dataclasses.replace(stats, **kv))


def held_at(index: KVIndex, worker_id: str, tier: int) -> None:
    """The worker holds the prompt's 4 blocks, each best in ``tier``."""
    hashes = chained_block_hashes(PROMPT, 16, SALT)
    tiers = {} if tier == KV_TIER_POOL else dict.fromkeys(hashes, tier)
    index.reset(worker_id, KVSnapshot("log", 0, frozenset(hashes), tiers))


def test_tier_weights_follow_the_measured_reads_else_the_default_bandwidths():
    fresh = load("w")
    host, disk = tier_weights(fresh, None)[1:]  # 4 GB/s and 1 GB/s against 1e-4 s a token
    assert host == pytest.approx(1 - 4096 / 4e9 / 1e-4) and disk == pytest.approx(
        1 - 4096 / 1e9 / 1e-4) and 1 > host > disk > 0
    assert tier_weights(fresh, 2e-6) == pytest.approx((1, 1 - 4096 / 4e9 / 2e-6, 0))
    measured = load("w", kv_host_read_bytes=100 * BLOCK_BYTES, kv_host_read_s=0.01)
    # 100 blocks in 0.01 s: 6.25e-6 s a token against 1e-4 s of prefill
    assert tier_weights(measured, 1e-4)[1] == pytest.approx(1 - 0.01 / (100 * 16) / 1e-4)
    assert tier_weights(load("w", kv_bytes_per_block=0), 1e-4) == (1, 1, 1)  # size not known


def test_a_pool_hit_beats_a_host_hit_beats_a_disk_hit_beats_nothing():
    index = KVIndex()
    workers = {tier: load(name) for tier, name in ((KV_TIER_POOL, "a-pool"),
                                                   (KV_TIER_HOST, "b-host"),
                                                   (KV_TIER_DISK, "c-disk"), (None, "d-none"))}
    for tier, w in workers.items():
        if tier is not None:
            held_at(index, w.stats.worker_id, tier)
    want = ["a-pool", "b-host", "c-disk", "d-none"]
    # listed in reverse so that no tie-break by order can pass the test
    ranked = rank_prefill(list(workers.values())[::-1], PROMPT, 16, index, SALT)
    assert [w.stats.worker_id for w, _ in ranked] == want
    costs = [r.cost for _, r in ranked]
    assert costs == sorted(set(costs))  # strictly: the tiers decide, not the tie-breaks
    assert [r.hit_blocks for _, r in ranked] == [4, 4, 4, 0]
    assert ranked[1][1].hit == PrefixHit((KV_TIER_HOST,) * 4, pytest.approx(
        4 * tier_weights(workers[KV_TIER_HOST], None)[KV_TIER_HOST]))
    decode = [dataclasses.replace(w, stats=dataclasses.replace(w.stats, role="decode"))
              for w in workers.values()]
    ranked = rank_decode(decode[::-1], PROMPT, index, SALT)
    assert [w.stats.worker_id for w, _ in ranked] == want
    rooms = [r.room for _, r in ranked]
    assert rooms == sorted(set(rooms), reverse=True)


def test_a_tier_slower_than_computing_counts_as_nothing():
    index = KVIndex()
    slow = load("a-slow", kv_disk_read_bytes=BLOCK_BYTES, kv_disk_read_s=1.0)  # 64 KiB/s
    held_at(index, "a-slow", KV_TIER_DISK)
    nothing = load("b-nothing")
    ranked = rank_prefill([slow, nothing], PROMPT, 16, index, SALT)
    assert {w.stats.worker_id: r.cost for w, r in ranked} == {"a-slow": 10, "b-nothing": 10}
    routing = next(r for _, r in ranked if r.worker_id == "a-slow")
    assert (routing.hit_blocks, routing.hit.cached, routing.hit.blocks_in(KV_TIER_DISK)) == \
        (4, 0, 4)


def test_a_decode_worker_s_tier_hit_needs_free_blocks_to_load_into():
    """Conditional disaggregation: blocks held below the decode worker's pool are not sent
    but loaded into free blocks, so a worker without the room prefills nothing locally."""
    decode = load("d", "decode", free_blocks=2, queued_tokens=0)
    remote = PrefillRouting("p", hit_blocks=0, cost=500)
    hit = PrefixHit((KV_TIER_HOST,) * 4, 3.9)
    args = (100, 80, decode, remote, 5, 2.0)
    assert prefill_location(*args, decode_hit_blocks=hit.cached,
                            decode_pool_blocks=hit.pool_blocks).location == "remote"
    pooled = PrefixHit((KV_TIER_POOL,) * 4, 4.0)
    assert prefill_location(*args, decode_hit_blocks=pooled.cached,
                            decode_pool_blocks=pooled.pool_blocks).location == "local"
    roomy = dataclasses.replace(decode, stats=dataclasses.replace(decode.stats, free_blocks=5))
    assert prefill_location(100, 80, roomy, remote, 5, 2.0, decode_hit_blocks=hit.cached,
                            decode_pool_blocks=hit.pool_blocks).location == "local"


def test_kv_tier_series_follow_the_workers_stats_and_leave_with_it():
    metrics = RouterMetrics()
    tiered = WorkerStats("w0", "prefill", 64, 64, 0, 0, 0, 0, 0, 0, 300, 900,
                         kv_bytes_per_block=1024, kv_host_blocks=120, kv_disk_blocks=900,
                         kv_host_bytes=120 * 1024, kv_disk_bytes=900 * 1024,
                         kv_host_capacity_bytes=1 << 20, kv_disk_capacity_bytes=1 << 30,
                         kv_host_hit_tokens=160, kv_disk_hit_tokens=48,
                         kv_host_read_bytes=10 * 1024, kv_disk_read_bytes=3 * 1024,
                         kv_host_written_bytes=200 * 1024, kv_disk_written_bytes=80 * 1024,
                         kv_tier_evictions=7, kv_tier_read_failures=2, kv_tier_write_failures=1)
    metrics.set_worker(tiered)
    metrics.set_worker(WorkerStats("plain", "prefill", 64, 64, 0, 0, 0, 0, 0, 0, 0, 0))
    text = generate_latest(metrics.registry).decode()
    host, disk = ('role="prefill",tier="host",worker="w0"',
                  'role="prefill",tier="disk",worker="w0"')
    labels = 'role="prefill",worker="w0"'
    for line in (f"pdserve_kv_tier_blocks{{{host}}} 120.0",
                 f"pdserve_kv_tier_blocks{{{disk}}} 900.0",
                 f"pdserve_kv_tier_bytes{{{disk}}} 921600.0",
                 f"pdserve_kv_tier_capacity_bytes{{{host}}} 1.048576e+06",
                 f"pdserve_kv_tier_hit_tokens_total{{{host}}} 160.0",
                 f"pdserve_kv_tier_hit_tokens_total{{{disk}}} 48.0",
                 f"pdserve_kv_tier_read_bytes_total{{{disk}}} 3072.0",
                 f"pdserve_kv_tier_written_bytes_total{{{host}}} 204800.0",
                 f"pdserve_kv_tier_evictions_total{{{labels}}} 7.0",
                 f"pdserve_kv_tier_read_failures_total{{{labels}}} 2.0",
                 f"pdserve_kv_tier_write_failures_total{{{labels}}} 1.0",
                 f"pdserve_prefix_cache_queries_total{{{labels}}} 900.0"):
        assert line in text, line
    tier_lines = [line for line in text.splitlines() if line.startswith("pdserve_kv_tier")]
    assert not [line for line in tier_lines if 'worker="plain"' in line]  # it has no tiers
    metrics.remove_worker("prefill", "w0")
    text = generate_latest(metrics.registry).decode()
    assert not [line for line in text.splitlines()
                if line.startswith(("pdserve_kv_tier", "pdserve_prefix")) and 'worker="w0"' in line]


class TieredHandle:
    """A prefill worker with a pool of 4 blocks and host memory for 10 that published one
    batch of ``events``."""

    role = "prefill"

    def __init__(self, worker_id: str, events: KVEvents) -> None:
        self.worker_id = worker_id
        self.events: KVEvents | None = events
        self.snapshots = 0

    async def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "prefill", 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                           kv_log_id="log", kv_events_number=1, kv_bytes_per_block=100,
                           kv_host_capacity_bytes=1000)

    async def drain_kv_events(self) -> KVEvents | None:
        events, self.events = self.events, None
        return events

    async def kv_snapshot(self) -> KVSnapshot | None:
        self.snapshots += 1
        return None  # (an entry the router finds stale stays so)


def test_the_router_checks_each_tier_of_a_worker_against_its_own_capacity():
    """A worker whose host memory holds twice its pool's blocks is not stale to the router,
    and its blocks keep their tiers; one whose batch leaves more blocks in host memory than
    its budget holds is stale (its record's capacities reach the index)."""
    hashes = tuple(bytes([i]) * 32 for i in range(13))
    tiers = (KV_TIER_POOL,) * 2 + (KV_TIER_HOST,) * 8
    fits = TieredHandle("p0", KVEvents("log", 1, hashes[:10], (), tiers))
    over = TieredHandle("p1", KVEvents("log", 1, hashes, (),
                                       (KV_TIER_POOL,) * 2 + (KV_TIER_HOST,) * 11))

    async def scenario():
        workers = Workers(StaticDirectory([fits, over]), RouterConfig(stats_interval_s=3600),
                          RouterMetrics(), lambda handle, delta: None, lambda w, why: None)
        await workers.refresh()
        return workers.kv_index

    index = asyncio.run(scenario())
    assert not index.needs_snapshot("p0") and fits.snapshots == 0
    assert index.held_tiers("p0") == dict(zip(hashes[:10], tiers, strict=True))
    assert index.needs_snapshot("p1") and over.snapshots == 1
    assert index.held_tiers("p1") == {}
