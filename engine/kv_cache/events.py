"""A worker's KV events: what its prefix cache gained and lost since the last batch.

The block manager reports every change to the set of block hashes it can match (``stored``
when a full block is registered, ``removed`` when a cached block is evicted for reuse); the
log keeps, per hash, its state at the latest change, so a batch says where each hash ended
up, never the order it went there by. Applying a batch is then idempotent (add the stored,
discard the removed), which is what lets a reader start from a snapshot and apply, on top,
batches the snapshot already contains.

The log is bounded: past ``max_pending`` hashes changed since the last batch (nobody drains
it, or too slowly), it forgets them and skips a batch number, so every reader sees a gap and
resyncs from a snapshot instead of trusting a batch that lost changes.

Threads: the engine's loop thread reports; ``drain`` may run on any thread (one lock).
``snapshot`` reads the block manager's hashes, so it runs on the loop thread too.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable

from pdserve.worker_api import KVEvents, KVSnapshot


class KVEventLog:
    """Changes to one block manager's prefix cache, drained in numbered batches."""

    def __init__(self, max_pending: int = 1 << 16) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: dict[bytes, bool] = {}  # hash -> held after its latest change
        self._number = 0  # batches drained so far (the last one's number)
        self.log_id = secrets.token_hex(8)  # tells this log's batches from a predecessor's

    def stored(self, block_hash: bytes) -> None:
        self._change(block_hash, True)

    def removed(self, block_hash: bytes) -> None:
        self._change(block_hash, False)

    def _change(self, block_hash: bytes, held: bool) -> None:
        with self._lock:
            self._pending[block_hash] = held
            if len(self._pending) > self.max_pending:  # overflow: readers must resync
                self._pending.clear()
                self._number += 1

    @property
    def number(self) -> int:
        """The number of the last batch drained (0: none yet)."""
        return self._number

    def drain(self) -> KVEvents | None:
        """The changes since the last batch as the next batch (None when there are none)."""
        with self._lock:
            if not self._pending:
                return None
            pending, self._pending = self._pending, {}
            self._number += 1
            number = self._number
        return KVEvents(self.log_id, number, tuple(h for h, held in pending.items() if held),
                        tuple(h for h, held in pending.items() if not held))

    def snapshot(self, held: Iterable[bytes]) -> KVSnapshot:
        """``held`` (every hash the cache holds now, read on the loop thread) as of the last
        batch drained: the changes not drained yet are in ``held`` already, and applying
        them again when their batch comes changes nothing."""
        with self._lock:
            return KVSnapshot(self.log_id, self._number, frozenset(held))
