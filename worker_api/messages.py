"""The messages between the router and a worker, besides the deltas (``worker_api.deltas``) and
the stats (``worker_api.stats``): typed dataclasses sent over Ray calls, never KV data, which
moves through ``pdserve.kv_transfer`` frames. :class:`WorkRequest` in, :class:`Reservation`
and :class:`PrefillResult` back; a worker's KV events (:class:`KVEvents`, :class:`KVSnapshot`):
what its prefix cache holds, by block hash, for the routers' shared index.

Ids: ``request_id`` in every message is the router's work id for one attempt of a request
(``router.flight``), unique across routers and attempts; workers key everything on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.deltas import PrefixSource, RequestDelta
from pdserve.worker_api.sampling_params import SamplingParams

# KV tiers, best first: a block in the pool is read in place; one in host memory or on the
# worker's disk is loaded back into the pool before it is used (docs/kv-tiers.md)
KV_TIER_POOL, KV_TIER_HOST, KV_TIER_DISK = 0, 1, 2
KV_TIER_NAMES = ("pool", "host", "disk")
MAX_KV_SENDS = 8  # groups of layers a PrefillResult reports the KV's sends in (a trace's spans)
# What reading a block back from a tier moves per second before the worker has measured a read
# of that tier (the worker's load rule and the routers' cost both assume it): host memory to
# the device at about what a PCIe 4 x16 link sustains, a local NVMe disk at what one sustains
# for large sequential reads
KV_TIER_ASSUMED_READ_BYTES_PER_S = {KV_TIER_HOST: 4e9, KV_TIER_DISK: 1e9}


@dataclass
class WorkRequest:
    """A validated request as the router hands it to a worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # random stream key, fixed by the router so every worker samples alike
    arrival_time: float  # router's time.time() when the request arrived
    deadline: float | None = None  # time.time() after which workers drop it (None = never)
    attempt: int = 1  # the router's attempt epoch: deltas carry it, stale ones are dropped
    output_token_ids: list[int] = field(default_factory=list)  # already streamed (migration):
    # the worker computes prompt + these, and samples output position len(output_token_ids)
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass(frozen=True)
class KVEvents:
    """One batch of a worker's prefix-cache changes, by block hash (``engine.kv_cache.prefix_hash``:
    salted, so token ids never leave the worker). ``number`` counts the batches of one event
    log (``log_id``, new with each engine) from 1: a reader that gets a number other than its
    last + 1, or another log's, has missed some and resyncs from a :class:`KVSnapshot`. A
    hash is in one list at most: its state at the end of the batch."""

    log_id: str
    number: int
    stored: tuple[bytes, ...]  # blocks now held (and matchable) on the worker
    removed: tuple[bytes, ...]  # blocks it holds in no tier any more
    stored_tiers: tuple[int, ...] = ()  # the best tier holding each of ``stored`` (KV_TIER_*;
    # empty: all in the pool, a worker without KV tiers)

    def tier_of(self, i: int) -> int:
        """The tier of ``stored[i]``: the pool unless ``stored_tiers`` says otherwise."""
        return self.stored_tiers[i] if self.stored_tiers else KV_TIER_POOL


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a worker's prefix cache holds, as of its log's batch ``number``
    (batches up to it are in; later ones apply on top)."""

    log_id: str
    number: int
    hashes: frozenset[bytes]
    tiers: dict[bytes, int] = field(default_factory=dict)  # the hashes of ``hashes`` held only
    # below the pool: their best tier (KV_TIER_HOST or KV_TIER_DISK); the rest are in the pool


@dataclass
class Reservation:
    """Blocks a decode worker holds for one request until its KV arrives (a lease)."""

    request_id: str
    worker_id: str  # the decode worker
    transfer_address: str  # its KV endpoint, host:port
    transfer_id: int  # int64 key of the reservation on the wire
    epoch: int  # fencing epoch: frames of another epoch are dropped
    num_blocks: int  # blocks reserved (prompt tokens / block size, rounded up)
    lease_deadline: float  # time.time() after which the decode worker frees the blocks
    rank_addresses: tuple[str, ...] = ()  # a tensor parallel decode worker: each rank's KV
    # endpoint in rank order (the first is transfer_address); each takes only its K/V heads
    num_cached_blocks: int = 0  # leading blocks the decode worker's prefix cache holds: the
    # prefill worker sends only the blocks after them
    grammar_compile_s: float | None = None  # the decode worker's compile of the request's
    # grammar (None: free output)
    grammar_cache_hit: bool | None = None  # its grammar cache held it
    prefix_source: PrefixSource | None = None  # where the decode worker found the leading
    # blocks it holds (its pool, or loaded from its tiers)


@dataclass(frozen=True)
class KVSend:
    """Layers ``[first_layer, end_layer)`` of a prompt's KV leaving a prefill worker (rank 0's
    frames of them), in seconds after the prompt's first chunk was scheduled."""

    first_layer: int
    end_layer: int  # exclusive
    queued_s: float  # the first of its frames packed and queued on the sender
    sent_s: float  # the last of its frames left (every route's copy)
    num_bytes: int  # payload bytes of its frames


@dataclass
class PrefillResult:
    """What a prefill worker returns once token 0 is sampled and the KV has been sent."""

    request_id: str
    first: RequestDelta  # token 0 (finish_reason set if it already ends the request)
    queue_time_s: float  # arrival at the worker -> first chunk scheduled
    prefill_time_s: float  # first chunk scheduled -> token 0 sampled
    transfer_time_s: float  # token 0 sampled -> last frame (commit) sent
    transfer_bytes: int  # KV payload bytes sent
    num_cached_tokens: int  # prompt tokens served by the prefill worker's prefix cache
    prefix_source: PrefixSource | None = None  # where it found them (pool, host, disk)
    grammar_compile_s: float | None = None  # the prefill worker's compile of the request's
    # grammar (None: free output)
    grammar_cache_hit: bool | None = None  # its grammar cache held it
    kv_sends: tuple[KVSend, ...] = ()  # the KV's frames in at most MAX_KV_SENDS groups of
    # consecutive layers, each sent while later layers computed (prefill_worker/worker.py)


