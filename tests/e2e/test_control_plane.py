"""The control plane on real Ray, redis-server and gRPC: Redis is a cache of the truth.

One 1 prefill + 2 decode cluster on its own redis-server serves the module (registry TTL 3 s,
heartbeats every 0.5 s). Under 16 live streams Redis is flushed, then SIGKILLed and started
again; then it stays down longer than the TTL while new requests arrive; then garbage is
written into every key family the cluster uses; last, the router actor is killed while its
workers look older than the start timeout. Every stream must complete with its request's
draws (``pdserve.testing.draw_check``), no worker may be replaced, no pool may shrink, and Redis
must hold everything again within 10 s of being back (``bench.chaos_redis.control_plane_restored``,
which the chaos scenarios use too). Tests run in file order on the shared cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from pdserve.api.client import PdserveClient
from pdserve.bench.chaos_redis import (
    control_plane_restored,
    embedded_redis,
    flushall,
    kill_redis,
    redis_client,
    serves_a_request,
)
from pdserve.bench.failover import chaos_requests, stream_all
from pdserve.cluster.adapters import AdapterStore
from pdserve.cluster.processes import is_running
from pdserve.cluster.record_auth import RecordAuth
from pdserve.testing.draw_check import draw_problems

pytestmark = pytest.mark.e2e

BACK_S = 10.0  # Redis back -> everything re-published and a new request served, at most
START_S = 120.0  # bound on a restarted router serving again
TOKENS = dict(min_tokens=32, max_tokens=64)
LONG = dict(min_tokens=192, max_tokens=256)  # streams that outlive a short Redis outage


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, own_redis=True, num_prefill=1, num_decode=2,
                      engine=dict(num_kv_blocks=512))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def baseline(cluster):
    """worker_id -> pid of the workers the cluster started with (none may be replaced)."""
    return {w.worker_id: w.pid for w in workers(cluster)}


def workers(cluster) -> list:
    return [w for w in cluster.refresh_workers() if w.state != "dead"]


def pools(cluster) -> dict:
    return {p.role: p for p in cluster._ray.get(cluster.router.pools_info.remote(), timeout=30)}


def degraded(cluster) -> bool:
    return metric(cluster, "pdserve_control_plane_degraded ") == 1.0


def metric(cluster, line_start: str) -> float:
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_start)]
    return sum(values)


class PoolWatch:
    """Samples every pool (target, ready) in a thread while the block runs."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append({r: (p.target, p.ready) for r, p in pools(self.cluster).items()})

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def stream_under(cluster, model_dir, prefix: str, fault, tokens: dict = TOKENS) -> list:
    """16 live streams with ``fault`` once they are under way: every one completes with its
    request's draws, and every pool stays at its target all along; returns their records."""
    requests = chaos_requests(16, seed=sum(map(ord, prefix)), prefix=prefix, **tokens)
    with PoolWatch(cluster) as watch:
        records, _ = asyncio.run(stream_all(cluster.target, requests, fault))
    assert [r.error for r in records] == [None] * len(records)
    assert draw_problems(str(model_dir), [(r.prompt, r.sampling) for r in requests],
                         [r.token_ids for r in records]) == []
    assert watch.samples and all(s == {"prefill": (1, 1), "decode": (2, 2)}
                                 for s in watch.samples), watch.samples
    return records


def restored_within(cluster, e2e, seconds: float = BACK_S) -> None:
    e2e.wait_for(lambda: control_plane_restored(cluster), seconds,
                 "Redis to hold the cluster's state again")
    assert serves_a_request(cluster, timeout=seconds)


def no_worker_replaced(cluster, baseline) -> None:
    assert {w.worker_id: w.pid for w in workers(cluster)} == baseline
    assert all(p.restarts == 0 for p in pools(cluster).values())


def test_flushall_under_live_streams(cluster, model_dir, e2e, baseline):
    stream_under(cluster, model_dir, "flush", flushall(cluster))
    restored_within(cluster, e2e)
    with redis_client(cluster) as client:  # the id counter never re-issues a live id
        seq = int(client.get(f"pdserve:{cluster.cluster_name}:pool:decode:seq"))
    assert seq >= 2
    no_worker_replaced(cluster, baseline)


def test_redis_killed_and_restarted_under_live_streams(cluster, model_dir, e2e, baseline):
    back: list[float] = []

    async def seen_down() -> None:  # down until the router noticed, then back at once
        await asyncio.to_thread(e2e.wait_for, lambda: degraded(cluster), BACK_S,
                                "the router to see Redis down")

    records = stream_under(cluster, model_dir, "restart",
                           kill_redis(cluster, 0.0, seen_down, back), LONG)
    assert back and max(r.end for r in records) > back[0]  # streams still ran when it was back
    restored_within(cluster, e2e)
    no_worker_replaced(cluster, baseline)


def test_redis_down_longer_than_the_ttl(cluster, model_dir, e2e, baseline, capsys):
    """Serving goes on (new requests too), health stays SERVING, and the router says it is
    degraded: in its gauge and in `pdserve status`."""
    from pdserve.cli.main import main

    prompts = e2e.prompts(seed=21, n=4)
    expected = e2e.reference(model_dir, prompts, 8)
    seen = {}

    async def while_down() -> None:
        down_at = time.monotonic()
        while time.monotonic() - down_at < 3.0 + 1.0:  # past the registry TTL
            outs = await asyncio.to_thread(e2e.generate_all, cluster.target, prompts, 8)
            assert [o.token_ids for o in outs] == expected
            with PdserveClient(cluster.target, timeout=5) as client:
                assert client.health(timeout=5) == "SERVING"
        seen["degraded"] = degraded(cluster)
        assert main(["status", "--target", cluster.target, "--json"]) == 0
        seen["status"] = json.loads(capsys.readouterr().out)["control_plane"]
        assert main(["status", "--target", cluster.target]) == 0
        seen["line"] = capsys.readouterr().out

    back: list[float] = []
    stream_under(cluster, model_dir, "down", kill_redis(cluster, 4.0, while_down, back))
    assert seen["degraded"]
    assert seen["status"]["degraded"] and seen["status"]["degraded_for_s"] > 3.0
    assert "control plane: DEGRADED" in seen["line"]
    restored_within(cluster, e2e)
    assert not degraded(cluster)
    no_worker_replaced(cluster, baseline)


def test_garbage_in_every_key_family_is_survived_and_healed(cluster, model_dir, e2e,
                                                            baseline):
    prefix = f"pdserve:{cluster.cluster_name}:"
    with redis_client(cluster) as client:
        keys = {k.decode() for k in client.scan_iter(match=prefix + "*")}
        families = {k.removeprefix(prefix).split(":")[0] for k in keys}
        # all covered here ("kv": the workers' KV event streams, there once a worker has
        # published since the Redis restart above)
        assert families - {"kv"} == {"worker", "pool", "members", "pids", "router",
                                     "lora_adapters"}
        client.delete(prefix + "kv:decode-0")
        client.set(prefix + "kv:decode-0", "garbage")  # a key of another type
        client.xadd(prefix + "kv:prefill-0", {"junk": "1"})  # an entry that does not parse
        client.hset(prefix + "worker:decode-0", mapping={"total_blocks": "lots",
                                                         "draining": "maybe"})
        client.set(prefix + "worker:decode-1", "garbage")
        client.hset(prefix + "worker:junk", "junk", "1")  # no TTL, no worker
        client.set(prefix + "pool:decode:target", "garbage")
        client.delete(prefix + "pool:prefill:target")
        client.hset(prefix + "pool:prefill:target", "a", "hash")  # a key of another type
        client.set(prefix + "pool:decode:seq", "garbage")
        client.set(prefix + "pool:decode:restarts", "-1")
        client.hset(prefix + "members", mapping={"decode-0": "{not json", "decode-99": "[]"})
        client.sadd(prefix + "pids", "junk")
        client.hset(prefix + "router", "port", "abc")
        client.set(prefix + "lora_adapters", "garbage")  # the LoRA registry's copy
    prompts = e2e.prompts(seed=22, n=4)
    outs = e2e.generate_all(cluster.target, prompts, 8)  # serving goes on
    assert [o.token_ids for o in outs] == e2e.reference(model_dir, prompts, 8)
    restored_within(cluster, e2e)
    with redis_client(cluster) as client:
        assert not client.exists(prefix + "worker:junk") or client.pttl(prefix + "worker:junk") > 0
        assert int(client.get(prefix + "pool:decode:seq")) >= 2
    adapters = AdapterStore(cluster.redis_url, cluster.cluster_name,
                            RecordAuth(cluster.derived_secret("redis-records")))
    e2e.wait_for(lambda: adapters.read() == [], BACK_S, "the LoRA registry's copy back")
    e2e.wait_for(lambda: not redis_client(cluster).exists(prefix + "worker:junk"), BACK_S,
                 "the junk record to expire")
    assert metric(cluster, "pdserve_malformed_records_total") > 0
    assert metric(cluster, "pdserve_control_plane_repairs_total") > 0
    no_worker_replaced(cluster, baseline)


def test_a_restarted_router_kills_no_worker_older_than_the_start_timeout(cluster, e2e,
                                                                         baseline):
    """Workers started "an hour ago" (their records say so) whose ready() answers have not
    arrived when the restarted router first reconciles are not dead: their start clock
    starts at adoption."""
    prefix = f"pdserve:{cluster.cluster_name}:"
    with redis_client(cluster) as client:
        for worker_id, raw in client.hgetall(prefix + "members").items():
            record = json.loads(raw)
            record["created_time"] -= 3600.0  # older than the 600 s start timeout
            client.hset(prefix + "members", worker_id, json.dumps(record))
    router_pid = cluster._ray.get(cluster.router.info.remote(), timeout=30)["pid"]
    os.kill(router_pid, signal.SIGKILL)
    e2e.wait_for(lambda: not is_running(router_pid), 30, "the router process to die")

    def restarted() -> bool:
        try:
            return cluster._ray.get(cluster.router.info.remote(), timeout=5)["pid"] != router_pid
        except Exception:  # noqa: BLE001 - Ray is restarting it
            return False

    e2e.wait_for(restarted, START_S, "Ray to restart the router actor")
    # Start it as a launcher adopting it does (idempotent): the restarted router's own start
    # call, sent from its constructor, can reach it while Ray still calls it restarting, and
    # is then lost until its restart watchdog fires.
    cluster._ray.get(cluster.router.start.remote(), timeout=START_S)

    def adopted():
        try:
            listed = cluster._ray.get(cluster.router.list_workers.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the restarted router is not up yet
            return False
        return {w.worker_id: w.state for w in listed} == dict.fromkeys(baseline, "ready")

    e2e.wait_for(adopted, START_S, "the restarted router to adopt every worker")
    no_worker_replaced(cluster, baseline)
    assert serves_a_request(cluster)
    assert embedded_redis(cluster).process is not None
