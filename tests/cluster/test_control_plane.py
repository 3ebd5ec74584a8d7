"""The router's hold on Redis (``pdserve.cluster.control_plane``): the degraded state and its
backoff, and the worker directory that keeps live workers routable when Redis lost their
records or cannot be reached. Real redis-server children; worker actors faked (no Ray)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pdserve.cluster.actors import RayHandle
from pdserve.cluster.control_plane import ControlPlaneHealth, ResilientDirectory
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.registry import Registry, WorkerRecord
from pdserve.router.metrics import RouterMetrics
from pdserve.testing.waits import wait_for

from .conftest import AUTH, Remote


class FakeWorker:
    """A worker actor whose ping answers while ``alive`` (and raises once it is not)."""

    def __init__(self) -> None:
        self.alive = True
        self.loop_alive = True
        self.ping = Remote(self._ping)

    async def _ping(self) -> dict:
        if not self.alive:
            raise ConnectionError("actor died")
        return {"loop_alive": self.loop_alive}


class FakeDirectory(ResilientDirectory):
    """Finds workers in ``actors`` instead of Ray's named actors."""

    def __init__(self, registry, health, actors):
        super().__init__(registry, "ns", "router", health, ping_timeout_s=1.0)
        self.actors = actors

    def _lookup(self, record):
        actor = self.actors.get(record.worker_id)
        return None if actor is None else RayHandle(actor, record.worker_id, record.role)


def test_degraded_backs_off_and_ends_at_the_first_success():
    now = [0.0]
    metrics = RouterMetrics()
    health = ControlPlaneHealth(metrics, min_backoff_s=1.0, max_backoff_s=4.0,
                                clock=lambda: now[0])
    assert health.can_try() and not health.degraded
    for backoff in (1.0, 2.0, 4.0, 4.0):
        health.failed(ConnectionError("refused"))
        assert health.degraded and health.error == "refused" and not health.can_try()
        now[0] += backoff - 0.01
        assert not health.can_try()
        now[0] += 0.01
        assert health.can_try()
    assert health.degraded_for_s == pytest.approx(11.0)
    assert metrics.control_plane_degraded._value.get() == 1
    health.ok()
    assert not health.degraded and health.degraded_for_s == 0 and health.error == ""
    assert metrics.control_plane_degraded._value.get() == 0
    health.failed(ConnectionError("again"))
    now[0] += 1.0
    assert health.can_try()  # the backoff starts over


def test_a_live_worker_whose_record_expired_stays_routable_until_it_dies(redis_url):
    """The worker cannot reach Redis (its record expires) while the router can: the router
    sees it alive through its pings and keeps routing to it, with its last stats."""
    registry = Registry(redis_url, uuid.uuid4().hex, ttl_s=0.3, auth=AUTH)
    actors = {"decode-0": FakeWorker(), "prefill-0": FakeWorker()}
    health = ControlPlaneHealth()
    directory = FakeDirectory(registry, health, actors)
    registry.heartbeat(WorkerRecord("decode-0", "decode", free_blocks=9))
    registry.heartbeat(WorkerRecord("prefill-0", "prefill"))
    [first, _] = sorted(asyncio.run(directory.snapshot()), key=lambda e: e[0].worker_id)
    wait_for(lambda: registry.workers() == [], 10, "both records to expire")
    listed = dict((h.worker_id, s) for h, s in asyncio.run(directory.snapshot()))
    assert set(listed) == {"decode-0", "prefill-0"} and not health.degraded
    assert listed["decode-0"] is first[1]  # its stats as last seen (the router's counts hold)
    actors["decode-0"].alive = False
    actors["prefill-0"].loop_alive = False
    assert asyncio.run(directory.snapshot()) == []
    registry.close()


def test_while_redis_is_down_the_known_workers_stay_and_it_says_degraded():
    server = RedisServer().start()
    try:
        registry = Registry(server.url, "c", ttl_s=30, auth=AUTH)
        actors = {"decode-0": FakeWorker(), "decode-1": FakeWorker()}
        health = ControlPlaneHealth(min_backoff_s=0.05, max_backoff_s=0.1)
        directory = FakeDirectory(registry, health, actors)
        for worker_id in actors:
            registry.heartbeat(WorkerRecord(worker_id, "decode"))
        assert len(asyncio.run(directory.snapshot())) == 2
        server.kill()
        actors["decode-1"].alive = False  # a worker that dies meanwhile still leaves
        live = asyncio.run(directory.snapshot())
        assert [h.worker_id for h, _ in live] == ["decode-0"] and health.degraded
        server.start()  # the same port and data (its append-only file)
        wait_for(lambda: asyncio.run(directory.snapshot()) and not health.degraded, 10,
                 "the directory to reach Redis again")
        # the records are back from the append-only file (the dead worker's until its TTL,
        # as after any death: a failed call takes it out of routing)
        assert {h.worker_id for h, _ in asyncio.run(directory.snapshot())} == set(actors)
        registry.close()
    finally:
        server.stop()


def test_what_the_router_publishes_is_kept_published(redis_url):
    registry = Registry(redis_url, uuid.uuid4().hex, auth=AUTH)
    health = ControlPlaneHealth()
    directory = FakeDirectory(registry, health, {})
    directory.keep_interval_s = 0.0
    writes = iter([True, False])
    directory.keep(lambda: next(writes))
    asyncio.run(directory.snapshot())
    asyncio.run(directory.snapshot())
    assert health.repairs == 1
