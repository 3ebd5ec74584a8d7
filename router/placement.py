"""Placing a request on a worker of a role (the router's PLACING phase, ``router.core``).

The request first waits its turn in the admission queue (``router.admission``: priority,
then tenant fairness, then arrival). Holding the turn, it tries the workers of the role in
rank order (decode: ``pairing.rank_decode``; colocated: the router's prefill routing, since
a colocated worker computes the prompt) until one takes it. A worker without room now
(NoRoomNow) is skipped; one that says the request can never fit (NeverFits) counts toward
RequestTooLargeError; any other failure is that worker's problem (it is suspected, and told to
drop the request in case it holds it). When no worker has room the request waits for one to
come back (a request leaving, or the next stats refresh), bounded by its deadline and
``reserve_wait_s``, and gives the turn up if a better request queued meanwhile.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from pdserve.router.admission import AdmissionQueue
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (
    DeadlineExceededError,
    NoWorkersError,
    QueueFullError,
    RequestTooLargeError,
)
from pdserve.router.flight import Flight
from pdserve.router.pairing import WorkerLoad
from pdserve.router.workers import Workers
from pdserve.worker_api import NeverFits, NoRoomNow


class _Outranked(Exception):
    """The request holding the placement turn yields it to a better one (see admission)."""


class Placer:
    """Places requests on the router's workers (see the module docstring)."""

    def __init__(self, config: RouterConfig, workers: Workers, queue: AdmissionQueue,
                 room: asyncio.Event):
        self.config, self.workers, self.queue = config, workers, queue
        self.room = room  # set whenever a request leaves (blocks came back)

    async def place(self, flight: Flight, role: str,
                    place_on: Callable[[Flight, WorkerLoad], Awaitable],
                    rank: Callable[[list[WorkerLoad]], list[WorkerLoad]]):
        """Try the workers of ``role`` in ``rank`` order until one takes the request; wait
        when none can.

        A worker without room now (NoRoomNow) is skipped; NeverFits means it can never hold
        the request (RequestTooLargeError once every worker says so); any other error is that
        worker's problem (its poller or the pool manager deals with it): skip it too.
        """
        try:
            while True:
                await self._take_turn(flight)
                try:
                    return await self._place_now(flight, role, place_on, rank)
                except _Outranked:
                    continue  # back in the queue behind a better request
                finally:
                    self.queue.done(flight)
        finally:
            flight.queued_at = None  # placed (or gone): the next attempt queues afresh

    async def _take_turn(self, flight: Flight) -> None:
        """Wait in the admission queue for this request's turn to place (see admission)."""
        limit = self.config.reserve_wait_s
        timeout = flight.budget(math.inf if limit is None else limit)
        try:
            await self.queue.turn(flight, None if timeout == math.inf else timeout)
        except TimeoutError:
            flight.budget(math.inf)  # DeadlineExceededError if the deadline went
            raise QueueFullError(f"no turn to place within {limit:g} s; retry later",
                                 retry_after_s=self.queue.retry_after_s()) from None
        if flight.timeline is not None:
            flight.timeline.turn()

    async def _place_now(self, flight: Flight, role: str,
                         place_on: Callable[[Flight, WorkerLoad], Awaitable],
                         rank: Callable[[list[WorkerLoad]], list[WorkerLoad]]):
        cfg = self.config
        started = time.monotonic()
        while True:
            candidates = rank(self.workers.live(role))
            too_large: list[NeverFits] = []
            for load in candidates:
                worker_id = load.stats.worker_id
                # Before the call: a colocated worker streams as soon as it has the request,
                # and its first delta must already find this attempt's worker.
                flight.decode_id = worker_id
                try:
                    return await place_on(flight, load)
                except NoRoomNow:
                    pass
                except DeadlineExceededError:
                    flight.decode_id = None
                    raise
                except NeverFits as exc:
                    too_large.append(exc)
                except Exception as exc:  # noqa: BLE001 - that worker's problem, not the request's
                    self.workers.suspect(worker_id, f"{role} call failed: {exc}")
                    self.workers.abort_later(worker_id, flight.request_id)  # it may hold it anyway
                flight.decode_id = None
            waited = time.monotonic() - started
            if candidates and len(too_large) == len(candidates):
                raise RequestTooLargeError(str(too_large[0]))
            if not candidates and waited > cfg.worker_wait_s:
                raise NoWorkersError(f"no {role} workers (waited {waited:.0f} s)")
            if candidates and cfg.reserve_wait_s is not None and waited > cfg.reserve_wait_s:
                raise QueueFullError(f"no {role} worker had room for {waited:.0f} s; retry later")
            await self.wait_for_room(flight)
            if self.queue.outranked(flight):
                raise _Outranked

    async def wait_for_room(self, flight: Flight) -> None:
        """Until a request leaves or the stats refresh, bounded by the deadline."""
        self.room.clear()
        wait = self.config.stats_interval_s
        try:
            await asyncio.wait_for(self.room.wait(), flight.budget(wait))
        except TimeoutError:
            flight.budget(wait)  # DeadlineExceededError if that was the deadline
