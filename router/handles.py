"""What the router needs from a worker, whatever hosts it (a Ray actor or this process).

The router only ever talks to workers through these async handles; it never sees worker
internals. Messages are the dataclasses of ``pdserve.engine.messages``; ``poll`` returns a
pure decode step's deltas as one compact ``TokenDeltas`` (``expand_deltas`` makes one
``RequestDelta`` per request of it).
"""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.messages import (
    PrefillResult,
    Reservation,
    StepDeltas,
    WorkerStats,
    WorkRequest,
)


class WorkerHandle(Protocol):
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"

    async def stats(self) -> WorkerStats: ...

    async def abort(self, request_id: str) -> None: ...


class DecodeHandle(WorkerHandle, Protocol):
    async def reserve(self, request: WorkRequest) -> Reservation: ...

    async def renew(self, request_id: str) -> float | None:
        """Extend the reservation's lease; its new deadline, or None if not reserved."""
        ...

    async def poll(self, timeout: float) -> StepDeltas: ...


class PrefillHandle(WorkerHandle, Protocol):
    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult: ...


class ColocatedHandle(WorkerHandle, Protocol):
    async def submit(self, request: WorkRequest) -> None: ...

    async def poll(self, timeout: float) -> StepDeltas: ...


class NoCapacity(Exception):
    """A decode worker refused a reservation for lack of free blocks (try another)."""
