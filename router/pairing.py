"""Pairing policy: which decode worker reserves, which prefill worker computes.

Decode: the worker with the most free blocks after the reservations this router made since
its last stats refresh, then the fewest running requests. Prefill: the fewest queued prompt
tokens (including what this router sent since the refresh) minus the prompt tokens its prefix
cache holds, which the router reads off its KV index (``router/kv_index.py``, fed by the
workers' KV events; every router sees the same) by the prompt's chained block hashes (the
engine's own salted sha256, ``pdserve.engine.prefix_hash``, with the cluster's salt).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.prefix_hash import chained_block_hashes
from pdserve.engine.protocol import WorkerStats
from pdserve.router.kv_index import KVIndex

__all__ = ["PrefillRouting", "WorkerLoad", "chained_block_hashes", "pick_prefill",
           "rank_decode"]


@dataclass
class WorkerLoad:
    """The router's view of one worker: last stats plus what it sent since."""

    stats: WorkerStats
    pending_blocks: int = 0  # reserved by this router since the stats were taken
    pending_tokens: int = 0  # prompt tokens sent for prefill since the stats were taken

    def refresh(self, stats: WorkerStats) -> None:
        if stats is self.stats:  # the directory has nothing newer (e.g. no heartbeat since)
            return
        self.stats, self.pending_blocks, self.pending_tokens = stats, 0, 0

    @property
    def free_blocks(self) -> int:
        return self.stats.free_blocks - self.pending_blocks


def rank_decode(loads: list[WorkerLoad]) -> list[WorkerLoad]:
    """Candidates for a reservation, best first (draining workers excluded by the caller)."""
    return sorted(loads, key=lambda w: (-w.free_blocks, w.stats.num_running, w.stats.worker_id))


@dataclass(frozen=True)
class PrefillRouting:
    """Which prefill worker computes a prompt, and why (the request's trace keeps it)."""

    worker_id: str
    hit_blocks: int  # the prompt's leading blocks its prefix cache holds (the KV index's)
    cost: int  # prompt tokens queued on it, less the hit's tokens
    runner_up: str | None = None  # the next best worker (None: the only one)
    runner_up_cost: int | None = None


def pick_prefill(loads: list[WorkerLoad], prompt_token_ids: list[int], block_size: int,
                 index: KVIndex, salt: bytes | None) -> tuple[WorkerLoad, PrefillRouting]:
    """The prefill worker with the least work left after its prefix-cache hit: queued
    prompt tokens (and those this router sent since its stats) less the tokens of the
    prompt's leading blocks the KV index says it holds. ``salt``: the cluster's prefix-cache
    salt (None: unknown, so no hit is counted and the queues alone decide)."""
    hashes = [] if salt is None else chained_block_hashes(prompt_token_ids, block_size, salt)
    hits = {w.stats.worker_id: index.matched_blocks(w.stats.worker_id, hashes) for w in loads}

    def cost(w: WorkerLoad) -> int:
        return w.stats.queued_tokens + w.pending_tokens - hits[w.stats.worker_id] * block_size

    best, *others = sorted(loads, key=lambda w: (cost(w), w.stats.worker_id))
    second = others[0] if others else None
    return best, PrefillRouting(best.stats.worker_id, hits[best.stats.worker_id], cost(best),
                                second and second.stats.worker_id, second and cost(second))
