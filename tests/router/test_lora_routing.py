"""LoRA-aware pairing (pure functions over WorkerStats): a request under an adapter goes where
the adapter is resident unless that worker is much busier, host memory beats a file read,
a free slot beats a full one; its prompt's blocks hash under the adapter's root."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.engine.kv_cache.prefix_hash import adapter_root_hash
from pdserve.router.kv_index import KVIndex
from pdserve.router.pairing import (
    DEFAULT_DISK_READ_S,
    DEFAULT_SLOT_LOAD_S,
    DEFAULT_TOKEN_S,
    FULL_SLOTS_WAIT_S,
    LoadTimes,
    WorkerLoad,
    adapter_cost,
    chained_block_hashes,
    pool_load_times,
    prefill_location,
    rank_decode,
    rank_prefill,
)
from pdserve.worker_api import KVSnapshot, WorkerStats

A, B, C = "a" * 64, "b" * 64, "c" * 64  # adapter digests
SALT = b"cluster-salt"
TOKEN_S = 1e-3  # prefill seconds per prompt token, as the router measured it


def lora(worker_id: str, role: str = "colocated", *, queued: int = 0, free: int = 100,
         running: int = 0, slots: int = 4, resident=(), host=(), **counters) -> WorkerLoad:
    stats = WorkerStats(worker_id, role, 128, free, 128 - free, 0, running, 0, queued, 0, 0, 0,
                        lora_slots=slots, lora_resident=tuple(resident),
                        lora_in_host=tuple(host), **counters)
    return WorkerLoad(stats)


def order(ranked) -> list[str]:
    return [w.stats.worker_id for w, _ in ranked]


def prefill_order(loads, adapter, prompt=(), index=None, **kwargs) -> list[str]:
    return order(rank_prefill(loads, list(prompt), 16, index or KVIndex(), SALT,
                              adapter=adapter, token_s=TOKEN_S, **kwargs))


def test_the_worker_holding_the_adapter_wins_at_equal_load():
    holder, other = lora("w1", resident=[B, A]), lora("w0", resident=[B])
    assert prefill_order([other, holder], A) == ["w1", "w0"]  # (w0 first by id otherwise)
    assert prefill_order([other, holder], None) == ["w0", "w1"]  # the base model: no term
    assert order(rank_decode([other, holder], adapter=A, token_s=TOKEN_S)) == ["w1", "w0"]
    [(_, routing), (_, runner_up)] = rank_prefill([other, holder], [], 16, KVIndex(), SALT,
                                                  adapter=A, token_s=TOKEN_S)
    assert routing.adapter.source == "resident" and not routing.adapter.loads
    assert runner_up.adapter.source == "disk" and runner_up.adapter.loads
    # the cost is the load time in prompt tokens of prefill
    load_s = DEFAULT_DISK_READ_S + DEFAULT_SLOT_LOAD_S
    assert (routing.cost, routing.runner_up_cost) == (0, pytest.approx(load_s / TOKEN_S))


def test_a_much_busier_holder_loses_and_a_little_busier_one_wins():
    load_tokens = (DEFAULT_DISK_READ_S + DEFAULT_SLOT_LOAD_S) / TOKEN_S  # 55 tokens
    idle = lora("idle")
    assert prefill_order([idle, lora("holder", resident=[A], queued=40)], A)[0] == "holder"
    assert prefill_order([idle, lora("holder", resident=[A], queued=500)], A)[0] == "idle"
    assert load_tokens < 500
    # decode: in blocks of prompt prefill (55 tokens: 3.4 blocks of 16)
    assert order(rank_decode([lora("roomy", free=102), lora("holder", free=100, resident=[A])],
                             adapter=A, token_s=TOKEN_S))[0] == "holder"
    assert order(rank_decode([lora("roomy", free=110), lora("holder", free=100, resident=[A])],
                             adapter=A, token_s=TOKEN_S))[0] == "roomy"


def test_host_memory_beats_a_file_read():
    disk, host = lora("w0"), lora("w1", host=[A])
    assert prefill_order([disk, host], A) == ["w1", "w0"]
    assert adapter_cost(host, A).source == "host"
    assert adapter_cost(host, A).seconds == DEFAULT_SLOT_LOAD_S
    assert adapter_cost(disk, A).seconds == DEFAULT_DISK_READ_S + DEFAULT_SLOT_LOAD_S
    # before any prefill was measured, DEFAULT_TOKEN_S turns seconds into tokens
    [(_, routing), _] = rank_prefill([disk, host], [], 16, KVIndex(), SALT, adapter=A)
    assert routing.cost == pytest.approx(DEFAULT_SLOT_LOAD_S / DEFAULT_TOKEN_S)


def test_load_times_are_the_pools_measured_means():
    """One mean for the pool: the first worker to load an adapter does not look cheaper to
    load the next one (its measured times against the defaults), which would pile every
    adapter onto it; nor does one noisy sample steer the choice."""
    measured = lora("w0", resident=[B], lora_disk_reads=1, lora_disk_read_s=0.01,
                    lora_slot_loads=1, lora_slot_load_s=0.002)
    fresh = lora("w1")
    assert pool_load_times([fresh]) == LoadTimes(DEFAULT_DISK_READ_S, DEFAULT_SLOT_LOAD_S)
    assert pool_load_times([measured, fresh]) == LoadTimes(0.01, 0.002)
    [(_, first), (_, second)] = rank_prefill([measured, fresh], [], 16, KVIndex(), SALT,
                                             adapter=A, token_s=TOKEN_S)
    assert first.cost == second.cost == pytest.approx(12)  # a tie, on ids: w0 first
    # the means over every load: a slow slot load of one worker raises the pool's
    slow = lora("slow", host=[A], lora_slot_loads=2, lora_slot_load_s=0.3)
    fast = lora("fast", lora_disk_reads=4, lora_disk_read_s=0.04, lora_slot_loads=4,
                lora_slot_load_s=0.02)
    times = pool_load_times([slow, fast])
    assert times == LoadTimes(0.01, pytest.approx(0.32 / 6))
    assert adapter_cost(fast, A, times).seconds == pytest.approx(0.01 + 0.32 / 6)
    assert prefill_order([slow, fast], A) == ["slow", "fast"]  # host still beats disk


def test_a_free_slot_beats_slots_that_all_hold_other_adapters():
    full = lora("w0", slots=2, resident=[B, C], host=[A], running=3)
    free = lora("w1", slots=2, resident=[B], host=[A], running=3)
    # full: the evicted adapter's next load, and a wait for a slot its requests may pin
    assert adapter_cost(full, A).seconds == pytest.approx(2 * DEFAULT_SLOT_LOAD_S
                                                          + FULL_SLOTS_WAIT_S)
    assert adapter_cost(free, A).seconds == DEFAULT_SLOT_LOAD_S
    assert prefill_order([full, free], A) == ["w1", "w0"]
    # full but idle: nothing pins its slots, but the eviction still counts
    idle_full = lora("w0", slots=2, resident=[B, C], host=[A])
    assert adapter_cost(idle_full, A).seconds == 2 * DEFAULT_SLOT_LOAD_S
    assert prefill_order([idle_full, lora("w1", slots=2, resident=[B], host=[A])], A) == \
        ["w1", "w0"]


def test_a_worker_without_adapter_slots_ranks_last():
    plain, served = lora("w0", slots=0), lora("w1", queued=10_000)
    assert adapter_cost(plain, A).source == "unserved"
    assert adapter_cost(plain, A).seconds == math.inf
    assert prefill_order([plain, served], A) == ["w1", "w0"]
    assert order(rank_decode([plain, served], adapter=A)) == ["w1", "w0"]
    assert prefill_order([plain, served], None) == ["w0", "w1"]  # the base model runs anywhere


def test_what_this_router_sent_counts_as_resident_until_the_stats_say():
    """A burst for one adapter sticks to the worker the first request went to instead of
    loading the adapter everywhere before the stats show where it is."""
    w0, w1 = lora("w0"), lora("w1")
    assert prefill_order([w0, w1], A)[0] == "w0"
    w0.sent(tokens=10, at=5.0, adapter=A)
    assert adapter_cost(w0, A).source == "sent" and not adapter_cost(w0, A).loads
    assert prefill_order([w0, w1], A)[0] == "w0" and prefill_order([w1, w0], B)[0] == "w1"
    w0.refresh(dataclasses.replace(w0.stats, taken_at=6.0, lora_resident=(A,)))
    assert adapter_cost(w0, A).source == "resident" and not w0.pending_adapters


def test_the_prompt_hashes_under_the_adapters_root():
    """The KV index holds a worker's blocks under the adapter that computed them: a prompt
    under adapter A matches A's blocks only, not the base model's or B's."""
    prompt = list(range(100, 164)) + [1]  # 4 full blocks of 16
    index = KVIndex()
    index.reset("base", KVSnapshot("l0", 0, frozenset(chained_block_hashes(prompt, 16, SALT))))
    index.reset("under_a", KVSnapshot("l1", 0, frozenset(chained_block_hashes(
        prompt, 16, SALT, root=adapter_root_hash(A)))))
    loads = [lora("base", resident=[A]), lora("under_a", resident=[A])]
    hits = {w.stats.worker_id: r.hit_blocks
            for w, r in rank_prefill(loads, prompt, 16, index, SALT, adapter=A)}
    assert hits == {"base": 0, "under_a": 4}
    hits = {w.stats.worker_id: r.hit_blocks for w, r in rank_prefill(loads, prompt, 16, index,
                                                                      SALT)}
    assert hits == {"base": 4, "under_a": 0}
    assert {r.worker_id: r.hit_blocks for _, r in rank_decode(loads, prompt, index, SALT,
                                                              adapter=B)} == \
        {"base": 0, "under_a": 0}


def test_a_local_prefill_pays_the_decode_workers_adapter_load():
    decode = lora("d", "decode")
    best = rank_prefill([lora("p", "prefill", resident=[A])], [], 16, KVIndex(), SALT,
                        adapter=A)[0][1]
    assert prefill_location(1024, 100, decode, best, 7, 2.0).location == "local"
    got = prefill_location(1024, 100, decode, best, 7, 2.0, decode_adapter_tokens=50.0)
    assert got.location == "remote" and got.local_cost == 150
