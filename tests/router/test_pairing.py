"""Pairing policy: decode by free blocks plus prefix hits then load, prefill by queued tokens
minus prefix hits."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVIndex
from pdserve.router.pairing import WorkerLoad, chained_block_hashes, rank_decode, rank_prefill
from pdserve.worker_api import KVSnapshot, WorkerStats
from pdserve.worker_api.sampling_params import SamplingParams


def stats(worker_id, role="decode", free=100, running=0, queued=0) -> WorkerStats:
    return WorkerStats(worker_id, role, 128, free, 128 - free, 0, running, 0, queued, 0, 0, 0)


def test_decode_prefers_free_blocks_then_fewer_running():
    loads = [WorkerLoad(stats("a", free=50)), WorkerLoad(stats("b", free=90, running=9)),
             WorkerLoad(stats("c", free=90, running=1))]
    assert [w.stats.worker_id for w, _ in rank_decode(loads)] == ["c", "b", "a"]
    loads[2].sent(blocks=60)  # reservations its stats do not count yet count
    assert rank_decode(loads)[0][0].stats.worker_id == "b"


def test_decode_counts_the_blocks_its_cache_holds_as_room():
    """A decode worker holding the prompt's leading blocks neither allocates nor receives them:
    with the weight 1 they count as free blocks, and the routing says why it won."""
    prompt, salt = list(range(100, 164)) + [1, 2], b"cluster-salt"  # 4 full blocks of 16
    roomy, holder = WorkerLoad(stats("roomy", free=92)), WorkerLoad(stats("holder", free=90))
    index = KVIndex()
    index.reset("holder", KVSnapshot("log", 0,
                                     frozenset(chained_block_hashes(prompt, 16, salt)[:3])))
    [(first, routing), (second, last)] = rank_decode([roomy, holder], prompt, index, salt)
    assert (first, second) == (holder, roomy)
    assert (routing.hit_blocks, routing.room, routing.runner_up, routing.runner_up_room) == \
        (3, 93, "roomy", 92)
    assert last.runner_up is None
    # half weight: 1.5 blocks of room from the hits, not enough against 2 free blocks
    assert rank_decode([roomy, holder], prompt, index, salt, 0.5)[0][0] is roomy
    # no salt (the index cannot be read): free blocks alone
    assert rank_decode([roomy, holder], prompt, index, None)[0][1].hit_blocks == 0


def test_what_a_router_sent_counts_until_stats_taken_after_it_arrive():
    import dataclasses
    import time

    # explicit call times: two time.time() readings in a row can be equal
    now = time.time()
    load = WorkerLoad(dataclasses.replace(stats("d", free=100), taken_at=now))
    load.sent(blocks=10, tokens=100, at=now + 1)
    before = now + 2
    load.sent(blocks=5, tokens=50, at=now + 3)
    assert (load.free_blocks, load.pending_tokens) == (85, 150)
    # the same record read again (a new object, no newer heartbeat) still misses both
    load.refresh(dataclasses.replace(load.stats))
    assert (load.free_blocks, load.pending_tokens) == (85, 150)
    # stats taken between the two calls count the first one (its 10 blocks are in free=90)
    load.refresh(dataclasses.replace(stats("d", free=90), taken_at=before))
    assert (load.free_blocks, load.pending_tokens) == (85, 50)
    load.refresh(dataclasses.replace(stats("d", free=85), taken_at=now + 4))
    assert (load.free_blocks, load.pending_tokens) == (85, 0)
    # stats of unknown age (taken_at 0) count everything sent before them
    load.sent(blocks=3)
    load.refresh(stats("d", free=82))
    assert load.free_blocks == 82


def pick_prefill(*args, **kwargs):
    return rank_prefill(*args, **kwargs)[0]


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


def test_prefill_cost_weights():
    system = list(range(100, 164))  # 4 blocks of 16, cached on "busy"
    salt = b"cluster-salt"
    busy, idle = WorkerLoad(stats("busy", "prefill", queued=40)), \
        WorkerLoad(stats("idle", "prefill", queued=0))
    index = KVIndex()
    index.reset("busy", KVSnapshot("log", 0, frozenset(chained_block_hashes(system, 16, salt))))
    prompt = system + [3, 4]
    # a cached token weighs half a queued one: 40 - 32 > 0
    load, routing = pick_prefill([busy, idle], prompt, 16, index, salt, overlap_weight=0.5)
    assert load is idle and (routing.runner_up, routing.runner_up_cost) == ("busy", 40 - 32)
    assert pick_prefill([busy, idle], prompt, 16, index, salt, overlap_weight=0)[0] is idle
    # busy's KV is 28 of 128 blocks in use (the stats above), idle's half full
    idle.stats.used_blocks = 64
    load, routing = pick_prefill([busy, idle], prompt, 16, index, salt, overlap_weight=0,
                                 kv_usage_weight=200)
    assert load is busy and routing.cost == 40 + 200 * 28 / 128
    assert routing.runner_up_cost == 200 * 64 / 128


def test_prefill_weights_are_checked():
    from pdserve.router.config import RouterConfig

    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="prefix_overlap_weight must be >= 0"):
            RouterConfig(prefix_overlap_weight=bad)
        with pytest.raises(ValueError, match="prefill_kv_usage_weight must be >= 0"):
            RouterConfig(prefill_kv_usage_weight=bad)


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


@pytest.mark.parametrize("block_size", [0, -16, "16", 1.5, True])
def test_a_block_size_that_is_not_a_whole_number_above_zero_is_named(block_size):
    """The registry skips such a record; a ledger that holds one anyway fails with the field
    named, not with a division by zero deep in placement."""
    load = WorkerLoad(stats("d0"))
    load.stats.ledger = {"block_size": block_size}
    with pytest.raises(ValueError, match="d0: ledger block_size"):
        load.blocks_for(100)


def test_a_computed_prompt_leaves_the_pending_tokens_at_once():
    """Tokens the router sent a worker count as queued there until its stats count them,
    unless the prompt's first token came back first (the request may be long finished when
    the next request is placed): then they are no longer queued, its blocks still are."""
    load = WorkerLoad(stats("a", free=50))
    first = load.sent(blocks=2, tokens=7)
    load.sent(blocks=1, tokens=5)
    assert (load.pending_tokens, load.pending_blocks) == (12, 3)
    load.computed(first)
    assert (load.pending_tokens, load.pending_blocks) == (5, 3)
