r"""The worker protocol: what the router and a worker say to each other, whatever hosts the
worker (a Ray actor or this process).

- the calls (:class:`WorkerHandle` and its per-role kinds): the router only ever reaches a
  worker through a handle with these methods;
- the messages (typed dataclasses, sent over Ray calls; KV data never travels in them, it moves
  through ``pdserve.kv_transfer`` frames): :class:`WorkRequest` in, :class:`Reservation` and
  :class:`PrefillResult` back, a step's :class:`RequestDelta`\ s polled, :class:`WorkerStats`;
- a worker's KV events (:class:`KVEvents`, :class:`KVSnapshot`): what its prefix cache holds,
  by block hash, for the routers' shared index;
- the refusals: :class:`NoRoomNow` (no free KV blocks now: try another worker, or wait) and
  :class:`NeverFits` (this worker can never run the request), raised by the worker and seen
  by the router as the same types through every handle; :class:`DuplicateRequestId`, an id the
  worker holds already; and :class:`RequestFaultError`, a request that made a step fail.

Ids: ``request_id`` in every message is the router's work id for one attempt of a request
(``router.flight``), unique across routers and attempts; workers key everything on it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

import numpy as np

from pdserve.engine.sampling_params import SamplingParams

ROLES = ("prefill", "decode", "colocated")  # a worker's role, WorkerHandle.role


class Refusal(Exception):
    """A worker declined a request; neither the request nor the worker is at fault."""


class NoRoomNow(Refusal):
    """No free KV blocks for the request right now: try another worker, or wait for room."""


class NeverFits(Refusal, ValueError):
    """This worker can never run the request: longer than its context, more KV blocks than its
    pool holds, or ids and values its model cannot take. A client error naming the limit."""


class DuplicateRequestId(ValueError):
    """A worker already holds a request under this id. Ids are the router's (one per
    attempt, never the client's), so a second one is a replay or a bug: refused, never merged
    into the first and never dropped with success."""


class RequestFaultError(RuntimeError):
    """The request itself made a step fail (a prefill worker's future fails with it; a
    streaming worker sends a ``faulted`` delta instead): it failed alone, and running it on
    another worker would fail the same way, so it is never retried or migrated."""


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


@dataclass
class RequestDelta:
    """What one step produced for one request (the unit streamed to clients)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step
    text: str  # text delta (held back while it could still become a stop string)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    logprobs: list[dict[int, float]] | None = None  # per new token, when requested
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this delta included
    error: str | None = None  # why an "abort" happened when the worker aborted on its own
    attempt: int = 1  # WorkRequest.attempt of the request this delta belongs to
    deadline_exceeded: bool = False  # the abort happened because the deadline passed
    preempted: bool = False  # a decode worker handed it back for lack of blocks: place again
    faulted: bool = False  # the request itself made its step fail (``error`` says how): it
    # ends here, failed, and is never moved to another worker as if this one had died
    queue_time_s: float | None = None  # on the first token a worker prefilled itself: arrival
    # at the worker -> first chunk scheduled (colocated traces; the prefill worker's are in
    # PrefillResult)
    prefill_time_s: float | None = None  # with queue_time_s: first chunk -> this token sampled


@dataclass(slots=True)
class _NewTokens:
    """One new token for each of several requests, none final, none with logprobs: the
    deltas of a pure decode step's rows that go on, kept as columns (StepDeltas' encoding)."""

    request_ids: list[str]
    token_ids: list[int]
    attempts: list[int]
    num_prompt_tokens: np.ndarray  # int64, one per request
    num_output_tokens: np.ndarray  # int64: generated so far, this token included
    texts: list[str] | None = None  # each token's text once filled (None: not yet)

    def __len__(self) -> int:
        return len(self.request_ids)

    def deltas(self) -> list[RequestDelta]:
        texts = self.texts if self.texts is not None else [""] * len(self)
        return [RequestDelta(request_id, [token_id], text, None, None, num_prompt, num_output,
                             attempt=attempt)
                for request_id, token_id, attempt, num_prompt, num_output, text
                in zip(self.request_ids, self.token_ids, self.attempts,
                       self.num_prompt_tokens.tolist(), self.num_output_tokens.tolist(),
                       texts, strict=True)]

    def select(self, index: list[int]) -> _NewTokens:
        """The requests at ``index`` (ascending)."""
        texts = None if self.texts is None else [self.texts[i] for i in index]
        return _NewTokens([self.request_ids[i] for i in index],
                          [self.token_ids[i] for i in index], [self.attempts[i] for i in index],
                          self.num_prompt_tokens[index], self.num_output_tokens[index], texts)


class StepDeltas:
    """The deltas of one or more steps in the order they were made: what a step returns, a
    worker's outbox holds and a poll ships. Iterating gives one :class:`RequestDelta` per
    request per step; ``len`` counts them.

    This class alone chooses how deltas are encoded, in memory and on the wire (pickled by
    Ray): a pure decode step's deltas that only add one token (most of them) are kept as
    columns, one list per field, so a step makes no object per request and a poll pickles
    one object per step; every other delta is a RequestDelta. Readers never see the
    difference."""

    __slots__ = ("_parts", "_size")

    def __init__(self, deltas: Iterable[RequestDelta] = ()) -> None:
        self._parts: list[RequestDelta | _NewTokens] = list(deltas)
        self._size = len(self._parts)

    @classmethod
    def new_tokens(cls, request_ids: list[str], token_ids: list[int], attempts: list[int],
                   num_prompt_tokens: np.ndarray, num_output_tokens: np.ndarray) -> StepDeltas:
        """The deltas of requests that each got one token (``token_ids[i]`` for
        ``request_ids[i]``), none final, none with logprobs; the lists are kept as given."""
        out = cls()
        if request_ids:
            out._add(_NewTokens(request_ids, token_ids, attempts, num_prompt_tokens,
                                num_output_tokens))
        return out

    def _add(self, part: RequestDelta | _NewTokens) -> None:
        self._parts.append(part)
        self._size += len(part) if type(part) is _NewTokens else 1

    def append(self, delta: RequestDelta) -> None:
        self._parts.append(delta)
        self._size += 1

    def extend(self, deltas: StepDeltas | Iterable[RequestDelta]) -> None:
        if type(deltas) is StepDeltas:
            self._parts.extend(deltas._parts)
            self._size += deltas._size
        else:
            for delta in deltas:
                self.append(delta)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[RequestDelta]:
        deltas: list[RequestDelta] = []
        for part in self._parts:
            if type(part) is _NewTokens:
                deltas += part.deltas()
            else:
                deltas.append(part)
        return iter(deltas)

    def __repr__(self) -> str:
        return f"StepDeltas({list(self)!r})"

    def read(self, token: Callable[[str, int, str], None],
             delta: Callable[[RequestDelta], None]) -> None:
        """Iterating without making the objects, for a reader that keeps up with every step
        (the offline LLM): ``token(request_id, token_id, text)`` for each delta that only
        adds one token and is kept as columns, ``delta(d)`` for every other; in order."""
        for part in self._parts:
            if type(part) is _NewTokens:
                texts = part.texts if part.texts is not None else repeat("")
                list(map(token, part.request_ids, part.token_ids, texts))
            else:
                delta(part)

    def fill_text(self, piece: Callable[[str, int, int], str],
                  end: Callable[[str, int], str]) -> None:
        """Add to each delta's text ``piece(request_id, attempt, token_id)`` of each of its new
        tokens, then, on a final delta, ``end(request_id, attempt)``; in order, once."""
        for part in self._parts:
            if type(part) is _NewTokens:
                part.texts = list(map(piece, part.request_ids, part.attempts, part.token_ids))
                continue
            for token_id in part.new_token_ids:
                part.text += piece(part.request_id, part.attempt, token_id)
            if part.finish_reason is not None:
                part.text += end(part.request_id, part.attempt)

    def split(self, owner: Callable[[str, int, bool], Hashable | None]
              ) -> dict[Hashable, StepDeltas]:
        """The deltas by ``owner(request_id, attempt, is_final)``, each owner's in order (an
        owner of None: dropped). Called once per delta, in order."""
        out: dict[Hashable, StepDeltas] = {}
        for part in self._parts:
            if type(part) is not _NewTokens:
                key = owner(part.request_id, part.attempt, part.finish_reason is not None)
                if key is not None:
                    out.setdefault(key, StepDeltas()).append(part)
                continue
            keys = list(map(owner, part.request_ids, part.attempts, repeat(False)))
            if keys.count(keys[0]) == len(keys):  # one owner (the usual case): kept whole
                if keys[0] is not None:
                    out.setdefault(keys[0], StepDeltas())._add(part)
                continue
            rows: dict[Hashable, list[int]] = {}
            for row, key in enumerate(keys):
                rows.setdefault(key, []).append(row)
            for key, index in rows.items():
                if key is not None:
                    out.setdefault(key, StepDeltas())._add(part.select(index))
        return out


@dataclass(frozen=True)
class KVEvents:
    """One batch of a worker's prefix-cache changes, by block hash (``engine.prefix_hash``:
    salted, so token ids never leave the worker). ``number`` counts the batches of one event
    log (``log_id``, new with each engine) from 1: a reader that gets a number other than its
    last + 1, or another log's, has missed some and resyncs from a :class:`KVSnapshot`. A
    hash is in one list at most: its state at the end of the batch."""

    log_id: str
    number: int
    stored: tuple[bytes, ...]  # blocks now cached (and matchable) on the worker
    removed: tuple[bytes, ...]  # blocks evicted since


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a worker's prefix cache holds, as of its log's batch ``number``
    (batches up to it are in; later ones apply on top)."""

    log_id: str
    number: int
    hashes: frozenset[bytes]


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


@dataclass
class WorkerStats:
    """A worker's load and memory, for the registry, the router's pairing and metrics."""

    worker_id: str
    role: str  # one of ROLES
    total_blocks: int
    free_blocks: int  # allocatable now (free + evictable cached)
    used_blocks: int  # owned by requests or reservations
    cached_blocks: int  # evictable prefix-cache blocks
    num_running: int
    num_waiting: int  # queued prompts, or reservations waiting for KV
    queued_tokens: int  # prompt tokens not computed yet
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    ledger: dict = field(default_factory=dict)  # MemoryLedger.to_dict()
    transfer_address: str = ""  # decode workers: KV endpoint host:port
    draining: bool = False  # takes no new requests
    error: str | None = None  # set when the worker's engine loop died: it takes no work
    num_bounces: int = 0  # preemptions that handed a request back to the router (a counter)
    flops_per_s: float = 0.0  # model FLOPs per forward second over the recent steps (achieved)
    bytes_per_s: float = 0.0  # weight + KV bytes per forward second over the recent steps
    peak_flops_per_s: float = 0.0  # dense matmul rate measured on the worker's device
    peak_bytes_per_s: float = 0.0  # copy bandwidth measured on the worker's device
    busy_fraction: float = 0.0  # forward seconds / wall seconds over the recent steps
    spec_num_drafts: int = 0  # speculative decoding counters: sequence-steps that verified drafts
    spec_num_draft_tokens: int = 0  # drafts proposed and verified
    spec_num_accepted_tokens: int = 0  # drafts the target accepted
    kv_log_id: str = ""  # the engine's KV event log (KVEvents.log_id; "": prefix caching off)
    kv_events_number: int = 0  # the last batch of it drained (a reader behind it missed some)
    taken_at: float = 0.0  # wall clock: every call the worker received before it is counted

    @property
    def utilization(self):
        """:class:`~pdserve.engine.roofline.Utilization` of these figures (what binds now)."""
        # lazy: roofline imports torch; the router reads these messages without it
        from pdserve.engine.roofline import Utilization

        return Utilization(self.flops_per_s, self.bytes_per_s, self.peak_flops_per_s,
                           self.peak_bytes_per_s, self.busy_fraction)


class WorkerHandle(Protocol):
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"

    async def stats(self) -> WorkerStats: ...

    async def abort(self, request_id: str) -> None: ...


class DecodeHandle(WorkerHandle, Protocol):
    async def reserve(self, request: WorkRequest) -> Reservation:
        """Blocks for the request under a lease; NoRoomNow or NeverFits when it declines."""
        ...

    async def submit(self, request: WorkRequest) -> None:
        """Queue the request to be prefilled here (conditional disaggregation); NeverFits
        when this worker can never run it."""
        ...

    async def renew(self, request_id: str) -> float | None:
        """Extend the reservation's lease; its new deadline, or None if not reserved."""
        ...

    async def poll(self, timeout: float) -> StepDeltas: ...


class PrefillHandle(WorkerHandle, Protocol):
    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult: ...


class ColocatedHandle(WorkerHandle, Protocol):
    async def submit(self, request: WorkRequest) -> None:
        """Queue the request; NeverFits when this worker can never run it."""
        ...

    async def poll(self, timeout: float) -> StepDeltas: ...
