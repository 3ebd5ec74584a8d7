"""Pairing policy: which decode worker reserves, which prefill worker computes, and whether
the decode worker computes the prompt itself (conditional disaggregation).

Decode (:func:`rank_decode`): the most room for the request, counting as room the prompt's
leading blocks its prefix cache holds (neither allocated nor received), then the fewest running
requests. Prefill (and colocated, whose
workers compute their prompts too): the lowest cost in prompt tokens of work
(:func:`rank_prefill`): queued prompt tokens (with those this router sent that the stats do
not count yet), less the prompt tokens its prefix cache holds, plus a term for its KV usage,
with weights from ``RouterConfig``. The router reads the cached tokens off its KV index
(``router/kv_index.py``, fed by the workers' KV events; every router sees the same) by the
prompt's chained block hashes (the engine's own salted sha256,
``pdserve.engine.kv_cache.prefix_hash``, with the cluster's salt, chained from the root of the
request's LoRA adapter). Where the prompt is computed: :func:`prefill_location`.

A request under a LoRA adapter also pays, on a worker that does not hold the adapter in a slot,
the time to load it there (:func:`adapter_cost`: 0 when resident, a slot load when the worker
holds it read in host memory, a file read and a slot load otherwise, each the mean the pool's
workers measured), turned into each cost's units with the measured prefill time per prompt token:
requests for an adapter go where it is resident unless that worker is much busier.

A worker with KV tiers (``docs/kv-tiers.md``) holds some of a prompt's leading blocks in host
memory or on its disk: it loads them back instead of computing them, so each counts as a
cached block weighed by what its load costs against computing it (:func:`tier_weights`: 1 in
the pool, between 1 and 0 below it, 0 where loading is as slow as computing), for prefill,
colocated and decode workers alike (:class:`PrefixHit`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.kv_cache.prefix_hash import adapter_root_hash, chained_block_hashes
from pdserve.router.kv_index import KVIndex
from pdserve.worker_api import (
    KV_TIER_ASSUMED_READ_BYTES_PER_S,
    KV_TIER_DISK,
    KV_TIER_HOST,
    KV_TIER_POOL,
    WorkerStats,
)

__all__ = ["AdapterCost", "DecodeRouting", "LoadTimes", "PrefillLocation", "PrefillRouting",
           "PrefixHit", "TransferCost", "WorkerLoad", "adapter_cost", "chained_block_hashes",
           "pool_load_times", "prefill_location", "rank_decode", "rank_prefill", "tier_weights"]

# What loading a LoRA adapter costs before any worker of the pool measured it (seconds), and
# the prefill time per prompt token before the router measured any: they turn load times into
# prompt tokens of work (:func:`adapter_cost`).
DEFAULT_SLOT_LOAD_S = 0.005  # host memory -> a slot of the model
DEFAULT_DISK_READ_S = 0.05  # read and check the adapter's files
FULL_SLOTS_WAIT_S = 0.1  # every slot holds another adapter and the worker runs requests
# (which may pin them all): a guess at the wait for one to come free
DEFAULT_TOKEN_S = 1e-4  # seconds of prefill per prompt token


class _Sent(NamedTuple):
    """One call this router made to a worker that its stats may not count yet."""

    at: float  # wall clock when the call began
    blocks: int  # KV blocks reserved
    tokens: int  # prompt tokens sent for prefill
    adapter: str | None  # the digest of the request's LoRA adapter (None: the base model)


@dataclass
class WorkerLoad:
    """The router's view of one worker: its last stats plus what this router sent it that
    those stats do not count yet."""

    stats: WorkerStats
    _sent: list[_Sent] = field(default_factory=list)  # per call this router made

    def refresh(self, stats: WorkerStats) -> None:
        """Take newer stats: what they count (sent before ``stats.taken_at``) leaves the
        pending sums; stats of unknown age (``taken_at`` 0) count everything."""
        if stats is self.stats:
            return
        self.stats = stats
        self._sent = [s for s in self._sent if s.at > stats.taken_at] if stats.taken_at else []

    def sent(self, blocks: int = 0, tokens: int = 0, at: float | None = None,
             adapter: str | None = None) -> _Sent:
        """This router reserved ``blocks`` on the worker, or sent it ``tokens`` to prefill,
        with a call it began at ``at`` (wall clock; None: now), for a request under the LoRA
        adapter of digest ``adapter`` (None: the base model). Returns the call's entry, for
        :meth:`computed`."""
        entry = _Sent(time.time() if at is None else at, blocks, tokens, adapter)
        self._sent.append(entry)
        return entry

    def computed(self, entry: _Sent) -> None:
        """The prompt of the call ``entry`` is computed (its first token came): its tokens
        are no longer queued there, whether or not newer stats say so yet."""
        self._sent = [s._replace(tokens=0) if s is entry else s for s in self._sent]

    @property
    def pending_blocks(self) -> int:
        return sum(s.blocks for s in self._sent)

    @property
    def pending_tokens(self) -> int:
        return sum(s.tokens for s in self._sent)

    @property
    def pending_adapters(self) -> frozenset[str]:
        """Digests of the adapters of requests this router sent that the stats do not count
        (the worker is loading them, or holds them already)."""
        return frozenset(s.adapter for s in self._sent if s.adapter is not None)

    @property
    def free_blocks(self) -> int:
        return self.stats.free_blocks - self.pending_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the worker's pool (its ledger's; 16 when it names none);
        ValueError naming the field when it is not a whole number > 0 (the registry skips
        such a record: it never reaches placement from Redis)."""
        block_size = self.stats.ledger.get("block_size", 16)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"worker {self.stats.worker_id}: ledger block_size must be a whole "
                             f"number > 0, got {block_size!r}")
        return block_size

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that ``num_tokens`` tokens hold on this worker."""
        return -(-num_tokens // self.block_size)


class LoadTimes(NamedTuple):
    """Mean seconds to load a LoRA adapter: to read its files, and to put it in a slot."""

    disk_read_s: float = DEFAULT_DISK_READ_S
    slot_load_s: float = DEFAULT_SLOT_LOAD_S


def pool_load_times(loads: list[WorkerLoad]) -> LoadTimes:
    """The workers' mean file read and slot load over all their measurements (the defaults
    where none measured one). A load's time is the adapter's size against the storage and
    the device, which the workers of a pool share: one mean for all of them keeps a worker's
    few noisy samples (or none yet, against the defaults) from steering where adapters go."""
    reads = sum(w.stats.lora_disk_reads for w in loads)
    slots = sum(w.stats.lora_slot_loads for w in loads)
    return LoadTimes(
        sum(w.stats.lora_disk_read_s for w in loads) / reads if reads else DEFAULT_DISK_READ_S,
        sum(w.stats.lora_slot_load_s for w in loads) / slots if slots else DEFAULT_SLOT_LOAD_S)


@dataclass(frozen=True)
class AdapterCost:
    """What a request's LoRA adapter costs a worker before the request can run there."""

    source: str  # where the adapter is on the worker: "resident" (in a slot), "sent" (this
    # router sent it a request for the adapter since its stats: it is loading it or holds it),
    # "host" (read in host memory: a slot load away), "disk" (its files to read first),
    # "unserved" (the worker serves no adapters: ranked last)
    seconds: float  # the expected wait to load it (inf: unserved)

    @property
    def loads(self) -> bool:
        """Whether the request puts the adapter in a slot (it was neither there nor sent)."""
        return self.source in ("host", "disk")

    def tokens(self, token_s: float | None) -> float:
        """The load time in prompt tokens of prefill (``token_s``: prefill seconds per prompt
        token, ``TransferCost.token_s``; None: not measured yet, ``DEFAULT_TOKEN_S``)."""
        return self.seconds / (token_s or DEFAULT_TOKEN_S) if self.seconds else 0.0


def adapter_cost(load: WorkerLoad, digest: str, times: LoadTimes = LoadTimes()) -> AdapterCost:
    """What running a request under the adapter of ``digest`` costs ``load``'s worker first:
    nothing when the adapter is in a slot (or this router sent it a request for it since its
    stats); a slot load when the worker holds it read in host memory; a file read and a slot
    load otherwise, each taking ``times`` (the pool's measured means, :func:`pool_load_times`).
    When every slot holds another adapter, one more slot load
    (the adapter it evicts is loaded again by its next request, from host memory at best), and
    ``FULL_SLOTS_WAIT_S`` more while the worker runs requests (they may pin every slot): a
    worker with a free slot is preferred."""
    stats = load.stats
    if stats.lora_slots <= 0:
        return AdapterCost("unserved", math.inf)
    if digest in stats.lora_resident:
        return AdapterCost("resident", 0.0)
    if digest in load.pending_adapters:
        return AdapterCost("sent", 0.0)
    seconds = times.slot_load_s
    if len(stats.lora_resident) >= stats.lora_slots:  # it evicts another adapter
        seconds += times.slot_load_s + (FULL_SLOTS_WAIT_S if stats.num_running else 0.0)
    if digest in stats.lora_in_host:
        return AdapterCost("host", seconds)
    return AdapterCost("disk", seconds + times.disk_read_s)


def _adapter_costs(loads: list[WorkerLoad], adapter: str | None) -> dict[str, AdapterCost | None]:
    """Each worker's :func:`adapter_cost` of ``adapter`` (None for all: the base model)."""
    if adapter is None:
        return {w.stats.worker_id: None for w in loads}
    times = pool_load_times(loads)
    return {w.stats.worker_id: adapter_cost(w, adapter, times) for w in loads}


def _load_tokens(cost: AdapterCost | None, token_s: float | None) -> float:
    return 0.0 if cost is None else cost.tokens(token_s)


def tier_weights(load: WorkerLoad, token_s: float | None) -> tuple[float, ...]:
    """How much a block held in each tier (indexed by ``KV_TIER_*``) of ``load``'s worker counts
    as a cached block: 1 in the pool (read in place), and below it

        clamp(1 - load_s_per_token / prefill_s_per_token, 0, 1)

    with load_s_per_token the tier's measured read time per byte (its stats' ``kv_*_read_s``
    over ``kv_*_read_bytes``; ``KV_TIER_ASSUMED_READ_BYTES_PER_S`` before it read any) times
    the bytes of a block per token, and prefill_s_per_token ``token_s``
    (:class:`TransferCost`; None: ``DEFAULT_TOKEN_S``). A worker that does not say its
    block's bytes loads for free (1)."""
    stats, prefill_s = load.stats, token_s or DEFAULT_TOKEN_S

    def weight(read_s: float, read_bytes: int, default_bytes_s: float) -> float:
        bytes_s = read_bytes / read_s if read_s > 0 and read_bytes > 0 else default_bytes_s
        load_s = stats.kv_bytes_per_block / bytes_s / load.block_size
        return min(1.0, max(0.0, 1.0 - load_s / prefill_s))

    assumed = KV_TIER_ASSUMED_READ_BYTES_PER_S
    return (1.0,
            weight(stats.kv_host_read_s, stats.kv_host_read_bytes, assumed[KV_TIER_HOST]),
            weight(stats.kv_disk_read_s, stats.kv_disk_read_bytes, assumed[KV_TIER_DISK]))


class PrefixHit(NamedTuple):
    """What a worker holds of a prompt's leading blocks (the KV index's)."""

    tiers: tuple[int, ...] = ()  # the best tier holding each leading block (KV_TIER_*)
    cached: float = 0.0  # those blocks as cached ones, each weighed by its tier (tier_weights)

    @property
    def blocks(self) -> int:
        """The leading blocks held, in any tier."""
        return len(self.tiers)

    @property
    def pool_blocks(self) -> int:
        """The leading blocks held in the pool: shared in place, allocated again by nobody."""
        return next((i for i, tier in enumerate(self.tiers) if tier != KV_TIER_POOL),
                    len(self.tiers))

    def blocks_in(self, tier: int) -> int:
        return sum(1 for t in self.tiers if t == tier)


@dataclass(frozen=True)
class DecodeRouting:
    """Which decode worker a request's blocks were asked of, and why (the trace keeps it)."""

    worker_id: str
    hit_blocks: int  # the prompt's leading blocks its prefix cache holds, in any tier (the
    # KV index's)
    room: float  # rank_decode's score (highest first)
    runner_up: str | None = None  # the next worker in rank (None: the last or only one)
    runner_up_room: float | None = None
    adapter: AdapterCost | None = None  # where the request's LoRA adapter was on the worker
    # when ranked (None: the base model)
    hit: PrefixHit = PrefixHit()  # the tier of each hit block, and what they count as


def rank_decode(loads: list[WorkerLoad], prompt_token_ids: list[int] = (),
                index: KVIndex | None = None, salt: bytes | None = None,
                overlap_weight: float = 1.0, *, adapter: str | None = None,
                token_s: float | None = None) -> list[tuple[WorkerLoad, DecodeRouting]]:
    """The decode workers that could take a request, best first, each with its routing (the
    runner-up: the next in this order). The score, in KV blocks, highest first:

        free blocks (its stats, less those this router reserved that they do not count)
        + overlap_weight * the prompt's leading blocks the KV index says its cache holds
          (a block below the pool weighed by its load cost, :func:`tier_weights`)
        - its load time of the request's LoRA adapter, in blocks of prompt prefill

    (a held block is neither allocated again nor sent, so the first term plus the second is
    the room the worker has left once it holds the request, when the weight is 1; the third
    counts the wait to load the adapter as the blocks a prefill would compute meanwhile),
    ties broken by the fewest running requests, then worker id. Draining workers are excluded
    by the caller; with no ``index`` or ``salt`` the free blocks alone decide. ``adapter``:
    the digest of the request's LoRA adapter (None: the base model), which also roots its
    block hashes; ``token_s``: the measured prefill seconds per prompt token (None: not yet)."""
    block_size = loads[0].block_size if loads else 16
    hits = _hits(loads, prompt_token_ids, block_size, index, salt, adapter, token_s)
    costs = _adapter_costs(loads, adapter)

    def room(w: WorkerLoad) -> float:
        load = _load_tokens(costs[w.stats.worker_id], token_s) / block_size
        return w.free_blocks + overlap_weight * hits[w.stats.worker_id].cached - load

    ranked = sorted(((room(w), w) for w in loads),
                    key=lambda rw: (-rw[0], rw[1].stats.num_running, rw[1].stats.worker_id))
    return _with_runners_up(ranked, hits, costs, DecodeRouting)


def _hits(loads: list[WorkerLoad], prompt_token_ids: list[int], block_size: int,
          index: KVIndex | None, salt: bytes | None, adapter: str | None = None,
          token_s: float | None = None) -> dict[str, PrefixHit]:
    """What each worker holds, by the index, of the prompt's leading blocks under the LoRA
    adapter of digest ``adapter`` (None: the base model), each block weighed by its tier
    (:func:`tier_weights`); nothing for all when the index or the salt is unknown."""
    hashes = ([] if index is None or salt is None
              else chained_block_hashes(prompt_token_ids, block_size, salt,
                                        root=adapter_root_hash(adapter)))
    hits = {}
    for w in loads:
        tiers = () if not hashes or index is None else index.matched_tiers(w.stats.worker_id,
                                                                             hashes)
        weights = tier_weights(w, token_s)
        hits[w.stats.worker_id] = PrefixHit(tiers, float(sum(weights[t] for t in tiers)))
    return hits


@dataclass(frozen=True)
class PrefillRouting:
    """Which worker (prefill or colocated) computes a prompt, and why (the request's trace
    keeps it)."""

    worker_id: str
    hit_blocks: int  # the prompt's leading blocks its prefix cache holds, in any tier (the
    # KV index's)
    cost: float  # rank_prefill's cost of this worker (lowest first)
    runner_up: str | None = None  # the next worker in rank (None: the last or only one)
    runner_up_cost: float | None = None
    adapter: AdapterCost | None = None  # where the request's LoRA adapter was on the worker
    # when ranked (None: the base model)
    hit: PrefixHit = PrefixHit()  # the tier of each hit block, and what they count as


def rank_prefill(loads: list[WorkerLoad], prompt_token_ids: list[int], block_size: int,
                 index: KVIndex, salt: bytes | None, overlap_weight: float = 1.0,
                 kv_usage_weight: float = 0.0, *, adapter: str | None = None,
                 token_s: float | None = None) -> list[tuple[WorkerLoad, PrefillRouting]]:
    """The workers that would prefill a prompt, lowest cost first, each with its routing
    (the runner-up: the next in this order). The cost, in prompt tokens of work:

        queued prompt tokens (its stats, plus those this router sent that they do not count)
        - overlap_weight * the tokens of the prompt's leading blocks the KV index says it holds
          (a block below the pool weighed by its load cost, :func:`tier_weights`)
        + kv_usage_weight * the share of its KV blocks in use
        + its load time of the request's LoRA adapter / token_s

    ties broken by the most free blocks, then the fewest running requests, then worker id.
    ``salt``: the cluster's prefix-cache salt (None: unknown, so no hit is counted and the
    queues alone decide). ``adapter``: the digest of the request's LoRA adapter (None: the
    base model), which also roots its block hashes; its load time is :func:`adapter_cost`'s.
    ``token_s``: the measured prefill seconds per prompt token (None: not yet,
    ``DEFAULT_TOKEN_S``)."""
    hits = _hits(loads, prompt_token_ids, block_size, index, salt, adapter, token_s)
    costs = _adapter_costs(loads, adapter)

    def cost(w: WorkerLoad) -> float:
        usage = w.stats.used_blocks / w.stats.total_blocks if w.stats.total_blocks else 0.0
        return (w.stats.queued_tokens + w.pending_tokens + kv_usage_weight * usage
                - overlap_weight * hits[w.stats.worker_id].cached * block_size
                + _load_tokens(costs[w.stats.worker_id], token_s))

    ranked = sorted(((cost(w), w) for w in loads), key=lambda cw: (
        cw[0], -cw[1].free_blocks, cw[1].stats.num_running, cw[1].stats.worker_id))
    return _with_runners_up(ranked, hits, costs, PrefillRouting)


def _with_runners_up(ranked: list[tuple[float, WorkerLoad]], hits: dict[str, PrefixHit],
                     costs: dict[str, AdapterCost | None],
                     routing: type) -> list[tuple[WorkerLoad, object]]:
    """``ranked`` (score, worker) pairs in rank order, each worker with its ``routing``: its
    hits, score and adapter cost, and the next worker's id and score (None for the last)."""
    out = []
    for i, (score, w) in enumerate(ranked):
        next_score, next_load = ranked[i + 1] if i + 1 < len(ranked) else (None, None)
        worker_id = w.stats.worker_id
        out.append((w, routing(worker_id, hits[worker_id].blocks, score,
                               next_load and next_load.stats.worker_id, next_score,
                               adapter=costs[worker_id], hit=hits[worker_id])))
    return out


class TransferCost:
    """What shipping one KV block costs against prefilling one prompt token, as the router
    saw it on the remote prefills it made: averages (exponentially weighted, ``weight`` to the
    newest) of a request's transfer time per block (token 0 sampled -> the last frame sent)
    and of its prefill time per computed token (first chunk -> token 0; a chunk that shared
    its step with others counts the whole step; colocated prefills count too), which also
    turns a LoRA adapter's load time into prompt tokens (:meth:`AdapterCost.tokens`)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.block_s: float | None = None
        self.token_s: float | None = None

    def observe(self, tokens: int, prefill_s: float, blocks: int, transfer_s: float) -> None:
        """One prefill: ``tokens`` computed in ``prefill_s``, ``blocks`` sent in
        ``transfer_s`` (none: a colocated prefill)."""
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
                     stall_weight: float = 1.0, decode_hit_blocks: float = 0,
                     decode_adapter_tokens: float = 0.0,
                     decode_pool_blocks: int | None = None) -> PrefillLocation:
    """Conditional disaggregation's rule (``RouterConfig.disaggregation`` "auto"): where to
    compute a prompt of ``num_tokens`` (prompt and any output it carries) that holds
    ``num_blocks`` KV blocks, ``decode`` being the decode worker it would go to, whose prefix
    cache holds the first ``decode_hit_blocks`` of them (the KV index's, as cached blocks: one
    below the pool counts its tier's weight, ``PrefixHit.cached``), the first
    ``decode_pool_blocks`` in its pool (None: all of them), and ``prefill`` the
    routing of the best prefill worker (None: there is none). The cheaper place, in prompt
    tokens of work (time) added to the requests' latencies:

        local  = decode's queued prompt tokens + uncached + decode_adapter_tokens
                 + stall_weight * decode's running requests * uncached
        remote = prefill.cost + num_tokens + (num_blocks - decode_hit_blocks) * tokens_per_block

    with ``uncached`` = num_tokens less the tokens of the decode worker's hit blocks. The first
    two terms of each are this request's wait for its first token; the third of local is the
    wait a local prefill adds to the next token of every request decoding on that worker
    (``stall_weight`` 0: the request's own first token alone decides), the third of remote the
    transfer of the blocks the decode worker lacks. ``decode_adapter_tokens``: the decode
    worker's load time of the request's LoRA adapter in prompt tokens
    (:meth:`AdapterCost.tokens`; a remote prefill's is in ``prefill.cost``, and the decode
    worker loads it either way, but before token 0 only when it computes the prompt).
    ``prefill.cost`` is the prefill worker's
    queue less the prefix it holds, as ranked by :func:`rank_prefill`; ``tokens_per_block``:
    :class:`TransferCost`. Local only when ``uncached <= max_local_tokens``, which bounds the
    stall a local prefill adds to the decode worker's running requests, when the decode worker
    has the blocks free now (a reservation would wait for them in the router's queue, in the
    queue's order; a local prefill would wait at the worker; a block loaded from a tier below
    its pool needs a free block as one sent does), and only when strictly cheaper: ties go
    remote."""
    uncached = max(0, num_tokens - decode_hit_blocks * decode.block_size)
    local = (decode.stats.queued_tokens + decode.pending_tokens + uncached
             + decode_adapter_tokens + stall_weight * decode.stats.num_running * uncached)
    to_send = num_blocks - decode_hit_blocks
    remote = (float("inf") if prefill is None
              else prefill.cost + num_tokens + to_send * tokens_per_block)
    in_pool = decode_hit_blocks if decode_pool_blocks is None else decode_pool_blocks
    allowed = uncached <= max_local_tokens and num_blocks - in_pool <= decode.free_blocks
    return PrefillLocation("local" if allowed and local < remote else "remote", local, remote)
