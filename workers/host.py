"""A worker of any role hosted in this process. :class:`WorkerHost` makes a worker's calls
awaitable, the calling router named on each (a Ray worker actor, ``cluster.actors``, is one in
its own process); :class:`LocalHandle` is the worker protocol (``worker_api.WorkerHandle``)
over a host in this process, for one router."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeAlias, cast

from pdserve.worker_api import (
    KVEvents,
    KVSnapshot,
    PrefillResult,
    Reservation,
    StepDeltas,
    WorkerHandle,
    WorkerStats,
    WorkRequest,
)

if TYPE_CHECKING:  # the router process imports the host (cluster.actors), never a worker
    from pdserve.colocated_worker.worker import ColocatedWorker
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.prefill_worker.worker import PrefillWorker
    from pdserve.streaming_worker.mailboxes import MailboxSizes
    from pdserve.streaming_worker.worker import StreamingWorker

Worker: TypeAlias = "PrefillWorker | DecodeWorker | ColocatedWorker"  # what build_worker makes
STREAMING_ROLES = ("decode", "colocated")  # the roles whose worker is a StreamingWorker


class WorkerHost:
    """A worker in this process with its calls made awaitable and the calling router named on
    each: what a worker actor serves (``cluster.actors.WorkerActor``) and what the
    :class:`LocalHandle` of every router in this process calls. Polls run one at a time,
    whichever router asks and whatever thread it asks on (the host's own, or a worker
    channel's: ``workers.worker_channel``). A call the worker's role does not answer raises
    TypeError."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.worker_id = worker.worker_id
        self.role = worker.role
        self._poller = ThreadPoolExecutor(1, thread_name_prefix=f"poll-{self.worker_id}")
        self._poll_lock = threading.Lock()

    def _of_role(self, roles: tuple[str, ...], call: str) -> Worker:
        """The worker, when its role answers ``call`` (TypeError naming both otherwise)."""
        if self.role not in roles:
            raise TypeError(f"{call}: worker {self.worker_id} is a {self.role} worker")
        return self.worker

    def _decode(self, call: str) -> DecodeWorker:
        return cast("DecodeWorker", self._of_role(("decode",), call))

    def _prefill(self, call: str) -> PrefillWorker:
        return cast("PrefillWorker", self._of_role(("prefill",), call))

    def _streaming(self, call: str) -> StreamingWorker:
        return cast("StreamingWorker", self._of_role(STREAMING_ROLES, call))

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self.worker.abort(request_id))

    async def reserve(self, request: WorkRequest, router: str) -> Reservation:
        worker = self._decode("reserve")
        return await asyncio.wrap_future(worker.reserve(request, router))

    async def renew(self, request_id: str) -> float | None:
        worker = self._decode("renew")
        return await asyncio.wrap_future(worker.renew(request_id))

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        worker = self._prefill("prefill")
        return await asyncio.wrap_future(worker.prefill(request, reservation))

    async def submit(self, request: WorkRequest, router: str) -> None:
        worker = self._streaming("submit")
        await asyncio.wrap_future(worker.submit(request, router))

    def submit_blocking(self, request: WorkRequest, router: str) -> None:
        """:meth:`submit` on the calling thread (the worker checks and queues the request there,
        never waiting for its engine loop)."""
        self._streaming("submit").submit(request, router).result()

    async def poll(self, timeout: float, router: str) -> StepDeltas:
        """``router``'s deltas (TypeError, from the poll thread, for a prefill worker)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._poller, self.poll_blocking, timeout, router)

    def poll_blocking(self, timeout: float, router: str) -> StepDeltas:
        """:meth:`poll` on the calling thread (it blocks up to ``timeout``), after any poll in
        progress on another."""
        worker = self._streaming("poll")
        with self._poll_lock:
            return worker.poll(timeout, router=router)

    async def kv_snapshot(self) -> KVSnapshot | None:
        """Every block hash the worker's prefix cache holds (read on its engine loop)."""
        return await asyncio.wrap_future(self.worker.loop.call(self.worker.engine.kv_snapshot))

    async def drain_kv_events(self) -> KVEvents | None:
        """The worker's prefix-cache changes since the last drain (as the next batch)."""
        return self.worker.engine.drain_kv_events()

    async def mailbox_sizes(self) -> MailboxSizes | None:
        """What the worker's per-router mailboxes hold (None: a prefill worker has none)."""
        if self.role not in STREAMING_ROLES:
            return None
        return self._streaming("mailbox_sizes").mailbox_sizes()

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """Test hook: the worker's next engine step raises or stalls (``EngineLoop``)."""
        self.worker.loop.inject_fault(kind, seconds)

    def stop(self) -> None:
        """Stop the poll thread and the worker."""
        self._poller.shutdown(wait=False, cancel_futures=True)
        self.worker.close()


class LocalHandle(WorkerHandle):
    """A worker in this process as the router named ``router`` reaches it (several routers
    share a decode or colocated worker; each polls its own requests' deltas); one router in a
    process leaves it "". :meth:`for_router` is the same worker as another router reaches
    it."""

    def __init__(self, host: WorkerHost, router: str = ""):
        self.host = host
        self.router = router
        self.worker = host.worker
        self.worker_id = host.worker_id
        self.role = host.role

    def for_router(self, router: str) -> LocalHandle:
        return LocalHandle(self.host, router)

    async def stats(self) -> WorkerStats:
        return await self.host.stats()

    async def abort(self, request_id: str) -> None:
        await self.host.abort(request_id)

    async def reserve(self, request: WorkRequest) -> Reservation:
        return await self.host.reserve(request, self.router)

    async def renew(self, request_id: str) -> float | None:
        return await self.host.renew(request_id)

    async def prefill(self, request: WorkRequest, reservation: Reservation) -> PrefillResult:
        return await self.host.prefill(request, reservation)

    async def submit(self, request: WorkRequest) -> None:
        await self.host.submit(request, self.router)

    async def poll(self, timeout: float) -> StepDeltas:
        return await self.host.poll(timeout, self.router)

    async def kv_snapshot(self) -> KVSnapshot | None:
        return await self.host.kv_snapshot()

    async def drain_kv_events(self) -> KVEvents | None:
        return await self.host.drain_kv_events()

    def close(self) -> None:
        """Stop the worker (for every router's handle of it)."""
        self.host.stop()
