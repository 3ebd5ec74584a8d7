"""The router's waiting queue: who may try to place a request next, and who is shed.

Every admitted request waits here for its *turn* to be placed (a decode reservation or a
colocated submit; also each new attempt after a failure or a bounce). One turn is held at a
time; the turn holder may itself wait for KV room, so when the pool is full the queue, not
the race between pollers, decides who gets the next free blocks. A newcomer that ranks
before the holder makes it yield (``outranked``; the router re-queues it, its waiting time
kept), so the holder is always the best-ranked request.

Order (``policy``):

- ``fcfs``: by arrival.
- ``priority``: by *effective level* ``floor(priority - waited_s / aging_s)``, lower first:
  a waiting request gains one level per ``aging_s`` seconds, so low priority is never
  starved: a request of priority ``p`` waiting behind an endless stream of priority ``q < p``
  gets its turn within ``(p - q + 1) * aging_s`` seconds plus one placement. Inside a level,
  tenants take turns (the tenant served least recently first; requests without a tenant
  share one anonymous tenant), then arrival. A tenant is remembered only while it has a
  request waiting or holding the turn: one that comes back after that counts as never served,
  so the table holds at most one entry per queued request however many tenants come and go.

Shedding (``Router._admit``): when the router is full, a new request that ranks before the
worst waiting one takes its place and that one fails with QueueFullError (RESOURCE_EXHAUSTED,
with a retry hint); otherwise the new request is refused the same way.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from pdserve.router.errors import QueueFullError
from pdserve.router.flight import Flight

POLICIES = ("fcfs", "priority")


class AdmissionQueue:
    """See the module docstring."""

    def __init__(self, policy: str = "fcfs", aging_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 wake: Callable[[], None] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        if not aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {aging_s}")
        self.policy = policy
        self.aging_s = aging_s
        self._clock = clock
        self._waiting: dict[str, tuple[Flight, asyncio.Future]] = {}  # request_id -> turn
        self._holder: str | None = None  # request id holding the turn
        self._served: dict[str, float] = {}  # tenant -> when it last got a turn
        self._num_queued: dict[str, int] = {}  # tenant -> its requests waiting or holding
        self._holder_flight: Flight | None = None
        self._wake = wake  # called when the holder is outranked (it may be waiting for room)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def num_tenants(self) -> int:
        """Tenants remembered: those with a request waiting or holding the turn."""
        return len(self._num_queued)

    def key(self, flight: Flight, now: float | None = None) -> tuple:
        """Rank of a waiting request: the smallest key goes first."""
        if self.policy == "fcfs":
            return (flight.arrival,)
        now = self._clock() if now is None else now
        waited = 0.0 if flight.queued_at is None else now - flight.queued_at
        level = math.floor(flight.request.params.priority - waited / self.aging_s)
        return level, self._served.get(flight.tenant or "", -math.inf), flight.arrival

    async def turn(self, flight: Flight, timeout: float | None) -> None:
        """Wait for ``flight``'s turn (at most ``timeout`` s); call :meth:`done` after."""
        future = asyncio.get_running_loop().create_future()
        if flight.queued_at is None:  # kept across re-queues: aging counts the whole wait
            flight.queued_at = self._clock()
        self._waiting[flight.request_id] = (flight, future)
        tenant = flight.tenant or ""
        self._num_queued[tenant] = self._num_queued.get(tenant, 0) + 1
        self._dispatch()
        if self.outranked(self._holder_flight) and self._wake is not None:
            self._wake()
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except BaseException:
            if self._waiting.pop(flight.request_id, None) is not None:
                self._leave(flight)  # still waiting (granted or shed: done() or shedding left)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.done(flight)  # granted at the last moment: hand it on
            future.cancel()
            raise

    def done(self, flight: Flight) -> None:
        """``flight`` has finished placing (or gave up): the next one gets the turn."""
        if self._holder == flight.request_id:
            self._holder, self._holder_flight = None, None
            self._leave(flight)
            self._dispatch()

    def outranked(self, flight: Flight | None) -> bool:
        """Does a waiting request rank before ``flight`` (the holder)?"""
        if flight is None or not self._waiting:
            return False
        now = self._clock()
        best = min(self.key(f, now) for f, _ in self._waiting.values())
        return best < self.key(flight, now)

    def shed_worst(self, newcomer_key: tuple) -> bool:
        """Fail the worst waiting request if ``newcomer_key`` ranks before it; True if so."""
        if not self._waiting:
            return False
        now = self._clock()
        worst_id, (worst, future) = max(self._waiting.items(),
                                        key=lambda kv: self.key(kv[1][0], now))
        if self.key(worst, now) <= newcomer_key:
            return False
        del self._waiting[worst_id]
        self._leave(worst)
        future.set_exception(QueueFullError(
            f"shed for a higher-priority request (priority {worst.request.params.priority}); "
            f"retry in {self.retry_after_s():.0f} s", retry_after_s=self.retry_after_s()))
        return True

    def retry_after_s(self) -> float:
        """A hint for refused clients: roughly how long the queue ahead takes to move."""
        return max(1.0, 0.05 * len(self._waiting))

    def _leave(self, flight: Flight) -> None:
        """``flight`` neither waits nor holds the turn any more: its tenant is forgotten once
        it has no other request here."""
        tenant = flight.tenant or ""
        left = self._num_queued[tenant] - 1
        if left:
            self._num_queued[tenant] = left
        else:
            del self._num_queued[tenant]
            self._served.pop(tenant, None)

    def _dispatch(self) -> None:
        if self._holder is not None or not self._waiting:
            return
        now = self._clock()
        request_id, (flight, future) = min(self._waiting.items(),
                                           key=lambda kv: self.key(kv[1][0], now))
        del self._waiting[request_id]
        self._holder, self._holder_flight = request_id, flight
        self._served[flight.tenant or ""] = now
        future.set_result(None)
