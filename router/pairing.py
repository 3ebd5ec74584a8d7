"""Pairing policy: which decode worker reserves, which prefill worker computes, and whether
the decode worker computes the prompt itself (conditional disaggregation).

Decode: the worker with the most free blocks after the reservations this router made that its
stats do not count yet, then the fewest running requests. Prefill (and colocated, whose
workers compute their prompts too): the lowest cost in prompt tokens of work
(:func:`rank_prefill`): queued prompt tokens (with those this router sent that the stats do
not count yet), less the prompt tokens its prefix cache holds, plus a term for its KV usage,
with weights from ``RouterConfig``. The router reads the cached tokens off its KV index
(``router/kv_index.py``, fed by the workers' KV events; every router sees the same) by the
prompt's chained block hashes (the engine's own salted sha256, ``pdserve.engine.prefix_hash``,
with the cluster's salt). Where the prompt is computed: :func:`prefill_location`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.prefix_hash import chained_block_hashes
from pdserve.engine.protocol import WorkerStats
from pdserve.router.kv_index import KVIndex

__all__ = ["PrefillLocation", "PrefillRouting", "TransferCost", "WorkerLoad",
           "chained_block_hashes", "prefill_location", "rank_decode", "rank_prefill"]


@dataclass
class WorkerLoad:
    """The router's view of one worker: its last stats plus what this router sent it that
    those stats do not count yet."""

    stats: WorkerStats
    # (wall clock, blocks reserved, prompt tokens sent for prefill) per call this router made
    _sent: list[tuple[float, int, int]] = field(default_factory=list)

    def refresh(self, stats: WorkerStats) -> None:
        """Take newer stats: what they count (sent before ``stats.taken_at``) leaves the
        pending sums; stats of unknown age (``taken_at`` 0) count everything."""
        if stats is self.stats:
            return
        self.stats = stats
        self._sent = [s for s in self._sent if s[0] > stats.taken_at] if stats.taken_at else []

    def sent(self, blocks: int = 0, tokens: int = 0, at: float | None = None) -> None:
        """This router reserved ``blocks`` on the worker, or sent it ``tokens`` to prefill,
        with a call it began at ``at`` (wall clock; None: now)."""
        self._sent.append((time.time() if at is None else at, blocks, tokens))

    @property
    def pending_blocks(self) -> int:
        return sum(s[1] for s in self._sent)

    @property
    def pending_tokens(self) -> int:
        return sum(s[2] for s in self._sent)

    @property
    def free_blocks(self) -> int:
        return self.stats.free_blocks - self.pending_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the worker's pool (its ledger's; 16 when it names none)."""
        return int(self.stats.ledger.get("block_size", 16))

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that ``num_tokens`` tokens hold on this worker."""
        return -(-num_tokens // self.block_size)


def rank_decode(loads: list[WorkerLoad]) -> list[WorkerLoad]:
    """Candidates for a reservation, best first (draining workers excluded by the caller)."""
    return sorted(loads, key=lambda w: (-w.free_blocks, w.stats.num_running, w.stats.worker_id))


@dataclass(frozen=True)
class PrefillRouting:
    """Which worker (prefill or colocated) computes a prompt, and why (the request's trace
    keeps it)."""

    worker_id: str
    hit_blocks: int  # the prompt's leading blocks its prefix cache holds (the KV index's)
    cost: float  # rank_prefill's cost of this worker (lowest first)
    runner_up: str | None = None  # the next worker in rank (None: the last or only one)
    runner_up_cost: float | None = None


def rank_prefill(loads: list[WorkerLoad], prompt_token_ids: list[int], block_size: int,
                 index: KVIndex, salt: bytes | None, overlap_weight: float = 1.0,
                 kv_usage_weight: float = 0.0) -> list[tuple[WorkerLoad, PrefillRouting]]:
    """The workers that would prefill a prompt, lowest cost first, each with its routing
    (the runner-up: the next in this order). The cost, in prompt tokens of work:

        queued prompt tokens (its stats, plus those this router sent that they do not count)
        - overlap_weight * the tokens of the prompt's leading blocks the KV index says it holds
        + kv_usage_weight * the share of its KV blocks in use

    ties broken by the most free blocks, then the fewest running requests, then worker id.
    ``salt``: the cluster's prefix-cache salt (None: unknown, so no hit is counted and the
    queues alone decide)."""
    hashes = [] if salt is None else chained_block_hashes(prompt_token_ids, block_size, salt)
    hits = {w.stats.worker_id: index.matched_blocks(w.stats.worker_id, hashes) for w in loads}

    def cost(w: WorkerLoad) -> float:
        usage = w.stats.used_blocks / w.stats.total_blocks if w.stats.total_blocks else 0.0
        return (w.stats.queued_tokens + w.pending_tokens + kv_usage_weight * usage
                - overlap_weight * hits[w.stats.worker_id] * block_size)

    ranked = sorted(((cost(w), w) for w in loads), key=lambda cw: (
        cw[0], -cw[1].free_blocks, cw[1].stats.num_running, cw[1].stats.worker_id))
    out = []
    for i, (c, w) in enumerate(ranked):
        next_cost, next_load = ranked[i + 1] if i + 1 < len(ranked) else (None, None)
        out.append((w, PrefillRouting(w.stats.worker_id, hits[w.stats.worker_id], c,
                                      next_load and next_load.stats.worker_id, next_cost)))
    return out


class TransferCost:
    """What shipping one KV block costs against prefilling one prompt token, as the router
    saw it on the remote prefills it made: averages (exponentially weighted, ``weight`` to the
    newest) of a request's transfer time per block (token 0 sampled -> the last frame sent)
    and of its prefill time per computed token (first chunk -> token 0; a chunk that shared
    its step with others counts the whole step)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.block_s: float | None = None
        self.token_s: float | None = None

    def observe(self, tokens: int, prefill_s: float, blocks: int, transfer_s: float) -> None:
        """One remote prefill: ``tokens`` computed in ``prefill_s``, ``blocks`` sent in
        ``transfer_s``."""
        if tokens > 0 and prefill_s > 0:
            self.token_s = self._mix(self.token_s, prefill_s / tokens)
        if blocks > 0 and transfer_s >= 0:
            self.block_s = self._mix(self.block_s, transfer_s / blocks)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    @property
    def tokens_per_block(self) -> float:
        """Prompt tokens of prefill that cost what one block's transfer does (0: not seen)."""
        if not self.block_s or not self.token_s:
            return 0.0
        return self.block_s / self.token_s


@dataclass(frozen=True)
class PrefillLocation:
    """Where a disaggregated request's prompt is computed, and why (the trace keeps it)."""

    location: str  # "remote": a prefill worker, its KV shipped; "local": the decode worker
    # prompt tokens of work before token 0 at each (:func:`prefill_location`; None: not
    # weighed, the mode "always" or "never" decided alone)
    local_cost: float | None = None
    remote_cost: float | None = None


def prefill_location(max_local_tokens: int, num_tokens: int, decode: WorkerLoad,
                     prefill: PrefillRouting | None, num_blocks: int, tokens_per_block: float,
                     stall_weight: float = 1.0) -> PrefillLocation:
    """Conditional disaggregation's rule (``RouterConfig.disaggregation`` "auto"): where to
    compute a prompt of ``num_tokens`` (prompt and any output it carries) that holds
    ``num_blocks`` KV blocks, ``decode`` being the decode worker it would go to and ``prefill``
    the routing of the best prefill worker (None: there is none). The cheaper place, in prompt
    tokens of work (time) added to the requests' latencies:

        local  = decode's queued prompt tokens + num_tokens
                 + stall_weight * decode's running requests * num_tokens
        remote = prefill.cost + num_tokens + num_blocks * tokens_per_block

    The first two terms of each are this request's wait for its first token (decode workers
    cache no prefix); the third of local is the wait a local prefill adds to the next token of
    every request decoding on that worker (``stall_weight`` 0: the request's own first token
    alone decides). ``prefill.cost`` is the prefill worker's queue less the prefix it holds, as
    ranked by :func:`rank_prefill`; ``tokens_per_block``: :class:`TransferCost`. Local only when
    ``num_tokens <= max_local_tokens``, which bounds the stall a local prefill adds to the
    decode worker's running requests, when the decode worker has the blocks free now (a
    reservation would wait for them in the router's queue, in the queue's order; a local
    prefill would wait at the worker), and only when strictly cheaper: ties go remote."""
    local = (decode.stats.queued_tokens + decode.pending_tokens + num_tokens
             + stall_weight * decode.stats.num_running * num_tokens)
    remote = (float("inf") if prefill is None
              else prefill.cost + num_tokens + num_blocks * tokens_per_block)
    allowed = num_tokens <= max_local_tokens and num_blocks <= decode.free_blocks
    return PrefillLocation("local" if allowed and local < remote else "remote", local, remote)
