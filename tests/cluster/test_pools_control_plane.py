"""The pool manager over a real redis-server that loses its data, holds garbage or goes away,
with worker actors faked (no Ray): Redis is a cache of the manager's truth, never a reason to
shrink a pool or kill a healthy worker."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from pdserve.cluster.actors import WorkerSpec
from pdserve.cluster.pools.manager import PoolManager
from pdserve.cluster.pools.plan import DEAD, DRAINING, READY, STARTING
from pdserve.cluster.pools.settings import PoolSettings
from pdserve.cluster.pools.store import MemberRecord, PoolStore
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.registry import Registry, WorkerRecord
from pdserve.engine.config import EngineConfig

from .conftest import AUTH, Remote


class FakeWorker:
    """A worker actor: ``ready()`` answers at once, or never with ``slow_start``."""

    def __init__(self, worker_id: str, slow_start: bool = False):
        self.worker_id = worker_id
        self.slow_start = slow_start
        self.ready = Remote(self._ready)
        self.ping = Remote(self._ping)

    async def _ready(self) -> dict:
        if self.slow_start:
            await asyncio.sleep(3600)
        return await self._ping()

    async def _ping(self) -> dict:
        return {"worker_id": self.worker_id, "pid": 100 + int(self.worker_id.split("-")[1]),
                "node_ip": "127.0.0.1", "loop_alive": True}


class FakeActorsManager(PoolManager):
    """A pool manager whose live worker actors are ``actors`` (by name), not Ray's."""

    def __init__(self, redis_url: str, cluster: str, actors: dict, **settings):
        spec = WorkerSpec("decode", "decode", EngineConfig(model="m"), redis_url, cluster)
        super().__init__(PoolStore(redis_url, cluster),
                         Registry(redis_url, cluster, 30.0, auth=AUTH),
                         PoolSettings((spec,), **settings), "ns")
        self.actors = actors

    def _lookup(self, worker_id):
        return self.actors.get(worker_id)

    def _named_workers(self) -> dict[str, str]:
        return {worker_id: worker_id.split("-")[0] for worker_id in self.actors}


@pytest.fixture
def cluster(redis_url):
    name = uuid.uuid4().hex
    yield name
    PoolStore(redis_url, name).clear()


async def adopted(manager: PoolManager) -> PoolManager:
    """Adopt, let the fake ready() answers land, observe once."""
    await manager._adopt()
    await asyncio.sleep(0.01)
    await manager.reconcile()
    return manager


def test_an_adopted_worker_older_than_the_start_timeout_is_not_dead(redis_url, cluster):
    """A restarted router adopts a worker started an hour ago whose ready() has not answered
    yet: its start clock starts at adoption, so it is not declared dead (and replaced)."""
    store = PoolStore(redis_url, cluster)
    store.set_target("decode", 1)
    store.save_member(MemberRecord("decode-0", "decode", created_time=time.time() - 3600))

    async def main():
        manager = FakeActorsManager(redis_url, cluster,
                                    {"decode-0": FakeWorker("decode-0", slow_start=True)},
                                    start_timeout_s=600.0)
        await adopted(manager)
        state = manager.members["decode-0"].state
        manager.settings = PoolSettings(manager.settings.templates, start_timeout_s=0.05)
        await asyncio.sleep(0.1)
        await manager._observe()  # a worker that never answers still fails, from adoption
        await manager.stop()
        return state, manager.members["decode-0"].state

    assert asyncio.run(main()) == (STARTING, DEAD)


def test_redis_losing_everything_changes_no_pool_and_is_put_back(redis_url, cluster):
    store, registry = PoolStore(redis_url, cluster), Registry(redis_url, cluster, 30.0,
                                                                   auth=AUTH)
    store.set_target("decode", 1)
    store.save_member(MemberRecord("decode-0", "decode", created_time=1.0))
    store.save_member(MemberRecord("decode-3", "decode", draining=True, created_time=2.0))
    store.count_restart("decode")
    store.client.set(store.prefix + "pool:decode:seq", 4)
    actors = {w: FakeWorker(w) for w in ("decode-0", "decode-3")}

    async def main():
        manager = await adopted(FakeActorsManager(redis_url, cluster, actors))
        before = {w: m.state for w, m in manager.members.items()}
        store.clear()  # FLUSHALL, as far as this cluster can tell
        registry.heartbeat(WorkerRecord("decode-3", "decode", num_running=1))  # re-registers
        await manager.reconcile()
        await manager.stop()
        return manager, before, {w: m.state for w, m in manager.members.items()}

    manager, before, after = asyncio.run(main())
    assert before == after == {"decode-0": READY, "decode-3": DRAINING}
    assert store.targets() == {"decode": 1} and store.restarts()["decode"] == 1
    assert [m.worker_id for m in store.members()] == ["decode-0", "decode-3"]
    assert store.pids() == {("127.0.0.1", 100), ("127.0.0.1", 103)}
    assert registry.workers()[0].draining is True  # its drain mark is back
    assert store.next_worker_id("decode") == "decode-4"  # no live id issued again
    assert manager.health.repairs >= 6


def test_a_manager_adopting_without_redis_state_keeps_the_live_workers(redis_url, cluster):
    """Redis lost the members and targets before the router restarted: the live worker
    actors are adopted by name, their number is the target, ids go on above theirs."""
    actors = {w: FakeWorker(w) for w in ("decode-2", "decode-5")}

    async def main():
        manager = await adopted(FakeActorsManager(redis_url, cluster, actors))
        await manager.stop()
        return manager

    manager = asyncio.run(main())
    assert {w: m.state for w, m in manager.members.items()} == {"decode-2": READY,
                                                                 "decode-5": READY}
    assert manager.targets == {"decode": 2} and manager.next_ids == {"decode": 6}
    store = PoolStore(redis_url, cluster)
    assert store.targets() == {"decode": 2} and store.next_worker_id("decode") == "decode-6"


def test_while_redis_is_away_the_manager_watches_and_changes_nothing():
    server = RedisServer().start()
    try:
        store = PoolStore(server.url, "c")
        store.set_target("decode", 1)
        store.save_member(MemberRecord("decode-0", "decode", created_time=1.0))

        async def main():
            manager = await adopted(FakeActorsManager(server.url, "c",
                                                      {"decode-0": FakeWorker("decode-0")}))
            server.kill()
            await manager.drain("decode-0")  # an operator's drain lands while Redis is away
            await manager.reconcile()
            degraded = manager.health.degraded
            server.start()
            manager.health.ok()  # skip the backoff
            await manager.reconcile()
            await manager.stop()
            return manager, degraded

        manager, degraded = asyncio.run(main())
        assert degraded and not manager.health.degraded
        assert manager.members["decode-0"].state == DRAINING and manager.targets == {"decode": 0}
        assert store.targets() == {"decode": 0}  # put back once Redis answered
        assert store.members()[0].draining is True
    finally:
        server.stop()


def test_forged_drain_marks_are_overwritten_by_the_next_reconcile(redis_url, cluster):
    """Which workers drain is the manager's decision; Redis only mirrors it. A raw
    ``draining=1`` on a serving worker never takes it out of another router's view and is
    cleared by the next reconcile; a raw ``draining=0`` on a worker being drained is marked
    again."""
    store = PoolStore(redis_url, cluster)
    store.set_target("decode", 2)
    for worker_id in ("decode-0", "decode-1"):
        store.save_member(MemberRecord(worker_id, "decode", created_time=1.0))
    actors = {w: FakeWorker(w) for w in ("decode-0", "decode-1")}
    router_view = Registry(redis_url, cluster, 30.0, auth=AUTH)  # another router's registry

    def flags() -> dict[str, bytes]:
        return {w: router_view.client.hget(router_view.prefix + w, "draining")
                for w in ("decode-0", "decode-1")}

    async def main():
        manager = await adopted(FakeActorsManager(redis_url, cluster, actors))
        for worker_id in actors:  # the workers' heartbeats
            router_view.heartbeat(WorkerRecord(worker_id, "decode", num_running=1))
        await manager.drain("decode-1")
        router_view.client.hset(router_view.prefix + "decode-0", "draining", "1")  # forged
        router_view.client.hset(router_view.prefix + "decode-1", "draining", "0")
        before = {r.worker_id: r.draining for r in router_view.workers()}
        await manager.reconcile()
        after = {r.worker_id: r.draining for r in router_view.workers()}
        await manager.stop()
        return manager, before, after

    manager, before, after = asyncio.run(main())
    assert before["decode-0"] is False  # routable while the forged flag sits in Redis
    assert flags() == {"decode-0": b"0", "decode-1": b"1"}
    assert after == {"decode-0": False, "decode-1": True}
    assert {w: m.state for w, m in manager.members.items()} == {"decode-0": READY,
                                                                "decode-1": DRAINING}


def test_a_ping_that_raises_marks_that_worker_dead_and_the_reconcile_goes_on(redis_url,
                                                                          cluster):
    """A worker whose ping raises what no handler names (a RayTaskError from its actor, say)
    is that worker's fault alone: it is marked dead, and the other worker's reconcile still
    happens (the raise used to abort the reconcile of every worker, every period)."""
    store = PoolStore(redis_url, cluster)
    store.set_target("decode", 2)
    for i in range(2):
        store.save_member(MemberRecord(f"decode-{i}", "decode", created_time=float(i)))
    actors = {w: FakeWorker(w) for w in ("decode-0", "decode-1")}

    async def raising() -> dict:
        raise RuntimeError("ping raised inside the actor")

    async def main():
        manager = await adopted(FakeActorsManager(redis_url, cluster, actors))
        actors["decode-0"].ping = Remote(raising)
        await manager._observe()
        states = {w: m.state for w, m in manager.members.items()}
        await manager.stop()
        return states

    assert asyncio.run(main()) == {"decode-0": DEAD, "decode-1": READY}
