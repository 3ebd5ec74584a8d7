"""One request's life on the router: an explicit state machine.

States (``Phase``) and the only transitions allowed (``TRANSITIONS``; ``Flight.move_to`` is
the one place that performs them and refuses any other):

| from        | to                                  | when                                      |
|-------------|-------------------------------------|-------------------------------------------|
| ADMITTED    | PLACING, DONE                       | admitted (bounded by requests and tokens) |
| PLACING     | PREFILLING, DECODING, MIGRATING,    | a decode reservation (waits for room up   |
|             | DONE                                | to the deadline), or a colocated submit   |
| PREFILLING  | DECODING, MIGRATING, DONE           | token 0 back from the prefill worker; the |
|             |                                     | router renews the lease meanwhile         |
| DECODING    | MIGRATING, DONE                     | deltas stream from the decode worker      |
| MIGRATING   | PLACING, DONE                       | the attempt failed; a new attempt starts  |
| DONE        | (none)                              | finished, failed, cancelled or expired    |

An attempt is one (reservation, prefill, decode) or one colocated submit. Each has an epoch
(``WorkRequest.attempt``) that workers echo in every delta, so deltas of an older attempt
are dropped. A failed attempt before any token is streamed is retried (``max_attempts``);
after tokens were streamed it is a migration (``migration_limit``): the next attempt
re-prefills prompt + the tokens already streamed and continues the same stream.

Identity: the router makes every id a worker sees. A flight has a ``uid`` (128 random bits,
so unique across routers) and each attempt a work id, ``<uid>.<attempt>``
(``WorkRequest.request_id``), which every worker-side table keys on. The client's id is the
flight's ``label``: echoed back and logged, never a key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum

from pdserve.router.errors import DeadlineExceededError
from pdserve.router.otel import RequestTimeline
from pdserve.router.pairing import DecodeRouting, PrefillLocation, PrefillRouting
from pdserve.worker_api import WorkRequest


class Phase(IntEnum):
    ADMITTED = 0
    PLACING = 1
    PREFILLING = 2
    DECODING = 3
    MIGRATING = 4
    DONE = 5


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.ADMITTED: frozenset({Phase.PLACING, Phase.DONE}),
    Phase.PLACING: frozenset({Phase.PREFILLING, Phase.DECODING, Phase.MIGRATING, Phase.DONE}),
    Phase.PREFILLING: frozenset({Phase.DECODING, Phase.MIGRATING, Phase.DONE}),
    Phase.DECODING: frozenset({Phase.MIGRATING, Phase.DONE}),
    Phase.MIGRATING: frozenset({Phase.PLACING, Phase.DONE}),
    Phase.DONE: frozenset(),
}


class AttemptFailed(Exception):
    """The current attempt cannot go on (a worker died, failed, or went silent)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # metrics label: worker_lost | worker_failed | timeout


def new_uid() -> str:
    """A flight's id: random, so no two routers ever make the same one."""
    return uuid.uuid4().hex


def work_id(uid: str, attempt: int) -> str:
    """The id workers know an attempt by (``WorkRequest.request_id``)."""
    return f"{uid}.{attempt}"


@dataclass
class Flight:
    """A request in flight on the router."""

    request: WorkRequest  # what workers get; replaced (new attempt) on every retry
    label: str = ""  # the client's id for the request (or the door's): echoed, never a key
    deadline: float | None = None  # time.monotonic() instant, None = no deadline
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestDelta | Exception
    arrival: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.ADMITTED
    output_ids: list[int] = field(default_factory=list)  # every token streamed so far
    num_retries: int = 0  # failed attempts before the first token
    num_migrations: int = 0  # failed attempts after it
    prefill_id: str | None = None  # the current attempt's prefill worker
    prefill_routing: PrefillRouting | None = None  # why it was chosen
    decode_routing: DecodeRouting | None = None  # why the decode worker was chosen
    prefill_location: PrefillLocation | None = None  # prefill or decode worker, and why
    decode_id: str | None = None  # the worker streaming deltas (decode or colocated)
    prompt_sent: tuple | None = None  # (WorkerLoad, its entry) of the worker computing the
    # current attempt's prompt, until its first token comes (WorkerLoad.computed)
    trace: object | None = None  # RequestTrace, set once the first prefill returns
    tenant: str | None = None  # who sent it (fair turns inside a priority level)
    queued_at: float | None = None  # time.monotonic() it last entered the admission queue
    num_bounces: int = 0  # attempts a full decode worker handed back (not failures)
    max_tokens: int | None = None  # as the client gave it (PreparedRequest.max_tokens); None:
    # it gave none, so the KV cap lowers request.params.max_tokens instead of refusing
    last_token_at: float | None = None
    timeline: RequestTimeline | None = None  # what its OpenTelemetry trace is made of (None:
    # tracing is off)

    @property
    def request_id(self) -> str:
        """The current attempt's work id, what workers key on."""
        return self.request.request_id

    @property
    def uid(self) -> str:
        return self.request_id.rpartition(".")[0]

    @property
    def name(self) -> str:
        """How logs name the request: the client's label and the attempt's work id."""
        return f"{self.label!r} ({self.request_id})" if self.label else self.request_id

    @property
    def attempt(self) -> int:
        return self.request.attempt

    def move_to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"{self.name}: no transition {self.phase.name} -> "
                               f"{phase.name}")
        self.phase = phase

    def next_attempt(self) -> None:
        """Start a new attempt that resumes after the tokens already streamed."""
        self.move_to(Phase.MIGRATING)
        attempt = self.attempt + 1
        self.request = dataclasses.replace(self.request, request_id=work_id(self.uid, attempt),
                                           attempt=attempt,
                                           output_token_ids=list(self.output_ids))
        self.prefill_id = self.decode_id = None
        self.queue = asyncio.Queue()  # whatever the failed attempt queued is dropped

    def wall_deadline(self) -> float | None:
        """The deadline as ``time.time()``, which travels to workers in other processes."""
        if self.deadline is None:
            return None
        return time.time() + (self.deadline - time.monotonic())

    def budget(self, limit: float) -> float:
        """``limit`` cut to what is left of the deadline; DeadlineExceededError if nothing."""
        if self.deadline is None:
            return limit
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError("the request's deadline passed")
        return min(limit, left)

    async def bounded(self, call: Callable[[], Awaitable], limit: float, what: str):
        """Await ``call()`` for at most ``budget(limit)``; past it DeadlineExceededError if the
        deadline went, else AttemptFailed (the worker is too slow: move the request)."""
        budget = self.budget(limit)
        try:
            return await asyncio.wait_for(call(), budget)
        except TimeoutError:
            self.budget(limit)
            raise AttemptFailed("timeout", f"{what} took longer than {limit:g} s") from None

