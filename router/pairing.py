"""Pairing policy: which decode worker reserves, which prefill worker computes.

Decode: the worker with the most free blocks after the reservations this router made since
its last stats refresh, then the fewest running requests. Prefill: the fewest queued prompt
tokens (including what this router sent since the refresh) minus the prompt tokens its prefix
cache probably holds, estimated from the chained block hashes of prompts this router sent it
(the engine's own salted sha256, ``pdserve.engine.prefix_hash``; they never leave the router).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.engine.prefix_hash import chained_block_hashes
from pdserve.engine.protocol import WorkerStats

__all__ = ["WorkerLoad", "chained_block_hashes", "pick_prefill", "rank_decode"]


@dataclass
class WorkerLoad:
    """The router's view of one worker: last stats plus what it sent since."""

    stats: WorkerStats
    pending_blocks: int = 0  # reserved by this router since the stats were taken
    pending_tokens: int = 0  # prompt tokens sent for prefill since the stats were taken
    recent_hashes: OrderedDict = field(default_factory=OrderedDict)  # LRU of prompt blocks

    def refresh(self, stats: WorkerStats) -> None:
        if stats is self.stats:  # the directory has nothing newer (e.g. no heartbeat since)
            return
        self.stats, self.pending_blocks, self.pending_tokens = stats, 0, 0

    @property
    def free_blocks(self) -> int:
        return self.stats.free_blocks - self.pending_blocks

    def prefix_hit_tokens(self, hashes: list[bytes], block_size: int) -> int:
        hits = 0
        for h in hashes:
            if h not in self.recent_hashes:
                break
            hits += 1
        return hits * block_size

    def remember(self, hashes: list[bytes], capacity: int) -> None:
        for h in hashes:
            self.recent_hashes[h] = None
            self.recent_hashes.move_to_end(h)
        while len(self.recent_hashes) > capacity:
            self.recent_hashes.popitem(last=False)


def rank_decode(loads: list[WorkerLoad]) -> list[WorkerLoad]:
    """Candidates for a reservation, best first (draining workers excluded by the caller)."""
    return sorted(loads, key=lambda w: (-w.free_blocks, w.stats.num_running, w.stats.worker_id))


def pick_prefill(loads: list[WorkerLoad], prompt_token_ids: list[int], block_size: int,
                 salt: bytes = b"") -> tuple[WorkerLoad, list[bytes]]:
    """The prefill worker with the least work left after its likely prefix-cache hit.

    ``salt``: the cluster's prefix-cache salt when the caller has it; the router only compares
    its own hashes with each other, so any fixed salt gives the same choice."""
    hashes = chained_block_hashes(prompt_token_ids, block_size, salt)

    def cost(w: WorkerLoad) -> tuple:
        queued = w.stats.queued_tokens + w.pending_tokens
        return (queued - w.prefix_hit_tokens(hashes, block_size), w.stats.worker_id)

    return min(loads, key=cost), hashes
