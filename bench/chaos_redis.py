"""Chaos scenarios of ``python -m pdserve.bench.chaos`` that break Redis (see that module for
what each reports). Each runs its own embedded cluster (1 prefill + 2 decode workers, its own
redis-server child, registry TTL :data:`TTL_S`) and 16 live streams:

* ``flushall``: FLUSHALL once the streams are under way. Recovery: from the flush until Redis
  holds again every pool target, member and live worker's record, the router is not
  degraded, every pool is at its target, and a new request completed.
* ``redis-restart``: the redis-server SIGKILLed under the streams and started again
  :data:`DOWN_S` later (same port, its append-only file). Recovery: the same, from the restart.
* ``redis-down-past-ttl``: the redis-server SIGKILLed for longer than the registry TTL while
  the streams run and 8 new requests arrive, then started again. Recovery: from the restart.

The faults (:func:`flushall`, :func:`kill_redis`) and the recovery check
(:func:`control_plane_restored`) are what ``tests/e2e/test_control_plane.py`` drives too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import redis

from pdserve.api.admin_client import AdminClient, state_name
from pdserve.api.client import PdserveClient, PdserveError
from pdserve.bench.failover import (
    ChaosRequest,
    ScenarioResult,
    StreamRecord,
    chaos_requests,
    reference_tokens,
    stream_all,
    tally,
)
from pdserve.cluster.adapters import AdapterStore
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.cluster.pools.store import PoolStore
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.registry import Registry

logger = logging.getLogger(__name__)

TTL_S = 3.0  # the scenarios' registry TTL (heartbeats every 0.5 s)
DOWN_S = 1.0  # redis-restart: how long Redis stays down
RECOVERY_BOUND_S = 60.0  # a scenario that has not recovered by then reports no recovery


def embedded_redis(cluster):
    """The cluster's own redis-server child (``RedisServer``); ValueError for a cluster on
    an external Redis, which these faults cannot kill."""
    server = cluster._redis
    if server is None:
        raise ValueError("this fault needs the cluster's own embedded Redis: start it "
                         "without redis_url")
    return server


def redis_client(cluster):
    return redis.Redis.from_url(cluster.redis_url, socket_timeout=5)


def flushall(cluster) -> Callable[[], None]:
    """The fault: FLUSHALL (every key of every cluster on that Redis goes)."""
    def fault() -> None:
        with redis_client(cluster) as client:
            client.flushall()
    return fault


def kill_redis(cluster, down_s: float,
               during: Callable[[], Awaitable[object]] | None = None,
               back: list[float] | None = None) -> Callable[[], Awaitable[None]]:
    """The fault (a coroutine function, for ``stream_all``): SIGKILL the cluster's
    redis-server, run ``during()`` while it is down (at least ``down_s``), start it again on
    the same port with its data; the restart's ``time.monotonic()`` goes into ``back``.
    Restarted on the calling thread: the child dies with the thread that started it."""
    server = embedded_redis(cluster)

    async def fault() -> None:
        start = time.monotonic()
        await asyncio.to_thread(server.kill)
        try:
            if during is not None:
                await during()
            await asyncio.sleep(max(0.0, down_s - (time.monotonic() - start)))
        finally:
            server.start()
            if back is not None:
                back.append(time.monotonic())
    return fault


def control_plane_restored(cluster) -> bool:
    """Redis holds again what the cluster knows (each pool's target, every live member, a
    record of every ready worker and the LoRA registry's copy), the router is not degraded,
    every pool is at its target and the router's ports are saved."""

    with AdminClient(cluster.target, timeout=5) as admin:
        pools, workers = admin.get_pools(), admin.list_workers()
        degraded = admin.get_control_plane().degraded
    states = {w.worker_id: state_name(w.state) for w in workers}
    store = PoolStore(cluster.redis_url, cluster.cluster_name)
    auth = RecordAuth(cluster.derived_secret("redis-records"))
    registry = Registry(cluster.redis_url, cluster.cluster_name, auth=auth)
    adapters = AdapterStore(cluster.redis_url, cluster.cluster_name, auth)
    try:
        live = {w for w, state in states.items() if state != "dead"}
        ready = {w for w, state in states.items() if state == "ready"}
        return (not degraded and all(p.ready == p.target for p in pools)
                and store.targets() == {p.role: p.target for p in pools}
                and {m.worker_id for m in store.members()} == live
                and ready <= {r.worker_id for r in registry.workers()}
                and store.router_ports() == (cluster.port, cluster.metrics_port)
                and adapters.read() is not None)
    finally:
        store.close()
        registry.close()
        adapters.client.close()


def serves_a_request(cluster, timeout: float = 10.0) -> bool:
    """A new request completes (within ``timeout``)."""

    try:
        with PdserveClient(cluster.target, timeout=timeout) as client:
            out = client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0)
    except PdserveError as exc:
        logger.info("a new request failed: %s", exc)
        return False
    return out.finish_reason == "length"


class RecoveryWatch:
    """A thread that, once :meth:`arm` is called with a start time, polls until the control
    plane is restored and a new request completes; ``recovery_s`` is the time it took."""

    def __init__(self, cluster, poll_s: float = 0.1):
        self.cluster = cluster
        self.poll_s = poll_s
        self.recovery_s: float | None = None
        self._start: float | None = None
        self._armed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recovery-watch", daemon=True)

    def __enter__(self) -> RecoveryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._armed.set()
        self._thread.join(RECOVERY_BOUND_S + 10)

    def arm(self, start: float) -> None:
        self._start = start
        self._armed.set()

    def _run(self) -> None:
        self._armed.wait()
        if self._start is None:
            return
        while time.monotonic() - self._start < RECOVERY_BOUND_S:
            try:
                if control_plane_restored(self.cluster) and serves_a_request(self.cluster):
                    self.recovery_s = time.monotonic() - self._start
                    return
            except Exception as exc:  # noqa: BLE001 - not yet: Redis or the router is away
                logger.debug("not recovered yet: %s", exc)
            time.sleep(self.poll_s)


def _cluster(model_dir: str):
    return EmbeddedCluster(ClusterOptions(
        model=model_dir, num_prefill=1, num_decode=2, port=0, metrics_port=None,
        heartbeat_s=0.5, ttl_s=TTL_S,
        engine=dict(dtype="float32", memory_budget_bytes=512 << 20)))


Fault = Callable[[object, RecoveryWatch, list[ChaosRequest], list[StreamRecord]], Callable]


def _run(name: str, model_dir: str, seed: int, note: str, fault_for: Fault,
         extra: int = 0) -> ScenarioResult:
    """Start a cluster, stream 16 requests, inject the fault
    ``fault_for(cluster, watch, extra_requests, extra_records)`` builds (it may send
    ``extra`` more requests, recording them in ``extra_records``), tally them all."""
    requests = chaos_requests(16, seed, prefix=f"{name}-")
    extra_requests = chaos_requests(extra, seed + 1, prefix=f"{name}-x")
    expected = reference_tokens(model_dir, requests + extra_requests)
    extra_records: list[StreamRecord] = []
    with _cluster(model_dir) as cluster:
        cluster.wait_ready(120)
        with RecoveryWatch(cluster) as watch:
            fault = fault_for(cluster, watch, extra_requests, extra_records)
            records, _ = asyncio.run(stream_all(cluster.target, requests, fault))
    return tally(name, records + extra_records, expected, watch.recovery_s, note)


def run_flushall(model_dir: str, seed: int) -> ScenarioResult:
    def fault_for(cluster, watch, _requests, _records):
        flush = flushall(cluster)

        def fault() -> None:
            flush()
            watch.arm(time.monotonic())
        return fault

    return _run("flushall", model_dir, seed, "recovery from the flush", fault_for)


def run_redis_restart(model_dir: str, seed: int) -> ScenarioResult:
    def fault_for(cluster, watch, _requests, _records):
        back: list[float] = []
        inner = kill_redis(cluster, DOWN_S, back=back)

        async def fault() -> None:
            await inner()
            watch.arm(back[0])
        return fault

    return _run("redis-restart", model_dir, seed,
                f"down {DOWN_S:.0f} s; recovery from the restart", fault_for)


def run_redis_down_past_ttl(model_dir: str, seed: int) -> ScenarioResult:
    def fault_for(cluster, watch, extra_requests, extra_records):
        back: list[float] = []

        async def during() -> None:  # new requests while Redis is away
            records, _ = await stream_all(cluster.target, extra_requests)
            extra_records.extend(records)

        inner = kill_redis(cluster, TTL_S + 1.0, during=during, back=back)

        async def fault() -> None:
            await inner()
            watch.arm(back[0])
        return fault

    return _run("redis-down-past-ttl", model_dir, seed,
                f"down {TTL_S + 1:.0f} s (TTL {TTL_S:.0f} s), 8 requests sent meanwhile; "
                "recovery from the restart", fault_for, extra=8)


SCENARIOS: dict[str, Callable] = {  # name -> (model_dir, seed) -> failover.ScenarioResult
    "flushall": run_flushall,
    "redis-restart": run_redis_restart,
    "redis-down-past-ttl": run_redis_down_past_ttl,
}
