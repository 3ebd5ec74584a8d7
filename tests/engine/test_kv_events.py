"""KV events: an index fed by the workers' event batches holds exactly what each worker's
prefix cache holds, and in which tier, through random admissions (under the base model and two
LoRA adapters), evictions from the pool into host memory and on to disk, tier drops, lost
batches (resynced from a snapshot) and a worker replaced under the same id; and the router,
hashing a prompt under its adapter's root, matches what the worker would."""

from __future__ import annotations

import random
from collections import OrderedDict

from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.kv_cache.events import KVEventLog
from pdserve.engine.kv_cache.prefix_hash import adapter_root_hash, chained_block_hashes
from pdserve.engine.sequence import Sequence
from pdserve.router.kv_index import KVCapacity, KVIndex
from pdserve.worker_api import (
    KV_TIER_DISK,
    KV_TIER_HOST,
    KV_TIER_POOL,
    KVEvents,
    KVSnapshot,
    WorkerStats,
)
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams

SALT = b"0123456789abcdef"
ADAPTERS = (None, AdapterRef("sql", "/adapters/sql", "5" * 64),
            AdapterRef("chat", "/adapters/chat", "c" * 64))  # None: the base model


HOST_BLOCKS, DISK_BLOCKS = 6, 8
CAPACITY = KVCapacity(10, HOST_BLOCKS, DISK_BLOCKS)


class TieredLog(KVEventLog):
    """A worker's event log with KV tiers below its pool, as the engine's tiers report to it:
    a block evicted from the pool is saved in host memory (LRU, ``HOST_BLOCKS``), host's
    evictions go to disk (LRU, ``DISK_BLOCKS``), disk's are deleted; ``drop`` loses a block of
    a tier (a failed read or write). ``host`` and ``disk`` are the truth the test checks the
    index against, kept apart from the log's own bookkeeping."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.disk: OrderedDict[bytes, None] = OrderedDict()

    def removed(self, block_hash: bytes) -> None:
        super().removed(block_hash)
        self._put(self.host, block_hash, KV_TIER_HOST, HOST_BLOCKS)

    def _put(self, tier: OrderedDict[bytes, None], block_hash: bytes, number: int,
             limit: int) -> None:
        tier[block_hash] = None
        tier.move_to_end(block_hash)
        self.tier_stored(block_hash, number)
        while len(tier) > limit:
            evicted, _ = tier.popitem(last=False)
            self.tier_removed(evicted, number)
            if number == KV_TIER_HOST:
                self._put(self.disk, evicted, KV_TIER_DISK, DISK_BLOCKS)

    def drop(self) -> None:
        tier, number = self.rng.choice(((self.host, KV_TIER_HOST), (self.disk, KV_TIER_DISK)))
        if tier:
            block_hash = self.rng.choice(list(tier))
            del tier[block_hash]
            self.tier_removed(block_hash, number)


def worker(rng: random.Random | None = None) -> BlockManager:
    """A block manager whose event log has KV tiers below its pool (``rng``), or none."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_salt=SALT)
    bm.events = KVEventLog() if rng is None else TieredLog(rng)
    return bm


def truth(bm: BlockManager) -> dict[bytes, int]:
    """Every hash the worker holds and the best tier holding it, from the pool and the test's
    own tiers."""
    log = bm.events
    held = {h: KV_TIER_DISK for h in log.disk} | {h: KV_TIER_HOST for h in log.host}
    return held | {h: KV_TIER_POOL for h in bm.held_hashes()}


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
    index says it missed one. A batch delivered after every earlier one applies: no tier of
    the entry ever holds more than the tier's capacity."""
    events = bm.events.drain()
    if events is not None and not lose:
        assert index.apply(worker_id, events, CAPACITY), (worker_id, events.number)
    index.note_latest(worker_id, bm.events.log_id, bm.events.number)  # (as its stats say)
    if index.needs_snapshot(worker_id):
        index.reset(worker_id, bm.events.snapshot())


def test_the_index_equals_every_workers_cache(seed_count=30):
    cached = lost = replaced = adapter_hits = below_pool = 0
    for seed in range(seed_count):
        rng = random.Random(seed)
        workers = {"p0": worker(rng), "p1": worker(rng)}
        traffic = {name: Traffic(rng) for name in workers}
        index = KVIndex()
        for _ in range(120):
            name = rng.choice(list(workers))
            traffic[name].step(workers[name])
            if rng.random() < 0.05:
                workers[name].events.drop()
            if rng.random() < 0.3:
                lose = rng.random() < 0.15
                lost += lose
                sync(index, name, workers[name], lose)
            if rng.random() < 0.02:  # the worker dies; a new one takes its id, cache empty
                workers[name], traffic[name] = worker(rng), Traffic(rng)
                replaced += 1
        for name, bm in workers.items():
            sync(index, name, bm)
            assert index.held_tiers(name) == truth(bm), (seed, name)
            cached += bool(bm.held_hashes())
            below_pool += len({KV_TIER_HOST, KV_TIER_DISK} & set(truth(bm).values()))
            adapter_hits += check_router_matches(index, name, bm, traffic[name].prefixes)
    assert lost and replaced and cached > seed_count  # (the traffic covered each case)
    assert adapter_hits  # (prompts under adapters were matched)
    assert below_pool > seed_count  # (blocks were held in host memory and on disk)


def check_router_matches(index: KVIndex, worker_id: str, bm: BlockManager,
                         prefixes: list[list[int]]) -> int:
    """The router's match of each prefix under each adapter (its hashes rooted at the
    adapter's digest) is the worker's own: its leading pool blocks are what the worker's pool
    matches, and the run goes on through the blocks its tiers hold; returns how many matched
    under an adapter."""
    hits_under_adapters = 0
    held = truth(bm)
    for prefix in prefixes:
        prompt = prefix + [1]
        for adapter in ADAPTERS:
            digest = None if adapter is None else adapter.digest
            hashes = chained_block_hashes(prompt, 4, SALT, root=adapter_root_hash(digest))
            seq = Sequence("probe", prompt, SamplingParams(max_tokens=1), adapter=adapter)
            worker_hits = bm.match_prefix(seq) // 4
            bm.free(seq)
            tiers = index.matched_tiers(worker_id, hashes)
            run = []
            for h in hashes:
                if h not in held:
                    break
                run.append(held[h])
            assert tiers == tuple(run), (prefix, digest)
            assert tiers[:worker_hits] == (KV_TIER_POOL,) * worker_hits, (prefix, digest)
            assert KV_TIER_POOL not in tiers[worker_hits:worker_hits + 1], (prefix, digest)
            assert index.matched_blocks(worker_id, hashes) == len(tiers)
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


def test_each_tier_is_checked_against_its_own_capacity():
    """Hashes count against the tier that holds them best: a worker whose pool is full and
    whose host memory holds more is not stale, one whose host tier holds more blocks than its
    budget over a block's bytes is; a tier whose budget is not known is not checked."""
    stats = WorkerStats("w", "prefill", 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, kv_bytes_per_block=100,
                        kv_host_capacity_bytes=250)  # three blocks at most (rounded up)
    capacity = KVCapacity.of(stats)
    assert capacity == KVCapacity(2, 3, None)
    a, b, c, d, e, f = (bytes([i]) * 32 for i in range(6))
    index = KVIndex()
    assert index.apply("w", KVEvents("log", 1, (a, b, c, d, e), (),
                                     (KV_TIER_POOL, KV_TIER_POOL, KV_TIER_HOST, KV_TIER_HOST,
                                      KV_TIER_DISK)), capacity)
    assert index.matched_tiers("w", [a, b, c, e, f]) == (0, 0, 1, KV_TIER_DISK)
    assert index.apply("w", KVEvents("log", 2, (a, f), (e,), (KV_TIER_HOST, KV_TIER_POOL)),
                       capacity)  # a moved down: the pool holds two, host memory three
    assert index.held_tiers("w") == {a: 1, b: 0, c: 1, d: 1, f: 0}
    assert not index.apply("w", KVEvents("log", 3, (b,), (), (KV_TIER_HOST,)), capacity)
    assert index.needs_snapshot("w") and index.matched_tiers("w", [b]) == ()
    index.reset("w", KVSnapshot("log", 3, frozenset((a, b)), {a: KV_TIER_DISK}))
    assert index.held_tiers("w") == {a: KV_TIER_DISK, b: KV_TIER_POOL}
