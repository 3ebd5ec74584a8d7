"""A worker's KV events: what its prefix cache gained and lost since the last batch.

The block manager reports every change to the set of block hashes its pool can match
(``stored`` when a full block is registered, ``removed`` when a cached block is evicted for
reuse), and the KV tiers below the pool (``engine.kv_cache.tiers``) every block they gain and
drop (``tier_stored``, ``tier_removed``). The log keeps which tiers hold each hash and, per
hash changed since the last batch, the best tier holding it after its latest change (or none),
so a batch says where each hash ended up, never the order it went there by. Applying a batch
is then idempotent (set the stored at their tier, discard the removed), which is what lets a
reader start from a snapshot and apply, on top, batches the snapshot already contains.

The log is bounded: past ``max_pending`` hashes changed since the last batch (nobody drains
it, or too slowly), it forgets them and skips a batch number, so every reader sees a gap and
resyncs from a snapshot instead of trusting a batch that lost changes.

Threads: the engine's loop thread reports; ``drain`` may run on any thread (one lock).
The tiers' writer thread reports too; ``snapshot`` may run on any thread.
"""

from __future__ import annotations

import secrets
import threading

from pdserve.worker_api import KV_TIER_POOL, KVEvents, KVSnapshot


class KVEventLog:
    """Changes to one worker's prefix cache (its pool and the tiers below), drained in
    numbered batches."""

    def __init__(self, max_pending: int = 1 << 16) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._held: dict[bytes, int] = {}  # hash -> bit t set when tier t holds it
        self._pending: dict[bytes, int | None] = {}  # hash -> best tier after its latest
        # change (None: no tier holds it)
        self._number = 0  # batches drained so far (the last one's number)
        self.log_id = secrets.token_hex(8)  # tells this log's batches from a predecessor's

    def stored(self, block_hash: bytes) -> None:
        """The pool holds ``block_hash`` now."""
        self._change(block_hash, KV_TIER_POOL, True)

    def removed(self, block_hash: bytes) -> None:
        """The pool holds ``block_hash`` no more."""
        self._change(block_hash, KV_TIER_POOL, False)

    def tier_stored(self, block_hash: bytes, tier: int) -> None:
        self._change(block_hash, tier, True)

    def tier_removed(self, block_hash: bytes, tier: int) -> None:
        self._change(block_hash, tier, False)

    def _change(self, block_hash: bytes, tier: int, held: bool) -> None:
        with self._lock:
            mask = self._held.get(block_hash, 0)
            mask = mask | (1 << tier) if held else mask & ~(1 << tier)
            if mask:
                self._held[block_hash] = mask
            else:
                self._held.pop(block_hash, None)
            self._pending[block_hash] = _best(mask)
            if len(self._pending) > self.max_pending:  # overflow: readers must resync
                self._pending.clear()
                self._number += 1

    @property
    def number(self) -> int:
        """The number of the last batch drained (0: none yet)."""
        return self._number

    def tier_of(self, block_hash: bytes) -> int | None:
        """The best tier holding ``block_hash`` now (None: none)."""
        with self._lock:
            return _best(self._held.get(block_hash, 0))

    def drain(self) -> KVEvents | None:
        """The changes since the last batch as the next batch (None when there are none)."""
        with self._lock:
            if not self._pending:
                return None
            pending, self._pending = self._pending, {}
            self._number += 1
            number = self._number
        stored = [(h, tier) for h, tier in pending.items() if tier is not None]
        tiers = tuple(tier for _, tier in stored)
        return KVEvents(self.log_id, number, tuple(h for h, _ in stored),
                        tuple(h for h, tier in pending.items() if tier is None),
                        () if not any(tiers) else tiers)

    def snapshot(self) -> KVSnapshot:
        """Every hash held now, as of the last batch drained: the changes not drained yet
        are in it already, and applying them again when their batch comes changes nothing."""
        with self._lock:
            held = {h: _best(mask) for h, mask in self._held.items()}
            number = self._number
        return KVSnapshot(self.log_id, number, frozenset(held),
                          {h: tier for h, tier in held.items() if tier != KV_TIER_POOL})


def _best(mask: int) -> int | None:
    """The lowest tier whose bit is set in ``mask`` (None: no bit)."""
    return (mask & -mask).bit_length() - 1 if mask else None
