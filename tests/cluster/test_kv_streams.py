"""KV event streams on a real redis-server: every reader's index equals the worker's cache, a
reader that starts late or finds its stream trimmed resyncs from a snapshot, and garbage,
forged and oversized entries in a stream are skipped, never applied."""

from __future__ import annotations

import random
import uuid

import redis

from pdserve.cluster.kv_streams import HASH_BYTES, MAX_BATCH_HASHES, MAX_ENTRY_BYTES, KVStreams
from pdserve.cluster.record_auth import RecordAuth
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.kv_cache.events import KVEventLog
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVCapacity, KVIndex
from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST, KV_TIER_POOL, KVEvents
from pdserve.worker_api.sampling_params import SamplingParams

from .conftest import AUTH


def cache_prompts(bm: BlockManager, rng: random.Random, count: int) -> None:
    """``count`` prompts computed and finished: their full blocks stay cached (LRU)."""
    for _ in range(count):
        seq = Sequence(uuid.uuid4().hex, [rng.randrange(1, 50) for _ in range(9)],
                       SamplingParams(max_tokens=2))
        bm.match_prefix(seq)
        bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
        bm.free(seq)


def catch_up(index: KVIndex, streams: KVStreams, bm: BlockManager) -> None:
    for worker_id, events in streams.read(["w"]):
        index.apply(worker_id, events)
    if index.needs_snapshot("w"):
        index.reset("w", bm.events.snapshot())


def test_readers_follow_the_stream_and_resync_what_they_missed(redis_url):
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    bm = BlockManager(12, 4, hash_salt=b"s" * 16)
    bm.events = KVEventLog()
    worker = KVStreams(client, cluster, ttl_ms=60_000, maxlen=3, auth=AUTH)
    rng = random.Random(0)
    early, early_streams = KVIndex(), KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH)
    for _ in range(4):
        cache_prompts(bm, rng, 2)
        worker.publish("w", bm.events.drain())
    catch_up(early, early_streams, bm)
    assert early.held("w") == bm.held_hashes() and early.held("w")
    assert not early.needs_snapshot("w")
    for _ in range(12):  # far more batches than the stream keeps (maxlen 3)
        cache_prompts(bm, rng, 2)
        worker.publish("w", bm.events.drain())
    late, late_streams = KVIndex(), KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH)
    applied = [late.apply(w, e) for w, e in late_streams.read(["w"])]
    assert applied and not applied[0]  # the stream starts past batch 1: a gap
    for index, streams in ((early, early_streams), (late, late_streams)):
        catch_up(index, streams, bm)  # the early reader lost trimmed batches: it resyncs
        assert index.held("w") == bm.held_hashes()
    client.xadd(f"pdserve:{cluster}:kv:w", {"log": "x", "n": "oops"})  # garbage
    cache_prompts(bm, rng, 1)
    worker.publish("w", bm.events.drain())
    got = early_streams.read(["w"])
    assert [e.number for _, e in got] == [17] and early.apply("w", got[0][1])
    assert early.held("w") == bm.held_hashes()
    assert client.pttl(f"pdserve:{cluster}:kv:w") > 0  # a dead worker's stream expires


def test_a_key_of_another_type_reads_as_nothing_and_the_worker_replaces_it(redis_url):
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    client.set(f"pdserve:{cluster}:kv:w", "not a stream")
    reader, worker = (KVStreams(client, cluster, ttl_ms=10_000, auth=AUTH) for _ in range(2))
    assert reader.read(["w", "v"]) == []
    log = KVEventLog()
    log.stored(b"h" * 32)
    worker.publish("w", log.drain())
    assert [(w, e.number, e.stored) for w, e in reader.read(["w"])] == [("w", 1, (b"h" * 32,))]


def test_forged_and_oversized_entries_are_skipped_and_the_index_follows_the_worker(redis_url):
    """Entries the worker did not sign (a wrong tag, none, another cluster's key, another
    worker's entry copied over), one too large to take out of Redis and a signed one with
    too many hashes are skipped and counted, never applied: a forged next batch number does
    not make the index skip the worker's real next batch."""
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    key = f"pdserve:{cluster}:kv:w"
    bm = BlockManager(12, 4, hash_salt=b"s" * 16)
    bm.events = KVEventLog()
    worker = KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH)
    counted = []
    reader = KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH,
                       on_malformed=lambda family, n: counted.append(("malformed", family, n)),
                       on_untrusted=lambda kind, n: counted.append(("untrusted", kind, n)))
    index, rng = KVIndex(), random.Random(1)
    for _ in range(2):
        cache_prompts(bm, rng, 2)
        worker.publish("w", bm.events.drain())
    catch_up(index, reader, bm)
    log_id, following = bm.events.log_id, str(bm.events.number + 1)
    lure = {"log": log_id, "n": following, "s": b"\x01" * HASH_BYTES, "r": b""}
    client.xadd(key, {**lure, "t": "0" * 64})
    client.xadd(key, lure)
    KVStreams(client, cluster, ttl_ms=60_000, auth=RecordAuth("another-cluster-key")).publish(
        "w", KVEvents(log_id, int(following), (b"\x01" * HASH_BYTES,), ()))
    worker.publish("v", KVEvents(log_id, int(following), (b"\x01" * HASH_BYTES,), ()))
    client.xadd(key, client.xrange(f"pdserve:{cluster}:kv:v")[0][1])
    client.xadd(key, {**lure, "s": b"\x02" * (MAX_ENTRY_BYTES + HASH_BYTES)})
    too_many = tuple(i.to_bytes(HASH_BYTES, "big") for i in range(MAX_BATCH_HASHES + 1))
    worker.publish("w", KVEvents(log_id, int(following), too_many, ()))
    cache_prompts(bm, rng, 2)
    real = bm.events.drain()
    worker.publish("w", real)
    got = reader.read(["w"])
    assert [(w, e.number) for w, e in got] == [("w", real.number)]
    assert index.apply("w", got[0][1]) and not index.needs_snapshot("w")
    assert index.held("w") == bm.held_hashes()
    assert sorted(counted) == [("malformed", "kv_event", 2), ("untrusted", "kv_event", 4)]


def test_an_index_holding_more_than_the_worker_s_blocks_goes_stale(redis_url):
    """A worker's cache holds at most its blocks: a batch that would leave more hashes in its
    entry is not its truth, and the entry matches nothing until a snapshot resets it."""
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    streams = KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH)
    hashes = tuple(i.to_bytes(HASH_BYTES, "big") for i in range(13))
    streams.publish("w", KVEvents("log", 1, hashes[:12], ()))
    streams.publish("w", KVEvents("log", 2, hashes[12:], ()))
    index = KVIndex()
    first, second = (events for _, events in streams.read(["w"]))
    assert index.apply("w", first, KVCapacity(12)) and index.held("w") == frozenset(hashes[:12])
    assert not index.apply("w", second, KVCapacity(12))
    assert index.needs_snapshot("w") and index.matched_blocks("w", list(hashes)) == 0


def test_stored_tiers_travel_signed_and_entries_without_them_read_as_pool(redis_url):
    """A batch's tiers come back as the worker sent them; an entry without the tiers field
    (a worker without KV tiers, or one written before them) reads as all pool; an entry whose
    tiers field was removed, added or changed does not verify; one with a tier out of range
    or a tier count that is not one per stored hash is malformed. Each skipped one is
    counted, and the index follows the worker's real batches at their tiers."""
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    key = f"pdserve:{cluster}:kv:w"
    counted = []
    worker = KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH)
    reader = KVStreams(client, cluster, ttl_ms=60_000, auth=AUTH,
                       on_malformed=lambda family, n: counted.append(("malformed", n)),
                       on_untrusted=lambda kind, n: counted.append(("untrusted", n)))
    a, b, c = (bytes([i]) * HASH_BYTES for i in (1, 2, 3))
    tiered = KVEvents("log", 1, (a, b, c), (), (KV_TIER_POOL, KV_TIER_HOST, KV_TIER_DISK))
    worker.publish("w", tiered)
    worker.publish("w", KVEvents("log", 2, (b,), (c,)))  # no tiers: b is back in the pool
    signed = dict(client.xrange(key)[0][1])
    stripped = {k: v for k, v in signed.items() if k != b"k"}
    client.xadd(key, {**stripped, b"n": b"3"})  # its tiers removed (and a new number)
    for bad in (b"\x00\x01\x03", b"\x00\x01"):  # a tier out of range; too few tiers
        client.xadd(key, {**signed, b"k": bad})
    client.xadd(key, {**signed, b"k": b"\x00\x00\x00"})  # changed: the tag breaks
    worker.publish("w", KVEvents("log", 3, (), (a,)))
    got = reader.read(["w"])
    assert [events for _, events in got] == [tiered, KVEvents("log", 2, (b,), (c,)),
                                            KVEvents("log", 3, (), (a,))]
    assert got[1][1].tier_of(0) == KV_TIER_POOL and got[0][1].tier_of(2) == KV_TIER_DISK
    assert sorted(counted) == [("malformed", 2), ("untrusted", 2)]
    index = KVIndex()
    assert all(index.apply(w, events) for w, events in got)
    assert index.held_tiers("w") == {b: KV_TIER_POOL}
