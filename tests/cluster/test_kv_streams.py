"""KV event streams on a real redis-server: every reader's index equals the worker's cache, a
reader that starts late or finds its stream trimmed resyncs from a snapshot, and garbage in
a stream is skipped, never applied."""

from __future__ import annotations

import random
import uuid

import redis

from pdserve.cluster.kv_streams import KVStreams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVIndex


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
        index.reset("w", bm.events.snapshot(bm.held_hashes()))


def test_readers_follow_the_stream_and_resync_what_they_missed(redis_url):
    client = redis.Redis.from_url(redis_url)
    cluster = uuid.uuid4().hex
    bm = BlockManager(12, 4, hash_salt=b"s" * 16)
    bm.events = KVEventLog()
    worker = KVStreams(client, cluster, ttl_ms=60_000, maxlen=3)
    rng = random.Random(0)
    early, early_streams = KVIndex(), KVStreams(client, cluster, ttl_ms=60_000)
    for _ in range(4):
        cache_prompts(bm, rng, 2)
        worker.publish("w", bm.events.drain())
    catch_up(early, early_streams, bm)
    assert early.held("w") == bm.held_hashes() and early.held("w")
    assert not early.needs_snapshot("w")
    for _ in range(12):  # far more batches than the stream keeps (maxlen 3)
        cache_prompts(bm, rng, 2)
        worker.publish("w", bm.events.drain())
    late, late_streams = KVIndex(), KVStreams(client, cluster, ttl_ms=60_000)
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
    reader, worker = (KVStreams(client, cluster, ttl_ms=10_000) for _ in range(2))
    assert reader.read(["w", "v"]) == []
    log = KVEventLog()
    log.stored(b"h" * 32)
    worker.publish("w", log.drain())
    assert [(w, e.number, e.stored) for w, e in reader.read(["w"])] == [("w", 1, (b"h" * 32,))]
