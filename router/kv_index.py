"""The router's view of every worker's prefix cache, kept from the workers' KV events.

Each worker numbers its event batches from 1 (``KVEvents``). The index applies a worker's
batches in order; a batch that does not follow the last one applied means some were lost (a
trimmed stream, a Redis restart, a router that started late), and the worker's entry stays
stale, matching nothing, until it is reset from a snapshot (``KVSnapshot``). Batches the
snapshot already contains are skipped; applying one again would change nothing anyway.

A worker holds each hash in its pool or, with KV tiers (``docs/kv-tiers.md``), in host
memory or on its disk; the entry keeps the best tier holding each (``KV_TIER_*``: a batch's
``stored_tiers``, a snapshot's ``tiers``). Each tier holds at most so many blocks, one hash
each: the pool its ``total_blocks``, a tier below it its capacity in bytes over the bytes of a
block (:class:`KVCapacity`, from the worker's record), so a batch that would leave more hashes
at some tier of its entry than that tier holds is not the worker's truth: the entry goes
stale, holding nothing, until it is reset. Only a hash's best tier counts against a tier (a
block both in the pool and in host memory is a pool block), which never overstates a tier.

Every router builds the same index from the same events, whatever traffic it routed itself.
A hash names a block under the LoRA adapter that computed it too (its chain starts at the
adapter's root, ``prefix_hash.adapter_root_hash``), so the index needs no adapter key: a
prompt hashed under another adapter, or the base model, matches none of those blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.worker_api import KV_TIER_NAMES, KV_TIER_POOL, KVEvents, KVSnapshot, WorkerStats


class KVCapacity(NamedTuple):
    """The most hashes each tier of a worker holds (None: not known, not checked)."""

    pool: int | None = None  # its KV pool's blocks
    host: int | None = None  # host memory's budget over one block's bytes
    disk: int | None = None  # the disk tier's

    @classmethod
    def of(cls, stats: WorkerStats) -> KVCapacity:
        """A worker's capacities as its stats say: its pool's blocks, and each tier's budget
        in whole blocks (rounded up: a bound, never under the truth) where both the budget and
        the bytes of a block are known."""
        def blocks(capacity_bytes: int) -> int | None:
            per_block = stats.kv_bytes_per_block
            return -(-capacity_bytes // per_block) if per_block > 0 and capacity_bytes else None

        return cls(stats.total_blocks, blocks(stats.kv_host_capacity_bytes),
                   blocks(stats.kv_disk_capacity_bytes))


@dataclass
class _Worker:
    """One worker's entry: every hash it holds, and the tier of those held only below its
    pool (kept apart, so a worker without tiers costs what a set of its hashes does)."""

    log_id: str  # the worker's event log (a restarted worker has a new one)
    number: int = 0  # the last batch applied (or the snapshot's)
    held: set[bytes] = field(default_factory=set)  # in any tier
    stale: bool = False  # a batch was missed: match nothing until reset
    below: dict[bytes, int] = field(default_factory=dict)  # hash -> its best tier, for the
    # hashes of ``held`` no pool block holds
    num_below: list[int] = field(default_factory=lambda: [0] * len(KV_TIER_NAMES))  # the
    # hashes of ``below`` per tier

    def update(self, events: KVEvents) -> None:
        """Drop the batch's removed hashes and hold its stored ones at their tiers."""
        self.held.difference_update(events.removed)
        self.held.update(events.stored)
        lower = ({h: tier for h, tier in zip(events.stored, events.stored_tiers, strict=True)
                  if tier != KV_TIER_POOL} if events.stored_tiers else {})
        if self.below:  # what is gone, back in the pool or moved from one tier to another
            self._unmark(self.below.keys() & {*events.removed, *events.stored})
        self.mark_below(lower)

    def mark_below(self, lower: dict[bytes, int]) -> None:
        """Hashes of ``held`` not in ``below`` yet are held best in these tiers below the
        pool."""
        self.below.update(lower)
        for tier, count in Counter(lower.values()).items():
            self.num_below[tier] += count

    def _unmark(self, block_hashes: set[bytes]) -> None:
        for block_hash in block_hashes:
            self.num_below[self.below.pop(block_hash)] -= 1

    def tier_of(self, block_hash: bytes) -> int:
        """The best tier holding a hash of ``held``."""
        return self.below.get(block_hash, KV_TIER_POOL)

    def exceeds(self, capacity: KVCapacity) -> bool:
        """Whether some tier holds more hashes than ``capacity`` says it can (a hash counts
        against its best tier only)."""
        counts = [len(self.held) - len(self.below), *self.num_below[KV_TIER_POOL + 1:]]
        return any(limit is not None and count > limit
                   for count, limit in zip(counts, capacity, strict=True))


class KVIndex:
    """Which block hashes each worker's prefix cache holds, and in which tier."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}

    def apply(self, worker_id: str, events: KVEvents,
              capacity: KVCapacity | None = None) -> bool:
        """Apply the worker's next batch; False when it does not follow the last one applied,
        or would leave some tier of the entry holding more hashes than ``capacity`` says
        (None: not known), and the entry is then stale until :meth:`reset`. A log's
        first batch starts an entry afresh (a new worker, or a restarted one: its cache
        started empty)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.log_id != events.log_id:
            if events.number != 1:
                self._workers[worker_id] = _Worker(events.log_id, stale=True)
                return False
            worker = self._workers[worker_id] = _Worker(events.log_id)
        if worker.stale:
            return False
        if events.number <= worker.number:
            return True  # in the snapshot already
        if events.number != worker.number + 1:
            worker.stale = True
            return False
        worker.update(events)
        if capacity is not None and worker.exceeds(capacity):
            self._workers[worker_id] = _Worker(worker.log_id, stale=True)
            return False
        worker.number = events.number
        return True

    def note_latest(self, worker_id: str, log_id: str, number: int) -> None:
        """The worker says (in its stats) that its event log ``log_id`` has drained batches up
        to ``number``. Called after applying what arrived: an entry of another log (a
        previous engine's under the same id) or behind that number missed batches, and is
        stale until reset."""
        worker = self._workers.get(worker_id)
        if worker is not None and log_id and (worker.log_id != log_id
                                              or worker.number < number):
            worker.stale = True

    def reset(self, worker_id: str, snapshot: KVSnapshot) -> None:
        """The worker's entry from a snapshot (its hashes, at their tiers); its later batches
        apply on top."""
        worker = self._workers[worker_id] = _Worker(snapshot.log_id, snapshot.number,
                                                    set(snapshot.hashes))
        worker.mark_below({h: tier for h, tier in snapshot.tiers.items()
                           if tier != KV_TIER_POOL and h in worker.held})

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def needs_snapshot(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is None or worker.stale

    def held(self, worker_id: str) -> frozenset[bytes]:
        """What the index says the worker holds, in any tier (empty while stale)."""
        worker = self._workers.get(worker_id)
        return frozenset() if worker is None or worker.stale else frozenset(worker.held)

    def held_tiers(self, worker_id: str) -> dict[bytes, int]:
        """Each hash the index says the worker holds and the best tier holding it (empty
        while stale)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.stale:
            return {}
        return {block_hash: worker.tier_of(block_hash) for block_hash in worker.held}

    def matched_tiers(self, worker_id: str, hashes: list[bytes]) -> tuple[int, ...]:
        """The best tier holding each of the leading blocks of a prompt's chained ``hashes``
        the worker holds, in any tier (a chain: a hit on block i stands for the whole prefix
        up to it; the run ends at the first block no tier holds)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.stale:
            return ()
        held, below, tiers = worker.held, worker.below, []
        for h in hashes:
            if h not in held:
                break
            tiers.append(below.get(h, KV_TIER_POOL))
        return tuple(tiers)

    def matched_blocks(self, worker_id: str, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt's chained ``hashes`` the worker holds, in any
        tier."""
        return len(self.matched_tiers(worker_id, hashes))

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)
