"""Pool state in a real redis-server: targets, fresh ids, restarts, members, router ports."""

from __future__ import annotations

import uuid

import pytest

from pdserve.cluster.pool_store import MemberRecord, PoolStore
from pdserve.cluster.registry import Registry, WorkerRecord


@pytest.fixture
def store(redis_url):
    store = PoolStore(redis_url, uuid.uuid4().hex)
    yield store
    store.clear()
    store.close()


def test_targets_survive_a_new_store_and_never_go_below_zero(store, redis_url):
    assert store.targets() == {}
    store.set_target("decode", 2)
    store.set_target("prefill", 1)
    again = PoolStore(redis_url, store.prefix.split(":")[1])  # a restarted router
    assert again.targets() == {"prefill": 1, "decode": 2}
    assert again.add_target("decode", -1) == 1
    assert again.add_target("prefill", -5) == 0
    assert store.targets() == {"prefill": 0, "decode": 1}


@pytest.mark.parametrize("role, size, field", [("decoder", 1, "role"), ("decode", -1, "size"),
                                               ("decode", 1.5, "size")])
def test_bad_targets_name_the_field(store, role, size, field):
    with pytest.raises(ValueError, match=field):
        store.set_target(role, size)


def test_worker_ids_are_fresh_per_role_and_restarts_count(store):
    assert [store.next_worker_id("decode") for _ in range(3)] == ["decode-0", "decode-1",
                                                                   "decode-2"]
    assert store.next_worker_id("prefill") == "prefill-0"
    assert store.restarts() == {"prefill": 0, "decode": 0, "colocated": 0}
    store.count_restart("decode")
    assert store.count_restart("decode") == 2
    assert store.restarts()["decode"] == 2


def test_members_roundtrip_in_start_order(store):
    store.save_member(MemberRecord("decode-1", "decode", created_time=2.0))
    store.save_member(MemberRecord("decode-0", "decode", restarts=1, created_time=1.0))
    store.save_member(MemberRecord("decode-1", "decode", draining=True, created_time=2.0,
                                   pid=42, node_ip="10.0.0.2"))
    members = store.members()
    assert [m.worker_id for m in members] == ["decode-0", "decode-1"]
    assert members[0].restarts == 1
    assert members[1].draining is True and members[1].pid == 42
    store.remove_member("decode-0")
    assert [m.worker_id for m in store.members()] == ["decode-1"]


def test_pids_router_ports_and_clear(store, redis_url):
    store.add_pid("127.0.0.1", 1234)
    store.add_pid("127.0.0.1", 1234)
    assert store.pids() == {("127.0.0.1", 1234)}
    assert store.router_ports() == (None, None)
    store.save_router(50051, None)
    assert store.router_ports() == (50051, None)
    store.save_router(40000, 9400)
    assert store.router_ports() == (40000, 9400)
    registry = Registry(redis_url, store.prefix.split(":")[1])
    registry.heartbeat(WorkerRecord("decode-0", "decode"))
    store.clear()
    assert registry.workers() == [] and store.targets() == {} and store.pids() == set()
