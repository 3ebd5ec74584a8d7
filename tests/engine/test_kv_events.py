"""KV events: an index fed by the workers' event batches holds exactly what each worker's
prefix cache holds, through random admissions (under the base model and two LoRA adapters),
evictions, lost batches (resynced from a snapshot) and a worker replaced under the same id;
and the router, hashing a prompt under its adapter's root, matches what the worker would."""

from __future__ import annotations

import random

from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.kv_cache.events import KVEventLog
from pdserve.engine.kv_cache.prefix_hash import adapter_root_hash, chained_block_hashes
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVIndex
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams

SALT = b"0123456789abcdef"
ADAPTERS = (None, AdapterRef("sql", "/adapters/sql", "5" * 64),
            AdapterRef("chat", "/adapters/chat", "c" * 64))  # None: the base model


def worker() -> BlockManager:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_salt=SALT)
    bm.events = KVEventLog()
    return bm


class Traffic:
    """Requests over a few shared prefixes through one block manager, as an engine runs them:
    admitted on their cached prefix, computed, hashed, finished."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.prefixes = [[rng.randrange(1, 50) for _ in range(8)] for _ in range(4)]
        self.live: list[Sequence] = []
        self.count = 0

    def step(self, bm: BlockManager) -> None:
        rng = self.rng
        if self.live and (rng.random() < 0.4 or bm.num_allocatable_blocks < 4):
            seq = self.live.pop(rng.randrange(len(self.live)))
            bm.free(seq)
            return
        self.count += 1
        prompt = rng.choice(self.prefixes) + [rng.randrange(1, 50)
                                              for _ in range(rng.randrange(1, 7))]
        seq = Sequence(f"r{self.count}", prompt, SamplingParams(max_tokens=4),
                       adapter=rng.choice(ADAPTERS))
        bm.match_prefix(seq)
        remaining = seq.num_tokens - seq.num_computed_tokens
        if not bm.can_allocate(seq, remaining):
            bm.free(seq)
            return
        bm.allocate(seq, remaining)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
        self.live.append(seq)


def sync(index: KVIndex, worker_id: str, bm: BlockManager, lose: bool = False) -> None:
    """Deliver the worker's pending batch (or lose it), resyncing from a snapshot when the
    index says it missed one."""
    events = bm.events.drain()
    if events is not None and not lose:
        index.apply(worker_id, events)
    index.note_latest(worker_id, bm.events.log_id, bm.events.number)  # (as its stats say)
    if index.needs_snapshot(worker_id):
        index.reset(worker_id, bm.events.snapshot())


def test_the_index_equals_every_workers_cache(seed_count=30):
    cached = lost = replaced = adapter_hits = 0
    for seed in range(seed_count):
        rng = random.Random(seed)
        workers = {"p0": worker(), "p1": worker()}
        traffic = {name: Traffic(rng) for name in workers}
        index = KVIndex()
        for _ in range(120):
            name = rng.choice(list(workers))
            traffic[name].step(workers[name])
            if rng.random() < 0.3:
                lose = rng.random() < 0.15
                lost += lose
                sync(index, name, workers[name], lose)
            if rng.random() < 0.02:  # the worker dies; a new one takes its id, cache empty
                workers[name], traffic[name] = worker(), Traffic(rng)
                replaced += 1
        for name, bm in workers.items():
            sync(index, name, bm)
            assert index.held(name) == bm.held_hashes(), (seed, name)
            cached += bool(bm.held_hashes())
            adapter_hits += check_router_matches(index, name, bm, traffic[name].prefixes)
    assert lost and replaced and cached > seed_count  # (the traffic covered each case)
    assert adapter_hits  # (prompts under adapters were matched)


def check_router_matches(index: KVIndex, worker_id: str, bm: BlockManager,
                         prefixes: list[list[int]]) -> int:
    """The router's match of each prefix under each adapter (its hashes rooted at the
    adapter's digest) is the worker's own; returns how many matched under an adapter."""
    hits_under_adapters = 0
    for prefix in prefixes:
        prompt = prefix + [1]
        for adapter in ADAPTERS:
            digest = None if adapter is None else adapter.digest
            hashes = chained_block_hashes(prompt, 4, SALT, root=adapter_root_hash(digest))
            seq = Sequence("probe", prompt, SamplingParams(max_tokens=1), adapter=adapter)
            worker_hits = bm.match_prefix(seq) // 4
            bm.free(seq)
            assert index.matched_blocks(worker_id, hashes) == worker_hits, (prefix, digest)
            hits_under_adapters += bool(worker_hits and adapter is not None)
    return hits_under_adapters


def test_a_gap_leaves_the_entry_matching_nothing_until_a_snapshot():
    bm, index = worker(), KVIndex()
    traffic = Traffic(random.Random(1))
    while not bm.held_hashes():
        traffic.step(bm)
    assert index.apply("w", bm.events.drain())
    hashes = sorted(bm.held_hashes())
    next_batch(bm, traffic)  # lost on its way
    events = next_batch(bm, traffic)
    assert not index.apply("w", events) and index.needs_snapshot("w")
    assert index.held("w") == frozenset() and index.matched_blocks("w", hashes) == 0
    index.reset("w", bm.events.snapshot())
    assert index.held("w") == bm.held_hashes() and not index.needs_snapshot("w")
    assert index.apply("w", events)  # a batch the snapshot holds already: skipped


def next_batch(bm: BlockManager, traffic: Traffic):
    while (events := bm.events.drain()) is None:
        traffic.step(bm)
    return events


def test_batches_say_where_each_hash_ended_up():
    log = KVEventLog()
    log.stored(b"a")
    log.stored(b"b")
    log.removed(b"a")
    first = log.drain()
    assert (first.number, first.stored, first.removed) == (1, (b"b",), (b"a",))
    assert log.drain() is None
    log.removed(b"b")
    log.stored(b"b")
    second = log.drain()
    assert (second.number, second.stored, second.removed) == (2, (b"b",), ())
    assert second.log_id == first.log_id != KVEventLog().log_id


def test_a_late_index_matches_the_leading_blocks_a_worker_holds():
    bm, index = worker(), KVIndex()
    seq = Sequence("a", list(range(1, 14)), SamplingParams(max_tokens=2))
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)  # three full blocks of 4
    bm.events.drain()  # before this router started: it never saw the batch
    index.reset("w", bm.events.snapshot())
    hashes = chained_block_hashes(list(range(1, 14)), 4, SALT)
    assert index.matched_blocks("w", hashes) == 3
    assert index.matched_blocks("w", chained_block_hashes([1, 2, 3, 5] + list(range(5, 14)),
                                                          4, SALT)) == 0
