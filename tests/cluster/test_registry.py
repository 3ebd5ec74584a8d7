"""The Redis registry against a real redis-server child."""

from __future__ import annotations

import dataclasses
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.control_plane import ControlPlaneHealth
from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.registry import MAX_RECORD_BYTES, Registry, WorkerRecord
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import WorkerLoad, rank_decode
from pdserve.testing.waits import wait_for

from .conftest import AUTH


def test_heartbeat_roundtrip_and_roles(redis_url):
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    reg.heartbeat(WorkerRecord("p0", "prefill", queued_tokens=12))
    reg.heartbeat(WorkerRecord("d0", "decode", "127.0.0.1:5000", total_blocks=64, free_blocks=60))
    decode = reg.workers("decode")
    assert [r.worker_id for r in decode] == ["d0"]
    assert decode[0].transfer_address == "127.0.0.1:5000" and decode[0].free_blocks == 60
    assert decode[0].draining is False and decode[0].heartbeat_time > 0
    assert {r.worker_id for r in reg.workers()} == {"p0", "d0"}
    reg.set_draining("d0")
    assert reg.workers("decode")[0].draining is True


def test_record_expires_without_heartbeat(redis_url):
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, ttl_s=0.2, auth=AUTH)
    reg.heartbeat(WorkerRecord("d1", "decode"))
    assert len(reg.workers()) == 1
    wait_for(lambda: reg.workers() == [], 10, "the record to expire")


def test_redis_child_stops_cleanly():
    server = RedisServer().start()
    pid = server.process.pid
    server.stop()
    import os

    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_stats_roundtrip_through_redis(redis_url):
    from pdserve.worker_api import WorkerStats

    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    stats = WorkerStats("d2", "decode", 64, 50, 10, 4, 2, 1, 12, 3, 40, 100,
                        {"weight_bytes": 1024, "kv_dtype": "float32"}, "127.0.0.1:7", False,
                        taken_at=1765000000.25, kv_log_id="log", kv_events_number=9)
    reg.heartbeat(WorkerRecord.from_stats(stats, pid=42))
    [record] = reg.workers()
    assert record.pid == 42 and record.heartbeat_time > 0
    assert record.to_stats() == stats


def test_every_stats_field_survives_the_registry(redis_url):
    """A WorkerStats field the record forgets is silently zero for the router and its metrics
    (it happened to the speculative-decoding counters): every field gets a non-default value."""
    import dataclasses

    from pdserve.worker_api import WorkerStats

    values = {}
    for i, f in enumerate(dataclasses.fields(WorkerStats)):
        kind = {"int": 100 + i, "float": 0.5 + i, "bool": True, "dict": {"kv_dtype": "int8"},
                "tuple[str,": (f"{i:064x}",), "dict[str,": {"sql": i}}
        values[f.name] = kind.get(str(f.type).split(" ")[0], f"value-{i}")
    stats = WorkerStats(**values)
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    reg.heartbeat(WorkerRecord.from_stats(stats, pid=7))
    [record] = reg.workers()
    assert record.to_stats() == stats


def test_heartbeat_never_overwrites_draining(redis_url):
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    reg.heartbeat(WorkerRecord("p1", "prefill"))
    reg.set_draining("p1")
    reg.heartbeat(WorkerRecord("p1", "prefill", queued_tokens=5))
    [record] = reg.workers()
    assert record.draining is True and record.queued_tokens == 5
    reg.set_draining("p1", False)
    reg.heartbeat(WorkerRecord("p1", "prefill"))
    assert reg.workers()[0].draining is False


def test_set_draining_on_an_expired_record_writes_nothing(redis_url):
    """A drain mark on a record that expired must not recreate it as a hash of one field
    without a TTL (which no reader could parse and nothing would ever remove)."""
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH)
    assert reg.set_draining("gone") is False
    assert reg.client.exists(reg.prefix + "gone") == 0
    reg.heartbeat(WorkerRecord("d3", "decode"))
    assert reg.set_draining("d3") is True
    assert reg.client.pttl(reg.prefix + "d3") > 0  # the mark kept the record's TTL


def test_a_heartbeat_replaces_garbage_and_always_leaves_a_ttl(redis_url):
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, ttl_s=30, auth=AUTH)
    key = reg.prefix + "d4"
    reg.client.set(key, "garbage")  # a key of another type
    reg.heartbeat(WorkerRecord("d4", "decode", free_blocks=7))
    [record] = reg.workers()
    assert record.free_blocks == 7 and 0 < reg.client.pttl(key) <= 30_000
    reg.client.hset(key, "draining", "garbage")  # a flag no reader can parse
    reg.heartbeat(WorkerRecord("d4", "decode"))
    assert reg.workers()[0].draining is False
    reg.set_draining("d4")
    reg.heartbeat(WorkerRecord("d4", "decode"))
    assert reg.workers()[0].draining is True  # a valid mark is never overwritten


def test_readers_skip_count_and_expire_malformed_records(redis_url):
    counted = []
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, ttl_s=30,
                   on_malformed=lambda family, n: counted.append((family, n)), auth=AUTH)
    reg.heartbeat(WorkerRecord("good", "decode"))
    client, prefix = reg.client, reg.prefix
    client.hset(prefix + "bad-int", mapping={"worker_id": "bad-int", "role": "decode",
                                             "total_blocks": "many"})
    client.hset(prefix + "no-role", mapping={"worker_id": "no-role"})
    client.hset(prefix + "elsewhere", mapping={"worker_id": "other", "role": "decode"})
    client.hset(prefix + "bad-ledger", mapping={"worker_id": "bad-ledger", "role": "decode",
                                                "ledger_json": "[1, 2"})
    client.set(prefix + "a-string", "garbage")
    assert [r.worker_id for r in reg.workers()] == ["good"]
    assert counted == [("worker", 5)]
    for name in ("bad-int", "no-role", "elsewhere", "bad-ledger", "a-string"):
        assert 0 < client.pttl(prefix + name) <= 30_000  # garbage leaves by itself


def test_a_record_whose_tag_does_not_verify_is_skipped_and_counted(redis_url):
    """A record changed in Redis, written under another cluster's key, copied under another
    worker's key or written raw is not the worker's: skipped (the worker unknown), counted
    in pdserve_untrusted_records_total{kind="worker"}; its worker's next heartbeat puts it
    back."""
    metrics = RouterMetrics()
    health = ControlPlaneHealth(metrics)
    cluster = uuid.uuid4().hex
    reg = Registry(redis_url, cluster, 30, health.count_malformed, health.count_untrusted,
                   auth=AUTH)
    stranger = Registry(redis_url, cluster, 30, auth=RecordAuth("another-cluster-key"))
    for worker_id in ("good", "changed", "copied"):
        reg.heartbeat(WorkerRecord(worker_id, "decode", total_blocks=64, free_blocks=8))
    reg.client.hset(reg.prefix + "changed", "free_blocks", "64")  # lure every request
    reg.client.hset(reg.prefix + "copied",
                    mapping={**reg.client.hgetall(reg.prefix + "good"), b"worker_id": "copied"})
    stranger.heartbeat(WorkerRecord("foreign", "decode", total_blocks=64, free_blocks=64))
    raw = WorkerRecord("raw", "decode", total_blocks=64, free_blocks=64).to_hash()
    reg.client.hset(reg.prefix + "raw", mapping=raw)
    assert [r.worker_id for r in reg.workers()] == ["good"]
    assert health.untrusted == 4 and health.malformed == 0
    assert metrics.registry.get_sample_value("pdserve_untrusted_records_total",
                                             {"kind": "worker"}) == 4
    assert 0 < reg.client.pttl(reg.prefix + "raw") <= 30_000  # garbage leaves by itself
    reg.heartbeat(WorkerRecord("changed", "decode", total_blocks=64, free_blocks=8))
    assert {r.worker_id: r.free_blocks for r in reg.workers()}["changed"] == 8


def test_a_record_out_of_bounds_is_skipped_and_never_reaches_placement(redis_url):
    """Signed records that break a bound (block_size 0: the router divides by it; a negative
    count; a record too large to read) are skipped as malformed: the worker is unknown and
    placement over the rest runs."""
    counted = []
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH,
                   on_malformed=lambda family, n: counted.append((family, n)))
    reg.heartbeat(WorkerRecord("good", "decode", total_blocks=64, free_blocks=8,
                               ledger_json='{"block_size": 4}'))
    reg.heartbeat(WorkerRecord("zero-block", "decode", total_blocks=64, free_blocks=64,
                               ledger_json='{"block_size": 0}'))
    reg.heartbeat(WorkerRecord("negative", "decode", total_blocks=-1, free_blocks=64))
    reg.heartbeat(WorkerRecord("huge", "decode", error="x" * (2 * MAX_RECORD_BYTES)))
    records = reg.workers()
    assert [r.worker_id for r in records] == ["good"] and counted == [("worker", 3)]
    loads = [WorkerLoad(r.to_stats()) for r in records]
    [(best, routing)] = rank_decode(loads, list(range(32)), KVIndex(), b"s" * 16)
    assert routing.worker_id == "good"


def test_a_drain_mark_whose_tag_does_not_verify_reads_as_not_draining(redis_url):
    """``draining`` is the pool manager's, signed: a raw HSET of it, a mark for 0 with the tag
    of 1, or another worker's mark copied over does not take a worker out of routing; each
    is counted (kind "draining")."""
    counted = []
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH,
                   on_untrusted=lambda kind, n: counted.append((kind, n)))
    reg.heartbeat(WorkerRecord("d0", "decode"))
    reg.heartbeat(WorkerRecord("d1", "decode"))
    key0, key1 = reg.prefix + "d0", reg.prefix + "d1"
    reg.client.hset(key0, "draining", "1")
    assert [r.draining for r in reg.workers()] == [False, False]
    assert reg.workers()[0].draining_tag == ""  # no valid mark: the pool manager writes one
    reg.set_draining("d1")
    reg.client.hset(key0, mapping={"draining": "1",
                                   "draining_tag": reg.client.hget(key1, "draining_tag")})
    assert [r.draining for r in reg.workers()] == [False, True]
    reg.client.hset(key1, "draining", "0")  # keeps the tag of 1
    assert [r.draining for r in reg.workers()] == [False, False]
    assert counted == [("draining", 1)] * 5  # at each read, per record


@settings(max_examples=200, deadline=None)
@given(values=st.dictionaries(
    st.sampled_from([f.name for f in dataclasses.fields(WorkerRecord)]) | st.text(max_size=16),
    st.binary(max_size=16) | st.text(max_size=16).map(str.encode), max_size=8),
    ledger=st.binary(max_size=16) | st.integers(1, 5000).map(lambda depth: b"[" * depth))
def test_a_hash_that_is_not_a_record_is_a_value_error(values, ledger):
    """Whatever a hash holds, reading it is a record or a ValueError (the readers skip and
    count those), never another error that would stop a read of every record."""
    base = WorkerRecord("w", "decode").to_hash()
    raw = {k.encode(): v.encode() for k, v in base.items()}
    raw.update({k.encode(): v for k, v in values.items()})
    raw[b"ledger_json"] = ledger
    try:
        WorkerRecord.from_hash(raw)
    except ValueError:
        pass


def test_a_ledger_nested_too_deep_is_skipped_as_malformed(redis_url):
    """json.loads raises RecursionError, not ValueError, for a deep enough nesting: one raw
    write to Redis would stop every reader's read of the registry."""
    counted = []
    reg = Registry(redis_url, cluster=uuid.uuid4().hex, auth=AUTH,
                   on_malformed=lambda family, n: counted.append((family, n)))
    reg.heartbeat(WorkerRecord("good", "decode"))
    reg.client.hset(reg.prefix + "deep", mapping={"worker_id": "deep", "role": "decode",
                                                  "ledger_json": "[" * 50_000})
    assert [r.worker_id for r in reg.workers()] == ["good"] and counted == [("worker", 1)]
    reg.close()
