"""Where the router learns which workers exist and how loaded they are."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from pdserve.worker_api import KVEvents, WorkerHandle, WorkerStats

logger = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    async def snapshot(self) -> Sequence[tuple[WorkerHandle, WorkerStats]]:
        """(handle, latest stats) of every live worker."""
        ...

    async def kv_events(self, worker_ids: list[str]) -> list[tuple[str, KVEvents]]:
        """The KV event batches these workers published since the last call, in order per
        worker (what was lost on the way shows as a gap in their numbers)."""
        ...


class StaticDirectory:
    """A fixed set of handles whose stats are asked for directly (in-process, tests)."""

    def __init__(self, handles: Iterable[WorkerHandle], timeout_s: float = 5.0):
        self.handles = list(handles)
        self.timeout_s = timeout_s

    async def snapshot(self) -> list[tuple[WorkerHandle, WorkerStats]]:
        results = await asyncio.gather(
            *(asyncio.wait_for(h.stats(), self.timeout_s) for h in self.handles),
            return_exceptions=True)
        live: list[tuple[WorkerHandle, WorkerStats]] = []
        for handle, stats in zip(self.handles, results, strict=True):
            if isinstance(stats, BaseException):
                logger.warning("worker %s did not answer stats: %s", handle.worker_id, stats)
            else:
                live.append((handle, stats))
        return live

    async def kv_events(self, worker_ids: list[str]) -> list[tuple[str, KVEvents]]:
        """Each worker's batch drained from its engine in this process (a second router of
        the same process drains its own share: the index of each sees gaps and resyncs)."""
        wanted, batches = set(worker_ids), []
        for handle in self.handles:
            if handle.worker_id in wanted:
                events = await handle.drain_kv_events()
                if events is not None:
                    batches.append((handle.worker_id, events))
        return batches
