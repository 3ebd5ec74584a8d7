"""The router's view of every worker's prefix cache, kept from the workers' KV events.

Each worker numbers its event batches from 1 (``KVEvents``). The index applies a worker's
batches in order; a batch that does not follow the last one applied means some were lost (a
trimmed stream, a Redis restart, a router that started late), and the worker's entry stays
stale, matching nothing, until it is reset from a snapshot (``KVSnapshot``). Batches the
snapshot already contains are skipped; applying one again would change nothing anyway.

A worker's cache holds at most its pool's blocks, one hash each, so a batch that would leave
more in its entry than the worker's ``total_blocks`` (its record's) is not the worker's
truth: the entry goes stale, holding nothing, until it is reset.

Every router builds the same index from the same events, whatever traffic it routed itself.
A hash names a block under the LoRA adapter that computed it too (its chain starts at the
adapter's root, ``prefix_hash.adapter_root_hash``), so the index needs no adapter key: a
prompt hashed under another adapter, or the base model, matches none of those blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.worker_api import KVEvents, KVSnapshot


@dataclass
class _Worker:
    log_id: str  # the worker's event log (a restarted worker has a new one)
    number: int = 0  # the last batch applied (or the snapshot's)
    held: set[bytes] = field(default_factory=set)
    stale: bool = False  # a batch was missed: match nothing until reset


class KVIndex:
    """Which block hashes each worker's prefix cache holds."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}

    def apply(self, worker_id: str, events: KVEvents, capacity: int | None = None) -> bool:
        """Apply the worker's next batch; False when it does not follow the last one applied,
        or would leave the entry holding more than ``capacity`` hashes (the worker's total
        blocks; None: not known), and the entry is then stale until :meth:`reset`. A log's
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
        worker.held.difference_update(events.removed)
        worker.held.update(events.stored)
        if capacity is not None and len(worker.held) > capacity:
            worker.held, worker.stale = set(), True
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
        """The worker's entry from a snapshot; its later batches apply on top."""
        self._workers[worker_id] = _Worker(snapshot.log_id, snapshot.number,
                                           set(snapshot.hashes))

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def needs_snapshot(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is None or worker.stale

    def held(self, worker_id: str) -> frozenset[bytes]:
        """What the index says the worker holds (empty while stale)."""
        worker = self._workers.get(worker_id)
        return frozenset() if worker is None or worker.stale else frozenset(worker.held)

    def matched_blocks(self, worker_id: str, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt's chained ``hashes`` the worker holds (a chain:
        a hit on block i stands for the whole prefix up to it)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.stale:
            return 0
        held, count = worker.held, 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)
