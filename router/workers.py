"""The router's view of its workers: who is there and how loaded, whose streams it polls, and
what a failed call or a lost worker means.

Membership and load come from the directory (``refresh``, every ``stats_interval_s``). A
worker that leaves the registry takes no new requests, but its streams go on until its poll
fails: only a failed poll (the process or its engine loop really died) loses a worker, so
liveness never depends on step time. A failed call on a worker (``suspect``) only keeps new
work away from it until the directory reports stats the worker took after the failure (a
worker whose engine died publishes none; a record written before the failure does not bring
it back). ``wait_ready`` is how a request waits for the workers it needs (start-up, a pool
being replaced): it wakes as soon as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from pdserve.router.config import RouterConfig
from pdserve.router.directory import WorkerDirectory
from pdserve.router.kv_index import KVCapacity, KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import WorkerLoad
from pdserve.worker_api import KVSnapshot, RequestDelta, WorkerHandle, WorkerStats

logger = logging.getLogger(__name__)


class Workers:
    """The workers one router sees; deltas polled from them go to ``route(handle, delta)``
    and a lost worker to ``lost(worker_id, why)``."""

    def __init__(self, directory: WorkerDirectory, config: RouterConfig,
                 metrics: RouterMetrics, route: Callable[[WorkerHandle, RequestDelta], None],
                 lost: Callable[[str, str], None]):
        self.directory = directory
        self._config, self._metrics = config, metrics
        self._route, self._lost = route, lost
        self.loads: dict[str, WorkerLoad] = {}  # workers that take new requests
        self.handles: dict[str, WorkerHandle] = {}  # seen, not lost (its streams may go on)
        self._pollers: dict[str, asyncio.Task] = {}
        self._suspected: dict[str, float] = {}  # worker id -> time.time() a call on it failed
        self._tasks: list[asyncio.Task] = []  # the refresh loop, background aborts
        self._ready = asyncio.Event()  # set while is_ready()
        self.kv_index = KVIndex()  # every worker's prefix cache, from their KV events

    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._refresh_loop()))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._pollers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._pollers.clear()

    def live(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.loads.values() if w.stats.role == role
                and not w.stats.draining and w.stats.error is None]

    def is_ready(self) -> bool:
        """A colocated worker, or a prefill and a decode worker, take new requests."""
        return bool(self.live("colocated")) or bool(self.live("prefill") and self.live("decode"))

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for :meth:`is_ready`; returns it."""
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                pass
        return self.is_ready()

    def _note_readiness(self) -> None:
        if self.is_ready():
            self._ready.set()
        else:
            self._ready.clear()

    async def refresh(self) -> None:
        """Re-read membership and load; start pollers for new streaming workers."""
        snapshot = await self.directory.snapshot()
        seen = set()
        for handle, stats in snapshot:
            seen.add(stats.worker_id)
            self.handles[stats.worker_id] = handle
            if stats.role != "prefill" and stats.worker_id not in self._pollers:
                self._pollers[stats.worker_id] = asyncio.create_task(self._poll(handle))
            self._metrics.set_worker(stats)
            if self._still_suspected(stats):
                continue
            load = self.loads.get(stats.worker_id)
            if load is None:
                self.loads[stats.worker_id] = WorkerLoad(stats)
            else:
                load.refresh(stats)
        for worker_id in set(self._suspected) - seen:
            del self._suspected[worker_id]
        for worker_id in set(self.loads) - seen:  # no new work; its streams go on
            logger.info("worker %s left the registry: no new requests go to it", worker_id)
            self._metrics.remove_worker(self.loads.pop(worker_id).stats.role, worker_id)
        self._note_readiness()
        await self._refresh_kv_index(snapshot)

    async def _refresh_kv_index(self,
                                workers: Sequence[tuple[WorkerHandle, WorkerStats]]) -> None:
        """Apply the workers' new KV event batches to the index (every role caches prefixes:
        a decode worker's hits are blocks it is not sent); a worker whose entry missed a batch
        (or that is new to it) is resynced from a snapshot it sends."""
        index = self.kv_index
        ids = [stats.worker_id for _, stats in workers]
        for worker_id in set(index.worker_ids) - set(ids):
            index.forget(worker_id)
        capacity = {stats.worker_id: KVCapacity.of(stats) for _, stats in workers}
        for worker_id, events in await self.directory.kv_events(ids):
            index.apply(worker_id, events, capacity.get(worker_id))
        for _, stats in workers:
            index.note_latest(stats.worker_id, stats.kv_log_id, stats.kv_events_number)
        stale = [(handle, stats.worker_id) for handle, stats in workers
                 if stats.kv_log_id and index.needs_snapshot(stats.worker_id)]
        snapshots = await asyncio.gather(*(self._kv_snapshot(handle) for handle, _ in stale),
                                         return_exceptions=True)
        for (_, worker_id), snapshot in zip(stale, snapshots, strict=True):
            if isinstance(snapshot, BaseException):
                logger.info("no KV snapshot from %s yet: %s", worker_id, snapshot)
            elif snapshot is not None:
                index.reset(worker_id, snapshot)

    async def _kv_snapshot(self, handle: WorkerHandle) -> KVSnapshot | None:
        return await asyncio.wait_for(handle.kv_snapshot(), self._config.rpc_timeout_s)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.stats_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep routing on the last known view
                logger.exception("worker refresh failed")

    async def abort_on(self, worker_id: str, request_id: str) -> None:
        """Abort ``request_id`` on the worker, bounded by ``rpc_timeout_s``; never raises."""
        handle = self.handles.get(worker_id)
        if handle is None:
            return
        try:
            await asyncio.wait_for(handle.abort(request_id), self._config.rpc_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead worker frees everything anyway
            logger.info("abort of %s on %s failed: %s", request_id, worker_id, exc)

    def abort_later(self, worker_id: str, request_id: str) -> None:
        """Abort in the background (the caller does not wait on that worker)."""
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self.abort_on(worker_id, request_id)))

    def suspect(self, worker_id: str, why: str) -> None:
        """A call on the worker failed: route nothing new to it until the directory reports
        stats it took since (a dead one never comes back; a live one does at the first
        refresh after its next heartbeat)."""
        logger.warning("worker %s: %s", worker_id, why)
        self._suspected[worker_id] = time.time()
        self.loads.pop(worker_id, None)
        self._note_readiness()

    def _still_suspected(self, stats: WorkerStats) -> bool:
        """Whether ``stats`` are older than the failed call that made their worker suspect
        (stats of unknown age, ``taken_at`` 0, clear it)."""
        suspected_at = self._suspected.get(stats.worker_id)
        if suspected_at is None:
            return False
        if stats.taken_at and stats.taken_at <= suspected_at:
            return True
        del self._suspected[stats.worker_id]
        return False

    async def _poll(self, handle: WorkerHandle) -> None:
        while True:
            try:
                deltas = await handle.poll(self._config.poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the worker is gone
                self._worker_lost(handle.worker_id, f"poll failed: {exc}")
                return
            for delta in deltas:
                self._route(handle, delta)

    def _worker_lost(self, worker_id: str, why: str) -> None:
        logger.warning("worker %s lost: %s", worker_id, why)
        self._suspected.pop(worker_id, None)
        load = self.loads.pop(worker_id, None)
        self.handles.pop(worker_id, None)
        if load is not None:
            self._metrics.remove_worker(load.stats.role, worker_id)
        self._note_readiness()
        poller = self._pollers.pop(worker_id, None)
        if poller is not None and poller is not asyncio.current_task():
            poller.cancel()
        self._lost(worker_id, why)
