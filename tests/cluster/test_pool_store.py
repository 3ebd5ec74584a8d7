"""Pool state in a real redis-server: targets, fresh ids, restarts, members, router ports."""

from __future__ import annotations

import uuid

import pytest

from pdserve.cluster.pools.store import MemberRecord, PoolStore
from pdserve.cluster.registry import Registry, WorkerRecord

from .conftest import AUTH


@pytest.fixture
def store(redis_url):
    store = PoolStore(redis_url, uuid.uuid4().hex)
    yield store
    store.clear()
    store.close()


def test_targets_survive_a_new_store(store, redis_url):
    assert store.targets() == {}
    store.set_target("decode", 2)
    store.set_target("prefill", 1)
    again = PoolStore(redis_url, store.prefix.split(":")[1])  # a restarted router
    assert again.targets() == {"prefill": 1, "decode": 2}
    again.set_target("prefill", 0)
    assert store.targets() == {"prefill": 0, "decode": 2}


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
    registry = Registry(redis_url, store.prefix.split(":")[1], auth=AUTH)
    registry.heartbeat(WorkerRecord("decode-0", "decode"))
    store.clear()
    assert registry.workers() == [] and store.targets() == {} and store.pids() == set()


def test_malformed_values_read_as_missing_and_are_counted(redis_url):
    counted = []
    store = PoolStore(redis_url, uuid.uuid4().hex, lambda family, n: counted.append((family, n)))
    try:
        store.set_target("decode", 2)
        store.client.set(store.prefix + "pool:prefill:target", "garbage")
        store.client.set(store.prefix + "pool:decode:restarts", "-3")
        assert store.targets() == {"decode": 2}
        assert store.restarts() == {"prefill": 0, "decode": 0, "colocated": 0}
        store.save_member(MemberRecord("decode-0", "decode", created_time=1.0))
        store.client.hset(store.prefix + "members", "decode-1", "{not json")
        store.client.hset(store.prefix + "members", "decode-2", '{"worker_id": "decode-2"}')
        store.client.hset(store.prefix + "members", "decode-3", "[" * 100_000)  # too deep
        assert [m.worker_id for m in store.members()] == ["decode-0"]
        store.client.sadd(store.prefix + "pids", "127.0.0.1:12", "junk", "h:-1")
        assert store.pids() == {("127.0.0.1", 12)}
        store.client.hset(store.prefix + "router", mapping={"port": "abc", "metrics_port": "9"})
        assert store.router_ports() == (None, 9)
        assert counted == [("target", 1), ("restarts", 1), ("members", 3), ("pids", 2),
                           ("router", 1)]
    finally:
        store.clear()
        store.close()


def test_ids_and_restarts_never_go_below_the_floor_redis_lost(store):
    """After Redis lost the counter (or holds garbage), ids start at the manager's floor, so
    no live worker's id is issued again."""
    assert store.next_worker_id("decode") == "decode-0"
    store.client.delete(store.prefix + "pool:decode:seq")  # Redis restarted empty
    assert store.next_worker_id("decode", floor=3) == "decode-3"
    assert store.next_worker_id("decode", floor=3) == "decode-4"  # Redis ahead: it wins
    store.client.set(store.prefix + "pool:decode:seq", "garbage")
    assert store.next_worker_id("decode", floor=5) == "decode-5"
    store.client.hset(store.prefix + "pool:prefill:seq", "a", "hash")  # another type
    assert store.next_worker_id("prefill", floor=1) == "prefill-1"
    assert store.count_restart("decode", floor=4) == 5


def test_republish_puts_back_what_redis_lost_and_drops_garbage(store):
    from pdserve.cluster.pools.store import PoolState

    members = [MemberRecord("decode-0", "decode", created_time=1.0, pid=11,
                            node_ip="127.0.0.1"),
               MemberRecord("decode-2", "decode", draining=True, created_time=2.0)]
    state = PoolState({"decode": 2, "prefill": 0}, {"decode": 1}, {"decode": 3}, members)
    assert sorted(store.republish(state)) == sorted(
        ["target", "target", "restarts", "seq", "members", "members", "pids"])
    assert store.republish(state) == []  # all there now
    assert store.targets() == {"decode": 2, "prefill": 0} and store.restarts()["decode"] == 1
    assert store.members() == members and store.pids() == {("127.0.0.1", 11)}
    assert store.next_worker_id("decode") == "decode-3"
    store.client.set(store.prefix + "pool:decode:target", "garbage")
    store.client.hset(store.prefix + "members", "decode-9", "{bad")
    store.client.hset(store.prefix + "members", "decode-7", MemberRecord(
        "decode-7", "decode").to_json())  # a member the manager no longer has
    store.client.sadd(store.prefix + "pids", "junk")
    assert sorted(store.republish(state)) == ["members", "members", "pids", "target"]
    assert store.members() == members and store.targets()["decode"] == 2
    store.client.set(store.prefix + "members", "a string")  # the whole hash replaced
    store.republish(state)
    assert store.members() == members


def test_ensure_router_rewrites_only_what_differs(store):
    assert store.ensure_router(50051, None) is True
    assert store.ensure_router(50051, None) is False
    store.client.set(store.prefix + "router", "garbage")
    assert store.router_ports() == (None, None)
    assert store.ensure_router(50051, 9400) is True and store.router_ports() == (50051, 9400)
