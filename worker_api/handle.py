"""The one way the router (and the cluster) reaches a worker: :class:`WorkerHandle`, whatever
hosts the worker (a Ray actor, ``cluster.actors.RayHandle``, or this process,
``workers.host.LocalHandle``). Every variable that holds a handle has this type, so a call
the protocol lacks is a type error (``make lint`` runs mypy), never a ``getattr``.

A handle is made for one router, named at construction: several routers share a decode or
colocated worker, and each one's ``reserve``, ``submit`` and ``poll`` concern only its own
requests (a router silent past the worker's orphan timeout has them freed).

Which calls a role answers: ``stats``, ``abort``, ``kv_snapshot`` and ``drain_kv_events``
every role; ``reserve``, ``renew`` a decode worker; ``prefill`` a prefill worker; ``submit``
and ``poll`` a decode or colocated worker. The router makes each call only of a worker whose
role answers it (``WorkerStats.role``).
"""

from __future__ import annotations

from typing import Protocol

from pdserve.worker_api.deltas import StepDeltas
from pdserve.worker_api.messages import (
    KVEvents,
    KVSnapshot,
    PrefillResult,
    Reservation,
    WorkRequest,
)
from pdserve.worker_api.stats import WorkerStats


class WorkerHandle(Protocol):
    """A worker as one router reaches it. The worker's refusals (``worker_api.refusals``)
    come out of every call as their own types; any other error means the worker (or the way to
    it) failed."""

    worker_id: str
    role: str  # one of ROLES

    async def stats(self) -> WorkerStats:
        """The worker's load and memory now (taken after every call it received before)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Drop the request and free what it holds; nothing when the worker does not hold it."""
        ...

    async def reserve(self, request: WorkRequest) -> Reservation:
        """Decode: blocks for the request under a lease, until its KV arrives; NoRoomNow or
        NeverFits when the worker declines."""
        ...

    async def renew(self, request_id: str) -> float | None:
        """Decode: extend the reservation's lease; its new deadline, or None if not reserved
        (committed, or already failed)."""
        ...

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        """Prefill: compute the prompt, send its KV to the reservation's decode worker and
        return token 0; NeverFits when the worker can never run it, RequestFaultError when the
        request made the step fail."""
        ...

    async def submit(self, request: WorkRequest) -> None:
        """Decode or colocated: queue the request to be prefilled and decoded here;
        NeverFits when the worker can never run it, DuplicateRequestId when it holds the id."""
        ...

    async def poll(self, timeout: float) -> StepDeltas:
        """Decode or colocated: this router's deltas produced since its last poll (waits up to
        ``timeout`` s for some)."""
        ...

    async def kv_snapshot(self) -> KVSnapshot | None:
        """Every block hash the worker's prefix cache holds (None: prefix caching is off)."""
        ...

    async def drain_kv_events(self) -> KVEvents | None:
        """The worker's prefix-cache changes since the last drain, as the next batch of its
        log (None: none to hand over through the handle, as when the worker publishes them
        elsewhere; a reader that misses batches resyncs from a snapshot)."""
        ...
