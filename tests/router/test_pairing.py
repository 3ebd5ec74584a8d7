"""Pairing policy: decode by free blocks then load, prefill by queued tokens minus prefix hits."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.protocol import KVSnapshot, WorkerStats
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVIndex
from pdserve.router.pairing import WorkerLoad, chained_block_hashes, pick_prefill, rank_decode


def stats(worker_id, role="decode", free=100, running=0, queued=0) -> WorkerStats:
    return WorkerStats(worker_id, role, 128, free, 128 - free, 0, running, 0, queued, 0, 0, 0)


def test_decode_prefers_free_blocks_then_fewer_running():
    loads = [WorkerLoad(stats("a", free=50)), WorkerLoad(stats("b", free=90, running=9)),
             WorkerLoad(stats("c", free=90, running=1))]
    assert [w.stats.worker_id for w in rank_decode(loads)] == ["c", "b", "a"]
    loads[2].pending_blocks = 60  # reservations made since the last refresh count
    assert rank_decode(loads)[0].stats.worker_id == "b"


def test_prefill_prefers_short_queue_unless_the_index_says_the_prefix_is_cached():
    system = list(range(100, 164))  # 4 blocks of 16
    salt = b"cluster-salt"
    busy, idle = WorkerLoad(stats("busy", "prefill", queued=40)), \
        WorkerLoad(stats("idle", "prefill", queued=0))
    index = KVIndex()
    load, routing = pick_prefill([busy, idle], system + [1, 2], 16, index, salt)
    assert (load, routing.hit_blocks, routing.runner_up) == (idle, 0, "busy")
    index.reset("busy", KVSnapshot("log", 0, frozenset(chained_block_hashes(system, 16, salt))))
    load, routing = pick_prefill([busy, idle], system + [3, 4], 16, index, salt)
    assert load is busy and routing.hit_blocks == 4  # 64 cached tokens outweigh 40
    assert (routing.cost, routing.runner_up, routing.runner_up_cost) == (40 - 64, "idle", 0)
    # without the cluster's salt the router cannot read the index: the queues alone choose
    assert pick_prefill([busy, idle], system + [3, 4], 16, index, None)[0] is idle
    assert pick_prefill([busy], system, 16, index, salt)[1].runner_up is None


def test_router_hashes_match_the_prefix_cache():
    bm = BlockManager(16, 4, hash_salt=b"cluster-salt")
    seq = Sequence("s", list(range(10, 22)), SamplingParams())
    bm.allocate(seq, 12)
    seq.num_computed_tokens = 12
    bm.cache_computed_blocks(seq)
    cached = [bm.block_hash(b) for b in seq.block_table]
    assert chained_block_hashes(list(range(10, 22)), 4, b"cluster-salt") == cached
    assert all(len(h) == 32 for h in cached)  # sha256 digests
    assert chained_block_hashes(list(range(10, 22)), 4, b"other-salt") != cached
